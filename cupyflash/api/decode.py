"""`attention_decode`: attention of a few new queries against a long key/value cache
(flash-decoding)."""

from __future__ import annotations

import dataclasses
import sys

import numpy

from cupyflash import validation
from cupyflash.api import common
from cupyflash.cpu import fallback
from cupyflash.dispatch.decode import plan_decode
from cupyflash.frameworks import arrays as frameworks
from cupyflash.problem import DecodeProblem, lse_dtype
from cupyflash.runtime import device as devices
from cupyflash.runtime import launch, workspace


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
    problem = CHECKED_STEPS.get(key) if key is not None else None
    if problem is not None:  # a decoding loop's next step: the same arguments but for the data
        out, lse = _decode_gpu(q, k_cache, v_cache, k_new, v_new, cache_seqlens, problem)
        return (out, lse) if problem.attention.return_lse else out

    given = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if k_new is not None:
        given["k_new"] = k_new
    if v_new is not None:
        given["v_new"] = v_new
    arrays, origins = common.ingest(given)
    immutable = any(origins[name].module in ("jax", "jaxlib") for name in ("k_cache", "v_cache"))
    lengths = cache_seqlens
    if hasattr(lengths, "__dlpack__"):  # an array of any framework (ints and lists are checked below)
        origin = frameworks.classify(lengths, "cache_seqlens")
        # Host lengths go with any inputs (checked, then copied); device lengths must be q's device.
        if origin.on_gpu and (not origins["q"].on_gpu or origin.device_id != origins["q"].device_id):
            raise ValueError("cache_seqlens on the GPU must be on q's device (or pass a host int, list or NumPy array)")
        lengths = frameworks.ingest(lengths, origin, "cache_seqlens")
    problem = validation.check_decode_args(
        arrays["q"], arrays["k_cache"], arrays["v_cache"], lengths, arrays.get("k_new"), arrays.get("v_new"),
        causal=causal, scale=scale, return_lse=return_lse, window=window, num_splits=num_splits,
        immutable_caches=immutable, softcap=softcap,
    )
    if alibi_slopes is not None:
        slopes = common.ingest_slopes(alibi_slopes, origins["q"])
        problem = dataclasses.replace(problem, attention=validation.check_alibi_slopes(slopes, problem.attention))
    q_, k_, v_ = arrays["q"], arrays["k_cache"], arrays["v_cache"]
    k_new_, v_new_ = arrays.get("k_new"), arrays.get("v_new")
    lengths = problem.cache_seqlens

    if not origins["q"].on_gpu:
        if problem.seqlen_new:  # host caches are appended to on the host, where they live
            for b, n in enumerate(lengths):
                k_[b, n : n + problem.seqlen_new] = k_new_[b]
                v_[b, n : n + problem.seqlen_new] = v_new_[b]
            lengths = lengths + problem.seqlen_new
            problem = DecodeProblem(problem.attention, 0, lengths, problem.num_splits)
        if not devices.gpu_available():
            out, lse = fallback.decode(q_, k_, v_, problem)
        else:
            import cupy

            q_, k_, v_ = (cupy.asarray(x) for x in (q_, k_, v_))
            out, lse = _decode_gpu(q_, k_, v_, None, None, lengths, problem)
    else:
        out, lse = _decode_gpu(q_, k_, v_, k_new_, v_new_, lengths, problem)
        if key is not None:
            # (each step brings its own lengths)
            workspace.keep_bounded(CHECKED_STEPS, key, dataclasses.replace(problem, cache_seqlens=None),
                                   MAX_CHECKED_STEPS)

    origin = origins["q"]
    out = frameworks.export(out, origin)
    return (out, frameworks.export(lse, origin)) if problem.attention.return_lse else out


# Decoding calls the same shapes step after step, and the checks (with the framework import around
# them) cost ~40% of a step's host path (H100 host: 145 -> 81 us per call without them). Checks
# read only what `_step_key` records of CuPy arguments (shapes, strides, dtypes, devices, options;
# device lengths' values are never read), so a call whose key passed them once passes them again.
# Keys of other inputs (host lengths, whose values are checked; other frameworks; unhashable
# options) are None: those calls are checked every time.
CHECKED_STEPS: dict = {}
MAX_CHECKED_STEPS = 64


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
        options = common.option_key(options)  # (types: causal=1 is refused where True is not)
    except TypeError:  # e.g. a window given as a list
        return None
    return tuple(None if x is None else (x.shape, x.strides, x.dtype, x.device.id) for x in arrays) + options


def _decode_gpu(q, k, v, k_new, v_new, lengths, d: DecodeProblem):
    import cupy

    p = d.attention
    with cupy.cuda.Device(q.device.id):
        if isinstance(lengths, numpy.ndarray):  # host values, already checked
            lengths = cupy.asarray(lengths)
        out = common.empty((p.batch, p.seqlen_q, p.heads, p.head_dim), q.dtype)
        lse = common.empty((p.batch, p.heads, p.seqlen_q), lse_dtype(p.dtype_name))
        launch.run(plan_decode(d, q, k, v, k_new, v_new, lengths, out, lse))
    return out, lse
