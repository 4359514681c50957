// Hopper's warpgroup-level instructions (sm_90a), as inline PTX: wgmma.mma_async with float32
// accumulators, its fences and the shared-memory matrix descriptors it reads operands through; the
// tensor memory accelerator (TMA: bulk tensor copies, reductions and stores), mbarriers, named
// barriers and setmaxnreg.
//
// A warpgroup is 4 consecutive warps (the first a multiple of 4) that issue one wgmma together: an
// m64nNk16 product of a 64 x 16 A and a 16 x N B, A from shared memory or registers, B from shared
// memory. Warp w of the group holds rows 16w..16w+15 of the 64 x N accumulator, in exactly
// mma.sync's C layout per n8 tile (arch/sm80.cuh): the n8 tile j of a warp is d[j][0..3]. A in
// registers is mma.sync's A fragment likewise. So a warp's share of a wgmma product is a
// kMTiles = 1 warp tile, and the tensor-core kernels' softmax, masks and stores (tc/fragments.cuh)
// serve it unchanged. Operands in shared memory are 128-byte-swizzled panels (sm90/traits.cuh).
//
// wgmma is asynchronous: it reads its operands and writes its accumulators after it was issued, until
// wgmma.wait_group says it is done. The compiler knows none of that, so the accumulators pass
// through fence_operands (an empty asm that "writes" them) after the wait: no read of them can be
// scheduled before it.
#pragma once
#include "common/numeric.cuh"

namespace cupyflash {

// The matrix descriptor (PTX ISA, "Matrix Descriptor Format") of a 128-byte-swizzled operand at
// shared byte address `address`: bits 0-13 the address / 16, 16-29 the leading-dimension byte
// offset / 16, 32-45 the stride-dimension byte offset / 16, 62-63 the swizzle mode (1: 128 bytes).
// The base offset (bits 49-51) stays 0: panels start at 1024-byte boundaries. Moving the operand
// within a tile adds (bytes / 16) to the low bits (descriptor_at), which cannot carry out of
// them: shared addresses are below 2^18.
//   K-major (rows of A, or of B^T, with k contiguous; S = Q K^T's Q_i and K_j): the stride offset
//     is between 8-row groups (kSwizzleAtomBytes); the leading one is unused with swizzling (1).
//   MN-major (B with n contiguous, read transposed: O += P V's V_j): the stride offset is between
//     8-row groups along k, the leading one between 64-column panels along n.
__device__ __forceinline__ unsigned long long smem_descriptor(unsigned address, unsigned leading_bytes,
                                                              unsigned stride_bytes) {
    return static_cast<unsigned long long>((address & 0x3FFFF) >> 4) |
           static_cast<unsigned long long>((leading_bytes & 0x3FFFF) >> 4) << 16 |
           static_cast<unsigned long long>((stride_bytes & 0x3FFFF) >> 4) << 32 | 1ull << 62;
}
__device__ __forceinline__ unsigned long long descriptor_at(unsigned long long descriptor, unsigned byte_offset) {
    return descriptor + (byte_offset >> 4);
}

// Shared memory written by threads (cp.async, st.shared) is read by wgmma through the async proxy:
// each writing thread fences its writes into that proxy before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Before a batch of wgmma: orders the warpgroup's earlier register writes (accumulators, A
// fragments) before the tensor cores read them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending of the warpgroup's committed batches are still running.
template <int kPending> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Registers a wgmma reads (A fragments, accumulators) must be written before its wgmma_fence, and
// those it writes read after its wait: an empty asm that "rewrites" them pins them in between.
template <int kTiles>
__device__ __forceinline__ void fence_operands(float (&d)[kTiles][4]) {
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
}
template <int kTiles>
__device__ __forceinline__ void fence_operands(unsigned (&a)[kTiles][4]) {
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[j][i])::"memory");
}

// The tensor memory accelerator (TMA): one thread asks for a whole tile, which the copy engine
// writes to shared memory in the 128-byte swizzle wgmma reads, rows past the tensor's end as zeros.
// It is described by a tensor map (CUtensorMap, 128 opaque bytes made on the host by
// cuTensorMapEncodeTiled) that must stay in parameter, constant or global memory: a kernel
// parameter marked __grid_constant__. The copy's bytes are counted against an mbarrier in shared
// memory: the issuing thread arrives on it announcing how many bytes will land (expect_tx), and the
// phase completes when they all have; threads wait on the phase's parity, which flips with each
// completion.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ void mbarrier_init(unsigned barrier, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals) : "memory");
}
// Makes initialised mbarriers visible to the async proxy (the copy engine) before a barrier
// publishes them to the block.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// The calling thread's arrival on `barrier`, announcing `bytes` more bytes to land in this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned barrier, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbarrier_try_wait(unsigned barrier, unsigned parity) {
    unsigned done;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(barrier), "r"(parity)
                 : "memory");
    return done != 0;
}
// The calling thread's arrival on `barrier`, announcing no bytes: a consumer handing a buffer back.
__device__ __forceinline__ void mbarrier_arrive(unsigned barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}
// Waits until the phase of `barrier` with this parity has completed; its copies are then visible
// to the calling thread.
__device__ __forceinline__ void mbarrier_wait(unsigned barrier, unsigned parity) {
    while (!mbarrier_try_wait(barrier, parity)) {
    }
}
// Copies the box of `map` at element coordinates (c0 innermost .. c3) to shared address `dst`
// (1024-byte aligned for the 128-byte swizzle), counted against `barrier`.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TensorMap& map, unsigned barrier, int c0, int c1,
                                            int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(barrier)
        : "memory");
}

// The other direction: the TMA adds a [rows][columns] box in shared memory (in the map's swizzle)
// into the tensor at element coordinates (c0 innermost .. c3), element by element in L2, clipping
// what falls past the tensor's bounds. Its completion is tracked per issuing thread in bulk
// groups: commit closes one, and wait_group_read<N> returns once all but the N newest have read
// their shared memory (which may then be rewritten). The adds themselves complete by the end of
// the launch, as a TMA store's writes do, or earlier once bulk_wait_group (below) has seen them.
// The threads' shared-memory writes reach the TMA (async proxy) through fence_proxy_async and a
// barrier before the issue.
__device__ __forceinline__ void tma_reduce_add_4d(const TensorMap& map, unsigned src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::
                     "l"(reinterpret_cast<unsigned long long>(&map)),
                 "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
                 : "memory");
}
// The same, storing: the box overwrites the tensor's elements there (those past its bounds are
// clipped), in the same bulk groups.
__device__ __forceinline__ void tma_store_4d(const TensorMap& map, unsigned src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::
                     "l"(reinterpret_cast<unsigned long long>(&map)),
                 "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int kPending> __device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// ... and wait_group<N> once all but the N newest have completed: their writes (or adds) are done.
// Made visible to other SMs' plain loads by fence_proxy_async_global and a release after it.
template <int kPending> __device__ __forceinline__ void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads') among `threads` threads, whole warps: a warpgroup's own.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The calling warp's arrival at barrier `id` without waiting: its earlier memory accesses are
// ordered before those of the threads that wait there (named_barrier_sync) after the barrier.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A warpgroup's registers per thread set to kRegs (a multiple of 8, 24..256; every thread of the
// warpgroup executes it): a warp-specialised kernel moves registers from the warpgroup that only
// issues copies to those that compute.
template <int kRegs> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// f(Index<i>()) for i = kBegin..kEnd-1: a loop whose index is a template argument.
template <int kI> struct Index {
    static constexpr int value = kI;
};
template <int kBegin, int kEnd, typename F>
__device__ __forceinline__ void static_for(F&& f) {
    if constexpr (kBegin < kEnd) {
        f(Index<kBegin>());
        static_for<kBegin + 1, kEnd>(f);
    }
}

// The accumulator operands of an m64nN wgmma: n8 tiles kFirst + j .. kFirst + j + 7 (32 registers) of d.
#define CUPYFLASH_ACC4(j) "+f"(d[kFirst + (j)][0]), "+f"(d[kFirst + (j)][1]), "+f"(d[kFirst + (j)][2]), "+f"(d[kFirst + (j)][3])
#define CUPYFLASH_ACC32(j)                                                                                  \
    CUPYFLASH_ACC4(j), CUPYFLASH_ACC4(j + 1), CUPYFLASH_ACC4(j + 2), CUPYFLASH_ACC4(j + 3), CUPYFLASH_ACC4(j + 4), \
        CUPYFLASH_ACC4(j + 5), CUPYFLASH_ACC4(j + 6), CUPYFLASH_ACC4(j + 7)
#define CUPYFLASH_REGS_0_31                                                                                    \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31"
#define CUPYFLASH_REGS_32_63                                                                                    \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, " \
    "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// Wgmma<Element>::ss<N, kFirst>: D (+)= A B for a 64 x 16 A and a 16 x N B, both K-major in shared
// memory (A [m][k], B as [n][k]: S = Q K^T), D the n8 tiles kFirst.. of d; kTransposeA/B: that
// operand MN-major instead (A as [k][m], B as [k][n]: dQ = dS K from dS^T and K). rs<N, kFirst>: A from
// registers (a, mma.sync's A fragment of the warp's 16 rows), B MN-major in shared memory ([k][n],
// n contiguous: O += P V). accumulate = 0 overwrites D (a product's first k-step), 1 adds to it.
#define CUPYFLASH_WGMMA(ELEMENT, TYPE)                                                                           \
    template <> struct Wgmma<ELEMENT> {                                                                        \
        template <int N, int kFirst = 0, bool kTransposeA = false, bool kTransposeB = false, int kTiles>       \
        static __device__ __forceinline__ void ss(float (&d)[kTiles][4], unsigned long long a_desc,           \
                                                  unsigned long long b_desc, int accumulate) {                 \
            static_assert(N == 64 || N == 128, "wgmma widths instantiated: 64, 128");                          \
            static_assert(kFirst + N / 8 <= kTiles, "the product's n8 tiles lie inside d");                      \
            if constexpr (N == 64) {                                                                           \
                asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"                                    \
                             " wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                      \
                             " {" CUPYFLASH_REGS_0_31 "}, %32, %33, p, 1, 1, %35, %36;\n}\n"                   \
                             : CUPYFLASH_ACC32(0)                                                              \
                             : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(int(kTransposeA)),              \
                               "n"(int(kTransposeB)));                                                         \
            } else {                                                                                           \
                asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"                                    \
                             " wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE                     \
                             " {" CUPYFLASH_REGS_0_31 ", " CUPYFLASH_REGS_32_63 "}, %64, %65, p, 1, 1, %67, %68;\n}\n" \
                             : CUPYFLASH_ACC32(0), CUPYFLASH_ACC32(8)                                          \
                             : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(int(kTransposeA)),              \
                               "n"(int(kTransposeB)));                                                         \
            }                                                                                                  \
        }                                                                                                      \
        template <int N, int kFirst = 0, int kTiles>                                                           \
        static __device__ __forceinline__ void rs(float (&d)[kTiles][4], const unsigned (&a)[4],              \
                                                  unsigned long long b_desc, int accumulate) {                 \
            static_assert(N == 64 || N == 128, "wgmma widths instantiated: 64, 128");                          \
            static_assert(kFirst + N / 8 <= kTiles, "the product's n8 tiles lie inside d");                      \
            if constexpr (N == 64) {                                                                           \
                asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"                                    \
                             " wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                      \
                             " {" CUPYFLASH_REGS_0_31 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"         \
                             : CUPYFLASH_ACC32(0)                                                              \
                             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));      \
            } else {                                                                                           \
                asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"                                    \
                             " wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE                     \
                             " {" CUPYFLASH_REGS_0_31 ", " CUPYFLASH_REGS_32_63                                \
                             "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                  \
                             : CUPYFLASH_ACC32(0), CUPYFLASH_ACC32(8)                                          \
                             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));      \
            }                                                                                                  \
        }                                                                                                      \
    };

template <typename Element> struct Wgmma;
CUPYFLASH_WGMMA(Float16, "f16")
CUPYFLASH_WGMMA(BFloat16, "bf16")

#undef CUPYFLASH_WGMMA
#undef CUPYFLASH_REGS_32_63
#undef CUPYFLASH_REGS_0_31
#undef CUPYFLASH_ACC32
#undef CUPYFLASH_ACC4

}  // namespace cupyflash
