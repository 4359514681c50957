"""Concurrency and lifetime on the GPU (marker `gpu`): problems run at once on two streams and from
two threads give their serial results bit for bit (per-stream workspaces, the dQ ring and its
counters, the persistent schedulers' tile counters); thousands of distinct shapes leave the
caches and the device memory bounded; an out-of-memory call raises, leaves its inputs as they
were, and the next call works. (CUDA graph capture and replay: test_attention_gpu.py,
test_decode_gpu.py, test_wgmma_gpu.py, test_launch_sequence.py.)"""

import threading

import numpy
import pytest

import cupyflash
from shapes import bits, random_qkv

pytestmark = pytest.mark.gpu

# Two problems that take different kernels on every GPU: fixed-length with GQA and a partial last
# tile, and causal with a window.
PROBLEMS = [
    ("bfloat16", (2, 700, 900, 4, 2, 128), {"causal": False}),
    ("float16", (1, 1023, 1024, 2, 2, 64), {"causal": True, "window": (300, 0)}),
]


def inputs(rng, dtype, shape):
    import cupy

    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = shape
    q, k, v = random_qkv(rng, dtype, batch, seqlen_q, seqlen_k, heads, head_dim, heads_kv)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    return [cupy.asarray(x) for x in (q, k, v, dout)]


def forward_backward(q, k, v, dout, options, deterministic):
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **options)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
    return [out, lse, *grads]


def host_bits(results, deterministic):
    """The results' bits on the host: out, lse, dk, dv, and dq when the backward is deterministic
    (otherwise its float atomics sum in any order)."""
    chosen = results if deterministic else results[:2] + results[3:]
    return [bits(x.get()) for x in chosen]


@pytest.mark.parametrize("deterministic", [False, True])
def test_two_streams_at_once_give_the_serial_results(rng, deterministic):
    import cupy

    data = [inputs(rng, dtype, shape) for dtype, shape, _ in PROBLEMS]
    serial = [host_bits(forward_backward(*x, options, deterministic), deterministic)
              for x, (_, _, options) in zip(data, PROBLEMS)]
    cupy.cuda.Device().synchronize()
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in PROBLEMS]
    for _ in range(4):
        results = []
        for x, (_, _, options), stream in zip(data, PROBLEMS, streams):
            with stream:  # both in flight: neither stream waits for the other
                results.append(forward_backward(*x, options, deterministic))
        for stream in streams:
            stream.synchronize()
        for got, want in zip(results, serial):
            for a, b in zip(host_bits(got, deterministic), want):
                numpy.testing.assert_array_equal(a, b)


def test_two_threads_at_once_give_the_serial_results(rng):
    import cupy

    data = [inputs(rng, dtype, shape) for dtype, shape, _ in PROBLEMS]
    serial = [host_bits(forward_backward(*x, options, False), False) for x, (_, _, options) in zip(data, PROBLEMS)]
    cupy.cuda.Device().synchronize()
    failures = []

    def worker(x, options, want):
        try:
            with cupy.cuda.Stream(non_blocking=True) as stream:
                for _ in range(6):
                    got = forward_backward(*x, options, False)
                    stream.synchronize()
                    for a, b in zip(host_bits(got, False), want):
                        numpy.testing.assert_array_equal(a, b)
        except Exception as e:  # reported by the main thread
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(x, options, want))
               for x, (_, _, options), want in zip(data, PROBLEMS, serial)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]


def test_thousands_of_shapes_keep_caches_and_memory_bounded(rng):
    import cupy

    from cupyflash.api import common
    from cupyflash.runtime import workspace

    pool = cupy.get_default_memory_pool()
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "bfloat16", 1, 2000, 2000, 2, 64))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))

    def call(n):
        out, lse = cupyflash.attention(q[:, :n], k[:, : n + 7], v[:, : n + 7], causal=True, return_lse=True)
        cupyflash.attention_backward(dout[:, :n], q[:, :n], k[:, : n + 7], v[:, : n + 7], out, lse, causal=True)

    for n in range(1, 201):
        call(n)
    cupy.cuda.Device().synchronize()
    used, cached = pool.used_bytes(), len(common.CHECKED)
    for n in range(201, 2001):
        call(n)
    cupy.cuda.Device().synchronize()
    assert len(common.CHECKED) <= common.CHECKED_KEPT and len(common.CHECKED) >= min(cached, common.CHECKED_KEPT)
    assert len(workspace.ZEROED) <= 64
    # Workspaces grow with the largest problem (2000 rows here, 10x the first phase's), and
    # nothing else stays: at most a few MB more than after the first 200 shapes.
    assert pool.used_bytes() - used < 64 * 2**20, (used, pool.used_bytes())


def test_out_of_memory_raises_leaves_inputs_and_the_next_call_works(rng):
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float16", 2, 512, 512, 4, 64))
    before = [x.copy() for x in (q, k, v)]
    want = cupyflash.attention(q, k, v, causal=True)
    pool = cupy.get_default_memory_pool()
    limit = pool.get_limit()
    big = cupy.asarray(rng.standard_normal((8, 4096, 16, 128)).astype(numpy.float16))
    try:
        pool.free_all_blocks()
        pool.set_limit(size=pool.total_bytes() + 1024)  # no room for big's output
        with pytest.raises(MemoryError, match="[Oo]ut of memory"):
            cupyflash.attention(big, big, big)
    finally:
        pool.set_limit(size=limit)
    for x, y in zip((q, k, v), before):
        numpy.testing.assert_array_equal(bits(x.get()), bits(y.get()))
    numpy.testing.assert_array_equal(bits(cupyflash.attention(q, k, v, causal=True).get()), bits(want.get()))
