"""Zero-size problems, NumPy-style: an empty batch, no heads, no queries or no keys give results of
the right (possibly empty) shapes and the values the definition gives (no query: dk = dv = 0; no
key: out 0, lse -inf, dq = 0), on NumPy inputs (the CPU fallback, or the GPU where there is one)
and, with the `gpu` marker, on CuPy inputs."""

import numpy
import pytest

import cupyflash
from shapes import random_qkv

# (batch, seqlen_q, seqlen_k, heads, heads_kv)
EMPTY = [(0, 8, 8, 2, 2), (1, 8, 8, 0, 0), (2, 0, 5, 3, 3), (2, 4, 0, 3, 3), (0, 0, 0, 2, 1)]


def check(q, k, v, xp, **options):
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **options)
    assert type(out) is type(q) and out.shape == q.shape and out.dtype == q.dtype
    batch, seqlen_q, heads, _ = q.shape
    assert lse.shape == (batch, heads, seqlen_q)
    assert bool((out == 0).all()) and bool(xp.isneginf(lse).all())  # (empty, or no key: 0 and -inf)
    grads = cupyflash.attention_backward(xp.ones_like(out), q, k, v, out, lse, **options)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and bool((g == 0).all())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_kv", EMPTY)
def test_empty_problems_give_empty_or_zero_results(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, causal):
    q, k, v = random_qkv(rng, "float32", batch, seqlen_q, seqlen_k, heads, 16, heads_kv)
    check(q, k, v, numpy, causal=causal)


def test_empty_block_sparse_decode_and_varlen(rng):
    q, k, v = random_qkv(rng, "float16", 0, 256, 256, 2, 16)
    mask = cupyflash.BlockMask(numpy.ones((2, 2, 2), bool))
    assert cupyflash.block_sparse_attention(q, k, v, mask).shape == q.shape
    q, k, v = random_qkv(rng, "float32", 1, 1, 32, 0, 16, 0)
    assert cupyflash.attention_decode(q, k, v, [4]).shape == (1, 1, 0, 16)
    empty = numpy.zeros((0, 2, 16), numpy.float32)
    out, lse = cupyflash.attention_varlen(empty, empty, empty, [0, 0, 0], [0, 0, 0], return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)


def test_heads_without_kv_heads_are_refused():
    q, k = numpy.zeros((1, 4, 0, 16), numpy.float32), numpy.zeros((1, 4, 2, 16), numpy.float32)
    with pytest.raises(ValueError, match="heads_kv"):
        cupyflash.attention(q, k, k)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_kv", EMPTY)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_empty_problems_on_the_gpu(rng, nan_outputs, dtype, batch, seqlen_q, seqlen_k, heads, heads_kv):
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, batch, seqlen_q, seqlen_k, heads, 64, heads_kv))
    check(q, k, v, cupy, causal=True)
    out = cupyflash.attention_decode(q[:, :1], k, v, None)
    assert out.shape == q[:, :1].shape
