"""Softcap and ALiBi on the GPU (marker `gpu`): forward and backward against the float64 reference
under the tolerance rule, on the fast (tensor-core) and scalar paths, with causal, windows, GQA and
block-sparse attention, through the NumPy, torch and JAX front ends."""

import numpy
import pytest

import cupyflash
from cupyflash import BlockMask
from shapes import DTYPES, bits, numpy_dtype
from test_attention_gpu import assert_matches_reference
from test_backward_gpu import assert_gradients_match_reference

pytestmark = pytest.mark.gpu

# (softcap, ALiBi slopes shape: None, "heads" or "batch") — a cap that the scores reach (|s| up to
# ~4 with these inputs and scale 1.5 / sqrt(d)), and ALiBi's geometric slopes, per head or per batch entry.
MODS = [(2.0, None), (None, "heads"), (5.0, "batch")]


def slopes_for(kind, batch, heads, rng):
    if kind is None:
        return None
    base = 2.0 ** (-8.0 * (numpy.arange(heads) + 1) / heads)
    return base if kind == "heads" else base * rng.uniform(0.5, 2.0, (batch, heads))


def run(rng, dtype, shape, heads_kv, softcap, alibi, *, causal=False, window=None, block_mask=None,
        deterministic=False, host_slopes=False):
    """Forward and backward of one problem, each checked against the reference."""
    import cupy

    batch, seqlen_q, seqlen_k, heads, head_dim = shape
    dt = numpy_dtype(dtype)
    q = cupy.asarray(rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dt)) for _ in range(2))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    slopes = slopes_for(alibi, batch, heads, rng)
    given = slopes if host_slopes or slopes is None else cupy.asarray(slopes, dtype=cupy.float32)
    scale = 1.5 / head_dim**0.5
    options = {"causal": causal, "window": window, "scale": scale, "softcap": softcap}
    if block_mask is None:
        out, lse = cupyflash.attention(q, k, v, return_lse=True, alibi_slopes=given, **options)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, alibi_slopes=given,
                                             **options)
    else:
        out, lse = cupyflash.block_sparse_attention(q, k, v, block_mask, return_lse=True, alibi_slopes=given, **options)
        grads = cupyflash.block_sparse_attention_backward(
            dout, q, k, v, out, lse, block_mask, deterministic=deterministic, alibi_slopes=given, **options
        )
    # The reference takes the slopes the kernels saw: in their accumulator type (float64 only for
    # float64 inputs), from float32 device slopes or float64 host ones.
    seen = None
    if slopes is not None:
        exact = host_slopes and dtype == "float64"
        seen = numpy.asarray(slopes, numpy.float64 if exact else numpy.float32).astype(numpy.float64)
    ref_options = {**options, "alibi_slopes": seen, "block_mask": block_mask}
    assert_matches_reference(q, k, v, out, lse, dtype, **ref_options)
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, **ref_options)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap,alibi", MODS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_awkward_shapes(rng, nan_outputs, dtype, softcap, alibi, causal, deterministic):
    # seqlens that end inside tiles, seqlen_q != seqlen_k both ways, GQA in the second.
    run(rng, dtype, (2, 203, 331, 2, 59), 2, softcap, alibi, causal=causal, deterministic=deterministic)
    run(rng, dtype, (1, 331, 113, 4, 40), 2, softcap, alibi, causal=causal, deterministic=deterministic)


@pytest.mark.parametrize("head_dim", [1, 16, 40, 64, 96, 128, 160, 200, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_head_dim_class(rng, nan_outputs, dtype, head_dim):
    run(rng, dtype, (1, 300, 277, 2, head_dim), 2, 3.0, "heads", causal=True)
    run(rng, dtype, (1, 130, 200, 2, head_dim), 1, 2.0, None, deterministic=True)


@pytest.mark.parametrize("softcap,alibi", MODS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_with_window_and_block_mask(rng, nan_outputs, dtype, softcap, alibi):
    mask = BlockMask(rng.random((4, 5, 4)) < 0.6)  # per query head: 517 x 400 in 128 x 128 blocks
    run(rng, dtype, (2, 517, 400, 4, 64), 2, softcap, alibi, causal=True, window=(200, None), block_mask=mask)
    run(rng, dtype, (1, 517, 400, 4, 64), 1, softcap, alibi, window=(100, 150), block_mask=mask, deterministic=True)
    run(rng, dtype, (1, 300, 300, 4, 96), 4, softcap, alibi, window=(30, 40))


def test_scalar_path(rng, nan_outputs, scalar_kernels):
    """16-bit problems on the scalar kernels (what GPUs older than sm_80 run)."""
    run(rng, "float16", (1, 211, 300, 4, 64), 2, 2.0, "heads", causal=True)
    run(rng, "bfloat16", (2, 130, 97, 3, 128), 1, 4.0, "batch", window=(10, 20), deterministic=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_host_slopes_and_float64_slopes(rng, nan_outputs, dtype):
    """Slopes as NumPy float64 (or a list) with GPU inputs: copied to the device in the kernels'
    accumulator type (float64 slopes stay float64 for float64 inputs)."""
    run(rng, dtype, (2, 150, 180, 4, 32), 2, None, "batch", causal=True, host_slopes=True)
    import cupy

    q = cupy.asarray(rng.standard_normal((1, 40, 2, 16)).astype(numpy_dtype(dtype)))
    listed = cupyflash.attention(q, q, q, alibi_slopes=[0.5, 0.25])
    arrayed = cupyflash.attention(q, q, q, alibi_slopes=cupy.asarray([0.5, 0.25]))
    assert bool((bits(listed) == bits(arrayed)).all())


def test_softcap_leaves_large_scores_finite(rng, nan_outputs):
    """Scores of size 1e4 under a cap of 20: the softmax sees at most |s| = 20, the output is the
    reference's, and no exp overflows in the backward either."""
    import cupy

    q = cupy.asarray((100 * rng.standard_normal((1, 200, 2, 64))).astype(numpy.float16))
    k, v = (cupy.asarray(rng.standard_normal((1, 200, 2, 64)).astype(numpy.float16)) for _ in range(2))
    out, lse = cupyflash.attention(q, k, v, softcap=20.0, scale=1.0, return_lse=True)
    assert bool(cupy.isfinite(out).all()) and float(lse.max()) <= 20.0 + numpy.log(200) + 1e-3
    assert_matches_reference(q, k, v, out, lse, "float16", False, scale=1.0, softcap=20.0)


def test_slopes_on_another_side_are_rejected(rng):
    import cupy

    q = rng.standard_normal((1, 4, 2, 8)).astype(numpy.float32)
    with pytest.raises(ValueError, match="alibi_slopes is on GPU 0 while q is on the host"):
        cupyflash.attention(q, q, q, alibi_slopes=cupy.ones(2, cupy.float32))


def test_torch_adapter(rng):
    torch = pytest.importorskip("torch")
    import cupyflash.torch

    q = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 220, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 220, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")
    out = cupyflash.torch.attention(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes)
    out.float().square().sum().backward()
    dout = (2 * out.float()).to(torch.bfloat16)
    as_np = [numpy.asarray(x.detach().float().cpu().numpy(), numpy.float64) for x in (dout, q, k, v)]
    grads = [x.grad.float().cpu().numpy() for x in (q, k, v)]
    options = {"softcap": 3.0, "alibi_slopes": slopes.cpu().numpy().astype(numpy.float64)}
    assert_gradients_match_reference(*as_np, grads, "bfloat16", True, **options)


def test_jax_adapter(rng, jax_gpu):
    jax = jax_gpu
    import jax.numpy as jnp

    import cupyflash.jax

    q = jnp.asarray(rng.standard_normal((1, 150, 4, 32)).astype(numpy.float32))
    k, v = (jnp.asarray(rng.standard_normal((1, 180, 2, 32)).astype(numpy.float32)) for _ in range(2))
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
    f = jax.jit(lambda q, k, v, s: cupyflash.jax.attention(q, k, v, softcap=2.0, alibi_slopes=s, causal=True).sum())
    grads = jax.grad(f, argnums=(0, 1, 2, 3))(q, k, v, slopes)
    assert not numpy.asarray(grads[3]).any()  # the slopes are constants
    as_np = [numpy.asarray(x, dtype=numpy.float64) for x in (q, k, v)]
    options = {"softcap": 2.0, "alibi_slopes": numpy.asarray(slopes, numpy.float64)}
    assert_gradients_match_reference(numpy.ones(q.shape), *as_np, [numpy.asarray(g) for g in grads[:3]], "float32",
                                     True, **options)
