"""Checks of user input: the one place that raises TypeError/ValueError for bad arguments.

Every check runs before any kernel launch or device copy and reads only shapes, dtypes, strides
and placement, so the inputs are left untouched whatever is raised. Pure: it knows the library's
limits (catalog/tiles.py) but not which kernel will run; a block mask's checks are BlockMask's own.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import re

import numpy

from cupyflash.catalog.tiles import DECODE_MAX_SPLITS, MAX_HEAD_DIM
from cupyflash.problem import AttentionProblem, DecodeProblem, lse_dtype

try:  # bfloat16 arrays in NumPy and CuPy are ml_dtypes' bfloat16
    import ml_dtypes

    BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

_SUPPORTED = "float16, bfloat16 (ml_dtypes), float32 or float64"
# Grid limits of the forward launch (heads on grid.y, batch on grid.z) and int32 sequence indices.
MAX_GRID_YZ = 65535
MAX_SEQLEN = 2**31 - 1024


def dtype_name(dtype, arg: str) -> str:
    """The supported dtype's name ('float16', 'bfloat16', 'float32', 'float64') or a TypeError."""
    dtype = numpy.dtype(dtype)
    if BFLOAT16 is not None and dtype == BFLOAT16:
        return "bfloat16"
    if dtype in (numpy.float16, numpy.float32, numpy.float64):
        return dtype.name
    if dtype.kind == "V":
        raise TypeError(
            f"{arg} has the void dtype {dtype.str!r}: a bfloat16 tensor passed through "
            f"__cuda_array_interface__ (e.g. cupy.asarray(torch_tensor)) arrives like this. Pass the "
            f"tensor itself (cupyflash imports it through DLPack) or use {_SUPPORTED}."
        )
    raise TypeError(f"{arg} must have dtype {_SUPPORTED}, got {dtype}")


def check_attention_args(q, k, v, *, causal, scale, return_lse, window=None, softcap=None) -> AttentionProblem:
    """Validates q, k, v (NumPy or CuPy arrays, already on one side) and the options. k and v may
    have fewer heads than q (GQA/MQA) when their number divides q's. ALiBi slopes are checked
    apart (`check_alibi_slopes`), as they may live elsewhere."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            seq = "seqlen_q" if name == "q" else "seqlen_k"
            raise ValueError(
                f"{name} must have 4 dimensions (batch, {seq}, heads, head_dim), got shape {tuple(x.shape)}"
            )
    name_q = dtype_name(q.dtype, "q")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            dtype_name(x.dtype, name)  # an unsupported dtype is named as such first
            raise TypeError(f"q, k and v must have the same dtype; q is {q.dtype}, {name} is {x.dtype}")

    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (the last axis of q) must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    heads_kv = k.shape[2]
    for name, x in (("k", k), ("v", v)):
        b, s, h, d = x.shape
        if (b, d) != (batch, head_dim) or (h == 0) != (heads == 0) or (h and heads % h):
            raise ValueError(
                f"{name} must have shape (batch={batch}, seqlen_k, heads_kv, head_dim={head_dim}) with heads_kv "
                f"dividing q's {heads} heads (GQA/MQA; heads_kv = {heads} for multi-head attention) to match "
                f"q {tuple(q.shape)}, got {tuple(x.shape)}"
            )
    if tuple(v.shape[1:3]) != (seqlen_k, heads_kv):
        raise ValueError(
            f"k and v must have the same seqlen_k and heads (axes 1 and 2), got k {tuple(k.shape)} and v "
            f"{tuple(v.shape)}"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_strides(x, name)
    if heads > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise ValueError(f"batch and heads must each be at most {MAX_GRID_YZ}, got batch={batch}, heads={heads}")
    if max(seqlen_q, seqlen_k) > MAX_SEQLEN:
        raise ValueError(f"seqlen_q and seqlen_k must be at most {MAX_SEQLEN}, got {seqlen_q} and {seqlen_k}")
    causal = check_flag(causal, "causal")
    window = check_window(window)
    softcap = check_softcap(softcap)
    if (causal or window is not None or softcap is not None) and seqlen_q + seqlen_k > MAX_SEQLEN:
        # The kernels' band arithmetic (i + seqlen_k - seqlen_q + right) is in int32.
        raise ValueError(
            f"with causal, a window or a softcap, seqlen_q + seqlen_k must be at most {MAX_SEQLEN}, got "
            f"{seqlen_q + seqlen_k}"
        )

    return AttentionProblem(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads=heads,
        head_dim=head_dim,
        dtype_name=name_q,
        causal=causal,
        scale=check_scale(scale, head_dim),
        return_lse=check_flag(return_lse, "return_lse"),
        heads_kv=heads_kv,
        window=window,
        softcap=softcap,
    )


def check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, scale, return_lse,
                      window=None, softcap=None) -> AttentionProblem:
    """Validates attention_varlen's packed q (total_q, heads, head_dim), k, v (total_k, heads_kv,
    head_dim) and cumulative sequence lengths (`check_cu_seqlens`). The problem is the padded one
    (batch = sequences, seqlen_* = max_seqlen_*) with its cu_seqlens."""
    for name, x, total in (("q", q, "total_q"), ("k", k, "total_k"), ("v", v, "total_k")):
        if x.ndim != 3:
            raise ValueError(
                f"{name} must have 3 dimensions ({total}, heads, head_dim), the sequences packed one after the other "
                f"(attention_varlen), got shape {tuple(x.shape)}"
            )
    cu_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    cu_k = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got {len(cu_q)} and {len(cu_k)}"
        )
    lengths = {}
    for name, cu, given in (("max_seqlen_q", cu_q, max_seqlen_q), ("max_seqlen_k", cu_k, max_seqlen_k)):
        longest = int(numpy.diff(cu).max()) if len(cu) > 1 else 0
        if given is None:
            lengths[name] = longest
            continue
        given = check_count(given, name)
        if given < longest:
            raise ValueError(f"{name} must be at least the longest sequence's length {longest}, got {given}")
        lengths[name] = given
    try:  # the padded batch's checks (dtypes, head dims, GQA, strides, limits), on views
        p = check_attention_args(q[None], k[None], v[None], causal=causal, scale=scale, return_lse=return_lse,
                                 window=window, softcap=softcap)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("(batch, ", "(").replace("batch=1, ", "")) from None
    batch = len(cu_q) - 1
    if batch > MAX_GRID_YZ:
        raise ValueError(f"at most {MAX_GRID_YZ} sequences (batch), got {batch}")
    if lengths["max_seqlen_q"] + lengths["max_seqlen_k"] > MAX_SEQLEN:
        raise ValueError(f"max_seqlen_q + max_seqlen_k must be at most {MAX_SEQLEN} (int32 band arithmetic)")
    return dataclasses.replace(p, batch=batch, seqlen_q=lengths["max_seqlen_q"], seqlen_k=lengths["max_seqlen_k"],
                               cu_seqlens=(cu_q, cu_k))


def check_cu_seqlens(cu_seqlens, name: str, total: int) -> numpy.ndarray:
    """cu_seqlens as a host int32 array: the cumulative sequence lengths [0, s_0, s_0 + s_1, ...,
    total] (FlashAttention-2's layout), one-dimensional, non-decreasing from 0 to the packed
    array's length. Index arrays follow one rule (`check_cache_seqlens` too): a list of ints or an
    array of any integer dtype, on the host or on q's GPU, converted to int32. A device array is
    copied to the host for this check (a few bytes, but a synchronisation)."""
    if isinstance(cu_seqlens, (list, tuple)):
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, (bool, numpy.bool_)) for x in cu_seqlens):
            raise TypeError(f"{name} must be an integer array or a list of ints, got {cu_seqlens!r}")
        cu_seqlens = numpy.asarray(cu_seqlens, dtype=numpy.int64)
    if not hasattr(cu_seqlens, "dtype") or not hasattr(cu_seqlens, "shape"):
        raise TypeError(f"{name} must be an integer array of shape (batch + 1,), got {type(cu_seqlens).__name__}")
    if numpy.dtype(cu_seqlens.dtype).kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype (int32, as FlashAttention's cu_seqlens), got {cu_seqlens.dtype}")
    if type(cu_seqlens).__module__.split(".")[0] == "cupy":
        cu_seqlens = cu_seqlens.get()
    cu = numpy.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 1:
        raise ValueError(f"{name} must have shape (batch + 1,), got {tuple(cu.shape)}")
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {cu[0]}")
    steps = numpy.diff(cu.astype(numpy.int64))
    if (steps < 0).any():
        at = int(numpy.flatnonzero(steps < 0)[0])
        raise ValueError(f"{name} must be non-decreasing, got {cu[at]} then {cu[at + 1]} at positions {at}, {at + 1}")
    if cu[-1] != total:
        raise ValueError(f"{name}'s last value must be the packed array's length {total}, got {cu[-1]}")
    if total >= 2**31:
        raise ValueError(f"{name}'s values must fit in int32, got a packed length of {total}")
    return numpy.ascontiguousarray(cu, dtype=numpy.int32)


def check_seqlens_k(seqlens_k, p: AttentionProblem) -> AttentionProblem:
    """The problem with seqlens_k: the keys each batch entry uses (its first seqlens_k[b] of
    seqlen_k; the rest is padding), as `check_cache_seqlens` checks cache_seqlens."""
    if seqlens_k is None:
        return p
    if p.block_mask is not None:
        raise ValueError("seqlens_k cannot be combined with a block mask")
    return dataclasses.replace(p, seqlens_k=check_cache_seqlens(seqlens_k, p.batch, p.seqlen_k, 0, "seqlens_k"))


def check_softcap(softcap) -> float | None:
    """softcap: None or 0 (flash-attn's spelling) for none, else a finite positive real number."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, numpy.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number or None, got {softcap!r}")
    softcap = float(softcap)
    if softcap == 0.0:
        return None
    if not math.isfinite(softcap) or softcap < 0.0:
        raise ValueError(f"softcap must be finite and positive (or 0 / None for none), got {softcap}")
    return softcap


def check_alibi_slopes(slopes, problem: AttentionProblem) -> AttentionProblem:
    """The problem with ALiBi slopes: an array of real floats shaped (heads,) or (batch or 1,
    heads), kept as a (batch or 1, heads) view. NumPy values are checked (finite); device values
    are not read back. Where the array lives is the caller's check."""
    if slopes is None:
        return problem
    if not hasattr(slopes, "dtype") or not hasattr(slopes, "shape"):
        raise TypeError(f"alibi_slopes must be an array of shape (heads,) or (batch, heads), got {type(slopes).__name__}")
    dtype = numpy.dtype(slopes.dtype)
    if dtype.kind != "f" and not (BFLOAT16 is not None and dtype == BFLOAT16):
        raise TypeError(f"alibi_slopes must have a floating dtype, got {dtype}")
    heads, batch = problem.heads, problem.batch
    shape = tuple(slopes.shape)
    if shape == (heads,):
        slopes = slopes.reshape(1, heads)
    elif len(shape) != 2 or shape[1] != heads or shape[0] not in (1, batch):
        raise ValueError(
            f"alibi_slopes must have shape (heads,) = ({heads},) or (batch or 1, heads) = ({batch}, {heads}), got {shape}"
        )
    if isinstance(slopes, numpy.ndarray) and not numpy.isfinite(slopes.astype(numpy.float64)).all():
        raise ValueError("alibi_slopes must be finite")
    if problem.seqlen_q + problem.seqlen_k > MAX_SEQLEN:  # ALiBi's distance i + seqlen_k - seqlen_q - j in int32
        raise ValueError(
            f"with alibi_slopes, seqlen_q + seqlen_k must be at most {MAX_SEQLEN}, got "
            f"{problem.seqlen_q + problem.seqlen_k}"
        )
    return dataclasses.replace(problem, alibi_slopes=slopes)


def check_dropout(dropout_p, seed, offset, problem: AttentionProblem) -> AttentionProblem:
    """The problem with dropout (`check_dropout_args`)."""
    if type(dropout_p) is float and dropout_p == 0.0 and seed is None and type(offset) is int and offset == 0:
        if (problem.dropout_p, problem.seed, problem.offset) == (0.0, 0, 0):  # no dropout: every call's path
            return problem
    dropout_p, seed, offset = check_dropout_args(dropout_p, seed, offset)
    if (dropout_p, seed, offset) == (problem.dropout_p, problem.seed, problem.offset):
        return problem  # dataclasses.replace costs ~10 us, and this is on every call's path
    return dataclasses.replace(problem, dropout_p=dropout_p, seed=seed, offset=offset)


def check_dropout_args(dropout_p, seed, offset) -> tuple[float, int, int]:
    """dropout_p a real number in [0, 1); with dropout_p > 0 a seed, an int in [0, 2^64) (None: 0
    otherwise); offset an int in [0, 2^32). The same seed and offset give the same mask."""
    if isinstance(dropout_p, (bool, numpy.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {dropout_p!r}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if seed is None:
        if dropout_p > 0.0:
            raise ValueError(
                "seed is required when dropout_p > 0: an int in [0, 2**64), which the backward needs again to "
                "regenerate the same dropout mask"
            )
        seed = 0
    return dropout_p, check_int_range(seed, "seed", 2**64), check_int_range(offset, "offset", 2**32)


def check_int_range(value, arg: str, end: int) -> int:
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, (int, numpy.integer)):
        raise TypeError(f"{arg} must be an int in [0, {end}), got {value!r}")
    if not 0 <= int(value) < end:
        raise ValueError(f"{arg} must be in [0, {end}), got {int(value)}")
    return int(value)


def check_window(window) -> tuple | None:
    """window=(left, right) of local attention as (left or None, right or None), where None and
    -1 (flash-attn's spelling) mean unbounded; None when both sides are. A side is an int or a
    0-d integer array or tensor."""
    if window is None:
        return None
    try:
        pair = tuple(window)
    except TypeError:
        raise TypeError(f"window must be None or a pair (left, right) of ints or None, got {window!r}") from None
    if len(pair) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints or None, got {window!r}")
    sides = []
    for side, x in zip(("left", "right"), pair):
        if x is None:
            sides.append(None)
            continue
        try:  # an int, or a 0-d integer array or tensor (as flash-attn's tests pass)
            boolean = isinstance(x, (bool, numpy.bool_)) or str(getattr(x, "dtype", "")).endswith("bool")
            x = None if boolean else operator.index(x)
        except TypeError:
            x = None
        if x is None:
            raise TypeError(f"window's {side} side must be an int or None, got {pair[len(sides)]!r}")
        if x < -1:
            raise ValueError(f"window's {side} side must be >= 0, or -1 or None for unbounded, got {x}")
        sides.append(None if x == -1 else int(x))
    return None if sides == [None, None] else tuple(sides)


def check_backward_args(
    dout, q, k, v, out, lse, *, causal, scale, deterministic, window=None, softcap=None
) -> AttentionProblem:
    """Validates the arguments of attention_backward (NumPy or CuPy arrays, already on one side)."""
    problem = check_attention_args(q, k, v, causal=causal, scale=scale, return_lse=False, window=window, softcap=softcap)
    expected_lse = (problem.batch, problem.heads, problem.seqlen_q)
    return check_backward_extras(dout, q, out, lse, problem, expected_lse, "(batch, heads, seqlen_q)", deterministic)


def check_varlen_backward_args(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               causal, scale, deterministic, window=None, softcap=None) -> AttentionProblem:
    """Validates the arguments of attention_varlen_backward: check_varlen_args', and dout, out of
    q's packed shape, lse of shape (heads, total_q)."""
    problem = check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                scale=scale, return_lse=False, window=window, softcap=softcap)
    expected_lse = (problem.heads, problem.total_q)
    return check_backward_extras(dout, q, out, lse, problem, expected_lse, "(heads, total_q)", deterministic,
                                  "attention_varlen")


def check_backward_extras(dout, q, out, lse, problem: AttentionProblem, expected_lse: tuple, lse_axes: str,
                           deterministic, forward: str = "attention") -> AttentionProblem:
    for name, x in (("dout", dout), ("out", out)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        check_strides(x, name)
    if tuple(lse.shape) != expected_lse:
        raise ValueError(
            f"lse must have shape {lse_axes} = {expected_lse}, as {forward}(..., return_lse=True) returns it, got "
            f"{tuple(lse.shape)}"
        )
    want = lse_dtype(problem.dtype_name)
    if lse.dtype != want:
        raise TypeError(
            f"lse must be {want} for {problem.dtype_name} inputs, as {forward}(..., return_lse=True) returns it, got "
            f"{lse.dtype}"
        )
    if lse.size and any(stride % lse.dtype.itemsize for stride in lse.strides):
        raise ValueError(f"lse's strides must be multiples of its itemsize {lse.dtype.itemsize}, got {lse.strides}")
    deterministic = check_flag(deterministic, "deterministic")
    return problem if deterministic == problem.deterministic else dataclasses.replace(problem, deterministic=deterministic)


def check_strides(x, name: str) -> None:
    if x.size == 0:  # an empty array's strides are arbitrary (NumPy reports zeros) and unused
        return
    itemsize = x.dtype.itemsize
    for axis, stride in enumerate(x.strides):
        if stride % itemsize:
            raise ValueError(f"{name}'s strides must be multiples of its itemsize {itemsize}, got {x.strides}")
    if x.shape[-1] > 1 and x.strides[-1] != itemsize:
        raise ValueError(
            f"{name}'s last axis (head_dim) must be contiguous (stride {itemsize} bytes), got strides "
            f"{x.strides}. Other axes may have any stride: a (batch, heads, seq, head_dim) array passes "
            f"as x.transpose(0, 2, 1, 3) with no copy."
        )


def check_flag(value, arg: str) -> bool:
    if not isinstance(value, (bool, numpy.bool_)):
        raise TypeError(f"{arg} must be True or False, got {value!r}")
    return bool(value)


def check_scale(scale, head_dim: int) -> float:
    """scale, defaulting to 1/sqrt(head_dim); must be a finite positive real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, numpy.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale must be finite and positive, got {scale}")
    return scale


# --------------------------------------------------------------------------- block-sparse

_MIN_BLOCK = 16  # the smallest tile of any kernel: a block size is a multiple of it


def check_block_mask_array(mask) -> numpy.ndarray:
    """The boolean block array of a BlockMask as a NumPy copy: 3 or 4 dimensions, dtype bool."""
    if type(mask).__module__.split(".")[0] == "cupy":
        mask = mask.get()
    if not hasattr(mask, "dtype") or not hasattr(mask, "shape"):
        raise TypeError(f"the block mask must be a boolean NumPy or CuPy array, got {type(mask).__name__}")
    mask = numpy.asarray(mask)
    if mask.dtype != numpy.bool_:
        raise TypeError(f"the block mask must have dtype bool, got {mask.dtype}")
    if mask.ndim not in (3, 4):
        raise ValueError(
            "the block mask must have shape (heads or 1, n_q_blocks, n_k_blocks) or (batch or 1, heads or 1, "
            f"n_q_blocks, n_k_blocks), got {mask.shape}"
        )
    return numpy.array(mask, dtype=bool, copy=True)


def check_block_size(block_size) -> tuple[int, int]:
    """(block_q, block_k) from an int or a pair; each a positive multiple of 16."""
    pair = (block_size, block_size) if isinstance(block_size, numbers.Integral) else block_size
    try:
        pair = tuple(pair)
    except TypeError:
        raise TypeError(f"block_size must be an int or a pair of ints, got {block_size!r}") from None
    if len(pair) != 2 or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in pair):
        raise TypeError(f"block_size must be an int or a pair of ints, got {block_size!r}")
    if not all(x > 0 and x % _MIN_BLOCK == 0 for x in pair):
        raise ValueError(f"block_size must be positive multiples of {_MIN_BLOCK} (e.g. 128), got {block_size!r}")
    return int(pair[0]), int(pair[1])


def check_count(value, arg: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{arg} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{arg} must be at least {minimum}, got {value}")
    return int(value)


# --------------------------------------------------------------------------- KV-cache decoding


def check_decode_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, *, causal, scale, return_lse, window,
                      num_splits, immutable_caches=False, softcap=None) -> DecodeProblem:
    """Validates attention_decode's arguments (NumPy or CuPy arrays, already on one side).

    cache_seqlens: None, an int, or an integer array of shape (batch,). Its values are checked
    (0 <= c, c + seqlen_new <= cache_len) when they live on the host; on the GPU they are used as
    given (reading them back would stall every decoding step), the kernels clamping to the cache."""
    try:
        p = check_attention_args(q, k_cache, v_cache, causal=causal, scale=scale, return_lse=return_lse, window=window,
                                 softcap=softcap)
    except (TypeError, ValueError) as e:  # the same checks, naming the caches as the caller knows them
        message = re.sub(r"\b([kv])\b", r"\1_cache", str(e)).replace("seqlen_k", "cache_len")
        raise type(e)(message) from None
    batch, cache_len = p.batch, p.seqlen_k

    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together (or both None)")
    seqlen_new = 0
    if k_new is not None:
        if immutable_caches:
            raise TypeError(
                "k_cache and v_cache are JAX arrays, which are immutable: new keys cannot be appended in "
                "place. Append them with k_cache.at[...].set(...) and call with k_new=None, v_new=None."
            )
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if x.ndim != 4 or (x.shape[0], x.shape[2], x.shape[3]) != (batch, p.heads_kv or 0, p.head_dim):
                raise ValueError(
                    f"{name} must have shape (batch={batch}, seqlen_new, heads_kv={p.heads_kv}, "
                    f"head_dim={p.head_dim}) to match the caches {tuple(k_cache.shape)}, got {tuple(x.shape)}"
                )
            if x.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
            check_strides(x, name)
        if k_new.shape[1] != v_new.shape[1]:
            raise ValueError(f"k_new and v_new must have the same seqlen_new, got {k_new.shape[1]} and {v_new.shape[1]}")
        seqlen_new = int(k_new.shape[1])
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required with k_new: it says where each sequence's new keys go")
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(x, numpy.ndarray) and not x.flags.writeable:
                raise ValueError(f"{name} is read-only; new keys are appended into it in place")
    cache_seqlens = check_cache_seqlens(cache_seqlens, batch, cache_len, seqlen_new, "cache_seqlens")
    if num_splits is not None:
        num_splits = check_count(num_splits, "num_splits", 1)
        if num_splits > DECODE_MAX_SPLITS:
            raise ValueError(f"num_splits must be at most {DECODE_MAX_SPLITS}, got {num_splits}")
    return DecodeProblem(p, seqlen_new, cache_seqlens, num_splits)


def check_cache_seqlens(cache_seqlens, batch: int, cache_len: int, seqlen_new: int, name: str):
    """cache_seqlens (or seqlens_k, as `name` says) as an int32 array of shape (batch,) on its own
    side (an int becomes a NumPy array), or None; host values must leave room for the append."""
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, (bool, numpy.bool_)):
        cache_seqlens = numpy.full(batch, int(cache_seqlens), dtype=numpy.int64)
    elif isinstance(cache_seqlens, (list, tuple)):
        cache_seqlens = numpy.asarray(cache_seqlens)
    if not hasattr(cache_seqlens, "dtype") or not hasattr(cache_seqlens, "shape"):
        raise TypeError(f"{name} must be None, an int, or an integer array of shape (batch,), got {cache_seqlens!r}")
    if numpy.dtype(cache_seqlens.dtype).kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype (int32 or int64), got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(cache_seqlens.shape)}")
    if isinstance(cache_seqlens, numpy.ndarray):
        if batch and (cache_seqlens.min() < 0 or cache_seqlens.max() + seqlen_new > cache_len):
            bound = (f"[0, cache_len - seqlen_new] = [0, {cache_len - seqlen_new}] (cache_len={cache_len}, "
                     f"{seqlen_new} new keys)" if name == "cache_seqlens" else f"[0, seqlen_k] = [0, {cache_len}]")
            raise ValueError(
                f"{name} must lie in {bound}, got values from {cache_seqlens.min()} to {cache_seqlens.max()}"
            )
        return numpy.ascontiguousarray(cache_seqlens, dtype=numpy.int32)
    # A CuPy array: its values used as given; the kernels read int32 lengths one after the other.
    return cache_seqlens.astype("int32", order="C", copy=False)
