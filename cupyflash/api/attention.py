"""The public forward and backward of fixed-length batches: `attention`, `attention_backward`, and
their block-sparse forms."""

from __future__ import annotations

from cupyflash.api import common, prepared
from cupyflash.problem import Options


def attention(
    q, k, v, *, causal=False, scale=None, return_lse=False, window=None, softcap=None, alibi_slopes=None, seqlens_k=None,
    dropout_p=0.0, seed=None, offset=0,
):
    """Exact softmax attention, computed with FlashAttention-2's tiled online softmax.

    out[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, h]) v[b, j, h]

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads, head_dim)
    k, v : arrays, shape (batch, seqlen_k, heads_kv, head_dim)
        NumPy arrays, CuPy arrays, or GPU arrays of any framework with ``__dlpack__`` (PyTorch,
        JAX). Any strides are accepted as long as the head_dim axis is contiguous, so a
        (batch, heads, seq, head_dim) tensor ``x`` passes as ``x.transpose(0, 2, 1, 3)`` (torch:
        ``x.transpose(1, 2)``) with no copy. dtype float16, bfloat16 (``ml_dtypes.bfloat16``),
        float32 or float64, the same for all three; head_dim any value from 1 to 256.
        heads_kv = heads is multi-head attention; a divisor of heads is grouped-query attention
        (GQA; heads_kv = 1: multi-query, MQA): query head h attends with K/V head
        ``h // (heads // heads_kv)``, read in place (never repeated in memory).
    causal : bool
        Mask key j for query i when ``j > i + (seqlen_k - seqlen_q)``: the diagonal is aligned to
        the bottom-right corner of the score matrix, as in FlashAttention-2. With seqlen_q = 2 and
        seqlen_k = 5 the visible keys are (1 = visible)::

            query 0:  1 1 1 1 0
            query 1:  1 1 1 1 1

        and with seqlen_q = 5, seqlen_k = 2, queries 0-2 see no key (output 0, lse -inf)::

            query 0:  0 0
            query 1:  0 0
            query 2:  0 0
            query 3:  1 0
            query 4:  1 1
    scale : float, optional
        Multiplies q . k before the softmax; default ``1 / sqrt(head_dim)``.
    return_lse : bool
        Also return lse, of shape (batch, heads, seqlen_q), float32 (float64 for float64
        inputs): the natural-log log-sum-exp of each row's scaled, masked scores, which
        `attention_backward` needs.
    window : (left, right), optional
        Sliding-window (local) attention: query i sees keys j with
        ``i + (seqlen_k - seqlen_q) - left <= j <= i + (seqlen_k - seqlen_q) + right``, the
        band aligned bottom-right as causal is. Each side is an int >= 0, or None (or -1, as
        flash-attn spells it) for unbounded. With causal=True both apply (right becomes 0):
        ``causal=True, window=(255, None)`` lets each query see itself and the 255 keys before
        it. Key blocks outside the band are skipped, so the time is proportional to the band's
        width, not to seqlen_k.
    softcap : float, optional
        Caps the scaled scores smoothly, s -> softcap * tanh(s / softcap), before the softmax
        (Gemma 2, Grok). None or 0: none.
    alibi_slopes : array, optional
        ALiBi: adds -slope[h] * |i + seqlen_k - seqlen_q - j| to the (softcapped) score of query
        i and key j, the key's distance from the query's own position, aligned bottom-right as
        causal is. Shape (heads,) or (batch, heads), any real float dtype (used in the kernels'
        accumulator precision); on the host, or on q's GPU. flash-attn's semantics.
    seqlens_k : int array of shape (batch,), optional
        Key padding for padded batches: batch entry b uses only its first seqlens_k[b] keys, as if
        k and v were cut to that length (causal, windows and ALiBi align to seqlen_q and
        seqlens_k[b]); the rest is never read. An integer array on the host (checked: 0 <= s <=
        seqlen_k) or on q's GPU (used as given, clamped to [0, seqlen_k]), or an int. For packed
        batches with no padding at all, see `attention_varlen`.
    dropout_p : float
        Dropout on the attention probabilities (training): each P_ij is kept with probability
        1 - dropout_p and scaled by 1 / (1 - dropout_p), out = (P ∘ Z / (1 - dropout_p)) V; lse
        stays that of P. The keep mask Z comes from a counter-based generator (Philox4x32-10) in
        the kernels, a function of (seed, offset, batch, head, query, key) alone: it is never
        stored, the backward regenerates it, and `cupyflash.dropout_mask` materialises it.
        dropout_p takes effect at 2^-32 resolution. Default 0: no dropout.
    seed : int in [0, 2**64), required when dropout_p > 0
        The generator's key: the same seed and offset give the same mask (pass both again to
        `attention_backward`).
    offset : int in [0, 2**32)
        A second stream selector (e.g. the training step), so one seed serves many calls.

    Returns
    -------
    out, or (out, lse)
        out has q's shape (contiguous) and dtype. A row with no visible key (causal with
        seqlen_q > seqlen_k, or seqlen_k == 0) gives out 0 and lse -inf. NaN and inf in the
        inputs propagate as in the definition: a row whose visible scores take a NaN or inf
        (a NaN or inf in its q, or in a key it sees) gives NaN out and NaN lse; an inf or NaN in v
        reaches the output columns of the rows that see that key. (Hidden keys' values may reach
        rows that share their tile, as standard attention's products spread them to every row.)
        Zero-size inputs (batch, heads or seqlen_q 0) give zero-size results.
        Results come back in the caller's array type: NumPy for NumPy input, CuPy for CuPy,
        a torch.Tensor / jax.Array for those (sharing memory through DLPack, no copy); other
        DLPack frameworks without a ``from_dlpack`` function get the CuPy array.

    Precision: float16/bfloat16 run on tensor cores (sm_80 and newer): every product accumulates
    in float32 and the softmax is float32, with P rounded to the input dtype before P V, as in
    FlashAttention-2 (GPUs older than sm_80 take the scalar kernels, all float32). float64 computes
    in float64: its forward and dK/dV on the FP64 tensor cores (sm_80 and newer, head dims up to
    128), the rest on CUDA cores. float32 computes in float32 on CUDA cores ("highest");
    `cupyflash.set_float32_precision` picks "high" (the forward on the tensor cores as 3xTF32,
    three TF32 products a product: its results within float32's error, gradients taken from them
    up to 1.3x past it) or "medium" (one TF32 product: TF32's error) at head dims up to 128 on
    sm_80 and newer.

    Where it runs: GPU inputs on the device that holds them, on CuPy's current stream
    (``cupy.cuda.get_current_stream()``). Arrays imported through DLPack are ordered after their
    producer's current stream, and a torch/JAX result is ordered before the consumer's stream on
    export; to run on a torch side stream, enter ``cupy.cuda.ExternalStream(s.cuda_stream)``.
    NumPy inputs are copied to the current CuPy device and the result copied back; with no GPU
    they run through the NumPy tiled algorithm (`cupyflash.reference.tiled_attention`) in
    float32 as the kernels accumulate (float64 for float64 inputs), the result in the input dtype.

    Raises TypeError or ValueError, before any device work and leaving the inputs untouched, for
    non-array inputs, unsupported or mismatched dtypes, inconsistent shapes, a non-contiguous
    head_dim axis, head_dim outside 1..256, arrays on different devices, or a scale that is not
    a finite positive number.

    Example
    -------
    >>> import numpy as np, cupyflash
    >>> q = np.random.randn(1, 5, 2, 16).astype(np.float32)
    >>> kv = np.random.randn(1, 7, 2, 16).astype(np.float32)
    >>> out, lse = cupyflash.attention(q, kv, kv, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((1, 5, 2, 16), (1, 2, 5))
    """
    if prepared.plain(alibi_slopes, seqlens_k, dropout_p, seed, offset):  # (a loop's usual call: api/prepared.py)
        return prepared.forward_call(q, k, v, causal, scale, window, softcap, return_lse)
    return common.forward_call(
        {"q": q, "k": k, "v": v},
        Options(causal=causal, scale=scale, return_lse=return_lse, window=window, softcap=softcap,
                alibi_slopes=alibi_slopes, seqlens_k=seqlens_k, dropout_p=dropout_p, seed=seed, offset=offset))


def block_sparse_attention(
    q, k, v, block_mask, *, causal=False, scale=None, return_lse=False, window=None, softcap=None, alibi_slopes=None,
    dropout_p=0.0, seed=None, offset=0,
):
    """Block-sparse FlashAttention (FlashAttention, §3.3, Algorithm 5): `attention` restricted to
    the nonzero blocks of `block_mask`.

    The seqlen_q x seqlen_k attention matrix is cut into blocks of ``block_mask.block_size``
    (default 128 x 128); keys of a zero block are hidden from that block's queries, as causal
    hides keys, and the kernels never load their K, V tiles, so the time falls in proportion to
    the mask's density. With causal=True both apply: a key is visible when the mask's block is
    nonzero and j <= i + seqlen_k - seqlen_q; the diagonal's blocks are the only ones masked per
    element (`BlockMask.partial`).

    Parameters
    ----------
    q, k, v, causal, scale, return_lse, window, softcap, alibi_slopes, dropout_p, seed, offset :
        as `attention` (a window applies on top of the mask: a key is visible when both keep it)
    block_mask : cupyflash.BlockMask
        Of shape (heads or 1, ceil(seqlen_q / block_q), ceil(seqlen_k / block_k)), optionally
        with a leading batch axis (batch or 1). Its block size must be a whole number of the
        kernels' tiles for the dtype and head_dim (128 always is); a ValueError says which
        otherwise.

    Returns
    -------
    out, or (out, lse), as `attention`. A query row whose blocks are all zero (or all hidden by
    causal) gives out 0 and lse -inf.

    Example
    -------
    >>> import numpy as np, cupyflash
    >>> q, k, v = (np.random.randn(1, 256, 2, 16).astype(np.float32) for _ in range(3))
    >>> mask = cupyflash.BlockMask.from_dense(np.array([[[True, False], [True, True]]]))  # 128 x 128 blocks
    >>> out = cupyflash.block_sparse_attention(q, k, v, mask)  # queries 0-127 see keys 0-127 only
    >>> out.shape
    (1, 256, 2, 16)
    """
    return common.forward_call(
        {"q": q, "k": k, "v": v},
        Options(causal=causal, scale=scale, return_lse=return_lse, window=window, softcap=softcap,
                alibi_slopes=alibi_slopes, block_mask=block_mask, dropout_p=dropout_p, seed=seed, offset=offset))


def attention_backward(
    dout, q, k, v, out, lse, *, causal=False, scale=None, deterministic=False, window=None, softcap=None,
    alibi_slopes=None, seqlens_k=None, dropout_p=0.0, seed=None, offset=0,
):
    """Gradients of attention: FlashAttention-2's backward pass, recomputing P from the saved lse.

    Given dout = dL/d(out) for ``out, lse = attention(q, k, v, causal=..., scale=...,
    return_lse=True)``, returns ``(dq, dk, dv)`` = dL/dq, dL/dk, dL/dv. The
    ``seqlen_q x seqlen_k`` attention matrix is never stored; each tile of it is recomputed from
    q, k and lse. Extra memory is O(seqlen): two float32 vectors per (batch, head, query) and,
    unless deterministic, a float32 dq accumulator of q's size (float64 for float64 inputs).

    Parameters
    ----------
    dout, out : arrays with q's shape (batch, seqlen_q, heads, head_dim) and dtype
    q, k, v : the forward's inputs, as in `attention` (any strides with a contiguous head_dim;
        k, v with heads_kv heads for GQA/MQA)
    lse : array, shape (batch, heads, seqlen_q), float32 (float64 for float64 inputs)
        The forward's log-sum-exp; any strides.
    causal, scale, window, softcap, alibi_slopes, seqlens_k : as given to the forward (same
        bottom-right alignment; padding keys get dk = dv = 0). With a softcap, dq and dk carry its
        derivative 1 - tanh^2; the slopes get no gradient (they are constants, as in flash-attn).
    dropout_p, seed, offset : as given to the forward: the kernels regenerate its dropout mask.
    deterministic : bool
        False (default): dq is summed across key blocks with float32 atomic adds, whose order
        varies, so the last bits of dq can differ from run to run. True: dq comes from a
        second kernel, parallel over query blocks, that recomputes the score tiles and sums
        each row of dq in a fixed order; results are bitwise reproducible on one GPU. It
        costs more time (docs/performance.md) and no extra memory.

    Returns
    -------
    (dq, dk, dv) with the shapes and dtype of q, k, v, in the caller's array type (as
    `attention`). Rows that see no key get dq = 0 and contribute nothing to dk and dv. With
    GQA/MQA, dk and dv of a K/V head are summed over its group of query heads on chip (float32),
    in a fixed order: no expanded copy, and no atomics.
    Precision: every product accumulates in float32 for 16-bit and float32 inputs, float64 for
    float64; each gradient is rounded once to the input dtype. On tensor cores (16-bit inputs,
    sm_80+) P and dS are rounded to the input dtype before they enter a product, as in
    FlashAttention-2; float64's dK/dV kernel runs on the FP64 tensor cores (head dims up to 128),
    its products rounded as float64.

    Where it runs, and what raises, as for `attention`: TypeError/ValueError before any device
    work for bad arguments (dout/out not of q's shape and dtype, lse not of shape
    (batch, heads, seqlen_q) and dtype float32/float64 as above, non-boolean deterministic).
    With no GPU, NumPy inputs run through `cupyflash.reference.tiled_attention_backward`.

    Example
    -------
    >>> import numpy as np, cupyflash
    >>> q, k, v = (np.random.randn(1, 5, 2, 16).astype(np.float32) for _ in range(3))
    >>> out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    >>> dout = np.ones_like(out)
    >>> dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> dq.shape, dk.dtype
    ((1, 5, 2, 16), dtype('float32'))
    """
    if prepared.plain(alibi_slopes, seqlens_k, dropout_p, seed, offset):
        return prepared.backward_call(dout, q, k, v, out, lse, causal, scale, window, softcap, deterministic)
    return common.backward_call(
        {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse},
        Options(causal=causal, scale=scale, deterministic=deterministic, window=window, softcap=softcap,
                alibi_slopes=alibi_slopes, seqlens_k=seqlens_k, dropout_p=dropout_p, seed=seed, offset=offset))


def block_sparse_attention_backward(
    dout, q, k, v, out, lse, block_mask, *, causal=False, scale=None, deterministic=False, window=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
):
    """Gradients of `block_sparse_attention`: `attention_backward` over the nonzero blocks of
    `block_mask` only (pass the mask and options the forward had). The dK/dV pass walks, per key
    block, the query blocks of its mask column; the dQ sums (atomic, or the deterministic pass
    over each mask row) likewise skip zero blocks. Keys that no query sees get dk = dv = 0; rows
    that see no key get dq = 0. Arguments, results and errors as `attention_backward`, and the
    mask as `block_sparse_attention`."""
    return common.backward_call(
        {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse},
        Options(causal=causal, scale=scale, deterministic=deterministic, window=window, softcap=softcap,
                alibi_slopes=alibi_slopes, block_mask=block_mask, dropout_p=dropout_p, seed=seed, offset=offset))
