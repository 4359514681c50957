"""Where a small decoding step's GPU time goes: the whole call, the call without its decode kernel
(the host's launches and the graph's own cost), a plain read of the same bytes, a D2D copy, and an
empty graph (CUDA-graph replay, median of CUDA-event batches as in bench.py). Experiment for
benchmarks/NOTES.md. (Before session 12 the split combine was a kernel of its own, and the
breakdown also timed the call without it: results/H100-2026-11-23-decode-breakdown.txt.)

    python benchmarks/decode_breakdown.py [cache_len ...]
"""
import sys

import cupy
import numpy

import cupyflash
from cupyflash import _attention, _validation

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import bench  # noqa: E402
from bench_decode import graph_ms  # noqa: E402

READ = cupy.RawKernel(r"""
extern "C" __global__ void read_all(const uint4* x, long long n, unsigned* out) {
    unsigned acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        uint4 v = x[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}
""", "read_all")


def gqa_step(n: int):
    """q, k, v and lengths of one decoding step: one sequence of n cached keys, 32 query heads over
    8 K/V heads, d128, bfloat16 (the bench's hardest row for the copy-bandwidth target)."""
    dt = _validation.BFLOAT16
    rs = cupy.random.default_rng(n)
    q = rs.standard_normal((1, 1, 32, 128), dtype=numpy.float32).astype(dt)
    k, v = (rs.standard_normal((1, n, 8, 128), dtype=numpy.float32).astype(dt) for _ in range(2))
    return q, k, v, cupy.full(1, n, dtype=numpy.int32)


def main():
    lens = [int(a) for a in sys.argv[1:]] or [8192, 32768]
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    for n in lens:
        q, k, v, lengths = gqa_step(n)
        nbytes = 2 * k.nbytes
        res = {}
        step = lambda: cupyflash.attention_decode(q, k, v, lengths)  # noqa: E731
        res["call"] = graph_ms(step, bench, 0.3)
        real = _attention._launch

        def launch(kernel, device_id, grid, params, *more):
            if "flash_decode_tc" not in kernel.name_expression:
                real(kernel, device_id, grid, params, *more)

        _attention._launch = launch
        try:
            res["without flash_decode_tc"] = graph_ms(step, bench, 0.3)
        finally:
            _attention._launch = real
        buf = cupy.empty(nbytes, numpy.uint8)
        out = cupy.zeros(1, numpy.uint32)
        for blocks_per_sm in (2, 4, 8):
            res[f"read {blocks_per_sm}/SM"] = graph_ms(
                lambda: READ((sms * blocks_per_sm,), (256,), (buf, numpy.int64(nbytes // 16), out)), bench, 0.3)
        dst = cupy.empty_like(buf)
        res["copy"] = bench._median_ms(lambda: dst.data.copy_from_device_async(buf.data, nbytes), 0.3)
        res["empty kernel"] = graph_ms(lambda: READ((1,), (32,), (buf, numpy.int64(0), out)), bench, 0.3)
        copy_gbs = 2 * nbytes / res["copy"] / 1e6
        print(f"# cache {n}: {nbytes / 2**20:.0f} MiB read; copy {copy_gbs:.0f} GB/s; 80% target {nbytes / (0.8 * copy_gbs) / 1e3:.1f} us")
        for name, ms in res.items():
            print(f"  {name:34} {ms * 1e3:8.2f} us   {nbytes / ms / 1e6:6.0f} GB/s")
        del buf, dst, k, v
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
