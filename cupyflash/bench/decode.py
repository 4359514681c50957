"""KV-cache decoding: the bandwidth attention_decode reaches reading the cache, against a
device-to-device copy and PyTorch SDPA on the same shapes, timed in the same run.

    python -m cupyflash bench --decode [--dtype bfloat16] [--head-dim 128] [--max-seconds 0.1]

float32 and float64 run the CUDA-core decode kernel (their results are named `...-decode-<dtype>`).

Decoding reads every cached key and value once per step for one query row (or a few), so it is
bound by memory bandwidth: bytes = 2 (K and V) x batch x cache_len x heads_kv x head_dim x
itemsize. Two times for cupyflash: per call (back-to-back calls, the host's Python path included,
which bounds small caches) and the GPU's own (the call replayed from a CUDA graph). The copy peer is cudaMemcpyAsync of a buffer of that size (it reads and writes it, so
its bandwidth is 2 x bytes / time); the target is >= 80% of it at cache_len >= 8192. Correctness
first, on the same inputs: sequence 0's first K/V head group against the float64 reference under
the tolerance rule. SDPA gets the same cache as (batch, heads, cache_len, head_dim) views (GQA
through enable_gqa), each backend where it runs; a backend that refuses a shape is named with
its reason, never dropped silently.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import numpy

from cupyflash import arguments
from cupyflash.bench import common

TORCH_BACKENDS = ("flash", "efficient", "cudnn", "math")


@dataclasses.dataclass(frozen=True)
class Problem:
    batch: int
    cache_len: int
    heads: int
    heads_kv: int
    seqlen_q: int

    def bytes_read(self, head_dim: int, itemsize: int) -> int:
        return 2 * self.batch * self.cache_len * self.heads_kv * head_dim * itemsize

    def label(self) -> str:
        kind = "MHA" if self.heads == self.heads_kv else f"GQA {self.heads}/{self.heads_kv}"
        return f"b{self.batch} q{self.seqlen_q} {kind}"


def problems() -> list[Problem]:
    grid = []
    for batch, heads, heads_kv in ((1, 32, 32), (1, 32, 8), (8, 32, 32), (8, 32, 8)):
        for cache_len in (2048, 8192, 32768, 65536):
            grid.append(Problem(batch, cache_len, heads, heads_kv, 1))
    grid += [Problem(8, 8192, 32, 8, 4), Problem(8, 32768, 32, 8, 4)]  # a few new tokens per step
    return grid


def check(q, k, v, out, dtype_name) -> tuple[bool, str]:
    """The timed call's output for sequence 0 and the query heads of K/V head 0, against float64
    under the tolerance rule."""
    from cupyflash import reference
    from cupyflash.cpu.reference import as_float64

    group = q.shape[2] // k.shape[2]
    q0, k0, v0 = q[:1, :, :group], k[:1, :, :1], v[:1, :, :1]
    ref = reference.attention(q0, k0, v0)
    lowp = reference.attention_in_precision(q0, k0, v0, numpy.dtype(q.dtype))
    got = as_float64(out[:1, :, :group])
    err = float(numpy.abs(got - ref).max())
    bound = reference.error_bound(ref, lowp, dtype_name, magnitude=reference.output_term_magnitude(q0, k0, v0))
    return err <= bound and not bool(numpy.isnan(got).any()), f"err {err:.2e} <= {bound:.2e}"


def time_sdpa(torch, backend, q, k, v, max_seconds):
    """Milliseconds, or the reason the backend does not run the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    tq, tk, tv = (common.torch_view(x) for x in (q, k, v))  # (batch, heads, seq, head_dim) views
    gqa = tq.shape[1] != tk.shape[1]
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]
    try:
        with sdpa_kernel(chosen):
            call = lambda: sdpa(tq, tk, tv, enable_gqa=gqa)  # noqa: E731
            return common.median_ms(call, max_seconds)
    except (RuntimeError, torch.OutOfMemoryError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def graph_ms(fn, max_seconds):
    """The GPU's time per call without the host's: one call captured in a CUDA graph and replayed.
    A decoding step's Python path (validation, argument packing, 2-3 launches: ~60-80 us) is
    longer than the kernels' time on small caches; back-to-back calls then time the host. The
    capture reuses the memory pool's blocks of the call just made (no allocation inside it);
    replays rewrite the same output buffer, which nothing else uses meanwhile."""
    import cupy

    fn()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
        return common.median_ms(lambda: graph.launch(stream), max_seconds)


def parser() -> arguments.Parser:
    ap = arguments.Parser("python -m cupyflash bench --decode", __doc__)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"],
                    help="the cache's dtype")
    ap.add_argument("--head-dim", type=arguments.head_dim, default=128, help="head_dim")
    ap.add_argument("--max-seconds", type=arguments.positive_float, default=0.1,
                    help="timing budget per measurement, seconds")
    ap.add_argument("--out", type=pathlib.Path, default=common.RESULTS, help="the folder for the result files")
    return ap


def main(args) -> int:
    matplotlib, tqdm, device, date, stem = common.start_run("decode" if args.dtype == "bfloat16" else f"decode-{args.dtype}")
    import cupy

    import cupyflash
    from cupyflash.validation import BFLOAT16

    try:
        import torch
    except ImportError as e:
        torch = None
        print(f"# peer torch: not installed ({e})")
    dt = BFLOAT16 if args.dtype == "bfloat16" else numpy.dtype(args.dtype)
    d, item = args.head_dim, dt.itemsize
    grid = problems()
    print(f"# {device}; cupyflash {cupyflash.__version__}; {args.dtype}, head_dim {d}; {len(grid)} problems", flush=True)
    rows, failures, skipped = [], [], 0
    for pr in tqdm(grid, desc="decode", file=sys.stderr):
        # The cache, its float32 draw and the copy's two buffers are held at once at the peak.
        need = 3 * pr.bytes_read(d, item) + pr.bytes_read(d, 4) // 2
        if need > 0.9 * cupy.cuda.runtime.memGetInfo()[0]:
            print(f"# {pr.label()} cache {pr.cache_len} skipped: needs ~{need / 2**30:.0f} GiB of device memory")
            skipped += 1
            continue
        rs = cupy.random.default_rng(pr.cache_len + pr.batch)
        q = rs.standard_normal((pr.batch, pr.seqlen_q, pr.heads, d), dtype=numpy.float32).astype(dt)
        k, v = (rs.standard_normal((pr.batch, pr.cache_len, pr.heads_kv, d), dtype=numpy.float32).astype(dt)
                for _ in range(2))
        lengths = cupy.full(pr.batch, pr.cache_len, dtype=numpy.int32)
        nbytes = pr.bytes_read(d, item)
        copy_src = cupy.empty(nbytes, dtype=numpy.uint8)
        copy_dst = cupy.empty_like(copy_src)
        copy_ms = common.median_ms(lambda: copy_dst.data.copy_from_device_async(copy_src.data, nbytes),
                                   args.max_seconds)
        del copy_src, copy_dst
        copy_gbs = 2 * nbytes / copy_ms / 1e6
        step = lambda: cupyflash.attention_decode(q, k, v, lengths)  # noqa: E731
        ok, message = check(q, k, v, step(), args.dtype)
        if not ok:
            failures.append(f"{pr}: {message}")
        timings = {"cupyflash": common.median_ms(step, args.max_seconds),
                   "cupyflash-graph": graph_ms(step, args.max_seconds)}
        if torch is not None:
            for backend in TORCH_BACKENDS:
                timings[f"torch-{backend}"] = time_sdpa(torch, backend, q, k, v, args.max_seconds)
            torch.cuda.empty_cache()  # the math backend's scores would crowd the next, larger caches
        for method, ms in timings.items():
            timed = isinstance(ms, float)
            rows.append({
                "device": device, "date": date, "dtype": args.dtype, "head_dim": d, "batch": pr.batch,
                "seqlen_q": pr.seqlen_q, "cache_len": pr.cache_len, "heads": pr.heads, "heads_kv": pr.heads_kv,
                "method": method, "median_ms": f"{ms:.4f}" if timed else "",
                "gb_per_s": f"{nbytes / ms / 1e6:.0f}" if timed else "",
                "copy_gb_per_s": f"{copy_gbs:.0f}", "of_copy": f"{nbytes / ms / 1e6 / copy_gbs:.3f}" if timed else "",
                "note": "" if timed else ms,
                "check": ("PASS " if ok else "FAIL ") + message if method == "cupyflash" else "",
            })
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()
    return common.finish(rows, failures, len(grid) - skipped, args.out / stem, device, plot, print_table, matplotlib)


def print_table(rows, device):
    print(f"\n# {device}: decode bandwidth reading the KV cache (GB/s; share of the D2D copy's)")
    by_problem = {}
    for r in rows:
        by_problem.setdefault((r["batch"], r["seqlen_q"], r["heads"], r["heads_kv"], r["cache_len"]), {})[r["method"]] = r
    print("# per call: back-to-back calls (host path included); graph: the GPU's time (CUDA graph replay)")
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if not m.startswith("cupyflash")]
    print(f"{'problem':15} {'cache':>6} {'copy GB/s':>9} {'call ms':>8} {'of copy':>7} {'graph ms':>8} {'GB/s':>5} "
          f"{'of copy':>7}  " + " ".join(f"{m.replace('torch-', '') + ' ms':>12}" for m in methods))
    for (b, sq, h, hkv, n), per in by_problem.items():
        call, graph = per["cupyflash"], per["cupyflash-graph"]
        label = Problem(b, n, h, hkv, sq).label()
        peers = " ".join(f"{per[m]['median_ms'] or 'skip':>12}" for m in methods)
        print(f"{label:15} {n:>6} {call['copy_gb_per_s']:>9} {call['median_ms']:>8} {call['of_copy']:>7} "
              f"{graph['median_ms']:>8} {graph['gb_per_s']:>5} {graph['of_copy']:>7}  {peers}")
    for r in rows:
        if r["note"]:
            print(f"# {r['method']} skipped at b{r['batch']} cache {r['cache_len']}: {r['note']}")


def plot(rows, path, device, matplotlib):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series = {}
    for r in rows:
        if r["median_ms"] and r["seqlen_q"] == 1:
            key = (r["method"], r["batch"], r["heads_kv"])
            series.setdefault(key, []).append((r["cache_len"], float(r["gb_per_s"])))
    for (method, batch, heads_kv), points in series.items():
        if method not in ("cupyflash", "cupyflash-graph", "torch-flash", "torch-cudnn"):
            continue
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", linestyle="-" if method == "cupyflash" else "--",
                label=f"{method} b{batch} kv{heads_kv}")
    copies = sorted({(r["cache_len"], float(r["copy_gb_per_s"])) for r in rows if r["method"] == "cupyflash"})
    ax.axhline(0.8 * max(c for _, c in copies), color="grey", linestyle=":", label="80% of D2D copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache length (keys)")
    ax.set_ylabel("GB/s reading K and V")
    ax.set_title(f"KV-cache decoding, one query row ({device})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

