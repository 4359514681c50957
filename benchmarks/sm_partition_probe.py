"""Would the backward's fixed passes hide behind the dK/dV kernel on SMs of their own? A probe.

    python benchmarks/sm_partition_probe.py [--rows d128-random-0.1 ...] [--sms 132 --sms 120 ...]

The block-sparse backward runs three launches: the preprocess (D_i, and the float32 dQ workspace
cleared), the warp-specialised dK/dV kernel, the conversion (workspace -> dq). The first and last
are memory-bound and density-independent; at density 0.1 and 4096 tokens they are ~135 us of a
~490 us call. One design would give them P SMs of the dK/dV launch (a persistent kernel whose
blocks past the dK/dV ones run the passes slab by slab, ahead of and behind the dK/dV items).
This measures its two unknowns on the lent GPU, without building it:

  1. the dK/dV launch alone with fewer blocks (grid = N of the SMs, `_attention._sm_count`
     patched): how its time grows when it gives up 132 - N SMs;
  2. a stand-in for the passes' traffic (reads of two arrays, writes of zeros twice their size;
     16-byte loads, --unroll of them in flight a thread) on P blocks of 384 threads, one an SM (they
     ask for 200 KB of shared memory), alone and while the dK/dV launch runs on the other SMs
     (two streams): its bandwidth, and what each does to the other.

Prints, per row, the call's three launches alone, the whole call replayed, and for each N the
dK/dV launch alone, the stand-in alone on 132 - N blocks, and both together (the pair's span).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

STREAM_SOURCE = r"""
// Reads a and b (n 16-byte words each), writes zeros to c (2n words): the preprocess's traffic
// (O_i and dO_i read, the workspace cleared), UNROLL loads of each array in flight a thread.
extern "C" __global__ void __launch_bounds__(384, 1)
stream_pass(const uint4* __restrict__ a, const uint4* __restrict__ b, uint4* __restrict__ c,
            unsigned int* __restrict__ sink, long long n) {
    const long long threads = (long long)gridDim.x * blockDim.x;
    unsigned int acc = 0;
    for (long long base = blockIdx.x * (long long)blockDim.x + threadIdx.x; base < n; base += threads * UNROLL) {
        uint4 x[UNROLL], y[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long i = base + u * threads;
            x[u] = i < n ? __ldcs(a + i) : make_uint4(0, 0, 0, 0);
            y[u] = i < n ? __ldcs(b + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long i = base + u * threads;
            if (i < n) {
                __stcs(c + i, make_uint4(0, 0, 0, 0));
                __stcs(c + n + i, make_uint4(0, 0, 0, 0));
            }
            acc ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w ^ y[u].x ^ y[u].y ^ y[u].z ^ y[u].w;
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads
}
"""

ROWS = {  # label: (head_dim, pattern, density)
    "d128-random-0.1": (128, "random", 0.1),
    "d128-local-0.1": (128, "local", 0.1),
    "d128-random-0.25": (128, "random", 0.25),
    "d64-random-0.1": (64, "random", 0.1),
}


def _median_us(fn, n: int = 25) -> float:
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    fn()
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    return float(numpy.median(times))


def main(argv=None):
    import cupy

    import bench_sparse
    import bwd_breakdown
    import cupyflash
    from cupyflash import _attention
    from cupyflash._validation import BFLOAT16

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", action="append", choices=sorted(ROWS))
    ap.add_argument("--sms", type=int, action="append", help="blocks of the dK/dV launch (default 132 124 120 116)")
    ap.add_argument("--unroll", type=int, default=8)
    ap.add_argument("--stream-mb", type=float, default=134.0, help="MB read from each of the stand-in's two arrays")
    args = ap.parse_args(argv)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    sm_total = props["multiProcessorCount"]
    print(f"device: {props['name'].decode()}, {sm_total} SMs")

    module = cupy.RawModule(code=STREAM_SOURCE, options=(f"-DUNROLL={args.unroll}",))
    stream_kernel = module.get_function("stream_pass")
    stream_kernel.max_dynamic_shared_size_bytes = 200 * 1024
    words = int(args.stream_mb * 1e6) // 16
    a = cupy.random.random(words * 2, dtype=numpy.float64).view(numpy.uint64)  # 16 bytes a word
    b = cupy.random.random(words * 2, dtype=numpy.float64).view(numpy.uint64)
    c = cupy.empty(words * 4, numpy.uint64)
    sink = cupy.zeros(1, numpy.uint32)
    moved_mb = 4 * words * 16 / 1e6  # read a and b, write c

    def stream_pass(blocks):
        stream_kernel((blocks,), (384,), (a, b, c, sink, numpy.int64(words)), shared_mem=200 * 1024)

    print(f"stand-in: reads {2 * words * 16 / 1e6:.0f} MB, writes {2 * words * 16 / 1e6:.0f} MB, "
          f"{args.unroll} 16-byte loads of each array in flight a thread")
    for blocks in (sm_total, 32, 24, 16, 12, 8):
        us = _median_us(lambda: stream_pass(blocks))
        print(f"  stand-in alone on {blocks:>3} blocks: {us:8.1f} us, {moved_mb / us:6.2f} TB/s")

    real_sm_count = _attention._sm_count
    side, main_stream = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    for label in args.rows or list(ROWS):
        d, pattern, density = ROWS[label]
        s, batch, heads = 4096, 4, 2048 // d
        q, k, v, dout = (cupy.random.standard_normal((batch, s, heads, d), dtype=numpy.float32).astype(BFLOAT16)
                         for _ in range(4))
        mask = bench_sparse.make_mask(pattern, density, s, heads, numpy.random.default_rng(s + d))
        out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)

        def call():
            return cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask)

        launches = bwd_breakdown.record_launches(call)
        if len(launches) != 3:
            raise RuntimeError(f"{label}: expected preprocess, dK/dV, conversion; got {len(launches)} launches")
        alone = [_median_us(lambda launch=launch: _attention._launch(*launch[:4], *launch[4])) for launch in launches]
        whole = bwd_breakdown.replay_us(launches)
        print(f"\n{label} (density {mask.density:.4f}): preprocess {alone[0]:.1f}, dK/dV {alone[1]:.1f}, "
              f"conversion {alone[2]:.1f} us alone; the call's launches replayed {whole:.1f} us")
        print(f"  {'N':>4} {'dK/dV':>8} {'x 132':>6} | {'P':>3} {'stand-in':>9} {'TB/s':>5} | "
              f"{'together':>9} {'dK/dV in it':>11}")
        for n in args.sms or [132, 124, 120, 116]:
            _attention._sm_count = lambda device_id, n=n: n
            try:
                dkdv = bwd_breakdown.record_launches(call)[1]
            finally:
                _attention._sm_count = real_sm_count
            if dkdv[2][0] != n:
                raise RuntimeError(f"{label}: the dK/dV grid is {dkdv[2]}, not {n} blocks")

            def run_dkdv(dkdv=dkdv):
                _attention._launch(*dkdv[:4], *dkdv[4])

            t_dkdv = _median_us(run_dkdv)
            p = sm_total - n
            t_stream = _median_us(lambda: stream_pass(p)) if p else float("nan")
            together = dkdv_in = float("nan")
            if p:
                # The stand-in first, so that its blocks hold P SMs; the dK/dV launch then fills the rest.
                begin, mid, end = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
                spans, inner = [], []
                for _ in range(15):
                    begin.record(main_stream)
                    side.wait_event(begin)
                    with side:
                        stream_pass(p)
                    with main_stream:
                        run_dkdv()
                        mid.record(main_stream)
                    main_stream.wait_event(side.record())
                    end.record(main_stream)
                    end.synchronize()
                    spans.append(cupy.cuda.get_elapsed_time(begin, end) * 1e3)
                    inner.append(cupy.cuda.get_elapsed_time(begin, mid) * 1e3)
                together, dkdv_in = float(numpy.median(spans)), float(numpy.median(inner))
            print(f"  {n:>4} {t_dkdv:8.1f} {t_dkdv / alone[1]:6.3f} | {p:>3} {t_stream:9.1f} "
                  f"{moved_mb / t_stream if p else float('nan'):5.2f} | {together:9.1f} {dkdv_in:11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
