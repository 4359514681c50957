"""How attention's time scales with the work per query tile, dense and block-sparse, for cupyflash
and its dense peers: a development tool (GPU) for Step 4's density-0.1 rows.

    python benchmarks/short_keys_scaling.py [--head-dim 64 --head-dim 128] [--out FILE.csv]

The sparse grid's 4096-token problem (batch 4, hidden 2048, bf16, not causal) with fewer keys:
seqlen_q 4096 and seqlen_k = n x 128 for n in 1, 2, 3, 4, 8, 16, 32. A dense problem with n key
blocks does what a block-sparse one with n of the 32 key blocks in every mask row does, with no
mask: the same query tiles, the same steps per tile, the same FLOPs as density n / 32. So its time
against the full problem's, set beside Step 4's bound of 1.2 x density, says how far the bound asks
a kernel to go below its own per-tile and per-launch costs, whichever its mask machinery. Timed
for cupyflash's dense `attention`, PyTorch SDPA's cuDNN and flash (FlashAttention-2) backends, and
cupyflash's `block_sparse_attention` on masks of exactly n blocks a row (the first n, and n at
random) and on the grid's own random and local masks at density 0.1; forward and backward (calls
timed as the grid times them: bench._median_ms, back to back). For cupyflash also each call's
launches replayed alone (the kernels' own time, bwd_breakdown.replay_us) and the host's time to
queue one call: where that is near the call's time, the call is paced by the host.

Checks first: the first-n-blocks mask's out, lse, dq, dk, dv against dense attention on the first
n x 128 keys (the same arithmetic, so equal to within a few units in the last place), and
cupyflash's dense out against the cuDNN backend's.
"""

import argparse
import contextlib
import csv
import pathlib
import sys

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

BLOCK = 128
KEY_BLOCKS = (1, 2, 3, 4, 8, 16, 32)
SEQLEN_Q = 4096


def exact_rows_mask(n_blocks: int, heads: int, at_random: bool, rng):
    """A BlockMask of 4096 x 4096 tokens whose every row has exactly n_blocks key blocks: the
    first ones, or n_blocks at random per (head, row)."""
    import cupyflash

    n = SEQLEN_Q // BLOCK
    if at_random:
        ranks = numpy.argsort(numpy.argsort(rng.random((heads, n, n)), axis=-1), axis=-1)
        return cupyflash.BlockMask(ranks < n_blocks)
    return cupyflash.BlockMask(numpy.broadcast_to(numpy.arange(n) < n_blocks, (1, n, n)).copy())


def check_first_blocks(q, k, v, dout, n_blocks: int, heads: int) -> float:
    """Max |difference| between block-sparse on the first n blocks and dense on those keys."""
    import cupy

    import cupyflash

    mask = exact_rows_mask(n_blocks, heads, False, None)
    keys = n_blocks * BLOCK
    ks, vs = (cupy.ascontiguousarray(x[:, :keys]) for x in (k, v))
    out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
    dq, dk, dv = cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask)
    out_d, lse_d = cupyflash.attention(q, ks, vs, return_lse=True)
    dq_d, dk_d, dv_d = cupyflash.attention_backward(dout, q, ks, vs, out_d, lse_d)
    worst = 0.0
    for a, b in ((out, out_d), (lse, lse_d), (dq, dq_d), (dk[:, :keys], dk_d), (dv[:, :keys], dv_d)):
        worst = max(worst, float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max()))
    rest = float(cupy.abs(dk[:, keys:].astype(cupy.float32)).max()) if keys < k.shape[1] else 0.0
    if rest != 0.0:
        raise SystemExit(f"dk of keys outside every block is {rest}, not 0")
    return worst


def parse_args(argv, doc: str, head_dims: str):
    """(arguments, the device's name) of a scaling tool: --head-dim (default head_dims),
    --max-seconds for each timing, --out for the CSV; its description the first paragraph of doc."""
    import cupy

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, action="append", help=f"default {head_dims}")
    ap.add_argument("--max-seconds", type=float, default=0.3)
    ap.add_argument("--out", type=pathlib.Path, help="write the rows as CSV here")
    return ap.parse_args(argv), cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()


def write_csv(path, rows) -> None:
    """rows (dicts) as CSV at path, the columns in order of first appearance."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(key for r in rows for key in r)))
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None) -> int:
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import bench
    import bench_sparse
    from bwd_breakdown import record_launches, replay_us
    from host_breakdown import _wall
    import cupyflash
    from cupyflash._validation import BFLOAT16

    args, device = parse_args(argv, __doc__, "64, 128")
    print(f"# {device}; seqlen_q {SEQLEN_Q}, batch 4, hidden 2048, bf16; ms per call (bench._median_ms)", flush=True)
    median_ms, view = bench._median_ms, bench.torch_view
    rows = []
    for d in args.head_dim or [64, 128]:
        batch, heads = 16384 // SEQLEN_Q, 2048 // d
        rs = cupy.random.default_rng(d)
        q, k, v, dout = (rs.standard_normal((batch, SEQLEN_Q, heads, d), dtype=numpy.float32).astype(BFLOAT16)
                         for _ in range(4))
        for n in (1, 3, 4):
            print(f"# d{d} check: block-sparse, first {n} blocks, against dense on those keys: max |diff| "
                  f"{check_first_blocks(q, k, v, dout, n, heads):.2e}", flush=True)

        def key_prefix(keys):
            return tuple(cupy.ascontiguousarray(x[:, :keys]) for x in (k, v))

        def ours_dense(n):
            ks, vs = key_prefix(n * BLOCK)
            out, lse = cupyflash.attention(q, ks, vs, return_lse=True)
            return (lambda: cupyflash.attention(q, ks, vs, return_lse=True),
                    lambda: cupyflash.attention_backward(dout, q, ks, vs, out, lse), contextlib.nullcontext())

        def torch_dense(backend):
            def calls(n):
                tq = view(q).detach().requires_grad_()
                tk, tv = (view(x).detach().requires_grad_() for x in key_prefix(n * BLOCK))
                tdo = view(dout)
                sdpa = torch.nn.functional.scaled_dot_product_attention
                with sdpa_kernel(backend):
                    out = sdpa(tq, tk, tv)
                # Timed inside the backend's context, as bench.time_torch_sdpa does.
                return (lambda: sdpa(tq, tk, tv), lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True),
                        sdpa_kernel(backend))
            return calls

        def ours_sparse(mask):
            out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
            return (lambda: cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True),
                    lambda: cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask),
                    contextlib.nullcontext())

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(view(q), view(k), view(v))
        ours = cupyflash.attention(q, k, v)
        diff = float(cupy.abs(cupy.from_dlpack(ref.transpose(1, 2).contiguous()).astype(cupy.float32)
                              - ours.astype(cupy.float32)).max())
        print(f"# d{d} check: cupyflash dense out against cuDNN's: max |diff| {diff:.2e}", flush=True)

        def kernel_and_host(fwd, bwd):
            out = {}
            for x, call in (("fwd", fwd), ("bwd", bwd)):
                out[f"{x}_kernel_ms"] = replay_us(record_launches(call)) / 1e3
                out[f"{x}_host_us"] = _wall(cupy, call, 50)  # us to queue a call, the GPU behind
            return out

        rng = numpy.random.default_rng(d)
        methods = {
            "cupyflash dense": ours_dense,
            "cudnn dense": torch_dense(SDPBackend.CUDNN_ATTENTION),
            "fa2 dense": torch_dense(SDPBackend.FLASH_ATTENTION),
            "cupyflash sparse first-n": lambda n: ours_sparse(exact_rows_mask(n, heads, False, None)),
            "cupyflash sparse random-n": lambda n: ours_sparse(exact_rows_mask(n, heads, True, rng)),
        }
        for method, make in methods.items():
            full = None
            for n in KEY_BLOCKS:
                fwd, bwd, context = make(n)
                with context:
                    times = (median_ms(fwd, args.max_seconds), median_ms(bwd, args.max_seconds))
                row = {"device": device, "head_dim": d, "method": method, "key_blocks": n,
                       "density": n / KEY_BLOCKS[-1], "fwd_ms": times[0], "bwd_ms": times[1]}
                if method.startswith("cupyflash"):
                    row.update(kernel_and_host(fwd, bwd))
                full = row if n == KEY_BLOCKS[-1] else full
                rows.append(row)
            for r in rows[-len(KEY_BLOCKS):]:
                for x in ("fwd", "bwd"):
                    r[f"{x}_vs_full"] = r[f"{x}_ms"] / full[f"{x}_ms"]
                    if f"{x}_kernel_ms" in r:
                        r[f"{x}_kernel_vs_full"] = r[f"{x}_kernel_ms"] / full[f"{x}_kernel_ms"]
        for pattern in ("random", "local"):
            mask = bench_sparse.make_mask(pattern, 0.1, SEQLEN_Q, heads, numpy.random.default_rng(SEQLEN_Q))
            fwd, bwd, _ = ours_sparse(mask)
            times = (median_ms(fwd, args.max_seconds), median_ms(bwd, args.max_seconds))
            dense = next(r for r in rows if r["head_dim"] == d and r["method"] == "cupyflash dense"
                         and r["key_blocks"] == KEY_BLOCKS[-1])
            row = {"device": device, "head_dim": d, "method": f"cupyflash sparse grid {pattern}",
                   "key_blocks": mask.density * KEY_BLOCKS[-1], "density": mask.density,
                   "fwd_ms": times[0], "bwd_ms": times[1], **kernel_and_host(fwd, bwd)}
            for x in ("fwd", "bwd"):
                row[f"{x}_vs_full"] = row[f"{x}_ms"] / dense[f"{x}_ms"]
                row[f"{x}_kernel_vs_full"] = row[f"{x}_kernel_ms"] / dense[f"{x}_kernel_ms"]
            rows.append(row)
        del q, k, v, dout
        cupy.get_default_memory_pool().free_all_blocks()

    if args.out:
        write_csv(args.out, rows)
    print(f"\n## {device}: time against the same method's 32 key blocks (the full problem); "
          "bound 1.2 x density; '*' over it")
    print("# call: bench._median_ms of whole calls; kernels: the calls' launches replayed; host: us to queue a call")
    print(f"{'d':>3} {'method':30} {'blocks':>6} {'density':>7} {'bound':>6} |"
          + "".join(f" {x + ' ms':>7} {'ratio':>7} {'kernels':>7} {'ratio':>7} {'host':>5} |" for x in ("fwd", "bwd")))
    for r in rows:
        bound = 1.2 * r["density"]
        line = f"{r['head_dim']:3d} {r['method']:30} {r['key_blocks']:6.2f} {r['density']:7.4f} {bound:6.3f} |"
        for x in ("fwd", "bwd"):
            line += f" {r[f'{x}_ms']:7.4f} {r[f'{x}_vs_full']:6.3f}{'*' if r[f'{x}_vs_full'] > bound else ' '}"
            if f"{x}_kernel_ms" in r:
                ratio = r[f"{x}_kernel_vs_full"]
                line += f" {r[f'{x}_kernel_ms']:7.4f} {ratio:6.3f}{'*' if ratio > bound else ' '} {r[f'{x}_host_us']:5.0f} |"
            else:
                line += f" {'':7} {'':7} {'':5} |"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
