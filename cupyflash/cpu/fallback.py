"""The CPU fallback: a checked problem computed by the tiled NumPy algorithm (cpu/tiled.py) in
float64, the results cast to the input's dtype. It serves NumPy inputs where no GPU is available."""

from __future__ import annotations

import numpy

from cupyflash.cpu import reference, tiled
from cupyflash.problem import AttentionProblem, DecodeProblem, lse_dtype


def _options(p: AttentionProblem) -> dict:
    """The references' options for the problem."""
    slopes = p.alibi_slopes
    return {"causal": p.causal, "scale": p.scale, "window": p.window, "softcap": p.softcap,
            "alibi_slopes": None if slopes is None else reference.as_float64(slopes),
            "dropout_p": p.dropout_p, "seed": p.seed, "offset": p.offset}


def forward(q, k, v, p: AttentionProblem):
    """(out, lse) of the problem."""
    options = _options(p)
    if p.cu_seqlens is not None:
        out, lse = reference.attention_varlen(q, k, v, *p.cu_seqlens, return_lse=True, forward=tiled.tiled_attention,
                                              **options)
    elif p.seqlens_k is not None:
        out, lse = _per_batch_entry(tiled.tiled_attention, p, (q,), (k, v), return_lse=True, **options)
    else:
        out, lse = tiled.tiled_attention(q, k, v, return_lse=True, block_mask=p.block_mask, **options)
    return out.astype(q.dtype), lse.astype(lse_dtype(p.dtype_name))


def backward(dout, q, k, v, out, lse, p: AttentionProblem):
    """(dq, dk, dv) of the problem."""
    options = _options(p)
    if p.cu_seqlens is not None:
        grads = reference.attention_varlen_backward(dout, q, k, v, *p.cu_seqlens, out=out, lse=lse,
                                                    backward=tiled.tiled_attention_backward, **options)
    elif p.seqlens_k is not None:
        grads = _per_batch_entry(lambda dout_b, q_b, out_b, lse_b, k_b, v_b, **kw: tiled.tiled_attention_backward(
            dout_b, q_b, k_b, v_b, out_b, lse_b, **kw), p, (dout, q, out, lse), (k, v), key_results=(1, 2), **options)
    else:
        grads = tiled.tiled_attention_backward(dout, q, k, v, out, lse, block_mask=p.block_mask, **options)
    return tuple(g.astype(q.dtype) for g in grads)


def _per_batch_entry(function, p: AttentionProblem, q_side, k_side, key_results=(), **options):
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


def decode(q, k, v, d: DecodeProblem):
    """(out, lse) of a decoding step (its appends already made), one sequence at a time over its
    valid keys."""
    p = d.attention
    out = numpy.zeros(q.shape, q.dtype)
    lse = numpy.full((p.batch, p.heads, p.seqlen_q), -numpy.inf, lse_dtype(p.dtype_name))
    slopes = None if p.alibi_slopes is None else reference.as_float64(p.alibi_slopes)
    for b in range(p.batch):
        n = p.seqlen_k if d.cache_seqlens is None else int(d.cache_seqlens[b])
        o, l = tiled.tiled_attention(
            q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], causal=p.causal, scale=p.scale, return_lse=True,
            window=p.window, softcap=p.softcap, alibi_slopes=None if slopes is None else slopes[b % slopes.shape[0]],
        )
        out[b], lse[b] = o[0], l[0]
    return out, lse
