"""The warp-specialised Hopper forward (WgmmaFwdWsKernel) against the TMA build the API takes now,
kernels alone, a development tool (sm_90 only).

    python benchmarks/ws_ab.py [--seqlen 4096] [--density 1 ...] [--pattern random ...] [--rounds 2]
                               [--ws-tiles "m,n,stages;..."]

For the sparse grid's shapes (batch x seqlen = 16384 tokens, hidden 2048, bf16,
bench_sparse.make_mask's masks, random by default): the dense forward and the block-sparse one at each
density, each build's launches replayed back to back (bench._median_ms), rounds alternating.
Prints microseconds per round, the ratio of each warp-specialised tile's median to the TMA
build's, and the largest difference between the two builds' outputs (rounding: the TMA build's
d128 tile of one warpgroup rescales lazily). Session 32 ran it at d64 as well, and with
FlashAttention-3's ping-pong and intra-warpgroup overlap (`results/H200-2026-11-26-ws-*`).
"""

import argparse
import pathlib
import sys
import time

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def main(argv=None):
    import cupy

    import bench_sparse
    from bwd_breakdown import record_launches, replay_us
    from cupyflash import _attention, _compile, _instantiations as inst, _validation
    from cupyflash._validation import BFLOAT16

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, action="append", help="default: WS_FORWARD_HEAD_DIMS")
    ap.add_argument("--seqlen", type=int, action="append", help="default 4096, 16384")
    ap.add_argument("--density", type=float, action="append", help="default 1 (dense), 0.5, 0.25, 0.1, 0.05")
    ap.add_argument("--pattern", action="append", choices=["random", "local"], help="default random")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ws-tiles", help="warp-specialised tiles as m,n,stages;... (default: the table's)")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds idle before each measurement")
    args = ap.parse_args(argv)
    if cupy.cuda.Device().compute_capability != str(inst.WGMMA_COMPUTE_CAPABILITY):
        print("needs an sm_90 GPU (the Hopper forward)")
        return 1
    device = cupy.cuda.Device().id

    def kernels_us(call) -> float:
        launches = record_launches(call)
        time.sleep(args.pause)
        return replay_us(launches)

    print(f"device: {cupy.cuda.runtime.getDeviceProperties(device)['name'].decode()}")
    print(f"{'d':>4} {'seqlen':>6} {'pattern':>7} {'density':>7} {'kernel (tile)':>34} {'regs':>4} | {'us':>17} "
          f"{'/ TMA':>6} {'max |diff|':>10}")
    for d in args.head_dim or list(inst.WS_FORWARD_HEAD_DIMS):
        ws_tiles = [inst.WsTileShape(*map(int, t.split(","))) for t in args.ws_tiles.split(";")] \
            if args.ws_tiles else [inst.WGMMA_FWD_WS_TILES[d]]
        for seqlen in args.seqlen or [4096, 16384]:
            batch, heads = 16384 // seqlen, 2048 // d
            rs = cupy.random.default_rng(d)
            q, k, v = (rs.standard_normal((batch, seqlen, heads, d), dtype=numpy.float32).astype(BFLOAT16)
                       for _ in range(3))
            p = _validation.check_attention_args(q, k, v, causal=False, scale=None, return_lse=True)
            for pattern, density in [(pattern, density) for pattern in args.pattern or ["random"]
                                     for density in args.density or [1.0, 0.5, 0.25, 0.1, 0.05]]:
                sparse = density < 1
                ps = p
                if sparse:
                    mask = bench_sparse.make_mask(pattern, density, seqlen, heads, numpy.random.default_rng(seqlen + d))
                    ps = _validation.check_block_mask(mask, p)
                    density = mask.density
                kernels = [inst.fwd_kernel("bfloat16", d, False, True, sparse, wgmma=True, tma=True)]
                kernels += [inst.WgmmaFwdWsKernel("bfloat16", d, False, block_sparse=sparse, tile_override=t)
                            for t in ws_tiles]
                outs = {kernel: (cupy.full(q.shape, numpy.nan, q.dtype),
                                 cupy.full((batch, heads, seqlen), numpy.nan, numpy.float32)) for kernel in kernels}
                times = {}
                for _ in range(args.rounds):
                    for kernel in kernels:
                        out, lse = outs[kernel]
                        us = kernels_us(lambda: _attention.launch_forward(q, k, v, out, lse, ps, kernel))
                        times.setdefault(kernel, []).append(us)
                base = numpy.median(times[kernels[0]])
                ref = outs[kernels[0]][0].astype(numpy.float32)
                for kernel in kernels:
                    regs = _compile.get_function(kernel, device).num_regs
                    diff = float(cupy.abs(outs[kernel][0].astype(numpy.float32) - ref).max())
                    name = f"{type(kernel).__name__[5:]} {tuple(vars(kernel.tile).values())}"
                    print(f"{d:>4} {seqlen:>6} {pattern if sparse else 'dense':>7} {density:7.3f} {name:>34} {regs:>4} | "
                          f"{' / '.join(f'{us:.1f}' for us in times[kernel]):>17} "
                          f"{numpy.median(times[kernel]) / base:6.3f} {diff:10.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
