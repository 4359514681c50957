"""Block-sparse forward and backward on masks whose rows differ in length, kernels alone, a
development tool (GPU).

    python benchmarks/tile_order_ab.py [--seqlen 4096 --seqlen 16384] [--head-dim 64 ...] [--backward]

For the sparse grid's shapes (batch x seqlen = 16384 tokens, hidden 2048, bf16): the dense forward,
then block-sparse forwards on BigBird masks (window 3, one global block, two random; one global
query row sees every key block), block-causal masks (`BlockMask.causal`, passed without
causal=True: row i walks i + 1 blocks), and the grid's random and local masks at density 0.1. Each
call's launches are replayed back to back (bench._median_ms); prints microseconds, the mask's
density and time / (density x dense): 1 is time proportional to density. Run it from a tree's own
directory to compare trees (benchmarks/NOTES.md, session 31).
"""

import argparse
import pathlib
import sys

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def masks(seqlen: int, heads: int):
    import bench_sparse
    import cupyflash

    yield "bigbird", cupyflash.BlockMask.bigbird(seqlen, seqlen, window=3, n_global=1, n_random=2, seed=0)
    yield "block-causal", cupyflash.BlockMask.causal(seqlen, seqlen)
    for pattern in ("random", "local"):
        yield f"{pattern} 0.1", bench_sparse.make_mask(pattern, 0.1, seqlen, heads, numpy.random.default_rng(seqlen))


def main(argv=None):
    import cupy

    import cupyflash
    from bwd_breakdown import problem_calls, record_launches, replay_us
    from cupyflash._validation import BFLOAT16

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, action="append", help="default 64, 128")
    ap.add_argument("--seqlen", type=int, action="append", help="default 4096, 16384")
    ap.add_argument("--backward", action="store_true", help="time the backward's launches instead")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    device = cupy.cuda.Device().id
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(device)['name'].decode()}; cupyflash from "
          f"{pathlib.Path(cupyflash.__file__).parent}; {'backward' if args.backward else 'forward'}")
    print(f"{'seqlen':>6} {'d':>4} {'mask':>13} {'density':>7} | {'us':>17} | {'/ (density x dense)':>19}")
    for seqlen in args.seqlen or [4096, 16384]:
        for d in args.head_dim or [64, 128]:
            batch, heads = 16384 // seqlen, 2048 // d
            rs = cupy.random.default_rng(d)
            q, k, v, dout = (rs.standard_normal((batch, seqlen, heads, d), dtype=numpy.float32).astype(BFLOAT16)
                             for _ in range(4))

            def time_us(mask):
                fwd, bwd = problem_calls(q, k, v, dout, mask)
                launches = record_launches(bwd if args.backward else fwd)
                return [replay_us(launches) for _ in range(args.rounds)]

            dense = time_us(None)
            print(f"{seqlen:>6} {d:>4} {'dense':>13} {1:7.3f} | {' / '.join(f'{t:.1f}' for t in dense):>17} |",
                  flush=True)
            for name, mask in masks(seqlen, heads):
                times = time_us(mask)
                ratio = numpy.median(times) / (mask.density * numpy.median(dense))
                print(f"{seqlen:>6} {d:>4} {name:>13} {mask.density:7.3f} | "
                      f"{' / '.join(f'{t:.1f}' for t in times):>17} | {ratio:19.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
