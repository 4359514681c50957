"""Where the backward's time goes, kernel by kernel, a development tool.

    python benchmarks/bwd_breakdown.py [--head-dim 128] [--seqlen 4096] [--density 1.0] [--pattern random]

Captures the launches one attention_backward (or block_sparse_attention_backward) call makes,
then times each alone (median of CUDA-event-timed replays, cupyx.profiler.benchmark): the
preprocess (D_i, lse_i·log2(e), and the dQ workspace cleared: a memset of its own before session
26), the dK/dV kernel (its TMA build where one serves, warp-specialised at WS_BACKWARD_HEAD_DIMS,
and its twin without TMA: cp.async copies, atomic dQ adds, one block per key block: the "atomic"
column), the
twin with no dQ (dq_accum null: what the dQ products and adds cost), and the dQ conversion; then
the whole call. Batch x seqlen = 16384 tokens, hidden 2048, bfloat16, as the sparse grid. The mask:
each block kept with probability --density, or with --pattern the sparse grid's own mask of that
pattern and density (bench_sparse.make_mask, the same seed).
"""

import argparse
import sys

import numpy


def main(argv=None):
    import cupy
    from cupyx.profiler import benchmark

    import cupyflash
    from cupyflash import _attention, _instantiations, _tma
    from cupyflash._validation import BFLOAT16

    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, action="append")
    ap.add_argument("--seqlen", type=int, action="append")
    ap.add_argument("--density", type=float, default=1.0, help="random block mask of this density (< 1)")
    ap.add_argument("--pattern", choices=("random", "local"), help="the sparse grid's mask (bench_sparse.py)")
    ap.add_argument("--n-repeat", type=int, default=30)
    args = ap.parse_args(argv)
    rng = numpy.random.default_rng(0)
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'d':>4} {'seqlen':>6} {'density':>7} | {'prep':>7} {'dkdv':>8} {'atomic':>8} {'no dQ':>8} "
          f"{'convert':>7} {'sum':>8} {'call':>8} | us (median)")
    for d in args.head_dim or [64, 128]:
        for s in args.seqlen or [4096, 16384]:
            b, h = max(1, 16384 // s), 2048 // d
            q, k, v, dout = (cupy.random.standard_normal((b, s, h, d), dtype=numpy.float32).astype(BFLOAT16)
                             for _ in range(4))
            mask = None
            if args.pattern:
                from bench_sparse import make_mask

                mask = make_mask(args.pattern, args.density, s, h, numpy.random.default_rng(s + d))
            elif args.density < 1:
                blocks = -(-s // 128)
                mask = cupyflash.BlockMask(rng.random((h, blocks, blocks)) < args.density)
            if mask is None:
                out, lse = cupyflash.attention(q, k, v, return_lse=True)
                call = lambda: cupyflash.attention_backward(dout, q, k, v, out, lse)  # noqa: E731
            else:
                out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
                call = lambda: cupyflash.block_sparse_attention_backward(  # noqa: E731
                    dout, q, k, v, out, lse, mask)
            launches = record_launches(call)
            real_launch = _attention._launch
            names = [type(kn).__name__ + ":" + getattr(kn, "name", "") for kn, *_ in launches]
            if len(launches) != 3:
                raise RuntimeError(f"expected preprocess, dK/dV, convert; got {names}")
            times = {}
            for label, (kernel, dev, grid, params, more) in zip(("prep", "dkdv", "convert"), launches):
                times[label] = benchmark(lambda: real_launch(kernel, dev, grid, params, *more),
                                         n_repeat=args.n_repeat, n_warmup=3)
            kernel, dev, grid, params, more = launches[1]
            twin = _instantiations.without_tma(kernel) if getattr(kernel, "tma", False) else kernel
            if getattr(kernel, "ws", False):  # the twin takes one block per key block
                grid = twin.grid(b, h, s, s)
            times["atomic"] = benchmark(lambda: real_launch(twin, dev, grid, params, _tma.NO_BWD_MAPS),
                                        n_repeat=args.n_repeat, n_warmup=3)
            no_dq = params.copy()
            no_dq["dq_accum"] = 0
            times["no dQ"] = benchmark(lambda: real_launch(twin, dev, grid, no_dq, _tma.NO_BWD_MAPS),
                                       n_repeat=args.n_repeat, n_warmup=3)
            times["call"] = benchmark(call, n_repeat=args.n_repeat, n_warmup=3)
            us = {key: float(numpy.median(t.gpu_times[0])) * 1e6 for key, t in times.items()}
            total = us["prep"] + us["dkdv"] + us["convert"]
            print(f"{d:>4} {s:>6} {args.density if mask is None else round(mask.density, 3):>7} | {us['prep']:7.1f} {us['dkdv']:8.1f} "
                  f"{us['atomic']:8.1f} {us['no dQ']:8.1f} {us['convert']:7.1f} {total:8.1f} {us['call']:8.1f}"
                  f"{'  (TMA dQ)' if twin is not kernel else ''}")
    return 0


class Launches(list):
    """Recorded launches; `kept`: the arrays the call made (its workspaces, its results), held so
    that replays write into them and not into whatever the memory pool hands their bytes to next
    (the warp-specialised dK/dV kernel's claims counter among them: replayed on reused bytes, it read
    garbage and ran out of bounds)."""

    kept: list


def problem_calls(q, k, v, dout, mask=None):
    """(forward, backward): zero-argument calls of the problem, dense (mask None) or block-sparse;
    the backward takes the out and lse of one forward made here."""
    import cupyflash

    if mask is None:
        out, lse = cupyflash.attention(q, k, v, return_lse=True)
        return (lambda: cupyflash.attention(q, k, v, return_lse=True),
                lambda: cupyflash.attention_backward(dout, q, k, v, out, lse))
    out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
    return (lambda: cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True),
            lambda: cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask))


def record_launches(call) -> Launches:
    """The kernel launches one call makes, as (kernel, device id, grid, params, more): copies of
    the argument images, to replay through `_attention._launch`. The call itself runs too."""
    import cupy

    from cupyflash import _attention

    launches = Launches()
    launches.kept = []
    real_launch = _attention._launch
    real = {name: getattr(cupy, name) for name in ("empty", "zeros")}

    def recording(kernel, device_id, grid, params, *more):
        launches.append((kernel, device_id, grid, params.copy(), tuple(m.copy() for m in more)))
        real_launch(kernel, device_id, grid, params, *more)

    def keeping(make):
        return lambda *args, **kwargs: launches.kept.append(make(*args, **kwargs)) or launches.kept[-1]

    _attention._launch = recording
    for name, make in real.items():
        setattr(cupy, name, keeping(make))
    try:
        launches.kept.append(call())
    finally:
        _attention._launch = real_launch
        for name, make in real.items():
            setattr(cupy, name, make)
    cupy.cuda.Device().synchronize()
    return launches


def replay_us(launches) -> float:
    """Median microseconds of `record_launches`' launches replayed back to back (bench._median_ms)."""
    import bench
    from cupyflash import _attention

    return bench._median_ms(lambda: [_attention._launch(*launch[:4], *launch[4]) for launch in launches], 0.3) * 1e3


if __name__ == "__main__":
    sys.exit(main())
