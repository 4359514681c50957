"""The public forward and backward: validation, dispatch (GPU kernels or CPU fallback), framework
round trip."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading

import numpy

from cupyflash import _arrays, _dropout, _instantiations, _tma, _validation, reference
from cupyflash._block_mask import BlockMask


def gpu_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.is_available())


def attention(
    q, k, v, *, causal=False, scale=None, return_lse=False, window=None, softcap=None, alibi_slopes=None, seqlens_k=None,
    dropout_p=0.0, seed=None, offset=0,
):
    """Exact softmax attention, computed with FlashAttention-2's tiled online softmax.

    out[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, h]) v[b, j, h]

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads, head_dim)
    k, v : arrays, shape (batch, seqlen_k, heads_kv, head_dim)
        NumPy arrays, CuPy arrays, or GPU arrays of any framework with ``__dlpack__`` (PyTorch,
        JAX). Any strides are accepted as long as the head_dim axis is contiguous, so a
        (batch, heads, seq, head_dim) tensor ``x`` passes as ``x.transpose(0, 2, 1, 3)`` (torch:
        ``x.transpose(1, 2)``) with no copy. dtype float16, bfloat16 (``ml_dtypes.bfloat16``),
        float32 or float64, the same for all three; head_dim any value from 1 to 256.
        heads_kv = heads is multi-head attention; a divisor of heads is grouped-query attention
        (GQA; heads_kv = 1: multi-query, MQA): query head h attends with K/V head
        ``h // (heads // heads_kv)``, read in place (never repeated in memory).
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
        Also return lse, of shape (batch, heads, seqlen_q), float32 (float64 for float64
        inputs): the natural-log log-sum-exp of each row's scaled, masked scores, which
        `attention_backward` needs.
    window : (left, right), optional
        Sliding-window (local) attention: query i sees keys j with
        ``i + (seqlen_k - seqlen_q) - left <= j <= i + (seqlen_k - seqlen_q) + right``, the
        band aligned bottom-right as causal is. Each side is an int >= 0, or None (or -1, as
        flash-attn spells it) for unbounded. With causal=True both apply (right becomes 0):
        ``causal=True, window=(255, None)`` lets each query see itself and the 255 keys before
        it. Key blocks outside the band are skipped, so the time is proportional to the band's
        width, not to seqlen_k.
    softcap : float, optional
        Caps the scaled scores smoothly, s -> softcap * tanh(s / softcap), before the softmax
        (Gemma 2, Grok). None or 0: none.
    alibi_slopes : array, optional
        ALiBi: adds -slope[h] * |i + seqlen_k - seqlen_q - j| to the (softcapped) score of query
        i and key j, the key's distance from the query's own position, aligned bottom-right as
        causal is. Shape (heads,) or (batch, heads), any real float dtype (used in the kernels'
        accumulator precision); on the host, or on q's GPU. flash-attn's semantics.
    seqlens_k : int array of shape (batch,), optional
        Key padding for padded batches: batch entry b uses only its first seqlens_k[b] keys, as if
        k and v were cut to that length (causal, windows and ALiBi align to seqlen_q and
        seqlens_k[b]); the rest is never read. An integer array on the host (checked: 0 <= s <=
        seqlen_k) or on q's GPU (used as given, clamped to [0, seqlen_k]), or an int. For packed
        batches with no padding at all, see `attention_varlen`.
    dropout_p : float
        Dropout on the attention probabilities (training): each P_ij is kept with probability
        1 - dropout_p and scaled by 1 / (1 - dropout_p), out = (P ∘ Z / (1 - dropout_p)) V; lse
        stays that of P. The keep mask Z comes from a counter-based generator (Philox4x32-10) in
        the kernels, a function of (seed, offset, batch, head, query, key) alone: it is never
        stored, the backward regenerates it, and `cupyflash.dropout_mask` materialises it.
        dropout_p takes effect at 2^-32 resolution. Default 0: no dropout.
    seed : int in [0, 2**64), required when dropout_p > 0
        The generator's key: the same seed and offset give the same mask (pass both again to
        `attention_backward`).
    offset : int in [0, 2**32)
        A second stream selector (e.g. the training step), so one seed serves many calls.

    Returns
    -------
    out, or (out, lse)
        out has q's shape (contiguous) and dtype. A row with no visible key (causal with
        seqlen_q > seqlen_k, or seqlen_k == 0) gives out 0 and lse -inf, never NaN.
        Results come back in the caller's array type: NumPy for NumPy input, CuPy for CuPy,
        a torch.Tensor / jax.Array for those (sharing memory through DLPack, no copy); other
        DLPack frameworks without a ``from_dlpack`` function get the CuPy array.

    Precision: float16/bfloat16 run on tensor cores (sm_80 and newer): every product accumulates
    in float32 and the softmax is float32, with P rounded to the input dtype before P V, as in
    FlashAttention-2 (GPUs older than sm_80 take the scalar kernels, all float32). float32 and
    float64 compute in their own precision on CUDA cores (never TF32).

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
    return _attention(q, k, v, causal, scale, return_lse, None, window, softcap, alibi_slopes, seqlens_k,
                      (dropout_p, seed, offset))


def block_sparse_attention(
    q, k, v, block_mask, *, causal=False, scale=None, return_lse=False, window=None, softcap=None, alibi_slopes=None,
    dropout_p=0.0, seed=None, offset=0,
):
    """Block-sparse FlashAttention (FlashAttention, §3.3, Algorithm 5): `attention` restricted to
    the nonzero blocks of `block_mask`.

    The seqlen_q x seqlen_k attention matrix is cut into blocks of ``block_mask.block_size``
    (default 128 x 128); keys of a zero block are hidden from that block's queries, as causal
    hides keys, and the kernels never load their K, V tiles, so the time falls in proportion to
    the mask's density. With causal=True both apply: a key is visible when the mask's block is
    nonzero and j <= i + seqlen_k - seqlen_q; the diagonal's blocks are the only ones masked per
    element (`BlockMask.partial`).

    Parameters
    ----------
    q, k, v, causal, scale, return_lse, window, softcap, alibi_slopes, dropout_p, seed, offset :
        as `attention` (a window applies on top of the mask: a key is visible when both keep it)
    block_mask : cupyflash.BlockMask
        Of shape (heads or 1, ceil(seqlen_q / block_q), ceil(seqlen_k / block_k)), optionally
        with a leading batch axis (batch or 1). Its block size must be a whole number of the
        kernels' tiles for the dtype and head_dim (128 always is); a ValueError says which
        otherwise.

    Returns
    -------
    out, or (out, lse), as `attention`. A query row whose blocks are all zero (or all hidden by
    causal) gives out 0 and lse -inf.

    Example
    -------
    >>> import numpy as np, cupyflash
    >>> q, k, v = (np.random.randn(1, 256, 2, 16).astype(np.float32) for _ in range(3))
    >>> mask = cupyflash.BlockMask.from_dense(np.array([[[True, False], [True, True]]]))  # 128 x 128 blocks
    >>> out = cupyflash.block_sparse_attention(q, k, v, mask)  # queries 0-127 see keys 0-127 only
    >>> out.shape
    (1, 256, 2, 16)
    """
    return _attention(q, k, v, causal, scale, return_lse, block_mask, window, softcap, alibi_slopes, None,
                      (dropout_p, seed, offset))


def _attention(
    q, k, v, causal, scale, return_lse, block_mask, window=None, softcap=None, alibi_slopes=None, seqlens_k=None,
    dropout=(0.0, None, 0),
):
    given = {"q": q, "k": k, "v": v}
    arrays, origins = _ingest_arrays(given)
    problem = _call_problem(
        "forward", arrays, origins, (causal, scale, return_lse, window, softcap),
        lambda: _validation.check_attention_args(arrays["q"], arrays["k"], arrays["v"], causal=causal, scale=scale,
                                                 return_lse=return_lse, window=window, softcap=softcap),
        block_mask, alibi_slopes, seqlens_k, dropout)
    return _run_forward(arrays, origins, problem)


def _call_problem(direction: str, arrays: dict, origins: dict, options: tuple, check_arrays, block_mask, alibi_slopes,
                  seqlens_k, dropout) -> _validation.AttentionProblem:
    """A call's checked problem: check_arrays() (the arrays and `options`), then the ALiBi slopes,
    the block mask and seqlens_k, through the cache of checked problems where the call has a key
    (`_checked_problem`); then dropout's probability, seed and offset."""

    def check():
        problem = _validation.check_alibi_slopes(_ingest_slopes(alibi_slopes, origins["q"]), check_arrays())
        if block_mask is not None:
            problem = _validation.check_block_mask(block_mask, problem)
        return _validation.check_seqlens_k(_ingest_side_array(seqlens_k, "seqlens_k", origins["q"]), problem)

    key = None
    if alibi_slopes is None and seqlens_k is None:
        key = _call_key(direction, arrays.values(), options)
    return _validation.check_dropout(*dropout, _checked_problem(key, block_mask, check))


# --------------------------------------------------------------------------- checked problems
# A training or inference loop calls with the same shapes, strides, dtypes and options again and
# again, and the checks (with the parameter images the launches then build from the problem) were
# most of a call's host time (benchmarks/NOTES.md, session 38). The checks read nothing else, so a
# call whose key passed them once passes them again: `_checked_problem` gives back the problem
# object of the first such call, whose `memo` keeps what the launches derived from it. Dropout's
# seed and offset change from call to call and are checked apart; ALiBi slopes and seqlens_k (arrays,
# whose values matter) and unhashable options leave a call without a key, checked every time.
_CHECKED: dict = {}  # call key -> AttentionProblem, calls without a block mask
_CHECKED_KEPT = 256  # problems kept per cache (this one, and each BlockMask's), oldest dropped first
# keep_bounded's one lock, for every cache it bounds (this one, each BlockMask's, decode's checked
# steps, the launch records' tensor maps).
_BOUNDED_LOCK = threading.Lock()


def _call_key(direction: str, arrays, options: tuple):
    """The key of a call's checks: direction, each array's type, shape, strides and dtype, and the
    options (`option_key`); None where an option cannot be hashed."""
    try:
        return (direction, tuple((type(x), x.shape, x.strides, x.dtype) for x in arrays), option_key(options))
    except TypeError:
        return None


def option_key(value):
    """value as a hashable key that tells apart values which compare equal across types (causal=1,
    refused, against True; scale=True against 1.0), inside tuples too; TypeError where unhashable."""
    if type(value) is tuple:
        return tuple(option_key(x) for x in value)
    hash(value)
    return (type(value), value)


def _checked_problem(key, block_mask, check) -> _validation.AttentionProblem:
    """check()'s problem, the same object for every call with this key (and this block mask); a
    call without a key (None) is checked every time. Problems with a mask are kept by the mask,
    without it: a copy that `_with_block_mask` completes on each call, sharing its memo."""
    if key is None or not (block_mask is None or isinstance(block_mask, BlockMask)):
        return check()  # (a block_mask of another type is refused there)
    cache = _CHECKED if block_mask is None else block_mask._checked_problems
    problem = cache.get(key)
    if problem is not None:
        return problem if block_mask is None else _with_block_mask(problem, block_mask)
    problem = check()
    keep_bounded(cache, key, problem if block_mask is None else _with_block_mask(problem, None), _CHECKED_KEPT)
    return problem


def keep_bounded(cache: dict, key, value, limit: int) -> None:
    """cache[key] = value, the oldest entry dropped first once `limit` are kept. Under one lock for
    every such cache: two threads dropping at once would both take the same oldest key (a KeyError),
    and an insert between iter() and next() makes next() raise."""
    with _BOUNDED_LOCK:
        if key not in cache and len(cache) >= limit:
            cache.pop(next(iter(cache)))
        cache[key] = value


def _with_block_mask(p: _validation.AttentionProblem, block_mask) -> _validation.AttentionProblem:
    """p with another block_mask, sharing p's memo (dataclasses.replace starts a new memo, and costs
    ~10 us on every call's path)."""
    copy = object.__new__(type(p))
    copy.__dict__.update(p.__dict__)
    copy.__dict__["block_mask"] = block_mask
    return copy


def _ingest_arrays(given: dict) -> tuple[dict, dict]:
    """The named arrays as NumPy or CuPy (DLPack imports, no copies) and their origins, all on the
    host or all on one GPU."""
    origins = {name: _arrays.classify(x, name) for name, x in given.items()}
    _arrays.check_placement(origins)
    return {name: _arrays.ingest(x, origins[name], name) for name, x in given.items()}, origins


def _run_forward(arrays: dict, origins: dict, problem: _validation.AttentionProblem):
    """The validated forward on the arrays' side (the GPU, or the CPU fallback), results exported."""
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


def _ingest_slopes(slopes, q_origin: _arrays.Origin):
    """alibi_slopes as NumPy or CuPy: a host array (or list) with any q, a GPU array only with q on
    the same GPU."""
    if isinstance(slopes, (list, tuple)):
        slopes = numpy.asarray(slopes)
    return _ingest_side_array(slopes, "alibi_slopes", q_origin)


def _ingest_side_array(x, name: str, q_origin: _arrays.Origin):
    """An argument array beside q (ALiBi slopes, sequence lengths) as NumPy or CuPy: on the host
    with any q, on a GPU only with q on the same GPU. None, ints and lists pass unchanged."""
    if x is None or isinstance(x, (int, numpy.integer, list, tuple)):
        return x
    origin = _arrays.classify(x, name)
    if origin.on_gpu and (not q_origin.on_gpu or origin.device_id != q_origin.device_id):
        where = f"GPU {q_origin.device_id}" if q_origin.on_gpu else "the host"
        raise ValueError(f"{name} is on GPU {origin.device_id} while q is on {where}; pass it on the host or on "
                         f"q's GPU")
    return _arrays.ingest(x, origin, name)


def _score_mod_options(p: _validation.AttentionProblem) -> dict:
    """The reference's softcap, alibi_slopes and dropout arguments for the problem."""
    slopes = p.alibi_slopes
    return {"softcap": p.softcap, "alibi_slopes": None if slopes is None else reference._as_float64(slopes),
            "dropout_p": p.dropout_p, "seed": p.seed, "offset": p.offset}


def _forward_cpu(q, k, v, p: _validation.AttentionProblem):
    options = dict(causal=p.causal, scale=p.scale, window=p.window, **_score_mod_options(p))
    if p.cu_seqlens is not None:
        out, lse = reference.attention_varlen(q, k, v, *p.cu_seqlens, return_lse=True, forward=reference.tiled_attention,
                                              **options)
    elif p.seqlens_k is not None:
        out, lse = _per_batch_entry(reference.tiled_attention, p, (q,), (k, v), return_lse=True, **options)
    else:
        out, lse = reference.tiled_attention(q, k, v, return_lse=True, block_mask=p.block_mask, **options)
    return out.astype(q.dtype), lse.astype(_validation.lse_dtype(p.dtype_name))


def _per_batch_entry(function, p: _validation.AttentionProblem, q_side, k_side, key_results=(), **options):
    """`function` (a reference) of a padded batch with seqlens_k, entry by entry on its first
    seqlens_k[b] keys; returns its results stacked over the batch, those at positions key_results
    (per key: dk, dv) padded with zeros to seqlen_k."""
    slopes = options.pop("alibi_slopes")
    results = []
    for b, keys in enumerate(numpy.asarray(p.seqlens_k)):
        row = None if slopes is None else slopes[b if slopes.shape[0] > 1 else 0]
        parts = list(function(*(x[b : b + 1] for x in q_side), *(x[b : b + 1, :keys] for x in k_side),
                              alibi_slopes=row, dropout_batch_start=b, **options))
        for i in key_results:
            parts[i] = numpy.pad(parts[i], [(0, 0), (0, p.seqlen_k - keys)] + [(0, 0)] * (parts[i].ndim - 2))
        results.append(parts)
    return tuple(numpy.concatenate(part) for part in zip(*results))


def _forward_gpu(q, k, v, p: _validation.AttentionProblem):
    import cupy

    with cupy.cuda.Device(q.device.id):
        if p.cu_seqlens is not None:  # packed: (total_q, heads, head_dim) and (heads, total_q)
            out = _empty((p.total_q, p.heads, p.head_dim), q.dtype)
            lse = _empty((p.heads, p.total_q), _validation.lse_dtype(p.dtype_name))
        else:
            out = _empty((p.batch, p.seqlen_q, p.heads, p.head_dim), q.dtype)
            lse = _empty((p.batch, p.heads, p.seqlen_q), _validation.lse_dtype(p.dtype_name))
        if out.size == 0:
            return out, lse
        if not p.return_lse:
            keep_if_captured(lse)  # (a graph's replays write it)
        launch_forward(q, k, v, out, lse, p)
    return out, lse


def _empty(shape, dtype):
    """Output allocation (the GPU tests replace it with NaN-filled arrays)."""
    import cupy

    return cupy.empty(shape, dtype=dtype)


def _pointer_and_strides(fields: dict, name: str, x) -> None:
    """x's pointer and (batch, row, head) strides in elements. A packed (total, heads, head_dim)
    array of a variable-length batch gets its row stride as batch stride: the kernels index it
    with a sequence's first row in place of the batch index (sequence_params)."""
    item = x.dtype.itemsize
    strides = x.strides if x.ndim == 4 else x.strides[:1] + x.strides
    fields[name] = x.data.ptr
    fields[f"{name}_batch_stride"] = strides[0] // item
    fields[f"{name}_row_stride"] = strides[1] // item
    fields[f"{name}_head_stride"] = strides[2] // item


def _problem_fields(fields: dict, p: _validation.AttentionProblem, device_id: int):
    """The problem's fields of FwdParams / BwdParams. Returns the device arrays they point to (ALiBi
    slopes, sequence lengths), which must stay alive until the launches are queued."""
    fields["heads"] = p.heads
    fields["seqlen_q"] = p.seqlen_q
    fields["seqlen_k"] = p.seqlen_k
    fields["head_dim"] = p.head_dim
    fields["kv_group"] = p.kv_group
    fields["band_first"], fields["band_last"] = p.kernel_band()
    fields["scale_log2"] = p.scale * reference.LOG2E
    _mask_fields(fields, p.block_mask, device_id)
    fields["softcap_log2"] = 0.0 if p.softcap is None else p.softcap * reference.LOG2E
    fields["dropout_seed"], fields["dropout_offset"] = p.seed, p.offset
    fields["dropout_threshold"] = _dropout.threshold(p.dropout_p)
    fields["dropout_rescale"] = _dropout.rescale(p.dropout_p)
    return _slopes_fields(fields, p), _varlen_fields(fields, p)


def _varlen_fields(fields: dict, p: _validation.AttentionProblem):
    """cu_seqlens_q, cu_seqlens_k, seqused_k (nullptr for a fixed-length batch); returns the device
    arrays, which must stay alive until the launches are queued."""
    import cupy

    fields["cu_seqlens_q"] = fields["cu_seqlens_k"] = fields["seqused_k"] = 0
    arrays = []
    if p.cu_seqlens is not None:
        device_id = cupy.cuda.Device().id
        arrays = [_device_lengths(device_id, cu.tobytes()) for cu in p.cu_seqlens]
        fields["cu_seqlens_q"], fields["cu_seqlens_k"] = (x.data.ptr for x in arrays)
    if p.seqlens_k is not None:
        arrays.append(cupy.asarray(p.seqlens_k))
        fields["seqused_k"] = arrays[-1].data.ptr
    return arrays


@functools.lru_cache(maxsize=64)
def _device_lengths(device_id: int, lengths: bytes):
    """Checked int32 cu_seqlens on the device, kept for the next call with the same lengths (the
    forward and its backward, a benchmark): the upload from pageable memory waits for the GPU."""
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.asarray(numpy.frombuffer(lengths, dtype=numpy.int32))


def _row_statistics_strides(p: _validation.AttentionProblem) -> tuple[int, int]:
    """(batch, head) strides of a contiguous per-row vector (lse, D): (batch, heads, seqlen_q), or
    packed (heads, total_q) indexed by each sequence's first row."""
    return (1, p.total_q) if p.cu_seqlens is not None else (p.heads * p.seqlen_q, p.seqlen_q)


def _slopes_fields(fields: dict, p: _validation.AttentionProblem):
    """The ALiBi fields; returns the slopes as the kernels read them (contiguous, Accum type)."""
    if p.alibi_slopes is None:
        fields["alibi_slopes"] = fields["alibi_batch_stride"] = 0
        return None
    import cupy

    slopes = p.alibi_slopes
    if isinstance(slopes, numpy.ndarray):
        slopes = numpy.ascontiguousarray(slopes, dtype=numpy.float64)  # bfloat16 has no CuPy cast
    slopes = cupy.ascontiguousarray(cupy.asarray(slopes), dtype=_validation.lse_dtype(p.dtype_name))
    fields["alibi_slopes"] = slopes.data.ptr
    fields["alibi_batch_stride"] = p.heads if slopes.shape[0] > 1 else 0
    return slopes


_MASK_POINTERS = ("kv_block_count", "kv_block_index", "q_block_count", "q_block_index", "key_block_order")


def _mask_fields(fields: dict, block_mask, device_id: int) -> None:
    """The block mask's compressed form (kernels' kv_block_*/q_block_*, mask_*); zeros (nullptr)
    for dense attention. A mask slab is one (batch, head) of the mask; a size-1 axis broadcasts."""
    if block_mask is None:
        fields.update(dict.fromkeys(_MASK_POINTERS, 0))
        fields.update(mask_batch_stride=0, mask_head_stride=0, mask_q_blocks=0, mask_k_blocks=0)
        fields.update(mask_block_q=0, mask_block_k=0)
        return
    for name, x in zip(_MASK_POINTERS, block_mask.device_arrays(device_id)):
        fields[name] = x.data.ptr
    heads = block_mask.mask_heads
    fields["mask_batch_stride"] = heads if block_mask.mask_batch > 1 else 0
    fields["mask_head_stride"] = 1 if heads > 1 else 0
    fields["mask_q_blocks"], fields["mask_k_blocks"] = block_mask.blocks
    fields["mask_block_q"], fields["mask_block_k"] = block_mask.block_size


def _params(dtype: numpy.dtype, fields: dict) -> numpy.ndarray:
    """The kernel-argument struct: one record of `dtype`, filled in a single assignment (setting
    fields one at a time costs microseconds each, and this runs on every call)."""
    params = numpy.empty(1, dtype=dtype)
    params[0] = tuple(fields[name] for name in dtype.names)
    return params


def _launch(kernel, device_id: int, grid, params: numpy.ndarray, *more: numpy.ndarray) -> None:
    """Launches `kernel` with its parameter struct (`more`: byte images of further by-value
    arguments, such as the forward's tensor maps)."""
    CPointer, get_function = _launch_helpers()
    function = get_function(kernel, device_id)  # raises ValueError if it cannot fit
    # The struct goes by address: CuPy's by-value path for a NumPy record rebuilds its
    # __array_interface__ (the whole field description) on every launch, about 50 us for BwdParams.
    # The arrays outlive the call, and the launch copies the bytes.
    arguments = tuple(CPointer(_address(x)) for x in (params, *more))
    function(grid, (kernel.num_threads,), arguments, shared_mem=kernel.smem_bytes)


@functools.cache
def _launch_helpers():
    """CuPy's CPointer and `_compile.get_function`, imported once: imports inside `_launch` cost
    about 2 us a launch (benchmarks/NOTES.md, session 39)."""
    from cupy.cuda.function import CPointer

    from cupyflash import _compile

    return CPointer, _compile.get_function


def _address(x: numpy.ndarray) -> int:
    """The address of an array's bytes, through ctypes' view of its buffer: about half the time of
    numpy's .ctypes.data (0.5 against 1.1 us on the H200 machine's host). Arrays ctypes cannot view
    (read-only, empty or not contiguous) take .ctypes.data."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(x))
    except (TypeError, ValueError):
        return x.ctypes.data


# Buffers that their kernels leave zeroed, kept per (purpose, device, stream), as the launches on a
# stream run one after another: "counters" (the persistent kernels' claims and dQ slab counts,
# decode's split counts) and "dq ring" (the warp-specialised dK/dV kernel's dQ ring, which would
# otherwise be cleared by a memset on every call).
_ZEROED: dict = {}
# The workspaces and counters of calls captured into CUDA graphs, which replays go on using (a
# graph holds the addresses for its life, which may be the process's).
_CAPTURED: list = []
# A dQ ring above this many bytes is allocated and cleared per call rather than kept (a stream
# keeps at most this much for it).
RING_KEPT_BYTES = 64 << 20


def zeroed(purpose: str, device_id: int, n: int, dtype, least: int = 0):
    """A zeroed buffer of at least n elements of dtype for a launch on the current stream, which the
    launch must leave zeroed. A call being captured into a CUDA graph gets one of its own, as its
    replays may run on any stream beside calls on this one (the memset is captured too: harmless)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        return keep_if_captured(cupy.zeros(n, dtype))
    key = (purpose, device_id, stream.ptr)
    buffer = _ZEROED.get(key)
    if buffer is None or buffer.size < n or buffer.dtype != dtype:
        buffer = _ZEROED[key] = cupy.zeros(max(n, least), dtype)
    return buffer


def zeroed_counters(device_id: int, n: int):
    """`zeroed`'s uint32 counters, at least 1024 of them."""
    return zeroed("counters", device_id, n, numpy.dtype(numpy.uint32), 1024)


def keep_if_captured(x, *more):
    """x, kept alive for the process's life with the other arrays given (None: skipped) if the
    current stream is being captured into a graph."""
    import cupy

    if cupy.cuda.get_current_stream().is_capturing():
        _CAPTURED.extend(y for y in (x, *more) if y is not None)
    return x


@functools.cache
def _compute_capability(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


@functools.cache
def _sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.cache
def large_shared_memory(device_id: int) -> bool:
    """Whether the device offers an H100's shared memory per block (the larger dK/dV tiles)."""
    import cupy

    limit = cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]
    return limit >= _instantiations.SMEM_H100


def tensor_cores_for(p: _validation.AttentionProblem, device_id: int) -> bool:
    """Whether the problem takes the tensor-core kernels on this device (16-bit, sm_80 or newer)."""
    return _instantiations.uses_tensor_cores(p.dtype_name, _compute_capability(device_id))


def _uses_wgmma(p: _validation.AttentionProblem, device_id: int) -> bool:
    """Whether the Hopper (wgmma) kernels can serve the problem: 16-bit, head dim padded to 64 or
    128, an sm_90 device."""
    padded = _instantiations.padded_head_dim(p.head_dim)
    return _instantiations.uses_wgmma(p.dtype_name, padded, _compute_capability(device_id))


def wgmma_for(p: _validation.AttentionProblem, device_id: int) -> bool:
    """Whether the problem's forward takes the Hopper (wgmma) kernel: it is switched on
    (`_instantiations.WGMMA_FORWARD_BY_DEFAULT`) and `_uses_wgmma`."""
    return _instantiations.WGMMA_FORWARD_BY_DEFAULT and _uses_wgmma(p, device_id)


def forward_kernel(p: _validation.AttentionProblem, device_id: int, tensor_cores=None, wgmma=None, tma=None, ws=None):
    """The traits table's forward kernel: the tensor-core kernel where `tensor_cores_for` allows
    it, unless tensor_cores=False; among those the Hopper one where `wgmma_for` allows it, or with
    wgmma=True; that one's TMA build where it has one, unless tma=False or CUPYFLASH_HOPPER_TMA=0
    (`_instantiations.TMA_FORWARD_BY_DEFAULT`); in place of the unmasked TMA builds at
    `_instantiations.WS_FORWARD_HEAD_DIMS` the warp-specialised kernel with ws=True, or by default
    (ws=None) where `_instantiations.ws_forward_by_default` allows (at d64: block masks whose query
    tiles walk few key blocks), unless CUPYFLASH_HOPPER_WS=0 (`_instantiations.WS_FORWARD_BY_DEFAULT`)."""
    if tensor_cores is None:
        tensor_cores = tensor_cores_for(p, device_id)
    if wgmma is None:
        wgmma = tensor_cores and wgmma_for(p, device_id)
    if tma is None:
        tma = _instantiations.TMA_FORWARD_BY_DEFAULT
    if ws is None:
        density = None if p.block_mask is None else p.block_mask.density
        ws = _instantiations.WS_FORWARD_BY_DEFAULT and _instantiations.ws_forward_by_default(
            _instantiations.padded_head_dim(p.head_dim), density, p.seqlen_k)
    return _instantiations.fwd_kernel(
        p.dtype_name, p.head_dim, p.local, tensor_cores, p.block_mask is not None, p.modified, p.varlen, wgmma,
        wgmma and tma, wgmma and tma and ws,
    )


def launch_forward(
    q, k, v, out, lse, p: _validation.AttentionProblem, kernel=None, tensor_cores=None, wgmma=None
) -> None:
    """Launches the forward kernel on CuPy's current stream; arrays (and a block mask's block
    size) must already be validated.

    `kernel` (an _instantiations.FwdKernel, TcFwdKernel or WgmmaFwdKernel) defaults to `forward_kernel`'s.
    A TMA build becomes its cp.async twin where K's or V's layout has no tensor map (_tma.py), and
    the warp-specialised kernel the TMA build where Q's, K's, V's or O's has none."""
    device_id = q.device.id
    kernel = kernel or forward_kernel(p, device_id, tensor_cores, wgmma)
    pointers = {"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "o": out.data.ptr, "lse": lse.data.ptr,
                "query_tile_order": _query_tile_order(p, kernel, device_id)}

    def static_fields():
        fields = {}
        fields["lse_batch_stride"], fields["lse_head_stride"] = _row_statistics_strides(p)
        for name, x in (("q", q), ("k", k), ("v", v), ("o", out)):
            _pointer_and_strides(fields, name, x)
        return fields, _problem_fields(fields, p, device_id)

    # keep_alive: the ALiBi slopes and sequence lengths the struct points to, until the launch is queued
    record, keep_alive = _launch_record(  # noqa: F841
        p, ("forward", device_id, q.strides, k.strides, v.strides, out.strides), _instantiations.FWD_PARAMS_DTYPE,
        pointers, static_fields)
    if isinstance(kernel, _instantiations.WgmmaFwdWsKernel):
        tile = kernel.tile
        maps = record.tensor_maps(
            ("ws", tile.block_m, tile.block_n, kernel.o_box_rows, *(pointers[name] for name in "qkvo")),
            lambda fields: _tma.fwd_ws_tensor_maps(
                fields, (p.batch, p.seqlen_q, p.heads), (p.batch, p.seqlen_k, p.heads // p.kv_group), p.dtype_name,
                p.head_dim, tile.block_m, tile.block_n, kernel.o_box_rows),
            pointers)
        if maps is not None:
            n_tiles = numpy.array(kernel.n_tiles(p.batch, p.heads, p.seqlen_q), numpy.int32)
            claims = numpy.array(zeroed_counters(device_id, 1).data.ptr, numpy.uint64)
            grid = kernel.grid(p.batch, p.heads, p.seqlen_q, sm_count=_sm_count(device_id))
            _launch(kernel, device_id, grid, record.params(pointers), maps, n_tiles, claims)
            return
        kernel = _instantiations.fwd_kernel(p.dtype_name, p.head_dim, False, True, kernel.block_sparse, wgmma=True,
                                            tma=True)
        pointers["query_tile_order"] = _query_tile_order(p, kernel, device_id)
    more = ()  # flash_fwd_tc.cu's kernels also take K's and V's tensor maps (KvTensorMaps)
    if kernel.source_file == "flash_fwd_tc.cu":
        maps = None
        if getattr(kernel, "tma", False):
            block_n = kernel.tile.block_n
            maps = record.tensor_maps(
                ("kv", block_n, pointers["k"], pointers["v"]),
                lambda fields: _tma.kv_tensor_maps(fields, (p.batch, p.seqlen_k, p.heads // p.kv_group), p.dtype_name,
                                                   p.head_dim, block_n),
                pointers)
            if maps is None:
                kernel = _instantiations.without_tma(kernel)
        more = (_tma.NO_MAPS if maps is None else maps,)
    _launch(kernel, device_id, kernel.grid(p.batch, p.heads, p.seqlen_q), record.params(pointers), *more)


def _dkdv_item_order(p: _validation.AttentionProblem, kernel, ring: int, device_id: int) -> int:
    """The warp-specialised dK/dV kernel's item_order: the address of the order of its claims on
    the problem's block mask (BlockMask.dkdv_item_order), or 0 (the launch's own order). Never
    with a dQ ring: a ring slot's next slab waits for the slab before it to complete, and an
    order that started later slabs' items early could leave every block waiting."""
    if p.block_mask is None or ring:
        return 0
    block_q, block_k = p.block_mask.block_size
    t = kernel.tile
    order = p.block_mask.dkdv_item_order(p.batch, p.heads, p.kv_group, block_k // t.block_n, block_q // t.block_m,
                                         device_id)
    return 0 if order is None else order.data.ptr


def _query_tile_order(p: _validation.AttentionProblem, kernel, device_id: int) -> int:
    """FwdParams.query_tile_order for `kernel`: the address of its tiles' order on the problem's
    block mask (BlockMask.query_tile_order), or 0 (the launch's own order). The block-sparse
    warp-specialised forward reads it; the one-block-per-tile builds do not (in the d64 TMA
    build, the tile coordinates read from it made every block-sparse launch 5-7% slower on an
    H100, whatever the order; benchmarks/NOTES.md, session 45)."""
    if p.block_mask is None or not (isinstance(kernel, _instantiations.WgmmaFwdWsKernel) and kernel.block_sparse):
        return 0
    order = p.block_mask.query_tile_order(p.batch, p.heads, p.seqlen_q, kernel.tile.block_m, device_id)
    return 0 if order is None else order.data.ptr


class _LaunchRecord:
    """A launch's parameter struct with every field but its array pointers filled in, from which
    each call's struct is a copy with the call's pointers written in; and the tensor maps made for
    the pointers seen lately (a map holds its array's address). Kept in the problem's memo."""

    # A model's layers share one problem and call it with their own arrays, at addresses that the
    # memory pools give back step after step: 8 kept sets were rebuilt on every call of a loop over
    # 16 array sets (+17-19 us a forward call on an H200's host; benchmarks/NOTES.md, session 39).
    _MAPS_KEPT = 64

    def __init__(self, dtype: numpy.dtype, fields: dict, pointer_names: tuple):
        self.dtype = dtype
        self.fields = fields  # pointers as given at first: the map makers take theirs from `pointers`
        image = _params(dtype, fields)
        self.image = image.view(numpy.uint64)  # the structs are 8-byte multiples; pointers 8-aligned
        self.slots = tuple((name, dtype.fields[name][1] // 8) for name in pointer_names)
        self.maps: dict = {}

    def params(self, pointers: dict) -> numpy.ndarray:
        """The struct (a one-element record of `dtype`) with these pointers."""
        image = self.image.copy()
        for name, slot in self.slots:
            image[slot] = pointers[name]
        return image.view(self.dtype)

    def tensor_maps(self, key: tuple, make, pointers: dict):
        """make(fields)'s maps (or None) for `key`, which must hold every pointer they describe."""
        maps = self.maps.get(key, self)  # one lookup: another thread may drop the entry meanwhile
        if maps is not self:
            return maps
        maps = make({**self.fields, **pointers})
        keep_bounded(self.maps, key, maps, self._MAPS_KEPT)  # (a model of more layers: the oldest go)
        return maps


def _launch_record(p: _validation.AttentionProblem, key: tuple, dtype: numpy.dtype, pointers: dict, static_fields):
    """The problem's `_LaunchRecord` for `key` (the launch's kind, device and arrays' strides):
    from its memo, or made from static_fields() -> (fields, arrays to keep alive) and kept there.
    Problems with ALiBi slopes or sequence lengths (device arrays made per call) are not memoised.
    Returns (record, the arrays its struct points to, which must live until the launch is queued)."""
    memoised = p.alibi_slopes is None and p.cu_seqlens is None and p.seqlens_k is None
    record = p.memo.get(key) if memoised else None
    if record is not None:
        return record, None
    fields, keep_alive = static_fields()
    record = _LaunchRecord(dtype, {**fields, **pointers}, tuple(pointers))
    if memoised:
        p.memo[key] = record
    return record, keep_alive


# --------------------------------------------------------------------------- dropout


def dropout_mask(batch, heads, seqlen_q, seqlen_k, *, dropout_p, seed, offset=0, device=None):
    """The keep mask Z that attention with ``dropout_p, seed, offset`` applies: True where the
    probability P[b, h, i, j] is kept (and scaled by 1 / (1 - dropout_p)), False where dropped.

    Materialises what the kernels regenerate tile by tile, for tests and for checking a small
    problem: ``out = (softmax(S) * Z / (1 - dropout_p)) @ V`` per (batch, head). Element (i, j) of
    (b, h) depends on (seed, offset, b, h, i, j) only, not on the sequence lengths, so the mask of
    a shorter problem is a corner of a longer one's, and a variable-length batch's sequence b has
    ``dropout_mask(...)[b, :, :len_q, :len_k]``. With GQA/MQA, h is the query head.

    Parameters
    ----------
    batch, heads, seqlen_q, seqlen_k : int
        The attention problem's sizes (heads: query heads).
    dropout_p, seed, offset : as `attention`.
    device : bool, optional
        True: generated on the GPU by the kernels' own code, returned as a CuPy array; False:
        by the NumPy mirror of that generator (the same bits), returned as NumPy; None
        (default): the GPU when one is available.

    Returns
    -------
    bool array of shape (batch, heads, seqlen_q, seqlen_k).

    Example
    -------
    >>> import cupyflash
    >>> keep = cupyflash.dropout_mask(1, 2, 3, 5, dropout_p=0.25, seed=7, device=False)
    >>> keep.shape, keep.dtype
    ((1, 2, 3, 5), dtype('bool'))
    """
    sizes = [_validation.check_count(x, name) for x, name in
             ((batch, "batch"), (heads, "heads"), (seqlen_q, "seqlen_q"), (seqlen_k, "seqlen_k"))]
    if max(sizes[:2]) > _validation._MAX_GRID_YZ:
        raise ValueError(f"batch and heads must each be at most {_validation._MAX_GRID_YZ}, got {sizes[0]}, {sizes[1]}")
    dropout_p, seed, offset = _validation.check_dropout_args(dropout_p, seed, offset)
    if device is not None:
        device = _validation.check_flag(device, "device")
    on_gpu = gpu_available() if device is None else device
    if not on_gpu:
        return _dropout.keep_mask_numpy(*sizes, dropout_p, seed, offset)
    import cupy

    keep = cupy.empty(sizes, dtype=cupy.uint8)
    if keep.size:
        kernel = _instantiations.DropoutMaskKernel()
        fields = dict.fromkeys(_instantiations.FWD_PARAMS_DTYPE.names, 0)
        fields.update(o=keep.data.ptr, heads=sizes[1], seqlen_q=sizes[2], seqlen_k=sizes[3], dropout_seed=seed,
                      dropout_offset=offset, dropout_threshold=_dropout.threshold(dropout_p),
                      dropout_rescale=_dropout.rescale(dropout_p))
        params = _params(_instantiations.FWD_PARAMS_DTYPE, fields)
        _launch(kernel, keep.device.id, kernel.grid(sizes[0], sizes[1], sizes[2], sizes[3]), params)
    return keep.view(cupy.bool_)


# --------------------------------------------------------------------------- variable-length batches


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, causal=False, scale=None,
    return_lse=False, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
):
    """Attention over a batch of sequences of different lengths, packed one after the other with no
    padding (FlashAttention-2's varlen layout, as ``flash_attn_varlen_func``).

    Sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v; each attends only within itself, exactly
    as `attention` on that sequence alone would, with causal, windows and ALiBi aligned to its own
    bottom-right corner. The kernels walk each sequence's own tiles: no padding is computed.

    Parameters
    ----------
    q : array, shape (total_q, heads, head_dim)
    k, v : arrays, shape (total_k, heads_kv, head_dim)
        Arrays, dtypes, strides, GQA/MQA as `attention`.
    cu_seqlens_q, cu_seqlens_k : int32 arrays of shape (batch + 1,)
        Cumulative sequence lengths: 0, then each sequence's end, the last equal to total_q
        (total_k). int32 NumPy or CuPy arrays (a list of ints also does). They are checked (int32,
        starting at 0, non-decreasing, ending at the total); a GPU array is read back for that,
        a small synchronising copy.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence's length (at least that; default: computed from cu_seqlens).
    causal, scale, window, softcap, alibi_slopes : as `attention`, per sequence; alibi_slopes of
        shape (heads,) or (batch, heads).
    dropout_p, seed, offset : as `attention`; sequence b's mask is that of batch entry b of a
        fixed-length batch (`dropout_mask(batch, ...)[b, :, :len_q, :len_k]`).

    Returns
    -------
    out, or (out, lse)
        out (total_q, heads, head_dim) in q's dtype, and lse (heads, total_q) float32 (float64 for
        float64 inputs), in the caller's array type, as `attention`.

    Raises TypeError/ValueError as `attention`, and for bad cu_seqlens (not int32, not starting at
    0, decreasing, a last value other than the packed length, different lengths for q and k) or a
    max_seqlen below the longest sequence. Block masks are not supported with varlen.

    Example
    -------
    >>> import numpy as np, cupyflash
    >>> q = np.random.randn(3 + 5, 2, 16).astype(np.float32)  # two sequences: 3 and 5 tokens
    >>> cu = np.array([0, 3, 8], dtype=np.int32)
    >>> out = cupyflash.attention_varlen(q, q, q, cu, cu, causal=True)
    >>> np.allclose(out[:3], cupyflash.attention(q[None, :3], q[None, :3], q[None, :3], causal=True)[0], atol=1e-6)
    True
    """
    given = {"q": q, "k": k, "v": v}
    arrays, origins = _ingest_arrays(given)
    problem = _validation.check_varlen_args(
        *arrays.values(), *_ingest_cu_seqlens(cu_seqlens_q, cu_seqlens_k, origins["q"]), max_seqlen_q, max_seqlen_k,
        causal=causal, scale=scale, return_lse=return_lse, window=window, softcap=softcap,
    )
    problem = _validation.check_alibi_slopes(_ingest_slopes(alibi_slopes, origins["q"]), problem)
    problem = _validation.check_dropout(dropout_p, seed, offset, problem)
    return _run_forward(arrays, origins, problem)


def attention_varlen_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, causal=False,
    scale=None, deterministic=False, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
):
    """Gradients of `attention_varlen`: `attention_backward` for each packed sequence.

    dout and out have q's shape (total_q, heads, head_dim), lse is the forward's (heads,
    total_q); the other arguments as given to the forward, deterministic as `attention_backward`.
    Returns (dq, dk, dv) with the shapes and dtype of q, k, v, in the caller's array type.
    """
    given = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    arrays, origins = _ingest_arrays(given)
    problem = _validation.check_varlen_backward_args(
        *arrays.values(), *_ingest_cu_seqlens(cu_seqlens_q, cu_seqlens_k, origins["q"]), max_seqlen_q, max_seqlen_k,
        causal=causal, scale=scale, deterministic=deterministic, window=window, softcap=softcap,
    )
    problem = _validation.check_alibi_slopes(_ingest_slopes(alibi_slopes, origins["q"]), problem)
    problem = _validation.check_dropout(dropout_p, seed, offset, problem)
    return _run_backward(arrays, origins, problem)


def _ingest_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q_origin: _arrays.Origin) -> tuple:
    return tuple(_ingest_side_array(cu, name, q_origin)
                 for cu, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")))


# --------------------------------------------------------------------------- backward


def attention_backward(
    dout, q, k, v, out, lse, *, causal=False, scale=None, deterministic=False, window=None, softcap=None,
    alibi_slopes=None, seqlens_k=None, dropout_p=0.0, seed=None, offset=0,
):
    """Gradients of attention: FlashAttention-2's backward pass, recomputing P from the saved lse.

    Given dout = dL/d(out) for ``out, lse = attention(q, k, v, causal=..., scale=...,
    return_lse=True)``, returns ``(dq, dk, dv)`` = dL/dq, dL/dk, dL/dv. The
    ``seqlen_q x seqlen_k`` attention matrix is never stored; each tile of it is recomputed from
    q, k and lse. Extra memory is O(seqlen): two float32 vectors per (batch, head, query) and,
    unless deterministic, a float32 dq accumulator of q's size (float64 for float64 inputs).

    Parameters
    ----------
    dout, out : arrays with q's shape (batch, seqlen_q, heads, head_dim) and dtype
    q, k, v : the forward's inputs, as in `attention` (any strides with a contiguous head_dim;
        k, v with heads_kv heads for GQA/MQA)
    lse : array, shape (batch, heads, seqlen_q), float32 (float64 for float64 inputs)
        The forward's log-sum-exp; any strides.
    causal, scale, window, softcap, alibi_slopes, seqlens_k : as given to the forward (same
        bottom-right alignment; padding keys get dk = dv = 0). With a softcap, dq and dk carry its
        derivative 1 - tanh^2; the slopes get no gradient (they are constants, as in flash-attn).
    dropout_p, seed, offset : as given to the forward: the kernels regenerate its dropout mask.
    deterministic : bool
        False (default): dq is summed across key blocks with float32 atomic adds, whose order
        varies, so the last bits of dq can differ from run to run. True: dq comes from a
        second kernel, parallel over query blocks, that recomputes the score tiles and sums
        each row of dq in a fixed order; results are bitwise reproducible on one GPU. It
        costs more time (measured in benchmarks/NOTES.md) and no extra memory.

    Returns
    -------
    (dq, dk, dv) with the shapes and dtype of q, k, v, in the caller's array type (as
    `attention`). Rows that see no key get dq = 0 and contribute nothing to dk and dv. With
    GQA/MQA, dk and dv of a K/V head are summed over its group of query heads on chip (float32),
    in a fixed order: no expanded copy, and no atomics.
    Precision: every product accumulates in float32 for 16-bit and float32 inputs, float64 for
    float64; each gradient is rounded once to the input dtype. On tensor cores (16-bit inputs,
    sm_80+) P and dS are rounded to the input dtype before they enter a product, as in
    FlashAttention-2.

    Where it runs, and what raises, as for `attention`: TypeError/ValueError before any device
    work for bad arguments (dout/out not of q's shape and dtype, lse not of shape
    (batch, heads, seqlen_q) and dtype float32/float64 as above, non-boolean deterministic).
    With no GPU, NumPy inputs run through `cupyflash.reference.tiled_attention_backward`.

    Example
    -------
    >>> import numpy as np, cupyflash
    >>> q, k, v = (np.random.randn(1, 5, 2, 16).astype(np.float32) for _ in range(3))
    >>> out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    >>> dout = np.ones_like(out)
    >>> dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> dq.shape, dk.dtype
    ((1, 5, 2, 16), dtype('float32'))
    """
    return _attention_backward(
        dout, q, k, v, out, lse, causal, scale, deterministic, None, window, softcap, alibi_slopes, seqlens_k,
        (dropout_p, seed, offset),
    )


def block_sparse_attention_backward(
    dout, q, k, v, out, lse, block_mask, *, causal=False, scale=None, deterministic=False, window=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
):
    """Gradients of `block_sparse_attention`: `attention_backward` over the nonzero blocks of
    `block_mask` only (pass the mask and options the forward had). The dK/dV pass walks, per key
    block, the query blocks of its mask column; the dQ sums (atomic, or the deterministic pass
    over each mask row) likewise skip zero blocks. Keys that no query sees get dk = dv = 0; rows
    that see no key get dq = 0. Arguments, results and errors as `attention_backward`, and the
    mask as `block_sparse_attention`."""
    return _attention_backward(
        dout, q, k, v, out, lse, causal, scale, deterministic, block_mask, window, softcap, alibi_slopes, None,
        (dropout_p, seed, offset),
    )


def _attention_backward(
    dout, q, k, v, out, lse, causal, scale, deterministic, block_mask, window=None, softcap=None, alibi_slopes=None,
    seqlens_k=None, dropout=(0.0, None, 0),
):
    given = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    arrays, origins = _ingest_arrays(given)
    problem = _call_problem(
        "backward", arrays, origins, (causal, scale, deterministic, window, softcap),
        lambda: _validation.check_backward_args(*arrays.values(), causal=causal, scale=scale,
                                                deterministic=deterministic, window=window, softcap=softcap),
        block_mask, alibi_slopes, seqlens_k, dropout)
    return _run_backward(arrays, origins, problem)


def _run_backward(arrays: dict, origins: dict, problem: _validation.AttentionProblem) -> tuple:
    """The validated backward on the arrays' side (the GPU, or the CPU fallback), results exported."""
    if not origins["q"].on_gpu and not gpu_available():
        grads = _backward_cpu(*arrays.values(), problem)
    else:
        if not origins["q"].on_gpu:
            import cupy

            arrays = {name: cupy.asarray(x) for name, x in arrays.items()}
        grads = _backward_gpu(*arrays.values(), problem)
    return tuple(_arrays.export(g, origins["q"]) for g in grads)


def _backward_cpu(dout, q, k, v, out, lse, p: _validation.AttentionProblem):
    options = dict(causal=p.causal, scale=p.scale, window=p.window, **_score_mod_options(p))
    if p.cu_seqlens is not None:
        grads = reference.attention_varlen_backward(
            dout, q, k, v, *p.cu_seqlens, out=out, lse=lse, backward=reference.tiled_attention_backward, **options
        )
    elif p.seqlens_k is not None:
        grads = _per_batch_entry(lambda dout_b, q_b, out_b, lse_b, k_b, v_b, **kw: reference.tiled_attention_backward(
            dout_b, q_b, k_b, v_b, out_b, lse_b, **kw), p, (dout, q, out, lse), (k, v), key_results=(1, 2), **options)
    else:
        grads = reference.tiled_attention_backward(dout, q, k, v, out, lse, block_mask=p.block_mask, **options)
    return tuple(g.astype(q.dtype) for g in grads)


def _backward_gpu(dout, q, k, v, out, lse, p: _validation.AttentionProblem):
    import cupy

    with cupy.cuda.Device(q.device.id):
        dq = _empty(q.shape, q.dtype)
        # Padding keys (seqlens_k) are no block's to write: their gradient is 0.
        dk, dv = ((cupy.zeros if p.seqlens_k is not None else _empty)(x.shape, x.dtype) for x in (k, v))
        launch_backward(dout, q, k, v, out, lse, dq, dk, dv, p)
    return dq, dk, dv


def backward_kernels(p: _validation.AttentionProblem, device_id: int, tensor_cores=None, wgmma=None,
                     tma=None, ws=None) -> tuple:
    """The traits table's (dK/dV kernel, deterministic dQ kernel) for the problem on this device:
    the Hopper dK/dV kernel where `_uses_wgmma` allows it and it is switched on
    (`_instantiations.WGMMA_BACKWARD_BY_DEFAULT`), or with wgmma=True; that one's TMA build where
    it has one and the dQ sums are atomic, unless tma=False or CUPYFLASH_HOPPER_TMA=0
    (`_instantiations.TMA_BACKWARD_BY_DEFAULT`); that build's warp-specialised form with ws=True,
    or by default (ws=None) for block masks up to `_instantiations.WS_BACKWARD_MAX_DENSITY`
    and for unmasked problems up to `_instantiations.WS_BACKWARD_UNMASKED_MAX_SEQLEN_Q` queries
    (`_instantiations.WS_BACKWARD_BY_DEFAULT`, CUPYFLASH_HOPPER_WS_BWD: 1 every problem, 0 none)."""
    if tensor_cores is None:
        tensor_cores = tensor_cores_for(p, device_id)
    if wgmma is None:
        wgmma = tensor_cores and _instantiations.WGMMA_BACKWARD_BY_DEFAULT and _uses_wgmma(p, device_id)
    if tma is None:
        tma = _instantiations.TMA_BACKWARD_BY_DEFAULT
    if ws is None:
        ws = _instantiations.WS_BACKWARD_BY_DEFAULT
    if ws is None:
        d = _instantiations.padded_head_dim(p.head_dim)
        if p.block_mask is None:
            ws = p.seqlen_q <= _instantiations.WS_BACKWARD_UNMASKED_MAX_SEQLEN_Q.get(d, 0)
        else:
            ws = p.block_mask.density <= _instantiations.WS_BACKWARD_MAX_DENSITY.get(d, 0.0)
    return _instantiations.bwd_kernels(
        p.dtype_name, p.head_dim, p.local, tensor_cores, large_shared_memory(device_id), p.block_mask is not None,
        p.modified, p.varlen, wgmma, wgmma and tma and not p.deterministic, ws,
    )


def launch_backward(
    dout, q, k, v, out, lse, dq, dk, dv, p: _validation.AttentionProblem, tensor_cores=None, kernels=None, wgmma=None
) -> None:
    """Launches the backward kernels on CuPy's current stream, writing dq, dk, dv (any strides,
    head_dim contiguous); arrays must already be validated. tensor_cores and wgmma as in
    `backward_kernels`; `kernels` (dK/dV kernel, dQ kernel) overrides the traits table's pair (for tuning).
    A TMA build of the dK/dV kernel becomes its twin without TMA (cp.async loads, atomic dQ adds)
    where the dQ workspace, Q or dO has no tensor map (_tma.py), and in deterministic mode (no
    workspace)."""
    import cupy

    if p.batch == 0 or p.heads == 0:  # nothing to launch over
        return
    device_id = q.device.id
    accum = _validation.lse_dtype(p.dtype_name)  # the kernels' accumulator type
    lse_log2 = cupy.empty(p.heads * p.total_q, accum)  # row statistics, as _row_statistics_strides
    d = cupy.empty(p.heads * p.total_q, accum)
    dkdv_kernel, dq_kernel = kernels or backward_kernels(p, device_id, tensor_cores, wgmma)

    def launch_seqlen_k(kernel) -> int:
        if p.block_mask is not None and isinstance(kernel, (_instantiations.BwdDkdvKernel,
                                                            _instantiations.TcBwdDkdvKernel)):
            # These take the mask's key blocks in its key_order, whole (flash_bwd.cuh, key_tile):
            # the launch covers the last block's tiles past seqlen_k, which return at once.
            block_k = p.block_mask.block_size[1]
            return -(-p.seqlen_k // block_k) * block_k
        return p.seqlen_k

    kv_heads = p.heads // p.kv_group
    # The warp-specialised dK/dV kernel at WS_DQ_RING_HEAD_DIMS, where the mask is dense enough
    # (takes_ring), adds dQ into a ring of a few (K/V head, batch) slabs, zero at launch and at its
    # exit (so kept per stream: `zeroed`), and rounds dq itself (flash_bwd_tc.cu, wait_for_slot).
    # The others add into the whole workspace, which the preprocess clears (it reads its rows
    # anyway) and the conversion rounds.
    ws = getattr(dkdv_kernel, "ws", False) and not p.deterministic and p.cu_seqlens is None
    ring = 0
    if ws:  # its launch: the key-tile positions and grid
        ws_seqlen_k = launch_seqlen_k(dkdv_kernel)
        ws_positions = dkdv_kernel.positions(ws_seqlen_k)
        ws_grid = dkdv_kernel.grid(p.batch, kv_heads, p.seqlen_q, ws_seqlen_k, sm_count=_sm_count(device_id))
        density = 1.0 if p.block_mask is None else p.block_mask.density
        if ws_grid[0] and p.seqlen_q and dkdv_kernel.takes_ring(density, p.seqlen_q):
            ring = dkdv_kernel.ring_slabs(p.batch * kv_heads, ws_positions, ws_grid[0],
                                          p.kv_group * p.seqlen_q * p.head_dim * accum.itemsize)
    if ring:
        elements = p.seqlen_q * ring * p.kv_group * p.head_dim  # (query, slot, head of the group, head dim)
        if elements * accum.itemsize <= RING_KEPT_BYTES:
            dq_accum = zeroed("dq ring", device_id, elements, accum)
        else:
            dq_accum = cupy.zeros(elements, accum)
    else:
        dq_accum = None if p.deterministic else cupy.empty((p.total_q, p.heads, p.head_dim), accum)

    pointers = {"lse": lse.data.ptr, "lse_log2": lse_log2.data.ptr, "d": d.data.ptr,
                "dq_accum": 0 if dq_accum is None else dq_accum.data.ptr}
    named = (("q", q), ("k", k), ("v", v), ("o", out), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv))
    pointers.update((name, x.data.ptr) for name, x in named)

    def static_fields():
        fields = {"scale": p.scale}
        for name, x in named:
            _pointer_and_strides(fields, name, x)
        lse_strides = [stride // lse.dtype.itemsize for stride in lse.strides]
        if p.cu_seqlens is not None:  # (heads, total_q): a sequence's first row stands for its batch index
            lse_strides = [lse_strides[1], lse_strides[0], lse_strides[1]]
        for name, stride in zip(("batch", "head", "row"), lse_strides):
            fields[f"lse_{name}_stride"] = stride
        fields["stats_batch_stride"], fields["stats_head_stride"] = _row_statistics_strides(p)
        rows_per_batch = 1 if p.cu_seqlens is not None else p.seqlen_q
        fields["dq_accum_batch_stride"] = rows_per_batch * p.heads * p.head_dim
        return fields, _problem_fields(fields, p, device_id)

    # keep_alive: the ALiBi slopes and sequence lengths the struct points to, until the launches are queued
    record, keep_alive = _launch_record(  # noqa: F841
        p, ("backward", device_id, lse.strides, *(x.strides for _, x in named)), _instantiations.BWD_PARAMS_DTYPE,
        pointers, static_fields)
    params = record.params(pointers)

    def launch(kernel, params):
        seqlen_k = launch_seqlen_k(kernel)
        heads = kv_heads if kernel.per_kv_head else p.heads
        if kernel.grid(p.batch, heads, p.seqlen_q, seqlen_k)[0] == 0:  # seqlen_q == 0 or seqlen_k == 0
            return  # leaves some kernels nothing to do
        more = ()  # flash_bwd_tc.cu's dK/dV kernels also take the TMA builds' tensor maps (BwdTensorMaps)
        if isinstance(kernel, _instantiations.TcBwdDkdvKernel):
            maps = None
            if getattr(kernel, "tma", False):
                if dq_accum is not None and p.cu_seqlens is None:
                    maps = bwd_maps(kernel)
                if maps is None:
                    kernel = _instantiations.without_tma(kernel)
            more = (_tma.NO_BWD_MAPS if maps is None else maps,)
        _launch(kernel, device_id, kernel.grid(p.batch, heads, p.seqlen_q, seqlen_k), params, *more)

    def bwd_maps(kernel, ring=0):
        block_m = kernel.tile.block_m
        dq_dims = (1, p.seqlen_q, ring * p.kv_group) if ring else None
        return record.tensor_maps(
            ("dq q dout", block_m, dq_dims, pointers["dq_accum"], pointers["q"], pointers["dout"]),
            lambda fields: _tma.bwd_tensor_maps(fields, fields["dq_accum"], (p.batch, p.seqlen_q, p.heads),
                                                p.dtype_name, p.head_dim, block_m, dq_dims),
            pointers)

    if ws:  # the warp-specialised kernel's maps: Q's, dO's and the workspace's or ring's, then K's and V's
        block_n = dkdv_kernel.tile.block_n
        maps = bwd_maps(dkdv_kernel, ring)
        kv_maps = None if maps is None else record.tensor_maps(
            ("k v", block_n, kv_heads, pointers["k"], pointers["v"]),
            lambda fields: _tma.kv_tensor_maps(fields, (p.batch, p.seqlen_k, kv_heads), p.dtype_name, p.head_dim,
                                               block_n),
            pointers)
        if kv_maps is None:  # the one-block build then, with the whole workspace
            ws, dkdv_kernel = False, dataclasses.replace(dkdv_kernel, ws=False)
            if ring:
                ring, dq_accum = 0, cupy.empty((p.total_q, p.heads, p.head_dim), accum)
                pointers["dq_accum"] = dq_accum.data.ptr
                params = record.params(pointers)
    elif getattr(dkdv_kernel, "ws", False):  # (deterministic or varlen: the one-block build's paths)
        dkdv_kernel = dataclasses.replace(dkdv_kernel, ws=False)
    keep_if_captured(lse_log2, d, dq_accum)  # the workspaces, which a graph's replays use

    launch(_instantiations.bwd_row_kernel("preprocess", p.dtype_name, p.seqlen_q),
           record.params({**pointers, "dq_accum": 0}) if ring else params)  # (no clear: the ring is zero)
    if not ws:
        launch(dkdv_kernel, params)
    elif ws_grid[0]:  # (no keys: nothing to launch)
        counters = zeroed_counters(device_id, dkdv_kernel.counters(kv_heads, p.batch))
        _launch(dkdv_kernel, device_id, ws_grid, params, maps, kv_maps, numpy.array(ws_positions, numpy.int32),
                numpy.array(ws_positions * kv_heads * p.batch, numpy.int32),
                numpy.array(counters.data.ptr, numpy.uint64), numpy.array(ring, numpy.int32),
                numpy.array(_dkdv_item_order(p, dkdv_kernel, ring, device_id), numpy.uint64))
    if not ring:
        launch(dq_kernel if p.deterministic else _instantiations.bwd_row_kernel("convert_dq", p.dtype_name, p.seqlen_q),
               params)
