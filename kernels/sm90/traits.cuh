// Tile shapes of the Hopper (sm_90a) kernels: wgmma products on 128-byte-swizzled tiles, TMA copies,
// and the warp-specialised kernels' register split. The catalogue (cupyflash/catalog/tiles.py)
// chooses the template arguments; everything else is derived here and checked with static_assert.
#pragma once
#include "sm80/traits.cuh"

namespace cupyflash {

// Tiles that wgmma reads through descriptors (arch/sm90.cuh) are stored in 128-byte-swizzled panels:
// [head dim / 64 panels][rows][64 elements], a panel row 128 bytes, its 16-byte chunk c kept at
// chunk position c ^ (row % 8). Eight rows then spread each chunk column over all 32 banks (writes
// and tensor-core reads without conflicts), and this is the layout of wgmma's 128-byte swizzle mode
// (PTX ISA, "Shared Memory Matrix Layout"). The hardware swizzles address bits, so a panel starts
// at a 1024-byte boundary, the pattern's period.
constexpr int kSwizzleBytes = 128;                    // a panel row
constexpr int kPanelColumns = kSwizzleBytes / 2;      // 16-bit elements per panel row
constexpr int kSwizzleAtomBytes = 8 * kSwizzleBytes;  // 8 rows: the swizzle's period

struct SwizzledTileLayout {
    static constexpr int kRowPeriod = 8;
    template <int kRows>
    static __device__ __forceinline__ unsigned tile_offset(int row, int col) {
        const int chunk = col % kPanelColumns / 8;
        return (col / kPanelColumns) * (kRows * kSwizzleBytes) + row * kSwizzleBytes + (chunk ^ (row % 8)) * 16;
    }
    static __host__ __device__ constexpr unsigned row_bytes(int rows) { return rows * kSwizzleBytes; }
    // The first swizzle period in the block's shared memory (whose size includes one period of slack).
    static __device__ __forceinline__ unsigned tile_base(unsigned smem) {
        return (smem + kSwizzleAtomBytes - 1) & ~static_cast<unsigned>(kSwizzleAtomBytes - 1);
    }
};

// Forward on Hopper (wgmma, sm_90a; sm90/fwd.cu's kernel with these traits): one block per
// query block, 64 rows per warpgroup. A warpgroup issues S = Q_i K_j^T and O_i += P_ij V_j for its
// rows as wgmma products; each of its warps then holds 16 of the rows (kMTiles = 1), the warp tile
// the tensor-core softmax takes. Q_i, K_j, V_j are swizzled panels; K_j and V_j have one buffer
// each, each loaded while the other is in use. The shared memory includes a swizzle period's slack
// to round the tiles' base up to one.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMinBlocksPerSm_>
struct WgmmaFwdTraits : TcWarpLayout<Element_, kHeadDim_, kBlockM_, kNWarps_>, SwizzledTileLayout {
    using Base = TcWarpLayout<Element_, kHeadDim_, kBlockM_, kNWarps_>;
    using SwizzledTileLayout::kRowPeriod;
    using SwizzledTileLayout::row_bytes;
    using SwizzledTileLayout::tile_base;
    using SwizzledTileLayout::tile_offset;
    static constexpr int kBlockM = kBlockM_;  // B_r: queries per block
    static constexpr int kBlockN = kBlockN_;  // B_c: keys per iteration
    static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
    static constexpr int kNTiles = kBlockN / 8;  // n8 tiles of a warp's S_ij rows
    static constexpr int kWarpgroups = kNWarps_ / 4;
    static constexpr int kPanels = kHeadDim_ / kPanelColumns;
    static constexpr int kKStepsPerPanel = kPanelColumns / 16;

    static constexpr bool kWgmma = true;
    static constexpr int kSmemQOffset = 0;  // Storage elements from the aligned base
    static constexpr int kSmemKOffset = kSmemQOffset + kBlockM * kHeadDim_;
    static constexpr int kSmemVOffset = kSmemKOffset + kBlockN * kHeadDim_;
    static constexpr int kSmemBytes = (kSmemVOffset + kBlockN * kHeadDim_) * 2 + kSwizzleAtomBytes;

    static_assert(kNWarps_ % 4 == 0 && kBlockM == 64 * kWarpgroups, "64 query rows per warpgroup");
    static_assert(Base::kMTiles == 1, "a warp holds 16 rows of its warpgroup's product");
    static_assert(kHeadDim_ % kPanelColumns == 0, "the head dim is whole 64-column panels");
    static_assert(kBlockN == 64 || kBlockN == 128, "S_ij is one wgmma wide (widths 64, 128)");
    static_assert((kBlockN * kSwizzleBytes) % kSwizzleAtomBytes == 0, "K_j, V_j panels start on swizzle periods");
};

// The registers a thread has at launch under __launch_bounds__(threads, 1), which the
// warp-specialised kernels' setmaxnreg splits share out: setmaxnreg.inc waits until the warpgroups
// that give registers back have freed enough, so a split must fit in threads times these, not in
// 64K (a forward split of 32 + 2 x 240 at 384 threads hung).
__host__ __device__ constexpr int launch_registers(int threads) { return 65536 / threads / 8 * 8; }

// Forward on Hopper, warp-specialised and persistent (FlashAttention-3's structure;
// sm90/fwd_ws.cu's flash_fwd_ws_kernel): a block per SM walks query tiles of kBlockM rows in
// turn. Warpgroup 0 is the producer: one of its threads asks the TMA for each tile's Q_i (two
// buffers) and for its K_j, V_j (a ring of kStages buffers each). The kConsumers warpgroups after
// it compute, 64 of the tile's rows each, as WgmmaFwdTraits' warpgroups do (this is that traits'
// view of the consumers), and hand each buffer back once read. So the next tile's Q_i and first
// K_j, V_j land while the consumers finish this one. O_i is staged in its own Q_i buffer, which
// the TMA stores from.
// (FlashAttention-3's ping-pong turns between the consumers and its overlap of the next S_ij with
// this step's softmax within a warpgroup were both slower here.)
// The shared memory includes a swizzle period's slack to round the tiles' base up to one.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct WgmmaFwdWsTraits : WgmmaFwdTraits<Element_, kHeadDim_, kBlockM_, kBlockN_, kBlockM_ / 16, 1> {
    using Base = WgmmaFwdTraits<Element_, kHeadDim_, kBlockM_, kBlockN_, kBlockM_ / 16, 1>;
    static constexpr int kConsumers = kBlockM_ / 64;            // consumer warpgroups
    static constexpr int kConsumerThreads = 128 * kConsumers;
    static constexpr int kNThreadsAll = kConsumerThreads + 128;  // and the producer warpgroup
    static constexpr int kStages = kStages_;
    // setmaxnreg's split of the registers given at launch (launch_registers): the producer keeps
    // 32 (at 24 the block-sparse producer, which claims its tiles, spilled 12-28 bytes), the
    // consumers what is left, in steps of 8.
    static constexpr int kProducerRegs = 32;
    static constexpr int kConsumerRegs = kConsumers == 2 ? 232 : 160;

    static constexpr int kQTileBytes = kBlockM_ * kHeadDim_ * 2;  // one Q_i buffer
    static constexpr int kKvTileBytes = kBlockN_ * kHeadDim_ * 2;  // one K_j or V_j buffer
    // Bytes from the aligned base: two Q_i buffers, then kStages of K_j, then kStages of V_j.
    static constexpr int kSmemQBytesOffset = 0;
    static constexpr int kSmemKBytesOffset = 2 * kQTileBytes;
    static constexpr int kSmemVBytesOffset = kSmemKBytesOffset + kStages_ * kKvTileBytes;
    static constexpr int kSmemBytes = kSmemVBytesOffset + kStages_ * kKvTileBytes + kSwizzleAtomBytes;

    static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups (setmaxnreg's split)");
    static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= launch_registers(kNThreadsAll) * kNThreadsAll,
                  "the registers given at launch are shared out");
    static_assert(kStages_ >= 2, "K_j, V_j at least double-buffered");
    static_assert(kQTileBytes % kSwizzleAtomBytes == 0 && kKvTileBytes % kSwizzleAtomBytes == 0,
                  "every buffer starts on a swizzle period");
};

// Backward dK/dV on Hopper (wgmma, sm_90a; sm90/bwd_dkdv.cu's kernels with these traits): 64
// keys per warpgroup, each of its warps 16 of them (a kWarpsK x 1 grid of TcBwdDkdvTraits). A
// warpgroup forms S^T and dP^T for its keys and every query of the step as wgmma products, so its
// P^T and dS^T feed dV_j += P^T dO_i and dK_j += dS^T Q_i whole from registers (no exchange
// between warps); dS^T also goes to shared memory, where dQ_i += dS_ij K_j (atomic mode) reads it
// as 64 x 64 shares, one warpgroup each. K_j, V_j, Q_i, dO_i and dS^T are swizzled panels; Q_i and
// dO_i are double-buffered. The shared memory includes a swizzle period's slack to round the
// tiles' base up to one.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kWarpsQ_, int kDoBuffers_,
          int kOutSplit_, int kMinBlocksPerSm_>
struct WgmmaBwdDkdvTraits
    : TcBwdDkdvTraits<Element_, kHeadDim_, kBlockM_, kBlockN_, kNWarps_, kWarpsQ_, kDoBuffers_, kOutSplit_, kMinBlocksPerSm_>,
      SwizzledTileLayout {
    using Base = TcBwdDkdvTraits<Element_, kHeadDim_, kBlockM_, kBlockN_, kNWarps_, kWarpsQ_, kDoBuffers_, kOutSplit_,
                                 kMinBlocksPerSm_>;
    using SwizzledTileLayout::kRowPeriod;
    using SwizzledTileLayout::row_bytes;
    using SwizzledTileLayout::tile_base;
    using SwizzledTileLayout::tile_offset;
    static constexpr int kWarpgroups = kNWarps_ / 4;
    static constexpr int kPanels = kHeadDim_ / kPanelColumns;
    static constexpr int kKStepsPerPanel = kPanelColumns / 16;
    // dQ_i's 64 x 64 shares: (queries / 64) x (head dim / 64), dealt out to the warpgroups in turn.
    static constexpr int kDqShares = kBlockM_ / 64 * kPanels;

    static constexpr bool kWgmma = true;
    static constexpr int kQueryTileBytes = kBlockM_ * kHeadDim_ * 2;
    // Storage elements from the aligned base: K_j, V_j, two buffers each of Q_i and dO_i, dS^T
    // ([queries / 64][keys][64]; P^T stays in registers), then float lse_i·log2(e) and D_i, two
    // buffers each.
    static constexpr int kSmemKOffset = 0;
    static constexpr int kSmemVOffset = kSmemKOffset + kBlockN_ * kHeadDim_;
    static constexpr int kSmemQOffset = kSmemVOffset + kBlockN_ * kHeadDim_;
    static constexpr int kSmemDoOffset = kSmemQOffset + 2 * kBlockM_ * kHeadDim_;
    static constexpr int kSmemPOffset = kSmemDoOffset + 2 * kBlockM_ * kHeadDim_;  // no P^T tile
    static constexpr int kSmemDsOffset = kSmemPOffset;
    static constexpr int kSmemRowStatsOffset = (kSmemDsOffset + kBlockN_ * kBlockM_) * 2;  // bytes
    static constexpr int kSmemBytes = kSmemRowStatsOffset + 2 * 2 * kBlockM_ * 4 + kSwizzleAtomBytes;
    // The TMA builds (kTma) then stage dQ_i's float32 shares for the TMA's adds: two buffers per
    // warpgroup of one 64 x 64 share, each two boxes of 32 columns (128 bytes: the widest the
    // 128-byte swizzle takes) by 64 rows.
    static constexpr int kDqBoxColumns = 32;
    static constexpr int kDqShareBytes = 64 * 64 * 4;
    static constexpr int kDqStageOffset = kSmemRowStatsOffset + 2 * 2 * kBlockM_ * 4;  // bytes
    static constexpr int kSmemBytesTma = kSmemBytes + 2 * kWarpgroups * kDqShareBytes;
    // The warp-specialised kernel then rounds dQ from the workspace itself, through two buffers of
    // one dQ box (64 queries x kDqBoxColumns floats: the adds' box, the same tensor map).
    static constexpr int kDqRoundBoxBytes = 64 * kDqBoxColumns * 4;
    static constexpr int kDqRoundOffset = kDqStageOffset + 2 * kWarpgroups * kDqShareBytes;  // bytes
    static constexpr int kSmemBytesWs = kSmemBytesTma + 2 * kDqRoundBoxBytes;

    static_assert(kDqStageOffset % kSwizzleAtomBytes == 0, "the dQ boxes start on swizzle periods");
    static_assert(kWarpsQ_ == 1 && kOutSplit_ == 1, "a warp owns whole rows of S^T, dK_j and dV_j");
    static_assert(kDoBuffers_ == 2, "dO_i is double-buffered");
    static_assert(kNWarps_ % 4 == 0 && kBlockN_ == 64 * kWarpgroups, "64 keys per warpgroup");
    static_assert(Base::kMTiles == 1, "a warp holds 16 keys of its warpgroup's product");
    static_assert(kBlockM_ == 64 || kBlockM_ == 128, "S^T is one wgmma wide (widths 64, 128)");
    static_assert(kHeadDim_ % kPanelColumns == 0, "the head dim is whole 64-column panels");
};

}  // namespace cupyflash
