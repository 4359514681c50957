"""NumPy float64 references for cupyflash.

- `attention`: the definition. Materialises the (seqlen_q, seqlen_k) scores per head; used to
  validate every kernel and checked itself against scipy.special.softmax and brute-force loops.
- `tiled_attention`: FlashAttention-2's forward (Algorithm 1) in NumPy with the kernel's own block
  schedule: running max m, running sum l, rescaling, lse, causal block skipping. It is the CPU
  fallback of `cupyflash.attention` and agrees with `attention` to float64 rounding.

Both take the arguments of `cupyflash.attention` (NumPy or CuPy arrays, any supported dtype),
compute in float64 and return float64 `out` of shape (batch, seqlen_q, heads, head_dim) and, with
return_lse=True, float64 `lse` of shape (batch, heads, seqlen_q).
"""

from __future__ import annotations

import bisect
import math

import numpy

from cupyflash import _dropout, _instantiations, _validation

LOG2E = math.log2(math.e)  # log2(e): exp(x) = exp2(x * log2(e))


def _as_float64(x):
    if type(x).__module__.split(".")[0] == "cupy":
        x = x.get()
    elif not isinstance(x, numpy.ndarray) and hasattr(x, "__dlpack__"):
        x = numpy.from_dlpack(x)
    return numpy.asarray(x).astype(numpy.float64)


def _prepare(q, k, v, causal, scale, return_lse, block_mask=None, window=None, softcap=None, alibi_slopes=None,
             dropout=(0.0, None, 0)):
    """The validated problem and q, k, v in float64, k and v repeated to q's heads (GQA/MQA);
    ALiBi slopes, if any, as float64 NumPy in the problem; dropout = (dropout_p, seed, offset)."""
    q, k, v = (x if hasattr(x, "ndim") else numpy.asarray(x) for x in (q, k, v))
    problem = _validation.check_attention_args(
        q, k, v, causal=causal, scale=scale, return_lse=return_lse, window=window, softcap=softcap
    )
    if alibi_slopes is not None:
        problem = _validation.check_alibi_slopes(_as_float64(alibi_slopes), problem)
    if block_mask is not None:
        problem = _validation.check_block_mask(block_mask, problem, for_kernels=False)
    problem = _validation.check_dropout(*dropout, problem)
    k, v = (numpy.repeat(_as_float64(x), problem.kv_group, axis=2) for x in (k, v))
    return problem, _as_float64(q), k, v


def _keep_mask(p, batch_start: int):
    """Dropout's keep mask (batch, heads, seqlen_q, seqlen_k), the kernels' (`cupyflash.dropout_mask`),
    for batch entries from batch_start; None without dropout."""
    if not p.dropout:
        return None
    return _dropout.keep_mask_numpy(p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.dropout_p, p.seed, p.offset, batch_start)


def _sum_groups(x, group: int):
    """A gradient with respect to K or V repeated to q's heads, (batch, seq, heads, d), summed
    over each group of query heads into (batch, seq, heads_kv, d)."""
    b, s, h, d = x.shape
    return x.reshape(b, s, h // group, group, d).sum(axis=3)


def _hidden(p) -> numpy.ndarray | None:
    """Boolean, broadcastable to (batch, heads, seqlen_q, seqlen_k): True where key j is hidden
    from query i by causal, the window or the block mask; None when nothing is."""
    hidden = _tile_hidden(p, 0, p.seqlen_q, 0, p.seqlen_k) if p.local else None
    if p.block_mask is not None:
        outside = ~p.block_mask.element_mask(p.seqlen_q, p.seqlen_k)
        hidden = outside if hidden is None else outside | hidden
    return hidden


def causal_mask(seqlen_q: int, seqlen_k: int):
    """Boolean (seqlen_q, seqlen_k): True where key j is hidden from query i, j > i + seqlen_k - seqlen_q."""
    return band_mask(seqlen_q, seqlen_k, None, 0)


def band_mask(seqlen_q: int, seqlen_k: int, left: int | None, right: int | None):
    """Boolean (seqlen_q, seqlen_k): True where key j is outside query i's window, that is
    j < i + seqlen_k - seqlen_q - left or j > i + seqlen_k - seqlen_q + right (None: unbounded)."""
    return _band_tile(seqlen_q, seqlen_k, left, right, 0, seqlen_q, 0, seqlen_k)


def _tile_hidden(p, row0, rows, col0, cols):
    """The problem's band_mask, for the tile of queries [row0, row0 + rows) and keys [col0, col0 + cols)."""
    return _band_tile(p.seqlen_q, p.seqlen_k, *p.band, row0, rows, col0, cols)


def _band_tile(seqlen_q, seqlen_k, left, right, row0, rows, col0, cols):
    i = numpy.arange(row0, row0 + rows)[:, None] + (seqlen_k - seqlen_q)
    j = numpy.arange(col0, col0 + cols)[None, :]
    hidden = numpy.zeros((rows, cols), bool)
    if left is not None:
        hidden |= j < i - left
    if right is not None:
        hidden |= j > i + right
    return hidden


def _modify_scores(scores, p, compute, row0=0, col0=0, bs=slice(None), hs=slice(None), unit=1.0):
    """Softcap, then ALiBi, on scaled scores (batch, heads, rows, cols) of queries from row0 and
    keys from col0 (bs, hs: the batch entries and heads they belong to), in `compute` precision;
    unit = log2(e) for scores in log2 units. Returns (scores, derivative): the derivative of the
    modified score in the plain one (1 - tanh^2), or None without a softcap. Masked (-inf)
    scores must be masked again afterwards."""
    derivative = None
    if p.softcap is not None:
        cap = compute(p.softcap * unit)
        t = numpy.tanh(scores / cap)
        derivative = 1 - t * t
        scores = cap * t
    if p.alibi_slopes is not None:
        rows, cols = scores.shape[-2:]
        i = numpy.arange(row0, row0 + rows)[:, None] + (p.seqlen_k - p.seqlen_q)
        j = numpy.arange(col0, col0 + cols)[None, :]
        slopes = numpy.broadcast_to(p.alibi_slopes, (p.batch, p.heads))[bs, hs].astype(compute) * compute(unit)
        scores = scores - slopes[:, :, None, None] * numpy.abs(i - j).astype(compute)
    return scores, derivative


def _band_cuts(p, row0, rows, col0, cols) -> bool:
    """The kernels' Band::cuts: whether an edge of the band runs through the tile."""
    first, last = p.kernel_band()
    return col0 + cols - 1 > row0 + last or col0 < row0 + rows - 1 + first


def attention(
    q, k, v, *, causal=False, scale=None, return_lse=False, block_mask=None, window=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0,
):
    """Exact attention in float64, materialising the scores. Semantics of `cupyflash.attention`
    (with block_mask, of `cupyflash.block_sparse_attention`), GQA/MQA, window, softcap, ALiBi and
    dropout included: with dropout_p > 0, out = (P ∘ Z / (1 - p)) V with the kernels' keep mask Z
    (`cupyflash.dropout_mask`) for batch entries from dropout_batch_start (a packed sequence's
    index, when references run sequence by sequence); lse is that of P, before dropout."""
    p, q, k, v = _prepare(q, k, v, causal, scale, return_lse, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    out, lse = _materialised_attention(q, k, v, p, numpy.float64, None, _keep_mask(p, dropout_batch_start))
    return (out, lse) if p.return_lse else out


def block_sparse_attention(q, k, v, block_mask, *, causal=False, scale=None, return_lse=False, window=None, **mods):
    """Block-sparse attention in float64: `attention` with the block mask expanded to an element
    mask (keys of zero blocks hidden, as causal hides keys). Semantics of
    `cupyflash.block_sparse_attention`: a row that sees no key gives out 0 and lse -inf. mods:
    softcap, alibi_slopes."""
    return attention(
        q, k, v, causal=causal, scale=scale, return_lse=return_lse, block_mask=block_mask, window=window, **mods
    )


def attention_decode(
    q, k_cache, v_cache, cache_seqlens=None, *, k_new=None, v_new=None, causal=False, window=None, scale=None,
    return_lse=False, softcap=None, alibi_slopes=None,
):
    """KV-cache decoding in float64 (semantics of `cupyflash.attention_decode`), one sequence at a
    time: its cached keys, then k_new, attended to with `attention` (softcap and ALiBi slopes of
    shape (heads,) or (batch, heads) included). The caches are left as they are (the append
    happens on copies)."""
    q = _as_float64(q)
    k, v = numpy.array(_as_float64(k_cache)), numpy.array(_as_float64(v_cache))
    batch, seqlen_q, heads, _ = q.shape
    lengths = numpy.full(batch, k.shape[1]) if cache_seqlens is None else _as_float64(cache_seqlens).reshape(-1)
    lengths = numpy.broadcast_to(lengths, (batch,)).astype(numpy.int64)
    if k_new is not None:
        k_new, v_new = _as_float64(k_new), _as_float64(v_new)
        for b in range(batch):
            k[b, lengths[b] : lengths[b] + k_new.shape[1]] = k_new[b]
            v[b, lengths[b] : lengths[b] + k_new.shape[1]] = v_new[b]
        lengths = lengths + k_new.shape[1]
    out = numpy.zeros(q.shape)
    lse = numpy.full((batch, heads, seqlen_q), -numpy.inf)
    slopes = None if alibi_slopes is None else _as_float64(alibi_slopes).reshape(-1, heads)
    for b in range(batch):
        args = (q[b : b + 1], k[b : b + 1, : lengths[b]], v[b : b + 1, : lengths[b]])
        row = None if slopes is None else slopes[b % slopes.shape[0]]
        o, l = attention(*args, causal=causal, scale=scale, return_lse=True, window=window, softcap=softcap,
                         alibi_slopes=row)
        out[b], lse[b] = o[0], l[0]
    return (out, lse) if return_lse else out


def attention_in_precision(
    q, k, v, dtype, *, causal=False, scale=None, return_lse=False, block_mask=None, window=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0,
):
    """Standard attention done in `dtype`'s precision: the baseline that sets test tolerances.

    float32/float64 compute in their own precision. For 16-bit dtypes the arithmetic is float32
    (as tensor-core matmuls and a float32 softmax) with the scores, the probabilities and the
    output rounded to `dtype`, as a framework's 16-bit standard attention does. Returns float64.
    """
    p, q, k, v = _prepare(q, k, v, causal, scale, return_lse, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    name = _validation.dtype_name(dtype, "dtype")
    compute = numpy.float64 if name == "float64" else numpy.float32
    rounding = numpy.dtype(dtype) if name in ("float16", "bfloat16") else None
    out, lse = _materialised_attention(q, k, v, p, compute, rounding, _keep_mask(p, dropout_batch_start))
    return (out, lse) if p.return_lse else out


def error_bound(ref, lowp, dtype_name: str, magnitude: float | None = None) -> float:
    """Tolerance rule (after flash-attn's tests): a kernel's max |error| against the float64
    reference may be at most twice that of the same computation done in the input precision
    (`attention_in_precision`), plus a noise floor of a few units in the last place.

    The floor is relative to the result's largest value, or, for float32/float64 when
    `magnitude` is given, to the size of the largest terms the result is summed from
    (`output_term_magnitude` for an output, `gradient_term_magnitudes` for gradients). Where those terms cancel (a
    gradient whose dP - D is nearly 0) the rounding noise follows them, not the small result, and
    a kernel's hardware exp2 (2 ulp) and summation order differ from the baseline's by that much.
    For 16-bit dtypes the baseline's own rounding of P, dP and dS dominates, and the floor stays
    relative to the result."""
    ref = numpy.asarray(ref, dtype=numpy.float64)
    lowp_err = float(numpy.abs(numpy.asarray(lowp, dtype=numpy.float64) - ref).max(initial=0.0))
    scale = float(numpy.abs(ref).max(initial=0.0))
    if magnitude is not None and dtype_name in ("float32", "float64"):
        scale = max(scale, float(magnitude))
    return 2.0 * lowp_err + noise_floor(dtype_name) * max(1.0, scale)


def noise_floor(dtype_name: str) -> float:
    """Relative rounding noise allowed beyond the 2x rule: one ulp of a 16-bit output, 4 ulp of
    float32. For float64 the same-precision computation is the reference itself (error 0), so the
    floor alone covers summing thousands of terms in another order: 64 ulp."""
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}[dtype_name]
    return eps * {"float16": 1, "bfloat16": 1, "float32": 4, "float64": 64}[dtype_name]


def _materialised_attention(q, k, v, p, compute, rounding, keep=None):
    out, lse, _, _, _ = _materialised_forward(q, k, v, p, compute, rounding, keep)
    return out.transpose(0, 2, 1, 3).astype(numpy.float64), lse[..., 0].astype(numpy.float64)


def _materialised_forward(q, k, v, p, compute, rounding, keep=None):
    """(out, lse, probs, derivative, dropped) in (batch, heads, seq, ...) layout, in `compute`
    precision; derivative: the score modifiers' (`_modify_scores`), None without a softcap; dropped:
    the probabilities V is weighed with, P ∘ Z / (1 - p) under dropout's keep mask `keep`, else P."""

    def rounded(x):
        return x if rounding is None else x.astype(rounding).astype(compute)

    qh, kh, vh = (x.astype(compute).transpose(0, 2, 1, 3) for x in (q, k, v))  # (b, h, seq, d)
    scores = rounded(qh @ kh.transpose(0, 1, 3, 2)) * compute(p.scale)
    if p.score_mod:  # a framework's softcapped, biased scores: a tensor of the dtype again
        scores, derivative = _modify_scores(scores, p, compute)
        scores = rounded(scores)
    else:
        derivative = None
    hidden = _hidden(p)
    if hidden is not None:
        scores = numpy.where(hidden, compute(-numpy.inf), scores)
    m = scores.max(axis=-1, keepdims=True, initial=-numpy.inf)
    m_safe = numpy.where(numpy.isneginf(m), 0.0, m).astype(compute)  # no-key rows: all-zero weights
    weights = numpy.exp(scores - m_safe)
    l = weights.sum(axis=-1, keepdims=True)
    probs = rounded(numpy.divide(weights, l, out=numpy.zeros_like(weights), where=l > 0))
    dropped = probs if keep is None else rounded(numpy.where(keep, probs * compute(_dropout.rescale(p.dropout_p)), 0.0))
    out = rounded(dropped @ vh)
    with numpy.errstate(divide="ignore"):
        lse = numpy.where(l > 0, m_safe + numpy.log(l), -numpy.inf)
    return out, lse, probs, derivative, dropped


# --------------------------------------------------------------------------- backward


def attention_backward(
    dout, q, k, v, *, causal=False, scale=None, block_mask=None, window=None, softcap=None, alibi_slopes=None,
    dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0,
):
    """Exact gradients (dq, dk, dv) of sum(dout * attention(q, k, v)), in float64.

    With S = scale Q K^T, P = softmax(S) (masked entries 0) and O = P V:
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),  dQ = scale dS K,  dK = scale dS^T Q.
    A softcap multiplies dS by its derivative 1 - tanh^2; ALiBi's bias has no effect on it.
    Dropout (keep mask Z, as `attention`): dV = (P ∘ Z / (1 - p))^T dO, and dS takes dP ∘ Z / (1 - p).
    Materialises P; arguments as `attention`, dout with q's shape. Returns float64 arrays with
    the shapes of q, k, v (GQA/MQA: dk, dv summed over each K/V head's group of query heads).
    """
    p, dout, q, k, v = _prepare_backward(dout, q, k, v, causal, scale, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    return _materialised_backward(dout, q, k, v, p, numpy.float64, None, _keep_mask(p, dropout_batch_start))


def block_sparse_attention_backward(dout, q, k, v, block_mask, *, causal=False, scale=None, window=None, **mods):
    """Exact gradients (dq, dk, dv) of `block_sparse_attention`, in float64 (`attention_backward`
    with the block mask expanded to elements)."""
    return attention_backward(dout, q, k, v, causal=causal, scale=scale, block_mask=block_mask, window=window, **mods)


def output_term_magnitude(
    q, k, v, *, causal=False, scale=None, block_mask=None, window=None, softcap=None, alibi_slopes=None,
    dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0,
) -> float:
    """For `error_bound`: the size an output's rounding noise follows. out_i = sum_j P_ij v_j with
    P_ij = exp(s_ij - lse_i), and a float type resolves an exponent of size |s| only to about
    |s|·eps, a relative error every P_ij carries into the sum: max|v| · max(1, max|s_ij|) over the
    visible scores s = scale·q k^T (softcapped, ALiBi-biased), times dropout's 1 / (1 - p).
    Arguments as `attention`."""
    p, q, k, v = _prepare(q, k, v, causal, scale, False, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    return float(numpy.abs(v).max(initial=0.0)) * _exponent_size(p, q, k) * _dropout.rescale(p.dropout_p)


def lse_term_magnitude(
    q, k, v, *, causal=False, scale=None, block_mask=None, window=None, softcap=None, alibi_slopes=None,
    dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0,
) -> float:
    """For `error_bound` on lse: lse_i = log sum_j exp(s_ij) carries its scores' rounding, and a
    score is a sum of head_dim products scale·q_d k_d, whose rounding follows the size of those
    terms, not of the sum: the largest visible scale·sum_d |q_d k_d|, and at least max(1, max|s|,
    max|lse|) (`gradient_exponent_size`). A kernel's dot products and the float32 baseline's
    (`attention_in_precision`) are summed in different orders, by as much as that size's eps.
    Arguments as `attention` (dropout leaves lse as it is)."""
    p, q, k, v = _prepare(q, k, v, causal, scale, True, block_mask, window, softcap, alibi_slopes)
    qh, kh = (numpy.abs(x).transpose(0, 2, 1, 3) for x in (q, k))
    terms = (qh @ kh.transpose(0, 1, 3, 2)) * p.scale
    hidden = _hidden(p)
    if hidden is not None:
        terms = numpy.where(hidden, 0.0, terms)
    _, lse, _, _, _ = _materialised_forward(q, k, v, p, numpy.float64, None)
    return max(float(terms.max(initial=0.0)), _exponent_size(p, q, k, lse))


def _exponent_size(p, q, k, lse=None) -> float:
    """max(1, the largest visible |s_ij|, and with `lse` its largest finite |lse_i|): the size of
    the operands of the exponents P_ij is computed from, which a float type resolves only to that
    size times its eps (`output_term_magnitude`, `gradient_term_magnitudes`)."""
    qh, kh = (x.transpose(0, 2, 1, 3) for x in (q, k))
    s = numpy.abs(_modify_scores((qh @ kh.transpose(0, 1, 3, 2)) * p.scale, p, numpy.float64)[0])
    hidden = _hidden(p)
    if hidden is not None:
        s = numpy.where(hidden, 0.0, s)
    size = max(1.0, float(s.max(initial=0.0)))
    if lse is not None:
        size = max(size, float(numpy.abs(lse[numpy.isfinite(lse)]).max(initial=0.0)))
    return size


def gradient_exponent_size(
    q, k, v, *, causal=False, scale=None, block_mask=None, window=None, softcap=None, alibi_slopes=None,
    dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0,
) -> float:
    """The factor `gradient_term_magnitudes` multiplies each of its terms by: max(1, max|s_ij|,
    max|lse_i|) over visible scores and rows that see a key (dropout does not change it).
    Arguments as `attention`."""
    p, q, k, v = _prepare(q, k, v, causal, scale, True, block_mask, window, softcap, alibi_slopes)
    _, lse, _, _, _ = _materialised_forward(q, k, v, p, numpy.float64, None)
    return _exponent_size(p, q, k, lse)


def gradient_term_magnitudes(
    dout, q, k, v, *, causal=False, scale=None, block_mask=None, window=None, softcap=None, alibi_slopes=None,
    dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0,
) -> tuple[float, float, float]:
    """For `error_bound`: the size of the largest terms summed into dq, dk and dv.

    dq_i = scale·sum_j P_ij (dP_ij - D_i) k_j, with each row of P summing to 1:
        scale · max(|dP| + |D|) · max|k|;
    dk_j = scale·sum_i P_ij (dP_ij - D_i) q_i: the same with max|q|, times the largest column sum
        of P;
    dv_j = sum_i P_ij dO_i: max|dO| times the largest column sum of P
    (GQA/MQA: column sums over each K/V head's group of query heads). With dropout, dP and the
    column sums are dropout's P ∘ Z / (1 - p) and dP ∘ Z / (1 - p).
    Each is then multiplied, as `output_term_magnitude` is, by the size of the exponents' operands:
    the backward rebuilds P_ij = exp(s_ij - lse_i) from the lse the forward stored (FlashAttention-2's
    Algorithm 2; float32 unless the inputs are float64), so every P_ij carries a relative error of
    about max(|s_ij|, |lse_i|)·eps. Standard attention's softmax, exp(s_ij - m_i) / l_i, has the
    |s|·eps part only, so the baseline does not show the lse part:
    max(1, max|s_ij|, max|lse_i|) over visible scores and rows that see a key.
    Arguments as `attention_backward`; computed in float64 from the materialised P."""
    p, dout, q, k, v = _prepare_backward(dout, q, k, v, causal, scale, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    out, lse, _, _, probs = _materialised_forward(q, k, v, p, numpy.float64, None, _keep_mask(p, dropout_batch_start))
    doh, vh = (x.transpose(0, 2, 1, 3) for x in (dout, v))
    dp = numpy.abs(doh @ vh.transpose(0, 1, 3, 2)) * _dropout.rescale(p.dropout_p)
    d = numpy.abs((doh * out).sum(axis=-1, keepdims=True))
    spread = float((dp + d).max(initial=0.0))
    columns = probs.sum(axis=-2)  # (batch, heads, seqlen_k)
    b, h, s = columns.shape
    column_sum = float(columns.reshape(b, h // p.kv_group, p.kv_group, s).sum(axis=2).max(initial=0.0))
    biggest = [float(numpy.abs(x).max(initial=0.0)) for x in (q, k, dout)]
    exponent = _exponent_size(p, q, k, lse)
    return tuple(exponent * x for x in (p.scale * spread * biggest[1], p.scale * spread * biggest[0] * column_sum,
                                        biggest[2] * column_sum))


def attention_backward_in_precision(
    dout, q, k, v, dtype, *, causal=False, scale=None, block_mask=None, window=None, softcap=None, alibi_slopes=None,
    dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0,
):
    """Standard attention's backward done in `dtype`'s precision (the tolerance baseline):
    float32/float64 in their own precision; for 16-bit dtypes float32 arithmetic with S, P, O,
    dP, dS and the gradients rounded to `dtype`, as a framework's autograd of 16-bit standard
    attention does (GQA/MQA: each query head's dk, dv rounded, then summed over the group).
    Returns float64."""
    p, dout, q, k, v = _prepare_backward(dout, q, k, v, causal, scale, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    name = _validation.dtype_name(dtype, "dtype")
    compute = numpy.float64 if name == "float64" else numpy.float32
    rounding = numpy.dtype(dtype) if name in ("float16", "bfloat16") else None
    return _materialised_backward(dout, q, k, v, p, compute, rounding, _keep_mask(p, dropout_batch_start))


def _prepare_backward(dout, q, k, v, causal, scale, block_mask=None, window=None, softcap=None, alibi_slopes=None,
                      dropout=(0.0, None, 0)):
    p, q, k, v = _prepare(q, k, v, causal, scale, False, block_mask, window, softcap, alibi_slopes, dropout)
    dout = _as_float64(dout)
    if dout.shape != q.shape:
        raise ValueError(f"dout must have q's shape {q.shape}, got {dout.shape}")
    return p, dout, q, k, v


def _materialised_backward(dout, q, k, v, p, compute, rounding, keep=None):
    def rounded(x):
        return x if rounding is None else x.astype(rounding).astype(compute)

    out, _, probs, derivative, dropped = _materialised_forward(q, k, v, p, compute, rounding, keep)
    qh, kh, vh, doh = (x.astype(compute).transpose(0, 2, 1, 3) for x in (q, k, v, dout))
    scale = compute(p.scale)
    dv = rounded(dropped.transpose(0, 1, 3, 2) @ doh)
    dp = rounded(doh @ vh.transpose(0, 1, 3, 2))
    if keep is not None:  # the gradient of P ∘ Z / (1 - p) in P
        dp = rounded(numpy.where(keep, dp * compute(_dropout.rescale(p.dropout_p)), 0.0))
    # Softmax's Jacobian-vector product needs rowsum(dP * P); FlashAttention uses the equal
    # rowsum(dO * O) (O as stored), and so does this baseline: the two round differently, and
    # with one visible key dP - D cancels exactly in the first form only.
    d = (doh * out).sum(axis=-1, keepdims=True)
    ds = probs * (dp - d)
    ds = rounded(ds if derivative is None else ds * derivative)
    dq = rounded(ds @ kh) * scale
    dk = rounded(ds.transpose(0, 1, 3, 2) @ qh) * scale
    dq, dk, dv = (rounded(x).transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    if p.kv_group > 1:
        dk, dv = (rounded(_sum_groups(x, p.kv_group)) for x in (dk, dv))
    return tuple(x.astype(numpy.float64) for x in (dq, dk, dv))


def tiled_attention(
    q, k, v, *, causal=False, scale=None, return_lse=False, block_m=None, block_n=None, block_mask=None, window=None,
    softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0,
):
    """FlashAttention-2's forward, block by block, as the GPU kernel schedules it (float64).

    block_m, block_n default to the kernel's tile for this dtype and head dim (with a block mask,
    cut to divide its block size). With block_mask (block-sparse FlashAttention, Algorithm 5), a
    query block visits only the key blocks its mask row lists, in the kernels' order. With causal or
    a window, only the key blocks in its band. softcap and alibi_slopes modify each tile's scores;
    dropout regenerates each tile's keep mask from its coordinates, as the kernels do (arguments as
    `attention`).
    """
    p, q, k, v = _prepare(q, k, v, causal, scale, return_lse, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    tile = _instantiations.tile_shape(p.dtype_name, _instantiations.padded_head_dim(p.head_dim))
    block_m, block_n = _tiles(p, block_m or tile.block_m, block_n or tile.block_n)
    sq, sk = p.seqlen_q, p.seqlen_k
    out = numpy.empty((p.batch, sq, p.heads, p.head_dim))
    lse = numpy.empty((p.batch, p.heads, sq))
    scale_log2 = p.scale * LOG2E  # scores in log2 units, so the kernel needs only exp2

    for slab, bs, hs in _mask_slabs(p):  # batch entries and heads that share one mask slab
        for row0 in range(0, sq, block_m):  # one thread block per query block i (and head, batch)
            rows = min(block_m, sq - row0)
            q_i = q[bs, row0 : row0 + rows, hs] * scale_log2  # Q_i, prescaled, on chip for the whole loop
            o_i = numpy.zeros((q_i.shape[0], q_i.shape[2], rows, p.head_dim))
            m_i = numpy.full(o_i.shape[:3] + (1,), -numpy.inf)
            l_i = numpy.zeros_like(m_i)
            for n_block in key_tiles(p, slab, row0, rows, block_n):
                col0 = n_block * block_n
                cols = min(block_n, sk - col0)
                s_ij = numpy.einsum("bqhd,bkhd->bhqk", q_i, k[bs, col0 : col0 + cols, hs])
                s_ij, _ = _modify_scores(s_ij, p, numpy.float64, row0, col0, bs, hs, LOG2E)
                # Like the kernel, mask only tiles an edge of the band cuts through (a slice needs
                # no seqlen_k mask: it holds no key past the end).
                if p.local and _band_cuts(p, row0, rows, col0, cols):
                    s_ij[..., _tile_hidden(p, row0, rows, col0, cols)] = -numpy.inf
                m_new = numpy.maximum(m_i, s_ij.max(axis=-1, keepdims=True))
                m_safe = numpy.where(numpy.isneginf(m_new), 0.0, m_new)  # no -inf - -inf = NaN
                p_ij = numpy.exp2(s_ij - m_safe)
                rescale = numpy.exp2(m_i - m_safe)
                l_i = l_i * rescale + p_ij.sum(axis=-1, keepdims=True)
                if p.dropout:  # P_ij ∘ Z_ij, after l_i took every probability in
                    p_ij = p_ij * _tile_keep(p, dropout_batch_start, bs, hs, row0, rows, col0, cols)
                o_i = o_i * rescale + numpy.einsum("bhqk,bkhd->bhqd", p_ij, v[bs, col0 : col0 + cols, hs])
                m_i = m_new
            # Epilogue: one final rescale of O_i (and dropout's 1 / (1 - p)), lse written once; rows
            # that saw no key get 0 / -inf.
            o_i = numpy.divide(o_i * _dropout.rescale(p.dropout_p), l_i, out=numpy.zeros_like(o_i), where=l_i > 0)
            out[bs, row0 : row0 + rows, hs] = o_i.transpose(0, 2, 1, 3)
            with numpy.errstate(divide="ignore"):
                lse[bs, hs, row0 : row0 + rows] = numpy.where(l_i > 0, m_i / LOG2E + numpy.log(l_i), -numpy.inf)[..., 0]
    return (out, lse) if p.return_lse else out


def _tile_keep(p, batch_start, bs, hs, row0, rows, col0, cols):
    """Dropout's keep mask for one tile: the batch entries bs and heads hs (slices), queries
    [row0, row0 + rows), keys [col0, col0 + cols)."""
    batches = numpy.arange(p.batch)[bs] + batch_start
    return _dropout.keep_tile(p.dropout_p, p.seed, p.offset, p.heads, batches, numpy.arange(p.heads)[hs],
                              range(row0, row0 + rows), range(col0, col0 + cols))


def _visible_key_tiles(p, row0: int, rows: int, block_n: int) -> tuple[int, int]:
    """The kernels' visible_key_tiles: key tiles [lo, hi) a query tile can see; with causal or a
    window, those in the band from its first row's first key to its last row's last key."""
    n_blocks = -(-p.seqlen_k // block_n)
    if not p.local:
        return 0, n_blocks
    first, last = p.kernel_band()
    last_key = row0 + rows - 1 + last
    lo = max(row0 + first, 0) // block_n
    hi = min(n_blocks, 0 if last_key < 0 else last_key // block_n + 1)
    return lo, max(lo, hi)


def _tiles(p, block_m: int, block_n: int) -> tuple[int, int]:
    """Tile sizes that divide the block mask's blocks (the kernels require it; here they are cut)."""
    if p.block_mask is None:
        return block_m, block_n
    bq, bk = p.block_mask.block_size
    return math.gcd(block_m, bq), math.gcd(block_n, bk)


def _mask_slabs(p):
    """(mask slab, batch index, head index): the groups of (batch, head) pairs one slab of the block
    mask covers (all of them without a mask), as indices that keep q's axes."""
    everything = slice(None)
    if p.block_mask is None:
        yield None, everything, everything
        return
    mb, mh = p.block_mask.mask_batch, p.block_mask.mask_heads
    for b in range(mb):
        for h in range(mh):
            yield (b, h), (everything if mb == 1 else slice(b, b + 1)), (everything if mh == 1 else slice(h, h + 1))


def sparse_tiles(blocks, count: int, row_blocks: int, per_block: int, lo: int, hi: int) -> list[int]:
    """The kernels' tile walk over one mask row of row_blocks blocks (kernels/flash_fwd.cuh,
    sparse_tiles and TileSequence): the tiles, per_block to a block, of the ascending nonzero
    `blocks[:count]` that fall in [lo, hi), in order, found with the same shortcut, binary
    searches and cuts."""
    if lo >= hi:
        return []
    if lo == 0 and hi >= row_blocks * per_block:  # every block whole: no index read for the range
        return [int(blocks[t // per_block]) * per_block + t % per_block for t in range(count * per_block)]
    blocks = [int(x) for x in blocks[:count]]
    first = 0 if lo == 0 else bisect.bisect_left(blocks, lo // per_block)
    last = bisect.bisect_left(blocks, -(-hi // per_block))
    if first >= last:
        return []
    begin = first * per_block + max(0, lo - blocks[first] * per_block)
    end = (last - 1) * per_block + min(per_block, hi - blocks[last - 1] * per_block)
    return [blocks[t // per_block] * per_block + t % per_block for t in range(begin, end)]


def key_tiles(p, slab, row0: int, rows: int, block_n: int) -> list[int]:
    """The key tiles (of block_n) the query tile [row0, row0 + rows) visits, as the kernels'
    key_tiles: those in its band (causal, window), and with a block mask only its row's nonzero blocks."""
    lo, hi = _visible_key_tiles(p, row0, rows, block_n)
    if p.block_mask is None:
        return list(range(lo, hi))
    bq, bk = p.block_mask.block_size
    count, index = p.block_mask.kv_count[slab], p.block_mask.kv_index[slab]
    r = row0 // bq
    return sparse_tiles(index[r], int(count[r]), index.shape[-1], bk // block_n, lo, hi)


def query_tiles(p, slab, col0: int, cols: int, block_m: int) -> list[int]:
    """The query tiles (of block_m) that see the key tile [col0, col0 + cols), as the kernels'
    query_tiles: those in its band, and with a block mask those of its mask column."""
    lo, hi = 0, -(-p.seqlen_q // block_m)
    if p.local:
        first, last = p.kernel_band()
        last_query = col0 + cols - 1 - first
        lo = max(0, col0 - last) // block_m
        hi = max(lo, min(hi, 0 if last_query < 0 else last_query // block_m + 1))
    if p.block_mask is None:
        return list(range(lo, hi))
    bq, bk = p.block_mask.block_size
    count, index = p.block_mask.q_count[slab], p.block_mask.q_index[slab]
    c = col0 // bk
    return sparse_tiles(index[c], int(count[c]), index.shape[-1], bq // block_m, lo, hi)


def tiled_attention_backward(
    dout, q, k, v, out, lse, *, causal=False, scale=None, block_m=None, block_n=None, block_mask=None, window=None,
    softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0,
):
    """FlashAttention-2's backward (Algorithm 2) in float64, block by block as the dK/dV kernel
    schedules it: an outer loop over key blocks holding dK_j, dV_j, an inner loop over the query
    blocks that can see them (in the band; with block_mask, those its mask column lists), P_ij
    recomputed from the saved lse, dQ summed across key blocks; GQA/MQA: dK, dV summed over each
    group of query heads. Dropout as the kernels do it (kernels/flash_bwd.cuh): D_i' = (1 - p) D_i,
    dS = P ∘ (Z ? dP - D' : -D'), and 1 / (1 - p) on dV, dK, dQ.

    Arguments as `cupyflash.attention_backward`: `out` and `lse` are the forward's. block_m
    (query rows per step) and block_n (keys per block) default to the kernel's tile. Returns
    float64 (dq, dk, dv).
    """
    p, dout, q, k, v = _prepare_backward(dout, q, k, v, causal, scale, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    out, lse = _as_float64(out), _as_float64(lse)
    tile = _instantiations.dkdv_tile_shape(p.dtype_name, _instantiations.padded_head_dim(p.head_dim))
    block_m, block_n = _tiles(p, block_m or tile.block_m, block_n or tile.block_n)
    sq, sk = p.seqlen_q, p.seqlen_k
    # Preprocessing: D_i = rowsum(dO_i * O_i); lse in log2 units, +inf where no key was seen so
    # that P = exp2(s - lse) is exactly 0 there (as -inf would give NaN on masked scores).
    rescale = _dropout.rescale(p.dropout_p)
    d = numpy.einsum("bqhd,bqhd->bhq", dout, out)[..., None] / rescale
    lse_log2 = numpy.where(numpy.isneginf(lse), numpy.inf, lse * LOG2E)[..., None]
    scale_log2 = p.scale * LOG2E
    dq = numpy.zeros(q.shape)
    dk = numpy.zeros(k.shape)
    dv = numpy.zeros(v.shape)

    for slab, bs, hs in _mask_slabs(p):
        for col0 in range(0, sk, block_n):  # one thread block per key block j (and head, batch)
            cols = min(block_n, sk - col0)
            k_j, v_j = k[bs, col0 : col0 + cols, hs], v[bs, col0 : col0 + cols, hs]
            dk_j = numpy.zeros_like(k_j)
            dv_j = numpy.zeros_like(k_j)
            # Query blocks outside the band (causal: before key col0's diagonal) are skipped.
            for m_block in query_tiles(p, slab, col0, cols, block_m):
                row0 = m_block * block_m
                rows = min(block_m, sq - row0)
                q_i, do_i = q[bs, row0 : row0 + rows, hs], dout[bs, row0 : row0 + rows, hs]
                s_ij = numpy.einsum("bqhd,bkhd->bhqk", q_i * scale_log2, k_j)  # Q_i prescaled, as in the forward
                s_ij, derivative = _modify_scores(s_ij, p, numpy.float64, row0, col0, bs, hs, LOG2E)
                if p.local and _band_cuts(p, row0, rows, col0, cols):
                    s_ij[..., _tile_hidden(p, row0, rows, col0, cols)] = -numpy.inf
                p_ij = numpy.exp2(s_ij - lse_log2[bs, hs, row0 : row0 + rows])
                dp_ij = numpy.einsum("bqhd,bkhd->bhqk", do_i, v_j)
                d_i = d[bs, hs, row0 : row0 + rows]
                if p.dropout:
                    keep = _tile_keep(p, dropout_batch_start, bs, hs, row0, rows, col0, cols)
                    ds_ij = p_ij * numpy.where(keep, dp_ij - d_i, -d_i)
                    p_ij = p_ij * keep
                else:
                    ds_ij = p_ij * (dp_ij - d_i)
                dv_j += numpy.einsum("bhqk,bqhd->bkhd", p_ij, do_i)
                if derivative is not None:
                    ds_ij *= derivative
                dk_j += numpy.einsum("bhqk,bqhd->bkhd", ds_ij, q_i)
                dq[bs, row0 : row0 + rows, hs] += p.scale * rescale * numpy.einsum("bhqk,bkhd->bqhd", ds_ij, k_j)
            dk[bs, col0 : col0 + cols, hs] = p.scale * rescale * dk_j
            dv[bs, col0 : col0 + cols, hs] = rescale * dv_j
    return dq, _sum_groups(dk, p.kv_group), _sum_groups(dv, p.kv_group)


# --------------------------------------------------------------------------- variable-length batches


def _sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes):
    """Per sequence b of a packed batch: (its query rows, its key rows, its ALiBi slopes)."""
    cu_q, cu_k = (numpy.asarray(_as_float64(cu)).astype(numpy.int64) for cu in (cu_seqlens_q, cu_seqlens_k))
    slopes = None if alibi_slopes is None else _as_float64(alibi_slopes)
    for b in range(len(cu_q) - 1):
        row = None if slopes is None else (slopes if slopes.ndim == 1 or slopes.shape[0] == 1 else slopes[b])
        yield slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1]), row


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, return_lse=False, forward=None, alibi_slopes=None,
                     **options):
    """Attention of a variable-length batch in float64, sequence by sequence: packed q
    (total_q, heads, head_dim), k, v (total_k, heads_kv, head_dim) and FlashAttention-2's
    cumulative lengths, semantics of `cupyflash.attention_varlen` (causal, windows and ALiBi
    aligned to each sequence's own bottom-right corner; dropout with each sequence's index as its
    batch index). `forward` is the per-sequence function,
    `attention` by default (`tiled_attention`, or a partial of `attention_in_precision`, also
    serve); options go to it. Returns out (total_q, heads, head_dim) and, with return_lse, lse
    (heads, total_q)."""
    forward = forward or attention
    q, k, v = (_as_float64(x) for x in (q, k, v))
    out = numpy.zeros(q.shape)
    lse = numpy.full((q.shape[1], q.shape[0]), -numpy.inf)
    for b, (rows, keys, slopes) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes)):
        o_b, lse_b = forward(q[None, rows], k[None, keys], v[None, keys], return_lse=True, alibi_slopes=slopes,
                             dropout_batch_start=b, **options)
        out[rows], lse[:, rows] = o_b[0], lse_b[0]
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, out=None, lse=None, backward=None,
                              alibi_slopes=None, **options):
    """Gradients (dq, dk, dv) of a variable-length batch in float64, sequence by sequence, as
    `attention_varlen`: `backward` is `attention_backward` by default (or a partial of
    `attention_backward_in_precision`); `tiled_attention_backward` takes the forward's out and lse
    (packed, as `attention_varlen` returns them), passed on per sequence when given."""
    backward = backward or attention_backward
    dout, q, k, v = (_as_float64(x) for x in (dout, q, k, v))
    grads = [numpy.zeros(x.shape) for x in (q, k, v)]
    for b, (rows, keys, slopes) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes)):
        saved = () if out is None else (_as_float64(out)[None, rows], _as_float64(lse)[None, :, rows])
        parts = backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], *saved, alibi_slopes=slopes,
                         dropout_batch_start=b, **options)
        for grad, part, span in zip(grads, parts, (rows, keys, keys)):
            grad[span] = part[0]
    return tuple(grads)
