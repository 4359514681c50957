"""Sweep tile shapes of the tensor-core kernels on the GPU (a development tool).

    python benchmarks/tune_tc.py [--dtype bfloat16 --seqlen 8192 --batch 2] [--causal] [--forward-only]

For head_dim 64 (32 heads) and 128 (16 heads), times the forward kernel and the backward
(dK/dV kernel with atomic dQ, plus its row kernels; and the deterministic dQ kernel) for each
candidate tile, median of CUDA-event timings; on an sm_90 GPU the Hopper (wgmma) forward's and
dK/dV kernel's tiles too. Each candidate's results are compared with the
traits table's first; a candidate the traits reject or whose shared memory does not fit is
reported with its error's first line; any other exception stops the sweep.
"""

import argparse
import sys

import numpy

from cupyflash import _attention, _instantiations as inst, _validation, standard
from cupyflash._instantiations import TcBwdTileShape as B, TcDkdvTileShape as D, TcTileShape as T

FWD = {
    64: [T(128, 64, 4, 1), T(128, 128, 4, 1), T(128, 64, 4, 2), T(64, 64, 4, 2)],
    128: [T(128, 64, 4, 1), T(128, 32, 4, 1), T(128, 64, 8, 1), T(128, 128, 8, 1)],
    256: [T(128, 64, 8, 1), T(64, 64, 4, 1), T(64, 32, 4, 1)],
}
# The Hopper forward (wgmma, sm_90a only): 64 query rows per warpgroup, 64 or 128 keys per step.
# One warpgroup per block with 2-3 blocks per SM lets one block's softmax overlap another's wgmma
# (no barrier ties them), at the price of loading K_j, V_j once per 64 rows instead of 128.
HOPPER_FWD = {
    64: [T(128, 128, 8, 1), T(128, 64, 8, 2), T(192, 128, 12, 1), T(64, 128, 4, 2), T(64, 128, 4, 3)],
    128: [T(128, 128, 8, 1), T(128, 64, 8, 1), T(192, 64, 12, 1), T(64, 64, 4, 2)],
}
DKDV = {  # (block_m, block_n, warps, warps_q, do_buffers, out_split, min_blocks); warps_q=1: session 4's layout
    64: [D(128, 128, 8, 2, 1, 1, 1), D(128, 128, 8, 2, 2, 1, 1), D(64, 128, 8, 2, 2, 1, 1), D(64, 128, 8, 2, 1, 1, 1)],
    128: [D(64, 128, 8, 2, 1, 1, 1), D(64, 128, 8, 2, 2, 1, 1), D(64, 128, 8, 1, 1, 1, 1)],
    256: [D(32, 64, 8, 2, 1, 1, 1), D(32, 64, 8, 2, 2, 1, 1), D(64, 64, 8, 2, 1, 1, 1), D(16, 64, 4, 1, 1, 2, 1)],
}
# The Hopper dK/dV kernel (wgmma, sm_90a only): 64 keys per warpgroup, Q_i and dO_i double-buffered.
# One warpgroup per block at two per SM, as the forward's d64 tile, besides the table's two.
HOPPER_DKDV = {
    64: [D(128, 128, 8, 1, 2, 1, 1), D(64, 128, 8, 1, 2, 1, 1), D(64, 64, 4, 1, 2, 1, 2)],
    128: [D(64, 128, 8, 1, 2, 1, 1), D(64, 64, 4, 1, 2, 1, 2)],
}
DQ = {
    64: [B(128, 64, 8, 1, 1), B(64, 64, 4, 1, 1)],
    128: [B(128, 64, 8, 1, 1), B(64, 64, 4, 1, 1)],
    256: [B(64, 32, 4, 2, 1)],
}


def main(argv=None):
    import cupy
    from cupy.cuda.compiler import CompileException
    from cupyx.profiler import benchmark

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=inst.TENSOR_CORE_DTYPES)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--head-dim", type=int, action="append")
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--backward-only", action="store_true", help="time only the dK/dV and dQ tiles")
    args = ap.parse_args(argv)
    hopper = cupy.cuda.Device().compute_capability == str(inst.WGMMA_COMPUTE_CAPABILITY)
    dtype = _validation.BFLOAT16 if args.dtype == "bfloat16" else numpy.dtype(args.dtype)
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# {name}: {args.dtype} b{args.batch} s{args.seqlen} causal={args.causal}")

    def ms_of(fn, *a):
        t = benchmark(fn, a, n_repeat=10, n_warmup=2)
        return float(numpy.median(t.gpu_times[0])) * 1e3

    for d in args.head_dim or (64, 128):
        b, s, h = args.batch, args.seqlen, 2048 // d
        rs = cupy.random.default_rng(1)
        q, k, v, dout = (rs.standard_normal((b, s, h, d), dtype=numpy.float32).astype(dtype) for _ in range(4))
        p = _validation.check_attention_args(q, k, v, causal=args.causal, scale=None, return_lse=True)
        flops = standard.flops(b, h, s, s, d, args.causal)
        out = cupy.empty_like(q)
        lse = cupy.empty((b, h, s), dtype=numpy.float32)
        first = None
        candidates = [(inst.TcFwdKernel, "fwd", tile) for tile in FWD[d]]
        candidates += [(inst.WgmmaFwdKernel, "fwd wgmma", tile) for tile in HOPPER_FWD.get(d, []) if hopper]
        candidates = [] if args.backward_only else candidates
        for kind, name, tile in candidates:
            kernel = kind(p.dtype_name, d, p.causal, tile)
            label = f"{name} d{d} {tuple(tile.__dict__.values())}"
            try:
                _attention.launch_forward(q, k, v, out, lse, p, kernel)
            except (CompileException, ValueError) as e:
                print(f"{label:40} failed: {str(e).strip().splitlines()[0][:90]}")
                continue
            got = out.astype(numpy.float32)
            first = got if first is None else first
            diff = float(cupy.abs(got - first).max())
            ms = ms_of(_attention.launch_forward, q, k, v, out, lse, p, kernel)
            print(f"{label:40} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  diff {diff:.1e}")
        if args.forward_only:
            continue
        _attention.launch_forward(q, k, v, out, lse, p, tensor_cores=True)
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        sweeps = [(False, inst.TcBwdDkdvKernel, "bwd", DKDV[d])]
        if hopper and d in HOPPER_DKDV:
            sweeps.append((False, inst.WgmmaBwdDkdvKernel, "bwd wgmma", HOPPER_DKDV[d]))
        sweeps.append((True, inst.TcBwdDqKernel, "bwd det", DQ[d]))
        first = None
        for det, kind, name, tiles in sweeps:
            pb = _validation.check_backward_args(dout, q, k, v, out, lse, causal=args.causal, scale=None, deterministic=det)
            first = None if det else first  # the atomic-dQ sweeps compare with the table's first tile
            for tile in tiles:
                default = inst.bwd_kernels(p.dtype_name, d, p.causal, True)
                kernels = (default[0], kind(p.dtype_name, d, p.causal, tile)) if det else (
                    kind(p.dtype_name, d, p.causal, tile), default[1])
                label = f"{name} d{d} {tuple(tile.__dict__.values())}"
                try:
                    _attention.launch_backward(dout, q, k, v, out, lse, *grads, pb, True, kernels)
                except (CompileException, ValueError) as e:
                    print(f"{label:40} failed: {str(e).strip().splitlines()[0][:90]}")
                    continue
                got = [g.astype(numpy.float32) for g in grads]
                first = got if first is None else first
                diff = max(float(cupy.abs(a - b_).max() / (cupy.abs(b_).max() + 1e-30)) for a, b_ in zip(got, first))
                ms = ms_of(_attention.launch_backward, dout, q, k, v, out, lse, *grads, pb, True, kernels)
                print(f"{label:40} {ms:8.3f} ms {2.5 * flops / ms / 1e9:7.1f} TFLOP/s  rel diff {diff:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
