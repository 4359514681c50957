// Tile shapes of the mma.sync (sm_80 and newer) kernels. The catalogue (cupyflash/catalog/tiles.py)
// chooses the template arguments; everything else is derived here and checked with static_assert.
#pragma once
#include "tc/layouts.cuh"

namespace cupyflash {

// Forward: one block per (query block, head, batch). Q_i stays in shared memory; K_j and V_j have
// one buffer each, and each is loaded while the other is in use (FlashAttention-2's overlap).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMinBlocksPerSm_>
struct TcFwdTraits : TcWarpLayout<Element_, kHeadDim_, kBlockM_, kNWarps_> {
    using Base = TcWarpLayout<Element_, kHeadDim_, kBlockM_, kNWarps_>;
    static constexpr int kBlockM = kBlockM_;  // B_r: queries per block
    static constexpr int kBlockN = kBlockN_;  // B_c: keys per iteration
    static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
    static constexpr int kNTiles = kBlockN / 8;  // n8 tiles of S_ij per m16 tile

    static constexpr bool kWgmma = false;  // mma.sync products (WgmmaFwdTraits: wgmma)
    static constexpr int kSmemQOffset = 0;  // Storage elements
    static constexpr int kSmemKOffset = kSmemQOffset + kBlockM * Base::kStride;
    static constexpr int kSmemVOffset = kSmemKOffset + kBlockN * Base::kStride;
    static constexpr int kSmemBytes = (kSmemVOffset + kBlockN * Base::kStride) * sizeof(typename Base::Storage);

    static_assert(kBlockN % 16 == 0, "P_ij feeds P V in k16 steps");
};

// Backward dK/dV: one block per (key block, output column slice, head, batch). Its rows are keys:
// S_ij^T = K_j Q_i^T, so that P^T and dS^T come out as A operands of dV_j += P^T dO_i and
// dK_j += dS^T Q_i. The warps form a kWarpsK x kWarpsQ grid (FlashAttention-2's partition, which
// feeds more mma per ldmatrix than one warp per key row range): warp (wk, wq) computes S^T and
// dP^T for keys wk x queries wq and owns dK_j, dV_j for the same keys x column group wq. Its own
// queries' share of P^T and dS^T feeds dK_j, dV_j from registers; the other kWarpsQ - 1 shares
// come from the tiles the other warps wrote to shared memory. dK_j and dV_j are kept for
// kHeadDim / kOutSplit columns; kOutSplit > 1 recomputes the scores once per slice.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kWarpsQ_, int kDoBuffers_,
          int kOutSplit_, int kMinBlocksPerSm_>
struct TcBwdDkdvTraits : TcTileLayout<Element_, kHeadDim_, kNWarps_> {
    using Base = TcTileLayout<Element_, kHeadDim_, kNWarps_>;
    static constexpr int kBlockM = kBlockM_;  // B_r: queries per iteration
    static constexpr int kBlockN = kBlockN_;  // B_c: keys per block
    static constexpr int kOutSplit = kOutSplit_;
    static constexpr int kHeadDimOut = kHeadDim_ / kOutSplit;  // columns of dK_j, dV_j, dQ_i per block
    static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;

    // dO_i double-buffered (the next one loads during this step) where shared memory allows;
    // single-buffered, it is reloaded once every warp is done with it, behind one more barrier.
    static constexpr int kDoBuffers = kDoBuffers_;
    static constexpr int kWarpsQ = kWarpsQ_;
    static constexpr int kWarpsK = kNWarps_ / kWarpsQ;
    static constexpr int kWarpKeys = kBlockN / kWarpsK;  // S^T rows, dK_j and dV_j rows per warp
    static constexpr int kMTiles = kWarpKeys / 16;
    static constexpr int kWarpQueries = kBlockM / kWarpsQ;  // S^T columns per warp
    static constexpr int kNTiles = kWarpQueries / 8;
    static constexpr int kWarpCols = kHeadDimOut / kWarpsQ;  // dK_j, dV_j columns per warp
    static constexpr int kOutTiles = kWarpCols / 8;

    // dQ_i += dS_ij K_j (atomic mode) is shared out differently: kDqWarpsM x kDqWarpsN warps over
    // the kBlockM x kHeadDimOut tile of dQ_i, two m16 tiles per warp where the rows allow (each
    // K_j fragment then feeds two mma). Warps left over (when the column pairs do not divide among
    // them) skip the dQ product.
    static constexpr int kDqRowTiles = kBlockM / 16;
    // m16 tiles per dQ warp (float64: one, its accumulators taking twice the registers)
    static constexpr int kDqTilesWanted = kDqRowTiles % 2 == 0 && !Base::kF64 ? 2 : 1;
    static constexpr int kDqWarpsM =
        kDqRowTiles / kDqTilesWanted < kNWarps_ ? kDqRowTiles / kDqTilesWanted : kNWarps_;
    static constexpr int kDqWarpsN = largest_divisor_at_most(kHeadDimOut / 16, kNWarps_ / kDqWarpsM);
    static constexpr int kDqMTiles = kBlockM / 16 / kDqWarpsM;
    static constexpr int kDqCols = kHeadDimOut / kDqWarpsN;
    // dQ_i's columns are produced kDqChunk at a time, its accumulators living beside dK_j and dV_j:
    // 32 columns, or 16 when S^T is wider than 64 queries and leaves fewer registers (ptxas spills
    // 32 at sm_80 there).
    static constexpr int kDqChunk = kDqCols % 32 == 0 && kBlockM <= 64 && !Base::kF64 ? 32 : 16;
    static_assert(kDqCols % kDqChunk == 0, "dQ chunks tile the warp's columns");
    static constexpr int kPStride = kBlockM + Base::kPad;  // row stride of P^T and dS^T [keys][queries]
    static constexpr int kSize = sizeof(typename Base::Storage);  // bytes of an element

    // Storage elements: K_j, V_j, two buffers of Q_i (the next one loads during this step),
    // kDoBuffers of dO_i, P_ij^T, dS_ij^T; then Accum lse_i·log2(e) and D_i, two buffers each.
    static constexpr int kSmemKOffset = 0;
    static constexpr int kSmemVOffset = kSmemKOffset + kBlockN * Base::kStride;
    static constexpr int kSmemQOffset = kSmemVOffset + kBlockN * Base::kStride;
    static constexpr int kSmemDoOffset = kSmemQOffset + 2 * kBlockM * Base::kStride;
    static constexpr int kSmemPOffset = kSmemDoOffset + kDoBuffers * kBlockM * Base::kStride;
    static constexpr int kSmemDsOffset = kSmemPOffset + kBlockN * kPStride;
    static constexpr int kSmemRowStatsOffset = (kSmemDsOffset + kBlockN * kPStride) * kSize;  // bytes
    static constexpr int kSmemBytes = kSmemRowStatsOffset + 2 * 2 * kBlockM * sizeof(typename Base::Accum);
    static constexpr int kQueryTileBytes = kBlockM * Base::kStride * kSize;  // one buffer of Q_i or dO_i
    static constexpr bool kWgmma = false;  // mma.sync products (WgmmaBwdDkdvTraits: wgmma)

    static_assert(kDoBuffers == 1 || kDoBuffers == 2, "dO_i is single- or double-buffered");
    static_assert(kNWarps_ % kWarpsQ == 0, "the warps form a kWarpsK x kWarpsQ grid");
    static_assert(kBlockN % (16 * kWarpsK) == 0, "each warp needs whole m16 tiles of keys");
    static_assert(kBlockM % (16 * kWarpsQ) == 0, "each warp's share of P^T feeds dV in whole k16 steps");
    static_assert(kHeadDim_ % (16 * kOutSplit * kWarpsQ) == 0, "each warp's columns are whole n16 pairs");
    static_assert(kBlockM % (16 * kDqWarpsM) == 0, "warps must tile dQ_i's rows in m16 tiles");
    static_assert(kSmemRowStatsOffset % 16 == 0, "row statistics start 16-byte aligned");
};

// Backward dQ (deterministic mode): one block per (query block, output column slice, head, batch),
// FlashAttention-2's forward shape. K_j and V_j are double-buffered.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kOutSplit_,
          int kMinBlocksPerSm_>
struct TcBwdDqTraits : TcWarpLayout<Element_, kHeadDim_, kBlockM_, kNWarps_> {
    using Base = TcWarpLayout<Element_, kHeadDim_, kBlockM_, kNWarps_>;
    static constexpr int kBlockM = kBlockM_;  // B_r: queries per block
    static constexpr int kBlockN = kBlockN_;  // B_c: keys per iteration
    static constexpr int kOutSplit = kOutSplit_;
    static constexpr int kHeadDimOut = kHeadDim_ / kOutSplit;
    static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
    static constexpr int kNTiles = kBlockN / 8;

    // Storage elements: Q_i, dO_i, two buffers each of K_j and V_j.
    static constexpr int kSmemQOffset = 0;
    static constexpr int kSmemDoOffset = kSmemQOffset + kBlockM * Base::kStride;
    static constexpr int kSmemKOffset = kSmemDoOffset + kBlockM * Base::kStride;
    static constexpr int kSmemVOffset = kSmemKOffset + 2 * kBlockN * Base::kStride;
    static constexpr int kSmemBytes = (kSmemVOffset + 2 * kBlockN * Base::kStride) * 2;

    static_assert(kBlockN % 16 == 0, "dS_ij feeds dS K in k16 steps");
    static_assert(kHeadDim_ % (16 * kOutSplit) == 0, "output slices are whole n16 column pairs");
};

}  // namespace cupyflash
