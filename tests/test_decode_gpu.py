"""KV-cache decoding on the GPU (marker `gpu`): attention_decode against the float64 reference,
sequence by sequence, under the tolerance rule; the in-place append; cache rows past each
sequence's length (NaN here) are never read."""

import numpy
import pytest

import cupyflash
from cupyflash.api import decode
from cupyflash.runtime import workspace
from cupyflash.cpu import reference as cpu_reference
from shapes import DTYPES, HEAD_DIMS, bits, captured, numpy_dtype, replay_into_nan
from rule import Judge, host
from test_attention_gpu import assert_matches_reference

pytestmark = pytest.mark.gpu


def decode_and_check(rng, dtype, *, batch=3, seqlen_q=1, heads=4, heads_kv=4, head_dim=64, cache_len=700,
                     lengths=None, seqlen_new=0, causal=False, window=None, num_splits=None, host_lengths=False,
                     layout="contiguous", softcap=None, alibi=None):
    """One attention_decode call, checked per sequence against `assert_matches_reference` over
    that sequence's keys, and the caches checked bit for bit after the append."""
    import cupy

    dt = numpy_dtype(dtype)
    if lengths is None:
        lengths = rng.integers(0, cache_len - seqlen_new + 1, size=batch)
        lengths[0] = cache_len - seqlen_new  # one sequence fills the cache
    lengths = numpy.asarray(lengths, numpy.int32)

    def array(shape, poison=False):
        x = rng.standard_normal(shape).astype(dt)
        if poison:  # cache rows past each sequence's keys must never be read
            for b, n in enumerate(lengths):
                x[b, n:] = numpy.nan
        if layout == "contiguous":
            return cupy.asarray(x)
        if layout == "padded":  # rows on 16 bytes, head_dim not a multiple of 8: part-filled chunks; NaN past it
            wide = numpy.full(shape[:-1] + (-(-shape[-1] // 16) * 16,), numpy.nan, dt)
            wide[..., : shape[-1]] = x
            return cupy.asarray(wide)[..., : shape[-1]]
        # (batch, heads, seq, head_dim) storage seen as (batch, seq, heads, head_dim): strided.
        return cupy.asarray(numpy.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)

    q = array((batch, seqlen_q, heads, head_dim))
    k_cache, v_cache = (array((batch, cache_len, heads_kv, head_dim), poison=True) for _ in range(2))
    k_new = v_new = None
    if seqlen_new:
        k_new, v_new = array((batch, seqlen_new, heads_kv, head_dim)), array((batch, seqlen_new, heads_kv, head_dim))
    k_before, v_before = k_cache.get(), v_cache.get()

    # ALiBi: "heads" (one row of slopes, on the host) or "batch" (per sequence, on the GPU).
    slopes = None if alibi is None else 2.0 ** (-8.0 * (numpy.arange(heads) + 1) / heads)
    if alibi == "batch":
        slopes = cupy.asarray(slopes * rng.uniform(0.5, 2.0, (batch, heads)), cupy.float32)
    out, lse = cupyflash.attention_decode(
        q, k_cache, v_cache, list(lengths) if host_lengths else cupy.asarray(lengths), k_new=k_new, v_new=v_new,
        causal=causal, window=window, return_lse=True, num_splits=num_splits, softcap=softcap, alibi_slopes=slopes,
    )
    assert isinstance(out, cupy.ndarray) and out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, heads, seqlen_q)

    k_after, v_after = k_cache.get(), v_cache.get()
    for before, after, new in ((k_before, k_after, k_new), (v_before, v_after, v_new)):
        expected = before.copy()
        if new is not None:
            for b, n in enumerate(lengths):
                expected[b, n : n + seqlen_new] = new[b].get()
        numpy.testing.assert_array_equal(bits(after), bits(expected))

    accum = numpy.float64 if dtype == "float64" else numpy.float32  # the slopes as the kernels read them
    seen = None if slopes is None else cpu_reference.as_float64(cpu_reference.as_float64(slopes).astype(accum))
    judge = Judge()
    for b, n in enumerate(lengths + seqlen_new):
        mods = {"softcap": softcap}
        if seen is not None:
            mods["alibi_slopes"] = seen if seen.ndim == 1 else seen[b]
        assert_matches_reference(
            q[b : b + 1], k_after[b : b + 1, :n], v_after[b : b + 1, :n], out[b : b + 1], lse[b : b + 1], dtype,
            causal, window=window, judge=judge, **mods,
        )
    judge.check()
    return out, lse


def assert_decode_matches_reference(out, q, k_cache, v_cache, lengths, dtype, *, k_new=None, v_new=None, causal=False):
    """attention_decode's out against the float64 reference of each sequence's keys (its first
    `lengths[b]` cache rows as they were before the call, then k_new), judged over the batch."""
    q, out, k, v = (host(x) for x in (q, out, k_cache, v_cache))
    lengths = numpy.asarray(host(lengths), numpy.int64).reshape(-1)
    if k_new is not None:
        k_new, v_new = host(k_new), host(v_new)
        for b, n in enumerate(lengths):
            k[b, n : n + k_new.shape[1]], v[b, n : n + k_new.shape[1]] = k_new[b], v_new[b]
        lengths = lengths + k_new.shape[1]
    judge = Judge()
    for b, n in enumerate(lengths):
        assert_matches_reference(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], out[b : b + 1], None, dtype, causal,
                                 judge=judge)
    judge.check()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,heads_kv", [(8, 8), (8, 2), (6, 1)])
@pytest.mark.parametrize("seqlen_q", [1, 5, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode(rng, nan_outputs, dtype, seqlen_q, heads, heads_kv, causal):
    decode_and_check(rng, dtype, seqlen_q=seqlen_q, heads=heads, heads_kv=heads_kv, head_dim=59, cache_len=1031,
                     seqlen_new=seqlen_q, causal=causal)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_every_head_dim_class(rng, nan_outputs, dtype, head_dim):
    decode_and_check(rng, dtype, seqlen_q=2, heads=4, heads_kv=2, head_dim=head_dim, cache_len=333, seqlen_new=2,
                     causal=True)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_decode_one_row_every_head_dim_class(rng, nan_outputs, dtype, head_dim):
    """One query row per K/V head (the CUDA-core kernel staged through shared memory): rows padded
    with NaN past head_dim, a window, splits, and a sequence shorter than a key tile."""
    decode_and_check(rng, dtype, batch=2, seqlen_q=1, heads=3, heads_kv=3, head_dim=head_dim, cache_len=2100,
                     lengths=[2099, 5], seqlen_new=1, causal=True, window=(700, 0), num_splits=3, layout="padded")


@pytest.mark.parametrize("num_splits", [None, 1, 3, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_splits(rng, nan_outputs, dtype, num_splits):
    # A long sequence and a short one: some splits of the short one see no key at all.
    decode_and_check(rng, dtype, batch=2, heads=2, heads_kv=1, head_dim=128, cache_len=9000,
                     lengths=[8999, 3], seqlen_new=1, num_splits=num_splits)


@pytest.mark.parametrize("window", [(0, 0), (17, 0), (100, None), (None, 5), (300, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_decode_window(rng, nan_outputs, dtype, causal, window):
    decode_and_check(rng, dtype, seqlen_q=4, heads=4, heads_kv=2, head_dim=40, cache_len=1500, seqlen_new=4,
                     causal=causal, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_strided_host_lengths_no_append(rng, nan_outputs, dtype):
    decode_and_check(rng, dtype, seqlen_q=3, heads=6, heads_kv=3, head_dim=111, cache_len=517, host_lengths=True,
                     layout="strided")
    decode_and_check(rng, dtype, seqlen_q=1, heads=2, heads_kv=2, head_dim=32, cache_len=300, seqlen_new=7,
                     layout="strided")


@pytest.mark.parametrize("head_dim", [1, 59, 111])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_on_16_bytes_with_an_odd_head_dim(rng, nan_outputs, dtype, head_dim):
    """Rows 16-byte aligned (the queries and tiles go by cp.async) but head_dim not a multiple of 8:
    the last chunk of a row is part-filled, and what lies past head_dim (NaN) is never read."""
    decode_and_check(rng, dtype, seqlen_q=2, heads=8, heads_kv=2, head_dim=head_dim, cache_len=900, seqlen_new=2,
                     causal=True, layout="padded")


def test_decode_more_query_rows_than_a_block(rng, nan_outputs):
    """seqlen_q x group rows above one block's 16 (tensor cores) or 8-16 (CUDA cores)."""
    decode_and_check(rng, "bfloat16", seqlen_q=9, heads=16, heads_kv=2, head_dim=128, cache_len=800, causal=True)
    decode_and_check(rng, "float64", seqlen_q=40, heads=2, heads_kv=1, head_dim=256, cache_len=300, causal=True)


def test_decode_lengths_on_the_host_or_another_framework(rng, nan_outputs):
    import cupy

    decode_and_check(rng, "float32", lengths=numpy.array([5, 0, 700], numpy.int32), host_lengths=True)
    q = cupy.asarray(rng.standard_normal((1, 1, 2, 16)).astype(numpy.float32))
    k = cupy.asarray(rng.standard_normal((1, 40, 2, 16)).astype(numpy.float32))
    want = cupyflash.attention_decode(q, k, k, cupy.asarray([30], numpy.int32))
    for lengths in (30, [30], numpy.array([30], numpy.int64), cupy.asarray([30], numpy.int64)):
        numpy.testing.assert_array_equal(cupyflash.attention_decode(q, k, k, lengths).get(), want.get())
    with pytest.raises(ValueError, match="cache_seqlens on the GPU must be on q's device"):
        cupyflash.attention_decode(q.get(), k.get(), k.get(), cupy.asarray([30], numpy.int32))


def test_decoding_loop_checks_each_step_shape_once(rng, nan_outputs):
    """Steps of one shape are checked once (`decode.CHECKED_STEPS`); every step still computes
    on its own data and lengths, and a call that differs in any checked respect is checked."""
    import cupy

    decode.CHECKED_STEPS.clear()
    k_cache, v_cache = (cupy.asarray(rng.standard_normal((2, 64, 2, 32)).astype(numpy.float32)) for _ in range(2))
    lengths = cupy.asarray([0, 10], numpy.int32)
    for _ in range(5):
        q = cupy.asarray(rng.standard_normal((2, 1, 4, 32)).astype(numpy.float32))
        k_new, v_new = (cupy.asarray(rng.standard_normal((2, 1, 2, 32)).astype(numpy.float32)) for _ in range(2))
        k_before, v_before = k_cache.get(), v_cache.get()
        out = cupyflash.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, causal=True)
        assert_decode_matches_reference(out, q, k_before, v_before, lengths, "float32", k_new=k_new, v_new=v_new,
                                        causal=True)
        lengths += 1
    assert len(decode.CHECKED_STEPS) == 1
    with pytest.raises(ValueError, match="cache_seqlens is required with k_new"):
        cupyflash.attention_decode(q, k_cache, v_cache, None, k_new=k_new, v_new=v_new)
    with pytest.raises(TypeError, match="k_new must have q's dtype"):
        cupyflash.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new.astype(numpy.float64), v_new=v_new)
    strided = cupy.asarray([3, -7, 40, -7], numpy.int32)[::2]  # read in order, not as stored
    for _ in range(2):
        out = cupyflash.attention_decode(q, k_cache, v_cache, strided)
        assert_decode_matches_reference(out, q, k_cache, v_cache, [3, 40], "float32")


def test_decode_empty_caches(rng, nan_outputs):
    import cupy

    out, lse = decode_and_check(rng, "float16", lengths=[0, 0, 0])
    assert not out.any() and bool(cupy.isneginf(lse).all())


def test_decode_scalar_path_for_16_bit(rng, nan_outputs, scalar_kernels):
    """16-bit decoding on the CUDA-core kernel (what GPUs older than sm_80 run)."""
    decode_and_check(rng, "float16", seqlen_q=4, heads=8, heads_kv=2, head_dim=96, cache_len=900, seqlen_new=4,
                     causal=True)
    decode_and_check(rng, "bfloat16", seqlen_q=1, heads=4, heads_kv=4, head_dim=256, cache_len=400, window=(50, 0))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_equals_attention_on_the_same_keys(rng, dtype):
    """A full cache, no append: attention's semantics (causal from the bottom right), judged
    against the float64 reference as attention() is (not bitwise: the key order of the sums
    differs)."""
    import cupy

    dt = numpy_dtype(dtype)
    q = cupy.asarray(rng.standard_normal((2, 3, 4, 64)).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((2, 2000, 2, 64)).astype(dt)) for _ in range(2))
    out, lse = cupyflash.attention_decode(q, k, v, causal=True, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, dtype, True)


def test_numpy_caches_are_appended_on_the_host(rng):
    q = rng.standard_normal((2, 1, 4, 32)).astype(numpy.float32)
    k_cache, v_cache = (rng.standard_normal((2, 50, 2, 32)).astype(numpy.float32) for _ in range(2))
    k_new, v_new = (rng.standard_normal((2, 1, 2, 32)).astype(numpy.float32) for _ in range(2))
    lengths = numpy.array([3, 49], numpy.int32)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    out = cupyflash.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new)
    assert isinstance(out, numpy.ndarray)
    assert_decode_matches_reference(out, q, k_before, v_before, lengths, "float32", k_new=k_new, v_new=v_new)
    numpy.testing.assert_array_equal(k_cache[0, 3], k_new[0, 0])
    numpy.testing.assert_array_equal(v_cache[1, 49], v_new[1, 0])


def test_torch_caches_are_appended_in_place(rng):
    torch = pytest.importorskip("torch")
    device = torch.device("cuda")
    q = torch.randn(2, 1, 8, 128, device=device, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(2, 4096, 2, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([100, 4095], device=device, dtype=torch.int32)
    out = cupyflash.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    assert torch.equal(k_cache[0, 100], k_new[0, 0]) and torch.equal(v_cache[1, 4095], v_new[1, 0])
    assert_decode_matches_reference(out, q, k_cache, v_cache, lengths.cpu().numpy() + 1, "bfloat16")


def test_jax_caches_are_read_and_never_appended_to(rng, jax_gpu):
    jax = jax_gpu
    import jax.numpy as jnp

    q = jnp.asarray(rng.standard_normal((2, 1, 4, 64)).astype(numpy.float32))
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((2, 300, 2, 64)).astype(numpy.float32)) for _ in range(2))
    lengths = numpy.array([17, 300], numpy.int32)
    out = cupyflash.attention_decode(q, k_cache, v_cache, lengths)
    assert isinstance(out, jax.Array)
    assert_decode_matches_reference(*(numpy.asarray(x) for x in (out, q, k_cache, v_cache)), lengths, "float32")
    k_new = jnp.zeros((2, 1, 2, 64), jnp.float32)
    with pytest.raises(TypeError, match="JAX arrays, which are immutable"):
        cupyflash.attention_decode(q, k_cache, v_cache, [0, 0], k_new=k_new, v_new=k_new)


@pytest.mark.parametrize("softcap,alibi", [(2.0, None), (None, "heads"), (5.0, "batch")])
@pytest.mark.parametrize("heads,heads_kv,seqlen_q", [(8, 2, 1), (6, 1, 5), (4, 4, 16)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_softcap_and_alibi(rng, nan_outputs, dtype, heads, heads_kv, seqlen_q, softcap, alibi):
    """Softcap and ALiBi with each query at its own position in the cache (causal and not, with an
    append, GQA/MQA, split and unsplit), on the tensor-core and CUDA-core decode kernels."""
    for causal, num_splits in ((True, None), (False, 1)):
        decode_and_check(rng, dtype, seqlen_q=seqlen_q, heads=heads, heads_kv=heads_kv, head_dim=59, cache_len=1031,
                         seqlen_new=seqlen_q, causal=causal, num_splits=num_splits, softcap=softcap, alibi=alibi)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_decode_softcap_and_alibi_scalar_kernel_and_window(rng, nan_outputs, scalar_kernels, head_dim):
    decode_and_check(rng, "bfloat16", seqlen_q=3, heads=4, heads_kv=2, head_dim=head_dim, cache_len=900,
                     seqlen_new=3, causal=True, window=(100, None), softcap=3.0, alibi="batch")


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_decode_split_merge_counters(rng, nan_outputs, dtype):
    """The splits are merged by the last block of each row group to finish, counted in a buffer
    per stream that every launch leaves zeroed: calls of other shapes and split counts one after
    another all match the reference and leave it zeroed."""
    import cupy

    for num_splits, heads, heads_kv, seqlen_q, head_dim in ((7, 8, 2, 1, 128), (128, 4, 4, 3, 59), (2, 6, 1, 16, 256)):
        decode_and_check(rng, dtype, batch=2, seqlen_q=seqlen_q, heads=heads, heads_kv=heads_kv, head_dim=head_dim,
                         cache_len=2000, num_splits=num_splits)
    cupy.cuda.Device().synchronize()
    assert workspace.ZEROED and not any(c.owner.any() for c in workspace.ZEROED.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_decode_captured_in_a_graph_replays_on_another_stream(rng, dtype):
    """A captured step keeps its workspace and split counters (the caller keeps out and lse), so
    its replays on another stream give the direct call's bits."""
    import cupy

    dt = numpy_dtype(dtype)
    q = cupy.asarray(rng.standard_normal((2, 1, 8, 64)).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((2, 4096, 2, 64)).astype(dt)) for _ in range(2))
    want = [x.get() for x in cupyflash.attention_decode(q, k, v, num_splits=16, return_lse=True)]
    graph, outputs, _ = captured(lambda: cupyflash.attention_decode(q, k, v, num_splits=16, return_lse=True))
    other = cupy.cuda.Stream(non_blocking=True)
    for _ in range(3):
        replay_into_nan(graph, outputs, other)
        other.synchronize()
        for got, expected in zip(outputs, want):
            numpy.testing.assert_array_equal(bits(got.get()), bits(expected))
