"""KV-cache decoding: attention of a few new queries against a long key/value cache (flash-decoding)."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys

import numpy

from cupyflash import _arrays, _attention, _instantiations, _validation, reference


def attention_decode(
    q, k_cache, v_cache, cache_seqlens=None, *, k_new=None, v_new=None, causal=False, window=None, scale=None,
    return_lse=False, num_splits=None, softcap=None, alibi_slopes=None,
):
    """Attention for autoregressive decoding: q's few new positions against a key/value cache.

    For each sequence b the keys are the first ``cache_seqlens[b]`` rows of the cache, followed by
    ``k_new[b]`` (written into the cache in place first, as flash-attn's
    ``flash_attn_with_kvcache`` does). The result equals
    ``attention(q[b:b+1], k[b:b+1, :n], v[b:b+1, :n], causal=..., window=...)`` with
    ``n = cache_seqlens[b] + seqlen_new``, for every b at once. The key sequence is split over
    thread blocks (split-KV) and the partial results merged through their log-sum-exp (by the last
    block of each group, in the same launch), so a single query row still uses the whole GPU; the
    query heads of a GQA group share each K/V tile read. A call captured into a CUDA graph keeps
    its workspace for the graph's replays; the caller keeps the arrays it returns, and passes
    cache_seqlens (and alibi_slopes) as GPU arrays, which host values would not be during replays.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads, head_dim)
        The new queries, usually 1 to 16 positions per sequence (any number works).
    k_cache, v_cache : arrays, shape (batch, cache_len, heads_kv, head_dim)
        heads_kv divides heads (GQA/MQA), as in `attention`. Rows past a sequence's length are
        never read (they may hold anything, NaN included).
    cache_seqlens : None, int, or integer array of shape (batch,)
        Valid keys per sequence before the append; None: the whole cache (cache_len keys).
        Host values (int, list, NumPy) are checked to leave room for k_new; a GPU array is used as
        given, without reading it back (which would stall each step): its values must lie in
        [0, cache_len - seqlen_new] (out-of-range ones are clamped to the cache, never read or
        written outside it). cache_seqlens is not updated: add seqlen_new yourself.
    k_new, v_new : arrays, shape (batch, seqlen_new, heads_kv, head_dim), optional
        Keys and values of the new positions, copied into the caches at rows
        ``cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1`` before attending; requires
        cache_seqlens. NumPy caches are written on the host; JAX arrays (immutable) are refused.
    causal, window : as `attention`, aligned bottom-right per sequence: query i of sequence b sits
        at key position ``n - seqlen_q + i``. With causal=True and seqlen_q = seqlen_new, each new
        query sees the cache and the new keys up to its own.
    scale, return_lse : as `attention`.
    softcap, alibi_slopes : as `attention`, with each query at its own position ``n - seqlen_q + i``
        (ALiBi's distance to key j is ``|n - seqlen_q + i - j|``).
    num_splits : int, optional
        Thread blocks along the keys of each (sequence, K/V head), 1 to 128; None (default) picks
        enough to fill the GPU.

    Returns
    -------
    out, or (out, lse), as `attention`: out (batch, seqlen_q, heads, head_dim) in q's dtype, lse
    (batch, heads, seqlen_q) float32 (float64 for float64). A sequence with no key gives out 0,
    lse -inf. Forward only: decoding has no backward.

    Where it runs and what raises: as `attention`. With no GPU, NumPy inputs run through the tiled
    NumPy fallback, one sequence at a time.

    Example
    -------
    >>> import numpy as np, cupyflash
    >>> k_cache = np.zeros((2, 64, 1, 16), np.float32); v_cache = np.zeros_like(k_cache)
    >>> lengths = np.array([10, 3], np.int32)  # keys already cached per sequence
    >>> q = np.random.randn(2, 1, 4, 16).astype(np.float32)  # one new token, 4 query heads (MQA)
    >>> k_new, v_new = (np.random.randn(2, 1, 1, 16).astype(np.float32) for _ in range(2))
    >>> out = cupyflash.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, causal=True)
    >>> out.shape, bool((k_cache[0, 10] == k_new[0, 0]).all())
    ((2, 1, 4, 16), True)
    """
    options = (causal, window, scale, return_lse, num_splits, softcap)
    # With ALiBi slopes (an array), every call is checked in full.
    key = None if alibi_slopes is not None else _step_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, options)
    problem = _checked_steps.get(key) if key is not None else None
    if problem is not None:  # a decoding loop's next step: the same arguments but for the data
        out, lse = _decode_gpu(q, k_cache, v_cache, k_new, v_new, cache_seqlens, problem)
        return (out, lse) if problem.attention.return_lse else out

    given = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if k_new is not None:
        given["k_new"] = k_new
    if v_new is not None:
        given["v_new"] = v_new
    origins = {name: _arrays.classify(x, name) for name, x in given.items()}
    _arrays.check_placement(origins)
    arrays = {name: _arrays.ingest(x, origins[name], name) for name, x in given.items()}
    immutable = any(origins[name].module in ("jax", "jaxlib") for name in ("k_cache", "v_cache"))
    lengths = cache_seqlens
    if hasattr(lengths, "__dlpack__"):  # an array of any framework (ints and lists are checked below)
        origin = _arrays.classify(lengths, "cache_seqlens")
        # Host lengths go with any inputs (checked, then copied); device lengths must be q's device.
        if origin.on_gpu and (not origins["q"].on_gpu or origin.device_id != origins["q"].device_id):
            raise ValueError("cache_seqlens on the GPU must be on q's device (or pass a host int, list or NumPy array)")
        lengths = _arrays.ingest(lengths, origin, "cache_seqlens")
    problem = _validation.check_decode_args(
        arrays["q"], arrays["k_cache"], arrays["v_cache"], lengths, arrays.get("k_new"), arrays.get("v_new"),
        causal=causal, scale=scale, return_lse=return_lse, window=window, num_splits=num_splits,
        immutable_caches=immutable, softcap=softcap,
    )
    if alibi_slopes is not None:
        slopes = _attention._ingest_slopes(alibi_slopes, origins["q"])
        problem = dataclasses.replace(problem, attention=_validation.check_alibi_slopes(slopes, problem.attention))
    q_, k_, v_ = arrays["q"], arrays["k_cache"], arrays["v_cache"]
    k_new_, v_new_ = arrays.get("k_new"), arrays.get("v_new")
    lengths = problem.cache_seqlens

    if not origins["q"].on_gpu:
        if problem.seqlen_new:  # host caches are appended to on the host, where they live
            for b, n in enumerate(lengths):
                k_[b, n : n + problem.seqlen_new] = k_new_[b]
                v_[b, n : n + problem.seqlen_new] = v_new_[b]
            lengths = lengths + problem.seqlen_new
            problem = _validation.DecodeProblem(problem.attention, 0, lengths, problem.num_splits)
        if not _attention.gpu_available():
            out, lse = _decode_cpu(q_, k_, v_, problem)
        else:
            import cupy

            q_, k_, v_ = (cupy.asarray(x) for x in (q_, k_, v_))
            out, lse = _decode_gpu(q_, k_, v_, None, None, lengths, problem)
    else:
        out, lse = _decode_gpu(q_, k_, v_, k_new_, v_new_, lengths, problem)
        if key is not None:
            # (each step brings its own lengths)
            _attention.keep_bounded(_checked_steps, key, dataclasses.replace(problem, cache_seqlens=None),
                                    _MAX_CHECKED_STEPS)

    origin = origins["q"]
    out = _arrays.export(out, origin)
    return (out, _arrays.export(lse, origin)) if problem.attention.return_lse else out


# Decoding calls the same shapes step after step, and the checks (with the framework import
# around them) cost ~40% of a step's host path (H100 host: 145 -> 81 us per call without them). Checks read only what `_step_key` records of CuPy arguments (shapes, strides, dtypes,
# devices, options; device lengths' values are never read), so a call whose key passed them once
# passes them again. Keys of other inputs (host lengths, whose values are checked; other
# frameworks; unhashable options) are None: those calls are checked every time.
_checked_steps: dict = {}
_MAX_CHECKED_STEPS = 64


def _step_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, options):
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    arrays = (q, k_cache, v_cache, cache_seqlens, k_new, v_new)
    if any(x is not None and type(x) is not cupy.ndarray for x in arrays) or cache_seqlens is None and k_new is not None:
        return None
    if cache_seqlens is not None and (cache_seqlens.dtype != numpy.int32 or not cache_seqlens.flags.c_contiguous):
        return None  # the checks convert these: the kernels read int32 lengths one after the other
    try:
        options = _attention.option_key(options)  # (types: causal=1 is refused where True is not)
    except TypeError:  # e.g. a window given as a list
        return None
    return tuple(None if x is None else (x.shape, x.strides, x.dtype, x.device.id) for x in arrays) + options


def _decode_cpu(q, k, v, d: _validation.DecodeProblem):
    """The tiled NumPy algorithm, one sequence at a time over its valid keys."""
    p = d.attention
    out = numpy.zeros(q.shape, q.dtype)
    lse = numpy.full((p.batch, p.heads, p.seqlen_q), -numpy.inf, _validation.lse_dtype(p.dtype_name))
    slopes = None if p.alibi_slopes is None else reference._as_float64(p.alibi_slopes)
    for b in range(p.batch):
        n = p.seqlen_k if d.cache_seqlens is None else int(d.cache_seqlens[b])
        o, l = reference.tiled_attention(
            q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], causal=p.causal, scale=p.scale, return_lse=True,
            window=p.window, softcap=p.softcap, alibi_slopes=None if slopes is None else slopes[b % slopes.shape[0]],
        )
        out[b], lse[b] = o[0], l[0]
    return out, lse


def decode_kernel(p: _validation.AttentionProblem, device_id: int, tensor_cores=None):
    """The traits table's decode kernel: the tensor-core one for 16-bit inputs on sm_80+."""
    if tensor_cores is None:
        tensor_cores = _attention.tensor_cores_for(p, device_id)
    return _instantiations.decode_kernel(p.dtype_name, p.head_dim, tensor_cores, p.score_mod)


@functools.cache
def _device_slots(device_id: int, kernel) -> int:
    """Blocks of a decode kernel worth running at once on the device (one wave): one per SM for the
    tensor-core kernel, whose cp.async ring keeps an SM's share of the bandwidth busy by itself (a
    second block adds only its fixed costs: one sequence, 8 K/V heads, 8192 keys took 14.3 us in 16
    splits, one block per SM, and 15.8 in 32, two; benchmarks/NOTES.md); for the CUDA-core kernel,
    whose warps wait on their own loads, as many as shared memory allows, up to 4."""
    import cupy

    attributes = cupy.cuda.Device(device_id).attributes
    if isinstance(kernel, _instantiations.TcDecodeKernel):
        return attributes["MultiProcessorCount"]
    per_sm = attributes["MaxSharedMemoryPerMultiprocessor"] // max(kernel.smem_bytes + 1024, 1)
    return attributes["MultiProcessorCount"] * max(1, min(per_sm, 4))


def choose_splits(blocks: int, key_tiles: int, slots: int) -> int:
    """Splits of the key sequence for `blocks` (row block, K/V head, sequence) triples of
    `key_tiles` tiles each on a GPU running `slots` blocks at once: no split when the blocks already
    fill most of a wave; otherwise the fewest splits whose critical path, waves of blocks times the
    tiles of the longest split, is within 5% of the shortest (each split costs a block's fixed work,
    which the path leaves out: 49 splits of 1024 tiles in 3 waves of 132 give 63 tile-times, 16 in
    one wave 64), each split keeping at least 4 tiles. (The first form, after flash-attn's
    heuristic, took the fewest splits whose last wave was within 5% as full as the best count's: 31
    splits of 128 tiles, some of 5 tiles, where 32 give 4 and ran 19.8 us against 23.1 for one
    sequence with 8 K/V heads and 8192 keys; benchmarks/NOTES.md.)"""
    if blocks >= 0.8 * slots or key_tiles < 8:
        return 1
    limit = min(_instantiations.DECODE_MAX_SPLITS, key_tiles // 4, math.ceil(4 * slots / blocks))

    def critical_path(splits):
        return math.ceil(blocks * splits / slots) * math.ceil(key_tiles / splits)

    paths = {s: critical_path(s) for s in range(1, limit + 1)}
    shortest = min(paths.values())
    return min(s for s, path in paths.items() if path <= 1.05 * shortest)


def _decode_gpu(q, k, v, k_new, v_new, lengths, d: _validation.DecodeProblem):
    import cupy

    p = d.attention
    with cupy.cuda.Device(q.device.id):
        if isinstance(lengths, numpy.ndarray):  # host values, already checked
            lengths = cupy.asarray(lengths)
        out = _attention._empty((p.batch, p.seqlen_q, p.heads, p.head_dim), q.dtype)
        lse = _attention._empty((p.batch, p.heads, p.seqlen_q), _validation.lse_dtype(p.dtype_name))
        launch_decode(q, k, v, k_new, v_new, lengths, out, lse, d)
    return out, lse


@functools.cache
def _plan(kernel, batch: int, heads_kv: int, rows: int, cache_len: int, num_splits, device_id: int) -> tuple:
    """(row blocks, splits) of a launch, memoised: decoding calls the same shapes step after step."""
    row_blocks = math.ceil(rows / kernel.rows)
    if num_splits is None:  # device lengths are not read back: the cache's capacity bounds the keys
        slots = _device_slots(device_id, kernel)
        num_splits = choose_splits(batch * heads_kv * row_blocks, math.ceil(cache_len / kernel.block_n), slots)
    return row_blocks, num_splits


def launch_decode(q, k, v, k_new, v_new, lengths, out, lse, d: _validation.DecodeProblem, kernel=None) -> None:
    """Launches the append (with new keys) and decode kernels on CuPy's current stream; arguments
    must already be validated. `kernel` overrides the traits table's decode kernel."""
    import cupy

    p = d.attention
    device_id = q.device.id
    kernel = kernel or decode_kernel(p, device_id)
    heads_kv = p.heads // p.kv_group
    rows = p.seqlen_q * p.kv_group
    row_blocks, splits = _plan(kernel, p.batch, heads_kv, rows, p.seqlen_k, d.num_splits, device_id)

    fields = {"lse": lse.data.ptr, "cache_seqlens": 0 if lengths is None else lengths.data.ptr}
    for name, x in (("q", q), ("k", k), ("v", v), ("k_new", k_new), ("v_new", v_new), ("o", out)):
        if x is None:
            fields.update({name: 0, f"{name}_batch_stride": 0, f"{name}_row_stride": 0, f"{name}_head_stride": 0})
        else:
            _attention._pointer_and_strides(fields, name, x)
    fields["o_partial"] = fields["lse_partial"] = fields["split_counters"] = 0
    if splits > 1 and out.size:
        # o_partial [splits, batch, heads, seqlen_q, padded head_dim], then lse_partial: one allocation
        partial_rows = splits * p.batch * p.heads * p.seqlen_q
        workspace = cupy.empty(partial_rows * (kernel.head_dim + 1), _validation.lse_dtype(p.dtype_name))
        fields["o_partial"] = workspace.data.ptr
        fields["lse_partial"] = workspace.data.ptr + partial_rows * kernel.head_dim * workspace.itemsize
        # Counters of the splits done per row group (decode_combine_splits), left zeroed.
        counters = _attention.zeroed_counters(device_id, p.batch * heads_kv * row_blocks)
        fields["split_counters"] = counters.data.ptr
        _attention.keep_if_captured(workspace)
    left, right = p.band
    fields.update(
        batch=p.batch, heads=p.heads, kv_group=p.kv_group, seqlen_q=p.seqlen_q, cache_len=p.seqlen_k,
        seqlen_new=d.seqlen_new, head_dim=p.head_dim, num_splits=splits, rows=rows,
        # Unbounded sides clamped to widths that hide nothing (the kernels' int arithmetic stays small).
        window_left=p.seqlen_k if left is None else min(left, p.seqlen_k),
        window_right=p.seqlen_q if right is None else min(right, p.seqlen_q),
        scale_log2=p.scale * reference.LOG2E,
        softcap_log2=0.0 if p.softcap is None else p.softcap * reference.LOG2E,
    )
    slopes = _attention._slopes_fields(fields, p)  # noqa: F841 - alive until the launches are queued
    params = _attention._params(_instantiations.DECODE_PARAMS_DTYPE, fields)

    if d.seqlen_new and p.batch and heads_kv:
        append = _instantiations.DecodeAppendKernel(p.dtype_name)
        _attention._launch(append, device_id, (d.seqlen_new, heads_kv, p.batch), params)
    if out.size == 0:
        return
    _attention._launch(kernel, device_id, (row_blocks * splits * heads_kv, p.batch, 1), params)
