"""The warp-specialised Hopper dK/dV kernel against the one-block TMA build, a development tool (sm_90 only).

    python benchmarks/ws_bwd_ab.py [--head-dim 64] [--seqlen 4096] [--pattern random] [--density 0.1 ...]
                                   [--rounds 2] [--seqlen-q 512 ...] [--causal] [--kv-group 4]

For the sparse grid's shapes (batch x seqlen = 16384 tokens, hidden 2048, bf16, bench_sparse.make_mask's
masks; density 1 is the dense call): one backward call's launches recorded with each build
(WS_BACKWARD_BY_DEFAULT off, then on), then replayed back to back (bench._median_ms), rounds
alternating: the dK/dV kernel alone and the whole call's kernels. --seqlen-q gives the dense calls
fewer (or more) queries than keys (batch still 16384 tokens / seqlen, the keys), --causal makes them
causal (dense calls only: the masks are square), --kv-group G gives K and V heads / G heads (GQA).
Prints microseconds per round, the ratio of the warp-specialised build's median to the one-block
build's, and whether dK, dV are equal bit for bit (they should be: the same steps on the same tiles)
and the largest dQ difference.
"""

import argparse
import pathlib
import sys

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def main(argv=None):
    import cupy

    from cupyflash import _instantiations as inst

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, action="append", help="default: WS_BACKWARD_HEAD_DIMS")
    ap.add_argument("--seqlen", type=int, action="append", help="default 4096, 16384")
    ap.add_argument("--pattern", action="append", choices=("random", "local"), help="default both")
    ap.add_argument("--density", type=float, action="append", help="default 1 (dense), 0.25, 0.1, 0.05")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seqlen-q", type=int, action="append", help="dense calls' query lengths (default seqlen)")
    ap.add_argument("--causal", action="store_true", help="dense calls causal")
    ap.add_argument("--kv-group", type=int, default=1, help="query heads a K/V head (GQA)")
    args = ap.parse_args(argv)
    if cupy.cuda.Device().compute_capability != str(inst.WGMMA_COMPUTE_CAPABILITY):
        print("needs an sm_90 GPU (the Hopper dK/dV kernel)")
        return 1
    device = cupy.cuda.Device().id
    default = inst.WS_BACKWARD_BY_DEFAULT
    try:
        return _run(args, device)
    finally:
        inst.WS_BACKWARD_BY_DEFAULT = default


def _run(args, device) -> int:
    import cupy

    import bench_sparse
    import cupyflash
    from bwd_breakdown import record_launches, replay_us
    from cupyflash import _compile, _instantiations as inst
    from cupyflash._validation import BFLOAT16

    print(f"device: {cupy.cuda.runtime.getDeviceProperties(device)['name'].decode()}")
    print(f"{'d':>4} {'seqlen':>6} {'s_q':>6} {'pattern':>7} {'density':>7} | {'dK/dV one-block':>17} {'ws':>17} "
          f"{'ratio':>6} | {'call one-block':>17} {'ws':>17} {'ratio':>6} | bits dQ diff regs")
    shapes = [(d, seqlen, seqlen_q) for d in args.head_dim or list(inst.WS_BACKWARD_HEAD_DIMS)
              for seqlen in args.seqlen or [4096, 16384] for seqlen_q in args.seqlen_q or [seqlen]]
    for d, seqlen, seqlen_q in shapes:
        batch, heads = 16384 // seqlen, 2048 // d
        rs = cupy.random.default_rng(d)
        k, v = (rs.standard_normal((batch, seqlen, heads // args.kv_group, d), dtype=numpy.float32)
                .astype(BFLOAT16) for _ in range(2))
        q, dout = (rs.standard_normal((batch, seqlen_q, heads, d), dtype=numpy.float32).astype(BFLOAT16)
                   for _ in range(2))
        densities = args.density or [1.0, 0.25, 0.1, 0.05]
        problems = [("dense", 1.0)] if max(densities) >= 1 else []
        if seqlen_q == seqlen and not args.causal:  # (the masks are square)
            problems += [(pattern, density) for pattern in args.pattern or ["random", "local"]
                         for density in densities if density < 1]
        for pattern, density in problems:
            mask = None
            if density < 1:
                mask = bench_sparse.make_mask(pattern, density, seqlen, heads,
                                              numpy.random.default_rng(seqlen + d))
                out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
                call = lambda: cupyflash.block_sparse_attention_backward(  # noqa: E731
                    dout, q, k, v, out, lse, mask)
            else:
                out, lse = cupyflash.attention(q, k, v, causal=args.causal, return_lse=True)
                call = lambda: cupyflash.attention_backward(  # noqa: E731
                    dout, q, k, v, out, lse, causal=args.causal)
            builds, grads, regs = {}, {}, {}
            for ws in (False, True):
                inst.WS_BACKWARD_BY_DEFAULT = ws
                grads[ws] = call()
                launches = record_launches(call)  # (its arrays kept alive for the replays)
                kernel = launches[1][0]
                if getattr(kernel, "ws", False) != ws:
                    raise RuntimeError(f"expected ws={ws}, launched {kernel}")
                builds[ws] = launches
                regs[ws] = _compile.get_function(kernel, device).num_regs
            times = {}
            for _ in range(args.rounds):
                for ws, launches in builds.items():
                    times.setdefault((ws, "dkdv"), []).append(replay_us(launches[1:2]))
                    times.setdefault((ws, "call"), []).append(replay_us(launches))
            same = all((a.view(numpy.uint16) == b.view(numpy.uint16)).all()
                       for a, b in zip(grads[True][1:], grads[False][1:]))
            dq_diff = float(cupy.abs(grads[True][0].astype(numpy.float32)
                                     - grads[False][0].astype(numpy.float32)).max())
            cells = []
            for what in ("dkdv", "call"):
                one, per = times[(False, what)], times[(True, what)]
                cells.append(f"{' / '.join(f'{us:.1f}' for us in one):>17} "
                             f"{' / '.join(f'{us:.1f}' for us in per):>17} "
                             f"{numpy.median(per) / numpy.median(one):6.3f}")
            shown = 1.0 if mask is None else mask.density
            dense = "causal" if args.causal else "dense"
            print(f"{d:>4} {seqlen:>6} {seqlen_q:>6} {pattern if mask is not None else dense:>7} {shown:7.3f} | "
                  f"{cells[0]} | {cells[1]} | {'equal' if same else 'DIFFER'} {dq_diff:.3g} "
                  f"{regs[False]}/{regs[True]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
