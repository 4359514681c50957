"""The NumPy fallback beside plain NumPy attention, on a machine without a GPU or with one.

    python -m cupyflash bench --cpu [--seqlen 2048 --heads 8 --head-dim 64 --dtype float32]

For causal and not: cupyflash.attention's CPU fallback (cpu/fallback.py: what a call on NumPy
arrays runs where there is no GPU, and here whether or not there is one) and the attention a NumPy
user writes (scores with `@`, which is BLAS, a softmax, `@` again), timed in the same process
(median of --repeat calls), with each one's peak memory (tracemalloc: the arrays NumPy allocates)
and max error against the float64 reference. The plain version holds every score; the fallback a
tile of them. The fallback's forward + backward is timed too (plain attention has no backward)."""

from __future__ import annotations

import time
import tracemalloc

import numpy

from cupyflash import arguments
from cupyflash.bench import common


def parser() -> arguments.Parser:
    ap = arguments.Parser("python -m cupyflash bench --cpu", __doc__)
    ap.add_argument("--batch", type=arguments.positive_int, default=1, help="batch size")
    ap.add_argument("--seqlen", type=arguments.positive_int, default=2048, help="seqlen_q and seqlen_k")
    ap.add_argument("--heads", type=arguments.positive_int, default=8, help="heads")
    ap.add_argument("--head-dim", type=arguments.head_dim, default=64, help="head_dim")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="the inputs' dtype")
    ap.add_argument("--repeat", type=arguments.positive_int, default=5, help="timed calls of each, the median reported")
    return ap


def plain_attention(q, k, v, causal: bool):
    """Attention as written with NumPy: (batch, seq, heads, head_dim) in and out, every score held."""
    scores = (q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)) * q.dtype.type(q.shape[-1] ** -0.5)
    if causal:
        scores[..., numpy.triu(numpy.ones(scores.shape[-2:], bool), scores.shape[-1] - scores.shape[-2] + 1)] = -numpy.inf
    scores = numpy.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    return (scores @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def _measure(fn, repeat: int) -> tuple:
    """(median seconds, peak bytes allocated during one call, the call's result)."""
    result = fn()
    tracemalloc.start()
    result = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(numpy.median(times)), peak, result


def _fallback(direction: str, given: dict, causal: bool):
    """A call's checks, then the CPU fallback, as `cupyflash.attention` (or its backward) runs them
    without a GPU."""
    from cupyflash.api import common
    from cupyflash.cpu import fallback
    from cupyflash.problem import Options

    arrays, origins = common.ingest(given)
    p = common.checked_problem(direction, arrays, origins, Options(causal=causal, return_lse=True))
    run = fallback.forward if direction == "forward" else fallback.backward
    return run(*arrays.values(), p)


def main(args) -> int:
    from cupyflash import reference

    dtype = numpy.dtype(args.dtype)
    rng = numpy.random.default_rng(0)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v, dout = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    print(f"# measured on {common.measured_on('cupyflash/cpu')}")
    print(f"# CPU: batch {args.batch}, seqlen {args.seqlen}, heads {args.heads}, head_dim {args.head_dim}, "
          f"{args.dtype}; median of {args.repeat} calls; peak: NumPy's allocations during one call")
    print(f"{'causal':6} {'method':34} {'time ms':>9} {'x plain':>8} {'peak MB':>8} {'max |error|':>12}")
    for causal in (False, True):
        exact = reference.attention(q, k, v, causal=causal)
        plain = _measure(lambda: plain_attention(q, k, v, causal), args.repeat)
        rows = {
            "numpy @ + softmax (plain)": plain,
            "cupyflash fallback": _measure(lambda: _fallback("forward", {"q": q, "k": k, "v": v}, causal),
                                           args.repeat),
        }
        for name, (seconds, peak, out) in rows.items():
            out = out[0] if isinstance(out, tuple) else out
            error = float(numpy.abs(out - exact).max())
            print(f"{causal!s:6} {name:34} {seconds * 1e3:9.1f} {seconds / plain[0]:8.2f} {peak / 2**20:8.1f} "
                  f"{error:12.2e}")

        def forward_backward():
            out, lse = _fallback("forward", {"q": q, "k": k, "v": v}, causal)
            return _fallback("backward", dict(zip(("dout", "q", "k", "v", "out", "lse"), (dout, q, k, v, out, lse))),
                             causal)

        seconds, peak, _ = _measure(forward_backward, args.repeat)
        print(f"{causal!s:6} {'cupyflash fallback fwd + bwd':34} {seconds * 1e3:9.1f} {seconds / plain[0]:8.2f} "
              f"{peak / 2**20:8.1f} {'':>12}")
    return 0
