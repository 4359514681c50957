"""The public forward: validation, dispatch (GPU kernel or CPU fallback), framework round trip."""

from __future__ import annotations

import numpy

from cupyflash import _arrays, _instantiations, _validation, reference


def gpu_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.is_available())


def attention(q, k, v, *, causal=False, scale=None, return_lse=False):
    """Exact softmax attention, computed with FlashAttention-2's tiled online softmax.

    out[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, h]) v[b, j, h]

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads, head_dim)
    k, v : arrays, shape (batch, seqlen_k, heads, head_dim)
        NumPy arrays, CuPy arrays, or GPU arrays of any framework with ``__dlpack__`` (PyTorch,
        JAX). Any strides are accepted as long as the head_dim axis is contiguous, so a
        (batch, heads, seq, head_dim) tensor ``x`` passes as ``x.transpose(0, 2, 1, 3)`` (torch:
        ``x.transpose(1, 2)``) with no copy. dtype float16, bfloat16 (``ml_dtypes.bfloat16``),
        float32 or float64, the same for all three; head_dim any value from 1 to 256.
    causal : bool
        Mask key j for query i when ``j > i + (seqlen_k - seqlen_q)``: the diagonal is aligned to
        the bottom-right corner of the score matrix, as in FlashAttention-2. With seqlen_q = 2 and
        seqlen_k = 5 the visible keys are (1 = visible)::

            query 0:  1 1 1 1 0
            query 1:  1 1 1 1 1

        and with seqlen_q = 5, seqlen_k = 2, queries 0-2 see no key (output 0, lse -inf)::

            query 0:  0 0
            query 1:  0 0
            query 2:  0 0
            query 3:  1 0
            query 4:  1 1
    scale : float, optional
        Multiplies q . k before the softmax; default ``1 / sqrt(head_dim)``.
    return_lse : bool
        Also return lse, float32 of shape (batch, heads, seqlen_q): the natural-log
        log-sum-exp of each row's scaled, masked scores (what the backward pass needs).

    Returns
    -------
    out, or (out, lse)
        out has q's shape (contiguous) and dtype. A row with no visible key (causal with
        seqlen_q > seqlen_k, or seqlen_k == 0) gives out 0 and lse -inf, never NaN.
        Results come back in the caller's array type: NumPy for NumPy input, CuPy for CuPy,
        a torch.Tensor / jax.Array for those (sharing memory through DLPack, no copy); other
        DLPack frameworks without a ``from_dlpack`` function get the CuPy array.

    Precision: 16-bit inputs are widened to float32 and every score, probability and
    accumulation is float32; float32 and float64 compute in their own precision.

    Where it runs: GPU inputs on the device that holds them, on CuPy's current stream
    (``cupy.cuda.get_current_stream()``). Arrays imported through DLPack are ordered after their
    producer's current stream, and a torch/JAX result is ordered before the consumer's stream on
    export; to run on a torch side stream, enter ``cupy.cuda.ExternalStream(s.cuda_stream)``.
    NumPy inputs are copied to the current CuPy device and the result copied back; with no GPU
    they run through `cupyflash.reference.tiled_attention` (the same algorithm in float64) and
    the result is cast to the input dtype.

    Raises TypeError or ValueError, before any device work and leaving the inputs untouched, for
    non-array inputs, unsupported or mismatched dtypes, inconsistent shapes, a non-contiguous
    head_dim axis, head_dim outside 1..256, arrays on different devices, or a scale that is not
    a finite positive number.

    Example
    -------
    >>> import numpy as np, cupyflash
    >>> q = np.random.randn(1, 5, 2, 16).astype(np.float32)
    >>> kv = np.random.randn(1, 7, 2, 16).astype(np.float32)
    >>> out, lse = cupyflash.attention(q, kv, kv, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((1, 5, 2, 16), (1, 2, 5))
    """
    given = {"q": q, "k": k, "v": v}
    origins = {name: _arrays.classify(x, name) for name, x in given.items()}
    _arrays.check_placement(origins)
    arrays = {name: _arrays.ingest(x, origins[name], name) for name, x in given.items()}
    problem = _validation.check_attention_args(
        arrays["q"], arrays["k"], arrays["v"], causal=causal, scale=scale, return_lse=return_lse
    )
    q_, k_, v_ = arrays["q"], arrays["k"], arrays["v"]

    if not origins["q"].on_gpu and not gpu_available():
        out, lse = _forward_cpu(q_, k_, v_, problem)
    else:
        if not origins["q"].on_gpu:
            import cupy

            q_, k_, v_ = (cupy.asarray(x) for x in (q_, k_, v_))
        out, lse = _forward_gpu(q_, k_, v_, problem)

    origin = origins["q"]
    out = _arrays.export(out, origin)
    return (out, _arrays.export(lse, origin)) if problem.return_lse else out


def _forward_cpu(q, k, v, p: _validation.AttentionProblem):
    out, lse = reference.tiled_attention(q, k, v, causal=p.causal, scale=p.scale, return_lse=True)
    return out.astype(q.dtype), lse.astype(numpy.float32)


def _forward_gpu(q, k, v, p: _validation.AttentionProblem):
    import cupy

    with cupy.cuda.Device(q.device.id):
        out = _empty((p.batch, p.seqlen_q, p.heads, p.head_dim), q.dtype)
        lse = _empty((p.batch, p.heads, p.seqlen_q), numpy.float32)
        if out.size == 0:
            return out, lse
        launch_forward(q, k, v, out, lse, p)
    return out, lse


def _empty(shape, dtype):
    """Output allocation (the GPU tests replace it with NaN-filled arrays)."""
    import cupy

    return cupy.empty(shape, dtype=dtype)


def launch_forward(q, k, v, out, lse, p: _validation.AttentionProblem, kernel=None) -> None:
    """Launches the forward kernel on CuPy's current stream; arrays must already be validated.

    `kernel` (an _instantiations.FwdKernel) defaults to the traits table's choice."""
    from cupyflash import _compile

    kernel = kernel or _instantiations.fwd_kernel(p.dtype_name, p.head_dim, p.causal)
    function = _compile.get_function(kernel, q.device.id)  # raises ValueError if it cannot fit
    params = numpy.zeros(1, dtype=_instantiations.FWD_PARAMS_DTYPE)
    for name, x in (("q", q), ("k", k), ("v", v), ("o", out)):
        params[name] = x.data.ptr
        item = x.dtype.itemsize
        params[f"{name}_batch_stride"] = x.strides[0] // item
        params[f"{name}_row_stride"] = x.strides[1] // item
        params[f"{name}_head_stride"] = x.strides[2] // item
    params["lse"] = lse.data.ptr
    params["heads"] = p.heads
    params["seqlen_q"] = p.seqlen_q
    params["seqlen_k"] = p.seqlen_k
    params["head_dim"] = p.head_dim
    params["scale_log2"] = p.scale * reference.LOG2E
    function(kernel.grid(p.batch, p.heads, p.seqlen_q), (kernel.num_threads,), (params,), shared_mem=kernel.smem_bytes)
