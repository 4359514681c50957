"""The CPU fallback: a checked problem computed by the tiled NumPy algorithm (cpu/tiled.py), the
results cast to the input's dtype. It serves NumPy inputs where no GPU is available.

It computes as the kernels accumulate: float64 for float64 inputs, float32 for the others; its
tiles are large, so that each step is a few BLAS products over all heads at once, and bounded, so
that memory stays O(seqlen x block) where plain attention holds every score."""

from __future__ import annotations

import functools

import numpy

from cupyflash.cpu import reference, tiled
from cupyflash.problem import AttentionProblem, DecodeProblem, lse_dtype

# Keys a tile takes, and the most scores one tile holds (its rows follow from the batch and heads):
# 4 MiB of float32 scores a step, which the BLAS products and exp2 run through at their pace.
BLOCK_N = 512
TILE_SCORES = 1 << 20

# What runs where there is no GPU, in the words explain and the command line print.
SUMMARY = ("the NumPy tiled algorithm (cupyflash.reference.tiled_attention and tiled_attention_backward), in "
           f"float32 as the kernels accumulate (float64 for float64 inputs), BLAS products over tiles of up to {BLOCK_N} "
           "keys; results in the input dtype")


def _tiled(function, p: AttentionProblem, batch: int | None = None):
    """`function` (tiled_attention or its backward) with the fallback's compute dtype and tiles for
    the problem (batch: entries a call takes at once, p.batch unless said)."""
    compute = numpy.float64 if p.dtype_name == "float64" else numpy.float32
    rows = max(1, (p.batch if batch is None else batch) * p.heads)  # (zero-size problems: any tile)
    block_m = max(16, min(256, TILE_SCORES // (rows * BLOCK_N)))
    return functools.partial(function, compute=compute, block_m=block_m, block_n=BLOCK_N)


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
        out, lse = reference.attention_varlen(q, k, v, *p.cu_seqlens, return_lse=True,
                                              forward=_tiled(tiled.tiled_attention, p, 1), **options)
    elif p.seqlens_k is not None:
        out, lse = _per_batch_entry(_tiled(tiled.tiled_attention, p, 1), p, (q,), (k, v), return_lse=True, **options)
    else:
        out, lse = _tiled(tiled.tiled_attention, p)(q, k, v, return_lse=True, block_mask=p.block_mask, **options)
    return out.astype(q.dtype), lse.astype(lse_dtype(p.dtype_name))


def backward(dout, q, k, v, out, lse, p: AttentionProblem):
    """(dq, dk, dv) of the problem."""
    options = _options(p)
    if p.cu_seqlens is not None:
        grads = reference.attention_varlen_backward(dout, q, k, v, *p.cu_seqlens, out=out, lse=lse,
                                                    backward=_tiled(tiled.tiled_attention_backward, p, 1), **options)
    elif p.seqlens_k is not None:
        entry_backward = _tiled(tiled.tiled_attention_backward, p, 1)
        grads = _per_batch_entry(lambda dout_b, q_b, out_b, lse_b, k_b, v_b, **kw: entry_backward(
            dout_b, q_b, k_b, v_b, out_b, lse_b, **kw), p, (dout, q, out, lse), (k, v), key_results=(1, 2), **options)
    else:
        grads = _tiled(tiled.tiled_attention_backward, p)(dout, q, k, v, out, lse, block_mask=p.block_mask, **options)
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
        o, l = _tiled(tiled.tiled_attention, p, 1)(
            q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], causal=p.causal, scale=p.scale, return_lse=True,
            window=p.window, softcap=p.softcap, alibi_slopes=None if slopes is None else slopes[b % slopes.shape[0]],
        )
        out[b], lse[b] = o[0], l[0]
    return out, lse
