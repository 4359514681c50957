"""NumPy float64 definitions of what cupyflash computes, and the tolerance rule.

- `attention`, `attention_backward` (and the block-sparse, decode and varlen forms): the
  definition. They materialise the (seqlen_q, seqlen_k) scores per head; every kernel is validated
  against them, and they are checked themselves against scipy.special.softmax and brute-force loops.
- `attention_in_precision`, `attention_backward_in_precision`: the same computation in the input
  precision, and `error_bound`: the tests' 2x rule built from it.
- The tiled algorithm (the CPU fallback) is cpu/tiled.py; `cupyflash.reference` exports both.

They take the arguments of `cupyflash.attention` (NumPy or CuPy arrays, any supported dtype),
compute in float64 and return float64 `out` of shape (batch, seqlen_q, heads, head_dim) and, with
return_lse=True, float64 `lse` of shape (batch, heads, seqlen_q).
"""

from __future__ import annotations

import functools
import math

import numpy

from cupyflash import validation
from cupyflash.block_mask import checked_for
from cupyflash.cpu import philox

LOG2E = math.log2(math.e)  # log2(e): exp(x) = exp2(x * log2(e))


def propagating(function):
    """function with NumPy's warnings for invalid values and log(0) off: NaN and inf in the inputs
    propagate to the results as in the definition, and rows with no key take log(0) = -inf, with
    no warning (as CuPy's and the kernels' arithmetic)."""

    @functools.wraps(function)
    def quiet(*args, **kwargs):
        with numpy.errstate(invalid="ignore", divide="ignore"):
            return function(*args, **kwargs)

    return quiet


def as_float64(x):
    return as_array(x, numpy.float64)


def as_array(x, dtype):
    """x as a new NumPy array of dtype (CuPy and DLPack arrays copied to the host first)."""
    if type(x).__module__.split(".")[0] == "cupy":
        x = x.get()
    elif not isinstance(x, numpy.ndarray) and hasattr(x, "__dlpack__"):
        x = numpy.from_dlpack(x)
    return numpy.asarray(x).astype(dtype)


def prepare(q, k, v, causal, scale, return_lse, block_mask=None, window=None, softcap=None, alibi_slopes=None,
             dropout=(0.0, None, 0), dtype=numpy.float64):
    """The validated problem and q, k, v as NumPy arrays of dtype (float64 unless asked), k and v
    repeated to q's heads (GQA/MQA); ALiBi slopes, if any, as float64 NumPy in the problem;
    dropout = (dropout_p, seed, offset)."""
    q, k, v = (x if hasattr(x, "ndim") else numpy.asarray(x) for x in (q, k, v))
    problem = validation.check_attention_args(
        q, k, v, causal=causal, scale=scale, return_lse=return_lse, window=window, softcap=softcap
    )
    if alibi_slopes is not None:
        problem = validation.check_alibi_slopes(as_float64(alibi_slopes), problem)
    if block_mask is not None:
        problem = checked_for(block_mask, problem)
    problem = validation.check_dropout(*dropout, problem)
    k, v = (numpy.repeat(as_array(x, dtype), problem.kv_group, axis=2) for x in (k, v))
    return problem, as_array(q, dtype), k, v


def _keep_mask(p, batch_start: int):
    """Dropout's keep mask (batch, heads, seqlen_q, seqlen_k), the kernels' (`cupyflash.dropout_mask`),
    for batch entries from batch_start; None without dropout."""
    if not p.dropout:
        return None
    return philox.keep_mask_numpy(p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.dropout_p, p.seed, p.offset, batch_start)


def sum_groups(x, group: int):
    """A gradient with respect to K or V repeated to q's heads, (batch, seq, heads, d), summed
    over each group of query heads into (batch, seq, heads_kv, d)."""
    b, s, h, d = x.shape
    return x.reshape(b, s, h // group, group, d).sum(axis=3)


def _hidden(p) -> numpy.ndarray | None:
    """Boolean, broadcastable to (batch, heads, seqlen_q, seqlen_k): True where key j is hidden
    from query i by causal, the window or the block mask; None when nothing is."""
    hidden = tile_hidden(p, 0, p.seqlen_q, 0, p.seqlen_k) if p.local else None
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


def tile_hidden(p, row0, rows, col0, cols):
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


def modify_scores(scores, p, compute, row0=0, col0=0, bs=slice(None), hs=slice(None), unit=1.0):
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


def band_cuts(p, row0, rows, col0, cols) -> bool:
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
    p, q, k, v = prepare(q, k, v, causal, scale, return_lse, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
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
    q = as_float64(q)
    k, v = numpy.array(as_float64(k_cache)), numpy.array(as_float64(v_cache))
    batch, seqlen_q, heads, _ = q.shape
    lengths = numpy.full(batch, k.shape[1]) if cache_seqlens is None else as_float64(cache_seqlens).reshape(-1)
    lengths = numpy.broadcast_to(lengths, (batch,)).astype(numpy.int64)
    if k_new is not None:
        k_new, v_new = as_float64(k_new), as_float64(v_new)
        for b in range(batch):
            k[b, lengths[b] : lengths[b] + k_new.shape[1]] = k_new[b]
            v[b, lengths[b] : lengths[b] + k_new.shape[1]] = v_new[b]
        lengths = lengths + k_new.shape[1]
    out = numpy.zeros(q.shape)
    lse = numpy.full((batch, heads, seqlen_q), -numpy.inf)
    slopes = None if alibi_slopes is None else as_float64(alibi_slopes).reshape(-1, heads)
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
    p, q, k, v = prepare(q, k, v, causal, scale, return_lse, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    name = validation.dtype_name(dtype, "dtype")
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
    """Relative rounding noise allowed beyond the 2x rule: 2 ulp of a 16-bit result, 4 ulp of
    float32. For float64 the same-precision computation is the reference itself (error 0), so the
    floor alone covers summing thousands of terms in another order: 64 ulp.

    16-bit: a kernel rounds dS (or P) and then its result to the dtype, and where a result is
    formed from few terms (head dim 1, a sequence of one query) the baseline's own roundings can
    happen to be near 0, leaving 2x its error no room for the kernel's. Over 431 random trials of
    the 16-bit backward's head-dim tests (41376 gradients, H200) one exceeded 2x + 1 ulp (1.38x
    over); none exceeded 2x + 2 ulp (worst 0.69 of the floor). FlashAttention-3's tests' floor,
    twice the dtype's rounding of the reference + 0.3, was exceeded 4 times: it is met there at
    one fixed seed."""
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}[dtype_name]
    return eps * {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 64}[dtype_name]


def _materialised_attention(q, k, v, p, compute, rounding, keep=None):
    out, lse, _, _, _ = _materialised_forward(q, k, v, p, compute, rounding, keep)
    return out.transpose(0, 2, 1, 3).astype(numpy.float64), lse[..., 0].astype(numpy.float64)


@propagating
def _materialised_forward(q, k, v, p, compute, rounding, keep=None):
    """(out, lse, probs, derivative, dropped) in (batch, heads, seq, ...) layout, in `compute`
    precision; derivative: the score modifiers' (`modify_scores`), None without a softcap; dropped:
    the probabilities V is weighed with, P ∘ Z / (1 - p) under dropout's keep mask `keep`, else P."""

    def rounded(x):
        return x if rounding is None else x.astype(rounding).astype(compute)

    qh, kh, vh = (x.astype(compute).transpose(0, 2, 1, 3) for x in (q, k, v))  # (b, h, seq, d)
    scores = rounded(qh @ kh.transpose(0, 1, 3, 2)) * compute(p.scale)
    if p.score_mod:  # a framework's softcapped, biased scores: a tensor of the dtype again
        scores, derivative = modify_scores(scores, p, compute)
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
    # l = 0 only where no key is visible; a NaN (a NaN or inf score) stays NaN in out and lse.
    seen = l != 0
    probs = rounded(numpy.divide(weights, l, out=numpy.zeros_like(weights), where=seen))
    dropped = probs if keep is None else rounded(numpy.where(keep, probs * compute(philox.rescale(p.dropout_p)), 0.0))
    out = rounded(dropped @ vh)
    lse = numpy.where(seen, m_safe + numpy.log(l), -numpy.inf)
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
    p, dout, q, k, v = prepare_backward(dout, q, k, v, causal, scale, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
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
    p, q, k, v = prepare(q, k, v, causal, scale, False, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    return float(numpy.abs(v).max(initial=0.0)) * _exponent_size(p, q, k) * philox.rescale(p.dropout_p)


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
    p, q, k, v = prepare(q, k, v, causal, scale, True, block_mask, window, softcap, alibi_slopes)
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
    s = numpy.abs(modify_scores((qh @ kh.transpose(0, 1, 3, 2)) * p.scale, p, numpy.float64)[0])
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
    p, q, k, v = prepare(q, k, v, causal, scale, True, block_mask, window, softcap, alibi_slopes)
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
    p, dout, q, k, v = prepare_backward(dout, q, k, v, causal, scale, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    out, lse, _, _, probs = _materialised_forward(q, k, v, p, numpy.float64, None, _keep_mask(p, dropout_batch_start))
    doh, vh = (x.transpose(0, 2, 1, 3) for x in (dout, v))
    dp = numpy.abs(doh @ vh.transpose(0, 1, 3, 2)) * philox.rescale(p.dropout_p)
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
    p, dout, q, k, v = prepare_backward(dout, q, k, v, causal, scale, block_mask, window, softcap, alibi_slopes, dropout=(dropout_p, seed, offset))
    name = validation.dtype_name(dtype, "dtype")
    compute = numpy.float64 if name == "float64" else numpy.float32
    rounding = numpy.dtype(dtype) if name in ("float16", "bfloat16") else None
    return _materialised_backward(dout, q, k, v, p, compute, rounding, _keep_mask(p, dropout_batch_start))


def prepare_backward(dout, q, k, v, causal, scale, block_mask=None, window=None, softcap=None, alibi_slopes=None,
                      dropout=(0.0, None, 0), dtype=numpy.float64):
    p, q, k, v = prepare(q, k, v, causal, scale, False, block_mask, window, softcap, alibi_slopes, dropout, dtype)
    dout = as_array(dout, dtype)
    if dout.shape != q.shape:
        raise ValueError(f"dout must have q's shape {q.shape}, got {dout.shape}")
    return p, dout, q, k, v


@propagating
def _materialised_backward(dout, q, k, v, p, compute, rounding, keep=None):
    def rounded(x):
        return x if rounding is None else x.astype(rounding).astype(compute)

    out, _, probs, derivative, dropped = _materialised_forward(q, k, v, p, compute, rounding, keep)
    qh, kh, vh, doh = (x.astype(compute).transpose(0, 2, 1, 3) for x in (q, k, v, dout))
    scale = compute(p.scale)
    dv = rounded(dropped.transpose(0, 1, 3, 2) @ doh)
    dp = rounded(doh @ vh.transpose(0, 1, 3, 2))
    if keep is not None:  # the gradient of P ∘ Z / (1 - p) in P
        dp = rounded(numpy.where(keep, dp * compute(philox.rescale(p.dropout_p)), 0.0))
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
        dk, dv = (rounded(sum_groups(x, p.kv_group)) for x in (dk, dv))
    return tuple(x.astype(numpy.float64) for x in (dq, dk, dv))


# --------------------------------------------------------------------------- variable-length batches


def _sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes):
    """Per sequence b of a packed batch: (its query rows, its key rows, its ALiBi slopes)."""
    cu_q, cu_k = (numpy.asarray(as_float64(cu)).astype(numpy.int64) for cu in (cu_seqlens_q, cu_seqlens_k))
    slopes = None if alibi_slopes is None else as_float64(alibi_slopes)
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
    q, k, v = (as_float64(x) for x in (q, k, v))
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
    dout, q, k, v = (as_float64(x) for x in (dout, q, k, v))
    grads = [numpy.zeros(x.shape) for x in (q, k, v)]
    for b, (rows, keys, slopes) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes)):
        saved = () if out is None else (as_float64(out)[None, rows], as_float64(lse)[None, :, rows])
        parts = backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], *saved, alibi_slopes=slopes,
                         dropout_batch_start=b, **options)
        for grad, part, span in zip(grads, parts, (rows, keys, keys)):
            grad[span] = part[0]
    return tuple(grads)
