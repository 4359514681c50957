"""The public forward and backward of variable-length batches, packed with no padding
(FlashAttention-2's varlen layout)."""

from __future__ import annotations

from cupyflash import validation
from cupyflash.api import common


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, causal=False, scale=None,
    return_lse=False, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
):
    """Attention over a batch of sequences of different lengths, packed one after the other with no
    padding (FlashAttention-2's varlen layout, as ``flash_attn_varlen_func``).

    Sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v; each attends only within itself, exactly
    as `attention` on that sequence alone would, with causal, windows and ALiBi aligned to its own
    bottom-right corner. The kernels walk each sequence's own tiles: no padding is computed.

    Parameters
    ----------
    q : array, shape (total_q, heads, head_dim)
    k, v : arrays, shape (total_k, heads_kv, head_dim)
        Arrays, dtypes, strides, GQA/MQA as `attention`.
    cu_seqlens_q, cu_seqlens_k : integer arrays of shape (batch + 1,)
        Cumulative sequence lengths: 0, then each sequence's end, the last equal to total_q
        (total_k). Any integer dtype (int32 as flash-attn's; int64 as torch's cumsum gives) on the
        host or q's GPU, or a list of ints: the rule of every index array here (seqlens_k,
        cache_seqlens). They are checked (starting at 0, non-decreasing, ending at the total); a
        GPU array is read back for that, a small synchronising copy.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence's length (at least that; default: computed from cu_seqlens).
    causal, scale, window, softcap, alibi_slopes : as `attention`, per sequence; alibi_slopes of
        shape (heads,) or (batch, heads).
    dropout_p, seed, offset : as `attention`; sequence b's mask is that of batch entry b of a
        fixed-length batch (`dropout_mask(batch, ...)[b, :, :len_q, :len_k]`).

    Returns
    -------
    out, or (out, lse)
        out (total_q, heads, head_dim) in q's dtype, and lse (heads, total_q) float32 (float64 for
        float64 inputs), in the caller's array type, as `attention`.

    Raises TypeError/ValueError as `attention`, and for bad cu_seqlens (not integers, not starting at
    0, decreasing, a last value other than the packed length, different lengths for q and k) or a
    max_seqlen below the longest sequence. Block masks are not supported with varlen.

    Example
    -------
    >>> import numpy as np, cupyflash
    >>> q = np.random.randn(3 + 5, 2, 16).astype(np.float32)  # two sequences: 3 and 5 tokens
    >>> cu = np.array([0, 3, 8], dtype=np.int32)
    >>> out = cupyflash.attention_varlen(q, q, q, cu, cu, causal=True)
    >>> np.allclose(out[:3], cupyflash.attention(q[None, :3], q[None, :3], q[None, :3], causal=True)[0], atol=1e-6)
    True
    """
    arrays, origins = common.ingest({"q": q, "k": k, "v": v})
    p = validation.check_varlen_args(
        *arrays.values(), *_ingest_cu_seqlens(cu_seqlens_q, cu_seqlens_k, origins["q"]), max_seqlen_q, max_seqlen_k,
        causal=causal, scale=scale, return_lse=return_lse, window=window, softcap=softcap,
    )
    p = validation.check_alibi_slopes(common.ingest_slopes(alibi_slopes, origins["q"]), p)
    return common.forward(arrays, origins, validation.check_dropout(dropout_p, seed, offset, p))


def attention_varlen_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, causal=False,
    scale=None, deterministic=False, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
):
    """Gradients of `attention_varlen`: `attention_backward` for each packed sequence.

    dout and out have q's shape (total_q, heads, head_dim), lse is the forward's (heads,
    total_q); the other arguments as given to the forward, deterministic as `attention_backward`.
    Returns (dq, dk, dv) with the shapes and dtype of q, k, v, in the caller's array type.
    """
    arrays, origins = common.ingest({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse})
    p = validation.check_varlen_backward_args(
        *arrays.values(), *_ingest_cu_seqlens(cu_seqlens_q, cu_seqlens_k, origins["q"]), max_seqlen_q, max_seqlen_k,
        causal=causal, scale=scale, deterministic=deterministic, window=window, softcap=softcap,
    )
    p = validation.check_alibi_slopes(common.ingest_slopes(alibi_slopes, origins["q"]), p)
    return common.backward(arrays, origins, validation.check_dropout(dropout_p, seed, offset, p))


def _ingest_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q_origin) -> tuple:
    return tuple(common.ingest_side_array(cu, name, q_origin)
                 for cu, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")))
