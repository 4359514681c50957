"""Standard attention in CuPy, the baseline FlashAttention is measured against.

matmul -> softmax -> matmul with the (seqlen_q, seqlen_k) matrix materialised per head, as a CuPy
user would write it: the matmuls in the input dtype (cuBLAS, tensor cores for 16-bit), the softmax
in float32 (as PyTorch's math backend upcasts 16-bit inputs), then P cast back for P V.
"""

from __future__ import annotations

import math


def standard_attention(q, k, v, *, causal=False, scale=None):
    """q: (batch, seqlen_q, heads, head_dim), k, v: (batch, seqlen_k, heads, head_dim), CuPy."""
    import cupy

    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # (batch, heads, seq, head_dim)
    scores = cupy.matmul(qh, kh.transpose(0, 1, 3, 2)).astype(cupy.float32)
    scores *= scale
    if causal:
        i = cupy.arange(seqlen_q)[:, None]
        j = cupy.arange(seqlen_k)[None, :]
        scores[..., j > i + (seqlen_k - seqlen_q)] = -cupy.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = cupy.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = cupy.matmul(probs.astype(q.dtype), vh)
    return cupy.ascontiguousarray(out.transpose(0, 2, 1, 3))


def flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal=False) -> float:
    """Forward FLOPs of attention, 4 b h s_q s_k d (two matmuls), halved for causal."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return f / 2 if causal else f
