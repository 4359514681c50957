"""The Hopper kernels' three kinds of product alone, on an sm_90 GPU (a development tool).

    python benchmarks/wgmma_probe.py [--head-dim 128] [--block-n 128] [--dtype bfloat16]
    python benchmarks/wgmma_probe.py --compile-only      (no GPU: NVRTC for sm_90a only)

One warpgroup loads Q (64 x d), K and V (block_n x d) into the swizzled panels with the kernels' own
loader (load_tile_async with WgmmaFwdTraits' layout), then computes (flash_wgmma.cuh) S = Q K^T
with wgmma_abt and O = P V with wgmma_ab_rs, P being S rounded to the input type; then it stores P
to a swizzled [64][block_n] tile (store_a_fragments_swizzled, as the backward stores dS^T) and
computes C = P^T Q with wgmma_atb, both operands read MN-major (as the backward's dQ = dS K), one
64 x 64 share per (key panel, head-dim panel). It writes S, O and C out in the warps' fragment
layout. Each is compared with NumPy in float64 on the same rounded values; the
printout says which rows and columns are wrong, which is what tells a swizzle or descriptor slip
(whole 8-row groups, 64-column panels, 16-byte chunks) from a fragment-order one. Any exception
stops the run.
"""

import argparse
import sys

import numpy

PROBE = r"""
#include "flash_fwd_tc.cu"

namespace cupyflash {
// Grid 1, block 128 (one warpgroup). q [64][d], k, v [kBlockN][d] contiguous; s [64][kBlockN],
// o [64][d] and c [kBlockN][d] float32.
template <typename Kt>
__global__ void wgmma_probe_kernel(const typename Kt::Storage* q, const typename Kt::Storage* k,
                                   const typename Kt::Storage* v, float* s, float* o, float* c) {
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned tiles = Kt::tile_base(smem_address(smem));
    const unsigned sQ = tiles + Kt::kSmemQOffset * 2, sK = tiles + Kt::kSmemKOffset * 2, sV = tiles + Kt::kSmemVOffset * 2;
    load_tile_async<Kt, Kt::kBlockM>(sQ, q, Kt::kHeadDim, Kt::kBlockM, Kt::kHeadDim);
    load_tile_async<Kt, Kt::kBlockN>(sK, k, Kt::kHeadDim, Kt::kBlockN, Kt::kHeadDim);
    load_tile_async<Kt, Kt::kBlockN>(sV, v, Kt::kHeadDim, Kt::kBlockN, Kt::kHeadDim);
    cp_async_commit();
    tiles_landed<Kt>();
    const int warp = threadIdx.x / 32;
    const Fragment f(threadIdx.x % 32);
    float S[1][Kt::kNTiles][4];
    wgmma_abt<Kt, Kt::kBlockN, Kt::kBlockM>(S[0], sQ, sK);
    for (int nt = 0; nt < Kt::kNTiles; ++nt)
        for (int i = 0; i < 4; ++i)
            s[(16 * warp + f.row(0, i / 2)) * Kt::kBlockN + f.col(nt, i % 2)] = S[0][nt][i];
    unsigned P[1][Kt::kNTiles / 2][4];
    to_a_fragments<typename Kt::Op>(S, P);
    float O[1][Kt::kHeadDim / 8][4];
    zero(O);
    wgmma_ab_rs<Kt, Kt::kBlockN>(O[0], P[0], sV);
    for (int dt = 0; dt < Kt::kHeadDim / 8; ++dt)
        for (int i = 0; i < 4; ++i)
            o[(16 * warp + f.row(0, i / 2)) * Kt::kHeadDim + f.col(dt, i % 2)] = O[0][dt][i];
    const unsigned sP = tiles + (Kt::kSmemVOffset + Kt::kBlockN * Kt::kHeadDim) * 2;  // [64][kBlockN]
    store_a_fragments_swizzled<Kt, 64>(sP, P[0], 16 * warp, f);
    __syncthreads();
    for (int key_panel = 0; key_panel < Kt::kBlockN / 64; ++key_panel)
        for (int col_panel = 0; col_panel < Kt::kPanels; ++col_panel) {
            float C[1][8][4];
            wgmma_atb<Kt, 64>(C[0], sP + key_panel * Kt::row_bytes(64), sQ + col_panel * Kt::row_bytes(64));
            for (int dt = 0; dt < 8; ++dt)
                for (int i = 0; i < 4; ++i)
                    c[(64 * key_panel + 16 * warp + f.row(0, i / 2)) * Kt::kHeadDim + 64 * col_panel + f.col(dt, i % 2)] =
                        C[0][dt][i];
        }
}
}  // namespace cupyflash
"""


def kernel_text(dtype, head_dim, block_n):
    from cupyflash import _compile, _instantiations as inst

    element = inst.ELEMENT_TYPES[dtype]
    traits = f"cupyflash::WgmmaFwdTraits<{element}, {head_dim}, 64, {block_n}, 4, 1>"
    code = PROBE.replace('#include "flash_fwd_tc.cu"', _compile.kernel_source("flash_fwd_tc.cu"))
    smem = (64 + 2 * block_n) * head_dim * 2 + 64 * block_n * 2 + 1024
    return code, f"cupyflash::wgmma_probe_kernel<{traits}>", smem


def describe(name, got, want, tol):
    bad = numpy.abs(got - want) > tol
    err = float(numpy.abs(got - want).max())
    if not bad.any():
        print(f"{name}: OK (max error {err:.2e}, bound {tol:.2e})")
        return True
    rows, cols = numpy.nonzero(bad)
    print(f"{name}: {bad.sum()} of {bad.size} wrong (max error {err:.2e}, bound {tol:.2e})")
    print(f"  wrong rows (mod 8): {sorted(set((rows % 8).tolist()))}, row groups of 8: {sorted(set((rows // 8).tolist()))}")
    print(f"  wrong columns: 16-byte chunks {sorted(set((cols // 8 % 8).tolist()))}, panels {sorted(set((cols // 64).tolist()))}")
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    ap.add_argument("--block-n", type=int, default=128, choices=[64, 128])
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args(argv)
    code, name, smem = kernel_text(args.dtype, args.head_dim, args.block_n)
    if args.compile_only:
        from cupy_backends.cuda.libs import nvrtc

        prog = nvrtc.createProgram(code, "wgmma_probe.cu", [], [])
        nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", "--gpu-architecture=sm_90a"])
        except nvrtc.NVRTCError:
            print(nvrtc.getProgramLog(prog))
            raise
        print(f"compiled {name}")
        return 0

    import cupy

    from cupyflash._validation import BFLOAT16

    dt = BFLOAT16 if args.dtype == "bfloat16" else numpy.dtype(args.dtype)
    rng = numpy.random.default_rng(0)
    d, n = args.head_dim, args.block_n
    q, k, v = (rng.standard_normal(shape).astype(dt) for shape in ((64, d), (n, d), (n, d)))
    module = cupy.RawModule(code=code, options=("-std=c++17", "--gpu-architecture=sm_90a"), name_expressions=[name])
    kernel = module.get_function(name)
    kernel.max_dynamic_shared_size_bytes = smem
    s = cupy.full((64, n), numpy.nan, dtype=numpy.float32)
    o = cupy.full((64, d), numpy.nan, dtype=numpy.float32)
    c = cupy.full((n, d), numpy.nan, dtype=numpy.float32)
    kernel((1,), (128,), (cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), s, o, c), shared_mem=smem)
    s, o, c = (cupy.asnumpy(x).astype(numpy.float64) for x in (s, o, c))
    q64, k64, v64 = (x.astype(numpy.float64) for x in (q, k, v))
    s_ref = q64 @ k64.T
    # P as the kernel rounds it: the kernel's own S, rounded to the input type.
    p = s.astype(numpy.float32).astype(dt).astype(numpy.float64)
    o_ref = p @ v64
    eps = 2.0**-24 * 4
    ok = describe("S = Q K^T", s, s_ref, eps * (numpy.abs(q64) @ numpy.abs(k64).T).max() * d)
    ok &= describe("O = P V", o, o_ref, eps * (numpy.abs(p) @ numpy.abs(v64)).max() * n)
    ok &= describe("C = P^T Q", c, p.T @ q64, eps * (numpy.abs(p).T @ numpy.abs(q64)).max() * 64)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
