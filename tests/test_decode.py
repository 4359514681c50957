"""KV-cache decoding on the CPU: the float64 reference against brute force, the no-GPU fallback
(and its in-place append) against the reference, the split heuristic, and input validation."""

import numpy
import pytest

import cupyflash
from cupyflash import catalog, reference, validation
from cupyflash.catalog.decode import DecodeKernelBase
from cupyflash.catalog.tiles import DECODE_MAX_SPLITS, DTYPE_NAMES, PADDED_HEAD_DIMS, TENSOR_CORE_DTYPES
from cupyflash.dispatch.decode import choose_splits
from test_variants import brute_force


def random_decode(rng, batch=3, seqlen_q=2, heads=4, heads_kv=2, head_dim=16, cache_len=40, seqlen_new=2,
                  dtype=numpy.float64):
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((batch, cache_len, heads_kv, head_dim)).astype(dtype) for _ in range(2))
    k_new, v_new = (rng.standard_normal((batch, seqlen_new, heads_kv, head_dim)).astype(dtype) for _ in range(2))
    return q, k_cache, v_cache, k_new, v_new


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (3, 0), (None, 1)])
def test_reference_decode_against_brute_force(rng, causal, window):
    q, k_cache, v_cache, k_new, v_new = random_decode(rng)
    lengths = numpy.array([0, 7, 38])
    k_before = k_cache.copy()
    got = reference.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, causal=causal,
                                     window=window)
    numpy.testing.assert_array_equal(k_cache, k_before)  # the reference appends to copies
    left, right = window or (None, None)
    right = 0 if causal else right
    for b, n in enumerate(lengths):
        keys = numpy.concatenate([k_cache[b : b + 1, :n], k_new[b : b + 1]], axis=1)
        values = numpy.concatenate([v_cache[b : b + 1, :n], v_new[b : b + 1]], axis=1)
        offset = keys.shape[1] - q.shape[1]

        def visible(i, j):
            return (left is None or j >= i + offset - left) and (right is None or j <= i + offset + right)

        want = brute_force(q[b : b + 1], keys, values, 1 / 4, visible)
        numpy.testing.assert_allclose(got[b : b + 1], want, atol=1e-12)


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
def test_fallback_decodes_and_appends_in_place(rng, dtype):
    q, k_cache, v_cache, k_new, v_new = random_decode(rng, dtype=dtype)
    lengths = numpy.array([5, 0, 38], numpy.int32)
    want, want_lse = reference.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new,
                                                causal=True, return_lse=True)
    k_before = k_cache.copy()
    out, lse = cupyflash.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, causal=True,
                                          return_lse=True)
    assert out.dtype == dtype and lse.dtype == (numpy.float64 if dtype == numpy.float64 else numpy.float32)
    tol = 1e-12 if dtype == numpy.float64 else 1e-5
    numpy.testing.assert_allclose(out, want, atol=tol)
    numpy.testing.assert_allclose(lse, want_lse, atol=tol)
    for b, n in enumerate(lengths):
        numpy.testing.assert_array_equal(k_cache[b, n : n + 2], k_new[b])
        numpy.testing.assert_array_equal(k_cache[b, :n], k_before[b, :n])
        numpy.testing.assert_array_equal(k_cache[b, n + 2 :], k_before[b, n + 2 :])


@pytest.mark.cpu_only
def test_fallback_whole_cache_without_lengths(rng):
    q, k_cache, v_cache, _, _ = random_decode(rng)
    out = cupyflash.attention_decode(q, k_cache, v_cache, window=(10, 0))
    numpy.testing.assert_allclose(out, cupyflash.reference.attention(q, k_cache, v_cache, window=(10, 0)), atol=1e-12)


@pytest.mark.parametrize(
    "change,error,message",
    [
        (dict(k_new=None), ValueError, "k_new and v_new must be given together"),
        (dict(cache_seqlens=None), ValueError, "cache_seqlens is required with k_new"),
        (dict(cache_seqlens=numpy.array([1, 2])), ValueError, r"cache_seqlens must have shape \(batch,\) = \(3,\)"),
        (dict(cache_seqlens=numpy.array([1.0, 2.0, 3.0])), TypeError, "cache_seqlens must have an integer dtype"),
        (dict(cache_seqlens=numpy.array([0, 1, 39])), ValueError, r"cache_seqlens must lie in \[0, cache_len - seqlen_new\]"),
        (dict(cache_seqlens=-1), ValueError, "cache_seqlens must lie in"),
        (dict(cache_seqlens="3"), TypeError, "cache_seqlens must be None, an int, or an integer array"),
        (dict(num_splits=0), ValueError, "num_splits must be at least 1"),
        (dict(num_splits=129), ValueError, "num_splits must be at most 128"),
        (dict(num_splits=2.0), TypeError, "num_splits must be an int"),
        (dict(k_cache="k"), TypeError, "k_cache must be an array"),
        (dict(k_cache=numpy.zeros((3, 40, 3, 16))), ValueError, "k_cache must have shape"),
        (dict(v_cache=numpy.zeros((3, 41, 2, 16))), ValueError, "k_cache and v_cache must have the same cache_len"),
        (dict(k_new=numpy.zeros((3, 2, 2, 15))), ValueError, r"k_new must have shape \(batch=3, seqlen_new"),
        (dict(v_new=numpy.zeros((3, 1, 2, 16))), ValueError, "k_new and v_new must have the same seqlen_new"),
        (dict(k_new=numpy.zeros((3, 2, 2, 16), numpy.float32)), TypeError, "k_new must have q's dtype"),
        (dict(window=(1, 2, 3)), TypeError, "window must be None or a pair"),
        (dict(causal=1), TypeError, "causal must be True or False"),
    ],
)
def test_bad_decode_arguments(rng, change, error, message):
    q, k_cache, v_cache, k_new, v_new = random_decode(rng)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=numpy.array([0, 1, 2]), k_new=k_new, v_new=v_new)
    args.update(change)
    before = [x.copy() for x in (k_cache, v_cache)]
    with pytest.raises(error, match=message):
        cupyflash.attention_decode(**args)
    for x, y in zip((k_cache, v_cache), before):  # nothing was appended
        numpy.testing.assert_array_equal(x, y)


def test_read_only_cache_is_refused(rng):
    q, k_cache, v_cache, k_new, v_new = random_decode(rng)
    k_cache.flags.writeable = False
    with pytest.raises(ValueError, match="k_cache is read-only"):
        cupyflash.attention_decode(q, k_cache, v_cache, 3, k_new=k_new, v_new=v_new)


def test_split_heuristic():
    slots = 132 * 2
    assert choose_splits(blocks=264, key_tiles=1024, slots=slots) == 1  # a full wave already
    assert choose_splits(blocks=4, key_tiles=7, slots=slots) == 1  # too few tiles to split
    for blocks in (1, 4, 8, 32, 100):
        for tiles in (8, 100, 1024):
            splits = choose_splits(blocks=blocks, key_tiles=tiles, slots=slots)
            assert 1 <= splits <= min(DECODE_MAX_SPLITS, tiles // 4)
    # One sequence of 32 heads over 1024 tiles: split until about a wave or more of blocks.
    assert 32 * choose_splits(blocks=32, key_tiles=1024, slots=slots) >= 0.8 * slots
    # The shortest critical path: 8 blocks over 128 tiles take 32 splits of 4 tiles, not 31 (whose
    # longest split has 5 tiles, as with 26), and never a count whose longest split is no shorter
    # than the count below's.
    assert choose_splits(blocks=8, key_tiles=128, slots=slots) == 32
    # The tensor-core kernel counts one block per SM: 16 splits of 8 tiles, where 32 of 4 would
    # make two waves (two blocks on most SMs) with no shorter path.
    assert choose_splits(blocks=8, key_tiles=128, slots=132) == 16
    for blocks in (1, 3, 8, 20):
        for tiles in (9, 100, 128, 333, 1024):
            s = choose_splits(blocks=blocks, key_tiles=tiles, slots=slots)
            assert s == 1 or -(-tiles // s) < -(-tiles // (s - 1)), (blocks, tiles, s)


def test_decode_instantiations_cover_every_dtype_and_head_dim():
    kernels = [k for k in catalog.all_kernels() if isinstance(k, DecodeKernelBase)]
    for name in DTYPE_NAMES:
        for d in PADDED_HEAD_DIMS:
            for rows in (2, 4, 5, 8, 16):
                assert catalog.decode_kernel(name, d, rows=rows) in kernels
            assert catalog.decode_kernel(name, d, one_row=True, score_mod=True) in kernels
            if name in TENSOR_CORE_DTYPES:
                assert catalog.decode_kernel(name, d, tensor_cores=True) in kernels
    with pytest.raises(ValueError, match="tensor-core decode kernel takes float16 or bfloat16"):
        catalog.decode_kernel("float32", 64, tensor_cores=True)


def test_one_row_per_kv_head_takes_the_staged_cuda_core_kernel():
    """Where the tensor cores do not serve, a K/V head with one query row (seqlen_q 1, no GQA)
    takes the kernel staged through shared memory; more rows the per-lane one."""
    from cupyflash.catalog.decode import DecodeKernel, DecodeStagedKernel
    from cupyflash.dispatch import decode as planner
    from cupyflash.dispatch.policy import current
    from cupyflash.problem import DecodeProblem
    from cupyflash.runtime.device import DeviceInfo

    a100 = DeviceInfo(-1, "an A100-like device", 80, 108, 163 * 1024, 164 * 1024)
    for dtype, heads_kv, seqlen_q, kind in [("float32", 8, 1, DecodeStagedKernel),
                                            ("float64", 8, 1, DecodeStagedKernel),
                                            ("float32", 2, 1, DecodeKernel), ("float64", 8, 2, DecodeKernel)]:
        p = validation.check_attention_args(
            numpy.zeros((1, seqlen_q, 8, 64), dtype), *(numpy.zeros((1, 100, heads_kv, 64), dtype),) * 2,
            causal=False, scale=None, return_lse=True, window=None, softcap=None)
        kernel = planner.decode_kernel(DecodeProblem(p, 0, None, None), a100, current())
        assert type(kernel) is kind, (dtype, heads_kv, seqlen_q)
        if kind is DecodeKernel:  # built for the fewest rows that hold the K/V head's rows
            assert kernel.rows == max(4, seqlen_q * 8 // heads_kv), (dtype, heads_kv, seqlen_q, kernel.rows)
    for d in PADDED_HEAD_DIMS:  # every staged build fits an A100's shared memory
        assert all(DecodeStagedKernel(name, d).smem_bytes <= a100.smem_per_block for name in DTYPE_NAMES)


def test_decoding_before_sm_80_is_refused_saying_why():
    from cupyflash.dispatch import decode as planner
    from cupyflash.dispatch.policy import current
    from cupyflash.problem import DecodeProblem
    from cupyflash.runtime.device import described

    p = validation.check_attention_args(numpy.zeros((1, 1, 8, 64), numpy.float16),
                                        *(numpy.zeros((1, 100, 8, 64), numpy.float16),) * 2,
                                        causal=False, scale=None, return_lse=True, window=None, softcap=None)
    with pytest.raises(ValueError, match="attention_decode needs sm_80 or newer.*sm_75"):
        planner.decode_kernel(DecodeProblem(p, 0, None, None), described(75), current())


def test_cuda_core_decode_builds_for_the_fewest_rows_that_hold_them():
    from cupyflash.catalog.decode import DecodeKernel

    assert [catalog.decode_kernel("float32", 128, rows=r).rows for r in (2, 4, 5, 8, 9, 16)] == [4, 4, 8, 8, 16, 16]
    assert catalog.decode_kernel("float64", 128, rows=16).rows == 8  # at most tiles.decode_rows
    assert DecodeKernel("float64", 128) == DecodeKernel("float64", 128, rows=8)
    with pytest.raises(ValueError, match="no 16-row CUDA-core decode build for float64 d128"):
        DecodeKernel("float64", 128, rows=16)


@pytest.mark.cpu_only
@pytest.mark.parametrize("slopes_shape", [(4,), (3, 4)])
def test_fallback_softcap_and_alibi(rng, slopes_shape):
    """Softcap and ALiBi with each query at its own cache position: the reference per sequence
    (`attention` with per-sequence slopes), which the fallback and the kernels follow."""
    q, k_cache, v_cache, k_new, v_new = random_decode(rng, dtype=numpy.float64)
    lengths = numpy.array([5, 0, 38], numpy.int32)
    slopes = rng.uniform(0.01, 0.5, slopes_shape)
    options = {"causal": True, "softcap": 2.5, "alibi_slopes": slopes, "return_lse": True}
    want, want_lse = reference.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, **options)
    for b, n in enumerate(lengths + 2):
        keys = numpy.concatenate([k_cache[b : b + 1, : n - 2], k_new[b : b + 1]], axis=1)
        values = numpy.concatenate([v_cache[b : b + 1, : n - 2], v_new[b : b + 1]], axis=1)
        row = slopes if slopes.ndim == 1 else slopes[b]
        o, l = reference.attention(q[b : b + 1], keys, values, causal=True, softcap=2.5, alibi_slopes=row,
                                   return_lse=True)
        numpy.testing.assert_allclose(want[b : b + 1], o, atol=1e-13)
    out, lse = cupyflash.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, **options)
    numpy.testing.assert_allclose(out, want, atol=1e-12)
    numpy.testing.assert_allclose(lse, want_lse, atol=1e-12)


def test_decode_softcap_and_alibi_are_checked(rng):
    q, k_cache, v_cache, _, _ = random_decode(rng)
    with pytest.raises(ValueError, match="softcap must be finite and positive"):
        cupyflash.attention_decode(q, k_cache, v_cache, softcap=-1.0)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        cupyflash.attention_decode(q, k_cache, v_cache, alibi_slopes=numpy.ones(3))
