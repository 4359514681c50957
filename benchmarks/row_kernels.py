"""The backward's row kernels (preprocess with the dQ workspace's clear; the dQ conversion) in
each of their launch shapes, a development tool.

    python benchmarks/row_kernels.py [--head-dim 64] [--seqlen 4096]

Records the launches of one dense attention_backward call (bfloat16; batch x seqlen = 16384 tokens,
hidden 2048, as the sparse grid), then replays the two row kernels alone with kRowsPerBlock 32,
64 and 128, the blocks taking rows within a head or heads within a row block (kHeadsFastest, the
traits table's choice with 32 rows): median time (cupyx.profiler.benchmark), the bandwidth over
the bytes each must move, and whether each shape's results equal the first shape's (32 rows,
heads slow: D, lse_log2, the cleared workspace; dq) bit for bit.
"""

import argparse
import dataclasses
import sys

import numpy


def device_view(ptr: int, count: int, dtype):
    import cupy

    memory = cupy.cuda.UnownedMemory(ptr, count * numpy.dtype(dtype).itemsize, None)
    return cupy.ndarray((count,), dtype, cupy.cuda.MemoryPointer(memory, 0))


def main(argv=None) -> int:
    import cupy
    from cupyx.profiler import benchmark

    import cupyflash
    from cupyflash import _attention
    from cupyflash._validation import BFLOAT16
    from bwd_breakdown import record_launches

    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, action="append")
    ap.add_argument("--seqlen", type=int, action="append")
    ap.add_argument("--n-repeat", type=int, default=30)
    args = ap.parse_args(argv)
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'kernel':10} {'d':>4} {'seqlen':>6} {'rows':>4} {'heads fastest':>13} | {'us':>7} {'TB/s':>5} same bits")
    for d in args.head_dim or [64, 128]:
        for s in args.seqlen or [4096, 16384]:
            b, h = max(1, 16384 // s), 2048 // d
            q, k, v, dout = (cupy.random.standard_normal((b, s, h, d), dtype=numpy.float32).astype(BFLOAT16)
                             for _ in range(4))
            out, lse = cupyflash.attention(q, k, v, return_lse=True)
            # The call's own arrays (row statistics, workspace) are kept: freed, the pool would hand
            # their memory to the copies below.
            kept, empty = [], cupy.empty
            cupy.empty = lambda *a, **kw: kept.append(empty(*a, **kw)) or kept[-1]
            try:
                launches = record_launches(lambda: cupyflash.attention_backward(dout, q, k, v, out, lse))
            finally:
                cupy.empty = empty
            rows = b * s * h
            moved = {"preprocess": rows * d * (2 + 2 + 4) + rows * 4 * 3, "convert_dq": rows * d * (4 + 2)}
            for kernel, dev, _, params, more in (launches[0], launches[2]):
                p = params[0]
                if kernel.step == "preprocess":
                    outputs = [(p["d"], rows, numpy.float32), (p["lse_log2"], rows, numpy.float32),
                               (p["dq_accum"], rows * d, numpy.float32)]
                else:
                    outputs = [(int(p["dq"]), rows * d, numpy.uint16)]
                want = None
                for per_block in (32, 64, 128):
                    for heads_fastest in (False, True):
                        variant = dataclasses.replace(kernel, rows_per_block=per_block, heads_fastest=heads_fastest)
                        grid = variant.grid(b, h, s)
                        views = [device_view(int(ptr), n, dt) for ptr, n, dt in outputs]
                        for x in views:
                            x.view(numpy.uint8).fill(0xFF)
                        _attention._launch(variant, dev, grid, params, *more)
                        got = [x.copy() for x in views]
                        if want is None:
                            want = got
                        same = all(bool((x.view(numpy.uint8) == y.view(numpy.uint8)).all()) for x, y in zip(got, want))
                        t = benchmark(lambda: _attention._launch(variant, dev, grid, params, *more),
                                      n_repeat=args.n_repeat, n_warmup=3)
                        us = float(numpy.median(t.gpu_times[0])) * 1e6
                        print(f"{kernel.step:10} {d:>4} {s:>6} {per_block:>4} {str(heads_fastest):>13} | {us:7.1f} "
                              f"{moved[kernel.step] / us / 1e6:5.2f} {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
