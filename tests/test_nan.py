"""NaN and inf in the inputs propagate as in the float64 definition, on every path: a row whose
visible scores or values take a bad value gives NaN (or inf) in out and NaN in lse, the gradients
that depend on it are NaN, and every other row, head and batch entry is untouched. A row that sees
no key still gives 0 and lse -inf.

The checks run the public functions on NumPy inputs (the CPU fallback without a GPU, the GPU's
default kernels with one), the float64 reference and the tiled mirror directly, and, with the
`gpu` marker, each kernel family of the GPU in turn."""

import numpy
import pytest
import scipy.special

import cupyflash
from cupyflash import reference
from cupyflash.cpu import reference as cpu_reference
from shapes import numpy_dtype, random_qkv

# (array, index, value): one bad element in batch entry 1 or 0, query head 2 or K/V head 1
BAD_INPUTS = [
    ("k", (1, 30, 1, 3), numpy.nan),  # causal: seen by queries 6-39 (the diagonal is at key i + 24)
    ("q", (0, 7, 2, 0), numpy.nan),
    ("q", (1, 3, 0, 5), numpy.inf),
]
SHAPE = (2, 40, 64, 4, 32)  # batch, seqlen_q, seqlen_k, heads, head_dim; K/V with 2 heads (GQA)
NO_KEY_SHAPE = (2, 64, 40, 4, 32)  # causal: queries 0-23 see no key


def poisoned(rng, dtype, name, index, value, shape=SHAPE):
    q, k, v = random_qkv(rng, dtype, *shape, heads_kv=2)
    arrays = {"q": q, "k": k, "v": v}
    arrays[name][index] = value
    return arrays["q"], arrays["k"], arrays["v"]


def finite_part_bound(ref, lowp, got, dtype):
    """(max error, bound) of `got` against `ref` where the reference is finite, under the 2x rule."""
    finite = numpy.isfinite(ref)
    err = float(numpy.abs(got[finite] - ref[finite]).max(initial=0.0))
    return err, reference.error_bound(ref[finite], lowp[finite], dtype)


def assert_forward_as_definition(q, k, v, out, lse, dtype, **options):
    """out and lse non-finite exactly where the float64 definition's are (NaN for NaN, inf for
    inf), lse -inf exactly on the rows with no key, and the rest within the tolerance rule."""
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    out, lse = cpu_reference.as_float64(out), cpu_reference.as_float64(lse)
    assert numpy.isnan(ref).any(), "the problem has no NaN row: the test would prove nothing"
    numpy.testing.assert_array_equal(numpy.isnan(out), numpy.isnan(ref), "out's NaNs")
    numpy.testing.assert_array_equal(numpy.isinf(out), numpy.isinf(ref), "out's infs")
    numpy.testing.assert_array_equal(numpy.isnan(lse), numpy.isnan(ref_lse), "lse's NaNs")
    numpy.testing.assert_array_equal(numpy.isneginf(lse), numpy.isneginf(ref_lse), "lse's -inf (rows with no key)")
    dt = numpy_dtype(dtype)
    lowp = reference.attention_in_precision(q.astype(dt), k.astype(dt), v.astype(dt), dt, **options)
    err, bound = finite_part_bound(ref, lowp, out, dtype)
    assert err <= bound, f"out where finite: max |error| {err:.3e} > bound {bound:.3e}"


def assert_backward_as_definition(dout, q, k, v, grads, dtype, regions, **options):
    """Each gradient NaN nowhere the reference's matrix products are finite, NaN all over the part
    that the bad value reaches in the definition (`regions`: name -> (that part, or None where
    causal makes it ragged; the part it may reach)), and within the tolerance rule elsewhere."""
    exact = reference.attention_backward(dout, q, k, v, **options)
    dt = numpy_dtype(dtype)
    lowp = reference.attention_backward_in_precision(*(x.astype(dt) for x in (dout, q, k, v)), dt, **options)
    for name, got, ref, base in zip(("dq", "dk", "dv"), grads, exact, lowp):
        got = cpu_reference.as_float64(got)
        required, reachable = regions[name]
        assert not (numpy.isnan(got) & ~numpy.isnan(ref)).any(), f"{name}: NaN where the definition has none"
        if required is not None:
            assert numpy.isnan(got[required]).all(), f"{name}: a gradient the bad value reaches is not NaN"
        untouched = numpy.ones(got.shape, bool)
        untouched[reachable] = False
        err, bound = finite_part_bound(ref[untouched], base[untouched], got[untouched], dtype)
        assert err <= bound, f"{name} where no bad value reaches: max |error| {err:.3e} > bound {bound:.3e}"


def reached(name, index, causal):
    """`assert_backward_as_definition`'s regions for one NaN in q or k (2 query heads a K/V head):
    a NaN in q[b, i, h] reaches dq's row i and all of dk, dv of K/V head h // 2; one in k[b, j, h]
    reaches all of dq of query heads 2h, 2h + 1 and dk, dv of K/V head h (without causal)."""
    b, row, h, _ = index
    if name == "q":
        kv = (b, slice(None), h // 2)
        return {"dq": ((b, row, h),) * 2, "dk": (None if causal else kv, kv), "dv": (None if causal else kv, kv)}
    group, kv = (b, slice(None), slice(2 * h, 2 * h + 2)), (b, slice(None), h)
    return {grad: (None if causal else region, region) for grad, region in (("dq", group), ("dk", kv), ("dv", kv))}


# --------------------------------------------------------------------------- the definition


@pytest.mark.parametrize("causal", [False, True])
def test_reference_nan_rows_match_scipy_softmax(rng, causal):
    q, k, v = poisoned(rng, "float64", "k", (1, 30, 1, 3), numpy.nan)
    b, sq, sk, h, d = SHAPE
    scores = numpy.einsum("bihd,bjhd->bhij", q, numpy.repeat(k, 2, axis=2)) / numpy.sqrt(d)
    if causal:
        scores = numpy.where(reference.causal_mask(sq, sk), -numpy.inf, scores)
    expected = numpy.einsum("bhij,bjhd->bihd", scipy.special.softmax(scores, axis=-1), numpy.repeat(v, 2, axis=2))
    out, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    numpy.testing.assert_array_equal(numpy.isnan(out), numpy.isnan(expected))
    numpy.testing.assert_array_equal(numpy.isnan(lse), numpy.isnan(scipy.special.logsumexp(scores, axis=-1)))
    rows = numpy.isnan(out[1, :, 2:]).any(axis=-1)  # query heads 2, 3 read K/V head 1
    first = 30 - (sk - sq) if causal else 0  # the first query that sees key 30
    assert not rows[:first].any() and rows[first:].all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,index,value", BAD_INPUTS)
def test_tiled_mirror_propagates_as_the_definition(rng, name, index, value, causal):
    q, k, v = poisoned(rng, "float64", name, index, value)
    out, lse = reference.tiled_attention(q, k, v, causal=causal, return_lse=True, block_m=16, block_n=16)
    assert_forward_as_definition(q, k, v, out, lse, "float64", causal=causal)
    dout = rng.standard_normal(q.shape)
    grads = reference.tiled_attention_backward(dout, q, k, v, out, lse, causal=causal, block_m=16, block_n=16)
    if value is numpy.nan:
        assert_backward_as_definition(dout, q, k, v, grads, "float64", reached(name, index, causal), causal=causal)


# --------------------------------------------------------------------------- the public functions


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,index,value", BAD_INPUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_attention_propagates_nan_and_inf(rng, dtype, name, index, value, causal):
    q, k, v = poisoned(rng, dtype, name, index, value)
    out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
    assert_forward_as_definition(q, k, v, out, lse, dtype, causal=causal)
    if value is numpy.nan:
        dout = rng.standard_normal(q.shape).astype(q.dtype)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        assert_backward_as_definition(dout, q, k, v, grads, dtype, reached(name, index, causal), causal=causal)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_inf_in_v_gives_inf_or_nan_where_the_definition_does(rng, dtype):
    q, k, v = poisoned(rng, dtype, "v", (0, 9, 1, 2), numpy.inf)
    v[1, 4, 0, 6] = numpy.nan
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    assert_forward_as_definition(q, k, v, out, lse, dtype)
    assert numpy.isfinite(cpu_reference.as_float64(lse)).all()  # lse does not depend on v


def test_rows_with_no_key_stay_zero_beside_nan_rows(rng):
    q, k, v = poisoned(rng, "float32", "k", (1, 30, 1, 3), numpy.nan, shape=NO_KEY_SHAPE)
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    assert_forward_as_definition(q, k, v, out, lse, "float32", causal=True)
    assert (out[:, :24] == 0).all() and numpy.isneginf(lse[..., :24]).all()


def test_padded_batch_propagates_nan_and_never_reads_its_padding(rng):
    q, k, v = poisoned(rng, "float32", "k", (1, 5, 1, 3), numpy.nan, shape=(2, 128, 256, 4, 32))
    k[1, 150, 0, 0] = v[0, 200, 1, 1] = numpy.nan  # padding: never read
    out, lse = cupyflash.attention(q, k, v, seqlens_k=[180, 100], return_lse=True)
    assert not numpy.isnan(out[0]).any() and not numpy.isnan(out[1, :, :2]).any()
    assert_forward_as_definition(q[1:], k[1:, :100], v[1:, :100], out[1:], lse[1:], "float32")


def test_block_mask_propagates_nan_to_the_blocks_that_see_it(rng):
    q, k, v = poisoned(rng, "float32", "k", (1, 5, 1, 3), numpy.nan, shape=(2, 128, 256, 4, 32))
    # Query heads 2 and 3 read K/V head 1: head 2 sees key 5 (block 0), head 3 only keys 128-255.
    mask = cupyflash.BlockMask(numpy.array([[[1, 1]], [[1, 1]], [[1, 0]], [[0, 1]]], bool))
    out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
    assert numpy.isnan(out[1, :, 2]).all() and not numpy.isnan(out[1, :, 3]).any()
    assert_forward_as_definition(q, k, v, out, lse, "float32", block_mask=mask)


def test_varlen_propagates_nan_in_its_sequence_only(rng):
    lengths = [17, 40, 9]
    cu = numpy.cumsum([0] + lengths).astype(numpy.int32)
    q, k, v = (rng.standard_normal((cu[-1], 4, 32)).astype(numpy.float32) for _ in range(3))
    k[cu[1] + 3, 2, 0] = numpy.nan  # sequence 1's key 3
    out, lse = cupyflash.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    bad = numpy.isnan(out).any(axis=-1)
    assert not bad[: cu[1]].any() and not bad[cu[2] :].any()
    assert bad[cu[1] + 3 : cu[2], 2].all() and not bad[cu[1] : cu[1] + 3].any()
    numpy.testing.assert_array_equal(numpy.isnan(lse), bad.T)


def test_decode_propagates_nan_from_the_cache_and_the_new_keys(rng):
    k_cache, v_cache = (numpy.full((2, 64, 2, 32), numpy.nan, numpy.float32) for _ in range(2))  # past 20: never read
    k_cache[:, :20], v_cache[:, :20] = (rng.standard_normal((2, 20, 2, 32)) for _ in range(2))
    k_cache[0, 7, 1, 4] = numpy.nan  # K/V head 1 of sequence 0: query heads 2, 3
    k_new, v_new = (rng.standard_normal((2, 1, 2, 32)).astype(numpy.float32) for _ in range(2))
    v_new[1, 0, 0, 3] = numpy.nan  # sequence 1, query heads 0, 1: output column 3 only
    q = rng.standard_normal((2, 1, 4, 32)).astype(numpy.float32)
    out, lse = cupyflash.attention_decode(q, k_cache, v_cache, [20, 20], k_new=k_new, v_new=v_new, return_lse=True)
    scores_bad = numpy.array([[False, False, True, True], [False, False, False, False]])
    assert numpy.isnan(out[:, 0][scores_bad]).all()
    numpy.testing.assert_array_equal(numpy.isnan(lse[:, :, 0]), scores_bad)
    column_3 = numpy.zeros(out.shape, bool)
    column_3[1, 0, :2, 3] = True
    numpy.testing.assert_array_equal(numpy.isnan(out) & ~scores_bad[:, None, :, None], column_3)


# --------------------------------------------------------------------------- each GPU kernel family


FAMILY_CASES = [  # (families allowed, the family that must take the forward, dtype, head_dim)
    (("scalar",), "scalar", "float32", 40),
    (("scalar",), "scalar", "float64", 40),
    (("sm80", "scalar"), "sm80", "float16", 40),
    (("sm80", "scalar"), "sm80", "float64", 64),
    (("sm90", "sm80", "scalar"), "sm90", "bfloat16", 64),
    (("sm90-tma", "sm90", "sm80", "scalar"), "sm90-tma", "bfloat16", 128),
    (("sm90-ws", "sm90-tma", "sm90", "sm80", "scalar"), "sm90-ws", "float16", 128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,index,value", BAD_INPUTS)
@pytest.mark.parametrize("families,family,dtype,head_dim", FAMILY_CASES)
def test_every_kernel_family_propagates_nan(rng, nan_outputs, policy, families, family, dtype, head_dim, name, index,
                                            value, causal):
    import cupy

    shape = (2, 150, 190, 4, head_dim)
    q, k, v = poisoned(rng, dtype, name, index, value, shape=shape)
    policy(families=families)
    taken = next(c.family for c in cupyflash.explain(q, k, v, causal=causal).forward.choices if c.taken)
    if taken != family:
        pytest.skip(f"{family} does not serve this problem on this GPU ({taken} does)")
    gq, gk, gv = (cupy.asarray(x) for x in (q, k, v))
    out, lse = cupyflash.attention(gq, gk, gv, causal=causal, return_lse=True)
    assert_forward_as_definition(q, k, v, out, lse, dtype, causal=causal)
    if value is numpy.nan:
        dout = rng.standard_normal(q.shape).astype(q.dtype)
        for deterministic in (False, True):
            grads = cupyflash.attention_backward(cupy.asarray(dout), gq, gk, gv, out, lse, causal=causal,
                                                 deterministic=deterministic)
            assert_backward_as_definition(dout, q, k, v, grads, dtype, reached(name, index, causal), causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_decode_kernels_propagate_nan(rng, nan_outputs, dtype, num_splits):
    import cupy

    dt = numpy_dtype(dtype)
    k_cache, v_cache = (rng.standard_normal((2, 512, 2, 64)).astype(dt) for _ in range(2))
    k_cache[0, 300, 1, 4] = numpy.nan
    q = rng.standard_normal((2, 1, 4, 64)).astype(dt)
    out, lse = cupyflash.attention_decode(cupy.asarray(q), cupy.asarray(k_cache), cupy.asarray(v_cache), [400, 400],
                                          num_splits=num_splits, return_lse=True)
    out, lse = cupy.asnumpy(out).astype(numpy.float64), cupy.asnumpy(lse)
    bad = numpy.isnan(out[:, 0]).any(axis=-1)
    numpy.testing.assert_array_equal(bad, [[False, False, True, True], [False, False, False, False]])
    numpy.testing.assert_array_equal(numpy.isnan(lse[:, :, 0]), bad)
    assert numpy.isnan(out[0, 0, 2:]).all() and numpy.isfinite(out[~numpy.isnan(out)]).all()
