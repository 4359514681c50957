"""Standard attention in CuPy, the baseline FlashAttention is measured against.

matmul -> softmax -> matmul with the (seqlen_q, seqlen_k) matrix materialised per head, as a CuPy
user would write it: the matmuls in the input dtype through cuBLAS (tensor cores for float16,
float64 DGEMM for float64), the softmax in float32, or in float64 for float64 inputs (PyTorch's
math backend likewise upcasts 16-bit inputs), then P cast back for P V. CuPy has no bfloat16
matmul, so bfloat16 inputs are upcast to float32 for the matmuls too.
"""

from __future__ import annotations

import math

import numpy


def standard_attention(q, k, v, *, causal=False, scale=None):
    """q: (batch, seqlen_q, heads, head_dim), k, v: (batch, seqlen_k, heads, head_dim), CuPy."""
    import cupy

    from cupyflash._validation import BFLOAT16

    out_dtype = q.dtype
    if out_dtype == BFLOAT16:
        q, k, v = (x.astype(numpy.float32) for x in (q, k, v))
    softmax_dtype = numpy.float64 if q.dtype == numpy.float64 else numpy.float32
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # (batch, heads, seq, head_dim)
    scores = cupy.matmul(qh, kh.transpose(0, 1, 3, 2)).astype(softmax_dtype, copy=False)
    scores *= scale
    if causal:
        i = cupy.arange(seqlen_q)[:, None]
        j = cupy.arange(seqlen_k)[None, :]
        scores[..., j > i + (seqlen_k - seqlen_q)] = -cupy.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = cupy.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = cupy.matmul(probs.astype(q.dtype, copy=False), vh)
    return cupy.ascontiguousarray(out.transpose(0, 2, 1, 3)).astype(out_dtype, copy=False)


def flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal=False) -> float:
    """Forward FLOPs of attention, 4 b h s_q s_k d (two matmuls), halved for causal."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return f / 2 if causal else f
