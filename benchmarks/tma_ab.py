"""A/B of the Hopper forward's TMA builds against their cp.async twins (the kernel alone, same
inputs, one process, the order rotating each round). Prints ms, TFLOP/s, A's time over each
other's and whether the outputs equal A's bit for bit. A: the cp.async build, B: the TMA build, C:
the TMA build at one more block per SM (d64). usage: python benchmarks/tma_ab.py [ROUNDS] [PROBLEM,...]"""
import dataclasses
import sys

import cupy
import cupy.cuda.function
import numpy
from cupyx.profiler import benchmark

sys.path.insert(0, "benchmarks")
from bench_sparse import make_mask  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _attention, _compile, _instantiations, _validation  # noqa: E402
from cupyflash._validation import BFLOAT16  # noqa: E402

PROBLEMS = [(64, 4096, "dense", 1), (64, 16384, "dense", 1), (64, 4096, "random", 0.25), (64, 16384, "random", 0.1),
            (64, 4096, "local", 0.25), (128, 4096, "dense", 1), (128, 16384, "dense", 1), (128, 4096, "random", 0.25),
            (128, 16384, "random", 0.1), (64, 4096, "random", 0.05), (64, 4096, "local", 0.05)]


def main(argv):
    rounds = int(argv[0]) if argv else 6
    picked = [PROBLEMS[int(i)] for i in argv[1].split(",")] if len(argv) > 1 else PROBLEMS
    captured = {}

    def capture(kernel, device_id, grid, params, *more):
        captured["args"] = (kernel, grid, [x.copy() for x in (params, *more)])

    real = _attention._launch
    _attention._launch = capture
    rng = numpy.random.default_rng(0)
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; forward kernel alone, bf16, "
          f"A = cp.async build, B = TMA build, C = TMA at one more block per SM; median of {rounds} rounds "
          "(each a median of 30)")
    for d, s, pattern, density in picked:
        heads, batch = 2048 // d, 16384 // s
        q, k, v = (cupy.random.standard_normal((batch, s, heads, d), dtype=numpy.float32).astype(BFLOAT16)
                   for _ in range(3))
        p = _validation.check_attention_args(q, k, v, causal=False, scale=None, return_lse=True)
        if pattern != "dense":
            p = _validation.check_block_mask(make_mask(pattern, density, s, heads, rng), p)
        out = cupy.full_like(q, numpy.nan)
        lse = cupy.full((batch, heads, s), numpy.nan, numpy.float32)
        launches, outs = {}, {}
        variants = {"A": _attention.forward_kernel(p, 0, True, True, False),
                    "B": _attention.forward_kernel(p, 0, True, True, True, ws=False)}
        if d == 64:
            tile = dataclasses.replace(variants["B"].tile, min_blocks_per_sm=variants["B"].tile.min_blocks_per_sm + 1)
            variants["C"] = dataclasses.replace(variants["B"], tile_override=tile)
        for name, kernel in variants.items():
            tma = name != "A"
            _attention.launch_forward(q, k, v, out, lse, p, kernel=kernel)
            kernel, grid, images = captured["args"]
            assert kernel.tma == tma, kernel
            fn = _compile.get_function(kernel, 0)
            ptrs = tuple(cupy.cuda.function.CPointer(x.ctypes.data) for x in images)
            launches[name] = lambda fn=fn, kernel=kernel, grid=grid, ptrs=ptrs, images=images: fn(
                grid, (kernel.num_threads,), ptrs, shared_mem=kernel.smem_bytes)
            out.fill(numpy.nan)
            launches[name]()
            outs[name] = (out.copy(), lse.copy())
        names = list(variants)
        times = {name: [] for name in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order if r % 2 == 0 else order[::-1]:
                t = benchmark(launches[name], (), n_repeat=30, n_warmup=3).gpu_times[0]
                times[name].append(float(numpy.median(t)) * 1e3)
        flops = 4 * batch * heads * s * s * d * density
        label = "dense" if pattern == "dense" else f"{pattern} {density}"
        ta = float(numpy.median(times["A"]))
        line = f"d{d} s{s} {label:>12}: A {ta:8.4f} ms {flops / ta / 1e9:6.1f} TFLOP/s"
        for name in names[1:]:
            same = all(bool((a.view(numpy.uint16 if a.dtype.itemsize == 2 else numpy.uint32)
                             == b.view(numpy.uint16 if b.dtype.itemsize == 2 else numpy.uint32)).all())
                       for a, b in zip(outs["A"], outs[name]))
            t = float(numpy.median(times[name]))
            line += f" | {name} {t:8.4f} ms {flops / t / 1e9:6.1f} TFLOP/s A/{name} {ta / t:.3f} bit-equal {same}"
        print(line, flush=True)
        if pattern != "dense":  # the whole call, host included (CPU and GPU time per call)
            _attention._launch = real
            for tma in (False, True):
                _instantiations.TMA_FORWARD_BY_DEFAULT = tma
                r = benchmark(lambda: cupyflash.block_sparse_attention(q, k, v, p.block_mask), (), n_repeat=50,
                              n_warmup=5)
                print(f"    whole call, tma={tma}: cpu {numpy.median(r.cpu_times) * 1e3:.4f} ms, "
                      f"gpu {numpy.median(r.gpu_times[0]) * 1e3:.4f} ms", flush=True)
            _instantiations.TMA_FORWARD_BY_DEFAULT = True
            _attention._launch = capture
    _attention._launch = real


if __name__ == "__main__":
    main(sys.argv[1:])
