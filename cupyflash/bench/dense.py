"""The FlashAttention benchmark grid: cupyflash against its peers, forward and backward.

    python -m cupyflash bench [--dtype bfloat16 --dtype float16] [--head-dim 64 --head-dim 128]
                              [--seqlen 512 ... --seqlen 16384] [--extra-head-dim 32 ...] [--flex]
                              [--out benchmarks/results]
    (python -m cupyflash bench --help lists the other grids: --sparse, --decode, --varlen, --variants,
    --host)

The grid is FlashAttention's: batch x seqlen = 16384 tokens, hidden 2048 (heads = 2048 / head_dim),
causal and not. For each problem, on the same inputs (random normal, never zeros):
  1. correctness: out, dq, dk, dv of (batch 0, head 0) against float64 standard attention on the GPU;
     the bound is the tolerance rule (2x the error of the same computation in the input precision,
     here PyTorch's flash backend for 16-bit inputs, otherwise standard attention, plus a noise floor);
  2. timing: CUDA events around batches of back-to-back calls after warm-up (GPU time per call,
     with Python's launch overhead hidden behind the GPU work, as in a training loop), the median
     of many batches, for
     cupyflash (the public attention / attention_backward on CuPy arrays; for float32 also at
     precisions "high" (3xTF32) and "medium" (TF32) beside the default "highest", each checked as
     in 1. with its errors in the CSV's check column, reported but not failing the run: neither
     is held to the float32 rule), PyTorch SDPA's
     flash (FlashAttention-2), cuDNN and mem-efficient backends (and math for float32 and float64:
     flash and cuDNN take only 16-bit inputs), FlexAttention (with --flex; compiled once per
     shape), and standard CuPy attention (its backward time is forward+backward minus forward;
     skipped where its seqlen x seqlen matrices do not fit in free memory).
FLOPs: forward 4·b·h·s_q·s_k·d, halved for causal; backward 2.5x forward. A peer that is not
installed or not supported here is named as skipped; any other exception stops the run.
Writes <device>-<date>-bench.csv and .png under --out and prints the table last.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import numpy

from cupyflash import arguments
from cupyflash.bench import common
from cupyflash.bench.common import TORCH_BACKENDS


@dataclasses.dataclass(frozen=True)
class Problem:
    dtype: str
    head_dim: int
    seqlen: int
    causal: bool
    tokens: int = 16384
    hidden: int = 2048

    @property
    def batch(self) -> int:
        return max(1, self.tokens // self.seqlen)

    @property
    def heads(self) -> int:
        return max(1, self.hidden // self.head_dim)

    def flops(self, direction: str) -> float:
        from cupyflash import standard

        f = standard.flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal)
        return f * (standard.BACKWARD_FLOPS_RATIO if direction == "bwd" else 1.0)


def parser() -> arguments.Parser:
    ap = arguments.Parser("python -m cupyflash bench", __doc__)
    ap.add_argument("--dtype", action="append", choices=["bfloat16", "float16", "float32", "float64"],
                    help="repeatable (default: bfloat16 and float16; float32 and float64 add SDPA's math backend)")
    ap.add_argument("--head-dim", type=arguments.head_dim, action="append",
                    help="the main grid's head dims, repeatable (default: 64 and 128)")
    ap.add_argument("--seqlen", type=arguments.positive_int, action="append",
                    help="repeatable (default: 512, 1024, 2048, 4096, 8192, 16384)")
    ap.add_argument("--extra-head-dim", type=arguments.head_dim, action="append",
                    help="head dims also reported in bfloat16 at seqlen 2048, 8192, 16384, repeatable (default: 32, "
                         "96, 256)")
    ap.add_argument("--no-extra", action="store_true", help="leave the extra head dims out")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both", help="causal problems, others, or both")
    ap.add_argument("--flex", action="store_true", help="also time FlexAttention (torch.compile per shape: slow)")
    ap.add_argument("--max-seconds", type=arguments.positive_float, default=0.3,
                    help="timing budget per measurement, seconds")
    ap.add_argument("--out", type=pathlib.Path, default=common.RESULTS, help="the folder for the result files")
    return ap


def problems(args) -> list[Problem]:
    dtypes = args.dtype or ["bfloat16", "float16"]
    dims = args.head_dim or [64, 128]
    seqlens = args.seqlen or [512, 1024, 2048, 4096, 8192, 16384]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    grid = [Problem(t, d, s, c) for t in dtypes for d in dims for c in causals for s in seqlens]
    if not args.no_extra:
        extra_seqlens = [s for s in (2048, 8192, 16384) if not args.seqlen or s in args.seqlen]
        for d in args.extra_head_dim or [32, 96, 256]:
            grid += [Problem("bfloat16", d, s, c) for c in causals for s in extra_seqlens]
    return grid


# --------------------------------------------------------------------------- peers


def time_torch_sdpa(peers, backend, pr, q, k, v, dout, max_seconds):
    """(fwd ms, bwd ms) or a reason string."""
    torch = peers.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "math" and (why := _materialised_too_big(pr)):
        return why
    tq, tk, tv = (common.torch_view(x).detach().requires_grad_() for x in (q, k, v))
    tdo = common.torch_view(dout)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(getattr(SDPBackend, {**TORCH_BACKENDS, **WIDE_BACKENDS}[backend])):
        try:
            out = sdpa(tq, tk, tv, is_causal=pr.causal)
        except RuntimeError as e:  # the backend does not support this problem here
            return f"not supported: {str(e).splitlines()[0][:80]}"
        fwd = common.median_ms(lambda: sdpa(tq, tk, tv, is_causal=pr.causal), max_seconds)
        bwd = common.median_ms(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True), max_seconds)
    return fwd, bwd


def checked_run(pr, q, k, v, dout, peers):
    """(passed, message, out, lse): cupyflash's forward and backward in the float32 precision in
    effect, checked (check)."""
    import cupyflash

    out, lse = cupyflash.attention(q, k, v, causal=pr.causal, return_lse=True)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=pr.causal)
    ok, message = check(pr, q, k, v, dout, out, grads, peers)
    return ok, message, out, lse


def time_cupyflash(pr, q, k, v, dout, out, lse, max_seconds):
    """(fwd ms, bwd ms) of the public calls, in the float32 precision in effect."""
    import cupyflash

    fwd = common.median_ms(lambda: cupyflash.attention(q, k, v, causal=pr.causal, return_lse=True), max_seconds)
    bwd = common.median_ms(lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, causal=pr.causal),
                           max_seconds)
    return fwd, bwd


def time_flex(peers, pr, q, k, v, dout, max_seconds):
    torch = peers.torch
    flex_attention, create_block_mask = peers.flex
    tq, tk, tv = (common.torch_view(x).detach().requires_grad_() for x in (q, k, v))
    tdo = common.torch_view(dout)
    mask = None
    if pr.causal:
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, pr.seqlen, pr.seqlen)
    try:
        out = flex_attention(tq, tk, tv, block_mask=mask)
    except RuntimeError as e:  # torch.compile's errors (Triton's float64 products, for one) are RuntimeErrors
        return f"not supported: {str(e).splitlines()[0][:80]}"
    fwd = common.median_ms(lambda: flex_attention(tq, tk, tv, block_mask=mask), max_seconds)
    bwd = common.median_ms(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True), max_seconds)
    return fwd, bwd


# SDPA's backend for float32 and float64 beside the memory-efficient one (the only other that takes
# them): PyTorch's math, cuBLAS products on the materialised score matrix.
WIDE_BACKENDS = {"math": "MATH"}


def _materialised_too_big(pr) -> str | None:
    """Why attention that holds the (seqlen, seqlen) matrices cannot run here (None: it can)."""
    import cupy

    # P and dS per head in the input precision (float32 for 16-bit), plus the scores: about 4
    # elements of 4 bytes per score at peak, twice that in float64.
    need = (32 if pr.dtype == "float64" else 16) * pr.batch * pr.heads * pr.seqlen**2
    # Both pools' cached blocks back to the device first: each sees only its own, and torch's cache
    # from the SDPA rows before left "22 GiB free" of an H200's 139 to CuPy.
    cupy.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    free = cupy.cuda.Device().mem_info[0]
    if need > 0.8 * free:
        return f"skipped: needs ~{need / 2**30:.0f} GiB for seqlen x seqlen matrices, {free / 2**30:.0f} GiB free"
    return None


def time_standard(pr, q, k, v, dout, max_seconds):
    import cupy

    from cupyflash import standard

    if why := _materialised_too_big(pr):
        return why
    fwd = common.median_ms(lambda: standard.standard_attention(q, k, v, causal=pr.causal), max_seconds)
    both = common.median_ms(lambda: standard.standard_attention_forward_backward(q, k, v, dout, causal=pr.causal), max_seconds)
    cupy.get_default_memory_pool().free_all_blocks()
    return fwd, both - fwd


# --------------------------------------------------------------------------- correctness


def check(pr, q, k, v, dout, out, grads, peers):
    """Max errors of cupyflash and of the in-precision baseline on (batch 0, head 0) against float64
    standard attention; returns (passed, message)."""
    import cupy

    from cupyflash import standard

    def head(x):
        return cupy.ascontiguousarray(x[:1, :, :1])

    exact_out, exact_grads = standard.standard_attention_forward_backward(
        *(head(x).astype(numpy.float64) for x in (q, k, v, dout)), causal=pr.causal
    )
    ours = [head(out)] + [head(g) for g in grads]
    exact = [exact_out] + list(exact_grads)
    if peers.torch is not None and pr.dtype in ("float16", "bfloat16"):
        torch = peers.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tq, tk, tv = (common.torch_view(head(x)).detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            tout = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=pr.causal)
            tgrads = torch.autograd.grad(tout, (tq, tk, tv), common.torch_view(head(dout)))
        baseline = [cupy.from_dlpack(t.detach().transpose(1, 2).contiguous()) for t in (tout, *tgrads)]
        baseline_name = "torch flash backend"
    else:
        b_out, b_grads = standard.standard_attention_forward_backward(*(head(x) for x in (q, k, v, dout)), causal=pr.causal)
        baseline = [b_out, *b_grads]
        baseline_name = "standard attention"
    ok, scores = common.within_bounds(zip(("out", "dq", "dk", "dv"), ours, exact, baseline), pr.dtype)
    return ok, f"err/bound vs {baseline_name}: {scores}"


# --------------------------------------------------------------------------- the run


def main(args) -> int:
    matplotlib, tqdm, device, date, stem = common.start_run("bench")
    import cupy

    import cupyflash
    from cupyflash.validation import BFLOAT16

    peers = common.Peers(args.flex)
    rows, failures = [], []
    grid = problems(args)
    print(f"# {device}; cupyflash {cupyflash.__version__}; {len(grid)} problems", flush=True)
    for name, reason in peers.skipped.items():
        print(f"# peer {name}: {reason}", flush=True)

    for pr in tqdm(grid, desc="bench", file=sys.stderr):
        dt = BFLOAT16 if pr.dtype == "bfloat16" else numpy.dtype(pr.dtype)
        rs = cupy.random.default_rng(abs(hash(pr)) % 2**32)
        shape = (pr.batch, pr.seqlen, pr.heads, pr.head_dim)
        q, k, v, dout = (rs.standard_normal(shape, dtype=numpy.float32).astype(dt) for _ in range(4))
        ok, message, out, lse = checked_run(pr, q, k, v, dout, peers)
        if not ok:
            failures.append(f"{pr}: {message}")
        timings = {"cupyflash": time_cupyflash(pr, q, k, v, dout, out, lse, args.max_seconds)}
        checks = {"cupyflash": ("PASS " if ok else "FAIL ") + message}
        if pr.dtype == "float32":  # float32's other precisions (cupyflash.set_float32_precision)
            for precision in ("high", "medium"):
                with cupyflash.float32_precision(precision):
                    ok_p, message_p, out_p, lse_p = checked_run(pr, q, k, v, dout, peers)
                    checks[f"cupyflash-{precision}"] = ("PASS " if ok_p else "over ") + message_p
                    timings[f"cupyflash-{precision}"] = time_cupyflash(pr, q, k, v, dout, out_p, lse_p,
                                                                       args.max_seconds)
                    del out_p, lse_p
        if peers.torch is not None:
            for backend in [*TORCH_BACKENDS, *(WIDE_BACKENDS if pr.dtype in ("float32", "float64") else ())]:
                timings[f"torch-{backend}"] = time_torch_sdpa(peers, backend, pr, q, k, v, dout, args.max_seconds)
        if peers.flex is not None:
            timings["flex"] = time_flex(peers, pr, q, k, v, dout, args.max_seconds)
        timings["standard"] = time_standard(pr, q, k, v, dout, args.max_seconds)
        for method, t in timings.items():
            for i, direction in enumerate(("fwd", "bwd")):
                ms = t[i] if isinstance(t, tuple) else None
                rows.append({
                    "device": device, "date": date, "dtype": pr.dtype, "head_dim": pr.head_dim, "heads": pr.heads,
                    "batch": pr.batch, "seqlen": pr.seqlen, "causal": pr.causal, "direction": direction,
                    "method": method, "median_ms": f"{ms:.4f}" if ms else "",
                    "tflops": f"{pr.flops(direction) / ms / 1e9:.1f}" if ms else "",
                    "note": "" if ms else t, "check": checks.get(method, ""),
                })
        del q, k, v, dout, out, lse
        cupy.get_default_memory_pool().free_all_blocks()

    return common.finish(rows, failures, len(grid), args.out / stem, device, plot, print_table, matplotlib)


def _key(r):
    return (r["dtype"], int(r["head_dim"]), r["causal"] in (True, "True"), int(r["seqlen"]))


def print_table(rows, device):
    """TFLOP/s of cupyflash and its ratio to every peer, per problem and direction."""
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "cupyflash"]
    by = {(_key(r), r["direction"], r["method"]): r for r in rows}
    print(f"\n## {device}: cupyflash TFLOP/s and speed ratio (peer time / cupyflash time; >1 = cupyflash faster)")
    header = f"{'dtype':8} {'d':>3} {'causal':6} {'seqlen':>6} {'dir':3} {'cupyflash':>9}"
    header += "".join(f" {m:>15}" for m in methods)
    print(header)
    for key in sorted({_key(r) for r in rows}):
        for direction in ("fwd", "bwd"):
            ours = by[(key, direction, "cupyflash")]
            line = f"{key[0]:8} {key[1]:3d} {str(key[2]):6} {key[3]:6d} {direction:3} {ours['tflops']:>9}"
            for m in methods:
                r = by.get((key, direction, m))
                if r is None or not r["median_ms"]:
                    line += f" {'-':>15}"
                else:
                    ratio = float(r["median_ms"]) / float(ours["median_ms"])
                    line += f" {r['tflops']:>7}/{ratio:5.2f}x "
            print(line)
    reasons = {(r["method"], r["note"]) for r in rows if not r["median_ms"]}
    for method, note in sorted(reasons):  # why a peer shows "-": never dropped silently
        problems = sum(1 for r in rows if r["method"] == method and r["note"] == note) // 2
        print(f"# {method} untimed on {problems} problems: {note}")


def plot(rows, path, device, matplotlib):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dtype"], int(r["head_dim"]), r["causal"] in (True, "True")) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows if r["tflops"]))  # timed at least once
    color = {m: f"C{i % 10}" for i, m in enumerate(methods)}  # one color a method in every panel
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 2.8 * len(panels)), squeeze=False)
    for (dtype, d, causal), ax_row in zip(panels, axes):
        for direction, ax in zip(("fwd", "bwd"), ax_row):
            for method in methods:
                pts = sorted(
                    (int(r["seqlen"]), float(r["tflops"]))
                    for r in rows
                    if (r["dtype"], int(r["head_dim"]), r["causal"] in (True, "True")) == (dtype, d, causal)
                    and r["direction"] == direction and r["method"] == method and r["tflops"]
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=color[method],
                            linewidth=2.5 if method == "cupyflash" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{direction} {dtype} d{d}{' causal' if causal else ''}", fontsize=9)
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=color[m], marker="o", label=m) for m in methods]
    fig.legend(handles=handles, loc="upper right", fontsize=8)
    fig.suptitle(f"cupyflash vs peers on {device} (16k tokens, hidden 2048)")
    fig.tight_layout(rect=(0, 0, 0.84, 1 - 0.4 / fig.get_figheight()))
    fig.savefig(path, dpi=110)

