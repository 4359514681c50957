"""Command line.

    python -m cupyflash [--batch 4 --seqlen 4096 --heads 16 --head-dim 128 --dtype float16 --causal]
        Runs attention forward and forward + backward on the GPU, checks a slice of out, dq, dk,
        dv against the float64 reference, and prints time, TFLOP/s, and speed-up and peak extra
        memory against standard CuPy attention. With no GPU, runs the NumPy tiled fallback on a
        small problem instead.

    python -m cupyflash bench [--dtype bfloat16 --head-dim 128 --seqlen 4096 ... --flex]
        The FlashAttention benchmark grid against PyTorch SDPA's backends, FlexAttention and
        standard attention (benchmarks/bench.py; needs a source checkout, a GPU, tqdm and
        matplotlib): correctness first, then median CUDA-event timings, a table, CSV and PNG.

    python -m cupyflash check-kernels [--arch sm_80 --arch sm_90a] [--dtype float16 ...]
        Compiles every kernel instantiation with NVRTC (no GPU needed), prints registers, shared
        memory and spills per kernel, and exits non-zero on a compile failure or a spill.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy

from cupyflash import _instantiations as inst


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["check-kernels"]:
        return check_kernels(argv[1:])
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    return run(argv)


# --------------------------------------------------------------------------- bench


def bench(argv) -> int:
    """Runs benchmarks/bench.py of the source tree (it is not part of an installed wheel)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
    if not path.is_file():
        print(f"bench runs from a source checkout: {path} not found", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("cupyflash_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.main(argv)


# --------------------------------------------------------------------------- check-kernels


def check_kernels(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash check-kernels")
    parser.add_argument("--arch", action="append", help="e.g. sm_80, sm_90a (repeatable; default both)")
    parser.add_argument("--dtype", action="append", choices=inst.DTYPE_NAMES, help="only these dtypes")
    parser.add_argument("--allow-spills", action="store_true", help="do not fail on local-memory spills")
    args = parser.parse_args(argv)
    from cupyflash import _compile

    archs = args.arch or ["sm_80", "sm_90a"]
    failed = spilled = serialized = total = 0
    print(f"{'arch':7} {'regs':>4} {'smem B':>7} {'stack':>5} {'spill st/ld':>11}  kernel")
    for arch in archs:
        kernels = [k for k in inst.all_kernels(arch) if not args.dtype or k.dtype_name in args.dtype]
        total += len(kernels)
        for source, dtype_name in sorted({(k.source_file, k.dtype_name) for k in kernels}):
            group = [k for k in kernels if k.dtype_name == dtype_name and k.source_file == source]
            start = time.perf_counter()
            try:
                reports = _compile.compile_offline(group, arch)
            except RuntimeError as e:
                print(f"{arch}: FAILED to compile {source} {dtype_name} kernels:\n{e}")
                failed += len(group)
                continue
            for r in reports:
                spill = r.spill_store_bytes + r.spill_load_bytes
                spilled += spill > 0
                serialized += r.wgmma_serialized
                flag = ("  <-- SPILLS" if spill else "") + ("  <-- WGMMA SERIALIZED" if r.wgmma_serialized else "")
                print(
                    f"{r.arch:7} {r.registers:4d} {r.smem_bytes:7d} {r.stack_bytes:5d} "
                    f"{r.spill_store_bytes:5d}/{r.spill_load_bytes:<5d}  {r.name_expression}{flag}"
                )
            print(f"# {arch} {source} {dtype_name}: {len(group)} kernels in {time.perf_counter() - start:.1f} s")
    print(f"{total - failed} of {total} kernel builds compiled; {spilled} spill; {serialized} wgmma serialized")
    return 1 if failed or serialized or (spilled and not args.allow_spills) else 0


# --------------------------------------------------------------------------- the demo run


def run(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash", description=__doc__.split("\n\n")[1])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096, help="seqlen_q (and seqlen_k unless given)")
    parser.add_argument("--seqlen-k", type=int, default=None)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="float16", choices=inst.DTYPE_NAMES)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeat", type=int, default=30, help="timed runs (median reported)")
    args = parser.parse_args(argv)

    from cupyflash._attention import gpu_available

    if not gpu_available():
        print("No CUDA GPU available (cupy.cuda.is_available() is False): running the NumPy tiled fallback on a small problem.")
        return _run_cpu(args)
    return _run_gpu(args)


def _numpy_dtype(name):
    from cupyflash._validation import BFLOAT16

    return BFLOAT16 if name == "bfloat16" else numpy.dtype(name)


def _run_cpu(args) -> int:
    from cupyflash import reference

    b, s, h, d = 1, 256, 2, min(args.head_dim, 64)
    rng = numpy.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, s, h, d)).astype(numpy.float32) for _ in range(3))
    dout = rng.standard_normal((b, s, h, d))
    start = time.perf_counter()
    out, lse = reference.tiled_attention(q, k, v, causal=args.causal, return_lse=True)
    middle = time.perf_counter()
    grads = reference.tiled_attention_backward(dout, q, k, v, out, lse, causal=args.causal)
    end = time.perf_counter()
    err = numpy.abs(out - reference.attention(q, k, v, causal=args.causal)).max()
    exact = reference.attention_backward(dout, q, k, v, causal=args.causal)
    grad_err = max(numpy.abs(g - e).max() for g, e in zip(grads, exact))
    print(f"tiled NumPy attention, batch {b}, seqlen {s}, heads {h}, head_dim {d}, causal={args.causal}: "
          f"forward {(middle - start) * 1e3:.1f} ms, max |error| vs reference {err:.2e}; "
          f"backward {(end - middle) * 1e3:.1f} ms, max |error| {grad_err:.2e}")
    return 0 if max(err, grad_err) < 1e-10 else 1


def _peak_extra_bytes(fn):
    """Device memory fn allocates, counted in a private CuPy pool: a fresh pool keeps every block
    it ever handed out, so its total is the high-water mark of the call (outputs included)."""
    import cupy

    pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc):
        result = fn()
        cupy.cuda.runtime.deviceSynchronize()
    del result
    peak = pool.total_bytes()
    pool.free_all_blocks()
    return peak


def _median_ms(fn, repeat):
    from cupyx.profiler import benchmark

    timing = benchmark(fn, (), n_repeat=repeat, n_warmup=3)
    return float(numpy.median(timing.gpu_times[0])) * 1e3


def _run_gpu(args) -> int:
    import cupy

    import cupyflash
    from cupyflash import reference, standard

    sk = args.seqlen_k or args.seqlen
    b, sq, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    dtype = _numpy_dtype(args.dtype)
    device = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode()
    print(f"{name}: batch {b}, seqlen_q {sq}, seqlen_k {sk}, heads {h}, head_dim {d}, {args.dtype}, causal={args.causal}")

    rs = cupy.random.default_rng(0)
    q = rs.standard_normal((b, sq, h, d), dtype=numpy.float32).astype(dtype)
    k = rs.standard_normal((b, sk, h, d), dtype=numpy.float32).astype(dtype)
    v = rs.standard_normal((b, sk, h, d), dtype=numpy.float32).astype(dtype)

    dout = rs.standard_normal((b, sq, h, d), dtype=numpy.float32).astype(dtype)
    causal = args.causal

    start = time.perf_counter()
    out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    cupy.cuda.runtime.deviceSynchronize()
    print(f"first forward + backward (compile or load from cache + run): {time.perf_counter() - start:.2f} s")

    # Correctness: batch 0, head 0, every query and key, against the float64 reference.
    sliced = [x[:1, :, :1].get() for x in (q, k, v, dout)]
    ok = _check("out", out[:1, :, :1].get(), reference.attention(*sliced[:3], causal=causal),
                reference.attention_in_precision(*sliced[:3], dtype, causal=causal), args.dtype)
    exact = reference.attention_backward(sliced[3], *sliced[:3], causal=causal)
    lowp = reference.attention_backward_in_precision(sliced[3], *sliced[:3], dtype, causal=causal)
    for name, g, e, lp in zip(("dq", "dk", "dv"), grads, exact, lowp):
        ok &= _check(name, g[:1, :, :1].get(), e, lp, args.dtype)

    def forward():
        return cupyflash.attention(q, k, v, causal=causal)

    def forward_backward(deterministic=False):
        o, l = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
        return cupyflash.attention_backward(dout, q, k, v, o, l, causal=causal, deterministic=deterministic)

    fwd_flops = standard.flops(b, h, sq, sk, d, causal)
    fwd_bwd_flops = fwd_flops * (1 + standard.BACKWARD_FLOPS_RATIO)
    runs = {
        "forward": [("cupyflash", forward), ("standard (CuPy)", lambda: standard.standard_attention(q, k, v, causal=causal))],
        "forward + backward": [
            ("cupyflash", forward_backward),
            ("cupyflash deterministic", lambda: forward_backward(True)),
            ("standard (CuPy)", lambda: standard.standard_attention_forward_backward(q, k, v, dout, causal=causal)),
        ],
    }
    print(f"\n{'':20} {'':24} {'median ms':>10} {'TFLOP/s':>8} {'vs std':>7} {'peak extra MiB':>15}")
    for phase, entries in runs.items():
        flops = fwd_flops if phase == "forward" else fwd_bwd_flops
        rows = []
        for label, fn in entries:
            try:
                rows.append((label, _median_ms(fn, args.repeat), _peak_extra_bytes(fn)))
            except cupy.cuda.memory.OutOfMemoryError as e:  # standard attention materialises seqlen_q x seqlen_k
                print(f"{phase:20} {label:24} out of device memory ({e})")
        t_std = rows[-1][1] if rows[-1][0].startswith("standard") else float("nan")
        for label, t, m in rows:
            print(f"{phase:20} {label:24} {t:10.3f} {flops / t / 1e9:8.1f} {t_std / t:6.2f}x {m / 2**20:15.1f}")
    print("(TFLOP/s: forward 4·b·h·sq·sk·d, backward 2.5x that, halved for causal; peak extra: device "
          "memory allocated during one call, outputs included)")
    return 0 if ok else 1


def _check(name, got, exact, lowp, dtype_name) -> bool:
    from cupyflash import reference

    got = got.astype(numpy.float64)
    err = float(numpy.abs(got - exact).max(initial=0.0))
    bound = reference.error_bound(exact, lowp, dtype_name)
    ok = bool(numpy.isfinite(got).all()) and err <= bound
    print(f"check {name:3} vs float64 reference (batch 0, head 0): max |error| {err:.3e}, bound {bound:.3e} "
          f"-> {'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
