// The attention products on Hopper's warpgroup instructions (arch/sm90.cuh): tiles are
// 128-byte-swizzled [head dim / 64][rows][64] panels (SwizzledTileLayout), a warpgroup multiplies 64
// rows of its tile, and each of its warps holds 16 of those rows in mma.sync's fragment layout, so
// masks, softmax and stores are tc/fragments.cuh's. Each product is issued and committed as one
// batch; by default it is also waited for at once. With kWait = false the caller waits (wgmma_wait,
// then fence_operands on C) and may issue other products or work on other registers meanwhile, the
// tensor cores running behind it. Also the TMA's tile loads and the tensor-map arguments.
#pragma once
#include "sm90/traits.cuh"
#include "tc/fragments.cuh"
#include "arch/sm90.cuh"

namespace cupyflash {

// C = A B^T over the head dim, A 64 rows of a [rows][head dim] tile (sA_rows: the first of them
// in a tile of kRowsA rows), B a [kN][head dim] tile: S = Q_i K_j^T in the forward, S^T = K_j Q_i^T
// and dP^T = V_j dO_i^T in the backward. Both are K-major (head dim contiguous). Step ks reads
// columns 16·ks.. of both tiles: panel ks / 4, 32 bytes into its (swizzled) rows; the first step
// overwrites C.
template <typename Tt, int kN, int kRowsA, bool kWait = true, int kTiles>
__device__ __forceinline__ void wgmma_abt(float (&C)[kTiles][4], unsigned sA_rows, unsigned sB) {
    const unsigned long long a_desc = smem_descriptor(sA_rows, 16, kSwizzleAtomBytes);
    const unsigned long long b_desc = smem_descriptor(sB, 16, kSwizzleAtomBytes);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < Tt::kKSteps; ++ks) {
        const unsigned panel = ks / Tt::kKStepsPerPanel, step_bytes = ks % Tt::kKStepsPerPanel * 32;
        Wgmma<typename Tt::Element>::template ss<kN>(C, descriptor_at(a_desc, panel * Tt::row_bytes(kRowsA) + step_bytes),
                                                     descriptor_at(b_desc, panel * Tt::row_bytes(kN) + step_bytes), ks > 0);
    }
    wgmma_commit();
    if constexpr (kWait) {
        wgmma_wait<0>();
        fence_operands(C);
    }
}

// C += A B, A from registers (the warp's 16 rows, kRowsB / 16 k16 steps of A fragments), B a
// [kRowsB][head dim] tile read MN-major: O_i += P_ij V_j in the forward, dV_j += P^T dO_i and
// dK_j += dS^T Q_i in the backward. Each k16 step is an m64 n64 k16 product per 64-column panel
// of B (16 of its rows: 16 rows of 128 bytes).
// kOverwrite: C = A B instead (its first k step does not read C, which may be unset).
template <typename Tt, int kRowsB, bool kWait = true, bool kOverwrite = false>
__device__ __forceinline__ void wgmma_ab_rs(float (&C)[Tt::kHeadDim / 8][4], unsigned (&A)[kRowsB / 16][4], unsigned sB) {
    const unsigned long long b_desc = smem_descriptor(sB, Tt::row_bytes(kRowsB), kSwizzleAtomBytes);
    fence_operands(C);  // C's rescale and A are written before the fence
    fence_operands(A);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kRowsB / 16; ++ks)
        static_for<0, Tt::kPanels>([&](auto panel) {
            constexpr int kPanel = decltype(panel)::value;
            Wgmma<typename Tt::Element>::template rs<kPanelColumns, kPanel * kPanelColumns / 8>(
                C, A[ks], descriptor_at(b_desc, kPanel * Tt::row_bytes(kRowsB) + Tt::row_bytes(16 * ks)),
                kOverwrite && ks == 0 ? 0 : 1);
        });
    wgmma_commit();
    if constexpr (kWait) {
        wgmma_wait<0>();
        fence_operands(C);
    }
}

// C = A^T B over kRowsK rows, both stored with those rows as rows and read MN-major: A^T 64
// columns wide (sAt_panel: one 64-column panel of a [kRowsK][...] tile), B one 64-column panel
// (sB_panel) of a [kRowsK][...] tile. dQ_i's 64 x 64 share dS_ij K_j from dS^T [keys][queries]
// and K_j [keys][head dim] in the backward.
template <typename Tt, int kRowsK>
__device__ __forceinline__ void wgmma_atb(float (&C)[kPanelColumns / 8][4], unsigned sAt_panel, unsigned sB_panel) {
    const unsigned long long a_desc = smem_descriptor(sAt_panel, Tt::row_bytes(kRowsK), kSwizzleAtomBytes);
    const unsigned long long b_desc = smem_descriptor(sB_panel, Tt::row_bytes(kRowsK), kSwizzleAtomBytes);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kRowsK / 16; ++ks)
        Wgmma<typename Tt::Element>::template ss<kPanelColumns, 0, true, true>(
            C, descriptor_at(a_desc, Tt::row_bytes(16 * ks)), descriptor_at(b_desc, Tt::row_bytes(16 * ks)), ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(C);
}

// Writes a warp's A fragments (its 16 rows from row0, kKSteps k16 steps of columns: P^T or dS^T) to a
// swizzled [kRows][...] tile, for wgmma to read. Every thread fences its writes into the async proxy
// before the barrier that publishes them.
template <typename Tt, int kRows, int kKSteps>
__device__ __forceinline__ void store_a_fragments_swizzled(unsigned s_tile, const unsigned (&A)[kKSteps][4], int row0,
                                                           const Fragment& f) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            // A register r holds row g + 8·(r % 2), columns 2t + 8·(r / 2) of the k16 step.
            const int row = row0 + f.g + 8 * (r % 2), col = kk * 16 + 8 * (r / 2);
            store_shared_4(s_tile + Tt::template tile_offset<kRows>(row, col) + 4 * f.t, A[kk][r]);
        }
    fence_proxy_async();
}

// K_j's and V_j's tensor maps, for the Hopper forward's TMA builds: 4-D (head dim, keys, K/V
// heads, batch), boxes of one 64-column panel by a tile's rows, 128-byte swizzle, rows past the
// keys read as zeros (cupyflash/runtime/tma.py makes them).
struct KvTensorMaps {
    TensorMap k, v;
};
static_assert(sizeof(KvTensorMaps) == 256, "cupyflash/runtime/tma.py passes 2 x 128 bytes");

// The Hopper dK/dV kernel's maps, for its TMA builds: the float32 dQ workspace's, into which dQ_i's
// shares are added (boxes of 32 columns by 64 queries), and Q's and dO's, like K's above with
// boxes of one panel by a query block's rows.
struct BwdTensorMaps {
    TensorMap dq, q, dout;
};
static_assert(sizeof(BwdTensorMaps) == 384, "cupyflash/runtime/tma.py passes 3 x 128 bytes");

// Thread 0 asks the TMA for a [kRows][head dim] tile of (head, batch)'s rows row0..: one box per
// 64-column panel, all counted on `barrier`'s current phase.
template <typename Tt, int kRows>
__device__ __forceinline__ void load_tile_tma(unsigned s_tile, const TensorMap& map, unsigned barrier, int row0,
                                              int head, int batch) {
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(barrier, Tt::row_bytes(kRows) * Tt::kPanels);
#pragma unroll
        for (int panel = 0; panel < Tt::kPanels; ++panel)
            tma_load_4d(s_tile + panel * Tt::row_bytes(kRows), map, barrier, panel * kPanelColumns, row0, head, batch);
    }
}

// Waits for a tile the TMA brings (its barrier's phase of this parity) and, behind the block
// barrier, for every warp to be done with the tiles read before it.
__device__ __forceinline__ void tma_tile_landed(unsigned barrier, unsigned parity) {
    mbarrier_wait(barrier, parity);
    __syncthreads();
}

// Waits for this thread's cp.async tile copies and publishes them to the block: behind the barrier
// every thread's copies have landed (and every warp is done with the tiles read before it). Tiles
// wgmma reads pass from the threads' (generic) view to the tensor cores' (async proxy) view first.
__device__ __forceinline__ void wgmma_tiles_landed() {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
}

}  // namespace cupyflash
