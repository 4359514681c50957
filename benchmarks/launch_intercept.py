"""How much of a call's time does not grow with the work: kernels alone, against the batch, a
development tool.

    python benchmarks/launch_intercept.py [--head-dim D ...] [--seqlen N] [--batch B ...] [--density X ...]

For the sparse grid's shapes (hidden 2048, bfloat16) and a few batch sizes it replays the launches
of one forward and one backward call (dense `attention`, and `block_sparse_attention` with the
grid's random masks, bench_sparse.make_mask), back to back (bench._median_ms), and fits
time = a + b x batch by least squares. The intercept a is what each call pays whatever its size:
the launch gaps, each launch's ramp (prologue, first loads) and tail (the last tiles, which leave
SMs idle). The slope b is the work. It prints both, and the density rows' ratio to dense with and
without a: how far the grid's 4096-token rows are from their bound for per-call reasons. (A long
run can lose clock speed: on an H200 the dense backward at batch 8 took 3% longer per batch entry
than at 2 and 4, which makes its a negative. Read the fits beside the times.)
"""

import argparse
import pathlib
import sys

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def main(argv=None):
    import cupy

    import bench_sparse
    from bwd_breakdown import problem_calls, record_launches, replay_us
    from cupyflash._validation import BFLOAT16

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, action="append", help="default 64, 128")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, action="append", help="default 2, 4, 8")
    ap.add_argument("--density", type=float, action="append", help="default 0.1, 0.25")
    args = ap.parse_args(argv)
    batches = args.batch or [2, 4, 8]
    densities = args.density or [0.1, 0.25]
    seqlen = args.seqlen

    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"seqlen {seqlen}, hidden 2048, bfloat16; kernels alone, us (median of back-to-back replays)")
    for d in args.head_dim or [64, 128]:
        heads = 2048 // d
        masks = {density: bench_sparse.make_mask("random", density, seqlen, heads,
                                                 numpy.random.default_rng(seqlen + d)) for density in densities}
        times = {}  # (problem, direction) -> [us per batch]
        for batch in batches:
            rs = cupy.random.default_rng(d + batch)
            q, k, v, dout = (rs.standard_normal((batch, seqlen, heads, d), dtype=numpy.float32).astype(BFLOAT16)
                             for _ in range(4))
            problems = [("dense", None)] + [(f"random {masks[x].density:.3f}", masks[x]) for x in densities]
            for name, mask in problems:
                fwd, bwd = problem_calls(q, k, v, dout, mask)
                for direction, call in (("fwd", fwd), ("bwd", bwd)):
                    us = replay_us(record_launches(call))
                    times.setdefault((name, direction), []).append(us)
                    print(f"d{d} batch {batch:>2} {name:>12} {direction}: {us:9.1f} us", flush=True)
            del q, k, v, dout, fwd, bwd  # the calls hold the arrays and the forward's out, lse
            cupy.get_default_memory_pool().free_all_blocks()

        x = numpy.array(batches, float)
        fits = {key: numpy.polyfit(x, numpy.array(us), 1) for key, us in times.items()}  # (b, a)
        print(f"\nd{d}: time = a + b x batch (batch {batches}); at batch {16384 // seqlen} (the grid's shape)")
        print(f"{'problem':>12} {'dir':>3} | {'a (us)':>8} {'b (us)':>8} | {'ratio':>6} {'ratio of b':>10} {'bound':>6}")
        at = 16384 // seqlen
        for (name, direction), (b, a) in fits.items():
            density = 1.0 if name == "dense" else float(name.split()[1])
            b_dense, a_dense = fits[("dense", direction)]
            ratio = (a + b * at) / (a_dense + b_dense * at)
            print(f"{name:>12} {direction:>3} | {a:8.1f} {b:8.1f} | {ratio:6.3f} {b / b_dense:10.3f} "
                  f"{1.2 * density if name != 'dense' else 1.1:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
