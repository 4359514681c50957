"""The dense and the density-1 block-sparse Hopper forward, one launch each, for ncu, a development tool.

    ncu --kernel-name regex:flash_fwd_tc_kernel --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section InstructionStats \
        python benchmarks/ncu_fwd_pair.py

bf16, d128, batch 4 x seqlen 4096, 16 heads (the sparse grid's shape): one untimed pair compiles,
then the pair ncu profiles. Same tiles, so the two kernels' counters differ only by the mask walk.
--density 0.1 (the sparse grid's random mask at that density) and --head-dim 64 profile a short
tile's pair instead; the warp-specialised forward's kernel is `regex:flash_fwd_ws_kernel` (at d64
only the sparse call takes it: `--launch-skip 1 --launch-count 1`). --exact-blocks N gives every
mask row exactly N key blocks instead: the first N, or N at random per row with --at-random
(short_keys_scaling.exact_rows_mask), to set the two layouts of the same work side by side.
"""
import argparse
import pathlib
import sys

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def main(argv=None):
    import cupy

    import bench_sparse
    import cupyflash
    from cupyflash._validation import BFLOAT16

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--density", type=float, default=1.0)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--exact-blocks", type=int, help="every mask row this many key blocks")
    ap.add_argument("--at-random", action="store_true", help="with --exact-blocks: at random, not the first")
    args = ap.parse_args(argv)
    d, s = args.head_dim, 4096
    b, h = 16384 // s, 2048 // d
    rs = cupy.random.default_rng(0)
    q, k, v = (rs.standard_normal((b, s, h, d), dtype=numpy.float32).astype(BFLOAT16) for _ in range(3))
    if args.exact_blocks:
        from short_keys_scaling import exact_rows_mask

        mask = exact_rows_mask(args.exact_blocks, h, args.at_random, numpy.random.default_rng(1))
    else:
        mask = bench_sparse.make_mask("random", args.density, s, h, numpy.random.default_rng(1))
    for _ in range(2):
        cupyflash.attention(q, k, v, return_lse=True)
        cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
    cupy.cuda.Device().synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
