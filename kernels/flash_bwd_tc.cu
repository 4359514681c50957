// Attention backward on tensor cores (float16 / bfloat16, sm_80+): FlashAttention-2, Algorithm 2,
// with mma.sync.m16n8k16 and float32 accumulation. Same schedule as the scalar flash_bwd.cu, whose
// preprocess (D_i, lse_i·log2(e)) and dQ-conversion kernels it shares:
//   flash_bwd_dkdv_tc_kernel: one block per key block; its warps form a keys x queries grid
//     (TcBwdDkdvTraits), so S_ij^T = K_j Q_i^T, P^T = exp2(S^T·scale·log2(e) - lse_i),
//     dP^T = V_j dO_i^T and dS^T = P^T ∘ (dP^T - D_i) come out with keys as rows, as the A operands
//     of dV_j += P^T dO_i and dK_j += dS^T Q_i (rounded to the input type, as FlashAttention-2
//     does). A warp's own share of P^T and dS^T feeds those products from registers, the other
//     warps' shares through shared memory; dQ_i += dS_ij K_j goes through dS^T in shared memory
//     and float32 atomics. On Hopper (sm_90a, WgmmaBwdDkdvTraits) the products are warpgroup
//     wgmma (flash_wgmma.cuh), 64 keys per warpgroup: a warp holds 16 keys x every query of the
//     step, so P^T and dS^T feed dV_j and dK_j whole from registers; products are left running
//     while the warp computes where registers allow (kOverlap, kDpWithS); its kTma builds hand
//     dQ_i's float32 shares to the TMA, which adds them in L2 (cp.reduce.async.bulk.tensor).
//   flash_bwd_dq_tc_kernel (deterministic mode): one block per query block, recomputes P_ij and
//     dP_ij and sums dQ_i over the key blocks in a fixed order, with no atomics.
#include "flash_bwd.cuh"
#include "flash_wgmma.cuh"

namespace cupyflash {

// lse_i·log2(e) and D_i for the kBlockM queries of (batch, head) from q_row0. Rows past seqlen_q
// get lse = +inf, so their P_ij are exactly 0 whatever their (zero) scores. (These plain loads hold
// the first warps at their shared-memory stores; copied by cp.async instead, the Hopper d128 dK/dV
// kernel measured 3-4% slower: benchmarks/NOTES.md, session 25.)
template <typename Bt>
__device__ __forceinline__ void load_row_stats(const BwdParams& params, float* sLse2, float* sD, int batch_idx,
                                               int head_idx, int q_row0) {
    const int rows_valid = min(Bt::kBlockM, params.seqlen_q - q_row0);
    const long long row_stats = row_vector_offset(params, batch_idx, head_idx) + q_row0;
    for (int i = threadIdx.x; i < Bt::kBlockM; i += Bt::kNThreads) {
        sLse2[i] = i < rows_valid ? static_cast<const float*>(params.lse_log2)[row_stats + i] : pos_inf<float>();
        sD[i] = i < rows_valid ? static_cast<const float*>(params.d)[row_stats + i] : 0.f;
    }
}

// Q_i (asynchronously) and its row statistics. The addresses are formed here from the kernel
// parameters, not kept across the loop in registers, which the d64-d128 kernels have none to
// spare for.
template <typename Bt>
__device__ __forceinline__ void load_query_block(const BwdParams& params, unsigned sQ, float* sLse2, float* sD,
                                                 int batch_idx, int head_idx, int q_row0) {
    const int rows_valid = min(Bt::kBlockM, params.seqlen_q - q_row0);
    const auto* q = static_cast<const typename Bt::Storage*>(params.q) + batch_idx * params.q_batch_stride +
                    head_idx * params.q_head_stride + q_row0 * params.q_row_stride;
    load_tile_async<Bt, Bt::kBlockM>(sQ, q, params.q_row_stride, rows_valid, params.head_dim);
    load_row_stats<Bt>(params, sLse2, sD, batch_idx, head_idx, q_row0);
}

// The TMA builds (kTma): thread 0 asks the copy engine for Q_i and dO_i, one box per 64-column
// panel of each, all counted on the buffer's one mbarrier (a second arrival could let the phase
// complete on the first tile's bytes alone). Queries past seqlen_q arrive as zeros.
template <typename Bt>
__device__ __forceinline__ void load_query_tiles_tma(const BwdTensorMaps& maps, unsigned sQ_i, unsigned sdO_i,
                                                     unsigned barrier, int q_row0, int head_idx, int batch_idx) {
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(barrier, 2 * Bt::kQueryTileBytes);
#pragma unroll
        for (int panel = 0; panel < Bt::kPanels; ++panel) {
            const unsigned offset = panel * Bt::row_bytes(Bt::kBlockM);
            tma_load_4d(sQ_i + offset, maps.q, barrier, panel * kPanelColumns, q_row0, head_idx, batch_idx);
            tma_load_4d(sdO_i + offset, maps.dout, barrier, panel * kPanelColumns, q_row0, head_idx, batch_idx);
        }
    }
}

template <typename Bt>
__device__ __forceinline__ void load_dout_block(const BwdParams& params, unsigned sdO, int batch_idx, int head_idx,
                                                int q_row0) {
    const auto* dout = static_cast<const typename Bt::Storage*>(params.dout) + batch_idx * params.dout_batch_stride +
                       head_idx * params.dout_head_stride + q_row0 * params.dout_row_stride;
    load_tile_async<Bt, Bt::kBlockM>(sdO, dout, params.dout_row_stride, min(Bt::kBlockM, params.seqlen_q - q_row0),
                                     params.head_dim);
}

// C += A^T B over the queries of the other warps in this warp's row of the grid: dV_j += P^T dO_i
// or dK_j += dS^T Q_i, with A^T the [keys][queries] tile those warps wrote (sAt_warp: at this
// warp's first key) and B = dO_i or Q_i (sB: its tile).
template <typename Bt, int kNTiles>
__device__ __forceinline__ void mma_other_queries(float (&C)[Bt::kMTiles][kNTiles][4], unsigned sAt_warp, unsigned sB,
                                                  int wq, int warp_cols, int lane) {
#pragma unroll
    for (int other = 1; other < Bt::kWarpsQ; ++other) {
        const int queries = (wq + other) % Bt::kWarpsQ * Bt::kWarpQueries;
        gemm_ab_ss<typename Bt::Op, false, Bt::kMTiles, kNTiles, Bt::kWarpQueries / 16, Bt::kPStride, Bt::kStride>(
            C, sAt_warp + queries * 2, sB + (queries * Bt::kStride + warp_cols) * 2, lane);
    }
}

// A warp's 16 rows of a 64 x 64 float32 dQ share (C, times `scale`) into the TMA's two boxes at
// s_share: [64 rows][32 columns] each, in the 128-byte swizzle (16-byte chunk c of row r at chunk
// c ^ r % 8), which spreads a warp's eight rows over all the banks.
template <typename Bt>
__device__ __forceinline__ void stage_dq_share(unsigned s_share, const float (&C)[kPanelColumns / 8][4], float scale,
                                               int warp_row0, const Fragment& f) {
    constexpr int kRowBytes = Bt::kDqBoxColumns * 4, kChunksPerTile = 8 * 4 / 16;
#pragma unroll
    for (int nt = 0; nt < kPanelColumns / 8; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp_row0 + f.g + 8 * h;
            const int box = nt * 8 / Bt::kDqBoxColumns;
            const int chunk = nt % (Bt::kDqBoxColumns / 8) * kChunksPerTile + f.t / 2;
            store_shared_8(s_share + box * 64 * kRowBytes + row * kRowBytes + (chunk ^ row % 8) * 16 + f.t % 2 * 8,
                           C[nt][2 * h] * scale, C[nt][2 * h + 1] * scale);
        }
}

// Hopper (WgmmaBwdDkdvTraits): dQ_i += scale · dS_ij K_j as 64 x 64 shares, warpgroup w taking
// shares w, w + kWarpgroups, ...: share s covers queries 64·(s / kPanels).. and head-dim panel
// s % kPanels, dS from dS^T's panel and K_j's panel (both read MN-major), over all kBlockN keys.
// Added to dq_accum by atomics, or (kTma, one share per warpgroup) staged in shared memory at
// sDq_stage and added by the TMA, which one thread of the warpgroup asks for: the adds then run
// in L2 while the warps go on, where the atomics held each warp's load/store queue.
template <typename Bt, bool kRescale, bool kTma>
__device__ __forceinline__ void add_dq_shares_wgmma(const BwdParams& params, const TensorMap& dq_map,
                                                    unsigned sDq_stage, unsigned sdSt, unsigned sK, int q_row0,
                                                    int batch_idx, int head_idx, int warp, int lane) {
    const long long dq_row_stride = static_cast<long long>(params.heads) * params.head_dim;
    const float scale = static_cast<float>(kRescale ? params.scale * params.dropout_rescale : params.scale);
    static_assert(!kTma || Bt::kDqShares == Bt::kWarpgroups, "the TMA builds stage one dQ share per warpgroup");
#pragma unroll 1
    for (int share = warp / 4; share < Bt::kDqShares; share += Bt::kWarpgroups) {
        const int query_panel = share / Bt::kPanels, col_panel = share % Bt::kPanels;
        float dQ[1][kPanelColumns / 8][4];
        wgmma_atb<Bt, Bt::kBlockN>(dQ[0], sdSt + query_panel * Bt::row_bytes(Bt::kBlockN),
                                   sK + col_panel * Bt::row_bytes(Bt::kBlockN));
        if constexpr (kTma) {
            // The stage's last adds have read it (waited for a step ago, behind the step's barriers).
            const unsigned s_share = sDq_stage + warp / 4 * Bt::kDqShareBytes;
            stage_dq_share<Bt>(s_share, dQ[0], scale, 16 * (warp % 4), Fragment(lane));
            fence_proxy_async();
            named_barrier_sync(1 + warp / 4, 128);
            if (threadIdx.x % 128 == 0) {
#pragma unroll
                for (int box = 0; box < kPanelColumns / Bt::kDqBoxColumns; ++box)
                    tma_reduce_add_4d(dq_map, s_share + box * 64 * Bt::kDqBoxColumns * 4,
                                      col_panel * kPanelColumns + box * Bt::kDqBoxColumns, q_row0 + 64 * query_panel,
                                      head_idx, batch_idx);
                bulk_commit_group();
                bulk_wait_group_read<1>();  // the other stage's adds, for the next step to rewrite it
            }
        } else {
            const int dq_row0 = q_row0 + 64 * query_panel + 16 * (warp % 4), dq_col0 = col_panel * kPanelColumns;
            float* dq_accum = static_cast<float*>(params.dq_accum) +
                              dq_accum_offset(params, batch_idx, dq_row0, head_idx) + dq_col0;
            atomic_add_fragments(dq_accum, dq_row_stride, params.seqlen_q - dq_row0, params.head_dim - dq_col0,
                                 dQ, scale, Fragment(lane));
        }
    }
}

// dQ_i += scale · dS_ij K_j (atomic mode; kRescale: times dropout's 1 / (1 - p)) from dS^T in
// shared memory: this warp's share of the
// kBlockM x kHeadDimOut tile (TcBwdDkdvTraits::kDqWarpsM x kDqWarpsN), added to the float32
// workspace with atomics, kDqChunk columns at a time (a whole row slice of dQ_i would sit in
// registers beside dK_j and dV_j).
template <typename Bt, bool kRescale = false, bool kTma = false>
__device__ __forceinline__ void add_dq_share(const BwdParams& params, const TensorMap& dq_map, unsigned sDq_stage,
                                             unsigned sdSt, unsigned sK, int q_row0, int col_out0, int batch_idx,
                                             int head_idx, int warp, int lane) {
    if constexpr (Bt::kWgmma) {
        add_dq_shares_wgmma<Bt, kRescale, kTma>(params, dq_map, sDq_stage, sdSt, sK, q_row0, batch_idx, head_idx,
                                                warp, lane);
        return;
    }
    const int wm = warp % Bt::kDqWarpsM, wn = warp / Bt::kDqWarpsM;
    if (wn >= Bt::kDqWarpsN) return;
    const int dq_row0 = q_row0 + wm * Bt::kDqMTiles * 16, dq_col0 = col_out0 + wn * Bt::kDqCols;
    const long long dq_row_stride = static_cast<long long>(params.heads) * params.head_dim;
    float* dq_accum = static_cast<float*>(params.dq_accum) + dq_accum_offset(params, batch_idx, dq_row0, head_idx) +
                      dq_col0;
    constexpr int kChunk = Bt::kDqChunk;
#pragma unroll 1
    for (int c = 0; c < Bt::kDqCols; c += kChunk) {
        float dQ[Bt::kDqMTiles][kChunk / 8][4];
        zero(dQ);
        gemm_ab_ss<typename Bt::Op, true, Bt::kDqMTiles, kChunk / 8, Bt::kBlockN / 16, Bt::kPStride, Bt::kStride>(
            dQ, sdSt + wm * Bt::kDqMTiles * 16 * 2, sK + (dq_col0 + c) * 2, lane);
        if constexpr (kRescale)
            atomic_add_fragments(dq_accum + c, dq_row_stride, params.seqlen_q - dq_row0, params.head_dim - dq_col0 - c,
                                 dQ, static_cast<float>(params.scale * params.dropout_rescale), Fragment(lane));
        else
            atomic_add_fragments(dq_accum + c, dq_row_stride, params.seqlen_q - dq_row0, params.head_dim - dq_col0 - c,
                                 dQ, static_cast<float>(params.scale), Fragment(lane));
    }
}

// Grid: (ceil(seqlen_k / kBlockN) · kOutSplit, K/V heads, batch), block-sparse with seqlen_k rounded up
// to the mask's key blocks (key_tile). Block: Bt::kNThreads.
// Shared memory: Bt::kSmemBytes. With GQA/MQA the block walks the query blocks of each query head
// of its K/V head's group in turn (as the scalar kernel): dK_j, dV_j sum over the group on chip.
// kScoreMod: softcap, ALiBi and dropout, as in the forward (instantiated with kIsLocal only);
// kVarlen: a variable-length batch, as in the forward. kTma (Hopper, neither of those): the copy
// engine does the step's data movement through `maps` (cupyflash/_tma.py; the other builds take
// them and ignore them): it brings Q_i and dO_i, one thread asking and every thread waiting on the
// buffer's mbarrier, in place of every thread's 16-byte cp.async copies and their address
// arithmetic (as the forward's K_j, V_j: benchmarks/NOTES.md, session 24); and it adds dQ_i's
// shares into dq_accum (4-D map: head dim, queries, heads, batch).
template <typename Bt, bool kIsLocal, bool kIsBlockSparse, bool kScoreMod = false, bool kVarlen = false,
          bool kTma = false>
__global__ void __launch_bounds__(Bt::kNThreads, Bt::kMinBlocksPerSm)
    flash_bwd_dkdv_tc_kernel(const BwdParams launch_params, const __grid_constant__ BwdTensorMaps maps) {
    using Storage = typename Bt::Storage;
    using Op = typename Bt::Op;
    constexpr int kStride = Bt::kStride, kPStride = Bt::kPStride;
    extern __shared__ __align__(16) unsigned char smem[];
    // (The tiles' base: the block's shared memory, or on Hopper the first swizzle period in it.)
    const unsigned tiles = Bt::tile_base(smem_address(smem));
    unsigned char* const smem_tiles = smem + (tiles - smem_address(smem));
    const unsigned sK = tiles + Bt::kSmemKOffset * 2;     // K_j [kBlockN][kStride] (Hopper: swizzled panels)
    const unsigned sV = tiles + Bt::kSmemVOffset * 2;     // V_j [kBlockN][kStride]
    const unsigned sQ = tiles + Bt::kSmemQOffset * 2;     // Q_i [2][kBlockM][kStride]
    const unsigned sdO = tiles + Bt::kSmemDoOffset * 2;   // dO_i [kBlockM][kStride]
    const unsigned sPt = tiles + Bt::kSmemPOffset * 2;    // P_ij^T [kBlockN][kPStride] (Hopper: none)
    const unsigned sdSt = tiles + Bt::kSmemDsOffset * 2;  // dS_ij^T [kBlockN][kPStride]
    float* sLse2 = reinterpret_cast<float*>(smem_tiles + Bt::kSmemRowStatsOffset);  // [2][kBlockM]
    float* sD = sLse2 + 2 * Bt::kBlockM;                                      // [2][kBlockM]
    static_assert(!kTma || (Bt::kWgmma && !kScoreMod && !kVarlen), "the TMA builds: Hopper, no score mods");
    unsigned sDq = 0;  // kTma: dQ_i's shares, [2 stages][kWarpgroups][kDqShareBytes]
    if constexpr (kTma) sDq = tiles + Bt::kDqStageOffset;
    int dq_stage = 0;

    const int kv_head = blockIdx.y, batch_idx = blockIdx.z;
    // The mma.sync builds take the key blocks in index order: they sit at 254-255 registers, and
    // holding a loaded key tile (blockIdx's is formed again at no register's cost) spilled 8 bytes
    // in two of them, or 12-20 in another with the tile kept in shared memory (sm_90a;
    // benchmarks/NOTES.md, session 30).
    constexpr bool kKeyOrder = kIsBlockSparse && Bt::kWgmma;
    const int n_block = key_tile<Bt::kBlockN, kKeyOrder>(launch_params, batch_idx, kv_head * launch_params.kv_group,
                                                         blockIdx.x / Bt::kOutSplit);
    const int key0 = n_block * Bt::kBlockN;
    const int col_out0 = blockIdx.x % Bt::kOutSplit * Bt::kHeadDimOut;  // this block's slice of dK_j, dV_j, dQ_i
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Fragment f(lane);
    // Warp (wk, wq): S^T rows warp_keys.., columns warp_queries.. (both local to the block);
    // dK_j and dV_j rows warp_keys.., head-dim columns warp_cols.. (global).
    const int wk = warp / Bt::kWarpsQ, wq = warp % Bt::kWarpsQ;
    const int warp_keys = wk * Bt::kWarpKeys, warp_queries = wq * Bt::kWarpQueries;
    const int warp_cols = col_out0 + wq * Bt::kWarpCols;
    int q_batch, k_batch;
    const BwdParams params = sequence_params<kVarlen>(launch_params, batch_idx, q_batch, k_batch);
    if ((kVarlen || kIsBlockSparse) && key0 >= params.seqlen_k) return;  // past this sequence's end
    const int keys_valid = min(Bt::kBlockN, params.seqlen_k - key0);

    const Storage* k = static_cast<const Storage*>(params.k) + k_batch * params.k_batch_stride +
                       kv_head * params.k_head_stride + key0 * params.k_row_stride;
    const Storage* v = static_cast<const Storage*>(params.v) + k_batch * params.v_batch_stride +
                       kv_head * params.v_head_stride + key0 * params.v_row_stride;
    load_tile_async<Bt, Bt::kBlockN>(sK, k, params.k_row_stride, keys_valid, params.head_dim);
    load_tile_async<Bt, Bt::kBlockN>(sV, v, params.v_row_stride, keys_valid, params.head_dim);
    // kTma: each Q_i/dO_i buffer's mbarrier, and the parity of the phase each is waited for at next
    // (bit b for buffer b).
    unsigned landed = 0, phases = 0;
    if constexpr (kTma) {
        __shared__ alignas(8) unsigned long long barriers[2];
        landed = smem_address(&barriers[0]);
        if (threadIdx.x == 0) {
            mbarrier_init(landed, 1);
            mbarrier_init(landed + 8, 1);
            fence_mbarrier_init();
        }
        __syncthreads();
    }

    float dV[Bt::kMTiles][Bt::kOutTiles][4], dK[Bt::kMTiles][Bt::kOutTiles][4];
    zero(dV);
    zero(dK);
    const float scale_log2 = static_cast<float>(params.scale_log2);
    const unsigned sK_warp = sK + warp_keys * kStride * 2, sV_warp = sV + warp_keys * kStride * 2;
    const unsigned sPt_warp = sPt + warp_keys * kPStride * 2, sdSt_warp = sdSt + warp_keys * kPStride * 2;

    // Hopper (benchmarks/NOTES.md, session 20): kOverlap leaves dV_j's and dK_j's products
    // running while the warp goes on (waited for at the end of the step), and kDpWithS issues
    // dP^T together with S^T, so the tensor cores compute it while the warp works out P^T.
    // kDpWithS needs S^T and dP^T in registers at once: taken where they are 32 each (64 queries
    // per step); at 128 queries (64 each, d64) it measured 2-7% slower than issuing dP^T after
    // P^T (benchmarks/results/H100-2026-11-24-bwd-overlap-ab.txt). The d128
    // score-modifier builds hold P^T ∘ dx besides and wait for each product at once (overlapped,
    // the variable-length one spilled at 255 registers, sm_90a).
    constexpr bool kOverlap = !(kScoreMod && Bt::kHeadDim >= 128);
    constexpr bool kDpWithS = kOverlap && Bt::kBlockM == 64;
    const int first_head = kv_head * params.kv_group;
    for (int head_idx = first_head; head_idx < first_head + params.kv_group; ++head_idx) {
        const auto mod = score_mod<kScoreMod, float>(params, batch_idx, head_idx);
        const auto dropout = dropout_for<kScoreMod>(params, batch_idx, head_idx);

        // Query blocks that see this key block: those in its band (causal: from its diagonal on),
        // and of those only the ones a block mask keeps.
        const auto query_blocks =
            query_tiles<Bt::kBlockM, kIsLocal, kIsBlockSparse>(params, batch_idx, head_idx, key0, keys_valid);
        // The query blocks are visited in a rotated order that starts at this block's launch
        // position (dense: its key block's index): the blocks in flight then add into different
        // rows of dQ at a time (atomics on the same addresses serialise in L2).
        const int m_blocks = query_blocks.end - query_blocks.begin;
        int t = m_blocks > 0 ? query_blocks.begin + static_cast<int>(blockIdx.x / Bt::kOutSplit) % m_blocks : 0;
        const auto after = [&](int t) { return t + 1 < query_blocks.end ? t + 1 : query_blocks.begin; };
        if (m_blocks > 0) {
            if constexpr (kTma) {
                // (The copies asked for before the row statistics' loads, here and in the loop,
                // made the d128 kernel 5-6% slower: benchmarks/NOTES.md, session 29.)
                load_row_stats<Bt>(params, sLse2, sD, q_batch, head_idx, query_blocks[t] * Bt::kBlockM);
                load_query_tiles_tma<Bt>(maps, sQ, sdO, landed, query_blocks[t] * Bt::kBlockM, head_idx, q_batch);
            } else {
                load_query_block<Bt>(params, sQ, sLse2, sD, q_batch, head_idx, query_blocks[t] * Bt::kBlockM);
                load_dout_block<Bt>(params, sdO, q_batch, head_idx, query_blocks[t] * Bt::kBlockM);
            }
        }
        cp_async_commit();
        if constexpr (kTma) {
            // K_j, V_j are the only cp.async copies: published at the first step's barrier.
            cp_async_wait<0>();
            fence_proxy_async();
        }

        for (int step = 0; step < m_blocks; ++step, t = after(t)) {
            const int buf = step % 2;
            const int q_row0 = query_blocks[t] * Bt::kBlockM;
            const bool has_next = step + 1 < m_blocks;
            const int next_row0 = query_blocks[after(t)] * Bt::kBlockM;
            const unsigned sQ_i = sQ + buf * Bt::kQueryTileBytes;
            const float* sLse2_i = sLse2 + buf * Bt::kBlockM;
            const float* sD_i = sD + buf * Bt::kBlockM;
            // Q_i, dO_i have landed; every warp is done with the last step's tiles.
            if constexpr (kTma) {
                tma_tile_landed(landed + 8 * buf, phases >> buf & 1);
                phases ^= 1u << buf;
            } else {
                tiles_landed<Bt>();
            }
            const unsigned sdO_i = sdO + (Bt::kDoBuffers == 2 ? buf : 0) * Bt::kQueryTileBytes;
            if (has_next) {
                if constexpr (kTma) {
                    load_row_stats<Bt>(params, sLse2 + (1 - buf) * Bt::kBlockM, sD + (1 - buf) * Bt::kBlockM,
                                       q_batch, head_idx, next_row0);
                    load_query_tiles_tma<Bt>(maps, sQ + (1 - buf) * Bt::kQueryTileBytes,
                                             sdO + (1 - buf) * Bt::kQueryTileBytes, landed + 8 * (1 - buf),
                                             next_row0, head_idx, q_batch);
                } else {
                    load_query_block<Bt>(params, sQ + (1 - buf) * Bt::kQueryTileBytes,
                                         sLse2 + (1 - buf) * Bt::kBlockM, sD + (1 - buf) * Bt::kBlockM, q_batch,
                                         head_idx, next_row0);
                    if (Bt::kDoBuffers == 2)
                        load_dout_block<Bt>(params, sdO + (1 - buf) * Bt::kQueryTileBytes, q_batch, head_idx,
                                            next_row0);
                }
            }
            cp_async_commit();

            // S_ij^T = K_j Q_i^T, masked, then P_ij^T = exp2(S^T·scale·log2(e) - lse_i·log2(e)).
            // On Hopper with kDpWithS, dP_ij^T = V_j dO_i^T (below) is issued with it.
            float St[Bt::kMTiles][Bt::kNTiles][4], dPt[Bt::kMTiles][Bt::kNTiles][4];
            if constexpr (Bt::kWgmma) {  // this warpgroup's 64 keys against all of Q_i
                const unsigned group_rows = Bt::row_bytes(64 * (warp / 4));
                wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN, false>(St[0], sK + group_rows, sQ_i);
                if constexpr (kDpWithS)
                    wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN, false>(dPt[0], sV + group_rows, sdO_i);
                wgmma_wait<kDpWithS ? 1 : 0>();  // S^T (dP^T may still run)
                fence_operands(St[0]);
            } else {
                zero(St);
                gemm_abt_ss<Op, Bt::kMTiles, Bt::kNTiles, Bt::kKSteps, kStride, kStride>(
                    St, sK_warp, sQ_i + warp_queries * kStride * 2, lane);
            }
            if (keys_valid < Bt::kBlockN ||
                (kIsLocal && band_cuts(params, q_row0, min(Bt::kBlockM, params.seqlen_q - q_row0), key0, keys_valid)))
                mask_fragments<kIsLocal, true>(St, key0 + warp_keys, q_row0 + warp_queries, params, f);
            // kScoreMod: P^T of the modified scores, and P^T ∘ dx (the modifier's derivative) rounded
            // as dS's factor in place of P^T: no fp32 tile outlives this loop.
            unsigned Pt_dx[Bt::kMTiles][Bt::kNTiles / 2][4];
            if constexpr (kScoreMod) {
                // ALiBi's query + diagonal - key at this lane's first element; the others add a constant.
                const float offset0 = mod.offset(q_row0 + warp_queries + f.col(0, 0), key0 + warp_keys + f.row(0, 0));
                const auto modified_probabilities = [&](auto softcap) {
                    constexpr bool kSoftcap = decltype(softcap)::value;
#pragma unroll
                    for (int nt = 0; nt < Bt::kNTiles; ++nt) {
                        const float2 lse2 = *reinterpret_cast<const float2*>(sLse2_i + warp_queries + f.col(nt, 0));
#pragma unroll
                        for (int mt = 0; mt < Bt::kMTiles; ++mt)
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const float offset = offset0 + static_cast<float>(8 * nt - 16 * mt - 8 * h);
                                float dx0, dx1;
                                const float x0 = mod.template apply_at<true, kSoftcap>(St[mt][nt][2 * h] * scale_log2,
                                                                                       fabsf(offset), dx0);
                                const float x1 = mod.template apply_at<true, kSoftcap>(
                                    St[mt][nt][2 * h + 1] * scale_log2, fabsf(offset + 1.f), dx1);
                                St[mt][nt][2 * h] = exp2f(x0 - lse2.x);
                                St[mt][nt][2 * h + 1] = exp2f(x1 - lse2.y);
                                Pt_dx[mt][nt / 2][(nt % 2) * 2 + h] =
                                    Op::pack(St[mt][nt][2 * h] * dx0, St[mt][nt][2 * h + 1] * dx1);
                            }
                    }
                };
                if (mod.softcap())
                    modified_probabilities(BoolConstant<true>());
                else
                    modified_probabilities(BoolConstant<false>());
                // Dropout (flash_bwd.cuh): a dropped P^T is 0 for dV_j, and its factor of dS carries
                // the drop in its sign, P^T ∘ dx >= 0 being negated.
                if (dropout.active())
                    for_dropped<true, Bt::kMTiles, Bt::kNTiles>(
                        dropout, key0 + warp_keys, q_row0 + warp_queries, f, [&](int mt, int nt, int i) {
                            St[mt][nt][i] = 0.f;
                            Pt_dx[mt][nt / 2][(nt % 2) * 2 + i / 2] ^= i % 2 ? 0x80000000u : 0x8000u;  // sign bit
                        });
            } else {
#pragma unroll
                for (int nt = 0; nt < Bt::kNTiles; ++nt) {
                    const float2 lse2 = *reinterpret_cast<const float2*>(sLse2_i + warp_queries + f.col(nt, 0));
#pragma unroll
                    for (int mt = 0; mt < Bt::kMTiles; ++mt)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            St[mt][nt][2 * h] = exp2f(fmaf(St[mt][nt][2 * h], scale_log2, -lse2.x));
                            St[mt][nt][2 * h + 1] = exp2f(fmaf(St[mt][nt][2 * h + 1], scale_log2, -lse2.y));
                        }
                }
            }

            // dV_j += P^T dO_i over this warp's queries. P^T is rounded to the input type first, as
            // the product takes it, and dS below reuses the rounded values: the fp32 scores are then
            // dead before dP^T is formed, which keeps dK_j, dV_j and both score tiles in registers.
            unsigned Pt[Bt::kMTiles][Bt::kNTiles / 2][4];
            to_a_fragments<Op>(St, Pt);
            if (Bt::kWarpsQ > 1) store_a_fragments<kPStride>(sPt_warp + warp_queries * 2, Pt, f);
            if constexpr (Bt::kWgmma)  // kOverlap: left running while dS^T is formed
                wgmma_ab_rs<Bt, Bt::kBlockM, !kOverlap>(dV[0], Pt[0], sdO_i);
            else
                gemm_ab_rs<Op, Bt::kMTiles, Bt::kOutTiles, Bt::kNTiles / 2, kStride>(
                    dV, Pt, sdO_i + (warp_queries * kStride + warp_cols) * 2, lane);

            // dP_ij^T = V_j dO_i^T, then dS_ij^T = P^T ∘ (dP^T - D_i) in place.
            if constexpr (Bt::kWgmma) {
                if constexpr (kDpWithS) {
                    wgmma_wait<1>();  // dP^T (batches complete in order; dV_j's may still run)
                } else {  // (waits for dV_j's product too)
                    wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN>(dPt[0], sV + Bt::row_bytes(64 * (warp / 4)), sdO_i);
                }
                fence_operands(dPt[0]);
            } else {
                zero(dPt);
                gemm_abt_ss<Op, Bt::kMTiles, Bt::kNTiles, Bt::kKSteps, kStride, kStride>(
                    dPt, sV_warp, sdO_i + warp_queries * kStride * 2, lane);
            }
#pragma unroll
            for (int nt = 0; nt < Bt::kNTiles; ++nt) {
                const float2 d_i = *reinterpret_cast<const float2*>(sD_i + warp_queries + f.col(nt, 0));
#pragma unroll
                for (int mt = 0; mt < Bt::kMTiles; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        // A fragment register r holds rows h = r % 2 of n8 tile 2kk + r / 2.
                        const float2 p = Op::unpack((kScoreMod ? Pt_dx : Pt)[mt][nt / 2][(nt % 2) * 2 + h]);
                        if constexpr (kScoreMod) {  // dropped (negative): -D_i' instead of dP - D_i'
                            dPt[mt][nt][2 * h] = p.x * (p.x >= 0.f ? dPt[mt][nt][2 * h] - d_i.x : d_i.x);
                            dPt[mt][nt][2 * h + 1] = p.y * (p.y >= 0.f ? dPt[mt][nt][2 * h + 1] - d_i.y : d_i.y);
                        } else {
                            dPt[mt][nt][2 * h] = p.x * (dPt[mt][nt][2 * h] - d_i.x);
                            dPt[mt][nt][2 * h + 1] = p.y * (dPt[mt][nt][2 * h + 1] - d_i.y);
                        }
                    }
            }

            // dK_j += dS^T Q_i over this warp's queries; dS^T also goes to shared memory for dQ_i.
            unsigned dSt[Bt::kMTiles][Bt::kNTiles / 2][4];
            to_a_fragments<Op>(dPt, dSt);
            if constexpr (Bt::kWgmma) {
                store_a_fragments_swizzled<Bt, Bt::kBlockN>(sdSt, dSt[0], warp_keys, f);
                wgmma_ab_rs<Bt, Bt::kBlockM, !kOverlap>(dK[0], dSt[0], sQ_i);  // kOverlap: waited for below
            } else {
                store_a_fragments<kPStride>(sdSt_warp + warp_queries * 2, dSt, f);
                gemm_ab_rs<Op, Bt::kMTiles, Bt::kOutTiles, Bt::kNTiles / 2, kStride>(
                    dK, dSt, sQ_i + (warp_queries * kStride + warp_cols) * 2, lane);
            }
            __syncthreads();  // P^T and dS^T are complete

            // dV_j over the other warps' queries; a single dO buffer is then reloaded.
            if (Bt::kDoBuffers == 1) {
                mma_other_queries<Bt>(dV, sPt_warp, sdO_i, wq, warp_cols, lane);
                __syncthreads();  // every warp is done with dO_i
                if (has_next) load_dout_block<Bt>(params, sdO, q_batch, head_idx, next_row0);
                cp_async_commit();
            }

            // dQ_i += dS_ij K_j, and dV_j (double-buffered dO) and dK_j over the other warps'
            // queries. Half the warps add their dQ share first, half last (one of the two warps on
            // each of an SM's four schedulers, warp w and w + 4): the atomics of all warps at once
            // would queue up in the load/store unit.
            const bool dq_first = warp % 8 < 4;
            unsigned sDq_stage = 0;
            if constexpr (kTma) sDq_stage = sDq + dq_stage * Bt::kWarpgroups * Bt::kDqShareBytes;
            if (params.dq_accum != nullptr && dq_first)
                add_dq_share<Bt, kScoreMod, kTma>(params, maps.dq, sDq_stage, sdSt, sK, q_row0, col_out0, q_batch,
                                                  head_idx, warp, lane);
            if (Bt::kDoBuffers == 2) mma_other_queries<Bt>(dV, sPt_warp, sdO_i, wq, warp_cols, lane);
            mma_other_queries<Bt>(dK, sdSt_warp, sQ_i, wq, warp_cols, lane);
            if (params.dq_accum != nullptr && !dq_first)
                add_dq_share<Bt, kScoreMod, kTma>(params, maps.dq, sDq_stage, sdSt, sK, q_row0, col_out0, q_batch,
                                                  head_idx, warp, lane);
            dq_stage ^= 1;
            if constexpr (Bt::kWgmma && kOverlap) {
                // dV_j's and dK_j's products have read Q_i, dO_i and dS^T before the next step's
                // barrier lets those buffers be refilled (dQ's wgmma waited for them already when
                // the atomic mode ran it).
                wgmma_wait<0>();
                fence_operands(dV[0]);
                fence_operands(dK[0]);
                fence_operands(dSt[0]);
            }
        }
        __syncthreads();  // every warp is done with this head's last Q_i, dO_i before the next head's land
    }
    cp_async_wait<0>();  // nothing may still be landing when the block exits
    // Nor may the TMA still be reading its shared memory. Only the reads are waited for: the adds
    // in L2 complete with the launch (as a TMA store's writes do), before the conversion reads dQ.
    if constexpr (kTma)
        if (threadIdx.x % 128 == 0) bulk_wait_group_read<0>();

    const int warp_key0 = key0 + warp_keys;
    Storage* dk = static_cast<Storage*>(params.dk) + k_batch * params.dk_batch_stride +
                  kv_head * params.dk_head_stride + warp_key0 * params.dk_row_stride + warp_cols;
    Storage* dv = static_cast<Storage*>(params.dv) + k_batch * params.dv_batch_stride +
                  kv_head * params.dv_head_stride + warp_key0 * params.dv_row_stride + warp_cols;
    if constexpr (Bt::kWgmma) {
        // Hopper: dK_j and dV_j go out through the K_j and V_j tiles as whole row chunks
        // (store_rows_staged), as the forward's O_i. No warp reads those tiles after the last
        // step; the barrier also covers a block that saw no query block, whose K_j, V_j copies
        // only the wait above has seen land, and for this thread alone.
        __syncthreads();
        const float dk_scale = static_cast<float>(kScoreMod ? params.scale * params.dropout_rescale : params.scale);
        const float dv_scale = kScoreMod ? static_cast<float>(params.dropout_rescale) : 1.f;
        store_rows_staged<Bt, Bt::kBlockN>(dk, params.dk_row_stride, params.seqlen_k - warp_key0,
                                           params.head_dim - warp_cols, dK, sK, warp_keys, f, lane, dk_scale);
        store_rows_staged<Bt, Bt::kBlockN>(dv, params.dv_row_stride, params.seqlen_k - warp_key0,
                                           params.head_dim - warp_cols, dV, sV, warp_keys, f, lane, dv_scale);
    } else if constexpr (kScoreMod) {  // dropout's 1 / (1 - p) on both
        const float rescale = static_cast<float>(params.dropout_rescale);
        store_fragments<typename Bt::Element>(dk, params.dk_row_stride, params.seqlen_k - warp_key0,
                                              params.head_dim - warp_cols, dK,
                                              static_cast<float>(params.scale * params.dropout_rescale), f);
        store_fragments<typename Bt::Element>(dv, params.dv_row_stride, params.seqlen_k - warp_key0,
                                              params.head_dim - warp_cols, dV, rescale, f);
    } else {
        store_fragments<typename Bt::Element>(dk, params.dk_row_stride, params.seqlen_k - warp_key0,
                                              params.head_dim - warp_cols, dK, static_cast<float>(params.scale), f);
        store_fragments<typename Bt::Element>(dv, params.dv_row_stride, params.seqlen_k - warp_key0,
                                              params.head_dim - warp_cols, dV, 1.f, f);
    }
}

// The query block a key block's walk starts at, the walk wrapping round: its launch position's, as
// flash_bwd_dkdv_tc_kernel's (dense: its key block's index), so that the blocks in flight add into
// different rows of dQ at a time (atomics on the same addresses serialise in L2).
template <bool kIsBlockSparse>
__device__ __forceinline__ int first_query_tile(const TileSequence<kIsBlockSparse>& query_blocks, int position) {
    const int m_blocks = query_blocks.end - query_blocks.begin;
    return m_blocks > 0 ? query_blocks.begin + position % m_blocks : 0;
}

// The warp-specialised dK/dV kernel's view of WgmmaBwdDkdvTraits' shared memory (the one-block
// kernel's TMA builds' layout), from its tiles' base, the first swizzle period.
struct DkdvTiles {
    unsigned sK, sV;  // K_j, V_j [kBlockN][head dim], swizzled panels
    unsigned sQ;      // Q_i [2][kBlockM][head dim]
    unsigned sdO;     // dO_i [2][kBlockM][head dim]
    unsigned sdSt;    // dS_ij^T [kBlockN][kBlockM]
    unsigned sDq;     // dQ_i's shares, [2 stages][kWarpgroups][kDqShareBytes]
    unsigned sRound;  // the warp-specialised kernel's dQ boxes being rounded, [2][kDqRoundBoxBytes]
    float* sLse2;     // lse_i·log2(e) [2][kBlockM]
    float* sD;        // D_i [2][kBlockM]
};

template <typename Bt>
__device__ __forceinline__ DkdvTiles dkdv_tiles(unsigned char* smem) {
    const unsigned tiles = Bt::tile_base(smem_address(smem));
    DkdvTiles s;
    s.sK = tiles + Bt::kSmemKOffset * 2;
    s.sV = tiles + Bt::kSmemVOffset * 2;
    s.sQ = tiles + Bt::kSmemQOffset * 2;
    s.sdO = tiles + Bt::kSmemDoOffset * 2;
    s.sdSt = tiles + Bt::kSmemDsOffset * 2;
    s.sDq = tiles + Bt::kDqStageOffset;
    s.sRound = tiles + Bt::kDqRoundOffset;
    s.sLse2 = reinterpret_cast<float*>(smem + (tiles - smem_address(smem)) + Bt::kSmemRowStatsOffset);
    s.sD = s.sLse2 + 2 * Bt::kBlockM;
    return s;
}

// One step of the warp-specialised kernel's consumers: flash_bwd_dkdv_tc_kernel's step as its Hopper
// TMA builds take it (64 keys per warpgroup, a warp's 16 keys against every query, no score
// modifiers), for key block K_j, V_j (from key0) and query block Q_i, dO_i (from q_row0, in buffer
// buf, landed): dV_j += P^T dO_i, dK_j += dS^T Q_i, dQ_i's shares added by the TMA. It returns with
// every product that reads Q_i, dO_i or dS^T done. (Moved into one function that both kernels
// called, the step spilled 8-32 bytes in the one-block kernel's mma.sync builds at head dim 256,
// sm_90a; so that kernel keeps its own text of it: benchmarks/NOTES.md, session 33.)
template <typename Bt, bool kIsLocal>
__device__ __forceinline__ void dkdv_consumer_step(const BwdParams& params, const BwdTensorMaps& maps,
                                                   const DkdvTiles& s, int key0, int keys_valid, int q_row0,
                                                   int head_idx, int q_batch, int buf,
                                                   float (&dK)[1][Bt::kOutTiles][4], float (&dV)[1][Bt::kOutTiles][4],
                                                   int& dq_stage, int barrier) {
    using Op = typename Bt::Op;
    static_assert(Bt::kWgmma && Bt::kWarpsQ == 1 && Bt::kMTiles == 1, "the Hopper builds' warps");
    constexpr bool kDpWithS = Bt::kBlockM == 64;  // (as flash_bwd_dkdv_tc_kernel's)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Fragment f(lane);
    const int warp_keys = warp * Bt::kWarpKeys;
    const float scale_log2 = static_cast<float>(params.scale_log2);
    const unsigned sQ_i = s.sQ + buf * Bt::kQueryTileBytes, sdO_i = s.sdO + buf * Bt::kQueryTileBytes;
    const float* sLse2_i = s.sLse2 + buf * Bt::kBlockM;
    const float* sD_i = s.sD + buf * Bt::kBlockM;

    // S_ij^T = K_j Q_i^T (with kDpWithS dP_ij^T = V_j dO_i^T issued with it), masked, then
    // P_ij^T = exp2(S^T·scale·log2(e) - lse_i·log2(e)).
    float St[1][Bt::kNTiles][4], dPt[1][Bt::kNTiles][4];
    const unsigned group_rows = Bt::row_bytes(64 * (warp / 4));
    wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN, false>(St[0], s.sK + group_rows, sQ_i);
    if constexpr (kDpWithS) wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN, false>(dPt[0], s.sV + group_rows, sdO_i);
    wgmma_wait<kDpWithS ? 1 : 0>();
    fence_operands(St[0]);
    if (keys_valid < Bt::kBlockN ||
        (kIsLocal && band_cuts(params, q_row0, min(Bt::kBlockM, params.seqlen_q - q_row0), key0, keys_valid)))
        mask_fragments<kIsLocal, true>(St, key0 + warp_keys, q_row0, params, f);
#pragma unroll
    for (int nt = 0; nt < Bt::kNTiles; ++nt) {
        const float2 lse2 = *reinterpret_cast<const float2*>(sLse2_i + f.col(nt, 0));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            St[0][nt][2 * h] = exp2f(fmaf(St[0][nt][2 * h], scale_log2, -lse2.x));
            St[0][nt][2 * h + 1] = exp2f(fmaf(St[0][nt][2 * h + 1], scale_log2, -lse2.y));
        }
    }
    // dV_j += P^T dO_i (left running), then dS_ij^T = P^T ∘ (dP^T - D_i) in place.
    unsigned Pt[1][Bt::kNTiles / 2][4];
    to_a_fragments<Op>(St, Pt);
    wgmma_ab_rs<Bt, Bt::kBlockM, false>(dV[0], Pt[0], sdO_i);
    if constexpr (kDpWithS)
        wgmma_wait<1>();
    else
        wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN>(dPt[0], s.sV + group_rows, sdO_i);
    fence_operands(dPt[0]);
#pragma unroll
    for (int nt = 0; nt < Bt::kNTiles; ++nt) {
        const float2 d_i = *reinterpret_cast<const float2*>(sD_i + f.col(nt, 0));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 p = Op::unpack(Pt[0][nt / 2][(nt % 2) * 2 + h]);
            dPt[0][nt][2 * h] = p.x * (dPt[0][nt][2 * h] - d_i.x);
            dPt[0][nt][2 * h + 1] = p.y * (dPt[0][nt][2 * h + 1] - d_i.y);
        }
    }
    // dK_j += dS^T Q_i (left running); dS^T to shared memory, and once every consumer warp's is
    // there, dQ_i += dS_ij K_j.
    unsigned dSt[1][Bt::kNTiles / 2][4];
    to_a_fragments<Op>(dPt, dSt);
    store_a_fragments_swizzled<Bt, Bt::kBlockN>(s.sdSt, dSt[0], warp_keys, f);
    wgmma_ab_rs<Bt, Bt::kBlockM, false>(dK[0], dSt[0], sQ_i);
    named_barrier_sync(barrier, Bt::kNThreads);
    add_dq_share<Bt, false, true>(params, maps.dq, s.sDq + dq_stage * Bt::kWarpgroups * Bt::kDqShareBytes, s.sdSt,
                                  s.sK, q_row0, 0, q_batch, head_idx, warp, lane);
    dq_stage ^= 1;
    wgmma_wait<0>();
    fence_operands(dV[0]);
    fence_operands(dK[0]);
    fence_operands(dSt[0]);
}

// The warp-specialised dK/dV kernel's counters, zero at launch and left zero at exit: its item
// claims, its rounding warps done, then per (K/V head, batch) slab the completions of its items
// (one per consumer warpgroup and item, once that warpgroup's dQ adds for it have landed) and the
// rounding warps done with it (two per block: its ring slot is zero again).
struct DkdvCounters {
    int* base;
    int slabs;
    __device__ __forceinline__ int* next_item() const { return base; }
    __device__ __forceinline__ int* rounders_done() const { return base + 1; }
    __device__ __forceinline__ int* slab_done(int slab) const { return base + 2 + slab; }
    __device__ __forceinline__ int* slab_rounded(int slab) const { return base + 2 + slabs + slab; }
};
constexpr int kRoundingWarps = 2;

__device__ __forceinline__ int load_acquire(const int* p) {
    int x;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(x) : "l"(p) : "memory");
    return x;
}
__device__ __forceinline__ void add_release(int* p, int x) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(x) : "memory");
}
__device__ __forceinline__ int add_acq_rel(int* p, int x) {
    int before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(before) : "l"(p), "r"(x) : "memory");
    return before;
}
__device__ __forceinline__ void wait_at_least(const int* p, int x) {
    while (load_acquire(p) < x) __nanosleep(128);
}

// The warp-specialised kernel's dQ workspace is a ring of `ring` slots, one (K/V head, batch) slab
// each: (query, slot, head of the group, head dim) floats, slab s in slot s % ring (the dq map's
// head coordinate is slot x group + the head within the group, its batch coordinate 0). The
// slots' rows interleave as the whole workspace's heads do: slot-major, the same adds ran 4-9%
// slower (benchmarks/NOTES.md, session 41). A slot is rounded into dq as soon as its slab's items
// are complete and left zero for slab s + ring, whose items wait for that (wait_for_slot). So
// there is no workspace to clear before the launch nor to round after it. With ring = slabs (a
// short launch) no slab waits. The producer looks while the item's K_j, V_j load (slot_ready: its
// load's latency is off the consumers' path); the consumers' storing threads wait only where it
// found the slot still in use.
__device__ __forceinline__ bool slot_ready(const DkdvCounters& counters, int slab, int ring) {
    if (ring == 0 || slab < ring) return true;
    if (load_acquire(counters.slab_rounded(slab - ring)) < kRoundingWarps * static_cast<int>(gridDim.x)) return false;
    fence_proxy_async_global();  // the slot's zeros (generic stores), before the TMA adds to it
    return true;
}
__device__ __forceinline__ void wait_for_slot(const DkdvCounters& counters, int slab, int ring) {
    wait_at_least(counters.slab_rounded(slab - ring), kRoundingWarps * gridDim.x);
    fence_proxy_async_global();
}

// A consumer warpgroup's count of its last item complete in its slab (`pending`, -1: none), made
// once the item's dQ adds have landed: after the next item's steps (the consumers' loop), or here,
// by the storing thread, at once where the next item must wait for its slot, which might need this
// very count (wait_for_slot), and at the end.
__device__ __forceinline__ void count_item_complete(const DkdvCounters& counters, int& pending) {
    if (pending < 0) return;
    bulk_wait_group<0>();
    fence_proxy_async_global();
    add_release(counters.slab_done(pending), 1);
    pending = -1;
}

// dq rounded from the ring inside the warp-specialised dK/dV kernel, in place of the conversion
// launch, box by box (the dq map's 64 queries x kDqBoxColumns boxes, column boxes fastest, then
// queries, then the query heads of the K/V head; the slabs in the items' order), block b taking
// boxes b, b + gridDim.x, ... of each slab: one thread waits until the slab has `expected`
// completions and asks the TMA for each box into the free one of two buffers (`box_of`: its head
// within the group, first query, first column, slab, and whether it is this block's last box of
// the slab; head -1: no more; and `box_at`: where its first element is in dq and in the ring), and
// the rounding warps round it into dq (round_dq_boxes). Loads by the rounding warps themselves, at
// the producer warpgroup's 40 registers, kept too few bytes in flight: 0.4 TB/s
// (benchmarks/NOTES.md, session 40).
enum { kBoxHead, kBoxRow, kBoxCol, kBoxSlab, kBoxLast, kBoxFields };
template <typename Bt>
__device__ __forceinline__ void load_dq_boxes(const BwdParams& params, const TensorMap& dq_map,
                                              const DkdvCounters& counters, int ring, int expected, unsigned sRound,
                                              unsigned long long (&barriers)[2][2], int (&box_of)[2][kBoxFields],
                                              long long (&box_at)[2][2]) {
    const int group = params.kv_group, kv_heads = params.heads / group;
    const int col_boxes = ceil_div(params.head_dim, Bt::kDqBoxColumns), row_boxes = ceil_div(params.seqlen_q, 64);
    const int per_slab = group * row_boxes * col_boxes;
    int b = 0;
    unsigned phase = 0;
    for (int slab = 0; slab < (ring ? counters.slabs : 0); ++slab) {
        if (blockIdx.x >= per_slab) {  // no box of this slab here: its part is done
            add_release(counters.slab_rounded(slab), kRoundingWarps);
            continue;
        }
        wait_at_least(counters.slab_done(slab), expected);
        fence_proxy_async_global();  // the slab's adds, seen here, before the TMA reads them
        for (int box = blockIdx.x; box < per_slab; box += gridDim.x) {
            int local = box;
            const int col0 = local % col_boxes * Bt::kDqBoxColumns;
            local /= col_boxes;
            const int row0 = local % row_boxes * 64, head = local / row_boxes;
            mbarrier_wait(smem_address(&barriers[b][1]), phase ^ 1);
            box_of[b][kBoxHead] = head;
            box_of[b][kBoxRow] = row0;
            box_of[b][kBoxCol] = col0;
            box_of[b][kBoxSlab] = slab;
            box_of[b][kBoxLast] = box + gridDim.x >= per_slab;
            box_at[b][0] = slab / kv_heads * params.dq_batch_stride +
                           (slab % kv_heads * group + head) * params.dq_head_stride + row0 * params.dq_row_stride + col0;
            box_at[b][1] = ((static_cast<long long>(row0) * ring + slab % ring) * group + head) *
                               params.head_dim + col0;
            const unsigned full = smem_address(&barriers[b][0]);
            mbarrier_arrive_expect_tx(full, Bt::kDqRoundBoxBytes);
            tma_load_4d(sRound + b * Bt::kDqRoundBoxBytes, dq_map, full, col0, row0, slab % ring * group + head, 0);
            if (++b == 2) b = 0, phase ^= 1;
        }
    }
    mbarrier_wait(smem_address(&barriers[b][1]), phase ^ 1);
    box_of[b][kBoxHead] = -1;
    mbarrier_arrive(smem_address(&barriers[b][0]));
}

// The rounding warps' part (t: their thread, 0..32·kRoundingWarps - 1): a box's rows in the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ r % 8), each thread one chunk of every
// eighth row, rounded to dq in 8-byte stores, and the box's floats in the ring set back to zero.
// Each warp counts the slab rounded after the block's last box of it; the last rounding warp of
// the launch to finish sets the counters back to zero, after every other count.
template <typename Bt>
__device__ __forceinline__ void round_dq_boxes(const BwdParams& params, const DkdvCounters& counters, int ring,
                                               unsigned sRound, unsigned long long (&barriers)[2][2],
                                               const int (&box_of)[2][kBoxFields], const long long (&box_at)[2][2],
                                               int t) {
    using Numeric = NumericTraits<typename Bt::Element>;
    using Storage = typename Bt::Storage;
    constexpr int kChunks = Bt::kDqBoxColumns / 4, kRowStep = 32 * kRoundingWarps / kChunks;
    // 8-byte stores where every row of dq allows them (its head dim is a multiple of 4: the map's).
    const bool vec = reinterpret_cast<unsigned long long>(params.dq) % 8 == 0 &&
                     (params.dq_row_stride | params.dq_head_stride | params.dq_batch_stride) % 4 == 0;
    const int ring_row_stride = ring * params.kv_group * params.head_dim;
    const int chunk = t % kChunks;
    int b = 0;
    unsigned phase = 0;
    for (;;) {
        mbarrier_wait(smem_address(&barriers[b][0]), phase);
        const int head = box_of[b][kBoxHead];
        if (head < 0) break;
        const int slab = box_of[b][kBoxSlab];
        const bool last = box_of[b][kBoxLast];
        if (box_of[b][kBoxCol] + 4 * chunk < params.head_dim) {
            Storage* dq = static_cast<Storage*>(params.dq) + box_at[b][0] + 4 * chunk;
            float* zeros = static_cast<float*>(params.dq_accum) + box_at[b][1] + 4 * chunk;
            const int rows = min(64, params.seqlen_q - box_of[b][kBoxRow]);
            for (int r = t / kChunks; r < rows; r += kRowStep) {
                const uint4 x = load_shared_16(sRound + b * Bt::kDqRoundBoxBytes + r * Bt::kDqBoxColumns * 4 +
                                               (chunk ^ r % 8) * 16);
                Storage* out = dq + r * params.dq_row_stride;
                const unsigned short e0 = Numeric::from_accum(__uint_as_float(x.x)),
                                     e1 = Numeric::from_accum(__uint_as_float(x.y)),
                                     e2 = Numeric::from_accum(__uint_as_float(x.z)),
                                     e3 = Numeric::from_accum(__uint_as_float(x.w));
                if (vec) {
                    *reinterpret_cast<uint2*>(out) = make_uint2(e0 | static_cast<unsigned>(e1) << 16,
                                                                e2 | static_cast<unsigned>(e3) << 16);
                } else {
                    out[0] = e0, out[1] = e1, out[2] = e2, out[3] = e3;
                }
                // The ring's rows are 16-byte aligned (head dim a multiple of 4, as the map's).
                *reinterpret_cast<uint4*>(zeros + r * ring_row_stride) = uint4{};
            }
        }
        __syncwarp();  // the warp's zeros, before its lane 0's release counts them
        if (threadIdx.x % 32 == 0) {
            mbarrier_arrive(smem_address(&barriers[b][1]));
            if (last) add_release(counters.slab_rounded(slab), 1);
        }
        if (++b == 2) b = 0, phase ^= 1;
    }
    if (threadIdx.x % 32 == 0 && add_acq_rel(counters.rounders_done(), 1) == kRoundingWarps * gridDim.x - 1) {
        for (int slab = 0; slab < counters.slabs; ++slab) *counters.slab_done(slab) = *counters.slab_rounded(slab) = 0;
        *counters.rounders_done() = 0;
    }
}

// The Hopper TMA builds' warp-specialised, persistent form (WgmmaBwdDkdvTraits; no score modifiers,
// not varlen), FlashAttention-3's structure: Bt::kNThreads consumer threads (threads 0.., the
// one-block kernel's warps, with its steps) and a producer warpgroup after them, of which one warp
// works. Grid: (at most one block per SM). Work items are flash_bwd_dkdv_tc_kernel's blocks in its
// launch order: `positions` key tiles (block-sparse: in key_block_order) fastest, then K/V heads,
// then batch; `items` in all. Block b makes claim b first, then the next unclaimed one
// (DkdvCounters' next_item: it counts the claims); claim c is item c, or block-sparse
// item_order[c] where the host gives an order (BlockMask.dkdv_item_order: columns far longer than
// the median's first; only with ring = 0, whose slabs need not complete in turn). With ring > 0
// the dQ adds go to a ring of `ring` slabs (params.dq_accum, zero at launch and left zero at
// exit; wait_for_slot), rounded into dq here (load_dq_boxes), slab by slab as each slab's items
// complete: no preprocess clear, no conversion launch. With ring = 0 they go to the whole
// workspace (dq_accum_offset's layout), cleared before and rounded after, as the one-block
// kernel's do.
//   producer: claims and decodes items, walks each item's query blocks (every head of its K/V
//     head's group, each from its launch position's query block, as the one-block kernel), asks
//     the TMA for K_j, V_j into their one buffer once the consumers are done with the last item's
//     (`kv` barriers), and for Q_i, dO_i into the free one of two buffers, whose row statistics its
//     lanes load (`q` barriers); it passes each item's indices and each buffer's query block in
//     shared memory, written before the arrival that completes the phase the consumers wait for.
//   consumers: wait for the item's ring slot where the producer found it in use (wait_for_slot),
//     then per step wait for the buffer, run dkdv_consumer_step, hand the buffer back; after an
//     item's last step hand K_j, V_j back, then write dK_j, dV_j out through the dQ stages while
//     the next item's tiles land; each warpgroup's storing thread counts the item complete in its
//     slab once its dQ adds have landed (count_item_complete).
//   the producer warpgroup's other warps: round dQ (load_dq_boxes) while the consumers work.
// A key block's loads no longer wait behind its own launch and the last one's stores, and its
// index loads stall only the producer.
template <typename Bt, bool kIsLocal, bool kIsBlockSparse>
__global__ void __launch_bounds__(Bt::kNThreads + 128, 1)
    flash_bwd_dkdv_ws_kernel(const BwdParams params, const __grid_constant__ BwdTensorMaps maps,
                             const __grid_constant__ KvTensorMaps kv_maps, const int positions, const int items,
                             int* const counter_buffer, const int ring, const int* const item_order) {
    static_assert(Bt::kWgmma && Bt::kOutSplit == 1 && Bt::kNThreads == 256, "the Hopper TMA builds' two warpgroups");
    static_assert(Bt::kBlockM % 32 == 0, "the producer's lanes load the row statistics");
    using Storage = typename Bt::Storage;
    static_assert(2 * Bt::kBlockN * Bt::kHeadDim * 2 <= 2 * Bt::kWarpgroups * Bt::kDqShareBytes,
                  "dK_j and dV_j are staged in the dQ stages");
    constexpr int kConsumerWarps = Bt::kNThreads / 32;
    constexpr int kConsumerBarrier = 3;  // (1 and 2: add_dq_shares_wgmma's, one per warpgroup)
    // setmaxnreg's split of the registers a thread has at launch (launch_registers: 168): the
    // consumers' share is what their steps need without spilling, at d128 outside the local builds
    // 232 (224 spilled 36 bytes), and the producer keeps the rest (at 40 the block-sparse d64
    // builds spilled 60-68 bytes).
    constexpr int kConsumerRegs = Bt::kHeadDim == 128 && !kIsLocal ? 232 : 224;
    constexpr int kProducerRegs = 3 * launch_registers(Bt::kNThreads + 128) - 2 * kConsumerRegs;
    extern __shared__ __align__(16) unsigned char smem[];
    const DkdvTiles s = dkdv_tiles<Bt>(smem);
    // kv: K_j, V_j landed (the producer's two arrivals, before and after its slot lookup, and the
    // bytes) / read (one arrival per consumer warp); q[b]: Q_i, dO_i and row statistics in buffer
    // b, likewise (the producer arrives twice: with the tiles' bytes, then once its lanes have
    // stored the statistics).
    __shared__ alignas(8) unsigned long long kv_barriers[2], q_barriers[2][2];
    // Two items' indices, alternately (a slot is rewritten once the consumers are done with the
    // next item's steps, and so with this one's stores): first key (-1: no more items), K/V head,
    // batch index, steps, whether its ring slot was free. And each Q_i buffer's first query and head.
    enum { kKey0, kKvHead, kBatch, kSteps, kSlotReady, kItemFields };
    __shared__ int item_of[2][kItemFields], query_of[2][2];
    // box[b]: dQ box buffer b landed (the loading thread's arrival and the bytes) / rounded (one
    // arrival per rounding warp); box_of: its coordinates (load_dq_boxes).
    __shared__ alignas(8) unsigned long long box_barriers[2][2];
    __shared__ int box_of[2][kBoxFields];
    __shared__ long long box_at[2][2];
    if (threadIdx.x == 0) {
        mbarrier_init(smem_address(&kv_barriers[0]), 2);
        mbarrier_init(smem_address(&kv_barriers[1]), kConsumerWarps);
        for (int b = 0; b < 2; ++b) {
            mbarrier_init(smem_address(&q_barriers[b][0]), 2);
            mbarrier_init(smem_address(&q_barriers[b][1]), kConsumerWarps);
            mbarrier_init(smem_address(&box_barriers[b][0]), 1);
            mbarrier_init(smem_address(&box_barriers[b][1]), kRoundingWarps);
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the last block-wide barrier: the roles part here

    const int slabs = items / positions;
    const DkdvCounters counters{counter_buffer, slabs};
    if (threadIdx.x >= Bt::kNThreads) {
        setmaxnreg_dec<kProducerRegs>();
        // The other three warps round dQ: one thread of the second loads the boxes, the last two round them.
        if (threadIdx.x >= Bt::kNThreads + 64) {
            round_dq_boxes<Bt>(params, counters, ring, s.sRound, box_barriers, box_of, box_at,
                               threadIdx.x - Bt::kNThreads - 64);
            return;
        }
        if (threadIdx.x >= Bt::kNThreads + 32) {
            if (threadIdx.x == Bt::kNThreads + 32)
                load_dq_boxes<Bt>(params, maps.dq, counters, ring, Bt::kWarpgroups * positions, s.sRound, box_barriers,
                                  box_of, box_at);
            return;
        }
        const int lane = threadIdx.x % 32;
        const int kv_heads = params.heads / params.kv_group;
        // The empty barriers' phases start "completed" for the producer: it waits on the parity
        // before the current one (phase ^ 1), which a fresh mbarrier reports as done.
        unsigned kv_phase = 0, q_phase = 0;
        int q_buffer = 0, slot = 0;
        for (int claim = blockIdx.x;;) {
            const bool last = claim >= items;  // (no more items: the consumers are told to leave)
            const int item = !last && kIsBlockSparse && item_order ? item_order[claim] : claim;
            const int position = last ? 0 : item % positions, kv_head = last ? 0 : item / positions % kv_heads;
            const int batch_idx = last ? 0 : item / positions / kv_heads;
            const int first_head = kv_head * params.kv_group;
            const int key0 = last ? -1
                                  : key_tile<Bt::kBlockN, kIsBlockSparse>(params, batch_idx, first_head, position) *
                                        Bt::kBlockN;
            if (key0 < params.seqlen_k) {  // (the launch's rounding up to whole mask blocks: nothing)
                const int keys_valid = min(Bt::kBlockN, params.seqlen_k - key0);
                int steps = 0;
                for (int head_idx = first_head; key0 >= 0 && head_idx < first_head + params.kv_group; ++head_idx) {
                    const auto query_blocks = query_tiles<Bt::kBlockM, kIsLocal, kIsBlockSparse>(
                        params, batch_idx, head_idx, key0, keys_valid);
                    steps += query_blocks.end - query_blocks.begin;
                }
                // Whether the item's ring slot is free, looked up while the consumers finish the last item.
                const bool slot_free = lane != 0 || key0 < 0 || slot_ready(counters, item / positions, ring);
                mbarrier_wait(smem_address(&kv_barriers[1]), kv_phase ^ 1);
                if (lane == 0) {
                    item_of[slot][kKey0] = key0;
                    item_of[slot][kKvHead] = kv_head;
                    item_of[slot][kBatch] = batch_idx;
                    item_of[slot][kSteps] = steps;
                    const unsigned kv_full = smem_address(&kv_barriers[0]);
                    if (key0 < 0) {
                        mbarrier_arrive(kv_full);  // no more items: the consumers leave
                    } else {
                        mbarrier_arrive_expect_tx(kv_full, 2 * Bt::row_bytes(Bt::kBlockN) * Bt::kPanels);
#pragma unroll
                        for (int panel = 0; panel < Bt::kPanels; ++panel) {
                            const unsigned offset = panel * Bt::row_bytes(Bt::kBlockN);
                            tma_load_4d(s.sK + offset, kv_maps.k, kv_full, panel * kPanelColumns, key0, kv_head,
                                        batch_idx);
                            tma_load_4d(s.sV + offset, kv_maps.v, kv_full, panel * kPanelColumns, key0, kv_head,
                                        batch_idx);
                        }
                    }
                    item_of[slot][kSlotReady] = slot_free;
                    mbarrier_arrive(kv_full);  // (the second arrival, once the slot's state is written)
                }
                kv_phase ^= 1;
                slot ^= 1;
                if (key0 < 0) return;
                for (int head_idx = first_head; head_idx < first_head + params.kv_group; ++head_idx) {
                    const auto query_blocks = query_tiles<Bt::kBlockM, kIsLocal, kIsBlockSparse>(
                        params, batch_idx, head_idx, key0, keys_valid);
                    const int m_blocks = query_blocks.end - query_blocks.begin;
                    for (int step = 0, t = first_query_tile(query_blocks, position); step < m_blocks; ++step) {
                        const int q_row0 = query_blocks[t] * Bt::kBlockM;
                        t = t + 1 < query_blocks.end ? t + 1 : query_blocks.begin;
                        mbarrier_wait(smem_address(&q_barriers[q_buffer][1]), q_phase ^ 1);
                        // Q_i, dO_i first, then their statistics: two arrivals complete the phase.
                        const unsigned q_full = smem_address(&q_barriers[q_buffer][0]);
                        if (lane == 0) {
                            mbarrier_arrive_expect_tx(q_full, 2 * Bt::kQueryTileBytes);
#pragma unroll
                            for (int panel = 0; panel < Bt::kPanels; ++panel) {
                                const unsigned offset =
                                    q_buffer * Bt::kQueryTileBytes + panel * Bt::row_bytes(Bt::kBlockM);
                                tma_load_4d(s.sQ + offset, maps.q, q_full, panel * kPanelColumns, q_row0, head_idx,
                                            batch_idx);
                                tma_load_4d(s.sdO + offset, maps.dout, q_full, panel * kPanelColumns, q_row0, head_idx,
                                            batch_idx);
                            }
                        }
                        // Rows past seqlen_q get lse = +inf, so their P_ij are exactly 0. Every load
                        // is asked for before the first store: one round trip to L2 a step, not one
                        // per 32 rows.
                        const int rows_valid = min(Bt::kBlockM, params.seqlen_q - q_row0);
                        const long long row_stats = row_vector_offset(params, batch_idx, head_idx) + q_row0;
                        constexpr int kRowsPerLane = Bt::kBlockM / 32;
                        float lse2[kRowsPerLane], d[kRowsPerLane];
#pragma unroll
                        for (int r = 0; r < kRowsPerLane; ++r) {
                            const int i = lane + 32 * r;
                            lse2[r] = i < rows_valid ? static_cast<const float*>(params.lse_log2)[row_stats + i]
                                                     : pos_inf<float>();
                            d[r] = i < rows_valid ? static_cast<const float*>(params.d)[row_stats + i] : 0.f;
                        }
#pragma unroll
                        for (int r = 0; r < kRowsPerLane; ++r) {
                            s.sLse2[q_buffer * Bt::kBlockM + lane + 32 * r] = lse2[r];
                            s.sD[q_buffer * Bt::kBlockM + lane + 32 * r] = d[r];
                        }
                        __syncwarp();  // the lanes' statistics, before lane 0's arrival releases them
                        if (lane == 0) {
                            query_of[q_buffer][0] = q_row0;
                            query_of[q_buffer][1] = head_idx;
                            mbarrier_arrive(q_full);
                        }
                        if (++q_buffer == 2) q_buffer = 0, q_phase ^= 1;
                    }
                }
            } else if (lane == 0 && ring) {
                add_release(counters.slab_done(item / positions), Bt::kWarpgroups);  // (no adds to wait for)
            }
            // The next item: every item makes one claim, and the launch's last sets the counter back
            // to zero, so that a launch replayed (a CUDA graph, a benchmark) starts as a fresh one does.
            int claims = 0;
            if (lane == 0 && !last) {
                claims = atomicAdd(counters.next_item(), 1);
                if (claims == items - 1) *counters.next_item() = 0;
            }
            claim = last ? claim : gridDim.x + __shfl_sync(0xffffffffu, claims, 0);
        }
    }

    setmaxnreg_inc<kConsumerRegs>();
    unsigned kv_phase = 0, q_phase = 0;
    int q_buffer = 0, slot = 0, dq_stage = 0;
    const int kv_heads = params.heads / params.kv_group;
    int pending = -1;  // the last item's slab, not yet counted complete (-1: none)
    for (;;) {
        mbarrier_wait(smem_address(&kv_barriers[0]), kv_phase);
        kv_phase ^= 1;
        const int* const item = item_of[slot];
        slot ^= 1;
        const int key0 = item[kKey0];
        if (key0 < 0) break;
        float dV[Bt::kMTiles][Bt::kOutTiles][4], dK[Bt::kMTiles][Bt::kOutTiles][4];
        zero(dV);
        zero(dK);
        const int steps = item[kSteps], slab = item[kKvHead] + item[kBatch] * kv_heads;
        // A query head's coordinate in the ring's map is ring_head + its index (wait_for_slot).
        const int ring_head = ring ? (slab % ring - item[kKvHead]) * params.kv_group : 0;
        if (!item[kSlotReady]) {  // (every consumer thread reads alike)
            if (threadIdx.x % 128 == 0) {
                count_item_complete(counters, pending);
                wait_for_slot(counters, slab, ring);
            }
            pending = -1;
        }
        for (int step = 0; step < steps; ++step) {
            mbarrier_wait(smem_address(&q_barriers[q_buffer][0]), q_phase);
            // Every consumer warp is done with the last step's dS^T and dQ stage.
            named_barrier_sync(kConsumerBarrier, Bt::kNThreads);
            dkdv_consumer_step<Bt, kIsLocal>(params, maps, s, key0, min(Bt::kBlockN, params.seqlen_k - key0),
                                             query_of[q_buffer][0], ring_head + query_of[q_buffer][1],
                                             ring ? 0 : item[kBatch], q_buffer, dK, dV, dq_stage, kConsumerBarrier);
            __syncwarp();
            if (threadIdx.x % 32 == 0) mbarrier_arrive(smem_address(&q_barriers[q_buffer][1]));
            if (++q_buffer == 2) q_buffer = 0, q_phase ^= 1;
        }
        // The item's products are done with K_j, V_j; the dQ stages are free once the TMA has read them.
        __syncwarp();
        if (threadIdx.x % 32 == 0) mbarrier_arrive(smem_address(&kv_barriers[1]));
        // The last item's adds have landed once all but this item's newest bulk group have; then a
        // thread with no copy of its own in flight counts it (a release waits for the thread's
        // outstanding writes: in the storing thread it held the warpgroup, item after item).
        if (threadIdx.x % 128 == 0) {
            bulk_wait_group_read<0>();
            if (pending >= 0) {
                if (steps > 0)
                    bulk_wait_group<1>();
                else
                    bulk_wait_group<0>();
                fence_proxy_async_global();
            }
        }
        named_barrier_sync(kConsumerBarrier, Bt::kNThreads);
        if (threadIdx.x % 128 == 32 && pending >= 0) add_release(counters.slab_done(pending), 1);
        pending = ring ? slab : -1;
        // dK_j and dV_j go out through the dQ stages as whole row chunks, as the one-block kernel's
        // through K_j and V_j.
        const int warp_key0 = key0 + threadIdx.x / 32 * Bt::kWarpKeys;
        Storage* dk = static_cast<Storage*>(params.dk) + item[kBatch] * params.dk_batch_stride +
                      item[kKvHead] * params.dk_head_stride + warp_key0 * params.dk_row_stride;
        Storage* dv = static_cast<Storage*>(params.dv) + item[kBatch] * params.dv_batch_stride +
                      item[kKvHead] * params.dv_head_stride + warp_key0 * params.dv_row_stride;
        const Fragment f(threadIdx.x % 32);
        store_rows_staged<Bt, Bt::kBlockN>(dk, params.dk_row_stride, params.seqlen_k - warp_key0, params.head_dim, dK,
                                           s.sDq, warp_key0 - key0, f, threadIdx.x % 32,
                                           static_cast<float>(params.scale));
        store_rows_staged<Bt, Bt::kBlockN>(dv, params.dv_row_stride, params.seqlen_k - warp_key0, params.head_dim, dV,
                                           s.sDq + Bt::kBlockN * Bt::kHeadDim * 2, warp_key0 - key0, f,
                                           threadIdx.x % 32);
    }
    if (threadIdx.x % 128 == 0) count_item_complete(counters, pending);
}

// Grid: (ceil(seqlen_q / kBlockM) · kOutSplit, heads, batch). Block: Dt::kNThreads.
// Shared memory: Dt::kSmemBytes.
template <typename Dt, bool kIsLocal, bool kIsBlockSparse, bool kScoreMod = false, bool kVarlen = false>
__global__ void __launch_bounds__(Dt::kNThreads, Dt::kMinBlocksPerSm) flash_bwd_dq_tc_kernel(const BwdParams launch_params) {
    using Storage = typename Dt::Storage;
    using Op = typename Dt::Op;
    constexpr int kOutTiles = Dt::kHeadDimOut / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned sQ = smem_address(smem) + Dt::kSmemQOffset * 2;    // Q_i [kBlockM][kStride]
    const unsigned sdO = smem_address(smem) + Dt::kSmemDoOffset * 2;  // dO_i [kBlockM][kStride]
    const unsigned sK = smem_address(smem) + Dt::kSmemKOffset * 2;    // K_j [2][kBlockN][kStride]
    const unsigned sV = smem_address(smem) + Dt::kSmemVOffset * 2;    // V_j [2][kBlockN][kStride]

    const int m_block = (kIsLocal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) / Dt::kOutSplit;  // long rows first
    const int col_out0 = blockIdx.x % Dt::kOutSplit * Dt::kHeadDimOut;
    const int head_idx = blockIdx.y, batch_idx = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Fragment f(lane);
    const int row0 = m_block * Dt::kBlockM;
    int q_batch, k_batch;
    const BwdParams params = sequence_params<kVarlen>(launch_params, batch_idx, q_batch, k_batch);
    if (kVarlen && row0 >= params.seqlen_q) return;  // past this sequence's end
    const int rows_valid = min(Dt::kBlockM, params.seqlen_q - row0);
    const int warp_row0 = row0 + warp * Dt::kWarpRows;

    const auto key_blocks = key_tiles<Dt::kBlockN, kIsLocal, kIsBlockSparse>(params, batch_idx, head_idx, row0, rows_valid);
    const int kv_head = head_idx / params.kv_group;

    const Storage* q = static_cast<const Storage*>(params.q) + q_batch * params.q_batch_stride +
                       head_idx * params.q_head_stride + row0 * params.q_row_stride;
    const Storage* dout = static_cast<const Storage*>(params.dout) + q_batch * params.dout_batch_stride +
                          head_idx * params.dout_head_stride + row0 * params.dout_row_stride;
    const Storage* k = static_cast<const Storage*>(params.k) + k_batch * params.k_batch_stride +
                       kv_head * params.k_head_stride;
    const Storage* v = static_cast<const Storage*>(params.v) + k_batch * params.v_batch_stride +
                       kv_head * params.v_head_stride;

    // This thread's rows' lse_i·log2(e) and D_i; rows past seqlen_q get P = 0 (lse = +inf).
    float lse2[Dt::kMTiles][2], d_i[Dt::kMTiles][2];
    const long long row_stats = row_vector_offset(params, q_batch, head_idx);
#pragma unroll
    for (int mt = 0; mt < Dt::kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp_row0 + f.row(mt, h);
            const bool valid = row < params.seqlen_q;
            lse2[mt][h] = valid ? static_cast<const float*>(params.lse_log2)[row_stats + row] : pos_inf<float>();
            d_i[mt][h] = valid ? static_cast<const float*>(params.d)[row_stats + row] : 0.f;
        }

    // Block-sparse, n_block carries the next tile's index, read an iteration ahead so that its
    // load hides under a tile's work. (Dense, the tiles are numbered as before block-sparse
    // attention existed: the same meaning, but NVRTC schedules the loop differently otherwise.)
    int n_block = key_blocks.begin < key_blocks.end ? key_blocks[key_blocks.begin] : 0;
    if (key_blocks.begin < key_blocks.end) {
        const int first = kIsBlockSparse || kIsLocal ? n_block * Dt::kBlockN : 0;
        const int first_valid = min(Dt::kBlockN, params.seqlen_k - first);
        load_tile_async<Dt, Dt::kBlockM>(sQ, q, params.q_row_stride, rows_valid, params.head_dim);
        load_tile_async<Dt, Dt::kBlockM>(sdO, dout, params.dout_row_stride, rows_valid, params.head_dim);
        load_tile_async<Dt, Dt::kBlockN>(sK, k + first * params.k_row_stride, params.k_row_stride, first_valid,
                                         params.head_dim);
        load_tile_async<Dt, Dt::kBlockN>(sV, v + first * params.v_row_stride, params.v_row_stride, first_valid,
                                         params.head_dim);
        cp_async_commit();
    }

    float dQ[Dt::kMTiles][kOutTiles][4];
    zero(dQ);
    const float scale_log2 = static_cast<float>(params.scale_log2);
    const auto mod = score_mod<kScoreMod, float>(params, batch_idx, head_idx);
    const auto dropout = dropout_for<kScoreMod>(params, batch_idx, head_idx);
    const unsigned sQ_warp = sQ + warp * Dt::kWarpRows * Dt::kStride * 2;
    const unsigned sdO_warp = sdO + warp * Dt::kWarpRows * Dt::kStride * 2;

    for (int t = key_blocks.begin; t < key_blocks.end; ++t) {
        const int buf = (kIsBlockSparse || kIsLocal ? t - key_blocks.begin : t) % 2;  // the first tile in buffer 0
        const int col0 = (kIsBlockSparse ? n_block : t) * Dt::kBlockN;
        if (kIsBlockSparse && t + 1 < key_blocks.end) n_block = key_blocks[t + 1];
        const int keys_valid = min(Dt::kBlockN, params.seqlen_k - col0);
        const unsigned sK_j = sK + buf * Dt::kBlockN * Dt::kStride * 2;
        const unsigned sV_j = sV + buf * Dt::kBlockN * Dt::kStride * 2;
        cp_async_wait<0>();
        __syncthreads();  // K_j, V_j (and Q_i, dO_i) have landed; every warp is done with the other buffers
        if (t + 1 < key_blocks.end) {
            const int next = kIsBlockSparse ? n_block * Dt::kBlockN : col0 + Dt::kBlockN;
            const int next_valid = min(Dt::kBlockN, params.seqlen_k - next);
            load_tile_async<Dt, Dt::kBlockN>(sK + (1 - buf) * Dt::kBlockN * Dt::kStride * 2, k + next * params.k_row_stride,
                                             params.k_row_stride, next_valid, params.head_dim);
            load_tile_async<Dt, Dt::kBlockN>(sV + (1 - buf) * Dt::kBlockN * Dt::kStride * 2, v + next * params.v_row_stride,
                                             params.v_row_stride, next_valid, params.head_dim);
        }
        cp_async_commit();

        float S[Dt::kMTiles][Dt::kNTiles][4], dP[Dt::kMTiles][Dt::kNTiles][4];
        zero(S);
        gemm_abt_ss<Op, Dt::kMTiles, Dt::kNTiles, Dt::kKSteps, Dt::kStride, Dt::kStride>(S, sQ_warp, sK_j, lane);
        if (keys_valid < Dt::kBlockN || (kIsLocal && band_cuts(params, row0, rows_valid, col0, keys_valid)))
            mask_fragments<kIsLocal, false>(S, warp_row0, col0, params, f);
        zero(dP);
        gemm_abt_ss<Op, Dt::kMTiles, Dt::kNTiles, Dt::kKSteps, Dt::kStride, Dt::kStride>(dP, sdO_warp, sV_j, lane);
        // dS_ij = P_ij ∘ (dP_ij - D_i), P_ij = exp2(S·scale·log2(e) - lse_i·log2(e)), in place in dP.
        if constexpr (kScoreMod) {  // P_ij of the modified scores, dS_ij times the modifier's derivative
            // S becomes P ∘ dx (>= 0), negated where dropout drops (as in the dK/dV kernel).
            const float offset0 = mod.offset(warp_row0 + f.row(0, 0), col0 + f.col(0, 0));
            const auto modified_probabilities = [&](auto softcap) {
                constexpr bool kSoftcap = decltype(softcap)::value;
#pragma unroll
                for (int mt = 0; mt < Dt::kMTiles; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int nt = 0; nt < Dt::kNTiles; ++nt)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const float offset = offset0 + static_cast<float>(16 * mt + 8 * h - 8 * nt - e);
                                float dx;
                                const float x = mod.template apply_at<true, kSoftcap>(S[mt][nt][2 * h + e] * scale_log2,
                                                                                      fabsf(offset), dx);
                                S[mt][nt][2 * h + e] = exp2f(x - lse2[mt][h]) * dx;
                            }
            };
            if (mod.softcap())
                modified_probabilities(BoolConstant<true>());
            else
                modified_probabilities(BoolConstant<false>());
            if (dropout.active())
                for_dropped<false, Dt::kMTiles, Dt::kNTiles>(dropout, warp_row0, col0, f,
                                                             [&](int mt, int nt, int i) { S[mt][nt][i] = -S[mt][nt][i]; });
#pragma unroll
            for (int mt = 0; mt < Dt::kMTiles; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int nt = 0; nt < Dt::kNTiles; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float p = S[mt][nt][2 * h + e];
                            dP[mt][nt][2 * h + e] = p * (p >= 0.f ? dP[mt][nt][2 * h + e] - d_i[mt][h] : d_i[mt][h]);
                        }
        } else {
#pragma unroll
            for (int mt = 0; mt < Dt::kMTiles; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int nt = 0; nt < Dt::kNTiles; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float p = exp2f(fmaf(S[mt][nt][2 * h + e], scale_log2, -lse2[mt][h]));
                            dP[mt][nt][2 * h + e] = p * (dP[mt][nt][2 * h + e] - d_i[mt][h]);
                        }
        }
        unsigned dS[Dt::kMTiles][Dt::kNTiles / 2][4];
        to_a_fragments<Op>(dP, dS);
        gemm_ab_rs<Op, Dt::kMTiles, kOutTiles, Dt::kNTiles / 2, Dt::kStride>(dQ, dS, sK_j + col_out0 * 2, lane);
    }
    cp_async_wait<0>();

    Storage* dq = static_cast<Storage*>(params.dq) + q_batch * params.dq_batch_stride +
                  head_idx * params.dq_head_stride + warp_row0 * params.dq_row_stride + col_out0;
    store_fragments<typename Dt::Element>(dq, params.dq_row_stride, params.seqlen_q - warp_row0, params.head_dim - col_out0,
                                          dQ, static_cast<float>(dropout_scaled<kScoreMod>(params, params.scale)), f);
}

}  // namespace cupyflash
