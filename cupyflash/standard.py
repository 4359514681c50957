"""Standard attention in CuPy, forward and backward: the baseline FlashAttention is measured against.

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
    out, _ = _forward(q, k, v, causal, scale)
    return out


def standard_attention_forward_backward(q, k, v, dout, *, causal=False, scale=None):
    """Forward, then backward as autograd runs it: P (seqlen_q x seqlen_k per head) is kept from
    the forward, then dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dP * P)), dQ = scale dS K,
    dK = scale dS^T Q, matmuls in the input dtype, the softmax's backward in float32 (float64 for
    float64). Returns out, (dq, dk, dv)."""
    import cupy

    out, (probs, qh, kh, vh, scale) = _forward(q, k, v, causal, scale)
    compute = qh.dtype
    doh = _compute_dtype(dout).transpose(0, 2, 1, 3)
    p_in = probs.astype(compute, copy=False)
    dvh = cupy.matmul(p_in.transpose(0, 1, 3, 2), doh)
    dp = cupy.matmul(doh, vh.transpose(0, 1, 3, 2)).astype(probs.dtype, copy=False)
    dp -= (dp * probs).sum(axis=-1, keepdims=True)
    dp *= probs  # dS
    ds = dp.astype(compute, copy=False)
    dqh = cupy.matmul(ds, kh)
    dqh *= scale
    dkh = cupy.matmul(ds.transpose(0, 1, 3, 2), qh)
    dkh *= scale
    grads = tuple(cupy.ascontiguousarray(g.transpose(0, 2, 1, 3)).astype(q.dtype, copy=False) for g in (dqh, dkh, dvh))
    return out, grads


def _compute_dtype(x):
    """CuPy has no bfloat16 matmul: bfloat16 runs in float32."""
    from cupyflash.validation import BFLOAT16

    return x.astype(numpy.float32) if x.dtype == BFLOAT16 else x


def _forward(q, k, v, causal, scale):
    import cupy

    out_dtype = q.dtype
    q, k, v = (_compute_dtype(x) for x in (q, k, v))
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
    out = cupy.ascontiguousarray(out.transpose(0, 2, 1, 3)).astype(out_dtype, copy=False)
    return out, (probs, qh, kh, vh, q.dtype.type(scale))


def flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal=False) -> float:
    """Forward FLOPs of attention, 4 b h s_q s_k d (two matmuls), halved for causal."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return f / 2 if causal else f


BACKWARD_FLOPS_RATIO = 2.5  # backward = 5 matmuls to the forward's 2 (FlashAttention's convention)
