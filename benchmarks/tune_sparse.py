"""Tile candidates for the block-sparse tensor-core forward (full 128 x 128 mask, bf16, causal
off), against the dense kernel of the traits table: CUDA-event means. On sm_90 the Hopper (wgmma)
kernel's candidates too, against its own dense tile.

    python benchmarks/tune_sparse.py [--head-dim 128] [--seqlen 16384] [--local]
"""

import argparse
import dataclasses

import cupy
import numpy
from cupyx.profiler import benchmark

from cupyflash import BlockMask, _attention, _instantiations as inst, _validation
from cupyflash._validation import BFLOAT16

CANDIDATES = {128: [(128, 64, 4), (128, 64, 8), (128, 32, 4), (64, 64, 4), (64, 128, 4)],
              64: [(128, 128, 4), (128, 64, 4), (64, 128, 4)], 256: [(128, 64, 8), (64, 64, 4), (64, 32, 4)]}
# (block_m, block_n, warps, blocks per SM); the first of each is the traits table's tile.
HOPPER_CANDIDATES = {64: [(64, 128, 4, 3), (64, 128, 4, 2), (64, 64, 4, 3), (64, 64, 4, 2)],
                     128: [(128, 128, 8, 1), (128, 64, 8, 1), (64, 64, 4, 2)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, action="append")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--local", action="store_true", help="the causal kernels, with a causal mask")
    args = ap.parse_args()
    hopper = cupy.cuda.Device().compute_capability == str(inst.WGMMA_COMPUTE_CAPABILITY)
    for d in args.head_dim or [128]:
        s, heads = args.seqlen, 2048 // d
        batch = max(1, 16384 // s)
        q, k, v = (cupy.random.standard_normal((batch, s, heads, d), dtype=numpy.float32).astype(BFLOAT16) for _ in range(3))
        out = cupy.empty_like(q)
        lse = cupy.empty((batch, heads, s), numpy.float32)
        mask = BlockMask(numpy.ones((1, -(-s // 128), -(-s // 128)), bool))
        local = args.local
        p = _validation.check_attention_args(q, k, v, causal=local, scale=None, return_lse=True)
        flops = 4.0 * batch * heads * s * s * d / (2 if local else 1)
        ps = _validation.check_block_mask(mask, p)
        kinds = [(inst.TcFwdKernel, False, [(m, n, w, 1) for m, n, w in CANDIDATES[d]])]
        if hopper and d in inst.WGMMA_HEAD_DIMS:
            kinds.append((inst.WgmmaFwdKernel, True, HOPPER_CANDIDATES[d]))
        for kind, wgmma, candidates in kinds:
            dense = inst.fwd_kernel("bfloat16", d, local, True, wgmma=wgmma)
            t = benchmark(_attention.launch_forward, (q, k, v, out, lse, p, dense), n_repeat=20, n_warmup=3).gpu_times.mean()
            print(f"d{d} s{s} causal={local} {kind.__name__} dense {dataclasses.astuple(dense.tile)}: {flops / t / 1e12:.1f} TFLOP/s")
            for tile in candidates:
                kernel = kind("bfloat16", d, local, tile_override=inst.TcTileShape(*tile), block_sparse=True)
                t = benchmark(_attention.launch_forward, (q, k, v, out, lse, ps, kernel), n_repeat=20, n_warmup=3).gpu_times.mean()
                print(f"d{d} s{s} causal={local} {kind.__name__} sparse {tile}: {flops / t / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
