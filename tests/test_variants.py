"""GQA/MQA and sliding-window (local) attention on the CPU: the float64 reference against brute
force and finite differences, the tiled mirror (the kernels' tile walk) against the reference,
the no-GPU fallback, and input validation."""

import numpy
import pytest
import scipy.special

import cupyflash
from cupyflash import BlockMask, validation, reference
from cupyflash.api import common
from shapes import random_qkv

# (left, right) windows: None is unbounded; one-sided, two-sided, a band of the diagonal only,
# and bands wider than the sequences.
WINDOWS = [(0, 0), (5, 0), (16, 3), (None, 7), (40, None), (1000, 1000)]


def random_gqa(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim):
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim))
    k = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
    v = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
    return q, k, v


def brute_force(q, k, v, scale, visible):
    """Loops over (batch, head, query): softmax over the visible keys by scipy; K/V head h // group."""
    b, sq, h, d = q.shape
    group = h // k.shape[2]
    out = numpy.zeros(q.shape)
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                keys = [j for j in range(k.shape[1]) if visible(i, j)]
                if not keys:
                    continue
                s = numpy.array([scale * q[bi, i, hi] @ k[bi, j, hi // group] for j in keys])
                out[bi, i, hi] = scipy.special.softmax(s) @ v[bi, keys, hi // group]
    return out


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(7, 7), (5, 12), (12, 5)])
def test_band_mask_is_its_definition(seqlen_q, seqlen_k, window):
    left, right = window
    offset = seqlen_k - seqlen_q
    hidden = reference.band_mask(seqlen_q, seqlen_k, left, right)
    for i in range(seqlen_q):
        for j in range(seqlen_k):
            visible = (left is None or j >= i + offset - left) and (right is None or j <= i + offset + right)
            assert hidden[i, j] == (not visible)
    numpy.testing.assert_array_equal(reference.causal_mask(seqlen_q, seqlen_k), reference.band_mask(seqlen_q, seqlen_k, None, 0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS[:4])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (4, 2), (3, 1)])
def test_reference_against_brute_force(rng, heads, heads_kv, window, causal):
    q, k, v = random_gqa(rng, 2, 9, 13, heads, heads_kv, 5)
    out, lse = reference.attention(q, k, v, causal=causal, window=window, scale=0.4, return_lse=True)
    left, right = window
    right = 0 if causal else right
    offset = 13 - 9

    def visible(i, j):
        return (left is None or j >= i + offset - left) and (right is None or j <= i + offset + right)

    numpy.testing.assert_allclose(out, brute_force(q, k, v, 0.4, visible), rtol=1e-12, atol=1e-12)
    # With seqlen_q <= seqlen_k every query sees at least its own diagonal key, even in window (0, 0).
    assert numpy.isfinite(lse).all()


@pytest.mark.parametrize("window,causal", [((3, 1), False), ((None, None), True), ((4, None), True), (None, False)])
@pytest.mark.parametrize("heads,heads_kv", [(4, 2), (2, 1), (2, 2)])
def test_reference_gradients_against_finite_differences(rng, heads, heads_kv, window, causal):
    q, k, v = random_gqa(rng, 1, 6, 8, heads, heads_kv, 4)
    dout = rng.standard_normal(q.shape)
    options = {"causal": causal, "window": window, "scale": 0.7}
    grads = reference.attention_backward(dout, q, k, v, **options)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]

    def loss(q_, k_, v_):
        return float((reference.attention(q_, k_, v_, **options) * dout).sum())

    eps = 1e-6
    for index, (x, g) in enumerate(zip((q, k, v), grads)):
        direction = rng.standard_normal(x.shape)
        args_plus = [q, k, v]
        args_minus = [q, k, v]
        args_plus[index] = x + eps * direction
        args_minus[index] = x - eps * direction
        numeric = (loss(*args_plus) - loss(*args_minus)) / (2 * eps)
        assert abs(numeric - float((g * direction).sum())) <= 1e-6 * max(1.0, abs(numeric)), "qkv"[index]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (37, 100), (100, 37), (130, 130)])
def test_tiled_mirror_matches_reference(rng, seqlen_q, seqlen_k, window, causal):
    q, k, v = random_gqa(rng, 1, seqlen_q, seqlen_k, 4, 2, 8)
    dout = rng.standard_normal(q.shape)
    options = {"causal": causal, "window": window}
    out, lse = reference.tiled_attention(q, k, v, return_lse=True, block_m=16, block_n=16, **options)
    want, want_lse = reference.attention(q, k, v, return_lse=True, **options)
    numpy.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_array_equal(numpy.isneginf(lse), numpy.isneginf(want_lse))
    finite = numpy.isfinite(want_lse)
    numpy.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12, atol=1e-12)
    grads = reference.tiled_attention_backward(dout, q, k, v, out, lse, block_m=16, block_n=16, **options)
    for g, w in zip(grads, reference.attention_backward(dout, q, k, v, **options)):
        numpy.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


def test_tiled_mirror_with_block_mask_window_and_gqa(rng):
    seqlen = 200
    q, k, v = random_gqa(rng, 2, seqlen, seqlen, 4, 1, 8)
    dout = rng.standard_normal(q.shape)
    mask = BlockMask(rng.random((4, 7, 7)) < 0.6, 32)
    options = {"causal": True, "window": (50, None), "block_mask": mask}
    out, lse = reference.tiled_attention(q, k, v, return_lse=True, block_m=16, block_n=16, **options)
    want, want_lse = reference.attention(q, k, v, return_lse=True, **options)
    numpy.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    grads = reference.tiled_attention_backward(dout, q, k, v, out, lse, block_m=16, block_n=32, **options)
    for g, w in zip(grads, reference.attention_backward(dout, q, k, v, **options)):
        numpy.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [(0, 0), (20, 3), (None, 9), (3, None)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(50, 300), (300, 50), (257, 257)])
def test_tile_walks_visit_exactly_the_tiles_with_a_visible_key(seqlen_q, seqlen_k, window):
    """key_tiles and query_tiles (the kernels' walks) skip every tile outside the band and keep
    every tile with a visible key, for every query tile and key tile."""
    q = numpy.zeros((1, seqlen_q, 1, 4))
    kv = numpy.zeros((1, seqlen_k, 1, 4))
    p = validation.check_attention_args(q, kv, kv, causal=False, scale=None, return_lse=False, window=window)
    visible = ~reference.band_mask(seqlen_q, seqlen_k, *window)
    for block in (16, 64):
        for row0 in range(0, seqlen_q, block):
            rows = min(block, seqlen_q - row0)
            want = [n for n in range(-(-seqlen_k // block)) if visible[row0 : row0 + rows, n * block : (n + 1) * block].any()]
            assert reference.key_tiles(p, None, row0, rows, block) == want
        for col0 in range(0, seqlen_k, block):
            cols = min(block, seqlen_k - col0)
            want = [m for m in range(-(-seqlen_q // block)) if visible[m * block : (m + 1) * block, col0 : col0 + cols].any()]
            assert reference.query_tiles(p, None, col0, cols, block) == want


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fallback_runs_gqa_and_windows(rng, dtype):
    q, k, v = (x.astype(dtype) for x in random_gqa(rng, 2, 40, 70, 6, 2, 16))
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, lse = cupyflash.attention(q, k, v, causal=True, window=(20, None), return_lse=True)
    want = reference.attention(q, k, v, causal=True, window=(20, None))
    numpy.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, window=(20, None))
    for g, w, x in zip(grads, reference.attention_backward(dout, q, k, v, causal=True, window=(20, None)), (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        numpy.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "window,error,message",
    [
        (5, TypeError, r"^window must be None or a pair \(left, right\)"),
        ((1, 2, 3), TypeError, r"^window must be None or a pair"),
        ((1.5, 2), TypeError, r"^window's left side must be an int or None, got 1.5"),
        ((1, True), TypeError, r"^window's right side must be an int or None, got True"),
        ((-2, 0), ValueError, r"^window's left side must be >= 0, or -1 or None for unbounded, got -2"),
    ],
)
def test_bad_window(rng, window, error, message):
    q, k, v = random_qkv(rng, "float32", 1, 4, 4, 2, 8)
    before = [x.copy() for x in (q, k, v)]
    with pytest.raises(error, match=message):
        cupyflash.attention(q, k, v, window=window)
    for x, x0 in zip((q, k, v), before):
        numpy.testing.assert_array_equal(x, x0)


def test_window_spellings():
    assert validation.check_window(None) is None
    assert validation.check_window((None, None)) is None
    assert validation.check_window((-1, -1)) is None
    assert validation.check_window([3, -1]) == (3, None)
    assert validation.check_window((numpy.int64(2), 0)) == (2, 0)


def test_problem_band_folds_causal_and_clamps_for_the_kernels(rng):
    q, k, v = random_qkv(rng, "float32", 1, 10, 30, 2, 8)
    p = validation.check_attention_args(q, k, v, causal=True, scale=None, return_lse=False, window=(5, 9))
    assert p.local and p.band == (5, 0) and p.kernel_window() == (5, 0)
    p = validation.check_attention_args(q, k, v, causal=False, scale=None, return_lse=False, window=(None, 500))
    assert p.local and p.band == (None, 500) and p.kernel_window() == (30, 10)
    p = validation.check_attention_args(q, k, v, causal=False, scale=None, return_lse=False, window=(None, None))
    assert not p.local and p.window is None


@pytest.mark.parametrize(
    "heads_k,heads_v,message",
    [
        (3, 3, r"^k must have shape \(batch=1, seqlen_k, heads_kv, head_dim=8\) with heads_kv dividing q's 4 heads"),
        (2, 4, r"^k and v must have the same seqlen_k and heads"),
        (0, 0, r"^k must have shape"),
    ],
)
def test_gqa_head_counts(rng, heads_k, heads_v, message):
    q = rng.standard_normal((1, 5, 4, 8)).astype(numpy.float32)
    k = rng.standard_normal((1, 6, heads_k, 8)).astype(numpy.float32)
    v = rng.standard_normal((1, 6, heads_v, 8)).astype(numpy.float32)
    with pytest.raises(ValueError, match=message):
        cupyflash.attention(q, k, v)


def test_gqa_group_and_block_mask_heads(rng):
    q, k, v = random_gqa(rng, 1, 256, 256, 6, 2, 8)
    p = validation.check_attention_args(q, k, v, causal=False, scale=None, return_lse=False)
    assert (p.heads, p.heads_kv, p.kv_group) == (6, 2, 3)
    # A block mask's head axis counts query heads.
    common.check_block_mask(BlockMask(numpy.ones((6, 2, 2), bool)), p)
    with pytest.raises(ValueError, match=r"^block_mask's batch and head axes must be 1 or the inputs'"):
        common.check_block_mask(BlockMask(numpy.ones((2, 2, 2), bool)), p)
