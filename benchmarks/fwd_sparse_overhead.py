"""The block-sparse forward kernel against the dense one, kernels alone, a development tool.

    python benchmarks/fwd_sparse_overhead.py [--head-dim D ...] [--seqlen N ...] [--density X ...] [--pattern P ...]
                                             [--backward]

For the sparse grid's shapes (batch x seqlen = 16384 tokens, hidden 2048, bfloat16) it replays the
launches of one dense `attention` call and of `block_sparse_attention` calls with the grid's masks
(bench_sparse.make_mask; random by default) back to back (bench._median_ms), and prints
microseconds and the sparse kernel's time over density x the dense kernel's: what the mask walk
costs apart from the host. --backward: the backward calls' launches instead (every kernel of the
call). (Run under two trees' PYTHONPATH in turn, it is an old/new A/B.)
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
    from bwd_breakdown import record_launches, replay_us
    from cupyflash._validation import BFLOAT16

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, action="append", help="default 64, 128")
    ap.add_argument("--seqlen", type=int, action="append", help="default 4096, 16384")
    ap.add_argument("--density", type=float, action="append", help="default 1, 0.25, 0.1")
    ap.add_argument("--pattern", action="append", choices=["random", "local"], help="default random")
    ap.add_argument("--backward", action="store_true", help="the backward calls (attention_backward and "
                    "block_sparse_attention_backward) instead of the forward")
    args = ap.parse_args(argv)

    def kernels_us(call) -> float:
        launches = record_launches(call)
        return replay_us(launches)

    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'d':>4} {'seqlen':>6} {'pattern':>7} {'density':>7} | {'us':>8} {'/ (density x dense)':>20}")
    for d in args.head_dim or [64, 128]:
        for seqlen in args.seqlen or [4096, 16384]:
            batch, heads = 16384 // seqlen, 2048 // d
            rs = cupy.random.default_rng(d)
            q, k, v = (rs.standard_normal((batch, seqlen, heads, d), dtype=numpy.float32).astype(BFLOAT16)
                       for _ in range(3))
            dout = rs.standard_normal((batch, seqlen, heads, d), dtype=numpy.float32).astype(BFLOAT16)

            def call(mask=None):
                if mask is None:
                    out, lse = cupyflash.attention(q, k, v, return_lse=True)
                    if not args.backward:
                        return lambda: cupyflash.attention(q, k, v, return_lse=True)
                    return lambda: cupyflash.attention_backward(dout, q, k, v, out, lse)
                out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
                if not args.backward:
                    return lambda: cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
                return lambda: cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask)

            dense = kernels_us(call())
            print(f"{d:>4} {seqlen:>6} {'dense':>7} {'':>7} | {dense:8.1f}", flush=True)
            for pattern in args.pattern or ["random"]:
                for density in args.density or [1.0, 0.25, 0.1]:
                    mask = bench_sparse.make_mask(pattern, density, seqlen, heads, numpy.random.default_rng(seqlen + d))
                    us = kernels_us(call(mask))
                    print(f"{d:>4} {seqlen:>6} {pattern:>7} {mask.density:7.3f} | {us:8.1f} "
                          f"{us / (mask.density * dense):20.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
