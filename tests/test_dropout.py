"""Dropout, CPU side: the NumPy Philox4x32-10 against Random123's known answers; the keep mask's
layout, keep rate and independence; the reference against a brute force with scipy's softmax and
finite differences; the tiled CPU fallback against the reference; unbiasedness; argument checks."""

import math

import numpy
import pytest
import scipy.special

import cupyflash
from cupyflash import catalog, validation, reference
from cupyflash.catalog.specs import DropoutMaskKernel
from cupyflash.cpu import philox


# Random123's kat_vectors, "philox4x32 10" lines: counter, key -> output.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox.philox4x32_10(counter, key)) == expected


def test_mask_is_the_documented_function_of_coordinates():
    """Element (i, j) of (b, h): word 2·((i//8)%2) + (j//8)%2 of Philox(counter (group(j), group(i),
    b·heads + h, offset), key (seed mod 2^32, seed // 2^32)) compared with round(p·2^32), computed
    here one element at a time."""
    seed, offset, p, heads = 0x1234_5678_9ABC_DEF1, 77, 0.37, 3
    keep = cupyflash.dropout_mask(2, heads, 21, 35, dropout_p=p, seed=seed, offset=offset, device=False)
    threshold = round(p * 2**32)
    group = lambda x: 8 * (x // 16) + x % 8  # noqa: E731
    rng = numpy.random.default_rng(0)
    for b, h, i, j in zip(rng.integers(0, 2, 60), rng.integers(0, heads, 60), rng.integers(0, 21, 60),
                          rng.integers(0, 35, 60)):
        words = philox.philox4x32_10((group(j), group(i), b * heads + h, offset), (seed % 2**32, seed >> 32))
        assert keep[b, h, i, j] == (int(words[2 * (i // 8 % 2) + j // 8 % 2]) >= threshold)


def test_mask_of_a_smaller_problem_is_a_corner_of_a_larger_one():
    big = cupyflash.dropout_mask(3, 2, 100, 130, dropout_p=0.5, seed=5, offset=1, device=False)
    small = cupyflash.dropout_mask(2, 2, 37, 81, dropout_p=0.5, seed=5, offset=1, device=False)
    numpy.testing.assert_array_equal(small, big[:2, :, :37, :81])
    numpy.testing.assert_array_equal(philox.keep_mask_numpy(1, 2, 37, 81, 0.5, 5, 1, batch_start=2), big[2:, :, :37, :81])


def test_keep_rate_and_independence_of_streams():
    shape = (2, 3, 200, 300)
    n = math.prod(shape)
    for p in (0.1, 0.5, 0.8):
        keep = cupyflash.dropout_mask(*shape, dropout_p=p, seed=42, device=False)
        q = 1 - p
        assert abs(keep.mean() - q) <= 5 * math.sqrt(q * p / n)
        other = cupyflash.dropout_mask(*shape, dropout_p=p, seed=42, offset=1, device=False)
        assert abs((keep & other).mean() - q * q) <= 5 * math.sqrt(q * q * (1 - q * q) / n)
        # neighbouring elements, rows and heads are not correlated either
        assert abs((keep[..., 1:] & keep[..., :-1]).mean() - q * q) <= 6 * math.sqrt(q * q / (n / 2))
        assert abs((keep[:, 1:] & keep[:, :-1]).mean() - q * q) <= 6 * math.sqrt(q * q / (n / 3))
    assert cupyflash.dropout_mask(1, 1, 5, 5, dropout_p=0.0, seed=1, device=False).all()


def test_p_resolution_and_rescale():
    assert philox.threshold(0.0) == 0 and philox.rescale(0.0) == 1.0
    assert philox.threshold(0.25) == 2**30 and philox.rescale(0.25) == 4 / 3
    assert philox.threshold(1 - 2**-40) == 2**32 - 1  # never all dropped: the threshold fits 32 bits
    assert not validation.check_dropout(1e-12, 3, 0, _problem()).dropout  # below 2^-32: no dropout


def _problem():
    x = numpy.zeros((1, 4, 2, 8), numpy.float32)
    return validation.check_attention_args(x, x, x, causal=False, scale=None, return_lse=False)


def brute_force(q, k, v, keep, p, causal=False, scale=None):
    """out[b, i, h] = sum_j softmax_j(s)_ij · keep_ij / (1 - p) · v_j, one (b, h, i) at a time."""
    batch, sq, heads, d = q.shape
    group = heads // k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = numpy.zeros(q.shape)
    for b in range(batch):
        for h in range(heads):
            for i in range(sq):
                s = scale * k[b, :, h // group] @ q[b, i, h]
                if causal:
                    s[numpy.arange(k.shape[1]) > i + k.shape[1] - sq] = -numpy.inf
                w = scipy.special.softmax(s) * keep[b, h, i] / (1 - p)
                out[b, i, h] = w @ v[b, :, h // group]
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_the_definition(rng, causal):
    q = rng.standard_normal((2, 19, 4, 8))
    k, v = (rng.standard_normal((2, 23, 2, 8)) for _ in range(2))
    options = {"dropout_p": 0.35, "seed": 2**63 + 17, "offset": 4}
    keep = cupyflash.dropout_mask(2, 4, 19, 23, device=False, **options)
    out, lse = reference.attention(q, k, v, causal=causal, return_lse=True, **options)
    numpy.testing.assert_allclose(out, brute_force(q, k, v, keep, 0.25 + 0.1, causal), atol=1e-12)
    # lse is that of the probabilities before dropout
    numpy.testing.assert_allclose(lse, reference.attention(q, k, v, causal=causal, return_lse=True)[1], atol=1e-13)


def test_reference_gradients_are_finite_differences(rng):
    q = rng.standard_normal((1, 11, 2, 6))
    k, v = (rng.standard_normal((1, 13, 1, 6)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    options = {"causal": True, "dropout_p": 0.4, "seed": 8, "offset": 2, "softcap": 3.0}
    grads = reference.attention_backward(dout, q, k, v, **options)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        for index in [tuple(rng.integers(0, n) for n in x.shape) for _ in range(6)]:
            plus, minus = x.copy(), x.copy()
            plus[index] += eps
            minus[index] -= eps
            args = [plus if y is x else y for y in (q, k, v)], [minus if y is x else y for y in (q, k, v)]
            f = [(reference.attention(*a, **options) * dout).sum() for a in args]
            assert abs((f[0] - f[1]) / (2 * eps) - g[index]) <= 1e-6 * max(1.0, abs(g[index]))


@pytest.mark.parametrize("options", [
    {"causal": True},
    {"window": (9, 4), "softcap": 2.0, "alibi_slopes": numpy.array([0.5, 0.25, 0.125, 0.0625])},
    {"block_mask": cupyflash.BlockMask(numpy.array([[[1, 0, 1], [1, 1, 0]]], bool), block_size=(16, 16))},
])
def test_tiled_fallback_matches_the_reference(rng, options):
    q = rng.standard_normal((2, 29, 4, 12))
    k, v = (rng.standard_normal((2, 37, 2, 12)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    options = {**options, "dropout_p": 0.3, "seed": 123456789, "offset": 0}
    out, lse = reference.attention(q, k, v, return_lse=True, **options)
    tiled, tiled_lse = reference.tiled_attention(q, k, v, return_lse=True, block_m=16, block_n=16, **options)
    numpy.testing.assert_allclose(tiled, out, atol=1e-12)
    numpy.testing.assert_allclose(tiled_lse, lse, atol=1e-12)
    exact = reference.attention_backward(dout, q, k, v, **options)
    tiled_grads = reference.tiled_attention_backward(dout, q, k, v, out, lse, block_m=16, block_n=16, **options)
    for a, b in zip(tiled_grads, exact):
        numpy.testing.assert_allclose(a, b, atol=1e-11)


@pytest.mark.cpu_only
def test_cpu_fallback_applies_the_same_mask(rng):
    q = rng.standard_normal((2, 21, 2, 8)).astype(numpy.float32)
    options = {"causal": True, "dropout_p": 0.5, "seed": 3, "offset": 1}
    out, lse = cupyflash.attention(q, q, q, return_lse=True, **options)
    numpy.testing.assert_allclose(out, reference.attention(q, q, q, **options), atol=1e-5)
    dout = numpy.ones_like(q)
    grads = cupyflash.attention_backward(dout, q, q, q, out, lse, **options)
    exact = reference.attention_backward(dout, q, q, q, **options)
    numpy.testing.assert_allclose(sum(grads), sum(exact), atol=1e-4)


def test_varlen_reference_gives_sequence_b_the_mask_of_entry_b(rng):
    cu = numpy.array([0, 5, 5, 22], numpy.int32)
    q = rng.standard_normal((22, 2, 8))
    options = {"dropout_p": 0.5, "seed": 10, "offset": 0}
    out = reference.attention_varlen(q, q, q, cu, cu, **options)
    keep = cupyflash.dropout_mask(3, 2, 17, 17, device=False, **options)
    expected = brute_force(q[None, 5:22], q[None, 5:22], q[None, 5:22], keep[2:, :, :17, :17], 0.5)
    numpy.testing.assert_allclose(out[5:22], expected[0], atol=1e-12)


def test_output_is_unbiased(rng):
    """The mean over 2000 seeds of the reference's dropout output is the plain output within 6
    standard errors, element by element."""
    q = rng.standard_normal((1, 6, 1, 4))
    runs = numpy.stack([reference.attention(q, q, q, dropout_p=0.3, seed=s) for s in range(2000)])
    error = numpy.abs(runs.mean(axis=0) - reference.attention(q, q, q))
    assert (error <= 6 * runs.std(axis=0) / math.sqrt(len(runs)) + 1e-12).all()


def test_dropout_takes_the_score_modifier_kernels():
    p = validation.check_dropout(0.1, 1, 0, _problem())
    assert p.dropout and p.modified and not p.score_mod
    kernel = catalog.forward_kernel("scalar", p.dtype_name, p.head_dim, catalog.Variant(p.local, False, p.modified))
    assert kernel.score_mod and kernel in catalog.all_kernels()
    assert DropoutMaskKernel() in catalog.all_kernels()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"dropout_p": 0.1}, ValueError, "seed is required when dropout_p > 0"),
    ({"dropout_p": 1.0, "seed": 1}, ValueError, r"dropout_p must be in \[0, 1\)"),
    ({"dropout_p": -0.1, "seed": 1}, ValueError, r"dropout_p must be in \[0, 1\)"),
    ({"dropout_p": float("nan"), "seed": 1}, ValueError, r"dropout_p must be in \[0, 1\)"),
    ({"dropout_p": True, "seed": 1}, TypeError, "dropout_p must be a real number"),
    ({"dropout_p": "0.1", "seed": 1}, TypeError, "dropout_p must be a real number"),
    ({"dropout_p": 0.1, "seed": 2**64}, ValueError, r"seed must be in \[0, 18446744073709551616\)"),
    ({"dropout_p": 0.1, "seed": -1}, ValueError, "seed must be in"),
    ({"dropout_p": 0.1, "seed": 1.0}, TypeError, "seed must be an int"),
    ({"dropout_p": 0.1, "seed": 1, "offset": 2**32}, ValueError, "offset must be in"),
    ({"dropout_p": 0.1, "seed": 1, "offset": None}, TypeError, "offset must be an int"),
])
def test_bad_dropout_arguments_are_rejected_untouched(rng, kwargs, error, match):
    q = rng.standard_normal((1, 5, 2, 8)).astype(numpy.float32)
    before = q.copy()
    out = numpy.ones_like(q)
    lse = numpy.zeros((1, 2, 5), numpy.float32)
    for call in (lambda: cupyflash.attention(q, q, q, **kwargs),
                 lambda: cupyflash.attention_backward(q, q, q, q, out, lse, **kwargs),
                 lambda: cupyflash.attention_varlen(q[0], q[0], q[0], [0, 5], [0, 5], **kwargs),
                 lambda: cupyflash.dropout_mask(1, 2, 5, 5, **{"dropout_p": 0.0, "seed": None, **kwargs})):
        with pytest.raises(error, match=match):
            call()
    numpy.testing.assert_array_equal(q, before)


@pytest.mark.parametrize("args,error,match", [
    ((-1, 2, 3, 4), ValueError, "batch must be at least 0"),
    ((1, 2.0, 3, 4), TypeError, "heads must be an int"),
    ((1, 70000, 3, 4), ValueError, "batch and heads must each be at most"),
])
def test_bad_mask_sizes_are_rejected(args, error, match):
    with pytest.raises(error, match=match):
        cupyflash.dropout_mask(*args, dropout_p=0.1, seed=1)
    with pytest.raises(TypeError, match="device must be True or False"):
        cupyflash.dropout_mask(1, 1, 1, 1, dropout_p=0.1, seed=1, device="gpu")
