"""16-bit accuracy beside FlashAttention-2: random problems, every method judged by one strict rule.

    python -m cupyflash bench --accuracy [--problems 3000] [--seed N] [--workers 8]

Each random plain problem (float16 or bfloat16; batch 1-3, heads 1-4; head_dim a multiple of 8 up
to 256, where PyTorch's FlashAttention-2 backend runs too; seqlen_q and seqlen_k 1-2100,
log-uniform; causal or not) runs forward and backward through cupyflash and through PyTorch SDPA's
FlashAttention-2 backend. Each output (out, dq, dk, dv) is compared with the float64 result (PyTorch,
autograd on the GPU), and exceeds the rule where its max |error| > 2 x that of the same computation
done in the input precision + 1e-4. That baseline is flash-attn's tests' `attention_ref` without
upcasting: scores in the input dtype, softmax in float32 rounded back, gradients by autograd. Causal
masks: cupyflash's aligns the last query with the last key, SDPA's the first with the first; each
method is judged against references with its own mask. Writes every problem's errors to
<device>-<date>-accuracy.csv and prints how often each method exceeded the rule, per output.
"""

from __future__ import annotations

import csv
import math
import multiprocessing
import os
import secrets

import numpy

from cupyflash import arguments
from cupyflash.bench import common

OUTPUTS = ("out", "dq", "dk", "dv")
METHODS = ("cupyflash", "torch-flash")


def parser() -> arguments.Parser:
    ap = arguments.Parser("python -m cupyflash bench --accuracy", __doc__)
    ap.add_argument("--problems", type=arguments.positive_int, default=3000, help="random problems")
    ap.add_argument("--seed", type=arguments.count, help="the problems' seed (default: a fresh one, printed)")
    ap.add_argument("--workers", type=arguments.positive_int, default=min(8, os.cpu_count() or 1),
                    help="processes sharing the GPU (the first calls of each compile kernels)")
    ap.add_argument("--max-seqlen", type=arguments.positive_int, default=2100, help="the longest seqlen_q or seqlen_k")
    ap.add_argument("--out", default=str(common.RESULTS), help="the folder for the result files")
    return ap


def draw(rng: numpy.random.Generator, max_seqlen: int) -> dict:
    def seqlen():
        return int(min(max_seqlen, math.floor(math.exp(rng.uniform(0.0, math.log(max_seqlen + 1))))))

    return {"dtype": str(rng.choice(["float16", "bfloat16"])), "batch": int(rng.integers(1, 4)),
            "heads": int(rng.integers(1, 5)), "head_dim": int(8 * rng.integers(1, 33)), "seqlen_q": seqlen(),
            "seqlen_k": seqlen(), "causal": bool(rng.integers(0, 2)), "seed": int(rng.integers(2**31))}


def _visible(torch, sq: int, sk: int, causal: bool, bottom_right: bool, device):
    """The (sq, sk) boolean mask of visible keys (None: all)."""
    if not causal:
        return None
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq if bottom_right else 0)


def _attention(torch, q, k, v, visible, upcast: bool):
    """(batch, seq, heads, d) attention as flash-attn's tests' attention_ref: in float64 (upcast),
    or in the inputs' dtype with the softmax in float32."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if visible is not None:  # a row with no visible key keeps its scores, then gets zero weights (not NaN)
        seen = visible.any(-1, keepdim=True)
        scores = scores.masked_fill(~visible & seen, float("-inf"))
    probs = torch.softmax(scores.float() if not upcast else scores, dim=-1)
    if visible is not None:
        probs = probs.masked_fill(~seen, 0.0)
    return torch.einsum("bhts,bshd->bthd", probs.to(v.dtype), v)


def _forward_backward(torch, fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _cupyflash(torch, q, k, v, dout, causal):
    import cupy

    import cupyflash

    cq, ck, cv, cdo = (cupy.from_dlpack(x.detach().contiguous()) for x in (q, k, v, dout))
    out, lse = cupyflash.attention(cq, ck, cv, causal=causal, return_lse=True)
    grads = cupyflash.attention_backward(cdo, cq, ck, cv, out, lse, causal=causal)
    return [torch.from_dlpack(x) for x in (out, *grads)]


def _torch_flash(torch, q, k, v, dout, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    return _forward_backward(torch, fn, q, k, v, dout)


def run_problem(torch, pr: dict) -> dict:
    dt = getattr(torch, pr["dtype"])
    gen = torch.Generator(device="cuda").manual_seed(pr["seed"])
    shape_q = (pr["batch"], pr["seqlen_q"], pr["heads"], pr["head_dim"])
    shape_k = (pr["batch"], pr["seqlen_k"], pr["heads"], pr["head_dim"])
    q, dout = (torch.randn(shape_q, device="cuda", generator=gen).to(dt) for _ in range(2))
    k, v = (torch.randn(shape_k, device="cuda", generator=gen).to(dt) for _ in range(2))
    row = dict(pr)
    references = {}
    for method, run, bottom_right in (("cupyflash", _cupyflash, True), ("torch-flash", _torch_flash, False)):
        visible = _visible(torch, pr["seqlen_q"], pr["seqlen_k"], pr["causal"], bottom_right, q.device)
        key = None if visible is None or pr["seqlen_q"] == pr["seqlen_k"] else bottom_right
        if key not in references:
            exact = _forward_backward(torch, lambda a, b, c: _attention(torch, a, b, c, visible, True),
                                      *(x.double() for x in (q, k, v, dout)))
            lowp = _forward_backward(torch, lambda a, b, c: _attention(torch, a, b, c, visible, False), q, k, v, dout)
            references[key] = exact, [(x.double() - e).abs().max().item() for x, e in zip(lowp, exact)]
        exact, lowp_err = references[key]
        try:
            got = run(torch, q, k, v, dout, pr["causal"])
        except RuntimeError as e:  # SDPA's flash backend declines some problems (causal, seqlen_q != seqlen_k)
            if method == "cupyflash" or "No available kernel" not in str(e):
                raise
            row[f"{method}_declined"] = str(e)
            continue
        for name, x, e, base in zip(OUTPUTS, got, exact, lowp_err):
            err = (x.double() - e).abs().max().item()
            row[f"{method}_{name}"] = err
            row[f"{method}_{name}_ratio"] = err / (2.0 * base + 1e-4)
        for name, base in zip(OUTPUTS, lowp_err):
            row[f"{method}_{name}_baseline"] = base
    return row


def _worker(problems):
    import torch

    rows = []
    for pr in problems:
        try:
            rows.append(run_problem(torch, pr))
        except Exception as e:  # a method that cannot run the problem is reported, not skipped silently
            rows.append({**pr, "error": f"{type(e).__name__}: {e}"})
    return rows


def main(args) -> int:
    seed = secrets.randbits(31) if args.seed is None else args.seed
    rng = numpy.random.default_rng(seed)
    problems = [draw(rng, args.max_seqlen) for _ in range(args.problems)]
    _, _, device, date, stem = common.start_run("accuracy")
    print(f"# {device}; seed {seed}; {len(problems)} problems; {args.workers} workers", flush=True)
    chunks = [problems[w::args.workers] for w in range(args.workers)]
    if args.workers == 1:
        rows = _worker(chunks[0])
    else:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            rows = [r for part in pool.map(_worker, chunks) for r in part]
    errors = [r for r in rows if "error" in r]
    ran = [r for r in rows if "error" not in r]
    done = [r for r in ran if "torch-flash_out" in r]  # both methods ran
    path = os.path.join(args.out, f"{stem}.csv")
    os.makedirs(args.out, exist_ok=True)
    fields = list(done[0]) if done else list(problems[0])
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields + ["torch-flash_declined", "error", "measured_on"], restval="")
        writer.writeheader()
        tree = common.measured_on("kernels")
        writer.writerows({**row, "measured_on": tree} for row in rows)
    print(f"# wrote {path}")
    for r in errors:
        print(f"# ERROR {r}")
    print(f"\n## {device}: problems over the rule (max |err| > 2 x the input-precision baseline's + 1e-4), "
          f"of {len(done)}")
    print(f"{'method':12} {'any':>5} " + " ".join(f"{n:>5}" for n in OUTPUTS) + "  worst ratio")
    for method in METHODS:
        over = {n: [r for r in done if r[f"{method}_{n}_ratio"] > 1.0] for n in OUTPUTS}
        any_over = sum(any(r[f"{method}_{n}_ratio"] > 1.0 for n in OUTPUTS) for r in done)
        worst = max(((r[f"{method}_{n}_ratio"], n, r) for r in done for n in OUTPUTS), default=(0, "", {}),
                    key=lambda t: t[0])
        shape = {k: worst[2].get(k) for k in ("dtype", "batch", "heads", "head_dim", "seqlen_q", "seqlen_k", "causal")}
        print(f"{method:12} {any_over:>5} " + " ".join(f"{len(over[n]):>5}" for n in OUTPUTS) +
              f"  {worst[0]:.3f} ({worst[1]} {shape})")
    alone = [r for r in ran if "torch-flash_out" not in r]
    over = sum(any(r[f"cupyflash_{n}_ratio"] > 1.0 for n in OUTPUTS) for r in alone)
    print(f"cupyflash alone, on the {len(alone)} problems SDPA's flash backend declined: {over} over the rule")
    return 1 if errors else 0
