"""The command line: `python -m cupyflash [COMMAND] ...`; `python -m cupyflash --help` lists the
commands, `python -m cupyflash COMMAND --help` each one's options.

    run (the default)   attention forward and forward + backward on the GPU, checked against the
                        float64 reference and timed beside standard CuPy attention (no GPU: the
                        NumPy tiled fallback on a small problem)
    bench               the benchmark grids against PyTorch's SDPA backends, FlexAttention and
                        standard attention (--sparse, --decode, --varlen, --variants, --host;
                        --cpu: the NumPy fallback beside plain NumPy attention, no GPU needed)
    explain             which kernels a call would take and why (no GPU needed with
                        --compute-capability)
    check-kernels       compiles every kernel instantiation with NVRTC (no GPU needed): registers,
                        shared memory, spills
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy

from cupyflash.catalog import tiles

COMMANDS = ("run", "bench", "explain", "check-kernels")
_CPU_DEFAULTS = {"batch": 1, "seqlen": 256, "heads": 2, "head_dim": 64}  # the fallback's demo problem
_GPU_DEFAULTS = {"batch": 4, "seqlen": 4096, "heads": 16, "head_dim": 128}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]  # `python -m cupyflash --seqlen 2048` is the run command
    parser = argparse.ArgumentParser(prog="python -m cupyflash", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _run_parser(commands.add_parser("run", help="check and time attention on this machine (the default)"))
    bench = commands.add_parser("bench", help="the benchmark grids against the peers (needs a GPU)", add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    _explain_parser(commands.add_parser("explain", help="which kernels a call takes, and why"))
    _check_kernels_parser(commands.add_parser("check-kernels", help="compile every kernel with NVRTC (no GPU needed)"))
    if argv[0] == "bench":  # its own parser lists its options (`bench --help`)
        return bench_command(argv[1:])
    args = parser.parse_args(argv)
    return {"run": run, "explain": explain_command, "check-kernels": check_kernels}[args.command](args)


# --------------------------------------------------------------------------- bench


def bench_command(argv) -> int:
    from cupyflash.runtime.device import gpu_available

    # (--table re-scores a recorded CSV; --cpu times the NumPy fallback)
    offline = any(a in ("-h", "--help", "--table", "--cpu") for a in argv)
    if not offline and not gpu_available():
        print("python -m cupyflash bench needs an NVIDIA GPU with a CUDA driver (cupy.cuda.is_available() is "
              "False here); `python -m cupyflash bench --cpu`, `check-kernels` and `explain --compute-capability` run "
              "without one.",
              file=sys.stderr)
        return 2
    from cupyflash import bench

    return bench.main(argv)


# --------------------------------------------------------------------------- explain


def _problem_options(parser) -> None:
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seqlen", type=int, default=None, help="seqlen_q (and seqlen_k unless given)")
    parser.add_argument("--seqlen-k", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--dtype", default="float16", choices=tiles.DTYPE_NAMES)
    parser.add_argument("--causal", action="store_true")


def _explain_parser(parser) -> None:
    _problem_options(parser)
    parser.add_argument("--heads-kv", type=int, default=None, help="K/V heads (GQA/MQA; default: heads)")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--compute-capability", type=int, default=None,
                        help="explain for a device of this kind (e.g. 80, 90) instead of this machine's GPU")


def _sizes(args, defaults: dict) -> dict:
    return {name: defaults[name] if getattr(args, name) is None else getattr(args, name) for name in defaults}


def explain_command(args) -> int:
    import cupyflash

    s = _sizes(args, _GPU_DEFAULTS)
    heads_kv = args.heads_kv or s["heads"]
    sk = args.seqlen_k or s["seqlen"]
    # Shapes and strides are all explain reads: zero-strided arrays stand in for the data.
    dtype = _numpy_dtype(args.dtype)
    q = numpy.lib.stride_tricks.as_strided(numpy.zeros(1, dtype), (s["batch"], s["seqlen"], s["heads"], s["head_dim"]),
                                           (0, 0, 0, dtype.itemsize))
    kv = numpy.lib.stride_tricks.as_strided(numpy.zeros(1, dtype), (s["batch"], sk, heads_kv, s["head_dim"]),
                                            (0, 0, 0, dtype.itemsize))
    print(cupyflash.explain(q, kv, kv, causal=args.causal, deterministic=args.deterministic,
                            compute_capability=args.compute_capability))
    return 0


# --------------------------------------------------------------------------- check-kernels


def _check_kernels_parser(parser) -> None:
    parser.add_argument("--arch", action="append", help="e.g. sm_80, sm_90a (repeatable; default both)")
    parser.add_argument("--dtype", action="append", choices=tiles.DTYPE_NAMES, help="only these dtypes")
    parser.add_argument("--source", action="append", help="only these kernel sources (e.g. sm90/fwd.cu)")
    parser.add_argument("--allow-spills", action="store_true", help="do not fail on local-memory spills")
    parser.add_argument("--verbose", "-v", action="store_true", help="a line per kernel (default: per group)")
    parser.add_argument("--jobs", "-j", type=int, default=None, help="processes (default: one per CPU)")


def check_kernels(args) -> int:
    import concurrent.futures
    import os

    from cupyflash.catalog import all_kernels

    archs = args.arch or ["sm_80", "sm_90a"]
    groups = []
    for arch in archs:
        kernels = [k for k in all_kernels(arch) if (not args.dtype or k.dtype_name in args.dtype)
                   and (not args.source or k.source_file in args.source)]
        for source, dtype_name in sorted({(k.source_file, k.dtype_name) for k in kernels}):
            groups.append((arch, source, dtype_name,
                           [k for k in kernels if k.dtype_name == dtype_name and k.source_file == source]))
    total = sum(len(g[3]) for g in groups)
    jobs = args.jobs or os.cpu_count() or 1
    print(f"compiling {total} kernel builds in {len(groups)} groups ({', '.join(archs)}) on {jobs} processes; "
          f"about a second a build", flush=True)
    failed = spilled = serialized = 0
    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        futures = {pool.submit(_compile_group, arch, group): (arch, source, dtype_name, group)
                   for arch, source, dtype_name, group in groups}
        for i, future in enumerate(concurrent.futures.as_completed(futures), 1):
            arch, source, dtype_name, group = futures[future]
            reports, error, seconds = future.result()
            if error is not None:
                print(f"{arch}: FAILED to compile {source} {dtype_name} kernels:\n{error}")
                failed += len(group)
                continue
            for r in reports:
                spill = r.spill_store_bytes + r.spill_load_bytes
                spilled += spill > 0
                serialized += r.wgmma_serialized
                flag = ("  <-- SPILLS" if spill else "") + ("  <-- WGMMA SERIALIZED" if r.wgmma_serialized else "")
                if args.verbose or flag:
                    print(f"{r.arch:7} {r.registers:4d} regs {r.smem_bytes:7d} B smem {r.stack_bytes:5d} B stack "
                          f"{r.spill_store_bytes:5d}/{r.spill_load_bytes:<5d} spill  {r.name_expression}{flag}")
            print(f"[{i}/{len(groups)}] {arch} {source} {dtype_name}: {len(group)} kernels in {seconds:.1f} s "
                  f"({time.perf_counter() - started:.0f} s so far)", flush=True)
    print(f"{total - failed} of {total} kernel builds compiled; {spilled} spill; {serialized} wgmma serialized")
    return 1 if failed or serialized or (spilled and not args.allow_spills) else 0


def _compile_group(arch: str, group: list):
    """compile_offline's reports for one group (in a worker process), or the error's text."""
    from cupyflash.runtime import compiler

    start = time.perf_counter()
    try:
        return compiler.compile_offline(group, arch), None, time.perf_counter() - start
    except RuntimeError as e:
        return None, str(e), time.perf_counter() - start


# --------------------------------------------------------------------------- the demo run


def _run_parser(parser) -> None:
    _problem_options(parser)
    parser.add_argument("--repeat", type=int, default=30, help="timed runs (median reported)")


def run(args) -> int:
    from cupyflash.runtime.device import gpu_available

    if not gpu_available():
        s = _sizes(args, _CPU_DEFAULTS)
        chosen = {name for name in _CPU_DEFAULTS if getattr(args, name) is not None}
        note = "" if chosen == set(_CPU_DEFAULTS) else (
            f" ({', '.join(f'{n} {s[n]}' for n in _CPU_DEFAULTS if n not in chosen)}: the CPU's defaults, smaller "
            f"than the GPU's; give --batch, --seqlen, --heads, --head-dim to choose)")
        print(f"No CUDA GPU available (cupy.cuda.is_available() is False): running the NumPy tiled fallback{note}.")
        return _run_cpu(args, s)
    return _run_gpu(args, _sizes(args, _GPU_DEFAULTS))


def _numpy_dtype(name):
    from cupyflash.validation import BFLOAT16

    return BFLOAT16 if name == "bfloat16" else numpy.dtype(name)


def _run_cpu(args, sizes: dict) -> int:
    """The fallback a NumPy call takes without a GPU (float32 here), timed and checked against the
    float64 reference under the tests' rule: 2x the error of standard attention in float32."""
    import cupyflash
    from cupyflash import reference

    b, s, h, d = (sizes[name] for name in ("batch", "seqlen", "heads", "head_dim"))
    sk = args.seqlen_k or s
    rng = numpy.random.default_rng(0)
    q, dout = (rng.standard_normal((b, s, h, d)).astype(numpy.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, h, d)).astype(numpy.float32) for _ in range(2))
    start = time.perf_counter()
    out, lse = cupyflash.attention(q, k, v, causal=args.causal, return_lse=True)
    middle = time.perf_counter()
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=args.causal)
    end = time.perf_counter()
    err = numpy.abs(out - reference.attention(q, k, v, causal=args.causal)).max()
    bound = reference.error_bound(reference.attention(q, k, v, causal=args.causal),
                                  reference.attention_in_precision(q, k, v, numpy.float32, causal=args.causal), "float32")
    exact = reference.attention_backward(dout, q, k, v, causal=args.causal)
    lowp = reference.attention_backward_in_precision(dout, q, k, v, numpy.float32, causal=args.causal)
    magnitudes = reference.gradient_term_magnitudes(dout, q, k, v, causal=args.causal)
    # dq, dk, dv each against its own bound; the one nearest its bound is reported
    grad_err, grad_bound = max(((numpy.abs(g - e).max(), reference.error_bound(e, lp, "float32", m))
                                for g, e, lp, m in zip(grads, exact, lowp, magnitudes)), key=lambda x: x[0] / x[1])
    print(f"tiled NumPy attention (float32), batch {b}, seqlen_q {s}, seqlen_k {sk}, heads {h}, head_dim {d}, "
          f"causal={args.causal}: "
          f"forward {(middle - start) * 1e3:.1f} ms, max |error| vs reference {err:.2e} (bound {bound:.2e}); "
          f"backward {(end - middle) * 1e3:.1f} ms, max |error| {grad_err:.2e} (bound {grad_bound:.2e})")
    return 0 if err <= bound and grad_err <= grad_bound else 1


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


def _run_gpu(args, sizes: dict) -> int:
    import cupy

    import cupyflash
    from cupyflash import reference, standard

    b, sq, h, d = (sizes[name] for name in ("batch", "seqlen", "heads", "head_dim"))
    sk = args.seqlen_k or sq
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

