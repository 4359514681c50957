"""cupyflash as an attention implementation of Hugging Face transformers.

    import cupyflash.transformers                      # registers "cupy_attention"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cupy_attention")

Importing the module registers `attention` with transformers' `AttentionInterface` and, with its
`AttentionMaskInterface`, the mask transformers hands flash_attention_2: None when no token is
padding, else the 2-D padding mask (batch, keys), True where a token is real. So a padded batch
reaches cupyflash's kernels with no 4-D mask and no call to torch's SDPA. Not causal (an encoder,
cross-attention): the dense kernels with each sequence's key count (`seqlens_k`), its real keys
moved first where they are not already (left padding); every query is computed in place. Causal
(a decoder): the varlen kernels, each sequence's real queries and keys packed. A padding-free
packed batch (one row of concatenated sequences, given as `cu_seq_lens_q` / `cu_seq_lens_k` or as
position ids that restart) takes varlen too. Keys and values keep their heads (GQA and MQA are read
in place). The layer's causality, scaling, sliding window (key j for query i when
i - window < j <= i), softcap and dropout come from transformers' arguments, as for
flash_attention_2. A generation step (up to 16 new queries against a longer cache, no gradient)
takes the decode kernels (`attention_decode`) when each sequence's real keys come first (no
padding, right padding, a static cache); left padding takes varlen. A static cache with no mask
(generate drops an all-ones mask) is read up to each sequence's position ids.
Importing this module imports torch and transformers, which cupyflash does not otherwise need.
"""

from __future__ import annotations

import weakref

import torch
import transformers
from transformers import masking_utils

from cupyflash.frameworks import torch as adapter
from cupyflash.runtime import workspace

__all__ = ["NAME", "attention"]

# Not "cupyflash": transformers takes every name holding "flash" for a flash-attn build and tries to
# import one for it.
NAME = "cupy_attention"


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None,
              is_causal=None, **kwargs):
    """transformers' attention-function signature: query (batch, heads, seq_q, head_dim), key and
    value (batch, heads_kv, seq_k, head_dim), attention_mask None or the 2-D padding mask of
    `AttentionMaskInterface`; returns ((batch, seq_q, heads, head_dim), None)."""
    for name in ("s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"cupyflash.transformers: attention sinks ({name}) are not supported")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("cupyflash.transformers: output_attentions=True needs attn_implementation='eager'")
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError("cupyflash.transformers: a value head dim other than the query's is not supported")
    causal = bool(module.is_causal if is_causal is None else is_causal)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (batch, seq, heads, head_dim), no copy
    window = None
    if sliding_window is not None:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    options = dict(causal=causal, scale=scaling, window=window, softcap=softcap or None, dropout_p=dropout)
    packed = _packed_lengths(q, kwargs)
    if packed is not None:
        out = adapter.attention_varlen(q[0], k[0], v[0], *packed, **options)
        return out.unsqueeze(0), None
    if attention_mask is None:
        lengths = _cache_lengths(q, k, causal, kwargs.get("position_ids"))
        if _decoding(q, k, v, dropout):
            del options["dropout_p"]
            return adapter.attention_decode(q, k, v, lengths, **options), None
        return adapter.attention(q, k, v, seqlens_k=lengths, **options), None
    if attention_mask.dim() != 2:
        raise ValueError(f"cupyflash.transformers: attention_mask must be the 2-D padding mask (batch, keys) of "
                         f"the '{NAME}' mask interface, got shape {tuple(attention_mask.shape)}")
    given_mask, attention_mask = attention_mask, attention_mask.bool()
    query_mask = attention_mask[:, -q.shape[1]:]  # (causal: the real queries are the last the mask covers)
    if attention_mask.shape[1] < k.shape[1]:  # a static cache: the mask covers its filled rows
        attention_mask = torch.nn.functional.pad(attention_mask, (0, k.shape[1] - attention_mask.shape[1]))
    if _decoding(q, k, v, dropout):
        lengths = _of_mask(given_mask, ("prefix", k.shape[1]), lambda: _prefix_lengths(attention_mask))
        if lengths is not None:
            del options["dropout_p"]
            return adapter.attention_decode(q, k, v, lengths, **options), None
    if not causal and window is None:
        order, lengths = _of_mask(given_mask, ("keys first", k.shape[1]), lambda: _real_keys_first(attention_mask))
        if order is not None:
            k, v = (x.gather(1, order.expand(-1, -1, *x.shape[2:])) for x in (k, v))
        return adapter.attention(q, k, v, seqlens_k=lengths, **options), None
    unpadding = _unpadding(given_mask, (q.shape[1], k.shape[1]), attention_mask, query_mask)
    return _padded(q, k, v, unpadding, options), None


def _cache_lengths(q, k, causal: bool, positions):
    """Each sequence's keys in a cache that holds more rows than it has filled (a static cache,
    whose all-ones mask generate drops): the last query's position id + 1, as an int32 CUDA tensor
    the kernels read in place; None where every key row is real (no cache, a dynamic one, or no
    position ids of (batch, seqlen_q) to tell)."""
    if not causal or k.shape[1] <= q.shape[1] or positions is None or positions.dim() != 2 \
            or positions.shape[1] != q.shape[1] or positions.shape[0] not in (1, q.shape[0]):
        return None
    return (positions[:, -1] + 1).to(torch.int32).expand(q.shape[0]).contiguous()


def _real_keys_first(mask) -> tuple:
    """(order, lengths) for the dense kernels with seqlens_k: each sequence's number of real keys
    and, where they are not its first ones (left padding), the key order that puts them first
    (a (batch, keys, 1, 1) index; None where they are first already). Under torch.compile the order
    is always made, with no read of the mask on the host."""
    lengths = mask.sum(dim=1, dtype=torch.int32)
    if not torch.compiler.is_compiling() and _is_prefix(mask, lengths):
        return None, lengths
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    return order[:, :, None, None], lengths


def _is_prefix(mask, lengths) -> bool:
    """Whether each sequence's real keys are its first ones (a read of the GPU)."""
    return bool(torch.equal(torch.arange(mask.shape[1], device=mask.device) < lengths[:, None], mask))


# New queries up to which a step with a cache takes the decode kernels (split over the keys).
DECODE_ROWS = 16


def _decoding(q, k, v, dropout) -> bool:
    """A generation step: a few new queries against more keys, no dropout, no gradient wanted."""
    wants_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    return q.shape[1] <= DECODE_ROWS and q.shape[1] < k.shape[1] and not dropout and not wants_grad


def _prefix_lengths(mask):
    """Each sequence's number of keys where its real keys are the first ones (right padding, or a
    static cache filled from the start), which `attention_decode` reads; None where some sequence
    has padding before a real key (left padding: the varlen kernels take it)."""
    lengths = mask.sum(dim=1, dtype=torch.int32)
    return lengths if _is_prefix(mask, lengths) else None


def _packed_lengths(q, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) of a padding-free packed batch (one row), from
    transformers' cu_seq_lens_* arguments or from position ids that restart; else None."""
    if kwargs.get("cu_seq_lens_q") is not None:
        return (kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32),
                _as_int(kwargs.get("max_length_q")), _as_int(kwargs.get("max_length_k")))
    positions = kwargs.get("position_ids")
    if positions is None or q.shape[0] != 1 or positions.shape[-1] != q.shape[1]:
        return None
    positions = positions.reshape(-1)
    starts = (positions == positions.min()).nonzero().reshape(-1)
    if starts.numel() <= 1:
        return None
    cu_seqlens = torch.cat((starts, starts.new_tensor([positions.numel()]))).to(torch.int32)
    return cu_seqlens, cu_seqlens, None, None


def _as_int(x):
    return int(x) if x is not None else None


# What a padded batch's mask gives the varlen call (or a generation step's the decode call), by
# mask: transformers hands every layer the same mask tensor, and each nonzero() or torch.equal (and
# the varlen checks' read of new lengths) waits for the GPU, so each layer's call cost a
# synchronisation or more. An entry holds while it is the same live tensor at the same version and
# address.
_UNPADDINGS: dict = {}
_UNPADDINGS_KEPT = 16


def _unpadding(given, shape: tuple, mask, query_mask) -> tuple:
    """(key rows, query rows, cu_seqlens_q, cu_seqlens_k) of the padded batch whose (bool, padded)
    key mask and query mask come from the mask `given` at this (seqlen_q, seqlen_k)."""
    return _of_mask(given, ("unpadding", shape), lambda: _rows_and_lengths(mask, query_mask))


def _of_mask(given, key: tuple, make):
    """make(), kept by the mask `given` (and key) while it is the same live tensor at the same
    version and address; not under torch.compile, which traces make() itself."""
    if torch.compiler.is_compiling():
        return make()
    kept = _UNPADDINGS.get((id(given), key))
    if kept is not None and kept[0]() is given and kept[1] == (given._version, given.data_ptr()):
        return kept[2]
    made = make()
    workspace.keep_bounded(_UNPADDINGS, (id(given), key), (weakref.ref(given), (given._version, given.data_ptr()), made),
                           _UNPADDINGS_KEPT)
    return made


def _rows_and_lengths(mask, query_mask) -> tuple:
    return (mask.reshape(-1).nonzero().reshape(-1), query_mask.reshape(-1).nonzero().reshape(-1),
            _cumulative(query_mask.sum(dim=1)), _cumulative(mask.sum(dim=1)))


def _padded(q, k, v, unpadding: tuple, options):
    """A causal padded batch through the varlen kernels: each sequence's real keys and real
    queries (`_unpadding`), packed; rows of padding queries get 0."""
    batch, seqlen_q = q.shape[:2]
    key_rows, query_rows, cu_seqlens_q, cu_seqlens_k = unpadding
    # (index_select, not x[rows]: its gradient is an index_add of distinct rows, where indexing's
    # is index_put with accumulate, which sorts the rows on CUDA)
    packed = adapter.attention_varlen(
        q.reshape(batch * seqlen_q, *q.shape[2:]).index_select(0, query_rows),
        k.reshape(-1, *k.shape[2:]).index_select(0, key_rows), v.reshape(-1, *v.shape[2:]).index_select(0, key_rows),
        cu_seqlens_q, cu_seqlens_k, **options)
    packed = packed.new_zeros((batch * seqlen_q, *packed.shape[1:])).index_copy(0, query_rows, packed)
    return packed.reshape(batch, seqlen_q, *packed.shape[1:])


def _cumulative(lengths):
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def register():
    """Registers `attention` and its mask as attn_implementation NAME (done on import)."""
    transformers.AttentionInterface.register(NAME, attention)
    masking_utils.AttentionMaskInterface.register(NAME, masking_utils.flash_attention_mask)


register()
