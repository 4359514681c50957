"""Tile candidates for the block-sparse tensor-core forward (full 128 x 128 mask, bf16, causal
off), against the dense kernel of the traits table: CUDA-event medians.

    python benchmarks/tune_sparse.py [--head-dim 128] [--seqlen 16384]
"""

import argparse

import cupy
import numpy
from cupyx.profiler import benchmark

from cupyflash import BlockMask, _attention, _instantiations as inst, _validation
from cupyflash._validation import BFLOAT16

CANDIDATES = {128: [(128, 64, 4), (128, 64, 8), (128, 32, 4), (64, 64, 4), (64, 128, 4)],
              64: [(128, 128, 4), (128, 64, 4), (64, 128, 4)], 256: [(128, 64, 8), (64, 64, 4), (64, 32, 4)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, action="append")
    ap.add_argument("--seqlen", type=int, default=16384)
    args = ap.parse_args()
    for d in args.head_dim or [128]:
        s, heads = args.seqlen, 2048 // d
        batch = max(1, 16384 // s)
        q, k, v = (cupy.random.standard_normal((batch, s, heads, d), dtype=numpy.float32).astype(BFLOAT16) for _ in range(3))
        out = cupy.empty_like(q)
        lse = cupy.empty((batch, heads, s), numpy.float32)
        mask = BlockMask(numpy.ones((1, -(-s // 128), -(-s // 128)), bool))
        p = _validation.check_attention_args(q, k, v, causal=False, scale=None, return_lse=True)
        flops = 4.0 * batch * heads * s * s * d
        dense = inst.fwd_kernel("bfloat16", d, False, True)
        t = benchmark(_attention.launch_forward, (q, k, v, out, lse, p, dense), n_repeat=20, n_warmup=3).gpu_times.mean()
        print(f"d{d} s{s} dense {dense.tile}: {flops / t / 1e12:.1f} TFLOP/s")
        ps = _validation.check_block_mask(mask, p)
        for m, n, w in CANDIDATES[d]:
            kernel = inst.TcFwdKernel("bfloat16", d, False, tile_override=inst.TcTileShape(m, n, w, 1), block_sparse=True)
            t = benchmark(_attention.launch_forward, (q, k, v, out, lse, ps, kernel), n_repeat=20, n_warmup=3).gpu_times.mean()
            print(f"d{d} s{s} sparse ({m}, {n}, {w} warps): {flops / t / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
