"""flash-attn's Python interface (FlashAttention-2's `flash_attn` package) computed by cupyflash.

    from cupyflash.flash_attn import flash_attn_func     # instead of: from flash_attn import ...
    out = flash_attn_func(q, k, v, causal=True)           # q, k, v: (batch, seqlen, heads, head_dim)

The functions keep flash-attn's names, signatures, layouts and return values, so that a PyTorch
program switches with one import and no build. What they mean follows flash-attn's code:

- window_size=(left, right), -1 for unbounded, aligned bottom-right. As flash-attn does, a side
  of at least seqlen_k (varlen: max_seqlen_k; kvcache: the cache's length) counts as unbounded,
  causal sets right to 0, and then a one-sided window's unbounded side becomes seqlen_k: with
  window_size=(left, -1) and seqlen_q > seqlen_k + 1, the first queries do not see the last keys.
  The sides may be ints or 0-d tensors.
- return_attn_probs=True returns (out, softmax_lse, S_dmask): softmax_lse (batch, heads, seqlen_q)
  float32 ((heads, total_q) for varlen) without gradient; S_dmask None without dropout, else
  (batch, heads, seqlen_q rounded up to 128, seqlen_k likewise) in q's dtype, the probabilities as
  FlashAttention-2 writes them for tests (each key block scaled by exp(-running row maximum) over
  the blocks it visits last to first, `_flash_block_n`), negative where dropout dropped them.
  Like flash-attn's, it is for testing only: cupyflash materialises it separately (O(seqlen^2)).
- Dropout draws its seed and offset from the CUDA generator of q's device, advancing its offset
  (`torch.cuda.manual_seed` makes it reproducible); the masks are cupyflash's own Philox stream,
  not flash-attn's bits.
- flash_attn_with_kvcache appends k, v into the caches in place at cache_seqlens, as flash-attn
  does; cache_batch_idx selects cache entries (which cupyflash gathers into a copy: flash-attn
  reads them in place). Rotary embeddings, paged caches (block_table) and cache_leftpad raise
  NotImplementedError. num_splits=0 lets cupyflash choose.

Differences from flash-attn that remain: varlen's device cu_seqlens are read back to the host
for their checks (a small synchronising copy per call, where flash-attn trusts max_seqlen_*);
inputs may also be float32/float64 and CPU tensors (cupyflash's host path) and head_dim any value
from 1 to 256, where flash-attn wants 16-bit CUDA tensors.
"""

from __future__ import annotations

import math
import operator

import numpy
import torch

import cupyflash
from cupyflash.frameworks import torch as adapter

__all__ = [
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, heads, head_dim), k, v (batch, seqlen_k, heads_k, head_dim), heads_k
    dividing heads (MQA/GQA). Returns out (batch, seqlen_q, heads, head_dim), or with
    return_attn_probs (out, softmax_lse, S_dmask)."""
    causal, window = _window(window_size, causal, k.shape[1])
    dropout = _dropout(dropout_p, q)
    out, lse = adapter.attention(q, k, v, causal=causal, scale=softmax_scale, window=window,
                                 softcap=_softcap(softcap), alibi_slopes=alibi_slopes, deterministic=deterministic,
                                 return_lse=True, **dropout)
    if not return_attn_probs:
        return out
    return out, lse, _probabilities(q, k, dropout, softmax_scale, causal, window, softcap, alibi_slopes)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv (batch, seqlen, 3, heads, head_dim): q, k, v stacked; the gradient comes back as one
    tensor of that shape. Returns as flash_attn_func."""
    _packed(qkv, 5, 3, "qkv", "(batch, seqlen, 3, heads, head_dim)")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, heads, head_dim), kv (batch, seqlen_k, 2, heads_k, head_dim). Returns as
    flash_attn_func."""
    _packed(kv, 5, 2, "kv", "(batch, seqlen_k, 2, heads_k, head_dim)")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q (total_q, heads, head_dim), k, v (total_k, heads_k, head_dim), sequences packed one after
    the other, cu_seqlens_* (batch + 1,) integer tensors. Returns out (total_q, heads, head_dim),
    or with return_attn_probs (out, softmax_lse (heads, total_q), S_dmask)."""
    if block_table is not None:
        raise NotImplementedError("cupyflash.flash_attn: paged KV caches (block_table) are not supported")
    causal, window = _window(window_size, causal, max_seqlen_k)
    dropout = _dropout(dropout_p, q)
    out, lse = adapter.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        causal=causal, scale=softmax_scale, window=window, softcap=_softcap(softcap),
                                        alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=True,
                                        **dropout)
    if not return_attn_probs:
        return out
    probabilities = None
    if dropout_p > 0:
        starts_q, starts_k = (torch.as_tensor(cu, device="cpu").tolist() for cu in (cu_seqlens_q, cu_seqlens_k))
        qp, kp = _padded(q, starts_q, max_seqlen_q), _padded(k, starts_k, max_seqlen_k)
        probabilities = _probabilities(qp, kp, dropout, softmax_scale, causal, window, softcap, alibi_slopes,
                                       lengths=(numpy.diff(starts_q).tolist(), numpy.diff(starts_k).tolist()))
    return out, lse, probabilities


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, heads, head_dim). Returns as flash_attn_varlen_func."""
    _packed(qkv, 4, 3, "qkv", "(total, 3, heads, head_dim)")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (total_q, heads, head_dim), kv (total_k, 2, heads_k, head_dim). Returns as
    flash_attn_varlen_func."""
    _packed(kv, 4, 2, "kv", "(total_k, 2, heads_k, head_dim)")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """q (batch, seqlen_q, heads, head_dim) against k_cache, v_cache (batch_cache, seqlen_cache,
    heads_k, head_dim); k, v (batch, seqlen_new, heads_k, head_dim) are first written into the
    caches at rows cache_seqlens[b]... (in place). cache_seqlens: int or (batch,) integer tensor;
    cache_batch_idx: (batch,) indices of the cache entries to use. No gradient. Returns out, or
    with return_softmax_lse (out, softmax_lse (batch, heads, seqlen_q))."""
    for name, given in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_leftpad", cache_leftpad),
                        ("block_table (paged KV cache)", block_table)):
        if given is not None:
            raise NotImplementedError(f"cupyflash.flash_attn.flash_attn_with_kvcache: {name} is not supported")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values), or neither")
    causal, window = _window(window_size, causal, k_cache.shape[1])
    if num_splits is not None and operator.index(num_splits) == 0:
        num_splits = None  # flash-attn's 0: let the library choose
    lengths = cache_seqlens
    if cache_batch_idx is not None:
        index = torch.as_tensor(cache_batch_idx, device=k_cache.device).long()
        if k is not None:  # append into the selected entries in place, then attend to copies of them
            if lengths is None:
                raise ValueError("cache_seqlens is required with k and v: it says where the new keys go")
            starts = torch.as_tensor(lengths, device=k_cache.device).long().expand(q.shape[0])
            rows = starts[:, None] + torch.arange(k.shape[1], device=k_cache.device)
            k_cache[index[:, None], rows] = k
            v_cache[index[:, None], rows] = v
            lengths = starts + k.shape[1]
            k = v = None
        k_cache, v_cache = k_cache[index], v_cache[index]
    with torch.no_grad():
        result = adapter.attention_decode(
            q, k_cache, v_cache, lengths, k_new=k, v_new=v, causal=causal, window=window, scale=softmax_scale,
            return_lse=return_softmax_lse, num_splits=num_splits, softcap=_softcap(softcap), alibi_slopes=alibi_slopes)
    return result


def _window(window_size, causal, seqlen_k) -> tuple:
    """(causal, window) for cupyflash from flash-attn's causal and window_size, by flash-attn's
    rules (its mha_fwd and set_params_fprop): a side >= seqlen_k is unbounded; causal makes the
    right side 0; a one-sided window's other side is seqlen_k."""
    try:
        left, right = (operator.index(side) for side in window_size)
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right) of ints, -1 for unbounded, got {window_size!r}")
    seqlen_k = int(seqlen_k)
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    if causal:
        right = 0
    if left < 0 and right >= 0:
        left = seqlen_k  # reaches before key 0 for every query: unbounded, as cupyflash says it
    if left >= 0 and right < 0:
        right = seqlen_k
    if right < 0:
        return False, None
    if causal and left >= seqlen_k:
        return True, None
    return False, (None if left >= seqlen_k else left, right)


def _softcap(softcap):
    return None if softcap == 0 else softcap


def _dropout(dropout_p, q) -> dict:
    seed, offset = adapter.dropout_seed(dropout_p, None, 0, q)
    return {"dropout_p": dropout_p, "seed": seed, "offset": offset}


def _packed(x, ndim, count, name, layout):
    if not isinstance(x, torch.Tensor) or x.dim() != ndim or x.shape[-3] != count:
        shape = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        raise ValueError(f"{name} must be a tensor of shape {layout}, got {shape}")


def _padded(x, starts, longest):
    """A packed (total, heads, head_dim) tensor as (batch, longest, heads, head_dim), zero-padded;
    starts: its cu_seqlens as a list."""
    out = x.new_zeros((len(starts) - 1, longest, *x.shape[1:]))
    for b, (start, end) in enumerate(zip(starts, starts[1:])):
        out[b, : end - start] = x[start:end]
    return out


def _flash_block_n(device, head_dim) -> int:
    """The key block width of FlashAttention-2's forward with dropout on this device (its kernel
    traits, as flash-attn's tests reproduce them): S_dmask is scaled per block of this width."""
    major, minor = torch.cuda.get_device_capability(device) if device.type == "cuda" else (8, 0)
    sm8x = major == 8 and minor > 0
    if head_dim <= 32:
        return 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 32
    if head_dim <= 160:
        return 64 if sm8x else 32
    return 64


def _probabilities(q, k, dropout, scale, causal, window, softcap, alibi_slopes, lengths=None):
    """S_dmask as FlashAttention-2 returns it (see the module's docstring), None without dropout;
    q, k (batch, seqlen, heads, head_dim), lengths: each sequence's (queries, keys) if padded."""
    if not dropout["dropout_p"] > 0:
        return None
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    with torch.no_grad():
        precision = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf, kf = q.to(precision), k.to(precision).repeat_interleave(heads // k.shape[2], dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", qf, kf) * (scale if scale is not None else head_dim ** -0.5)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        lens_q = torch.tensor(lengths[0] if lengths else [seqlen_q] * batch, device=q.device)
        lens_k = torch.tensor(lengths[1] if lengths else [seqlen_k] * batch, device=q.device)
        rows = torch.arange(seqlen_q, device=q.device)[None, :, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, None, :]
        position = rows + (lens_k - lens_q)[:, None, None]  # the query's own key position
        if alibi_slopes is not None:
            slopes = torch.as_tensor(alibi_slopes, device=q.device, dtype=precision)
            slopes = slopes.expand(batch, heads) if slopes.dim() == 1 else slopes
            scores = scores - slopes[:, :, None, None] * (position - cols).abs()[:, None].to(precision)
        hidden = (cols >= lens_k[:, None, None]) | (rows >= lens_q[:, None, None])
        if causal:
            hidden |= cols > position
        if window is not None:
            left, right = window
            hidden |= cols > position + right
            if left is not None:
                hidden |= cols < position - left
        scores = scores.masked_fill(hidden[:, None], -math.inf)
        # Each key block is scaled by the largest score of its row over that block and those after
        # it: FlashAttention-2 visits the blocks last to first, keeping a running maximum.
        width = _flash_block_n(q.device, head_dim)
        block_max = torch.stack([s.amax(-1) for s in scores.split(width, dim=-1)], dim=-1)
        running = block_max.flip(-1).cummax(-1).values.flip(-1)
        running = running.repeat_interleave(width, dim=-1)[..., :seqlen_k]
        # Hidden keys get 0 (where exp(-inf - -inf) is NaN); a NaN score stays NaN.
        unnormalised = torch.exp(scores - running).masked_fill(hidden[:, None], 0.0)
        keep = cupyflash.dropout_mask(batch, heads, seqlen_q, seqlen_k, **dropout, device=q.is_cuda)
        keep = torch.from_dlpack(keep) if q.is_cuda else torch.from_numpy(keep)
        probabilities = torch.where(keep.to(q.device), unnormalised, -unnormalised).to(q.dtype)
        rounded = (-seqlen_q % 128, -seqlen_k % 128)
        return torch.nn.functional.pad(probabilities, (0, rounded[1], 0, rounded[0]))
