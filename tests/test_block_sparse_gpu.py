"""Block-sparse attention on the GPU (marker `gpu`): forward and backward against the float64
block-sparse reference under the tolerance rule, on the fast (tensor-core) and scalar paths."""

import dataclasses
import math

import numpy
import pytest

import cupyflash
from cupyflash import BlockMask, catalog, validation
from cupyflash.catalog import Unavailable, Variant, tiles
from families import HOPPER, MMA_SYNC, SCALAR, backward, forward
from cupyflash.api import common
from shapes import DTYPES, bits, random_qkv
from test_attention_gpu import assert_matches_reference
from test_backward_gpu import assert_gradients_match_reference, assert_workspace_poisoned

pytestmark = pytest.mark.gpu


def run_block_sparse(rng, dtype, shape, mask, causal, deterministic=False, grads=True):
    import cupy

    batch, seqlen_q, seqlen_k, heads, head_dim = shape
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, batch, seqlen_q, seqlen_k, heads, head_dim))
    out, lse = cupyflash.block_sparse_attention(q, k, v, mask, causal=causal, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, dtype, causal, block_mask=mask)
    if not grads:
        return
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    g = cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask, causal=causal, deterministic=deterministic)
    assert_gradients_match_reference(dout, q, k, v, g, dtype, causal, block_mask=mask)


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dq_workspace_is_cleared_where_no_block_is_kept(rng, policy, nan_outputs, poisoned_empty, dtype, ring):
    """Query rows whose blocks are all zero get no dQ share from any key block: their rows of the
    uninitialised (here NaN) workspace must still come out as dq = 0. With `ring`, the Hopper
    warp-specialised kernel's dQ ring instead (zeroed, sm90/bwd_dkdv_ws.cu's wait_for_slot), whose
    rounding must write those rows of dq (NaN before) too; two slots for six slabs, so that the
    rows come from reused slots (where a Hopper kernel serves the dtype; elsewhere the whole
    workspace, unchecked)."""
    policy(ring_head_dims=(64,) if ring else ())
    if ring:
        policy(ws_backward=True, ring_slabs=2)
    seqlen_q, seqlen_k, heads = 517, 300, 3
    dense = rng.random((heads, math.ceil(seqlen_q / 128), math.ceil(seqlen_k / 128))) < 0.5
    dense[:, 1] = False  # a query block with no key block, in every head
    run_block_sparse(rng, dtype, (2, seqlen_q, seqlen_k, heads, 64), BlockMask(dense), causal=False)
    if not ring:
        assert_workspace_poisoned(poisoned_empty, 2 * seqlen_q, heads, 64, dtype)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_masks(rng, nan_outputs, dtype, density, causal, deterministic):
    # seqlens that end inside their last block, seqlen_q != seqlen_k, a head dim that is padded;
    # a mask per head, so the heads walk different blocks.
    seqlen_q, seqlen_k, heads = 517, 300, 3
    mask = BlockMask(rng.random((heads, math.ceil(seqlen_q / 128), math.ceil(seqlen_k / 128))) < density)
    run_block_sparse(rng, dtype, (2, seqlen_q, seqlen_k, heads, 59), mask, causal, deterministic)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 0), (0, 33)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_no_keys_or_no_queries(rng, nan_outputs, dtype, seqlen_q, seqlen_k, causal):
    """A mask with no key blocks (or no query blocks) has index rows with no entries, which the
    kernels must not read (they read a row's first entry beside its count): out 0 and lse -inf
    with no keys, dk and dv 0 with no queries."""
    mask = BlockMask(numpy.ones((2, math.ceil(seqlen_q / 128), math.ceil(seqlen_k / 128)), bool))
    run_block_sparse(rng, dtype, (2, seqlen_q, seqlen_k, 2, 64), mask, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_key_blocks_start_longest_first(rng, nan_outputs, dtype, causal):
    """The dK/dV pass starts the mask's key blocks in its key_order (most query blocks first). Here
    the last key block has the most, and with blocks of 256 keys and seqlen_k 600 it holds one key
    tile of 128 where the others hold two: it starts first, and its second tile's launch position
    (past seqlen_k) must do nothing. Every dK/dV kernel family the dtype has on this GPU (the
    mma.sync one keeps index order, but its launch is rounded up the same way)."""
    import cupy

    seqlen_q, seqlen_k, heads = 517, 600, 3
    dense = rng.random((heads, 5, 3)) < 0.4
    dense[:, :, 2] = True
    dense[:, 0, :2] = False
    mask = BlockMask(dense, (128, 256))
    assert (mask.key_order[0, :, 0] == 2).all()
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 2, seqlen_q, seqlen_k, heads, 64))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    out, lse = cupyflash.block_sparse_attention(q, k, v, mask, causal=causal, return_lse=True)
    p = validation.check_backward_args(dout, q, k, v, out, lse, causal=causal, scale=None, deterministic=False)
    p = common.check_block_mask(mask, p)
    # Every family that serves the problem here: the scalar kernels, mma.sync, and on sm_90 the Hopper ones.
    sm_90 = cupy.cuda.Device().compute_capability == "90"
    families = [SCALAR] + ([MMA_SYNC] if dtype in tiles.TENSOR_CORE_DTYPES else []) + (
        [HOPPER] if sm_90 and dtype in tiles.TENSOR_CORE_DTYPES else [])
    for family in families:
        grads = [cupy.full(x.shape, numpy.nan, numpy.float32).astype(x.dtype) for x in (q, k, v)]
        backward(p, dout, q, k, v, out, lse, *grads, families=family)
        assert_gradients_match_reference(dout, q, k, v, grads, dtype, causal, block_mask=mask)


@pytest.mark.parametrize("head_dim", [16, 40, 64, 96, 128, 200, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_head_dim_class(rng, nan_outputs, dtype, head_dim):
    mask = BlockMask.local(700, 700, window=150)
    run_block_sparse(rng, dtype, (1, 700, 700, 2, head_dim), mask, causal=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_batch_masks_block_sizes_and_rows_with_no_key(rng, nan_outputs, dtype):
    # A mask per batch entry (heads broadcast), blocks of 256 x 128, and query blocks with no key.
    dense = rng.random((2, 1, 3, 5)) < 0.5
    dense[0, 0, 1] = False
    mask = BlockMask(dense, (256, 128))
    run_block_sparse(rng, dtype, (2, 600, 577, 2, 64), mask, causal=False)
    for constructor in (BlockMask.strided(600, 577, 2), BlockMask.bigbird(600, 577, 0, 1, 1, seed=3, heads=2)):
        run_block_sparse(rng, dtype, (2, 600, 577, 2, 64), constructor, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_mask_is_bitwise_dense_attention(rng, dtype):
    """With every block nonzero the kernels take the same tiles in the same order as dense
    attention: the same bits (dq in deterministic mode; the atomic dq's order varies). Head dims
    where the block-sparse kernels have the dense kernels' tiles: 59 (padded to 64) not causal, 150
    (padded to 160) causal (at d65-128 the 16-bit forward's differ, and at d <= 64 the causal
    one's, `tc_fwd_tile_shape`)."""
    import cupy

    for causal, head_dim in ((False, 59), (True, 150)):
        for family in ("sm80", "scalar"):
            for make in (catalog.forward_kernel, catalog.dkdv_kernel):
                try:
                    pair = [make(family, dtype, head_dim, Variant(causal, sparse)) for sparse in (False, True)]
                except Unavailable:
                    continue
                same = [dataclasses.replace(k.tile, min_blocks_per_sm=1) for k in pair]  # (occupancy alone)
                assert same[0] == same[1], (make.__name__, family)
        q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 2, 333, 517, 2, head_dim))
        dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
        mask = BlockMask(numpy.ones((1, 3, 5), bool))
        dense = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
        sparse = cupyflash.block_sparse_attention(q, k, v, mask, causal=causal, return_lse=True)
        for a, b in zip(dense, sparse):
            assert bool((bits(a) == bits(b)).all())
        for deterministic in (False, True):
            want = cupyflash.attention_backward(dout, q, k, v, *dense, causal=causal, deterministic=deterministic)
            got = cupyflash.block_sparse_attention_backward(
                dout, q, k, v, *dense, mask, causal=causal, deterministic=deterministic
            )
            for name, a, b in list(zip("qkv", want, got))[0 if deterministic else 1 :]:
                assert bool((bits(a) == bits(b)).all()), f"d{name}"


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_empty_mask(rng, nan_outputs, dtype):
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 1, 200, 300, 2, 32))
    mask = BlockMask(numpy.zeros((1, 2, 3), bool))
    out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
    assert bool((out == 0).all()) and bool(cupy.isneginf(lse).all())
    grads = cupyflash.block_sparse_attention_backward(cupy.ones_like(out), q, k, v, out, lse, mask)
    assert all(bool((g == 0).all()) for g in grads)


def test_scalar_and_tensor_core_paths_agree(rng):
    """16-bit inputs forced onto the scalar kernels walk the same blocks."""
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float16", 1, 400, 400, 2, 64))
    mask = BlockMask(rng.random((2, 4, 4)) < 0.5)
    p = validation.check_attention_args(q, k, v, causal=True, scale=None, return_lse=True)
    p = common.check_block_mask(mask, p)
    for families in (SCALAR, MMA_SYNC):
        out = cupy.full(q.shape, numpy.nan, q.dtype)
        lse = cupy.full((1, 2, 400), numpy.nan, numpy.float32)
        forward(p, q, k, v, out, lse, families)
        assert_matches_reference(q, k, v, out, lse, "float16", True, block_mask=mask)


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_adapter(rng, deterministic):
    """The adapter runs the block-sparse kernels: the same bits as the direct calls (dq only in
    deterministic mode, the atomic dq's order varies), and gradients within the tolerance rule."""
    torch = pytest.importorskip("torch")
    import cupyflash.torch

    q, k, v = (torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = BlockMask(rng.random((2, 3, 3)) < 0.6)
    out = cupyflash.torch.attention(q, k, v, causal=True, block_mask=mask, deterministic=deterministic)
    dout = torch.randn_like(out)
    out.backward(dout)
    inputs = [x.detach() for x in (dout, q, k, v)]
    want = cupyflash.block_sparse_attention(*inputs[1:], mask, causal=True, return_lse=True)
    assert torch.equal(out, want[0])
    grads = cupyflash.block_sparse_attention_backward(*inputs, *want, mask, causal=True, deterministic=deterministic)
    for name, x, g in list(zip("qkv", (q, k, v), grads))[0 if deterministic else 1 :]:
        assert torch.equal(x.grad, g), f"d{name}"
    as_numpy = [x.float().cpu().numpy() for x in (*inputs, q.grad, k.grad, v.grad)]  # bfloat16 values exactly
    assert_gradients_match_reference(*as_numpy[:4], as_numpy[4:], "bfloat16", True, block_mask=mask)


def test_jax_adapter(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cupyflash.jax

    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, "float32", 1, 300, 260, 2, 32))
    mask = BlockMask(rng.random((1, 3, 3)) < 0.6)
    loss = jax.jit(lambda q, k, v: cupyflash.jax.attention(q, k, v, block_mask=mask, deterministic=True).sum())
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    qn, kn, vn = (numpy.asarray(x) for x in (q, k, v))
    out, lse = cupyflash.block_sparse_attention(qn, kn, vn, mask, return_lse=True)
    want = cupyflash.block_sparse_attention_backward(numpy.ones_like(out), qn, kn, vn, out, lse, mask, deterministic=True)
    for g, w in zip(grads, want):
        numpy.testing.assert_array_equal(numpy.asarray(g), w)


def test_numpy_in_numpy_out(rng):
    q, k, v = random_qkv(rng, "float32", 1, 300, 300, 2, 16)
    mask = BlockMask.causal(300, 300)
    out, lse = cupyflash.block_sparse_attention(q, k, v, mask, causal=True, return_lse=True)
    assert isinstance(out, numpy.ndarray) and out.dtype == numpy.float32
    # BlockMask.causal with causal=True is causal attention: the dense reference's tolerance rule.
    assert_matches_reference(q, k, v, out, lse, "float32", True)
