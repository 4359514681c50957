"""GQA/MQA, sliding-window, softcap, ALiBi and dropout attention against dense causal attention of the same shape.

    python -m cupyflash bench --variants [--seqlen 16384] [--head-dim 128] [--max-seconds 0.12]

What it shows: a window's time follows the band's width (key tiles outside it are skipped), and
GQA costs what multi-head attention costs (K/V read in place; dK, dV summed on chip), with the
torch SDPA flash backend (GQA through enable_gqa) on the same inputs where it runs; and what the
score modifiers (softcap, ALiBi) cost against the same problem without them (SDPA has neither), and what
dropout costs, beside the SDPA flash backend's dropout (FlashAttention-2's) on the same inputs. Correctness
first: each variant at seqlen --check-seqlen (the same kernels; a float64 seqlen^2 reference at
16k would take minutes), one query group against the float64 reference under the tolerance rule.
TFLOP/s count only the visible (query, key) pairs: 4 d per pair forward, 2.5x that backward.
"""

from __future__ import annotations


import numpy

import cupyflash
from cupyflash import arguments, reference
from cupyflash.bench import common
from cupyflash.cpu.reference import as_float64


def visible_pairs(seqlen: int, left, right) -> int:
    """Pairs (i, j) of a seqlen x seqlen band: j - i in [-left, right] (None: unbounded)."""
    lo = -(seqlen - 1) if left is None else -min(left, seqlen - 1)
    hi = seqlen - 1 if right is None else min(right, seqlen - 1)
    return sum(seqlen - abs(delta) for delta in range(lo, hi + 1))


def alibi_slopes(heads: int) -> numpy.ndarray:
    """ALiBi's geometric slopes 2^(-8 (h + 1) / heads) (Press et al., 2022)."""
    return 2.0 ** (-8.0 * (numpy.arange(heads) + 1) / heads)


def check_head(q, k, v, dout, out, grads, window, causal, dtype, mods):
    """Head 0 (and its K/V head) of batch 0 against float64 under the 2x rule."""
    group = q.shape[2] // k.shape[2]
    sl = (slice(0, 1), slice(None), slice(0, group))
    kv = (slice(0, 1), slice(None), slice(0, 1))
    qs, ks, vs, ds = (as_float64(x[s]) for x, s in ((q, sl), (k, kv), (v, kv), (dout, sl)))
    options = {"causal": causal, "window": window, **mods}
    if mods.get("alibi_slopes") is not None:
        options["alibi_slopes"] = as_float64(mods["alibi_slopes"])[:group]
    dt = q.dtype
    ref = reference.attention(qs, ks, vs, **options)
    low = reference.attention_in_precision(*(x.astype(dt) for x in (qs, ks, vs)), dt, **options)
    exact = reference.attention_backward(ds, qs, ks, vs, **options)
    lowp = reference.attention_backward_in_precision(*(x.astype(dt) for x in (ds, qs, ks, vs)), dt, **options)
    # dk, dv of K/V head 0 sum over all of its group's query heads: compare the whole group.
    got = [out[sl]] + [g[s] for g, s in zip(grads, (sl, kv, kv))]
    ok, _ = common.within_bounds(zip(("out", "dq", "dk", "dv"), got, [ref, *exact], [low, *lowp]), dtype)
    return ok


def parser() -> arguments.Parser:
    ap = arguments.Parser("python -m cupyflash bench --variants", __doc__)
    ap.add_argument("--seqlen", type=arguments.positive_int, default=16384, help="seqlen_q and seqlen_k, batch 1")
    ap.add_argument("--head-dim", type=arguments.head_dim, default=128, help="head_dim")
    ap.add_argument("--heads", type=arguments.positive_int, default=16, help="query heads")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="the inputs' dtype")
    ap.add_argument("--max-seconds", type=arguments.positive_float, default=0.12,
                    help="timing budget per measurement, seconds")
    ap.add_argument("--check-seqlen", type=arguments.positive_int, default=2048,
                    help="the seqlen each variant is checked at against float64")
    return ap


def main(args) -> int:

    import cupy

    from cupyflash.validation import BFLOAT16

    dt = BFLOAT16 if args.dtype == "bfloat16" else numpy.dtype(numpy.float16)
    s, h, d = args.seqlen, args.heads, args.head_dim
    slopes = cupy.asarray(alibi_slopes(h), dtype=cupy.float32)
    # (label, heads_kv, causal, window, score modifiers)
    problems = [
        ("causal", h, True, None, {}),
        ("causal, window (4095, 0)", h, True, (4095, None), {}),
        ("causal, window (1023, 0)", h, True, (1023, None), {}),
        ("window (511, 512)", h, False, (511, 512), {}),
        ("causal, GQA 4 K/V heads", 4, True, None, {}),
        ("causal, MQA 1 K/V head", 1, True, None, {}),
        ("window (1023, 0), GQA 4", 4, True, (1023, None), {}),
        ("non-causal", h, False, None, {}),
        ("non-causal, softcap 30", h, False, None, {"softcap": 30.0}),
        ("causal, softcap 30", h, True, None, {"softcap": 30.0}),
        ("causal, ALiBi", h, True, None, {"alibi_slopes": slopes}),
        ("causal, softcap + ALiBi", h, True, None, {"softcap": 30.0, "alibi_slopes": slopes}),
        ("non-causal, dropout 0.1", h, False, None, {"dropout_p": 0.1, "seed": 1}),
        ("causal, dropout 0.1", h, True, None, {"dropout_p": 0.1, "seed": 1}),
    ]
    try:
        import torch

        sdpa = torch.nn.functional.scaled_dot_product_attention
    except ImportError:
        torch = None
        print("# torch not installed: the SDPA flash column is skipped")
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"# measured on {common.measured_on('kernels')}")
    print(f"# {device}; batch 1, seqlen {s}, {h} query heads, head_dim {d}, {args.dtype}")
    rng = numpy.random.default_rng(0)
    rows, failures = [], 0
    def inputs(seqlen, heads_kv):
        q = cupy.asarray(rng.standard_normal((1, seqlen, h, d)).astype(dt))
        k, v = (cupy.asarray(rng.standard_normal((1, seqlen, heads_kv, d)).astype(dt)) for _ in range(2))
        return q, k, v, cupy.asarray(rng.standard_normal(q.shape).astype(dt))

    for label, heads_kv, causal, window, mods in problems:
        options = {"causal": causal, "window": window, **mods}
        q, k, v, dout = inputs(args.check_seqlen, heads_kv)
        out, lse = cupyflash.attention(q, k, v, return_lse=True, **options)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, **options)
        ok = check_head(q, k, v, dout, out, grads, window, causal, args.dtype, mods)
        failures += not ok
        q, k, v, dout = inputs(s, heads_kv)
        out, lse = cupyflash.attention(q, k, v, return_lse=True, **options)
        fwd = common.median_ms(lambda: cupyflash.attention(q, k, v, return_lse=True, **options), args.max_seconds)
        bwd = common.median_ms(lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, **options), args.max_seconds)
        left, right = window or (None, None)
        pairs = visible_pairs(s, left, 0 if causal else right)
        flops = 4 * d * pairs * h
        torch_fwd = torch_bwd = None
        # SDPA has no sliding window, softcap or ALiBi; its flash backend has dropout.
        if torch is not None and window is None and not set(mods) - {"dropout_p", "seed"}:
            tq, tk, tv, tdo = (common.torch_view(x) for x in (q, k, v, dout))
            tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
            p = mods.get("dropout_p", 0.0)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                try:
                    call = lambda: sdpa(tq, tk, tv, is_causal=causal, dropout_p=p, enable_gqa=heads_kv != h)  # noqa: E731
                    torch_fwd = common.median_ms(call, args.max_seconds)
                    o = call()
                    torch_bwd = common.median_ms(lambda: torch.autograd.grad(o, (tq, tk, tv), tdo, retain_graph=True),
                                                 args.max_seconds)
                except RuntimeError as e:  # the flash backend refuses some GQA shapes
                    print(f"# torch flash skipped for {label!r}: {str(e).splitlines()[0]}")
        rows.append((label, ok, fwd, bwd, flops / fwd / 1e9, 2.5 * flops / bwd / 1e9, torch_fwd, torch_bwd))
    print(f"# correctness: {'all PASS' if not failures else f'{failures} FAIL'}")
    print(f"{'problem':28} {'check':5} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'bwd TF/s':>9} {'torch flash fwd/bwd ms':>23}")
    for label, ok, fwd, bwd, tf_f, tf_b, t_f, t_b in rows:
        peer = f"{t_f:8.3f} / {t_b:8.3f}" if t_f is not None else "-"
        print(f"{label:28} {'PASS' if ok else 'FAIL':5} {fwd:8.3f} {bwd:8.3f} {tf_f:9.1f} {tf_b:9.1f} {peer:>23}")
    return 1 if failures else 0

