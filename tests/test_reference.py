"""The NumPy float64 reference against scipy and brute force; the tiled mirror against it."""

import math
import tracemalloc

import numpy
import pytest
import scipy.special

import cupyflash
from cupyflash import reference
from shapes import AWKWARD_SHAPES, DTYPES, HEAD_DIMS, numpy_dtype, random_qkv
from test_attention_gpu import assert_matches_reference
from test_backward_gpu import assert_gradients_match_reference


def brute_force(q, k, v, causal, scale):
    """Loops over every (batch, head, query): softmax written out by hand."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    out = numpy.zeros((b, sq, h, d))
    lse = numpy.full((b, h, sq), -numpy.inf)
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                visible = [j for j in range(sk) if not (causal and j > i + sk - sq)]
                if not visible:
                    continue
                s = [scale * float(numpy.dot(q[bi, i, hi], k[bi, j, hi])) for j in visible]
                mx = max(s)
                w = [math.exp(x - mx) for x in s]
                total = sum(w)
                for wj, j in zip(w, visible):
                    out[bi, i, hi] += wj / total * v[bi, j, hi]
                lse[bi, hi, i] = mx + math.log(total)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim", [(1, 1, 1), (5, 7, 3), (7, 5, 4), (9, 9, 2), (3, 0, 2)])
def test_reference_matches_brute_force(rng, causal, seqlen_q, seqlen_k, head_dim):
    q, k, v = random_qkv(rng, "float64", 2, seqlen_q, seqlen_k, 2, head_dim)
    scale = 0.7
    out, lse = reference.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    out_bf, lse_bf = brute_force(q, k, v, causal, scale)
    numpy.testing.assert_allclose(out, out_bf, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse, lse_bf, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_scipy_softmax(rng, causal):
    q, k, v = random_qkv(rng, "float64", 2, 37, 53, 3, 24)
    out, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    scores = numpy.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(24)
    if causal:
        scores = numpy.where(reference.causal_mask(37, 53), -numpy.inf, scores)
    probs = scipy.special.softmax(scores, axis=-1)
    numpy.testing.assert_allclose(out, numpy.einsum("bhqk,bkhd->bqhd", probs, v), rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse, scipy.special.logsumexp(scores, axis=-1), rtol=1e-12, atol=1e-12)


def test_causal_is_bottom_right_aligned():
    # The docstring's worked examples.
    expected_visible = numpy.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=bool)
    numpy.testing.assert_array_equal(~reference.causal_mask(2, 5), expected_visible)
    expected_visible = numpy.array([[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]], dtype=bool)
    numpy.testing.assert_array_equal(~reference.causal_mask(5, 2), expected_visible)


def test_rows_without_keys_give_zero_and_neg_inf(rng):
    q, k, v = random_qkv(rng, "float64", 1, 6, 2, 2, 8)
    for fn in (reference.attention, reference.tiled_attention):
        out, lse = fn(q, k, v, causal=True, return_lse=True)
        assert not numpy.isnan(out).any()
        assert (out[:, :4] == 0).all() and numpy.isneginf(lse[:, :, :4]).all()
        assert numpy.isfinite(lse[:, :, 4:]).all() and (numpy.abs(out[:, 4:]) > 0).any()


def _assert_tiled_matches(q, k, v, causal, **kw):
    out, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    t_out, t_lse = reference.tiled_attention(q, k, v, causal=causal, return_lse=True, **kw)
    numpy.testing.assert_allclose(t_out, out, rtol=0, atol=1e-13)
    numpy.testing.assert_array_equal(numpy.isneginf(t_lse), numpy.isneginf(lse))
    finite = numpy.isfinite(lse)
    numpy.testing.assert_allclose(t_lse[finite], lse[finite], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim", AWKWARD_SHAPES)
def test_tiled_matches_reference_on_awkward_shapes(rng, causal, seqlen_q, seqlen_k, head_dim):
    q, k, v = random_qkv(rng, "float64", 2, seqlen_q, seqlen_k, 2, head_dim)
    _assert_tiled_matches(q, k, v, causal)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_matches_reference_per_dtype_tile(rng, dtype, head_dim):
    # Each dtype/head dim has its own kernel tile, so its own block schedule.
    q, k, v = random_qkv(rng, dtype, 1, 75, 91, 2, head_dim)
    _assert_tiled_matches(q, k, v, True)


@pytest.mark.parametrize("block_m,block_n", [(1, 1), (16, 64), (7, 5)])
def test_tiled_with_other_block_sizes(rng, block_m, block_n):
    q, k, v = random_qkv(rng, "float64", 1, 40, 33, 2, 8)
    _assert_tiled_matches(q, k, v, True, block_m=block_m, block_n=block_n)


def test_in_precision_baseline_is_less_accurate_for_lower_precision(rng):
    q, k, v = random_qkv(rng, "float64", 1, 64, 80, 2, 32)
    ref = reference.attention(q, k, v)
    errors = {}
    for name in DTYPES:
        dt = numpy_dtype(name)
        qq, kk, vv = (x.astype(dt) for x in (q, k, v))
        ref_d = reference.attention(qq, kk, vv)
        errors[name] = numpy.abs(reference.attention_in_precision(qq, kk, vv, dt) - ref_d).max()
    assert errors["float64"] < 1e-14 < errors["float32"] < 1e-5 < errors["float16"] < errors["bfloat16"] < 0.1
    # The bound is tight enough to catch a real mistake (e.g. a dropped scale).
    wrong = reference.attention(q, k, v, scale=1.0)
    lowp = reference.attention_in_precision(q.astype(numpy.float16), k.astype(numpy.float16), v.astype(numpy.float16), numpy.float16)
    assert numpy.abs(wrong - ref).max() > reference.error_bound(ref, lowp, "float16")


def test_error_bound_floor_follows_summed_terms_only_for_32_and_64_bit():
    ref, lowp = numpy.array([0.0, 0.5]), numpy.array([0.0, 0.5])
    for name in ("float32", "float64"):
        assert reference.error_bound(ref, lowp, name, magnitude=100.0) == reference.noise_floor(name) * 100.0
        assert reference.error_bound(ref, lowp, name, magnitude=0.1) == reference.noise_floor(name)  # never below the result's
    for name in ("float16", "bfloat16"):
        assert reference.error_bound(ref, lowp, name, magnitude=100.0) == reference.noise_floor(name)


def test_gradient_term_magnitudes_brute_force(rng):
    dout, q, k, v = (rng.standard_normal((1, 5, 2, 3)) for _ in range(4))
    k, v = k[:, :4], v[:, :4]
    scale = 0.7
    got = reference.gradient_term_magnitudes(dout, q, k, v, causal=True, scale=scale)
    spread, colsum, exponent = 0.0, 0.0, 1.0
    for h in range(2):
        s = scale * q[0, :, h] @ k[0, :, h].T
        s[numpy.triu(numpy.ones((5, 4), bool), 4 - 5 + 1)] = -numpy.inf  # key j > i + (4 - 5) hidden
        p = numpy.nan_to_num(scipy.special.softmax(s, axis=1))
        o = p @ v[0, :, h]
        d = (dout[0, :, h] * o).sum(axis=1)
        spread = max(spread, (numpy.abs(dout[0, :, h] @ v[0, :, h].T) + numpy.abs(d)[:, None]).max())
        colsum = max(colsum, p.sum(axis=0).max())
        lse = scipy.special.logsumexp(s, axis=1)  # -inf for the first row, which sees no key
        exponent = max(exponent, numpy.abs(s[numpy.isfinite(s)]).max(), numpy.abs(lse[numpy.isfinite(lse)]).max())
    want = (scale * spread * numpy.abs(k).max(), scale * spread * numpy.abs(q).max() * colsum, numpy.abs(dout).max() * colsum)
    numpy.testing.assert_allclose(got, numpy.array(want) * exponent, rtol=1e-12)
    assert reference.gradient_exponent_size(q, k, v, causal=True, scale=scale) == pytest.approx(exponent, rel=1e-12)


def test_gradient_floor_covers_rebuilding_p_from_a_float32_lse(rng):
    """What the exponent factor in `gradient_term_magnitudes` is for. A float32 backward rebuilds
    P = exp(s - lse) from the lse the forward stored in float32: half an ulp of an lse of 20 is
    8 eps, so dv_j = P_j dO is off by 8 eps relative from that rounding alone, twice the whole
    float32 floor (4 eps) when the floor followed only the summed terms."""
    q = numpy.ones((1, 1, 1, 1))
    k = numpy.array([20.0, 19.0, 18.0, 17.0]).reshape(1, 4, 1, 1)  # scores s_j = k_j, lse ~ 20.44
    v, dout = rng.standard_normal((1, 4, 1, 1)), rng.choice([-1.0, 1.0]) * rng.uniform(3, 5, (1, 1, 1, 1))  # dv above 1
    exact = reference.attention_backward(dout, q, k, v, scale=1.0)[2]
    _, lse = reference.attention(q, k, v, scale=1.0, return_lse=True)
    stored = lse + numpy.spacing(numpy.float32(lse)).astype(numpy.float64) / 2  # the worst float32 rounding
    rebuilt = (numpy.exp(k[0, :, 0, 0] - stored[0, 0]) * dout[0, 0, 0, 0]).reshape(exact.shape)
    err = numpy.abs(rebuilt - exact).max()
    magnitude = reference.gradient_term_magnitudes(dout, q, k, v, scale=1.0)[2]
    without = magnitude / float(numpy.abs(lse).max())  # the factor is max|lse| here
    assert err <= reference.error_bound(exact, exact, "float32", magnitude)
    assert err > reference.error_bound(exact, exact, "float32", without)


def test_output_term_magnitude_brute_force(rng):
    q, k, v = (rng.standard_normal((1, 5, 2, 3)) for _ in range(3))
    k, v = k[:, :4], v[:, :4]
    for factor in (0.01, 30.0):  # scores below 1 leave max|v|; large ones scale it
        biggest = 0.0
        for h in range(2):
            s = numpy.abs(0.7 * factor * q[0, :, h] @ k[0, :, h].T)
            s[numpy.triu(numpy.ones((5, 4), bool), 4 - 5 + 1)] = 0.0  # key j > i + (4 - 5) hidden
            biggest = max(biggest, s.max())
        got = reference.output_term_magnitude(factor * q, k, v, causal=True, scale=0.7)
        assert got == pytest.approx(numpy.abs(v).max() * max(1.0, biggest), rel=1e-12)
        assert (got == numpy.abs(v).max()) == (biggest <= 1.0)


def test_lse_term_magnitude_brute_force(rng):
    """The largest visible scale·sum_d |q_d k_d| (a score's terms), at least the exponent size.
    GQA: one K head serves both query heads."""
    q, k, v = (rng.standard_normal((1, 5, 2, 3)) for _ in range(3))
    k, v = k[:, :4, :1], v[:, :4, :1]
    for factor in (0.01, 30.0):  # tiny scores leave the exponent size (lse ~ log 4); large ones their terms
        terms, exponent = 0.0, 1.0
        for h in range(2):
            hidden = numpy.triu(numpy.ones((5, 4), bool), 4 - 5 + 1)  # key j > i + (4 - 5)
            t = 0.7 * numpy.abs(factor * q[0, :, h]) @ numpy.abs(k[0, :, 0]).T
            s = 0.7 * (factor * q[0, :, h]) @ k[0, :, 0].T
            terms = max(terms, numpy.where(hidden, 0.0, t).max())
            s[hidden] = -numpy.inf
            lse = scipy.special.logsumexp(s, axis=1)  # -inf for the first row, which sees no key
            exponent = max(exponent, numpy.abs(s[numpy.isfinite(s)]).max(), numpy.abs(lse[numpy.isfinite(lse)]).max())
        got = reference.lse_term_magnitude(factor * q, k, v, causal=True, scale=0.7)
        assert got == pytest.approx(max(terms, exponent), rel=1e-12)
        if factor < 1:
            assert terms < 1.0 <= exponent  # the exponent size decides
        assert got >= reference.gradient_exponent_size(factor * q, k, v, causal=True, scale=0.7)
    # Terms that cancel: the score is 0 (lse 0) while each of its two terms is 10.
    one = numpy.ones((1, 1, 1, 2))
    assert reference.lse_term_magnitude(one, one * numpy.array([1.0, -1.0]), one, scale=10.0) == 20.0


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_attention_falls_back_to_tiled_numpy_without_gpu(rng, dtype):
    """The fallback computes as the kernels accumulate (float32, float64 for float64 inputs) and
    meets the kernels' rule: 2x the error of standard attention in the input precision."""
    q, k, v = random_qkv(rng, dtype, 2, 33, 47, 3, 40)
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, numpy.ndarray) and out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == (numpy.float64 if dtype == "float64" else numpy.float32) and lse.shape == (2, 3, 33)
    assert_matches_reference(q, k, v, out, lse, dtype, True)


@pytest.mark.cpu_only
@pytest.mark.parametrize("causal", [False, True])
def test_fallback_holds_a_tile_of_scores_not_all_of_them(rng, causal):
    """Peak memory of a float32 call: the inputs' copies and a bounded tile, far below the
    (batch, heads, seqlen_q, seqlen_k) scores that plain attention holds."""
    q, k, v = random_qkv(rng, "float32", 1, 2048, 2048, 4, 32)
    tracemalloc.start()
    cupyflash.attention(q, k, v, causal=causal)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    scores = 4 * 2048 * 2048 * 4
    assert peak < scores / 3, f"peak {peak / 2**20:.1f} MB against {scores / 2**20:.0f} MB of scores"


# --------------------------------------------------------------------------- backward


def finite_difference_grads(dout, q, k, v, causal, scale, h=1e-6):
    """Central differences of sum(dout * reference.attention(q, k, v)) for every input element."""

    def loss(*args):
        return float((reference.attention(*args, causal=causal, scale=scale) * dout).sum())

    grads = []
    for which in range(3):
        args = [q, k, v]
        grad = numpy.zeros_like(args[which])
        for idx in numpy.ndindex(grad.shape):
            plus, minus = args[which].copy(), args[which].copy()
            plus[idx] += h
            minus[idx] -= h
            grad[idx] = (loss(*args[:which], plus, *args[which + 1:]) - loss(*args[:which], minus, *args[which + 1:])) / (2 * h)
        grads.append(grad)
    return grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim", [(1, 1, 1), (4, 6, 3), (6, 4, 2), (5, 5, 4), (6, 2, 3)])
def test_reference_backward_matches_finite_differences(rng, causal, seqlen_q, seqlen_k, head_dim):
    q, k, v = random_qkv(rng, "float64", 1, seqlen_q, seqlen_k, 2, head_dim)
    dout = rng.standard_normal(q.shape)
    grads = reference.attention_backward(dout, q, k, v, causal=causal, scale=0.8)
    for name, got, fd in zip("qkv", grads, finite_difference_grads(dout, q, k, v, causal, 0.8)):
        assert got.shape == fd.shape
        numpy.testing.assert_allclose(got, fd, rtol=0, atol=1e-7, err_msg=f"d{name}")
    if causal and seqlen_q > seqlen_k:  # queries that see no key get no gradient
        assert (grads[0][:, : seqlen_q - seqlen_k] == 0).all()


def _assert_tiled_backward_matches(dout, q, k, v, causal, **kw):
    out, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    expected = reference.attention_backward(dout, q, k, v, causal=causal)
    got = reference.tiled_attention_backward(dout, q, k, v, out, lse, causal=causal, **kw)
    for name, g, e in zip("qkv", got, expected):
        assert not numpy.isnan(g).any()
        numpy.testing.assert_allclose(g, e, rtol=0, atol=1e-12 * max(1.0, numpy.abs(e).max(initial=0)), err_msg=f"d{name}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim", AWKWARD_SHAPES)
def test_tiled_backward_matches_reference_on_awkward_shapes(rng, causal, seqlen_q, seqlen_k, head_dim):
    q, k, v = random_qkv(rng, "float64", 1, seqlen_q, seqlen_k, 2, head_dim)
    dout = rng.standard_normal(q.shape)
    _assert_tiled_backward_matches(dout, q, k, v, causal)


@pytest.mark.parametrize("head_dim", [16, 59, 200])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_backward_per_dtype_tile(rng, dtype, head_dim):
    q, k, v = random_qkv(rng, dtype, 1, 75, 91, 2, head_dim)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    _assert_tiled_backward_matches(*(x.astype(numpy.float64) for x in (dout, q, k, v)), True)


@pytest.mark.parametrize("block_m,block_n", [(1, 1), (16, 64), (7, 5)])
def test_tiled_backward_with_other_block_sizes(rng, block_m, block_n):
    q, k, v = random_qkv(rng, "float64", 1, 40, 33, 2, 8)
    _assert_tiled_backward_matches(rng.standard_normal(q.shape), q, k, v, True, block_m=block_m, block_n=block_n)


def test_backward_in_precision_baseline_orders_the_dtypes(rng):
    q, k, v = random_qkv(rng, "float64", 1, 64, 80, 2, 32)
    dout = rng.standard_normal(q.shape)
    errors = {}
    for name in DTYPES:
        dt = numpy_dtype(name)
        args = [x.astype(dt) for x in (dout, q, k, v)]
        exact = reference.attention_backward(*args)
        lowp = reference.attention_backward_in_precision(*args, dt)
        errors[name] = max(numpy.abs(a - b).max() for a, b in zip(lowp, exact))
    assert errors["float64"] < 1e-13 < errors["float32"] < 1e-4 < errors["float16"] < errors["bfloat16"] < 0.5
    # A wrong gradient (the scale left out of dq) is far outside the float16 bound.
    args16 = [x.astype(numpy.float16) for x in (dout, q, k, v)]
    exact = reference.attention_backward(*args16)
    lowp = reference.attention_backward_in_precision(*args16, numpy.float16)
    wrong_dq = exact[0] * math.sqrt(32)
    assert numpy.abs(wrong_dq - exact[0]).max() > reference.error_bound(exact[0], lowp[0], "float16")


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_backward_falls_back_to_tiled_numpy_without_gpu(rng, dtype):
    q, k, v = random_qkv(rng, dtype, 2, 33, 47, 3, 40)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    for g, x in zip(grads, (q, k, v)):
        assert isinstance(g, numpy.ndarray) and g.dtype == x.dtype and g.shape == x.shape
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, True)
