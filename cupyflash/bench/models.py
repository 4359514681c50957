"""Real models, end to end: a training step (forward, loss, backward, AdamW) of models built from
configs with random weights (nothing downloaded), with each attention in the same run.

    python -m cupyflash bench --models [--model llama --model bert --model vit] [--seqlen 2048 ...]

Models: "llama", a Llama-style decoder from transformers (6 layers, hidden 1024, 16 heads, 4 K/V
heads, head dim 64), 8192 tokens a batch (or one sequence of seqlen) at each --seqlen; "bert", a
BERT-base encoder (transformers), 16 sequences padded to 512 (real lengths 128-512, seeded: the
padding mask reaches the attention); "vit", ViT-B/16 (timm), 32 images of 224 x 224.

With --curve: a GPT-2-small-style model (12 layers, hidden 768, 12 heads) trained --curve-steps
steps on a fixed synthetic corpus (8 x 1024 tokens a step) with SDPA at two weight seeds and with
cupyflash (from seed 0's weights), the losses overlaid in a PNG; it passes when cupyflash's final
loss differs from SDPA seed 0's by no more than SDPA's two seeds differ.

Attentions: torch's SDPA (its own choice; the FlashAttention-2 and cuDNN backends forced), the
same compiled (torch.compile), flash-attn's flash_attention_2 where flash-attn is installed, and
cupyflash (transformers' attn_implementation "cupy_attention"; timm's calls of SDPA through
`cupyflash.torch.scaled_dot_product_attention`) eager, compiled, and compiled with
mode="reduce-overhead" (CUDA graphs). A model whose library is missing, and an attention a model
cannot take, are named as skipped with the reason; a step that raises is reported failed with its
error. Each row: the median step time, tokens a second, peak memory, and the first step's loss,
which must lie within twice the largest difference between SDPA's own backends (plus 1e-3 of the
loss) of SDPA's (the same weights and batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import pathlib
import statistics
import time

from cupyflash import arguments
from cupyflash.bench import common

MODELS = ("llama", "bert", "vit")
# attention -> (transformers' attn_implementation, SDPA backend forced, torch.compile options or None)
METHODS = {
    "sdpa": ("sdpa", None, None),
    "sdpa-flash": ("sdpa", "FLASH_ATTENTION", None),
    "sdpa-cudnn": ("sdpa", "CUDNN_ATTENTION", None),
    "sdpa-compiled": ("sdpa", None, {}),
    "flash-attn": ("flash_attention_2", None, None),
    "cupyflash": ("cupy_attention", None, None),
    "cupyflash-compiled": ("cupy_attention", None, {}),
    "cupyflash-reduce-overhead": ("cupy_attention", None, {"mode": "reduce-overhead"}),
}
SDPA_METHODS = ("sdpa", "sdpa-flash", "sdpa-cudnn")


class Skip(Exception):
    """An attention this model or machine cannot take, with the reason."""


@dataclasses.dataclass
class Workload:
    name: str
    tokens: int
    build: object  # build(attn_implementation, dtype, device) -> (model, batch dict, loss(model, batch))
    masked: bool = False  # whether SDPA receives an attn_mask (a padded batch)


def parser() -> arguments.Parser:
    ap = arguments.Parser("python -m cupyflash bench --models", __doc__)
    ap.add_argument("--model", action="append", choices=MODELS, help="repeatable (default: all three)")
    ap.add_argument("--seqlen", type=arguments.positive_int, action="append",
                    help="the decoder's sequence lengths, repeatable (default: 2048, 8192, 32768)")
    ap.add_argument("--method", action="append", choices=list(METHODS), help="repeatable (default: all)")
    ap.add_argument("--steps", type=arguments.positive_int, default=10, help="timed training steps per row")
    ap.add_argument("--warmup", type=arguments.positive_int, default=3,
                    help="untimed steps first (compilation, CUDA-graph capture)")
    ap.add_argument("--curve", action="store_true",
                    help="instead of timing: the loss curve of a GPT-2-small-style model trained on a fixed "
                         "synthetic corpus with SDPA (two seeds) and with cupyflash, overlaid in a PNG")
    ap.add_argument("--curve-steps", type=arguments.positive_int, default=300, help="training steps of --curve")
    ap.add_argument("--out", type=pathlib.Path, default=common.RESULTS,
                    help="the folder for the result files")
    return ap


def corpus(steps: int, batch: int, seqlen: int, vocab: int, seed: int = 0):
    """A fixed synthetic corpus a language model can learn: token streams of a seeded sparse Markov
    chain (each token has 4 likely successors), one (batch, seqlen) block of ids per step."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=gen)
    blocks = torch.empty((steps, batch, seqlen), dtype=torch.long)
    state = torch.randint(0, vocab, (steps, batch), generator=gen)
    for t in range(seqlen):
        blocks[:, :, t] = state
        choice = torch.randint(0, 4, (steps, batch), generator=gen)
        state = successors[state, choice]
    return blocks


def loss_curve(impl: str, seed: int, blocks, dtype, device: str, layers: int = 12, hidden: int = 768,
               heads: int = 12, vocab: int = 512) -> list:
    """The training losses of a GPT-2-style model (weights from `seed`) on `blocks`, step by step."""
    import torch
    import transformers

    if impl == "cupy_attention":
        importlib.import_module("cupyflash.transformers")
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=blocks.shape[-1], n_embd=hidden, n_layer=layers,
                                     n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation=impl, dtype=dtype).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    losses = []
    for ids in blocks:
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def curve_verdict(curves: dict, tail: int = 20) -> tuple[bool, str]:
    """Whether cupyflash's final loss (the mean of the last `tail` steps), from SDPA seed 0's
    weights, differs from SDPA seed 0's by no more than SDPA's own seeds differ (at least 1e-3 of
    the loss): the attention's effect within run-to-run variation."""
    finals = {name: sum(c[-tail:]) / len(c[-tail:]) for name, c in curves.items()}
    base = finals["sdpa seed 0"]
    spread = max(abs(finals["sdpa seed 1"] - base), 1e-3 * abs(base))
    difference = finals["cupyflash"] - base
    text = (f"final losses (mean of the last {tail} steps): " + ", ".join(f"{k} {v:.4f}" for k, v in finals.items())
            + f"; cupyflash - SDPA seed 0 {difference:+.4f}, SDPA's seed spread {spread:.4f}")
    return abs(difference) <= spread, text


def curve_main(args) -> int:
    import torch

    matplotlib, _, device, _, stem = common.start_run("loss-curve")
    blocks = corpus(args.curve_steps, batch=8, seqlen=1024, vocab=512)
    curves = {"sdpa seed 0": loss_curve("sdpa", 0, blocks, torch.bfloat16, "cuda"),
              "sdpa seed 1": loss_curve("sdpa", 1, blocks, torch.bfloat16, "cuda"),
              "cupyflash": loss_curve("cupy_attention", 0, blocks, torch.bfloat16, "cuda")}
    ok, text = curve_verdict(curves)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{device}: GPT-2-small-style model, bf16, synthetic corpus")
    ax.legend()
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{stem}.png"
    fig.savefig(path, dpi=120)
    print(f"# wrote {path}\n# {text}\n# {'PASS' if ok else 'FAIL'}: cupyflash's final loss "
          f"{'within' if ok else 'outside'} SDPA's seed spread of SDPA's")
    return 0 if ok else 1


def llama(seqlen: int, tokens: int = 8192, layers: int = 6, hidden: int = 1024, heads: int = 16, kv_heads: int = 4,
          vocab: int = 32000) -> Workload:
    batch = max(1, tokens // seqlen)

    def build(impl, dtype, device):
        import torch
        import transformers

        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=kv_heads, max_position_embeddings=seqlen)
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=impl, dtype=dtype)
        ids = torch.randint(0, vocab, (batch, seqlen), device=device, generator=_generator(device))
        return model.to(device), {"input_ids": ids, "labels": ids}, _transformers_loss

    return Workload(f"llama s{seqlen}", batch * seqlen, build)


def bert(batch: int = 16, seqlen: int = 512, layers: int = 12, hidden: int = 768, heads: int = 12,
         vocab: int = 30522, shortest: int = 128) -> Workload:
    def build(impl, dtype, device):
        import torch
        import transformers

        config = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=heads, intermediate_size=4 * hidden,
                                         max_position_embeddings=seqlen)
        model = transformers.BertForMaskedLM._from_config(config, attn_implementation=impl, dtype=dtype)
        gen = _generator(device)
        ids = torch.randint(0, vocab, (batch, seqlen), device=device, generator=gen)
        lengths = torch.randint(shortest, seqlen + 1, (batch,), device=device, generator=gen)
        mask = (torch.arange(seqlen, device=device) < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        return model.to(device), {"input_ids": ids, "attention_mask": mask, "labels": labels}, _transformers_loss

    return Workload("bert padded", batch * seqlen, build, masked=True)


def vit(batch: int = 32, name: str = "vit_base_patch16_224", image: int = 224) -> Workload:
    def build(impl, dtype, device):
        import timm
        import torch

        if impl not in ("sdpa", "cupy_attention"):
            raise Skip("timm's attention calls SDPA only")
        model = timm.create_model(name, pretrained=False, num_classes=1000, img_size=image).to(device, dtype)
        gen = _generator(device)
        images = torch.randn((batch, 3, image, image), device=device, generator=gen).to(dtype)
        labels = torch.randint(0, 1000, (batch,), device=device, generator=gen)

        def loss(model, inputs):
            with _sdpa_swapped(impl == "cupy_attention"):
                return torch.nn.functional.cross_entropy(model(inputs["images"]).float(), inputs["labels"])

        return model, {"images": images, "labels": labels}, loss

    tokens = (image // 16) ** 2 + 1
    return Workload("vit-b/16", batch * tokens, build)


def _transformers_loss(model, inputs):
    return model(**inputs).loss


def _generator(device):
    import torch

    return torch.Generator(device=device).manual_seed(0)


@contextlib.contextmanager
def _sdpa_swapped(swap: bool):
    """torch.nn.functional.scaled_dot_product_attention set to cupyflash's for the block (timm
    looks it up at each call), as a program that swaps it in does."""
    if not swap:
        yield
        return
    import torch

    import cupyflash.torch

    torch_sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = cupyflash.torch.scaled_dot_product_attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = torch_sdpa


def _backend(name):
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name)])


def run(workload: Workload, method: str, steps: int, warmup: int, dtype, device: str) -> dict:
    """One row: the workload's training step with `method`'s attention, `warmup` untimed steps,
    then `steps` timed ones (CUDA events on a GPU, the wall clock on the CPU)."""
    import torch

    impl, backend, compile_options = METHODS[method]
    if backend == "FLASH_ATTENTION" and workload.masked:
        raise Skip("SDPA's FlashAttention-2 backend takes no attn_mask, which a padded batch needs")
    if impl == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise Skip("flash-attn is not installed")
    if impl == "cupy_attention":
        importlib.import_module("cupyflash.transformers")  # registers it with transformers
    torch.manual_seed(0)  # the same weights for every attention
    model, inputs, loss_fn = workload.build(impl, dtype, device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = torch.compile(lambda m, x: loss_fn(m, x), **compile_options) if compile_options is not None else loss_fn
    cuda = device == "cuda"

    def step():
        loss = forward(model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    times, first_loss = [], None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with _backend(backend):
        for i in range(warmup + steps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                began = time.perf_counter()
            loss = step()
            if first_loss is None:
                first_loss = float(loss.detach())
            if cuda:
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                elapsed = (time.perf_counter() - began) * 1e3
            if i >= warmup:
                times.append(elapsed)
    ms = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return {"model": workload.name, "method": method, "step_ms": round(ms, 3),
            "tokens_per_s": round(workload.tokens / ms * 1e3), "peak_gib": round(peak, 2), "first_loss": first_loss}


def loss_verdicts(rows) -> list[str]:
    """Each row's first loss against SDPA's for its model: within twice the largest difference among
    SDPA's own backends, plus 1e-3 of the loss. Returns the failures."""
    failures = []
    for model in dict.fromkeys(r["model"] for r in rows):
        measured = [r for r in rows if r["model"] == model and r.get("first_loss") is not None]
        peers = [r["first_loss"] for r in measured if r["method"] in SDPA_METHODS]
        if not peers:
            continue
        anchor = next(r["first_loss"] for r in measured if r["method"] in SDPA_METHODS)
        allowed = 2 * (max(peers) - min(peers)) + 1e-3 * abs(anchor)
        for r in measured:
            r["loss_vs_sdpa"] = r["first_loss"] - anchor
            if abs(r["loss_vs_sdpa"]) > allowed:
                failures.append(f"{model} {r['method']}: first loss {r['first_loss']:.6f}, SDPA's {anchor:.6f} "
                                f"(allowed difference {allowed:.2e})")
    return failures


def workloads(models, seqlens) -> list[Workload]:
    chosen = []
    for name in models:
        if name == "llama":
            chosen += [llama(s) for s in seqlens]
        elif name == "bert":
            chosen.append(bert())
        else:
            chosen.append(vit())
    return chosen


def _table(rows, device):
    print(f"\n## {device}: a training step (forward, loss, backward, AdamW), bf16; ratio = SDPA's time / this "
          f"row's (>1 = faster than SDPA)")
    print(f"{'model':14s} {'attention':27s} {'step ms':>9s} {'vs sdpa':>8s} {'tokens/s':>10s} {'peak GiB':>9s} "
          f"{'loss - sdpa':>12s}  note")
    for r in rows:
        base = next((b["step_ms"] for b in rows if b["model"] == r["model"] and b["method"] == "sdpa"
                     and b.get("step_ms")), None)
        if r.get("step_ms"):
            ratio = f"{base / r['step_ms']:.2f}x" if base else "-"
            difference = f"{r['loss_vs_sdpa']:.2e}" if r.get("loss_vs_sdpa") != "" else "-"
            print(f"{r['model']:14s} {r['method']:27s} {r['step_ms']:9.2f} {ratio:>8s} {r['tokens_per_s']:10d} "
                  f"{r['peak_gib']:9.2f} {difference:>12s}")
        else:
            print(f"{r['model']:14s} {r['method']:27s} {'-':>9s} {'-':>8s} {'-':>10s} {'-':>9s} {'-':>12s}  "
                  f"{r['note']}")


def _plot(rows, path, device, matplotlib):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("step_ms")]
    names = list(dict.fromkeys(r["model"] for r in timed))
    methods = list(dict.fromkeys(r["method"] for r in timed))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4))
    width = 0.8 / max(1, len(methods))
    for j, method in enumerate(methods):
        xs = [i + j * width for i, name in enumerate(names)
              if any(r["model"] == name and r["method"] == method for r in timed)]
        ys = [r["step_ms"] for name in names for r in timed if r["model"] == name and r["method"] == method]
        ax.bar(xs, ys, width, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("training step, ms")
    ax.set_title(f"{device}: training step time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> int:
    import torch

    if args.curve:
        return curve_main(args)
    matplotlib, _, device, _, stem = common.start_run("models")
    rows = []
    for workload in workloads(args.model or MODELS, args.seqlen or (2048, 8192, 32768)):
        for method in args.method or METHODS:
            try:
                rows.append(run(workload, method, args.steps, args.warmup, torch.bfloat16, "cuda"))
            except (Skip, ImportError) as e:  # an attention or library this machine lacks
                rows.append({"model": workload.name, "method": method, "note": f"skipped: {e}"})
            except Exception as e:  # reported in the table and the CSV, and the run fails
                rows.append({"model": workload.name, "method": method,
                             "note": f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120]}"})
            finally:
                torch.compiler.reset()
                torch.cuda.empty_cache()
            print(f"# {rows[-1]}", flush=True)
    failures = loss_verdicts(rows) + [f"{r['model']} {r['method']}: {r['note']}" for r in rows
                                      if r.get("note", "").startswith("FAILED")]
    columns = ("model", "method", "step_ms", "tokens_per_s", "peak_gib", "first_loss", "loss_vs_sdpa", "note")
    rows = [{c: r.get(c, "") for c in columns} for r in rows]
    return common.finish(rows, failures, len(rows), args.out / stem, device, _plot, _table, matplotlib)
