"""Dropout on the GPU (marker `gpu`): the kernels' keep mask bit for bit against the NumPy mirror;
forward and backward exactly against the float64 reference under that mask (tolerance rule) on
the tensor-core and scalar paths, with causal, windows, GQA, softcap/ALiBi, block-sparse and
variable-length batches; keep rate, unbiasedness and reproducibility; the torch and JAX front ends."""

import math

import numpy
import pytest

import cupyflash
from cupyflash import BlockMask, reference
from cupyflash.cpu import reference as cpu_reference
from cupyflash.cpu import philox
from rule import Judge
from shapes import DTYPES, bits, numpy_dtype
from test_attention_gpu import assert_matches_reference
from test_backward_gpu import assert_gradients_match_reference

pytestmark = pytest.mark.gpu


def random_seed(rng):
    return int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2))  # the full 64 bits


def run(rng, dtype, shape, heads_kv, dropout_p, *, causal=False, window=None, block_mask=None, deterministic=False,
        softcap=None, alibi=False, strided=False):
    """Forward and backward of one problem with dropout, each checked against the reference under the
    same keep mask; returns (out, grads)."""
    import cupy

    batch, seqlen_q, seqlen_k, heads, head_dim = shape
    dt = numpy_dtype(dtype)
    q = cupy.asarray(rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dt)) for _ in range(2))
    if strided:  # (batch, heads, seq, d) storage seen as (batch, seq, heads, d)
        q, k, v = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    slopes = 2.0 ** (-8.0 * (numpy.arange(heads) + 1) / heads) if alibi else None
    options = {"causal": causal, "window": window, "scale": 1.5 / head_dim**0.5, "softcap": softcap,
               "dropout_p": dropout_p, "seed": random_seed(rng), "offset": int(rng.integers(0, 2**32))}
    if block_mask is None:
        out, lse = cupyflash.attention(q, k, v, return_lse=True, alibi_slopes=slopes, **options)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, alibi_slopes=slopes,
                                             **options)
    else:
        out, lse = cupyflash.block_sparse_attention(q, k, v, block_mask, return_lse=True, alibi_slopes=slopes, **options)
        grads = cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, block_mask,
                                                          deterministic=deterministic, alibi_slopes=slopes, **options)
    seen = None if slopes is None else slopes.astype(numpy.float64 if dtype == "float64" else numpy.float32)
    ref_options = {**options, "alibi_slopes": seen, "block_mask": block_mask}
    assert_matches_reference(q, k, v, out, lse, dtype, **ref_options)
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, **ref_options)
    return out, grads


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 17, 113), (3, 203, 113), (1, 1023, 1024), (2, 64, 48)])
def test_kernel_mask_is_the_numpy_mirror_bit_for_bit(rng, shape):
    batch, seqlen_q, seqlen_k = shape
    for dropout_p in (0.1, 0.5, 0.93):
        seed, offset = random_seed(rng), int(rng.integers(0, 2**32))
        gpu = cupyflash.dropout_mask(batch, 3, seqlen_q, seqlen_k, dropout_p=dropout_p, seed=seed, offset=offset)
        cpu = cupyflash.dropout_mask(batch, 3, seqlen_q, seqlen_k, dropout_p=dropout_p, seed=seed, offset=offset,
                                     device=False)
        assert type(gpu).__module__.startswith("cupy") and gpu.dtype == bool and gpu.shape == cpu.shape
        numpy.testing.assert_array_equal(gpu.get(), cpu)


def test_keep_rate_and_independence():
    """A million-element mask keeps 1 - p of its elements within 5 binomial standard deviations,
    for each p, and masks of other seeds or offsets agree only as independent ones would."""
    shape = (2, 4, 300, 400)
    n = math.prod(shape)
    for dropout_p in (0.05, 0.3, 0.5, 0.9):
        keep = cupyflash.dropout_mask(*shape, dropout_p=dropout_p, seed=1234, offset=5).get()
        q = 1 - dropout_p
        assert abs(keep.mean() - q) <= 5 * math.sqrt(q * (1 - q) / n), (dropout_p, keep.mean())
        for other in ({"seed": 1235, "offset": 5}, {"seed": 1234, "offset": 6}):
            again = cupyflash.dropout_mask(*shape, dropout_p=dropout_p, **other).get()
            both = (keep & again).mean()
            assert abs(both - q * q) <= 5 * math.sqrt(q * q * (1 - q * q) / n), (dropout_p, other, both)
        # every head and batch entry its own stream
        per_slab = keep.reshape(8, -1)
        assert len({row.tobytes() for row in per_slab}) == 8


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_awkward_shapes(rng, nan_outputs, dtype, causal, deterministic):
    run(rng, dtype, (2, 203, 331, 2, 59), 2, 0.17, causal=causal, deterministic=deterministic)
    run(rng, dtype, (1, 331, 113, 4, 40), 2, 0.6, causal=causal, deterministic=deterministic)
    run(rng, dtype, (3, 1, 17, 2, 111), 1, 0.3, causal=causal, deterministic=deterministic, strided=True)


@pytest.mark.parametrize("head_dim", [1, 16, 40, 64, 96, 128, 160, 200, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_head_dim_class(rng, nan_outputs, dtype, head_dim):
    run(rng, dtype, (1, 300, 277, 2, head_dim), 2, 0.25, causal=True)
    run(rng, dtype, (1, 130, 200, 2, head_dim), 1, 0.1, deterministic=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_with_modifiers_window_and_block_mask(rng, nan_outputs, dtype):
    mask = BlockMask(rng.random((4, 5, 4)) < 0.6)  # per query head: 517 x 400 in 128 x 128 blocks
    run(rng, dtype, (2, 517, 400, 4, 64), 2, 0.2, causal=True, window=(200, None), block_mask=mask, softcap=3.0,
        alibi=True)
    run(rng, dtype, (1, 517, 400, 4, 64), 1, 0.4, window=(100, 150), block_mask=mask, deterministic=True)
    run(rng, dtype, (1, 300, 300, 4, 96), 4, 0.3, window=(30, 40), softcap=2.0)


def test_scalar_path(rng, nan_outputs, scalar_kernels):
    """16-bit problems on the scalar kernels (what GPUs older than sm_80 run)."""
    run(rng, "float16", (1, 211, 300, 4, 64), 2, 0.3, causal=True)
    run(rng, "bfloat16", (2, 130, 97, 3, 128), 1, 0.5, window=(10, 20), deterministic=True, alibi=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_varlen_and_seqlens_k(rng, nan_outputs, dtype):
    """Sequence b of a packed batch has the mask of batch entry b, cut to its lengths."""
    import cupy

    dt = numpy_dtype(dtype)
    lens_q, lens_k = [1, 17, 0, 113, 203, 64], [40, 9, 5, 203, 113, 64]
    cu_q, cu_k = (numpy.concatenate([[0], numpy.cumsum(x)]).astype(numpy.int32) for x in (lens_q, lens_k))
    q = cupy.asarray(rng.standard_normal((cu_q[-1], 4, 64)).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((cu_k[-1], 2, 64)).astype(dt)) for _ in range(2))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    options = {"causal": True, "dropout_p": 0.3, "seed": random_seed(rng), "offset": 11}
    out, lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    grads = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options)
    for b in range(len(lens_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop:
            continue
        per = {**options, "dropout_batch_start": b}
        assert_matches_reference(q[None, rows], k[None, keys], v[None, keys], out[None, rows], lse[None, :, rows],
                                 dtype, **per)
        if keys.start < keys.stop:
            assert_gradients_match_reference(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                                             (grads[0][None, rows], grads[1][None, keys], grads[2][None, keys]),
                                             dtype, **per)
    # Padded batch: entry b's first seqlens_k[b] keys, with batch entry b's mask.
    q, k, v = (cupy.asarray(rng.standard_normal((3, 90, 2, 32)).astype(dt)) for _ in range(3))
    used = numpy.array([90, 13, 0], numpy.int32)
    out = cupyflash.attention(q, k, v, seqlens_k=used, **options)
    for b, keys in enumerate(used):
        if keys:
            ref = reference.attention(q[b : b + 1], k[b : b + 1, :keys], v[b : b + 1, :keys], dropout_batch_start=b,
                                      **options)
            scale = float(numpy.abs(ref).max())
            assert numpy.abs(cpu_reference.as_float64(out[b : b + 1]) - ref).max() <= 0.02 * scale


def test_reproducible_and_seed_dependent(rng):
    import cupy

    q, k, v = (cupy.asarray(rng.standard_normal((2, 150, 4, 64)).astype(numpy.float16)) for _ in range(3))
    options = {"dropout_p": 0.2, "seed": 99, "offset": 3, "causal": True}
    first, again = (cupyflash.attention(q, k, v, **options) for _ in range(2))
    assert bool((bits(first) == bits(again)).all())
    for other in ({"seed": 100}, {"offset": 4}):
        assert not bool((bits(cupyflash.attention(q, k, v, **{**options, **other})) == bits(first)).all())
    plain = cupyflash.attention(q, k, v, causal=True)
    zero = cupyflash.attention(q, k, v, causal=True, dropout_p=0.0, seed=5)
    assert bool((bits(plain) == bits(zero)).all())  # p = 0 is no dropout, whatever the kernel


def test_output_is_unbiased(rng):
    """E[out] over masks is attention without dropout: the mean of 400 seeds' outputs lies within 6
    standard errors (estimated from the same samples) of the no-dropout output, element by element."""
    import cupy

    q, k, v = (cupy.asarray(rng.standard_normal((1, 33, 2, 16)).astype(numpy.float32)) for _ in range(3))
    runs = cupy.stack([cupyflash.attention(q, k, v, dropout_p=0.4, seed=s) for s in range(400)])
    mean, std = runs.mean(axis=0), runs.std(axis=0)
    exact = cupyflash.attention(q, k, v)
    excess = cupy.abs(mean - exact) - 6 * std / math.sqrt(runs.shape[0]) - 1e-6
    assert float(excess.max()) <= 0.0
    assert float(std.min()) > 0.0  # the masks differ


def test_bad_arguments_raise_before_any_work(rng):
    import cupy

    q = cupy.asarray(rng.standard_normal((1, 8, 2, 16)).astype(numpy.float16))
    before = q.copy()
    with pytest.raises(ValueError, match="seed is required"):
        cupyflash.attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        cupyflash.attention(q, q, q, dropout_p=1.0, seed=1)
    with pytest.raises(TypeError, match="seed must be an int"):
        cupyflash.attention(q, q, q, dropout_p=0.1, seed=1.5)
    assert bool((bits(q) == bits(before)).all())


def test_torch_adapter(rng):
    torch = pytest.importorskip("torch")
    import cupyflash.torch

    q = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 220, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 220, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = cupyflash.torch.attention(q, k, v, causal=True, dropout_p=0.2, seed=77, offset=1)
    out.float().square().sum().backward()
    dout = (2 * out.float()).to(torch.bfloat16)
    as_np = [numpy.asarray(x.detach().float().cpu().numpy(), numpy.float64) for x in (dout, q, k, v)]
    grads = [x.grad.float().cpu().numpy() for x in (q, k, v)]
    assert_gradients_match_reference(*as_np, grads, "bfloat16", True, dropout_p=0.2, seed=77, offset=1)
    # No seed: one from torch's generator, so torch.manual_seed reproduces the output.
    torch.manual_seed(3)
    first = cupyflash.torch.attention(q, k, v, dropout_p=0.2)
    torch.manual_seed(3)
    assert torch.equal(first, cupyflash.torch.attention(q, k, v, dropout_p=0.2))


def test_jax_adapter(rng, jax_gpu):
    jax = jax_gpu
    import jax.numpy as jnp

    import cupyflash.jax

    q = jnp.asarray(rng.standard_normal((1, 150, 4, 32)).astype(numpy.float32))
    k, v = (jnp.asarray(rng.standard_normal((1, 180, 2, 32)).astype(numpy.float32)) for _ in range(2))
    options = {"dropout_p": 0.25, "seed": 2**40 + 3, "offset": 9, "causal": True}
    f = jax.jit(lambda q, k, v: cupyflash.jax.attention(q, k, v, **options).sum())
    grads = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    as_np = [numpy.asarray(x, dtype=numpy.float64) for x in (q, k, v)]
    assert_gradients_match_reference(numpy.ones(q.shape), *as_np, [numpy.asarray(g) for g in grads], "float32",
                                     **options)
    assert abs(philox.rescale(0.25) - 4 / 3) < 1e-12


def test_jax_cpu_backend(rng, jax_gpu):
    """Arrays on JAX's CPU device take the NumPy fallback inside the callback (fixed-length and
    varlen, forward and gradient), with dropout, softcap and causal."""
    jax = jax_gpu
    import cupyflash.jax

    cpu = jax.devices("cpu")[0]
    q = rng.standard_normal((1, 20, 4, 16)).astype(numpy.float32)
    k = rng.standard_normal((1, 23, 2, 16)).astype(numpy.float32)
    qj, kj = (jax.device_put(x, cpu) for x in (q, k))
    options = {"causal": True, "softcap": 3.0, "dropout_p": 0.2, "seed": 7}
    out = cupyflash.jax.attention(qj, kj, kj, **options)
    assert next(iter(out.devices())).platform == "cpu"
    assert_matches_reference(q, k, k, numpy.asarray(out), None, "float32", **options)
    grads = jax.grad(lambda q, k, v: cupyflash.jax.attention(q, k, v, **options).sum(), argnums=(0, 1, 2))(qj, kj, kj)
    assert_gradients_match_reference(numpy.ones(q.shape, numpy.float32), q, k, k, [numpy.asarray(g) for g in grads],
                                     "float32", **options)
    cu_q, cu_k = numpy.array([0, 7, 20], numpy.int32), numpy.array([0, 9, 23], numpy.int32)
    out = numpy.asarray(cupyflash.jax.attention_varlen(qj[0], kj[0], kj[0], cu_q, cu_k, **options))
    judge = Judge()
    for b in range(2):  # sequence b has batch entry b's dropout mask
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        assert_matches_reference(q[:, rows], k[:, keys], k[:, keys], out[None, rows], None, "float32", judge=judge,
                                 dropout_batch_start=b, **options)
    judge.check()
