"""Variable-length batches on the GPU (marker `gpu`): `attention_varlen` (packed sequences,
cu_seqlens) and `seqlens_k` (padded batches), forward and backward, each sequence checked against
the float64 reference of that sequence alone under the tolerance rule; on the tensor-core and
scalar paths, with causal, windows, GQA, softcap and ALiBi, through the torch adapter."""

import numpy
import pytest

import cupyflash
from rule import Judge
from shapes import DTYPES, HEAD_DIMS, numpy_dtype
from test_attention_gpu import assert_matches_reference
from test_backward_gpu import assert_gradients_match_reference, assert_workspace_poisoned

pytestmark = pytest.mark.gpu

# Sequence lengths (queries, keys): tile edges, an empty sequence on either side, seqlen_q != seqlen_k
# both ways, and one sequence longer than a tile's worth of the others.
AWKWARD_LENGTHS = ([1, 17, 0, 113, 203, 64, 5], [1, 40, 9, 203, 113, 0, 5])
LONG_LENGTHS = ([1023, 1, 300], [1024, 77, 300])


def cumulative(lengths):
    return numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)


def packed_problem(rng, dtype, lengths, heads, heads_kv, head_dim, strided=False):
    """Packed q, k, v, dout on the GPU and the int32 cu_seqlens of `lengths` (queries, keys).
    strided: q, k, v as views into wider arrays (their rows and heads not contiguous)."""
    import cupy

    dt = numpy_dtype(dtype)
    total_q, total_k = sum(lengths[0]), sum(lengths[1])

    def draw(total, h):
        x = rng.standard_normal((total, h + 1 if strided else h, head_dim)).astype(dt)
        return cupy.asarray(x)[:, 1:] if strided else cupy.asarray(x)

    q, k, v = draw(total_q, heads), draw(total_k, heads_kv), draw(total_k, heads_kv)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    return (q, k, v, dout), cumulative(lengths[0]), cumulative(lengths[1])


def check_sequences(arrays, out, lse, grads, cu_q, cu_k, dtype, slopes=None, **options):
    """Each sequence's out, lse and gradients against the reference of that sequence alone, the
    rule judging each result over the whole packed batch."""
    q, k, v, dout = arrays
    dq, dk, dv = grads
    judge = Judge()
    for b in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        mods = dict(options)
        if mods.get("dropout_p"):  # sequence b has batch entry b's dropout mask
            mods["dropout_batch_start"] = b
        if slopes is not None:
            mods["alibi_slopes"] = slopes if slopes.ndim == 1 else slopes[b]
        assert_matches_reference(q[None, rows], k[None, keys], v[None, keys], out[None, rows], lse[None, :, rows],
                                 dtype, judge=judge, **mods)
        assert_gradients_match_reference(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                                         (dq[None, rows], dk[None, keys], dv[None, keys]), dtype, judge=judge, **mods)
    judge.check()


def run_varlen(rng, dtype, lengths, heads, heads_kv, head_dim, *, causal=False, window=None, softcap=None,
               alibi=None, deterministic=False, strided=False, cu_on_gpu=False):
    import cupy

    arrays, cu_q, cu_k = packed_problem(rng, dtype, lengths, heads, heads_kv, head_dim, strided)
    q, k, v, dout = arrays
    slopes = None
    if alibi is not None:
        base = 2.0 ** (-8.0 * (numpy.arange(heads) + 1) / heads)
        slopes = base if alibi == "heads" else base * rng.uniform(0.5, 2.0, (len(cu_q) - 1, heads))
        # as the kernels see them (float32, except float64 for float64 inputs)
        slopes = slopes.astype(numpy.float64 if dtype == "float64" else numpy.float32).astype(numpy.float64)
    given_cu = (cupy.asarray(cu_q), cupy.asarray(cu_k)) if cu_on_gpu else (cu_q, cu_k)
    options = dict(causal=causal, window=window, softcap=softcap, scale=1.5 / head_dim**0.5)
    out, lse = cupyflash.attention_varlen(q, k, v, *given_cu, return_lse=True, alibi_slopes=slopes, **options)
    assert out.shape == q.shape and out.dtype == q.dtype and isinstance(out, cupy.ndarray)
    assert lse.shape == (heads, q.shape[0])
    grads = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, *given_cu, deterministic=deterministic,
                                                alibi_slopes=slopes, **options)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    check_sequences(arrays, out, lse, grads, cu_q, cu_k, dtype, slopes, **options)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_awkward_lengths(rng, nan_outputs, dtype, causal, deterministic):
    run_varlen(rng, dtype, AWKWARD_LENGTHS, 4, 2, 59, causal=causal, deterministic=deterministic)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dq_workspace_is_cleared_for_packed_sequences(rng, nan_outputs, poisoned_empty, dtype):
    """The packed dQ workspace (total_q rows) starts as NaN: every sequence's rows, the empty
    ones' neighbours included, must be cleared before the dK/dV kernel adds into them."""
    run_varlen(rng, dtype, AWKWARD_LENGTHS, 4, 2, 59, causal=True)
    assert_workspace_poisoned(poisoned_empty, sum(AWKWARD_LENGTHS[0]), 4, 59, dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_sequences(rng, nan_outputs, dtype, causal):
    """Sequences of several tiles beside one of a single token (many blocks exit at once)."""
    run_varlen(rng, dtype, LONG_LENGTHS, 2, 1, 128, causal=causal)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_head_dim_class(rng, nan_outputs, dtype, head_dim):
    run_varlen(rng, dtype, ([30, 1, 77], [50, 3, 64]), 2, 2, head_dim, causal=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_window_softcap_alibi(rng, nan_outputs, dtype):
    run_varlen(rng, dtype, AWKWARD_LENGTHS, 4, 4, 64, causal=True, window=(20, None), softcap=3.0, alibi="batch")
    run_varlen(rng, dtype, AWKWARD_LENGTHS, 4, 1, 40, window=(7, 3), alibi="heads", deterministic=True)


def test_strided_views_and_device_cu_seqlens(rng, nan_outputs):
    run_varlen(rng, "float16", AWKWARD_LENGTHS, 3, 3, 48, causal=True, strided=True, cu_on_gpu=True)


def test_scalar_path(rng, nan_outputs, scalar_kernels):
    """16-bit varlen on the scalar kernels (what GPUs older than sm_80 run)."""
    run_varlen(rng, "bfloat16", AWKWARD_LENGTHS, 2, 1, 64, causal=True, deterministic=True)
    run_varlen(rng, "float16", LONG_LENGTHS, 2, 2, 128, window=(50, 50), softcap=4.0)


def test_one_sequence_matches_attention_bit_for_bit(rng):
    """One packed sequence is a batch of one: the same kernels' tiles, the same bits as `attention`
    (the fixed-length kernel), forward; the backward is checked against the reference above."""
    import cupy

    arrays, cu_q, cu_k = packed_problem(rng, "bfloat16", ([300], [300]), 4, 4, 64)
    q, k, v, _ = arrays
    out = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, softcap=5.0)
    fixed = cupyflash.attention(q[None], k[None], v[None], causal=True, softcap=5.0)[0]
    cupy.testing.assert_array_equal(out.view(cupy.uint16), fixed.view(cupy.uint16))


# --------------------------------------------------------------------------- seqlens_k (padded batches)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_seqlens_k(rng, nan_outputs, dtype, causal):
    """Key padding: entry b sees its first seqlens_k[b] keys; dk, dv of padding are 0."""
    import cupy

    dt = numpy_dtype(dtype)
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = 4, 113, 203, 4, 2, 40
    q = cupy.asarray(rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dt)) for _ in range(2))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    seqlens = numpy.array([203, 0, 1, 150], dtype=numpy.int32)
    for given in (seqlens, cupy.asarray(seqlens)):
        out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True, seqlens_k=given)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, seqlens_k=given)
        for b, keys in enumerate(seqlens):
            assert_matches_reference(q[b : b + 1], k[b : b + 1, :keys], v[b : b + 1, :keys], out[b : b + 1],
                                     lse[b : b + 1], dtype, causal)
            assert_gradients_match_reference(dout[b : b + 1], q[b : b + 1], k[b : b + 1, :keys], v[b : b + 1, :keys],
                                             tuple(g[b : b + 1, :n] for g, n in zip(grads, (seqlen_q, keys, keys))),
                                             dtype, causal)
            for g in grads[1:]:
                assert not cupy.any(g[b, keys:]), "padding keys must get dk = dv = 0"


@pytest.mark.parametrize("causal", [False, True])
def test_torch_seqlens_k(rng, causal):
    """cupyflash.torch.attention with seqlens_k as an int32 CUDA tensor (the prepared calls, the
    pointer written per call) and as int64 (converted): bit for bit cupyflash.attention's results
    and deterministic gradients, the same prepared call serving new lengths of the same shape."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import cupyflash.torch as cft

    q = torch.randn(4, 113, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(4, 203, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    for lengths in ([203, 0, 1, 150], [17, 203, 99, 0]):
        for dtype in (torch.int32, torch.int64):
            seqlens = torch.tensor(lengths, dtype=dtype, device="cuda")
            xs = [x.clone().requires_grad_() for x in (q, k, v)]
            out = cft.attention(*xs, causal=causal, seqlens_k=seqlens, deterministic=True)
            out.backward(dout)
            host = numpy.array(lengths, numpy.int32)
            want, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True, seqlens_k=host)
            grads = cupyflash.attention_backward(dout, q, k, v, want, lse, causal=causal, seqlens_k=host,
                                                 deterministic=True)
            assert torch.equal(out.detach(), torch.from_dlpack(want))
            for x, g in zip(xs, grads):
                assert torch.equal(x.grad, torch.from_dlpack(g))
            for x in xs[1:]:
                for b, n in enumerate(lengths):
                    assert not x.grad[b, n:].any()


def test_torch_adapter(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import cupyflash.torch as cft

    lengths = ([5, 0, 33], [7, 2, 33])
    cu_q, cu_k = (torch.tensor(cumulative(x), device="cuda") for x in lengths)
    q = torch.randn(38, 4, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(42, 2, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = cft.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    out.float().square().sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == k.shape
    dout = 2 * out.detach()
    lse = cupyflash.attention_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k, causal=True, return_lse=True)[1]
    check_sequences((q, k, v, dout), out, lse, (q.grad, k.grad, v.grad), cu_q.cpu().numpy(), cu_k.cpu().numpy(),
                    "bfloat16", causal=True)


def test_jax_adapter(rng, jax_gpu):
    """cupyflash.jax.attention_varlen under jit with the lengths closed over (static), with softcap
    and dropout; traced lengths are refused with a TypeError that says so."""
    jax = jax_gpu
    import jax.numpy as jnp

    import cupyflash.jax

    (q, k, v, dout), cu_q, cu_k = packed_problem(rng, "float32", ([5, 0, 33], [7, 2, 33]), 4, 2, 32)
    qj, kj, vj, doutj = (jnp.asarray(x.get()) for x in (q, k, v, dout))
    options = {"causal": True, "softcap": 3.0, "dropout_p": 0.2, "seed": 5, "offset": 1}
    f = jax.jit(lambda q, k, v: cupyflash.jax.attention_varlen(q, k, v, cu_q, cu_k, **options))
    out, pullback = jax.vjp(f, qj, kj, vj)
    grads = [numpy.asarray(g) for g in pullback(doutj)]
    lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)[1]
    check_sequences((q, k, v, dout), numpy.asarray(out), lse, grads, cu_q, cu_k, "float32", **options)
    with pytest.raises(TypeError, match="cu_seqlens_q must be concrete"):
        jax.jit(lambda cu: cupyflash.jax.attention_varlen(qj, kj, vj, cu, cu_k))(jnp.asarray(cu_q))
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        cupyflash.jax.attention_varlen(qj, kj, vj, cu_q, cu_k.astype(numpy.float32))
