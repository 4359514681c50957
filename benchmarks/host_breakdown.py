"""Where a call's host time goes, stage by stage, a development tool.

    python benchmarks/host_breakdown.py [--calls 2000]

For a tiny problem (batch 1, seqlen 128, 2 heads, head_dim 128, bfloat16: the GPU's work is a few
microseconds, so back-to-back calls run at the host's pace) and for the sparse grid's d64 random
0.1 row at seqlen 4096, it prints per call, in microseconds:
  wall     back-to-back calls' wall time (the host's time per call where the host is the slower);
  stages   each listed function's inclusive time per call, measured by wrapping it with a
           perf_counter pair (about 0.3 us a wrap, which the enclosing stages carry too).
cProfile inflates Python calls several-fold and shifts the balance between them; this does not.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# (module, function) pairs timed inclusively; the name is looked up on the module at each call,
# so patching the module attribute catches every caller.
STAGES = [
    ("_attention", "_ingest_arrays"),
    ("_validation", "check_attention_args"),
    ("_validation", "check_backward_args"),
    ("_validation", "check_alibi_slopes"),
    ("_validation", "check_block_mask"),
    ("_validation", "check_seqlens_k"),
    ("_validation", "check_dropout"),
    ("_attention", "_forward_gpu"),
    ("_attention", "_backward_gpu"),
    ("_attention", "_empty"),
    ("_attention", "launch_forward"),
    ("_attention", "launch_backward"),
    ("_attention", "forward_kernel"),
    ("_attention", "backward_kernels"),
    ("_attention", "_pointer_and_strides"),
    ("_attention", "_problem_fields"),
    ("_attention", "_params"),
    ("_attention", "zeroed_counters"),
    ("_tma", "fwd_ws_tensor_maps"),
    ("_tma", "kv_tensor_maps"),
    ("_tma", "bwd_tensor_maps"),
    ("_attention", "_launch"),
    ("_compile", "get_function"),
    ("_arrays", "export"),
]


def main(argv=None):
    import cupy

    import bench_sparse
    import cupyflash
    from cupyflash._validation import BFLOAT16

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    rs = cupy.random.default_rng(0)
    problems = {}
    q, k, v, dout = (rs.standard_normal((1, 128, 2, 128), dtype=numpy.float32).astype(BFLOAT16) for _ in range(4))
    problems["tiny"] = (q, k, v, dout, cupyflash.BlockMask(numpy.ones((2, 1, 1), bool)))
    q, k, v, dout = (rs.standard_normal((4, 4096, 32, 64), dtype=numpy.float32).astype(BFLOAT16) for _ in range(4))
    problems["s4096 d64 random 0.1"] = (q, k, v, dout,
                                        bench_sparse.make_mask("random", 0.1, 4096, 32, numpy.random.default_rng(1)))
    for label, (q, k, v, dout, mask) in problems.items():
        out, lse = cupyflash.attention(q, k, v, return_lse=True)
        calls = {
            "attention": lambda: cupyflash.attention(q, k, v, return_lse=True),
            "attention_backward": lambda: cupyflash.attention_backward(dout, q, k, v, out, lse),
            "block_sparse fwd": lambda: cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True),
            "block_sparse bwd": lambda: cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask),
        }
        if label != "tiny":
            calls = {name: fn for name, fn in calls.items() if name.startswith("block_sparse")}
        for name, fn in calls.items():
            calls_n = args.calls if label == "tiny" else 200
            wall = _wall(cupy, fn, calls_n)
            totals, counts = _staged(cupy, fn, calls_n)
            print(f"\n{label}: {name}: wall {wall:.1f} us per call")
            for stage, total in sorted(totals.items(), key=lambda kv: -kv[1]):
                print(f"  {stage:34} {total / calls_n * 1e6:7.1f} us  ({counts[stage] / calls_n:g} a call)")
    return 0


def _wall(cupy, fn, n: int) -> float:
    fn()
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    cupy.cuda.Device().synchronize()
    return elapsed / n * 1e6


def _staged(cupy, fn, n: int):
    import importlib

    totals: dict = {}
    counts: dict = {}
    saved = []
    for module_name, name in STAGES:
        module = importlib.import_module(f"cupyflash.{module_name}")
        original = getattr(module, name)
        saved.append((module, name, original))
        setattr(module, name, _timed(original, f"{module_name}.{name}", totals, counts))
    try:
        fn()
        cupy.cuda.Device().synchronize()
        totals.clear()
        counts.clear()
        for _ in range(n):
            fn()
        cupy.cuda.Device().synchronize()
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
    return totals, counts


def _timed(function, label: str, totals: dict, counts: dict):
    clock = time.perf_counter

    @functools.wraps(function)
    def wrapper(*a, **kw):
        start = clock()
        try:
            return function(*a, **kw)
        finally:
            totals[label] = totals.get(label, 0.0) + clock() - start
            counts[label] = counts.get(label, 0) + 1

    return wrapper


if __name__ == "__main__":
    sys.exit(main())
