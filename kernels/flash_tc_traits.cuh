// Tile shapes of the tensor-core (mma.sync m16n8k16) kernels for float16 / bfloat16.
// Python (cupyflash/_instantiations.py) chooses the template arguments; everything else is derived
// here and checked with static_assert.
//
// The forward and the dQ kernel split a block's rows (queries) evenly over its warps, 16·kMTiles
// rows per warp, and each warp owns every column of its rows' score tile: the softmax's row
// reductions stay inside the 4 lanes that share a fragment row, and score tiles turn into A
// operands in registers. The dK/dV kernel lays its warps out in two dimensions (its traits say how).
#pragma once
#include "mma.cuh"

namespace cupyflash {

__host__ __device__ constexpr int largest_divisor_at_most(int n, int cap) {
    for (int c = cap; c > 1; --c)
        if (n % c == 0) return c;
    return 1;
}

// What every tensor-core kernel's tiles share: the element type and the padded shared-memory rows
// of [rows][head dim] tiles.
template <typename Element_, int kHeadDim_, int kNWarps_>
struct TcTileLayout {
    using Element = Element_;
    using Numeric = NumericTraits<Element>;
    using Storage = typename Numeric::Storage;
    using Accum = float;
    using Op = Mma<Element>;

    static constexpr int kHeadDim = kHeadDim_;  // padded head dim d; columns >= head_dim are zero
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kKSteps = kHeadDim / 16;  // k16 steps of a product over the head dim

    // Shared-memory rows are padded by 16 bytes: a row is then an odd number of 16-byte chunks,
    // so the 8 rows an ldmatrix phase reads fall in 8 different bank groups (no conflicts), and
    // every row start stays 16-byte aligned for cp.async.
    static constexpr int kPad = 8;
    static constexpr int kStride = kHeadDim + kPad;  // row stride of a [rows][head dim] tile, elements

    // Byte offset of (row, col) in a [kRows][kHeadDim] tile, col a multiple of 8; rows a multiple
    // of kRowPeriod apart are row_bytes(rows) apart in every column.
    static constexpr int kRowPeriod = 1;
    template <int kRows>
    static __device__ __forceinline__ unsigned tile_offset(int row, int col) { return (row * kStride + col) * 2; }
    static __host__ __device__ constexpr unsigned row_bytes(int rows) { return rows * kStride * 2; }
    // Where the tiles start in the block's shared memory (byte address): at its start.
    static __device__ __forceinline__ unsigned tile_base(unsigned smem) { return smem; }

    static_assert(sizeof(Storage) == 2, "tensor-core kernels take 16-bit elements");
    static_assert(kHeadDim % 16 == 0, "the head dim is padded to a multiple of the k16 step");
};

// Tiles that wgmma reads through descriptors (wgmma.cuh) are stored in 128-byte-swizzled panels:
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

// kRows rows split evenly over the warps, whole m16 tiles each.
template <typename Element_, int kHeadDim_, int kRows_, int kNWarps_>
struct TcWarpLayout : TcTileLayout<Element_, kHeadDim_, kNWarps_> {
    static constexpr int kWarpRows = kRows_ / kNWarps_;  // rows of the block's row tile per warp
    static constexpr int kMTiles = kWarpRows / 16;       // m16 tiles per warp

    static_assert(kRows_ % (16 * kNWarps_) == 0, "each warp needs whole m16 tiles of rows");
};

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
    static constexpr int kSmemBytes = (kSmemVOffset + kBlockN * Base::kStride) * 2;

    static_assert(kBlockN % 16 == 0, "P_ij feeds P V in k16 steps");
};

// Forward on Hopper (wgmma, sm_90a; flash_fwd_tc.cu's kernel with these traits): one block per
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
// 64K (a forward split of 32 + 2 x 240 at 384 threads hung; benchmarks/NOTES.md, session 35).
__host__ __device__ constexpr int launch_registers(int threads) { return 65536 / threads / 8 * 8; }

// Forward on Hopper, warp-specialised and persistent (FlashAttention-3's structure;
// flash_fwd_tc.cu's flash_fwd_ws_kernel): a block per SM walks query tiles of kBlockM rows in
// turn. Warpgroup 0 is the producer: one of its threads asks the TMA for each tile's Q_i (two
// buffers) and for its K_j, V_j (a ring of kStages buffers each). The kConsumers warpgroups after
// it compute, 64 of the tile's rows each, as WgmmaFwdTraits' warpgroups do (this is that traits'
// view of the consumers), and hand each buffer back once read. So the next tile's Q_i and first
// K_j, V_j land while the consumers finish this one. O_i is staged in its own Q_i buffer, which
// the TMA stores from.
// (FlashAttention-3's ping-pong turns between the consumers and its overlap of the next S_ij with
// this step's softmax within a warpgroup were both slower here: benchmarks/NOTES.md, session 32.)
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
    static constexpr int kDqTilesWanted = kDqRowTiles % 2 == 0 ? 2 : 1;  // m16 tiles per dQ warp
    static constexpr int kDqWarpsM =
        kDqRowTiles / kDqTilesWanted < kNWarps_ ? kDqRowTiles / kDqTilesWanted : kNWarps_;
    static constexpr int kDqWarpsN = largest_divisor_at_most(kHeadDimOut / 16, kNWarps_ / kDqWarpsM);
    static constexpr int kDqMTiles = kBlockM / 16 / kDqWarpsM;
    static constexpr int kDqCols = kHeadDimOut / kDqWarpsN;
    // dQ_i's columns are produced kDqChunk at a time, its accumulators living beside dK_j and dV_j:
    // 32 columns, or 16 when S^T is wider than 64 queries and leaves fewer registers (ptxas spills
    // 32 at sm_80 there).
    static constexpr int kDqChunk = kDqCols % 32 == 0 && kBlockM <= 64 ? 32 : 16;
    static_assert(kDqCols % kDqChunk == 0, "dQ chunks tile the warp's columns");
    static constexpr int kPStride = kBlockM + Base::kPad;  // row stride of P^T and dS^T [keys][queries]

    // Storage elements: K_j, V_j, two buffers of Q_i (the next one loads during this step),
    // kDoBuffers of dO_i, P_ij^T, dS_ij^T; then float lse_i·log2(e) and D_i, two buffers each.
    static constexpr int kSmemKOffset = 0;
    static constexpr int kSmemVOffset = kSmemKOffset + kBlockN * Base::kStride;
    static constexpr int kSmemQOffset = kSmemVOffset + kBlockN * Base::kStride;
    static constexpr int kSmemDoOffset = kSmemQOffset + 2 * kBlockM * Base::kStride;
    static constexpr int kSmemPOffset = kSmemDoOffset + kDoBuffers * kBlockM * Base::kStride;
    static constexpr int kSmemDsOffset = kSmemPOffset + kBlockN * kPStride;
    static constexpr int kSmemRowStatsOffset = (kSmemDsOffset + kBlockN * kPStride) * 2;  // bytes
    static constexpr int kSmemBytes = kSmemRowStatsOffset + 2 * 2 * kBlockM * 4;
    static constexpr int kQueryTileBytes = kBlockM * Base::kStride * 2;  // one buffer of Q_i or dO_i
    static constexpr bool kWgmma = false;  // mma.sync products (WgmmaBwdDkdvTraits: wgmma)

    static_assert(kDoBuffers == 1 || kDoBuffers == 2, "dO_i is single- or double-buffered");
    static_assert(kNWarps_ % kWarpsQ == 0, "the warps form a kWarpsK x kWarpsQ grid");
    static_assert(kBlockN % (16 * kWarpsK) == 0, "each warp needs whole m16 tiles of keys");
    static_assert(kBlockM % (16 * kWarpsQ) == 0, "each warp's share of P^T feeds dV in whole k16 steps");
    static_assert(kHeadDim_ % (16 * kOutSplit * kWarpsQ) == 0, "each warp's columns are whole n16 pairs");
    static_assert(kBlockM % (16 * kDqWarpsM) == 0, "warps must tile dQ_i's rows in m16 tiles");
    static_assert(kSmemRowStatsOffset % 16 == 0, "row statistics start 16-byte aligned");
};

// Backward dK/dV on Hopper (wgmma, sm_90a; flash_bwd_tc.cu's dK/dV kernel with these traits): 64
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
