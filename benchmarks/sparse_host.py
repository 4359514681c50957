"""Host time against kernel time on the sparse grid's short rows, a development tool.

    python benchmarks/sparse_host.py [--profile]

For the 4096-token rows of `bench --sparse` at low density (batch 4, hidden 2048, bfloat16) it
prints, per direction, in microseconds:
  call    the grid's figure (bench._median_ms: back-to-back calls, CUDA events), which is the
          host's time per call wherever the host is slower than the GPU;
  kernels the call's launches replayed alone, back to back (the GPU's time per call);
  host    wall time to queue one call (perf_counter over 200 calls, before the GPU catches up),
          with Python's cyclic garbage collector on and off;
  gc      collections per 1000 calls (generations 0/1/2) with the collector on.
With --profile, a cProfile run of the d64 random 0.1 forward and backward calls follows (the
calls' results dropped as they come, as in the grid's loop). With --torch, torch is imported and
a FlexAttention call compiled first, as in the grid's process.
"""

import argparse
import cProfile
import gc
import io
import math
import pathlib
import pstats
import sys
import time

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def main(argv=None):
    import cupy

    import bench
    import bench_sparse
    import cupyflash
    from cupyflash import _attention
    from cupyflash._validation import BFLOAT16

    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--density", type=float, action="append", help="default 0.25 0.1 0.05")
    ap.add_argument("--torch", action="store_true", help="import torch and compile FlexAttention first")
    args = ap.parse_args(argv)
    if args.torch:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        x = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
        mask = create_block_mask(lambda b, h, i, j: i >= j, 1, 1, 256, 256)
        torch.compile(flex_attention)(x, x, x, block_mask=mask)
        torch.cuda.synchronize()
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'d':>4} {'pattern':>7} {'density':>7} {'dir':>3} | {'call':>6} {'kernels':>7} {'host':>6} "
          f"{'no gc':>6} | gc per 1000 calls")
    seqlen = 4096
    for d in (64, 128):
        batch, heads = 16384 // seqlen, 2048 // d
        rs = cupy.random.default_rng(d)
        q, k, v, dout = (rs.standard_normal((batch, seqlen, heads, d), dtype=numpy.float32).astype(BFLOAT16)
                         for _ in range(4))
        for pattern in ("random", "local"):
            for density in args.density or [0.25, 0.1, 0.05]:
                mask = bench_sparse.make_mask(pattern, density, seqlen, heads, numpy.random.default_rng(seqlen + d))
                out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
                calls = {
                    "fwd": lambda: cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True),
                    "bwd": lambda: cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask),
                }
                for direction, call in calls.items():
                    row = _measure(cupy, bench, _attention, call)
                    print(f"{d:>4} {pattern:>7} {mask.density:7.3f} {direction:>3} | {row['call']:6.1f} "
                          f"{row['kernels']:7.1f} {row['host']:6.1f} {row['no gc']:6.1f} | {row['gc']}")
                    if args.profile and d == 64 and pattern == "random" and math.isclose(density, 0.1):
                        profile = cProfile.Profile()
                        profile.runcall(_repeat, call, 300)
                        cupy.cuda.Device().synchronize()
                        text = io.StringIO()
                        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
                        print(text.getvalue())
    return 0


def _repeat(call, n):
    for _ in range(n):
        call()


def _measure(cupy, bench, _attention, call) -> dict:
    from bwd_breakdown import record_launches

    row = {"call": bench._median_ms(call, 0.3) * 1e3}
    launches = record_launches(call)
    real_launch = _attention._launch

    def replay():
        for kernel, device_id, grid, params, more in launches:
            real_launch(kernel, device_id, grid, params, *more)

    row["kernels"] = bench._median_ms(replay, 0.3) * 1e3
    for label, collect in (("host", True), ("no gc", False)):
        cupy.cuda.Device().synchronize()
        if not collect:
            gc.disable()
        before = [s["collections"] for s in gc.get_stats()]
        start = time.perf_counter()
        for _ in range(200):
            call()
        row[label] = (time.perf_counter() - start) / 200 * 1e6
        after = [s["collections"] for s in gc.get_stats()]
        gc.enable()
        if collect:
            row["gc"] = "/".join(f"{(b - a) * 5:g}" for a, b in zip(before, after))
        cupy.cuda.Device().synchronize()
    return row


if __name__ == "__main__":
    sys.exit(main())
