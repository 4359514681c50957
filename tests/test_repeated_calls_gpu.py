"""Calls that repeat a checked problem (api/common.py's cache): the second and later calls
with the same shapes, strides, dtypes and options skip the checks and reuse the parameter struct
and tensor maps the first one built. Each must still read its own arrays and write its own
outputs, whichever kernel serves it (marker `gpu`)."""

import math

import numpy
import pytest

import cupyflash
from cupyflash import BlockMask
from cupyflash.api import common
from shapes import random_qkv
from test_attention_gpu import assert_matches_reference
from test_backward_gpu import assert_gradients_match_reference

pytestmark = pytest.mark.gpu


@pytest.fixture
def checks(monkeypatch):
    """An empty cache of checked problems (calls without a block mask) that counts its misses,
    by direction."""
    counted = {"forward": 0, "backward": 0}

    class Counting(dict):
        def __setitem__(self, key, value):
            counted[key[0]] += 1
            super().__setitem__(key, value)

    monkeypatch.setattr(common, "CHECKED", Counting())
    return counted


def _inputs(rng, dtype, shape, strided=False):
    """q, k, v and dout on the GPU; strided: q a transposed (batch, heads, seq, head_dim) array and
    k, v views into one buffer (the same shapes as contiguous ones, other strides)."""
    import cupy

    batch, seqlen_q, seqlen_k, heads, head_dim = shape
    q, k, v = random_qkv(rng, dtype, batch, seqlen_q, seqlen_k, heads, head_dim)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    if not strided:
        return tuple(cupy.asarray(x) for x in (q, k, v, dout))
    q = cupy.asarray(numpy.ascontiguousarray(q.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    kv = cupy.asarray(numpy.stack([k, v], axis=2))
    return q, kv[:, :, 0], kv[:, :, 1], cupy.asarray(dout)


@pytest.mark.parametrize("head_dim", [59, 64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_forward_and_backward_repeated_with_new_arrays(rng, nan_outputs, checks, dtype, head_dim):
    """Three calls of one shape: new arrays (new pointers: the struct's and the tensor maps' must
    follow), then strided views of the same shapes (another key: checked again)."""
    shape = (2, 130, 200, 4, head_dim)
    for call, strided in enumerate([False, False, True, False]):
        q, k, v, dout = _inputs(rng, dtype, shape, strided)
        out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
        assert_matches_reference(q, k, v, out, lse, dtype, True)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        assert_gradients_match_reference(dout, q, k, v, grads, dtype, True)
        expected = 1 if call < 2 else 2  # the contiguous key, then the strided one
        assert checks == {"forward": expected, "backward": expected}, f"call {call}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_block_sparse_repeated_with_new_arrays_and_masks(rng, nan_outputs, checks, dtype, head_dim):
    """Two masks of one shape, each checked once and kept by its mask, with new arrays on every
    call; sparse enough for the warp-specialised dK/dV kernel where it serves (head_dim 64 below
    density 0.3, 128 always, on sm_90)."""
    seqlen_q, seqlen_k, heads = 517, 700, 3
    blocks = (heads, math.ceil(seqlen_q / 128), math.ceil(seqlen_k / 128))
    masks = [BlockMask(rng.random(blocks) < density) for density in (0.25, 0.5)]
    for call in range(4):
        mask = masks[call % 2]
        q, k, v, dout = _inputs(rng, dtype, (2, seqlen_q, seqlen_k, heads, head_dim))
        out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
        assert_matches_reference(q, k, v, out, lse, dtype, False, block_mask=mask)
        grads = cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask)
        assert_gradients_match_reference(dout, q, k, v, grads, dtype, False, block_mask=mask)
    assert checks == {"forward": 0, "backward": 0}  # kept by the masks: one forward, one backward each
    assert [sorted(key[0] for key in m.checked_problems) for m in masks] == [["backward", "forward"]] * 2


def test_dropout_seeds_change_between_repeated_calls(rng, checks):
    """The seed is not part of the key: each call's own seed reaches the kernels."""
    q, k, v, _ = _inputs(rng, "bfloat16", (1, 200, 200, 2, 64))
    first = cupyflash.attention(q, k, v, dropout_p=0.3, seed=1)
    again = cupyflash.attention(q, k, v, dropout_p=0.3, seed=1)
    other = cupyflash.attention(q, k, v, dropout_p=0.3, seed=2)
    plain = cupyflash.attention(q, k, v)
    assert bool((first == again).all()) and not bool((first == other).all()) and not bool((first == plain).all())
    assert checks["forward"] == 1


def test_a_decode_step_key_lets_no_bad_window_through(rng):
    """attention_decode keeps its own cache of checked steps, keyed the same way: a window side of
    True after the same window with 1 is refused, not taken for the cached step."""
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "bfloat16", 2, 1, 300, 2, 64))
    cupyflash.attention_decode(q, k, v, cupy.asarray(numpy.array([200, 300], numpy.int32)), window=(1, None))
    with pytest.raises(TypeError, match="window's left side must be an int"):
        cupyflash.attention_decode(q, k, v, cupy.asarray(numpy.array([200, 300], numpy.int32)), window=(True, None))
