"""Where one small decoding step's time goes, block by block: a copy of the tensor-core decode
kernel with %globaltimer read by each block's thread 0 at the phases of its work (start, Q loaded,
each K/V tile landed, merge, counted done, split combine), for one call on an L2-warm cache (as
the bench's replayed steps are), and the step's graph-replayed GPU time, for the kernel as it is
and for the VARIANTS below (source patches, split counts). Experiment for benchmarks/NOTES.md; the library's kernels carry
no trace points (they are patched into the source text here, and a missing marker is an error).

    python benchmarks/decode_trace.py [cache_len ...]
"""
import sys

import cupy
import numpy

import cupyflash
from cupyflash import _compile

SLOTS = 16
PHASES = {0: "start", 1: "Q in shared memory", 2: "tile 1 landed", 3: "tile 2 landed", 4: "tile 3 landed",
          5: "tile 4 landed", 6: "last tile landed (5th on)", 7: "key loop done", 8: "split stored",
          9: "counted done", 11: "counter reset (last block)", 12: "split weights (last block)",
          10: "combine done (last block)"}

PRELUDE = r"""
__device__ unsigned long long cupyflash_trace[1 << 16];
__device__ __forceinline__ unsigned long long cupyflash_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define CF_TRACE(slot) do { if (threadIdx.x == 0) { const unsigned b_ = blockIdx.y * gridDim.x + blockIdx.x; \
    if (b_ < (1u << 16) / 16) cupyflash_trace[b_ * 16 + (slot)] = cupyflash_now(); } } while (0)
#define CF_SMID() do { if (threadIdx.x == 0) { unsigned s_; asm volatile("mov.u32 %0, %%smid;" : "=r"(s_)); \
    const unsigned b_ = blockIdx.y * gridDim.x + blockIdx.x; if (b_ < (1u << 16) / 16) cupyflash_trace[b_ * 16 + 15] = s_; } } while (0)
"""

# (marker, what replaces it, how often it occurs)
PATCHES = [
    ("const Fragment f(lane);\n    const int seqlen_k", "const Fragment f(lane);\n    CF_TRACE(0); CF_SMID();\n    const int seqlen_k", 1),
    ("__syncthreads();  // Q is in shared memory\n    const unsigned a0",
     "__syncthreads();  // Q is in shared memory\n    CF_TRACE(1);\n    const unsigned a0", 1),
    ("whose stage is reloaded now\n", "whose stage is reloaded now\n        CF_TRACE(2 + min(t - tiles.x, 4));\n", 1),
    ("// the merge below reuses the tiles' shared memory\n", "// the merge below reuses the tiles' shared memory\n    CF_TRACE(7);\n", 1),
    ("    if (params.num_splits > 1) decode_combine_splits",
     "    CF_TRACE(8);\n    if (params.num_splits > 1) decode_combine_splits", 2),
    ("s_done = count_acq_rel(counter);\n    __syncthreads();  // the other splits' results are read after their counts were seen\n",
     "s_done = count_acq_rel(counter);\n    __syncthreads();\n    CF_TRACE(9);\n", 1),
    ("if (threadIdx.x == 0) *counter = 0u;\n", "if (threadIdx.x == 0) *counter = 0u;\n    CF_TRACE(11);\n", 1),
    ("__syncwarp();  // the weights are in shared memory\n",
     "__syncwarp();  // the weights are in shared memory\n                    CF_TRACE(12);\n", 1),
    ("// the next row's weights overwrite these\n    }\n",
     "// the next row's weights overwrite these\n    }\n    __syncthreads();\n    CF_TRACE(10);\n", 1),
]


def patched(source: str) -> str:
    source = PRELUDE + source
    for marker, replacement, count in PATCHES:
        if source.count(marker) != count:
            raise RuntimeError(f"trace marker found {source.count(marker)} times, expected {count}: {marker!r}")
        source = source.replace(marker, replacement)
    return source


# Variants tried beside the kernel as it is: (name, extra source patches, attention_decode options).
FENCES = [  # session 12's count: a fence.sc before it, and one after it in the block that merges
    ("    __syncthreads();  // every thread's o_partial and lse_partial are written; the merge is done with shared memory\n"
     "    if (threadIdx.x == 0) s_done = count_acq_rel(counter);\n",
     "    __threadfence();\n    __syncthreads();\n    if (threadIdx.x == 0) s_done = atomicAdd(counter, 1u);\n", 1),
    ("    if (threadIdx.x == 0) *counter = 0u;\n", "    __threadfence();\n    if (threadIdx.x == 0) *counter = 0u;\n", 1),
]
VARIANTS = [
    ("as is", [], {}),
    ("32 splits", [], {"num_splits": 32}),
    ("the count between two fence.sc", FENCES, {}),
]


def main():
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import bench
    from bench_decode import graph_ms
    from decode_breakdown import gqa_step

    lens = [int(a) for a in sys.argv[1:]] or [8192, 32768]
    real = _compile.get_function
    current = {"patches": [], "modules": {}}

    def get_function(kernel, device_id):
        if "flash_decode_tc_kernel" not in kernel.name_expression:
            return real(kernel, device_id)
        key = (kernel, tuple(current["patches"]))
        if key not in current["modules"]:
            source = patched(_compile._source_for([kernel]))
            for marker, replacement, count in current["patches"]:
                if source.count(marker) != count:
                    raise RuntimeError(f"variant marker found {source.count(marker)} times: {marker!r}")
                source = source.replace(marker, replacement)
            module = cupy.RawModule(code=source, options=_compile.COMPILE_OPTIONS, name_expressions=[kernel.name_expression])
            function = module.get_function(kernel.name_expression)
            function.max_dynamic_shared_size_bytes = kernel.smem_bytes
            current["modules"][key] = (module, function)
        current["module"] = current["modules"][key][0]
        return current["modules"][key][1]

    summary = []
    for n in lens:
        q, k, v, lengths = gqa_step(n)
        nbytes = 2 * k.nbytes
        src, dst = cupy.empty(nbytes, numpy.uint8), cupy.empty(nbytes, numpy.uint8)
        copy_ms = bench._median_ms(lambda: dst.data.copy_from_device_async(src.data, nbytes), 0.3)
        del src, dst
        copy_gbs = 2 * nbytes / copy_ms / 1e6
        untraced = graph_ms(lambda: cupyflash.attention_decode(q, k, v, lengths), bench, 0.3)
        print(f"# cache {n}: {nbytes / 2**20:.0f} MiB; copy {copy_gbs:.0f} GB/s, the 80% target "
              f"{nbytes / (0.8 * copy_gbs) / 1e3:.2f} us; the untraced step {untraced * 1e3:.2f} us (graph replay)")
        summary.append((n, "untraced", untraced * 1e3, nbytes / untraced / 1e6 / copy_gbs))
        reference = cupyflash.attention_decode(q, k, v, lengths).astype(numpy.float32)
        _compile.get_function = get_function
        try:
            for name, patches, options in VARIANTS:
                current["patches"] = patches
                step = lambda: cupyflash.attention_decode(q, k, v, lengths, **options)  # noqa: E731
                for _ in range(30):  # compiled, clocks up, the cache warm in L2
                    out = step()
                error = float(cupy.abs(out.astype(numpy.float32) - reference).max())
                trace = cupy.ndarray((1 << 16,), numpy.uint64, current["module"].get_global("cupyflash_trace"))
                trace.fill(0)
                step()
                cupy.cuda.get_current_stream().synchronize()
                t = trace.get().reshape(-1, SLOTS)
                replay = graph_ms(step, bench, 0.3)
                summary.append((n, name, replay * 1e3, nbytes / replay / 1e6 / copy_gbs))
                report(n, name, t, replay, error)
        finally:
            _compile.get_function = real
    print(f"\n{'cache':>6} {'variant':38} {'us':>11} {'of copy':>8}")
    for n, name, us, share in summary:
        print(f"{n:6} {name:38} {us:11.2f} {share:8.3f}")


def report(n, name, t, replay, error):
    t = t[t[:, 0] != 0]
    us = (t[:, :15].astype(numpy.int64) - int(t[:, 0].min())) / 1e3
    sm = t[:, 15]
    per_sm = numpy.bincount(numpy.bincount(sm.astype(numpy.int64)))
    print(f"## {n} keys, {name}: {len(t)} blocks (SMs holding 0, 1, 2, ... of them: {per_sm.tolist()}); "
          f"graph replay {replay * 1e3:.2f} us; max |difference| from the library's call {error:.1e}")
    print(f"  {'phase':28} {'min':>7} {'median':>7} {'max':>7}  (us after the first block started)")
    for slot, phase in PHASES.items():
        col = us[:, slot][t[:, slot] != 0]
        if col.size:
            print(f"  {phase:28} {col.min():7.2f} {numpy.median(col):7.2f} {col.max():7.2f}   ({col.size} blocks)")
    for b in numpy.nonzero(t[:, 10])[0][:2]:
        print("  a merging block:", " ".join(f"{slot}={us[b, slot]:.2f}" for slot in PHASES if t[b, slot]))


if __name__ == "__main__":
    main()
