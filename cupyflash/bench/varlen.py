"""Variable-length batches: `attention_varlen` on packed sequences against the same sequences padded
to the longest (our fixed-length kernels) and against FlashAttention-2's own varlen kernels as
PyTorch ships them (torch.ops.aten._flash_attention_forward / _backward with cu_seqlens).

    python -m cupyflash bench --varlen [--head-dim 128] [--heads 16] [--max-seconds 0.12]

Two batches of 16384 tokens: "mixed", lengths drawn between 256 and 4096 (seeded), and "equal",
8 x 2048, where packed and padded are the same work, so their ratio is the variable-length kernel's
own cost. TFLOP/s count the visible (query, key) pairs of the real sequences (4 d per pair forward,
2.5x that backward), padding excluded, for every column. Correctness first: the shortest and the
longest sequence of each batch, forward and backward, head 0, against float64 under the rule.
"""

from __future__ import annotations


import numpy

import cupyflash
from cupyflash import reference
from cupyflash import arguments
from cupyflash.bench import common
from cupyflash.cpu.reference import as_float64


def pairs(lq: int, lk: int, causal: bool) -> int:
    if not causal:
        return lq * lk
    return sum(max(0, min(lk, i + lk - lq + 1)) for i in range(lq))


def check_sequence(q, k, v, dout, out, lse, grads, rows, keys, causal, dtype) -> bool:
    """Head 0 of one packed sequence against the float64 reference under the 2x rule."""
    group = q.shape[1] // k.shape[1]
    qs, ds = (as_float64(x[rows, :group])[None] for x in (q, dout))
    ks, vs = (as_float64(x[keys, :1])[None] for x in (k, v))
    dt = q.dtype
    ref = reference.attention(qs, ks, vs, causal=causal)
    low = reference.attention_in_precision(*(x.astype(dt) for x in (qs, ks, vs)), dt, causal=causal)
    exact = reference.attention_backward(ds, qs, ks, vs, causal=causal)
    lowp = reference.attention_backward_in_precision(*(x.astype(dt) for x in (ds, qs, ks, vs)), dt, causal=causal)
    spans = ((rows, slice(0, group)), (keys, slice(0, 1)), (keys, slice(0, 1)))
    got = [out[rows, :group][None]] + [g[r, h][None] for g, (r, h) in zip(grads, spans)]
    ok, _ = common.within_bounds(zip(("out", "dq", "dk", "dv"), got, [ref, *exact], [low, *lowp]), dtype)
    return ok


def parser() -> arguments.Parser:
    ap = arguments.Parser("python -m cupyflash bench --varlen", __doc__)
    ap.add_argument("--tokens", type=arguments.positive_int, default=16384, help="tokens of each packed batch")
    ap.add_argument("--head-dim", type=arguments.head_dim, default=128, help="head_dim")
    ap.add_argument("--heads", type=arguments.positive_int, default=16, help="heads")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="the inputs' dtype")
    ap.add_argument("--max-seconds", type=arguments.positive_float, default=0.12,
                    help="timing budget per measurement, seconds")
    return ap


def main(args) -> int:

    import cupy

    from cupyflash.validation import BFLOAT16

    dt = BFLOAT16 if args.dtype == "bfloat16" else numpy.dtype(numpy.float16)
    h, d = args.heads, args.head_dim
    rng = numpy.random.default_rng(0)
    mixed = []
    while sum(mixed) < args.tokens:
        mixed.append(int(rng.integers(256, 4097)))
    mixed[-1] -= sum(mixed) - args.tokens
    batches = {"mixed": mixed, "equal": [args.tokens // 8] * 8}
    try:
        import torch

        flash_fwd, flash_bwd = torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward
    except (ImportError, AttributeError) as e:
        torch = None
        print(f"# torch's FlashAttention-2 varlen kernels unavailable ({e}): that column is skipped")
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"# measured on {common.measured_on('kernels')}")
    print(f"# {device}; {args.tokens} tokens, {h} heads, head_dim {d}, {args.dtype}")
    rows, failures = [], 0
    for name, lengths in batches.items():
        print(f"# {name}: {len(lengths)} sequences, lengths {sorted(lengths)}")
        cu = numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)
        cu_gpu, longest = cupy.asarray(cu), max(lengths)
        total = int(cu[-1])
        q, k, v, dout = (cupy.asarray(rng.standard_normal((total, h, d)).astype(dt)) for _ in range(4))
        padded = [cupy.zeros((len(lengths), longest, h, d), dt) for _ in range(4)]
        for b, n in enumerate(lengths):
            for p, x in zip(padded, (q, k, v, dout)):
                p[b, :n] = x[cu[b] : cu[b + 1]]
        for causal in (True, False):
            # Host lengths: a device array is read back for its check, a synchronisation per call.
            varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=causal)
            out, lse = cupyflash.attention_varlen(q, k, v, return_lse=True, **varlen)
            grads = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, **varlen)
            ok = True
            for b in (int(numpy.argmin(lengths)), int(numpy.argmax(lengths))):
                span = slice(int(cu[b]), int(cu[b + 1]))
                ok &= check_sequence(q, k, v, dout, out, lse, grads, span, span, causal, args.dtype)
            failures += not ok
            fwd = common.median_ms(lambda: cupyflash.attention_varlen(q, k, v, return_lse=True, **varlen),
                                   args.max_seconds)
            bwd = common.median_ms(lambda: cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, **varlen),
                                   args.max_seconds)
            pq, pk, pv, pdo = padded
            p_out, p_lse = cupyflash.attention(pq, pk, pv, causal=causal, return_lse=True)
            pad_fwd = common.median_ms(lambda: cupyflash.attention(pq, pk, pv, causal=causal, return_lse=True),
                                       args.max_seconds)
            pad_bwd = common.median_ms(
                lambda: cupyflash.attention_backward(pdo, pq, pk, pv, p_out, p_lse, causal=causal), args.max_seconds)
            t_fwd = t_bwd = None
            if torch is not None:
                tq, tk, tv, tdo, tcu = (torch.from_dlpack(x) for x in (q, k, v, dout, cu_gpu))  # packed, no copies
                try:
                    call = lambda: flash_fwd(tq, tk, tv, tcu, tcu, longest, longest, 0.0, causal, False)  # noqa: E731
                    t_fwd = common.median_ms(call, args.max_seconds)
                    t_out, t_lse, seed, offset, _ = call()
                    t_bwd = common.median_ms(
                        lambda: flash_bwd(tdo, tq, tk, tv, t_out, t_lse, tcu, tcu, longest, longest, 0.0, causal,
                                          seed, offset), args.max_seconds)
                except RuntimeError as e:
                    print(f"# torch FlashAttention-2 varlen skipped for {name}: {str(e).splitlines()[0]}")
            flops = 4 * d * h * sum(pairs(n, n, causal) for n in lengths)
            rows.append((f"{name}, {'causal' if causal else 'non-causal'}", ok, fwd, bwd, flops, pad_fwd, pad_bwd,
                         t_fwd, t_bwd))
    print(f"# correctness: {'all PASS' if not failures else f'{failures} FAIL'}")
    print("# TFLOP/s of the real sequences' pairs; ratio = our varlen's speed / the column's")
    header = f"{'batch':20} {'check':5} {'varlen fwd/bwd TF/s':>20} {'padded (ours) fwd/bwd':>22} {'FA2 varlen (torch) fwd/bwd':>28}"
    print(header)
    for label, ok, fwd, bwd, flops, p_f, p_b, t_f, t_b in rows:
        tf = lambda ms, k=1.0: k * flops / ms / 1e9  # noqa: E731
        ours = f"{tf(fwd):7.1f} / {tf(bwd, 2.5):7.1f}"
        pad = f"{tf(p_f):6.1f} / {tf(p_b, 2.5):6.1f} ({p_f / fwd:.2f}x/{p_b / bwd:.2f}x)"
        fa2 = "-" if t_f is None else f"{tf(t_f):6.1f} / {tf(t_b, 2.5):6.1f} ({t_f / fwd:.2f}x/{t_b / bwd:.2f}x)"
        print(f"{label:20} {'PASS' if ok else 'FAIL':5} {ours:>20} {pad:>22} {fa2:>28}")
    return 1 if failures else 0

