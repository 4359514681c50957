// The sm_80 warp-level instructions of the tensor-core kernels, as inline PTX (no CUDA headers):
// cp.async (global -> shared without registers), ldmatrix (shared -> mma fragments) and
// mma.sync: m16n8k16 with float32 accumulators, TF32's m16n8k8 and float64's DMMA.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane = 4·g + t:
//   A (16 x 16, row-major), 4 x .b32 = 8 halves:  a[0]: row g,   cols 2t, 2t+1
//                                                 a[1]: row g+8, cols 2t, 2t+1
//                                                 a[2]: row g,   cols 2t+8, 2t+9
//                                                 a[3]: row g+8, cols 2t+8, 2t+9
//   B (16 x 8, "col"), 2 x .b32:                  b[0]: rows 2t, 2t+1 of column g; b[1]: rows 2t+8, 2t+9
//   C (16 x 8, float32), 4 floats:                c[0], c[1]: row g, cols 2t, 2t+1; c[2], c[3]: row g+8
// Two C tiles side by side (16 x 16) hold exactly an A fragment's elements: a score tile becomes the
// A operand of the next product without leaving registers (FlashAttention-2's P kept in registers).
#pragma once
#include "common/numeric.cuh"

namespace cupyflash {

__device__ __forceinline__ unsigned smem_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; bytes past src_bytes (0..16) are zero-filled, so
// padding rows and columns cost no branch. Both addresses must be 16-byte aligned. A whole chunk
// takes the plain form: on an H100 (ncu) the zero-filling one moved 1.5x the L2 sectors and 1.8x
// the shared-memory wavefronts for the same whole tile rows. The L2::128B hint has L2 fetch whole
// 128-byte lines, which a tile row's neighbouring chunks then use.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
    asm volatile(
        "{\n .reg .pred whole;\n setp.eq.s32 whole, %2, 16;\n"
        " @whole cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n"
        " @!whole cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n}\n" ::"r"(dst),
        "l"(src), "r"(src_bytes)
        : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Shared memory is addressed by 32-bit shared-window byte addresses, the operand ldmatrix and
// cp.async take: a kernel converts its tile bases once, and the fixed offsets of fragments within
// a tile then fold into the instructions' immediate offsets instead of costing an address
// computation per load.
__device__ __forceinline__ void store_shared_16(unsigned dst, const void* x) {
    const uint4 v = *static_cast<const uint4*>(x);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ void store_shared_4(unsigned dst, unsigned x) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(dst), "r"(x) : "memory");
}
__device__ __forceinline__ void store_shared_8(unsigned dst, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(dst), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ unsigned load_shared_4(unsigned src) {
    unsigned x;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(x) : "r"(src) : "memory");
    return x;
}
__device__ __forceinline__ void store_shared_f64x2(unsigned dst, double x, double y) {
    asm volatile("st.shared.v2.f64 [%0], {%1, %2};\n" ::"r"(dst), "d"(x), "d"(y) : "memory");
}
__device__ __forceinline__ double load_shared_f64(unsigned src) {
    double x;
    asm volatile("ld.shared.f64 %0, [%1];\n" : "=d"(x) : "r"(src) : "memory");
    return x;
}
__device__ __forceinline__ void load_shared_f64x2(unsigned src, double& x, double& y) {
    asm volatile("ld.shared.v2.f64 {%0, %1}, [%2];\n" : "=d"(x), "=d"(y) : "r"(src) : "memory");
}
__device__ __forceinline__ uint4 load_shared_16(unsigned src) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(src)
                 : "memory");
    return v;
}

// Four 8x8 b16 matrices; lanes 8m..8m+7 give the row addresses of matrix m, and each thread gets
// (row g, cols 2t, 2t+1) of every matrix (with .trans: (rows 2t, 2t+1, col g)).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row_address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row_address));
}

// mma reads and writes registers only, so its asm is not volatile: the compiler may schedule it
// around the (volatile, shared-memory reading) ldmatrix of the next fragments.
template <typename Element> struct Mma;

template <> struct Mma<Float16> {
    // c += a b (16x8x16), float32 accumulation.
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Two floats rounded to one .b32 of halves; lo goes to the lower 16 bits (the lower column).
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float2 unpack(unsigned r) {
        float2 x;
        asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32.f16 %0, lo; cvt.f32.f16 %1, hi; }\n"
            : "=f"(x.x), "=f"(x.y)
            : "r"(r));
        return x;
    }
};

template <> struct Mma<BFloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    // bfloat16 is the top half of a float32: widening is exact.
    static __device__ __forceinline__ float2 unpack(unsigned r) {
        return make_float2(__uint_as_float(r << 16), __uint_as_float(r & 0xffff0000u));
    }
};

// float32 products on the tensor cores (the Tf32 element tags, common/numeric.cuh). Each operand x
// is split into a TF32 part hi = rna(x) and the TF32 rounding of its remainder lo = rna(x - hi).
// kPasses 3 ("3xTF32", float32 accuracy) forms a·b as hi·hi + hi·lo + lo·hi (lo·lo, about 2^-22 of
// the product, is left out); kPasses 1 as hi·hi alone (TF32's 2^-11 relative rounding). Each
// product is an mma.sync.m16n8k8 accumulating in float32. Fragment layouts (PTX ISA, "Matrix
// fragments for mma.m16n8k8" .tf32):
//   A (16 x 8), 4 x .b32: a[0]: row g, col t; a[1]: row g+8, col t; a[2]: row g, col t+4; a[3]: row g+8, col t+4
//   B (8 x 8, "col"), 2 x .b32: b[0]: row t, column g; b[1]: row t+4, column g
//   C (16 x 8, float32): as m16n8k16's
// An ldmatrix.x4 of float32 rows read as b16 pairs gives lane (g, t) the float (row g, col t) of
// each 8 x 4 block: the A and B fragments above, at the 16-bit kernels' lane addresses.
template <int kPasses> struct Mma<Tf32<kPasses>> {
    static_assert(kPasses == 1 || kPasses == 3, "TF32 products take one pass or three");
    static __device__ __forceinline__ void split(unsigned x, unsigned& hi, unsigned& lo) {
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(__uint_as_float(x)));
        if constexpr (kPasses == 3)
            asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(__uint_as_float(x) - __uint_as_float(hi)));
        else
            lo = 0;
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // c += a·b from split operands, the small products first.
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a_hi)[4], const unsigned (&a_lo)[4],
                                               const unsigned (&b_hi)[2], const unsigned (&b_lo)[2]) {
        if constexpr (kPasses == 3) {
            mma(c, a_lo, b_hi[0], b_hi[1]);
            mma(c, a_hi, b_lo[0], b_lo[1]);
        }
        mma(c, a_hi, b_hi[0], b_hi[1]);
    }
};

// float64 products on the FP64 tensor cores (DMMA), a k16 step of a 16 x 8 tile at a time, accumulating in
// float64 with IEEE round-to-nearest (the same rounding as a DFMA chain). Fragment layouts (PTX ISA,
// "Matrix fragments for mma.m16n8k16" .f64), lane = 4g + t:
//   A (16 x 16), 8 doubles: a[i]: row g + 8·(i % 2), col t + 4·(i / 2)
//   B (16 x 8, "col"), 4 doubles: b[i]: row t + 4i, column g
//   C (16 x 8), 4 doubles: as m16n8k16's float32 C (c[0], c[1]: row g, cols 2t, 2t+1; c[2], c[3]: row g+8)
// The k index of slot (t, i) only has to be the same in A and B, so the kernels give it whatever
// element order their shared-memory reads make contiguous (sm80/gemm.cuh). sm_90 has this shape as
// one instruction; sm_80 has only m8n8k4 (A: row g, col t; B: row t, column g; C: row g, cols 2t,
// 2t+1), of which the step is eight: two row halves by four k4 slices (CUPYFLASH_DMMA_M8N8K4
// compiles that form on any GPU, for the tests).
template <> struct Mma<double> {
    static __device__ __forceinline__ void run(double (&c)[4], const double (&a)[8], const double (&b)[4]) {
#if __CUDA_ARCH__ >= 900 && !defined(CUPYFLASH_DMMA_M8N8K4)
        asm("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7, %8, %9, %10, %11}, "
            "{%12, %13, %14, %15}, {%0, %1, %2, %3};\n"
            : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
            : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]),
              "d"(b[1]), "d"(b[2]), "d"(b[3]));
#else
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};\n"
                    : "+d"(c[2 * h]), "+d"(c[2 * h + 1])
                    : "d"(a[2 * i + h]), "d"(b[i]));
#endif
    }
};

}  // namespace cupyflash
