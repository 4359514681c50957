"""cupyflash from the shell: check and time attention on this machine, run the benchmarks, ask
which kernels a call takes, compile every kernel.

    run (the default)   checks attention on this machine against the float64 reference and times
                        it: on a GPU, the kernels beside standard CuPy attention; without one,
                        the NumPy fallback on a small problem
    bench               the benchmark grids: cupyflash beside PyTorch's SDPA backends,
                        FlexAttention and standard attention (needs a GPU and PyTorch; `bench
                        --cpu`, the NumPy fallback beside plain NumPy attention, needs neither)
    explain             which kernels a call takes, and why the others do not (no GPU needed with
                        --compute-capability)
    check-kernels       compiles every kernel for sm_80 and sm_90a with NVRTC and reports
                        registers, shared memory and spills (no GPU needed; needs the CUDA extra)

`python -m cupyflash COMMAND --help` lists a command's options.
"""

from __future__ import annotations

import re
import sys
import time

import numpy

from cupyflash import arguments
from cupyflash.catalog import tiles

PROG = "python -m cupyflash"
COMMANDS = ("run", "bench", "explain", "check-kernels")
_CPU_DEFAULTS = {"batch": 1, "seqlen": 256, "heads": 2, "head_dim": 64, "dtype": "float32", "repeat": 3}
_GPU_DEFAULTS = {"batch": 4, "seqlen": 4096, "heads": 16, "head_dim": 128, "dtype": "float16", "repeat": 30}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} [COMMAND] [OPTIONS]\n\n{__doc__.strip()}")
        return 0
    if not argv or argv[0].startswith("-"):
        argv = ["run", *argv]  # `python -m cupyflash --seqlen 2048` is the run command
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        arguments.fail(PROG, f"unknown command {command!r}; the commands are {', '.join(COMMANDS)} "
                             f"({PROG} --help says what each does)")
    if command == "bench":  # its own parser lists its options (`bench --help`)
        return bench_command(rest)
    parser = {"run": _run_parser, "explain": _explain_parser, "check-kernels": _check_kernels_parser}[command]()
    args = parser.parse_args(rest)
    return {"run": run, "explain": explain_command, "check-kernels": check_kernels}[command](args, parser)


# --------------------------------------------------------------------------- bench


def bench_command(argv) -> int:
    from cupyflash import bench

    return bench.main(argv)


# --------------------------------------------------------------------------- options of a problem


def _problem_options(parser, gpu: dict, cpu: dict | None = None) -> None:
    """The problem's sizes, dtype and causal; unset ones take `gpu`'s values on a GPU, `cpu`'s
    without one (gpu's everywhere when cpu is None)."""

    def default(name):
        return f"{gpu[name]} on a GPU, {cpu[name]} without one" if cpu else str(gpu[name])

    parser.add_argument("--batch", type=arguments.positive_int, help=f"batch size (default: {default('batch')})")
    parser.add_argument("--seqlen", type=arguments.positive_int, help=f"seqlen_q (default: {default('seqlen')})")
    parser.add_argument("--seqlen-k", type=arguments.positive_int, help="seqlen_k (default: --seqlen)")
    parser.add_argument("--heads", type=arguments.positive_int, help=f"query heads (default: {default('heads')})")
    parser.add_argument("--head-dim", type=arguments.head_dim,
                        help=f"1 to {tiles.MAX_HEAD_DIM} (default: {default('head_dim')})")
    parser.add_argument("--dtype", choices=tiles.DTYPE_NAMES, help=f"the inputs' dtype (default: {default('dtype')})")
    parser.add_argument("--causal", action="store_true", help="causal attention, aligned bottom-right")


def _sizes(args, defaults: dict) -> dict:
    return {name: defaults[name] if getattr(args, name, None) is None else getattr(args, name) for name in defaults}


def _numpy_dtype(name):
    from cupyflash.validation import BFLOAT16

    return BFLOAT16 if name == "bfloat16" else numpy.dtype(name)


def _zero_strided(dtype, shape):
    """A stand-in array of `shape` for checks and explain, which read shapes and strides only."""
    return numpy.lib.stride_tricks.as_strided(numpy.zeros(1, dtype), shape, (0,) * (len(shape) - 1) + (dtype.itemsize,))


def _checked_explanation(prog: str, s: dict, seqlen_k: int, heads_kv: int, causal: bool, **options):
    """cupyflash.explain of the problem; a problem it refuses ends the command with its message."""
    import cupyflash

    dtype = _numpy_dtype(s["dtype"])
    q = _zero_strided(dtype, (s["batch"], s["seqlen"], s["heads"], s["head_dim"]))
    kv = _zero_strided(dtype, (s["batch"], seqlen_k, heads_kv, s["head_dim"]))
    try:
        return cupyflash.explain(q, kv, kv, causal=causal, **options)
    except (TypeError, ValueError) as e:  # the library's own message, naming what is wrong
        arguments.fail(prog, str(e))


# --------------------------------------------------------------------------- explain


def _explain_parser():
    from cupyflash.runtime.device import ARCHITECTURES

    parser = arguments.Parser(f"{PROG} explain", explain_command.__doc__)
    _problem_options(parser, _GPU_DEFAULTS)
    parser.add_argument("--heads-kv", type=arguments.positive_int, help="K/V heads, a divisor of --heads (GQA/MQA; "
                                                                         "default: --heads)")
    parser.add_argument("--deterministic", action="store_true", help="the deterministic backward")
    parser.add_argument("--compute-capability", type=int, choices=list(ARCHITECTURES), metavar="CC",
                        help=f"explain for a typical device of this compute capability instead of this machine's GPU "
                             f"({', '.join(map(str, ARCHITECTURES))})")
    return parser


def explain_command(args, parser) -> int:
    """Which kernels `cupyflash.attention` and its backward take for a problem, and why each other
    kernel family does not; nothing runs. Without a GPU, give --compute-capability."""
    s = _sizes(args, _GPU_DEFAULTS)
    print(_checked_explanation(parser.prog, s, args.seqlen_k or s["seqlen"], args.heads_kv or s["heads"], args.causal,
                               deterministic=args.deterministic, compute_capability=args.compute_capability))
    return 0


# --------------------------------------------------------------------------- check-kernels


def _check_kernels_parser():
    parser = arguments.Parser(f"{PROG} check-kernels", check_kernels.__doc__)
    parser.add_argument("--arch", action="append", type=_arch,
                        help="an architecture to compile for, e.g. sm_80, sm_86, sm_90a (repeatable; default: sm_80 "
                             "and sm_90a)")
    parser.add_argument("--dtype", action="append", choices=tiles.DTYPE_NAMES, help="only these dtypes (repeatable)")
    parser.add_argument("--source", action="append", metavar="FILE",
                        help="only the kernels of these sources, relative to kernels/ (e.g. sm90/fwd.cu; repeatable)")
    parser.add_argument("--allow-spills", action="store_true", help="do not fail on local-memory spills")
    parser.add_argument("--verbose", "-v", action="store_true", help="a line per kernel (default: a line per group)")
    parser.add_argument("--jobs", "-j", type=arguments.positive_int, help="processes (default: one per CPU)")
    return parser


def _arch(text: str) -> str:
    import argparse

    if not re.fullmatch(r"sm_\d{2,3}a?", text):
        raise argparse.ArgumentTypeError(f"expected an architecture such as sm_80 or sm_90a, got {text!r}")
    return text


def check_kernels(args, parser) -> int:
    """Compiles every kernel instantiation with NVRTC, as a GPU would on first use, and reports each
    one's registers, shared memory and local-memory spills; fails on a spill, a compile error, or
    wgmma products that ptxas serialized. Needs no GPU, but NVRTC: the CUDA extra. Tens of minutes
    for both architectures on a few cores."""
    import concurrent.futures
    import os

    from cupyflash.catalog import all_kernels
    from cupyflash.runtime import compiler

    missing = compiler.offline_unavailable()
    if missing:
        arguments.fail(parser.prog, missing)

    archs = args.arch or ["sm_80", "sm_90a"]
    sources = {k.source_file for arch in archs for k in all_kernels(arch)}
    unknown = sorted(set(args.source or ()) - sources)
    if unknown:
        arguments.fail(parser.prog, f"--source {unknown[0]!r} has no kernels; the sources are "
                                    f"{', '.join(sorted(sources))}")
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


def _run_parser():
    parser = arguments.Parser(f"{PROG} run", run.__doc__)
    _problem_options(parser, _GPU_DEFAULTS, _CPU_DEFAULTS)
    parser.add_argument("--repeat", type=arguments.positive_int,
                        help=f"timed runs of each, the median reported (default: {_GPU_DEFAULTS['repeat']} on a GPU, "
                             f"{_CPU_DEFAULTS['repeat']} without one)")
    return parser


def run(args, parser) -> int:
    """Checks attention on this machine against the float64 reference and times it. On a GPU:
    cupyflash's forward and forward + backward beside standard CuPy attention (cuBLAS and a softmax),
    with their peak memory. Without one: the NumPy fallback that a call on NumPy arrays takes there,
    on a small problem unless the options say otherwise."""
    from cupyflash.runtime.device import gpu_available

    on_gpu = gpu_available()
    s = _sizes(args, _GPU_DEFAULTS if on_gpu else _CPU_DEFAULTS)
    _checked_explanation(parser.prog, s, args.seqlen_k or s["seqlen"], s["heads"], args.causal)
    if on_gpu:
        return _run_gpu(args, s)
    unset = [n for n in ("batch", "seqlen", "heads", "head_dim") if getattr(args, n) is None]
    note = "" if not unset else (f" ({', '.join(f'{n} {s[n]}' for n in unset)}: the defaults without a GPU, smaller "
                                 f"than a GPU's)")
    print(f"No CUDA GPU available (cupy.cuda.is_available() is False or CuPy is not installed): running the NumPy "
          f"fallback{note}.")
    return _run_cpu(args, s)


def _run_cpu(args, s: dict) -> int:
    """The fallback a NumPy call takes without a GPU (16-bit inputs computed in float32, as the
    kernels accumulate), timed (median of s["repeat"] calls) and checked against the float64
    reference under the tests' rule: 2x the error of standard attention in the input precision."""
    import cupyflash
    from cupyflash import reference

    b, sq, h, d, name, repeat = (s[n] for n in ("batch", "seqlen", "heads", "head_dim", "dtype", "repeat"))
    sk = args.seqlen_k or sq
    dtype = _numpy_dtype(name)
    rng = numpy.random.default_rng(0)
    q, dout = (rng.standard_normal((b, sq, h, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, h, d)).astype(dtype) for _ in range(2))
    causal = args.causal

    def median_seconds(fn):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
        return float(numpy.median(times)), result

    t_fwd, (out, lse) = median_seconds(lambda: cupyflash.attention(q, k, v, causal=causal, return_lse=True))
    t_bwd, grads = median_seconds(lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal))
    exact = reference.attention(q, k, v, causal=causal)
    lowp = reference.attention_in_precision(q, k, v, dtype, causal=causal)
    err, bound = float(numpy.abs(out.astype(numpy.float64) - exact).max(initial=0.0)), reference.error_bound(exact, lowp, name)
    exact_grads = reference.attention_backward(dout, q, k, v, causal=causal)
    lowp_grads = reference.attention_backward_in_precision(dout, q, k, v, dtype, causal=causal)
    magnitudes = reference.gradient_term_magnitudes(dout, q, k, v, causal=causal)
    # dq, dk, dv each against its own bound; the one nearest its bound is reported
    grad_err, grad_bound = max(((float(numpy.abs(g.astype(numpy.float64) - e).max(initial=0.0)),
                                 reference.error_bound(e, lp, name, m))
                                for g, e, lp, m in zip(grads, exact_grads, lowp_grads, magnitudes)),
                               key=lambda x: x[0] / x[1])
    print(f"NumPy fallback ({name} inputs), batch {b}, seqlen_q {sq}, seqlen_k {sk}, heads {h}, head_dim {d}, "
          f"causal={causal}, median of {repeat}: forward {t_fwd * 1e3:.1f} ms, max |error| vs reference {err:.2e} "
          f"(bound {bound:.2e}); backward {t_bwd * 1e3:.1f} ms, max |error| {grad_err:.2e} (bound {grad_bound:.2e})")
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
    dtype = _numpy_dtype(sizes["dtype"])
    device = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode()
    print(f"{name}: batch {b}, seqlen_q {sq}, seqlen_k {sk}, heads {h}, head_dim {d}, {sizes['dtype']}, causal={args.causal}")

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
                reference.attention_in_precision(*sliced[:3], dtype, causal=causal), sizes["dtype"])
    exact = reference.attention_backward(sliced[3], *sliced[:3], causal=causal)
    lowp = reference.attention_backward_in_precision(sliced[3], *sliced[:3], dtype, causal=causal)
    for name, g, e, lp in zip(("dq", "dk", "dv"), grads, exact, lowp):
        ok &= _check(name, g[:1, :, :1].get(), e, lp, sizes["dtype"])

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
                rows.append((label, _median_ms(fn, sizes["repeat"]), _peak_extra_bytes(fn)))
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

