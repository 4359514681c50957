"""How the backward's time scales with the query blocks per key block, cupyflash and its dense peers:
a development tool (GPU) for Step 4's density-0.1 rows.

    python benchmarks/short_queries_scaling.py [--head-dim 64 --head-dim 128] [--out FILE.csv]

The backward's dK/dV kernels take one key block at a time and walk its query blocks. The sparse
grid's 4096-token problem (batch 4, hidden 2048, bf16) with seqlen_q = n x 128 and seqlen_k 4096
gives them the block-sparse launch's shape with no mask: 32 key blocks a head, each of n steps, the
FLOPs of density n / 32. Unlike short_keys_scaling.py's problems (n key blocks of 32 steps, one or
two waves of them), the launch holds as many key blocks as the grid's does, and the passes over the
query rows (D_i, the dQ workspace's clear and conversion) shrink with the work. So the time against
the full problem's measures how a kernel copes with short key blocks alone, the density-independent
passes aside. Timed: cupyflash's backward with its one-block dK/dV kernel (the dense default) and
with its warp-specialised one (the block-sparse default), PyTorch SDPA's cuDNN and flash
(FlashAttention-2) backends, all as the grid times calls (bench._median_ms). For cupyflash also the
three launches alone: preprocess, dK/dV, conversion.
"""

import pathlib
import sys

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

BLOCK = 128
QUERY_BLOCKS = (1, 2, 3, 4, 8, 32)
SEQLEN_K = 4096


def main(argv=None) -> int:
    import cupy
    import torch
    from cupyx.profiler import benchmark
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import bench
    from bwd_breakdown import record_launches
    from short_keys_scaling import parse_args, write_csv
    import cupyflash
    from cupyflash import _attention, _instantiations
    from cupyflash._validation import BFLOAT16

    args, device = parse_args(argv, __doc__, "128, 64")
    print(f"# {device}; seqlen_k {SEQLEN_K}, seqlen_q = n x {BLOCK}, batch 4, hidden 2048, bf16; "
          "backward ms per call (bench._median_ms)", flush=True)
    ws_default = _instantiations.WS_BACKWARD_BY_DEFAULT
    rows = []
    for d in args.head_dim or [128, 64]:
        batch, heads = 16384 // SEQLEN_K, 2048 // d
        rs = cupy.random.default_rng(d)
        k, v = (rs.standard_normal((batch, SEQLEN_K, heads, d), dtype=numpy.float32).astype(BFLOAT16) for _ in range(2))
        q_all, dout_all = (rs.standard_normal((batch, SEQLEN_K, heads, d), dtype=numpy.float32).astype(BFLOAT16)
                           for _ in range(2))

        def ours(ws):
            def run(n):
                q, dout = (cupy.ascontiguousarray(x[:, :n * BLOCK]) for x in (q_all, dout_all))
                out, lse = cupyflash.attention(q, k, v, return_lse=True)

                def call():
                    _instantiations.WS_BACKWARD_BY_DEFAULT = ws
                    try:
                        return cupyflash.attention_backward(dout, q, k, v, out, lse)
                    finally:
                        _instantiations.WS_BACKWARD_BY_DEFAULT = ws_default

                ms = bench._median_ms(call, args.max_seconds)
                by_part = {}
                for launch in record_launches(call):
                    kernel = launch[0]
                    part = getattr(kernel, "step", "dkdv")
                    if part in by_part:
                        raise RuntimeError(f"two {part} launches in one call")
                    if part == "dkdv" and bool(getattr(kernel, "ws", False)) != ws:
                        raise RuntimeError(f"asked for ws={ws}, the call launched {kernel}")
                    by_part[part] = float(numpy.median(benchmark(
                        lambda launch=launch: _attention._launch(*launch[:4], *launch[4]), n_repeat=20,
                        n_warmup=3).gpu_times[0])) * 1e6  # us
                # (absent: 0; the d64 warp-specialised kernel's dQ ring rounds dq itself, no conversion)
                return ms, [by_part.get(part, 0.0) for part in ("preprocess", "dkdv", "convert_dq")]
            return run

        def torch_dense(backend):
            def run(n):
                tq, tdo = (bench.torch_view(cupy.ascontiguousarray(x[:, :n * BLOCK])) for x in (q_all, dout_all))
                tq = tq.detach().requires_grad_()
                tk, tv = (bench.torch_view(x).detach().requires_grad_() for x in (k, v))
                sdpa = torch.nn.functional.scaled_dot_product_attention
                with sdpa_kernel(backend):
                    out = sdpa(tq, tk, tv)
                    ms = bench._median_ms(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True),
                                          args.max_seconds)
                return ms, None
            return run

        methods = {"cupyflash one-block": ours(False), "cupyflash ws": ours(True),
                   "cudnn": torch_dense(SDPBackend.CUDNN_ATTENTION), "fa2": torch_dense(SDPBackend.FLASH_ATTENTION)}
        for method, run in methods.items():
            first = len(rows)
            for n in QUERY_BLOCKS:
                ms, alone = run(n)
                row = {"device": device, "head_dim": d, "method": method, "query_blocks": n,
                       "density": n / QUERY_BLOCKS[-1], "bwd_ms": ms}
                if alone:
                    row.update(prep_us=alone[0], dkdv_us=alone[1], convert_us=alone[2])
                rows.append(row)
                print(f"# d{d} {method} n={n}: {ms:.4f} ms", flush=True)
            full = rows[-1]
            for r in rows[first:]:
                r["vs_full"] = r["bwd_ms"] / full["bwd_ms"]
                if "dkdv_us" in r:
                    r["dkdv_vs_full"] = r["dkdv_us"] / full["dkdv_us"]
        del k, v, q_all, dout_all
        cupy.get_default_memory_pool().free_all_blocks()

    if args.out:
        write_csv(args.out, rows)
    print(f"\n## {device}: backward time against the same method's 32 query blocks; bound 1.2 x density; "
          "'*' over it")
    print(f"{'d':>3} {'method':20} {'n':>3} {'density':>7} {'bound':>6} | {'call ms':>8} {'ratio':>7} | "
          f"{'prep us':>8} {'dK/dV us':>9} {'conv us':>8} {'dK/dV ratio':>11}")
    for r in rows:
        bound = 1.2 * r["density"]
        line = (f"{r['head_dim']:3d} {r['method']:20} {r['query_blocks']:3d} {r['density']:7.4f} {bound:6.3f} | "
                f"{r['bwd_ms']:8.4f} {r['vs_full']:6.3f}{'*' if r['vs_full'] > bound else ' '} |")
        if "dkdv_us" in r:
            line += (f" {r['prep_us']:8.1f} {r['dkdv_us']:9.1f} {r['convert_us']:8.1f} "
                     f"{r['dkdv_vs_full']:10.3f}{'*' if r['dkdv_vs_full'] > bound else ' '}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
