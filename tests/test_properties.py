"""Random problems mixing every option, each against the float64 reference under the 2x rule.

Each test draws one problem from its own printed seed (`rng`): dtype; head_dim 1-256; seqlens
0-5000, log-uniform, so 0, 1 and non-multiples of every tile come up; batch 1-3; GQA/MQA ratios;
causal; a window; softcap; ALiBi; dropout; a block mask; key padding (seqlens_k); packed varlen
batches; decoding with appended keys; deterministic backward; and strided, packed or misaligned
views. Forward and backward are judged by the rule of tests/test_attention_gpu.py and
test_backward_gpu.py: max |error| against float64 at most twice that of the same computation in
the input precision, plus a noise floor (`reference.error_bound`); outputs are NaN-poisoned.

    CUPYFLASH_PROPERTY_PROBLEMS=3000 pytest -m gpu tests/test_properties.py -n 15

runs the full campaign (default: 60 problems); on a machine without a GPU, 20 smaller problems
run through the CPU fallback (CI).
"""

import math
import os

import numpy
import pytest

import cupyflash
from cupyflash.cpu.reference import as_float64
from shapes import bits, numpy_dtype
from test_attention_gpu import assert_matches_reference
from test_backward_gpu import assert_gradients_match_reference

PROBLEMS = int(os.environ.get("CUPYFLASH_PROPERTY_PROBLEMS", "60"))
CPU_PROBLEMS = int(os.environ.get("CUPYFLASH_PROPERTY_CPU_PROBLEMS", "20"))
MAX_SEQLEN = 5000


def draw(rng, max_scores: int) -> dict:
    """One random problem: sizes, options, layout. max_scores bounds batch·heads·seqlen_q·seqlen_k
    (the reference materialises the scores)."""
    def seqlen():
        u = rng.random()
        return 0 if u < 0.03 else 1 if u < 0.08 else int(math.exp(rng.uniform(0, math.log(MAX_SEQLEN + 1))))

    kind = str(rng.choice(["dense", "dense", "dense", "sparse", "varlen", "decode"]))
    heads_kv = int(rng.integers(1, 4))
    pr = {
        "kind": kind, "dtype": str(rng.choice(["float16", "bfloat16", "float32", "float64"])),
        "batch": int(rng.integers(1, 4)), "heads_kv": heads_kv, "heads": heads_kv * int(rng.choice([1, 1, 2, 3, 4])),
        "head_dim": int(rng.choice([int(rng.integers(1, 257)), 64, 128])),
        "seqlen_q": seqlen(), "seqlen_k": seqlen(), "causal": bool(rng.integers(2)),
        "window": (None if rng.random() < 0.7 else
                   (int(rng.integers(0, 300)) if rng.random() < 0.8 else None, int(rng.integers(0, 300)))),
        "softcap": None if rng.random() < 0.8 else float(rng.uniform(5, 50)),
        "alibi": rng.random() < 0.2, "dropout": rng.random() < 0.2 and kind != "decode",
        "deterministic": bool(rng.integers(2)), "padding": kind == "dense" and rng.random() < 0.2,
        "layout": str(rng.choice(["contiguous", "transposed", "misaligned"])),
    }
    if kind == "decode":
        pr["seqlen_q"] = int(rng.integers(1, 17))
        pr["new"] = int(rng.integers(0, pr["seqlen_q"] + 1))
    while pr["batch"] * pr["heads"] * max(pr["seqlen_q"], 1) * max(pr["seqlen_k"], 1) > max_scores:
        longer = "seqlen_q" if pr["seqlen_q"] > pr["seqlen_k"] and kind != "decode" else "seqlen_k"
        pr[longer] //= 2
    if kind == "decode":
        pr["seqlen_k"] = max(pr["seqlen_k"], pr["new"])  # the cache holds the appended keys
    return pr


def array(rng, shape, dtype, layout, xp):
    """A random array of `shape` (..., seq, heads, head_dim) in the given layout: contiguous; a
    transposed view of a (batch, heads, seq, head_dim) array; or one element past a 16-byte
    boundary (the tensor-map kernels' cut)."""
    values = rng.standard_normal(shape).astype(dtype)
    if layout == "transposed" and len(shape) == 4:
        return xp.ascontiguousarray(xp.asarray(values).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if layout == "misaligned":
        flat = xp.empty(values.size + 1, dtype)
        view = flat[1:].reshape(shape)
        view[...] = xp.asarray(values)
        return view
    return xp.asarray(values)


def options_of(rng, pr) -> dict:
    options = {"causal": pr["causal"], "window": pr["window"], "softcap": pr["softcap"]}
    if pr["alibi"]:
        options["alibi_slopes"] = rng.uniform(0, 1, pr["heads"]).astype(numpy.float32)
    if pr["dropout"]:
        options.update(dropout_p=float(rng.uniform(0.05, 0.5)), seed=int(rng.integers(2**62)),
                       offset=int(rng.integers(2**31)))
    return options


def run(rng, pr, xp):
    dtype = numpy_dtype(pr["dtype"])
    b, sq, sk, h, hk, d = (pr[n] for n in ("batch", "seqlen_q", "seqlen_k", "heads", "heads_kv", "head_dim"))
    options = options_of(rng, pr)
    print(pr)
    if pr["kind"] == "varlen":
        return run_varlen(rng, pr, dtype, options, xp)
    if pr["kind"] == "decode":
        return run_decode(rng, pr, dtype, options, xp)
    q, k, v = (array(rng, s, dtype, pr["layout"], xp) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    dout = xp.asarray(rng.standard_normal(q.shape).astype(dtype))
    if pr["kind"] == "sparse":
        mask = cupyflash.BlockMask.from_dense(rng.random((h, -(-sq // 128), -(-sk // 128))) < rng.uniform(0.1, 1))
        out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True, **options)
        grads = cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask,
                                                          deterministic=pr["deterministic"], **options)
        assert_matches_reference(q, k, v, out, lse, pr["dtype"], block_mask=mask, **options)
        assert_gradients_match_reference(dout, q, k, v, grads, pr["dtype"], block_mask=mask, **options)
        return
    padding = {}
    if pr["padding"]:
        padding["seqlens_k"] = rng.integers(0, sk + 1, b).astype(numpy.int32)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **options, **padding)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=pr["deterministic"], **options,
                                         **padding)
    if not padding:
        assert_matches_reference(q, k, v, out, lse, pr["dtype"], **options)
        assert_gradients_match_reference(dout, q, k, v, grads, pr["dtype"], **options)
        return
    for i, n in enumerate(padding["seqlens_k"].tolist()):  # entry i is attention over its first n keys
        one = per_entry(options, i)
        rows, keys = slice(i, i + 1), (slice(i, i + 1), slice(0, n))
        assert_matches_reference(q[rows], k[keys], v[keys], out[rows], lse[rows], pr["dtype"], **one)
        assert_gradients_match_reference(dout[rows], q[rows], k[keys], v[keys],
                                         (grads[0][rows], grads[1][keys], grads[2][keys]), pr["dtype"], **one)
        assert not numpy.abs(as_float64(grads[1][i, n:])).max(initial=0) and not numpy.abs(as_float64(grads[2][i, n:])).max(initial=0)


def host(x):
    return x.get() if hasattr(x, "get") else numpy.asarray(x)


def per_entry(options, i) -> dict:
    """The options of batch entry i run alone: its dropout mask is entry i's."""
    return {**options, "dropout_batch_start": i} if options.get("dropout_p") else dict(options)


def run_varlen(rng, pr, dtype, options, xp):
    b, h, hk, d = (pr[n] for n in ("batch", "heads", "heads_kv", "head_dim"))
    lengths_q, lengths_k = (rng.integers(0, pr[n] + 1, b).tolist() for n in ("seqlen_q", "seqlen_k"))
    layout = "misaligned" if pr["layout"] == "misaligned" else "contiguous"
    q = array(rng, (sum(lengths_q), h, d), dtype, layout, xp)
    k, v = (array(rng, (sum(lengths_k), hk, d), dtype, layout, xp) for _ in range(2))
    cu_q, cu_k = (numpy.cumsum([0] + x).astype(numpy.int32) for x in (lengths_q, lengths_k))
    dout = xp.asarray(rng.standard_normal(q.shape).astype(dtype))
    out, lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    grads = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                deterministic=pr["deterministic"], **options)
    for i in range(b):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        one = per_entry(options, i)
        assert_matches_reference(q[None, rows], k[None, keys], v[None, keys], out[None, rows], lse[None, :, rows],
                                 pr["dtype"], **one)
        assert_gradients_match_reference(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                                         (grads[0][None, rows], grads[1][None, keys], grads[2][None, keys]),
                                         pr["dtype"], **one)


def run_decode(rng, pr, dtype, options, xp):
    b, sq, cache_len, h, hk, d, new = (pr[n] for n in ("batch", "seqlen_q", "seqlen_k", "heads", "heads_kv",
                                                        "head_dim", "new"))
    q = array(rng, (b, sq, h, d), dtype, pr["layout"], xp)
    k_cache, v_cache = (array(rng, (b, cache_len, hk, d), dtype, "contiguous", xp) for _ in range(2))
    k_new, v_new = (array(rng, (b, new, hk, d), dtype, "contiguous", xp) for _ in range(2))
    lengths = rng.integers(0, cache_len - new + 1, b).astype(numpy.int32)
    out, lse = cupyflash.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new if new else None,
                                          v_new=v_new if new else None, return_lse=True, **options)
    for i, n in enumerate(lengths.tolist()):
        assert numpy.array_equal(bits(host(k_cache[i, n : n + new])), bits(host(k_new[i])))
        keys = (slice(i, i + 1), slice(0, n + new))
        assert_matches_reference(q[i : i + 1], k_cache[keys], v_cache[keys], out[i : i + 1], lse[i : i + 1],
                                 pr["dtype"], **options)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(PROBLEMS))
def test_random_problem_on_the_gpu(rng, nan_outputs, index):
    import cupy

    run(rng, draw(rng, max_scores=2**21), cupy)


@pytest.mark.cpu_only
@pytest.mark.parametrize("index", range(CPU_PROBLEMS))
def test_random_problem_on_the_cpu_fallback(rng, index):
    pr = draw(rng, max_scores=2**13)
    run(rng, pr, numpy)
