"""Every kernel family on small problems under compute-sanitizer's four tools.

    python tools/sanitize.py [--tool memcheck --tool racecheck ...] [--only NAME ...] [--out DIR]
                             [--sanitizer-option=--kernel-name-exclude --sanitizer-option=kns=NAME]

For each tool (default: memcheck, racecheck, synccheck, initcheck) it runs this file again as
`compute-sanitizer --tool T python tools/sanitize.py --problems`, which calls each problem below
through the public API (forward, then backward) with the memory pool off (so that an overrun
reaches past its own allocation) and the kernels compiled with line information
(CUPYFLASH_LINEINFO=1: the reports name source lines). The problems force one kernel family each
through the planner's policy (dispatch/policy.py's `override`); each prints the kernels that
`cupyflash.explain` says it takes. Each tool's full log goes to DIR; a table of errors per tool
ends the output, and the exit status is 1 if any tool reported an error. The kernels are compiled
first, each problem in a process of its own at once, so that the sanitized runs find them in
CuPy's kernel cache. Needs an NVIDIA GPU and
compute-sanitizer on PATH (or --sanitizer PATH); the Hopper problems run on sm_90 only.

initcheck does not see stores made by the TMA (`cp.async.bulk`: a probe's bytes stored that way
read back as uninitialised, the same bytes stored by `st.global` did not), and the
warp-specialised forward writes O that way, so every read of its O would be reported. Under
initcheck the problems therefore take the TMA forward, which stores O from registers; the
warp-specialised forward is covered by the other three tools.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def _problems():
    """(name, policy fields, whether it needs sm_90, call): call(rng) runs the problem."""
    import ml_dtypes
    import numpy

    import cupyflash

    def qkv(rng, dtype, b, sq, sk, h, d, h_kv=None):
        import cupy

        h_kv = h_kv or h
        return [cupy.asarray(rng.standard_normal(s).astype(dtype))
                for s in ((b, sq, h, d), (b, sk, h_kv, d), (b, sk, h_kv, d))]

    def dense(dtype, shape, h_kv=None, **options):
        deterministic = options.pop("deterministic", False)

        def call(rng):
            import cupy

            q, k, v = qkv(rng, dtype, *shape, h_kv=h_kv)
            out, lse = cupyflash.attention(q, k, v, return_lse=True, **options)
            dout = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
            cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
            return q, k, v, {**options, "deterministic": deterministic}
        return call

    def sparse(dtype, shape, mask):
        def call(rng):
            import cupy

            q, k, v = qkv(rng, dtype, *shape)
            out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
            dout = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
            cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask)
            return q, k, v, {"block_mask": mask}
        return call

    def varlen(dtype, lengths_q, lengths_k, d, **options):
        def call(rng):
            import cupy

            cu_q = numpy.concatenate([[0], numpy.cumsum(lengths_q)]).astype(numpy.int32)
            cu_k = numpy.concatenate([[0], numpy.cumsum(lengths_k)]).astype(numpy.int32)
            q = cupy.asarray(rng.standard_normal((int(cu_q[-1]), 2, d)).astype(dtype))
            k, v = (cupy.asarray(rng.standard_normal((int(cu_k[-1]), 2, d)).astype(dtype)) for _ in range(2))
            out, lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
            dout = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
            cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options)
        return call

    def decode(dtype, d, num_splits, seqlen_q=2, heads=4):
        def call(rng):
            import cupy

            q = cupy.asarray(rng.standard_normal((3, seqlen_q, heads, d)).astype(dtype))
            k_cache, v_cache = (cupy.asarray(rng.standard_normal((3, 700, 2, d)).astype(dtype)) for _ in range(2))
            k_new, v_new = (cupy.asarray(rng.standard_normal((3, seqlen_q, 2, d)).astype(dtype)) for _ in range(2))
            lengths = numpy.array([0, 333, 698], numpy.int32)
            cupyflash.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, causal=True,
                                       num_splits=num_splits)
        return call

    def mask_on_device(rng):
        cupyflash.dropout_mask(2, 3, 130, 257, dropout_p=0.2, seed=7, device=True)

    bf16, f16 = ml_dtypes.bfloat16, numpy.float16
    hopper_off = {"hopper_forward": False, "hopper_backward": False}
    mask = cupyflash.BlockMask.local(384, 512, window=200)
    return [
        # The Hopper families: the warp-specialised forward and dK/dV kernel (the reported problem),
        # with and without its dQ ring; the TMA builds; their cp.async twins.
        ("sm90-ws, ws dK/dV", {"ws_backward": True}, True, dense(bf16, (1, 257, 130, 2, 128))),
        ("sm90-ws, ws dK/dV, dQ ring", {"ws_backward": True, "ring_slabs": 1}, True,
         dense(bf16, (2, 300, 520, 2, 64))),
        ("sm90-tma causal, TMA dK/dV", {"ws_forward": False, "ws_backward": False}, True,
         dense(f16, (2, 200, 333, 2, 64), causal=True)),
        ("sm90 cp.async, window, GQA", {"tma": False}, True,
         dense(bf16, (1, 190, 260, 4, 100), h_kv=2, window=(70, 20))),
        ("sm90 softcap, ALiBi", {}, True,
         dense(bf16, (1, 150, 150, 2, 64), softcap=30.0, alibi_slopes=numpy.array([0.5, 0.25], numpy.float32))),
        ("sm90-tma softcap, ALiBi", {}, True,
         dense(bf16, (1, 150, 150, 2, 128), softcap=30.0, alibi_slopes=numpy.array([0.5, 0.25], numpy.float32))),
        ("sm90 block-sparse", {}, True, sparse(bf16, (1, 384, 512, 2, 128), mask)),
        ("sm90 deterministic", {}, True, dense(bf16, (1, 200, 300, 2, 128), deterministic=True)),
        ("sm90 dropout", {}, True, dense(f16, (1, 140, 150, 2, 64), dropout_p=0.2, seed=3)),
        ("sm90-tma dropout", {}, True, dense(bf16, (1, 140, 150, 2, 128), dropout_p=0.2, seed=3)),
        # The mma.sync families (every GPU from sm_80) and the CUDA-core ones.
        ("sm80", hopper_off, False, dense(f16, (2, 113, 203, 3, 40), causal=True)),
        ("sm80 d256, dropout, deterministic", hopper_off, False,
         dense(bf16, (1, 90, 70, 2, 256), dropout_p=0.1, seed=5, deterministic=True)),
        ("sm80 block-sparse", hopper_off, False, sparse(f16, (1, 384, 512, 2, 64), mask)),
        ("sm80 softcap, window", hopper_off, False, dense(bf16, (1, 100, 120, 2, 64), softcap=20.0, window=(30, 0))),
        ("sm80 float32 3xTF32", {"float32_precision": "high"}, False, dense(numpy.float32, (2, 17, 113, 2, 59), causal=True)),
        ("sm80 float32 TF32 softcap", {"float32_precision": "medium"}, False,
         dense(numpy.float32, (1, 100, 120, 2, 128), softcap=20.0, window=(30, 0))),
        ("sm80 float32 block-sparse", {"float32_precision": "high"}, False, sparse(numpy.float32, (1, 384, 512, 2, 64), mask)),
        ("scalar float32", {}, False,
         dense(numpy.float32, (2, 17, 113, 2, 59), causal=True)),
        ("sm80 float64 DMMA, window", {}, False, dense(numpy.float64, (1, 65, 33, 2, 111), window=(10, 10))),
        ("sm80 float64 DMMA softcap, dropout", {}, False,
         dense(numpy.float64, (1, 100, 120, 2, 64), softcap=20.0, dropout_p=0.2, seed=3)),
        ("sm80 float64 DMMA block-sparse", {}, False, sparse(numpy.float64, (1, 384, 512, 2, 40), mask)),
        ("varlen float64 DMMA", {}, False, varlen(numpy.float64, [17, 3], [40, 1], 128)),
        ("varlen float64 DMMA d64", {}, False, varlen(numpy.float64, [70, 3], [40, 90], 64, causal=True)),
        ("sm80 float64 DMMA deterministic, GQA", {}, False,
         dense(numpy.float64, (1, 90, 130, 4, 96), h_kv=2, deterministic=True)),
        ("scalar float64", {"families": ("scalar",)}, False, dense(numpy.float64, (1, 65, 33, 2, 111), window=(10, 10))),
        ("scalar 16-bit", {"families": ("scalar",)}, False, dense(f16, (1, 50, 70, 2, 32))),
        ("varlen", {}, False, varlen(bf16, [1, 130, 0, 257], [5, 100, 30, 300], 64, causal=True)),
        ("varlen float32", {}, False, varlen(numpy.float32, [17, 3], [40, 1], 40)),
        ("decode split", {}, False, decode(bf16, 128, 3)),
        ("decode float32", {}, False, decode(numpy.float32, 64, None)),
        ("decode float64 split", {}, False, decode(numpy.float64, 96, 3)),
        ("decode one row, staged", {}, False, decode(numpy.float32, 128, 3, seqlen_q=1, heads=2)),
        ("decode one row, staged float64", {}, False, decode(numpy.float64, 40, None, seqlen_q=1, heads=2)),
        ("dropout_mask", {}, False, mask_on_device),
    ]


def run_problems(only, initcheck: bool) -> None:
    """The child under compute-sanitizer: each problem in turn."""
    import cupy
    import numpy

    import cupyflash
    from cupyflash.dispatch import policy

    cupy.cuda.set_allocator(None)  # every allocation its own: an overrun is not hidden in the pool
    hopper = cupy.cuda.Device().compute_capability == "90"
    seed = int(os.environ.get("CUPYFLASH_TEST_SEED", "0")) or int(time.time())
    print(f"seed {seed}", flush=True)
    for name, fields, needs_hopper, call in _problems():
        if (only and name not in only) or (needs_hopper and not hopper):
            continue
        if initcheck and needs_hopper:
            fields = {"ws_forward": False, **fields}
        with policy.override(**fields):
            ran = call(numpy.random.default_rng(seed))
            taken = ""
            if ran is not None:
                q, k, v, options = ran
                e = cupyflash.explain(q, k, v, **options)
                taken = f"{e.forward.kernel.source_file} + {e.backward.kernel.source_file}"
        cupy.cuda.Device().synchronize()
        print(f"ran {name}: {taken}", flush=True)


def errors_in(tool: str, log: str) -> int | None:
    if tool == "racecheck":
        found = _RACE_SUMMARY.search(log)
        if found:
            return int(found.group(2))
    found = _SUMMARY.search(log)
    return int(found.group(1)) if found else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tool", action="append", choices=TOOLS, help="default: all four")
    ap.add_argument("--only", action="append", help="a problem's name (default: every problem)")
    ap.add_argument("--skip", action="append", default=[], help="a problem's name to leave out")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("sanitizer-logs"))
    ap.add_argument("--sanitizer", default=shutil.which("compute-sanitizer") or "compute-sanitizer")
    ap.add_argument("--sanitizer-option", action="append", default=[], help="passed to compute-sanitizer")
    ap.add_argument("--problems", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--initcheck", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.problems:
        run_problems(args.only or [], args.initcheck)
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUPYFLASH_LINEINFO": "1"}
    names = [n for n in args.only or [name for name, *_ in _problems()] if n not in args.skip]
    compiling = [subprocess.Popen([sys.executable, __file__, "--problems", f"--only={n}"], env=env,
                                  stdout=subprocess.DEVNULL) for n in names]
    if any(c.wait() for c in compiling):
        print("a problem failed without the sanitizer: run `python tools/sanitize.py --problems` to see it")
        return 1
    child = [sys.executable, __file__, "--problems"] + [f"--only={n}" for n in names]
    rows = []
    for tool in args.tool or TOOLS:
        log_path = args.out / f"{tool}.log"
        extra = ["--racecheck-report", "hazard"] if tool == "racecheck" else []
        tool_child = child + ["--initcheck"] if tool == "initcheck" else child
        started = time.perf_counter()
        done = subprocess.run([args.sanitizer, "--tool", tool, "--print-limit", "100", *extra,
                               *args.sanitizer_option, *tool_child],
                              env=env, capture_output=True, text=True)
        log = done.stdout + done.stderr
        log_path.write_text(log)
        ran = log.count("\nran ") + log.startswith("ran ")
        rows.append((tool, errors_in(tool, log), done.returncode, ran, time.perf_counter() - started))
    print(f"{'tool':10} {'errors':>6} {'exit':>4} {'problems':>8} {'seconds':>8}")
    for tool, errors, code, ran, seconds in rows:
        print(f"{tool:10} {'?' if errors is None else errors:>6} {code:>4} {ran:>8} {seconds:>8.0f}")
    return int(any(errors != 0 or code != 0 for _, errors, code, _, _ in rows))


if __name__ == "__main__":
    sys.exit(main())
