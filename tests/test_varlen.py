"""Variable-length batches on the CPU: the varlen reference against a brute force over the whole
packed batch with a block-diagonal mask (scipy's softmax), the no-GPU fallback of
`attention_varlen` / `seqlens_k` forward and backward, bad cu_seqlens and seqlens_k rejected before
any work with the inputs untouched, and the kernels' varlen instantiations."""

import numpy
import pytest
import scipy.special

import cupyflash
from cupyflash import catalog, reference
from cupyflash.catalog import tiles

LENGTHS = ([3, 0, 17, 1, 9], [5, 4, 17, 0, 12])


def cumulative(lengths):
    return numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)


def packed(rng, lengths, heads=4, heads_kv=2, head_dim=8, dtype=numpy.float64):
    q = rng.standard_normal((sum(lengths[0]), heads, head_dim)).astype(dtype)
    k, v = (rng.standard_normal((sum(lengths[1]), heads_kv, head_dim)).astype(dtype) for _ in range(2))
    return q, k, v, cumulative(lengths[0]), cumulative(lengths[1])


def brute_force(q, k, v, cu_q, cu_k, causal, window, scale, slopes):
    """All packed queries against all packed keys at once, a key visible to a query only in its
    own sequence (and its band, aligned to the sequence's bottom-right corner); ALiBi by distance."""
    seq_q = numpy.repeat(numpy.arange(len(cu_q) - 1), numpy.diff(cu_q))
    seq_k = numpy.repeat(numpy.arange(len(cu_k) - 1), numpy.diff(cu_k))
    pos_q = numpy.arange(len(q)) - cu_q[seq_q]
    pos_k = numpy.arange(len(k)) - cu_k[seq_k]
    diagonal = numpy.diff(cu_k)[seq_q] - numpy.diff(cu_q)[seq_q]  # per query: seqlen_k - seqlen_q of its sequence
    offset = pos_q[:, None] + diagonal[:, None] - pos_k[None, :]  # i + seqlen_k - seqlen_q - j
    visible = seq_q[:, None] == seq_k[None, :]
    left, right = window or (None, None)
    right = 0 if causal else right
    if left is not None:
        visible &= offset <= left
    if right is not None:
        visible &= offset >= -right
    group = q.shape[1] // k.shape[1]
    out = numpy.zeros(q.shape)
    for h in range(q.shape[1]):
        s = scale * q[:, h] @ k[:, h // group].T - slopes[seq_q, h][:, None] * numpy.abs(offset)
        s = numpy.where(visible, s, -numpy.inf)
        seen = visible.any(axis=1)
        p = numpy.zeros_like(s)
        p[seen] = scipy.special.softmax(s[seen], axis=1)
        out[:, h] = p @ v[:, h // group]
    return out


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (2, 1)), (True, (4, None))])
def test_reference_against_brute_force(rng, causal, window):
    q, k, v, cu_q, cu_k = packed(rng, LENGTHS)
    slopes = rng.uniform(0.0, 0.5, (len(cu_q) - 1, q.shape[1]))
    got = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window, scale=0.4, alibi_slopes=slopes)
    want = brute_force(q, k, v, cu_q, cu_k, causal, window, 0.4, slopes)
    numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.cpu_only
@pytest.mark.parametrize("causal", [False, True])
def test_fallback_matches_reference(rng, causal):
    """attention_varlen and its backward with no GPU: the tiled reference per sequence."""
    q, k, v, cu_q, cu_k = packed(rng, LENGTHS, dtype=numpy.float32)
    options = dict(causal=causal, softcap=3.0, alibi_slopes=numpy.array([0.1, 0.2, 0.3, 0.4]))
    out, lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    assert out.dtype == numpy.float32 and out.shape == q.shape and lse.shape == (4, len(q))
    numpy.testing.assert_allclose(out, ref, atol=1e-5)
    numpy.testing.assert_array_equal(numpy.isneginf(lse), numpy.isneginf(ref_lse))
    dout = rng.standard_normal(q.shape).astype(numpy.float32)
    grads = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options)
    for got, want in zip(grads, reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **options)):
        numpy.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.cpu_only
def test_fallback_seqlens_k(rng):
    q = rng.standard_normal((3, 7, 4, 8)).astype(numpy.float32)
    k, v = (rng.standard_normal((3, 9, 2, 8)).astype(numpy.float32) for _ in range(2))
    seqlens = numpy.array([9, 0, 4])
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True, seqlens_k=seqlens)
    grads = cupyflash.attention_backward(numpy.ones_like(out), q, k, v, out, lse, causal=True, seqlens_k=seqlens)
    for b, keys in enumerate(seqlens):
        ref = reference.attention(q[b : b + 1], k[b : b + 1, :keys], v[b : b + 1, :keys], causal=True)
        numpy.testing.assert_allclose(out[b : b + 1], ref, atol=1e-5)
        dq, dk, dv = reference.attention_backward(numpy.ones_like(ref), q[b : b + 1], k[b : b + 1, :keys],
                                                  v[b : b + 1, :keys], causal=True)
        numpy.testing.assert_allclose(grads[0][b : b + 1], dq, atol=1e-4)
        numpy.testing.assert_allclose(grads[1][b : b + 1, :keys], dk, atol=1e-4)
        assert not grads[1][b, keys:].any() and not grads[2][b, keys:].any()


@pytest.mark.parametrize("form", ["tensor", "list", "int"])
def test_torch_seqlens_k_on_the_host(rng, form):
    """cupyflash.torch.attention's seqlens_k as a host tensor, a list or an int: the NumPy path's
    results and gradients, padding keys' gradients 0; bad lengths named before any work."""
    torch = pytest.importorskip("torch")
    import cupyflash.torch

    q = torch.from_numpy(rng.standard_normal((3, 7, 4, 8)).astype(numpy.float32)).requires_grad_()
    k, v = (torch.from_numpy(rng.standard_normal((3, 9, 2, 8)).astype(numpy.float32)).requires_grad_()
            for _ in range(2))
    lengths = {"tensor": torch.tensor([9, 0, 4]), "list": [9, 0, 4], "int": 5}[form]
    seqlens = numpy.array([9, 0, 4] if form != "int" else [5] * 3)
    out = cupyflash.torch.attention(q, k, v, causal=True, seqlens_k=lengths)
    out.backward(torch.ones_like(out))
    arrays = [x.detach().numpy() for x in (q, k, v)]
    want, lse = cupyflash.attention(*arrays, causal=True, return_lse=True, seqlens_k=seqlens)
    grads = cupyflash.attention_backward(numpy.ones_like(want), *arrays, want, lse, causal=True, seqlens_k=seqlens)
    numpy.testing.assert_array_equal(out.detach().numpy(), want)
    for x, g in zip((q, k, v), grads):
        numpy.testing.assert_array_equal(x.grad.numpy(), g)
    for b, n in enumerate(seqlens):
        assert not k.grad[b, n:].any() and not v.grad[b, n:].any()
    for bad, error, match in (([1, 2], ValueError, r"seqlens_k must have shape \(batch,\) = \(3,\)"),
                              (torch.tensor([1, 2, 10]), ValueError, r"seqlens_k must lie in \[0, seqlen_k\]"),
                              (torch.tensor([1.0, 2.0, 3.0]), TypeError, "seqlens_k must have an integer dtype")):
        with pytest.raises(error, match=match):
            cupyflash.torch.attention(q, k, v, seqlens_k=bad)


BAD_CU = [
    (dict(cu_seqlens_q=numpy.array([0, 3, 3, 20, 21, 30], dtype=numpy.float32)), TypeError,
     "cu_seqlens_q must have an integer dtype"),
    (dict(cu_seqlens_q=numpy.array([0, 3, 2, 20, 21, 30], dtype=numpy.int32)), ValueError, "must be non-decreasing"),
    (dict(cu_seqlens_k=numpy.array([0, 5, 9, 26, 26, 37], dtype=numpy.int32)), ValueError, "last value must be the packed"),
    (dict(cu_seqlens_q=numpy.array([1, 3, 3, 20, 21, 30], dtype=numpy.int32)), ValueError, "must start at 0"),
    (dict(cu_seqlens_q=numpy.array([0, 30], dtype=numpy.int32)), ValueError, "must have the same length"),
    (dict(cu_seqlens_q=numpy.zeros((2, 3), dtype=numpy.int32)), ValueError, r"shape \(batch \+ 1,\)"),
    (dict(cu_seqlens_q=[0, 3.0, 30]), TypeError, "an integer array or a list of ints"),
    (dict(cu_seqlens_q="0 30"), TypeError, "cu_seqlens_q must be an array"),
    (dict(max_seqlen_q=16), ValueError, "max_seqlen_q must be at least the longest sequence's length 17"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be at least 0"),
]


@pytest.mark.parametrize("change,error,match", BAD_CU)
def test_bad_cu_seqlens_are_rejected(rng, change, error, match):
    q, k, v, cu_q, cu_k = packed(rng, LENGTHS, dtype=numpy.float32)
    copies = [x.copy() for x in (q, k, v, cu_q, cu_k)]
    args = {**dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=None, max_seqlen_k=None), **change}
    with pytest.raises(error, match=match):
        cupyflash.attention_varlen(q, k, v, **args)
    for x, y in zip((q, k, v, cu_q, cu_k), copies):
        numpy.testing.assert_array_equal(x, y)


def test_index_arrays_take_any_integer_dtype(rng):
    """One rule for every index array (cu_seqlens, seqlens_k, cache_seqlens): a list of ints or an
    integer array of any width gives what int32 gives."""
    q, k, v, cu_q, cu_k = packed(rng, LENGTHS, dtype=numpy.float32)
    want = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    for convert in (lambda cu: cu.astype(numpy.int64), lambda cu: cu.astype(numpy.uint32), lambda cu: cu.tolist()):
        numpy.testing.assert_array_equal(cupyflash.attention_varlen(q, k, v, convert(cu_q), convert(cu_k), causal=True), want)
    qf, kf, vf = (rng.standard_normal((2, n, 2, 8)).astype(numpy.float32) for n in (3, 9, 9))
    want = cupyflash.attention(qf, kf, vf, seqlens_k=numpy.array([4, 9], numpy.int32))
    numpy.testing.assert_array_equal(cupyflash.attention(qf, kf, vf, seqlens_k=numpy.array([4, 9], numpy.int64)), want)
    numpy.testing.assert_array_equal(cupyflash.attention(qf, kf, vf, seqlens_k=[4, 9]), want)
    want = cupyflash.attention_decode(qf, kf, vf, numpy.array([4, 9], numpy.int32))
    numpy.testing.assert_array_equal(cupyflash.attention_decode(qf, kf, vf, numpy.array([4, 9], numpy.int64)), want)
    numpy.testing.assert_array_equal(cupyflash.attention_decode(qf, kf, vf, [4, 9]), want)


def test_bad_packed_arrays_are_rejected(rng):
    q, k, v, cu_q, cu_k = packed(rng, LENGTHS, dtype=numpy.float32)
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \(total_q, heads, head_dim\)"):
        cupyflash.attention_varlen(q[None], k, v, cu_q, cu_k)
    with pytest.raises(TypeError, match="same dtype"):
        cupyflash.attention_varlen(q, k.astype(numpy.float64), v, cu_q, cu_k)
    with pytest.raises(ValueError, match="heads_kv"):
        cupyflash.attention_varlen(q, k[:, :1].repeat(3, axis=1), v, cu_q, cu_k)
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    with pytest.raises(ValueError, match=r"lse must have shape \(heads, total_q\)"):
        cupyflash.attention_varlen_backward(q, q, k, v, q, lse.T.astype(numpy.float32), cu_q, cu_k)
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        cupyflash.attention_varlen_backward(q, q, k, v, q, lse.astype(numpy.float32), cu_q, cu_k, deterministic=1)


@pytest.mark.parametrize("seqlens,error,match", [
    (numpy.array([1, 2]), ValueError, r"seqlens_k must have shape \(batch,\) = \(3,\)"),
    (numpy.array([1, 2, 10]), ValueError, r"seqlens_k must lie in \[0, seqlen_k\] = \[0, 9\]"),
    (numpy.array([1.0, 2.0, 3.0]), TypeError, "seqlens_k must have an integer dtype"),
    ("3", TypeError, "seqlens_k must be an array"),
])
def test_bad_seqlens_k_are_rejected(rng, seqlens, error, match):
    q = rng.standard_normal((3, 7, 4, 8)).astype(numpy.float32)
    k = rng.standard_normal((3, 9, 4, 8)).astype(numpy.float32)
    with pytest.raises(error, match=match):
        cupyflash.attention(q, k, k, seqlens_k=seqlens)


def test_varlen_instantiations():
    """One varlen instantiation per (dtype, head dim class) and kernel, dense, with the score
    modifiers; a varlen problem picks it, and never a block-sparse one."""
    varlen = [k for k in catalog.all_kernels() if getattr(k, "varlen", False)]
    assert all(k.local and k.score_mod and not k.block_sparse for k in varlen)
    v = catalog.Variant(varlen=True)
    for dtype in tiles.DTYPE_NAMES:
        for d in tiles.PADDED_HEAD_DIMS:
            assert catalog.forward_kernel("scalar", dtype, d, v) in varlen
            assert {catalog.dkdv_kernel("scalar", dtype, d, v), catalog.dq_kernel(False, dtype, d, v)} <= set(varlen)
    for d in tiles.PADDED_HEAD_DIMS:
        for large in (False, True):
            assert catalog.dkdv_kernel("sm80", "bfloat16", d, v, large) in varlen
        assert catalog.dq_kernel(True, "bfloat16", d, v) in varlen
    with pytest.raises(ValueError, match="no block-sparse"):
        catalog.forward_kernel("scalar", "float32", 64, catalog.Variant(True, True, varlen=True))


def test_the_checks_read_device_views_as_arrays(rng):
    """The torch adapter's first call of a packed batch checks DeviceViews (address, shape,
    strides, dtype) of its tensors: the same problem as from arrays of that layout, a packed view
    seen as a batch of one by x[None] and nothing else."""
    from cupyflash import validation
    from cupyflash.frameworks.arrays import DeviceView

    q, k, v = (rng.standard_normal((203, h, 40)).astype(numpy.float32)[:, ::1] for h in (4, 2, 2))
    cu = numpy.array([0, 17, 130, 203], numpy.int32)
    views = [DeviceView(1 << 20, x.shape, x.strides, x.dtype, 0, x) for x in (q, k, v)]
    options = dict(causal=True, scale=None, return_lse=True, window=(33, 0), softcap=None)
    assert validation.check_varlen_args(*views, cu, cu, None, 113, **options) == validation.check_varlen_args(
        q, k, v, cu, cu, None, 113, **options)
    batch = views[0][None]
    assert (batch.shape, batch.strides[1:], batch.data.ptr) == ((1, 203, 4, 40), q.strides, 1 << 20)
    with pytest.raises(TypeError, match="only x\\[None\\]"):
        views[0][0]
