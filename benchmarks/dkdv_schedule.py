"""A model of the block-sparse dK/dV launch's schedule, a development tool (no GPU).

    python benchmarks/dkdv_schedule.py [--us-per-step 3.0] [--us-per-block 5.0] [--sms 132]

The dK/dV kernel runs one thread block per SM, one block per key block (128 keys), and the GPU
starts blocks in launch order as SMs free up. A block's time is modelled as us-per-block plus
us-per-step x its steps (its mask column's query blocks; two steps a block at d128, whose query
tile is 64 rows). The defaults fit the H100 grids of sessions 27-29 (d64 3.0 and d128 2.9 us a
step at one block per SM; 5 us a block). For the sparse grid's masks (bench_sparse.make_mask) it
prints the modelled kernel time with the key blocks in index order, in each head's order by
descending column count (BlockMask.key_order), in the forward's class order over the whole launch
(`_block_mask.longest_rows_first` on the column counts; "-" where it keeps index order), in the
kernel's own order (BlockMask.dkdv_item_order's `outliers_first`: only columns of class 3 and above
moved to the front; "-" where there are none), with the whole launch sorted by count, and the
bound of total work / SMs. --masks irregular: BigBird, block-causal and the grid's 0.1 masks
instead (tile_order_ab.masks).
"""

import argparse
import heapq
import sys

import numpy

from bench_sparse import make_mask
from cupyflash._block_mask import longest_rows_first, outliers_first


def makespan(costs, sms: int) -> float:
    """Greedy list schedule: each block in order goes to the SM that frees up first."""
    free = [0.0] * sms
    for cost in costs:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--us-per-step", type=float, action="append", help="d64's then d128's (default 3.0, 2.9)")
    ap.add_argument("--us-per-block", type=float, default=5.0)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--masks", choices=["grid", "irregular"], default="grid")
    args = ap.parse_args(argv)
    per_step = dict(zip((64, 128), args.us_per_step or [3.0, 2.9]))
    print(f"{'seqlen':>6} {'d':>3} {'mask':>13} {'density':>7} | {'index order':>11} {'key_order':>9} "
          f"{'classes':>8} {'outliers':>8} {'launch sorted':>13} {'work/SMs':>8} | us (model)")
    for seqlen in (4096, 16384):
        for d in (64, 128):
            batch, heads = max(1, 16384 // seqlen), 2048 // d
            steps_per_block = 1 if d == 64 else 2
            for name, mask in masks(args.masks, seqlen, d, heads):
                column = numpy.broadcast_to(mask.q_count[0], (heads, mask.blocks[1]))
                cost = args.us_per_block + per_step.get(d, 3.0) * steps_per_block * column
                ordered = numpy.take_along_axis(cost, numpy.broadcast_to(mask.key_order[0], cost.shape), axis=1)
                launch = numpy.concatenate([cost] * batch).ravel()  # key block fastest, then head, batch
                by_key_order = numpy.concatenate([ordered] * batch).ravel()
                classes = longest_rows_first(numpy.concatenate([column] * batch).ravel())
                by_class = "-" if classes is None else f"{makespan(launch[classes], args.sms):.1f}"
                outliers = outliers_first(mask.item_steps(batch, heads, 1, 1, 1))  # (the kernel's rule and numbering)
                by_outliers = "-" if outliers is None else f"{makespan(by_key_order[outliers], args.sms):.1f}"
                print(f"{seqlen:>6} {d:>3} {name:>13} {mask.density:7.3f} | {makespan(launch, args.sms):11.1f} "
                      f"{makespan(by_key_order, args.sms):9.1f} {by_class:>8} {by_outliers:>8} "
                      f"{makespan(numpy.sort(launch)[::-1], args.sms):13.1f} {launch.sum() / args.sms:8.1f}")
    return 0


def masks(which: str, seqlen: int, d: int, heads: int):
    """(name, BlockMask) pairs: the sparse grid's, or tile_order_ab's irregular ones."""
    if which == "irregular":
        import tile_order_ab

        yield from tile_order_ab.masks(seqlen, heads)
        return
    for pattern in ("random", "local"):
        for density in (1.0, 0.5, 0.25, 0.1, 0.05):
            yield pattern, make_mask(pattern, density, seqlen, heads, numpy.random.default_rng(seqlen + d))


if __name__ == "__main__":
    sys.exit(main())
