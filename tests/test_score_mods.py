"""Softcap and ALiBi on the CPU: the float64 reference against brute force (scipy's softmax) and
finite differences, the tiled mirror against the reference, the no-GPU fallback, input
validation, and the instantiation list."""

import numpy
import pytest
import scipy.special

import cupyflash
from cupyflash import BlockMask, catalog, validation, reference
from cupyflash.catalog import tiles

# (softcap, whether ALiBi slopes are given)
MODS = [(2.5, False), (None, True), (1.5, True)]


def random_problem(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim):
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim))
    k = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
    v = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
    return q, k, v


def brute_force(q, k, v, scale, softcap, slopes, visible):
    """Per (batch, head, query): the modified scores of the visible keys, softmax by scipy."""
    b, sq, h, d = q.shape
    sk, group = k.shape[1], h // k.shape[2]
    slopes = numpy.broadcast_to(numpy.zeros((1, h)) if slopes is None else numpy.reshape(slopes, (-1, h)), (b, h))
    out = numpy.zeros(q.shape)
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                keys = [j for j in range(sk) if visible(i, j)]
                if not keys:
                    continue
                s = numpy.array([scale * q[bi, i, hi] @ k[bi, j, hi // group] for j in keys])
                if softcap is not None:
                    s = softcap * numpy.tanh(s / softcap)
                s = s - slopes[bi, hi] * numpy.abs(i + sk - sq - numpy.array(keys))
                out[bi, i, hi] = scipy.special.softmax(s) @ v[bi, keys, hi // group]
    return out


@pytest.mark.parametrize("softcap,alibi", MODS)
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (3, 2)), (True, (4, None))])
@pytest.mark.parametrize("heads,heads_kv,per_batch", [(4, 4, False), (4, 2, True), (3, 1, False)])
def test_reference_against_brute_force(rng, heads, heads_kv, per_batch, causal, window, softcap, alibi):
    q, k, v = random_problem(rng, 2, 9, 13, heads, heads_kv, 5)
    slopes = rng.uniform(0.05, 1.0, (2, heads) if per_batch else (heads,)) if alibi else None
    out, lse = reference.attention(
        q, k, v, causal=causal, window=window, scale=0.9, softcap=softcap, alibi_slopes=slopes, return_lse=True
    )
    left, right = window or (None, None)
    right = 0 if causal else right

    def visible(i, j):
        return (left is None or j >= i + 4 - left) and (right is None or j <= i + 4 + right)

    numpy.testing.assert_allclose(out, brute_force(q, k, v, 0.9, softcap, slopes, visible), rtol=1e-12, atol=1e-12)
    assert numpy.isfinite(lse).all()


def test_softcap_bounds_the_scores_and_alibi_favours_near_keys(rng):
    """With a softcap every score lies in (-cap, cap), however large q and k are, so each row's lse
    lies within cap of log(seqlen_k). With a steep ALiBi slope a query attends to the key at its
    own position."""
    q, k, v = random_problem(rng, 1, 6, 6, 2, 2, 8)
    _, lse = reference.attention(100.0 * q, k, v, softcap=0.5, return_lse=True)
    # tanh(100 q.k) rounds to exactly 1 in float64, so a saturated row reaches the bound: closed interval
    assert (numpy.abs(lse - numpy.log(6)) <= 0.5 + 1e-12).all()
    _, plain = reference.attention(100.0 * q, k, v, return_lse=True)
    assert (numpy.abs(plain - numpy.log(6)) > 0.5).any()  # without the cap the bound fails
    steep = reference.attention(q, k, v, alibi_slopes=numpy.array([50.0, 50.0]))
    numpy.testing.assert_allclose(steep, v, atol=1e-12)  # seqlen_q == seqlen_k: query i's own key is i


def test_zero_softcap_and_zero_slopes_change_nothing(rng):
    q, k, v = random_problem(rng, 2, 7, 11, 4, 2, 6)
    plain = reference.attention(q, k, v, causal=True, return_lse=True)
    for options in ({"softcap": 0}, {"softcap": 0.0, "alibi_slopes": numpy.zeros(4)}):
        for a, b in zip(reference.attention(q, k, v, causal=True, return_lse=True, **options), plain):
            numpy.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("softcap,alibi", MODS)
@pytest.mark.parametrize("window,causal", [(None, False), (None, True), ((3, 1), False)])
def test_reference_gradients_against_finite_differences(rng, window, causal, softcap, alibi):
    q, k, v = random_problem(rng, 1, 6, 8, 4, 2, 4)
    dout = rng.standard_normal(q.shape)
    slopes = rng.uniform(0.1, 1.0, (1, 4)) if alibi else None
    options = {"causal": causal, "window": window, "scale": 1.3, "softcap": softcap, "alibi_slopes": slopes}
    grads = reference.attention_backward(dout, q, k, v, **options)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]

    def loss(q, k, v):
        return float((reference.attention(q, k, v, **options) * dout).sum())

    step = 1e-6
    for which, grad in enumerate(grads):
        x = (q, k, v)[which]
        for index in [tuple(rng.integers(0, n) for n in x.shape) for _ in range(5)]:
            plus, minus = [a.copy() for a in (q, k, v)], [a.copy() for a in (q, k, v)]
            plus[which][index] += step
            minus[which][index] -= step
            numeric = (loss(*plus) - loss(*minus)) / (2 * step)
            assert abs(numeric - grad[index]) <= 1e-6 * max(1.0, abs(numeric)), (which, index)


@pytest.mark.parametrize("softcap,alibi", MODS)
@pytest.mark.parametrize("causal,window,masked", [(False, None, False), (True, None, True), (False, (20, 9), True)])
def test_tiled_mirror_matches_reference(rng, causal, window, masked, softcap, alibi):
    """The kernels' schedule (tiles of 16 here, a mask of 16 x 32 blocks), forward and backward."""
    q, k, v = random_problem(rng, 2, 50, 70, 4, 2, 8)
    dout = rng.standard_normal(q.shape)
    slopes = rng.uniform(0.01, 0.3, (2, 4)) if alibi else None
    mask = BlockMask(rng.random((4, 4, 3)) < 0.7, block_size=(16, 32)) if masked else None
    options = {"causal": causal, "window": window, "softcap": softcap, "alibi_slopes": slopes, "block_mask": mask}
    out, lse = reference.attention(q, k, v, return_lse=True, **options)
    tiled_out, tiled_lse = reference.tiled_attention(q, k, v, return_lse=True, block_m=16, block_n=16, **options)
    numpy.testing.assert_allclose(tiled_out, out, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(tiled_lse, lse, rtol=1e-12, atol=1e-12)
    exact = reference.attention_backward(dout, q, k, v, **options)
    tiled = reference.tiled_attention_backward(dout, q, k, v, out, lse, block_m=16, block_n=16, **options)
    for a, b in zip(tiled, exact):
        numpy.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fallback_without_gpu(rng, dtype):
    q, k, v = (x.astype(dtype) for x in random_problem(rng, 2, 33, 40, 4, 2, 16))
    dout = rng.standard_normal(q.shape).astype(dtype)
    slopes = rng.uniform(0.01, 0.5, 4).astype(numpy.float32)
    options = {"causal": True, "softcap": 3.0, "alibi_slopes": slopes}
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **options)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    assert isinstance(out, numpy.ndarray) and out.dtype == q.dtype
    tol = 1e-5 if dtype == "float32" else 1e-12
    numpy.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    numpy.testing.assert_allclose(lse, ref_lse, rtol=tol, atol=tol)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, **options)
    for got, want in zip(grads, reference.attention_backward(dout, q, k, v, **options)):
        numpy.testing.assert_allclose(got, want, rtol=10 * tol, atol=10 * tol)


@pytest.mark.parametrize(
    "softcap,error,match",
    [
        ("3", TypeError, "softcap must be a real number"),
        (True, TypeError, "softcap must be a real number"),
        (-1.0, ValueError, "softcap must be finite and positive"),
        (float("inf"), ValueError, "softcap must be finite and positive"),
        (float("nan"), ValueError, "softcap must be finite and positive"),
    ],
)
def test_bad_softcap_is_rejected(rng, softcap, error, match):
    q, k, v = (x.astype(numpy.float32) for x in random_problem(rng, 1, 4, 4, 2, 2, 8))
    with pytest.raises(error, match=match):
        cupyflash.attention(q, k, v, softcap=softcap)
    with pytest.raises(error, match=match):
        cupyflash.attention_backward(q, q, k, v, q, numpy.zeros((1, 2, 4), numpy.float32), softcap=softcap)


@pytest.mark.parametrize(
    "slopes,error,match",
    [
        ("0.5", TypeError, "alibi_slopes must be an array"),
        (numpy.ones(3), ValueError, r"alibi_slopes must have shape \(heads,\) = \(2,\)"),
        (numpy.ones((3, 2)), ValueError, "alibi_slopes must have shape"),
        (numpy.ones((1, 1, 2)), ValueError, "alibi_slopes must have shape"),
        (numpy.ones(2, numpy.int32), TypeError, "alibi_slopes must have a floating dtype"),
        (numpy.array([0.5, numpy.nan]), ValueError, "alibi_slopes must be finite"),
        (numpy.array([numpy.inf, 0.5]), ValueError, "alibi_slopes must be finite"),
    ],
)
def test_bad_alibi_slopes_are_rejected_and_inputs_untouched(rng, slopes, error, match):
    q, k, v = (x.astype(numpy.float32) for x in random_problem(rng, 1, 4, 4, 2, 2, 8))
    before = [x.copy() for x in (q, k, v)]
    with pytest.raises(error, match=match):
        cupyflash.attention(q, k, v, alibi_slopes=slopes)
    with pytest.raises(error, match=match):
        cupyflash.block_sparse_attention(q, k, v, BlockMask(numpy.ones((1, 1, 1), bool)), alibi_slopes=slopes)
    for x, y in zip((q, k, v), before):
        numpy.testing.assert_array_equal(x, y)


def test_slopes_as_a_list_and_per_batch_are_accepted():
    p = validation.AttentionProblem(2, 4, 4, 3, 8, "float32", False, 0.5, False)
    assert validation.check_alibi_slopes(numpy.ones(3), p).alibi_slopes.shape == (1, 3)
    assert validation.check_alibi_slopes(numpy.ones((2, 3)), p).alibi_slopes.shape == (2, 3)
    assert validation.check_alibi_slopes(numpy.ones((1, 3)), p).score_mod
    assert validation.check_softcap(0) is None and validation.check_softcap(2) == 2.0


def test_score_mod_kernels_are_listed_for_every_dtype_head_dim_and_mask():
    everything = set(catalog.all_kernels())
    for dtype_name in tiles.DTYPE_NAMES:
        families = ["scalar"] + (["sm80", "sm90"] if dtype_name in tiles.TENSOR_CORE_DTYPES else [])
        for d in (1, 40, 64, 111, 128, 200, 256):
            for causal in (False, True):
                for sparse in (False, True):
                    v = catalog.Variant(causal, sparse, score_mod=True)
                    for family in families:
                        if family == "sm90" and tiles.padded_head_dim(d) not in tiles.WGMMA_HEAD_DIMS:
                            continue
                        fwd = catalog.forward_kernel(family, dtype_name, d, v)
                        assert fwd.local and fwd.score_mod and fwd in everything
                        assert fwd.name_expression.endswith(", true>")
                        for large in (False, True):
                            dkdv = catalog.dkdv_kernel(family, dtype_name, d, v, large and family == "sm80")
                            assert dkdv in everything and dkdv.local and dkdv.score_mod
                        dq = catalog.dq_kernel(family != "scalar", dtype_name, d, v)
                        assert dq in everything and dq.local and dq.score_mod
    # The unmodified kernels keep their two-flag names (their compiled code is unchanged).
    local = catalog.Variant(local=True)
    assert catalog.forward_kernel("sm80", "float16", 64, local).name_expression.endswith(", true, false>")


class _Shaped:
    """Shape, dtype and strides only: what the checks read, for sizes no test could allocate."""

    def __init__(self, shape, dtype=numpy.float16):
        self.shape, self.dtype, self.ndim = tuple(shape), numpy.dtype(dtype), len(shape)
        self.size = int(numpy.prod(shape))
        self.strides = tuple(int(numpy.prod(shape[i + 1:])) * self.dtype.itemsize for i in range(len(shape)))


def test_sequences_past_int32_distances_are_rejected():
    """ALiBi's distance and the softcap kernels' band are int32: seqlen_q + seqlen_k must fit."""
    q, k = _Shaped((1, 2**30, 1, 8)), _Shaped((1, 2**30, 1, 8))
    with pytest.raises(ValueError, match="with causal, a window or a softcap, seqlen_q"):
        validation.check_attention_args(q, k, k, causal=False, scale=None, return_lse=False, softcap=5.0)
    p = validation.check_attention_args(q, k, k, causal=False, scale=None, return_lse=False)
    with pytest.raises(ValueError, match="with alibi_slopes, seqlen_q"):
        validation.check_alibi_slopes(numpy.ones(1), p)
