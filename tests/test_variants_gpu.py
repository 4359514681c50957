"""GQA/MQA and sliding-window attention on the GPU (marker `gpu`): forward and backward against
the float64 reference under the tolerance rule, on the fast (tensor-core) and scalar paths,
combined with causal and with block-sparse attention; tiles outside the band are never read."""

import numpy
import pytest

import cupyflash
from cupyflash import BlockMask
from cupyflash.cpu import reference as cpu_reference
from shapes import DTYPES, bits, numpy_dtype
from test_attention_gpu import assert_matches_reference
from test_backward_gpu import assert_gradients_match_reference

pytestmark = pytest.mark.gpu


def run(rng, dtype, shape, heads_kv, *, causal=False, window=None, block_mask=None, deterministic=False):
    """Forward and backward of one problem, each checked against the reference; returns the inputs."""
    import cupy

    batch, seqlen_q, seqlen_k, heads, head_dim = shape
    dt = numpy_dtype(dtype)
    q = cupy.asarray(rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dt)) for _ in range(2))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    options = {"causal": causal, "window": window}
    if block_mask is None:
        out, lse = cupyflash.attention(q, k, v, return_lse=True, **options)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
    else:
        out, lse = cupyflash.block_sparse_attention(q, k, v, block_mask, return_lse=True, **options)
        grads = cupyflash.block_sparse_attention_backward(
            dout, q, k, v, out, lse, block_mask, deterministic=deterministic, **options
        )
    assert_matches_reference(q, k, v, out, lse, dtype, block_mask=block_mask, **options)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, block_mask=block_mask, **options)
    return q, k, v, dout, out, lse, grads


WINDOWS = [(0, 0), (17, 0), (64, 33), (None, 5), (100, None)]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_windows(rng, nan_outputs, dtype, window, causal, deterministic):
    # seqlens that end inside tiles, seqlen_q != seqlen_k both ways (two problems).
    run(rng, dtype, (2, 203, 331, 2, 59), 2, causal=causal, window=window, deterministic=deterministic)
    run(rng, dtype, (1, 331, 113, 2, 40), 2, causal=causal, window=window, deterministic=deterministic)


@pytest.mark.parametrize("head_dim", [16, 40, 64, 96, 128, 160, 200, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_windows_every_head_dim_class(rng, nan_outputs, dtype, head_dim):
    run(rng, dtype, (1, 700, 700, 2, head_dim), 2, causal=True, window=(150, None))
    run(rng, dtype, (1, 300, 500, 2, head_dim), 2, window=(70, 90))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,heads_kv", [(4, 2), (6, 1), (8, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_and_mqa(rng, nan_outputs, dtype, heads, heads_kv, causal, deterministic):
    run(rng, dtype, (2, 190, 257, heads, 72), heads_kv, causal=causal, deterministic=deterministic)


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gqa_every_head_dim_class(rng, nan_outputs, dtype, head_dim):
    run(rng, dtype, (1, 300, 300, 4, head_dim), 1, causal=True)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_window_and_block_mask_together(rng, nan_outputs, dtype, deterministic):
    mask = BlockMask(rng.random((4, 5, 4)) < 0.6)  # per query head: 517 x 400 in 128 x 128 blocks
    run(rng, dtype, (2, 517, 400, 4, 64), 2, causal=True, window=(200, None), block_mask=mask, deterministic=deterministic)
    run(rng, dtype, (1, 517, 400, 4, 64), 1, window=(100, 150), block_mask=mask, deterministic=deterministic)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_keys_outside_every_band_are_never_read(rng, dtype):
    """Keys that no query's window reaches hold NaN in k and v: a kernel that loaded their tiles
    would spread it (0 x NaN = NaN in P V and in dV). Queries see keys 3700.. of 4000 at most."""
    import cupy

    dt = numpy_dtype(dtype)
    seqlen_q, seqlen_k, window = 128, 4000, (150, 0)
    q = cupy.asarray(rng.standard_normal((1, seqlen_q, 4, 64)).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((1, seqlen_k, 2, 64)).astype(dt)) for _ in range(2))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    first_seen = seqlen_k - seqlen_q - window[0]
    for deterministic in (False, True):
        clean = cupyflash.attention(q, k, v, window=window, return_lse=True)
        clean_grads = cupyflash.attention_backward(dout, q, k, v, *clean, window=window, deterministic=deterministic)
        k_nan, v_nan = k.copy(), v.copy()
        k_nan[:, : first_seen - 256] = numpy.nan
        v_nan[:, : first_seen - 256] = numpy.nan
        out, lse = cupyflash.attention(q, k_nan, v_nan, window=window, return_lse=True)
        grads = cupyflash.attention_backward(dout, q, k_nan, v_nan, out, lse, window=window, deterministic=deterministic)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (*clean, *clean_grads)):
            if name != "dq" or deterministic:
                assert bool((bits(a) == bits(b)).all()), name
        if not deterministic:  # dq's atomics add in a varying order: judged against the clean problem
            assert_gradients_match_reference(dout, q, k, v, grads, dtype, False, window=window)
        assert bool((grads[1][:, : first_seen - 256] == 0).all())


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gqa_equals_attention_on_repeated_heads(rng, dtype):
    """The forward on K/V heads shared by groups is bit for bit the forward on explicitly repeated
    K/V (the same tiles, the same order); dk, dv are the group sums of the repeated problem's."""
    import cupy

    dt = numpy_dtype(dtype)
    q = cupy.asarray(rng.standard_normal((2, 150, 6, 32)).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((2, 170, 2, 32)).astype(dt)) for _ in range(2))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    k_rep, v_rep = (cupy.repeat(x, 3, axis=2) for x in (k, v))
    for a, b in zip(cupyflash.attention(q, k, v, causal=True, return_lse=True),
                    cupyflash.attention(q, k_rep, v_rep, causal=True, return_lse=True)):
        assert bool((bits(a) == bits(b)).all())
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    dq_rep, dk_rep, dv_rep = cupyflash.attention_backward(
        dout, q, k_rep, v_rep, out, lse, causal=True, deterministic=True
    )
    assert bool((bits(dq) == bits(dq_rep)).all())
    # Summed in float32 on chip against three roundings to the dtype and a float64 sum: equal to
    # a few units in the last place of the terms (the reference comparisons are in test_gqa_and_mqa).
    relative = {"float16": 2.0**-8, "float32": 2.0**-18}[dtype]
    for g, g_rep in zip((dk, dv), (dk_rep, dv_rep)):
        summed = g_rep.astype(numpy.float64).reshape(2, 170, 2, 3, 32).sum(axis=3)
        assert float(abs(g.astype(numpy.float64) - summed).max()) <= relative * float(abs(g_rep).max())


def test_scalar_path_takes_gqa_and_windows(rng, nan_outputs, scalar_kernels):
    """16-bit problems on the scalar kernels (what GPUs older than sm_80 run)."""
    run(rng, "float16", (1, 211, 300, 4, 64), 2, causal=True, window=(40, None))
    run(rng, "bfloat16", (2, 130, 97, 3, 128), 1, window=(10, 20), deterministic=True)


def test_torch_adapter(rng):
    torch = pytest.importorskip("torch")
    import cupyflash.torch

    q = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 220, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 220, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = cupyflash.torch.attention(q, k, v, causal=True, window=(50, None))
    out.float().square().sum().backward()
    assert k.grad.shape == k.shape and v.grad.shape == v.shape
    dout = (2 * out.float()).to(torch.bfloat16)
    as_np = [cpu_reference.as_float64(x.detach().float().cpu().numpy()) for x in (dout, q, k, v)]
    grads = [x.grad.float().cpu().numpy() for x in (q, k, v)]
    assert_gradients_match_reference(*as_np, grads, "bfloat16", True, window=(50, None))


def test_jax_adapter(rng, jax_gpu):
    jax = jax_gpu
    import jax.numpy as jnp

    import cupyflash.jax

    q = jnp.asarray(rng.standard_normal((1, 150, 4, 32)).astype(numpy.float32))
    k, v = (jnp.asarray(rng.standard_normal((1, 180, 1, 32)).astype(numpy.float32)) for _ in range(2))
    f = jax.jit(lambda q, k, v: cupyflash.jax.attention(q, k, v, window=(30, 30)).sum())
    grads = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    as_np = [numpy.asarray(x, dtype=numpy.float64) for x in (q, k, v)]
    dout = numpy.ones(q.shape)
    assert_gradients_match_reference(dout, *as_np, [numpy.asarray(g) for g in grads], "float32", False, window=(30, 30))
