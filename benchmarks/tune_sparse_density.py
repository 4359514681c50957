"""Tile candidates for the Hopper block-sparse forward at the sparse grid's densities, kernels
alone, a development tool (sm_90 only).

    python benchmarks/tune_sparse_density.py [--head-dim 128] [--seqlen 4096] [--density 0.1 ...]
                                             [--pattern random] [--rounds 2]

tune_sparse.py compares tiles at density 1. Where a mask row holds a few key blocks, a block's
fixed cost (its first copies, the O_i store) weighs as much as its steps, and a tile that puts
more blocks on an SM may hide it even if its steps are slower. For the grid's shapes (batch x
seqlen = 16384 tokens, hidden 2048, bf16, bench_sparse.make_mask) this replays the launches of one
call per candidate tile (the TMA builds) back to back, rounds alternating, and prints microseconds
and time over density x the dense kernel's (the traits table's tile).

    --dense [--causal] [--copies tma|cp.async|both] [--tiles "m,n,warps,per_sm;..."] [--pause S]
        the dense (or causal) forward's tiles, each against the first, TMA builds or their twins;
    --backward
        the whole backward (preprocess, dK/dV, conversion) with BWD_CANDIDATES' dK/dV tiles.
"""

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# (block_m, block_n, warps, blocks per SM); the first of each is the traits table's tile.
# The Hopper dK/dV kernel's TMA builds: (block_m, block_n, warps, warps_q, dO buffers, out_split,
# blocks per SM); None is the traits table's tile. (The TMA builds stage one 64 x 64 dQ share per
# warpgroup, so one warpgroup serves d64 only.)
BWD_CANDIDATES = {64: [None, (64, 64, 4, 1, 2, 1, 2)], 128: [None]}
CANDIDATES = {64: [(64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 8, 2), (128, 64, 8, 2)],
              128: [(128, 128, 8, 1), (64, 128, 4, 2), (64, 64, 4, 3)]}


def main(argv=None):
    import cupy

    import bench_sparse
    import cupyflash
    from bwd_breakdown import record_launches, replay_us
    from cupyflash import _attention, _compile, _instantiations as inst, _validation
    from cupyflash._validation import BFLOAT16

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, action="append", help="default 64, 128")
    ap.add_argument("--seqlen", type=int, action="append", help="default 4096")
    ap.add_argument("--density", type=float, action="append", help="default 1.0 0.25 0.1 0.05")
    ap.add_argument("--pattern", choices=["random", "local"], action="append", help="default random")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dense", action="store_true",
                    help="the dense kernel's candidates instead (no mask; causal too with --causal)")
    ap.add_argument("--causal", action="store_true", help="with --dense: the causal (local) builds")
    ap.add_argument("--copies", choices=["tma", "cp.async", "both"], default="tma",
                    help="with --dense: the TMA builds, their cp.async twins, or both for each tile")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds idle before each measurement (clocks recover from the last one's load)")
    ap.add_argument("--backward", action="store_true",
                    help="the backward's launches (preprocess, dK/dV, conversion) with BWD_CANDIDATES' dK/dV tiles")
    ap.add_argument("--tiles", help="with --dense: candidates as m,n,warps,per_sm;... (default: the table's list)")
    args = ap.parse_args(argv)
    if cupy.cuda.Device().compute_capability != str(inst.WGMMA_COMPUTE_CAPABILITY):
        print("needs an sm_90 GPU (the Hopper forward)")
        return 1

    def kernels_us(call) -> float:
        launches = record_launches(call)
        time.sleep(args.pause)
        return replay_us(launches)

    def described(kernel, times: list, ratios: str) -> str:
        """A candidate's tile, registers (a cupy.RawKernel's), times in us and ratios."""
        regs = _compile.get_function(kernel, cupy.cuda.Device().id).num_regs
        return (f"{str(dataclasses.astuple(kernel.tile)):>27} {regs:>4} | "
                f"{' / '.join(f'{us:.1f}' for us in times):>8} {ratios:>20}")

    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'d':>4} {'seqlen':>6} {'pattern':>7} {'density':>7} {'tile (m, n, warps, per SM)':>27} "
          f"{'regs':>4} | {'us':>8} {'/ (density x dense)':>20}")
    for d in args.head_dim or [64, 128]:
        for seqlen in args.seqlen or [4096]:
            batch, heads = 16384 // seqlen, 2048 // d
            rs = cupy.random.default_rng(d)
            q, k, v = (rs.standard_normal((batch, seqlen, heads, d), dtype=numpy.float32).astype(BFLOAT16)
                       for _ in range(3))
            out = cupy.empty_like(q)
            lse = cupy.empty((batch, heads, seqlen), numpy.float32)
            p = _validation.check_attention_args(q, k, v, causal=False, scale=None, return_lse=True)
            dense_kernel = inst.fwd_kernel("bfloat16", d, False, True, wgmma=True, tma=True)
            if args.backward:
                dout = rs.standard_normal(q.shape, dtype=numpy.float32).astype(BFLOAT16)
                real_kernels = _attention.backward_kernels
                for pattern in args.pattern or ["random"]:
                    for density in args.density or [1.0, 0.25, 0.1, 0.05]:
                        mask = bench_sparse.make_mask(pattern, density, seqlen, heads,
                                                      numpy.random.default_rng(seqlen + d))
                        out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
                        times, used = {}, {}  # per candidate: times; the dK/dV kernel it launched
                        for _ in range(args.rounds):
                            for tile in BWD_CANDIDATES[d]:
                                def patched(*a, tile=tile, **kw):
                                    dkdv, dq = real_kernels(*a, **kw)
                                    if tile is not None:
                                        dkdv = dataclasses.replace(dkdv, tile_override=inst.TcDkdvTileShape(*tile))
                                    used[tile] = dkdv
                                    return dkdv, dq

                                _attention.backward_kernels = patched
                                try:
                                    us = kernels_us(lambda: cupyflash.block_sparse_attention_backward(
                                        dout, q, k, v, out, lse, mask))
                                finally:
                                    _attention.backward_kernels = real_kernels
                                times.setdefault(tile, []).append(us)
                        base = numpy.median(times[None])
                        for tile in BWD_CANDIDATES[d]:
                            ratio = f"{numpy.median(times[tile]) / base:.3f}"
                            print(f"{d:>4} {seqlen:>6} {pattern:>7} {mask.density:7.3f} "
                                  f"{described(used[tile], times[tile], ratio)} (backward; / the table's)")
                continue
            if args.dense:
                p = _validation.check_attention_args(q, k, v, causal=args.causal, scale=None, return_lse=True)
                tiles = ([tuple(map(int, t.split(","))) for t in args.tiles.split(";")] if args.tiles
                         else CANDIDATES[d])
                copies = {"tma": [True], "cp.async": [False], "both": [False, True]}[args.copies]
                kernels = [inst.WgmmaFwdKernel("bfloat16", d, args.causal, tma=tma,
                                               tile_override=inst.TcTileShape(*tile))
                           for tile in tiles for tma in copies]
                times = {}
                for _ in range(args.rounds):
                    for kernel in kernels:
                        us = kernels_us(lambda: _attention.launch_forward(q, k, v, out, lse, p, kernel))
                        times.setdefault(kernel, []).append(us)
                base = numpy.median(times[kernels[0]])
                for kernel in kernels:
                    ratio = f"{numpy.median(times[kernel]) / base:.3f}"
                    print(f"{d:>4} {seqlen:>6} {'causal' if args.causal else 'dense':>7} "
                          f"{'TMA' if kernel.tma else 'cp.async':>7} {described(kernel, times[kernel], ratio)}")
                continue
            for pattern in args.pattern or ["random"]:
                for density in args.density or [1.0, 0.25, 0.1, 0.05]:
                    mask = bench_sparse.make_mask(pattern, density, seqlen, heads, numpy.random.default_rng(seqlen + d))
                    ps = _validation.check_block_mask(mask, p)
                    kernels = [inst.WgmmaFwdKernel("bfloat16", d, False, block_sparse=True, tma=True,
                                                   tile_override=inst.TcTileShape(*tile)) for tile in CANDIDATES[d]]
                    times = {}
                    for _ in range(args.rounds):
                        dense = kernels_us(lambda: _attention.launch_forward(q, k, v, out, lse, p, dense_kernel))
                        times.setdefault("dense", []).append(dense)
                        for kernel in kernels:
                            us = kernels_us(lambda: _attention.launch_forward(q, k, v, out, lse, ps, kernel))
                            times.setdefault(kernel, []).append(us)
                    dense = numpy.median(times["dense"])
                    print(f"{d:>4} {seqlen:>6} {pattern:>7} {'dense':>7} {'':>27} {'':>4} | "
                          f"{' / '.join(f'{t:.1f}' for t in times['dense']):>8}")
                    for kernel in kernels:
                        ratios = " / ".join(f"{us / (mask.density * dense):.3f}" for us in times[kernel])
                        print(f"{d:>4} {seqlen:>6} {pattern:>7} {mask.density:7.3f} "
                              f"{described(kernel, times[kernel], ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
