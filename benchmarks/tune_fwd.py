"""Sweep tile shapes of the scalar forward kernel on the GPU (a development tool).

    python benchmarks/tune_fwd.py [--dtype float16 --head-dim 128 --seqlen 4096 --batch 4 --heads 16]

Each candidate's output is checked against the float64 reference on (batch 0, head 0) before it
is timed (median of CUDA-event timings). A candidate the traits' static_asserts reject, or whose
shared memory does not fit the device, is reported with the first line of its error; any other
exception stops the sweep.
"""

import argparse
import sys

import numpy

from cupyflash import _attention, _instantiations as inst, _validation, reference, standard
from cupyflash._instantiations import TileShape

CANDIDATES = [
    TileShape(64, 32, 8, 4, 2),
    TileShape(64, 64, 8, 4, 1),
    TileShape(128, 32, 8, 8, 1),
    TileShape(128, 64, 8, 8, 1),
    TileShape(64, 32, 8, 2, 2),
    TileShape(64, 32, 4, 4, 2),
    TileShape(64, 16, 8, 4, 2),
    TileShape(32, 32, 4, 4, 4),
    TileShape(128, 32, 8, 4, 1),
    # shapes for float64's larger accumulators
    TileShape(32, 32, 4, 4, 2),
    TileShape(64, 32, 8, 4, 1),
    TileShape(32, 32, 8, 2, 2),
    TileShape(64, 16, 4, 4, 2),
]


def main(argv=None):
    import cupy
    from cupy.cuda.compiler import CompileException
    from cupyx.profiler import benchmark

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float16", choices=inst.DTYPE_NAMES)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args(argv)
    b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    dtype = _validation.BFLOAT16 if args.dtype == "bfloat16" else numpy.dtype(args.dtype)
    rs = cupy.random.default_rng(1)
    q, k, v = (rs.standard_normal((b, s, h, d), dtype=numpy.float32).astype(dtype) for _ in range(3))
    p = _validation.check_attention_args(q, k, v, causal=args.causal, scale=None, return_lse=False)
    qs, ks, vs = (x[:1, :, :1].get() for x in (q, k, v))
    ref = reference.attention(qs, ks, vs, causal=args.causal)
    bound = reference.error_bound(ref, reference.attention_in_precision(qs, ks, vs, dtype, causal=args.causal), args.dtype)
    flops = standard.flops(b, h, s, s, d, args.causal)
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# {name}: {args.dtype} b{b} s{s} h{h} d{d} causal={args.causal}")
    print(f"{'tile (M, N, warps, rows/thr, blocks/SM)':42} {'smem KiB':>8} {'ms':>8} {'TFLOP/s':>8} {'max err':>9}")
    for tile in CANDIDATES:
        kernel = inst.FwdKernel(p.dtype_name, inst.padded_head_dim(d), p.causal, tile)
        out = cupy.full(q.shape, numpy.nan, dtype=numpy.float32).astype(dtype)
        lse = cupy.empty((b, h, s), dtype=numpy.float32)
        label = f"{tuple(tile.__dict__.values())}"
        try:
            _attention.launch_forward(q, k, v, out, lse, p, kernel)
        except (CompileException, ValueError) as e:  # a shape the traits reject, or too much shared memory
            print(f"{label:42} {kernel.smem_bytes / 1024:8.1f}  failed: {str(e).strip().splitlines()[0][:90]}")
            continue
        err = float(numpy.abs(out[:1, :, :1].get().astype(numpy.float64) - ref).max())
        if not err <= bound:
            print(f"{label:42} {kernel.smem_bytes / 1024:8.1f}  WRONG: max err {err:.2e} > bound {bound:.2e}")
            continue
        t = benchmark(_attention.launch_forward, (q, k, v, out, lse, p, kernel), n_repeat=10, n_warmup=2)
        ms = float(numpy.median(t.gpu_times[0])) * 1e3
        print(f"{label:42} {kernel.smem_bytes / 1024:8.1f} {ms:8.2f} {flops / ms / 1e9:8.1f} {err:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
