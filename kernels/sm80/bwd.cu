// Attention backward on tensor cores with mma.sync (float16 / bfloat16, sm_80 and newer; the dK/dV
// kernel also float64 on the FP64 tensor cores, sm80/gemm.cuh's DMMA products, where P^T and dS^T
// stay unrounded): FlashAttention-2, Algorithm 2, with float32 accumulation (float64 for float64).
// Same schedule as the scalar
// scalar/bwd.cu, whose row passes (rows/bwd_rows.cu) it shares:
//   flash_bwd_dkdv_sm80_kernel: one block per key block; its warps form a keys x queries grid
//     (TcBwdDkdvTraits), so S_ij^T = K_j Q_i^T, P^T = exp2(S^T·scale·log2(e) - lse_i),
//     dP^T = V_j dO_i^T and dS^T = P^T ∘ (dP^T - D_i) come out with keys as rows, as the A operands
//     of dV_j += P^T dO_i and dK_j += dS^T Q_i (rounded to the input type, as FlashAttention-2
//     does). A warp's own share of P^T and dS^T feeds those products from registers, the other
//     warps' shares through shared memory; dQ_i += dS_ij K_j goes through dS^T in shared memory
//     and float32 atomics.
//   flash_bwd_dq_sm80_kernel (deterministic mode, on every tensor-core GPU): one block per query
//     block, recomputes P_ij and dP_ij and sums dQ_i over the key blocks in a fixed order, with no
//     atomics.
#include "sm80/traits.cuh"
#include "tc/bwd_steps.cuh"
#include "sm80/gemm.cuh"

namespace cupyflash {

// C += A^T B over the queries of the other warps in this warp's row of the grid: dV_j += P^T dO_i
// or dK_j += dS^T Q_i, with A^T the [keys][queries] tile those warps wrote (sAt_warp: at this
// warp's first key) and B = dO_i or Q_i (sB: its tile).
template <typename Bt, int kNTiles, typename T>
__device__ __forceinline__ void mma_other_queries(T (&C)[Bt::kMTiles][kNTiles][4], unsigned sAt_warp, unsigned sB,
                                                  int wq, int warp_cols, int lane) {
    constexpr int kSize = Bt::kSize;
#pragma unroll
    for (int other = 1; other < Bt::kWarpsQ; ++other) {
        const int queries = (wq + other) % Bt::kWarpsQ * Bt::kWarpQueries;
        if constexpr (Bt::kF64)
            gemm_ab_ss_f64<typename Bt::Op, false, Bt::kMTiles, kNTiles, Bt::kWarpQueries / 16, Bt::kPStride, Bt::kStride>(
                C, sAt_warp + queries * kSize, sB + (queries * Bt::kStride + warp_cols) * kSize, Fragment(lane));
        else
            gemm_ab_ss<typename Bt::Op, false, Bt::kMTiles, kNTiles, Bt::kWarpQueries / 16, Bt::kPStride, Bt::kStride>(
                C, sAt_warp + queries * kSize, sB + (queries * Bt::kStride + warp_cols) * kSize, lane);
    }
}

// dQ_i += scale · dS_ij K_j (atomic mode; kRescale: times dropout's 1 / (1 - p)) from dS^T in
// shared memory: this warp's share of the
// kBlockM x kHeadDimOut tile (TcBwdDkdvTraits::kDqWarpsM x kDqWarpsN), added to the float32
// (float64) workspace with atomics, kDqChunk columns at a time (a whole row slice of dQ_i would sit
// in registers beside dK_j and dV_j).
template <typename Bt, bool kRescale = false>
__device__ __forceinline__ void add_dq_share(const BwdParams& params, unsigned sdSt, unsigned sK, int q_row0,
                                             int col_out0, int batch_idx, int head_idx, int warp, int lane) {
    using Accum = typename Bt::Accum;
    constexpr int kSize = Bt::kSize;
    const int wm = warp % Bt::kDqWarpsM, wn = warp / Bt::kDqWarpsM;
    if (wn >= Bt::kDqWarpsN) return;
    const int dq_row0 = q_row0 + wm * Bt::kDqMTiles * 16, dq_col0 = col_out0 + wn * Bt::kDqCols;
    const long long dq_row_stride = static_cast<long long>(params.heads) * params.head_dim;
    Accum* dq_accum = static_cast<Accum*>(params.dq_accum) + dq_accum_offset(params, batch_idx, dq_row0, head_idx) +
                      dq_col0;
    constexpr int kChunk = Bt::kDqChunk;
#pragma unroll 1
    for (int c = 0; c < Bt::kDqCols; c += kChunk) {
        Accum dQ[Bt::kDqMTiles][kChunk / 8][4];
        zero(dQ);
        if constexpr (Bt::kF64)
            gemm_ab_ss_f64<typename Bt::Op, true, Bt::kDqMTiles, kChunk / 8, Bt::kBlockN / 16, Bt::kPStride, Bt::kStride>(
                dQ, sdSt + wm * Bt::kDqMTiles * 16 * kSize, sK + (dq_col0 + c) * kSize, Fragment(lane));
        else
            gemm_ab_ss<typename Bt::Op, true, Bt::kDqMTiles, kChunk / 8, Bt::kBlockN / 16, Bt::kPStride, Bt::kStride>(
                dQ, sdSt + wm * Bt::kDqMTiles * 16 * kSize, sK + (dq_col0 + c) * kSize, lane);
        if constexpr (kRescale)
            atomic_add_fragments(dq_accum + c, dq_row_stride, params.seqlen_q - dq_row0, params.head_dim - dq_col0 - c,
                                 dQ, static_cast<Accum>(params.scale * params.dropout_rescale), Fragment(lane));
        else
            atomic_add_fragments(dq_accum + c, dq_row_stride, params.seqlen_q - dq_row0, params.head_dim - dq_col0 - c,
                                 dQ, static_cast<Accum>(params.scale), Fragment(lane));
    }
}

// Grid: (ceil(seqlen_k / kBlockN) · kOutSplit, K/V heads, batch), block-sparse with seqlen_k rounded up
// to the mask's key blocks (key_tile). Block: Bt::kNThreads.
// Shared memory: Bt::kSmemBytes. With GQA/MQA the block walks the query blocks of each query head
// of its K/V head's group in turn (as the scalar kernel): dK_j, dV_j sum over the group on chip.
// kScoreMod: softcap, ALiBi and dropout, as in the forward (instantiated with kIsLocal only);
// kVarlen: a variable-length batch, as in the forward.
template <typename Bt, bool kIsLocal, bool kIsBlockSparse, bool kScoreMod = false, bool kVarlen = false>
__global__ void __launch_bounds__(Bt::kNThreads, Bt::kMinBlocksPerSm)
    flash_bwd_dkdv_sm80_kernel(const BwdParams launch_params) {
    using Storage = typename Bt::Storage;
    using Accum = typename Bt::Accum;
    using Op = typename Bt::Op;
    constexpr int kStride = Bt::kStride, kPStride = Bt::kPStride, kSize = Bt::kSize;
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned tiles = Bt::tile_base(smem_address(smem));
    unsigned char* const smem_tiles = smem + (tiles - smem_address(smem));
    const unsigned sK = tiles + Bt::kSmemKOffset * kSize;     // K_j [kBlockN][kStride]
    const unsigned sV = tiles + Bt::kSmemVOffset * kSize;     // V_j [kBlockN][kStride]
    const unsigned sQ = tiles + Bt::kSmemQOffset * kSize;     // Q_i [2][kBlockM][kStride]
    const unsigned sdO = tiles + Bt::kSmemDoOffset * kSize;   // dO_i [kBlockM][kStride]
    const unsigned sPt = tiles + Bt::kSmemPOffset * kSize;    // P_ij^T [kBlockN][kPStride]
    const unsigned sdSt = tiles + Bt::kSmemDsOffset * kSize;  // dS_ij^T [kBlockN][kPStride]
    Accum* sLse2 = reinterpret_cast<Accum*>(smem_tiles + Bt::kSmemRowStatsOffset);  // [2][kBlockM]
    Accum* sD = sLse2 + 2 * Bt::kBlockM;                                      // [2][kBlockM]

    const int kv_head = blockIdx.y, batch_idx = blockIdx.z;
    // The key blocks in index order (the mask's key_order unread): these builds sit at 254-255
    // registers, and holding a loaded key tile (blockIdx's is formed again at no register's cost)
    // spilled 8 bytes in two of them, or 12-20 in another with the tile kept in shared memory.
    const int n_block = key_tile<Bt::kBlockN, false>(launch_params, batch_idx, kv_head * launch_params.kv_group,
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

    Accum dV[Bt::kMTiles][Bt::kOutTiles][4], dK[Bt::kMTiles][Bt::kOutTiles][4];
    zero(dV);
    zero(dK);
    const Accum scale_log2 = static_cast<Accum>(params.scale_log2);
    const unsigned sK_warp = sK + warp_keys * kStride * kSize, sV_warp = sV + warp_keys * kStride * kSize;
    const unsigned sPt_warp = sPt + warp_keys * kPStride * kSize, sdSt_warp = sdSt + warp_keys * kPStride * kSize;

    const int first_head = kv_head * params.kv_group;
    for (int head_idx = first_head; head_idx < first_head + params.kv_group; ++head_idx) {
        const auto mod = score_mod<kScoreMod, Accum>(params, batch_idx, head_idx);
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
            load_query_block<Bt>(params, sQ, sLse2, sD, q_batch, head_idx, query_blocks[t] * Bt::kBlockM);
            load_dout_block<Bt>(params, sdO, q_batch, head_idx, query_blocks[t] * Bt::kBlockM);
        }
        cp_async_commit();

        for (int step = 0; step < m_blocks; ++step, t = after(t)) {
            const int buf = step % 2;
            const int q_row0 = query_blocks[t] * Bt::kBlockM;
            const bool has_next = step + 1 < m_blocks;
            const int next_row0 = query_blocks[after(t)] * Bt::kBlockM;
            const unsigned sQ_i = sQ + buf * Bt::kQueryTileBytes;
            const Accum* sLse2_i = sLse2 + buf * Bt::kBlockM;
            const Accum* sD_i = sD + buf * Bt::kBlockM;
            // Q_i, dO_i have landed; every warp is done with the last step's tiles.
            tiles_landed<Bt>();
            const unsigned sdO_i = sdO + (Bt::kDoBuffers == 2 ? buf : 0) * Bt::kQueryTileBytes;
            if (has_next) {
                load_query_block<Bt>(params, sQ + (1 - buf) * Bt::kQueryTileBytes, sLse2 + (1 - buf) * Bt::kBlockM,
                                     sD + (1 - buf) * Bt::kBlockM, q_batch, head_idx, next_row0);
                if (Bt::kDoBuffers == 2)
                    load_dout_block<Bt>(params, sdO + (1 - buf) * Bt::kQueryTileBytes, q_batch, head_idx, next_row0);
            }
            cp_async_commit();

            // S_ij^T = K_j Q_i^T, masked, then P_ij^T = exp2(S^T·scale·log2(e) - lse_i·log2(e)).
            Accum St[Bt::kMTiles][Bt::kNTiles][4], dPt[Bt::kMTiles][Bt::kNTiles][4];
            zero(St);
            if constexpr (Bt::kF64)
                gemm_abt_ss_f64<Op, Bt::kMTiles, Bt::kNTiles, Bt::kKSteps, kStride>(
                    St, sK_warp, sQ_i + warp_queries * kStride * kSize, f);
            else
                gemm_abt_ss<Op, Bt::kMTiles, Bt::kNTiles, Bt::kKSteps, kStride, kStride>(
                    St, sK_warp, sQ_i + warp_queries * kStride * kSize, lane);
            // kScoreMod: dS's factor P^T ∘ dx (16-bit: as A fragments; float64: an accumulator tile)
            using PtDx = typename Conditional<Bt::kF64, Accum[Bt::kMTiles][Bt::kNTiles][4],
                                              unsigned[Bt::kMTiles][Bt::kNTiles / 2][4]>::type;
            PtDx Pt_dx;
            probabilities_t<Bt, kIsLocal, kScoreMod>(St, Pt_dx, params, mod, dropout, sLse2_i, scale_log2, q_row0, key0,
                                                     keys_valid, warp_keys, warp_queries, f);

            // dV_j += P^T dO_i over this warp's queries, P^T rounded to the input type as the product
            // takes it; dS below takes P^T in float32 (scores_gradient_t; with score modifiers, the
            // rounded P^T ∘ dx). float64: P^T as computed, from St.
            constexpr bool kF64 = Bt::kF64;
            unsigned Pt[kF64 ? 1 : Bt::kMTiles][Bt::kNTiles / 2][4];
            if constexpr (kF64) {
                if (Bt::kWarpsQ > 1) store_accumulators_f64<kPStride>(sPt_warp + warp_queries * kSize, St, f);
                gemm_pv_f64<Op, Bt::kMTiles, Bt::kOutTiles, Bt::kNTiles, kStride>(
                    dV, St, sdO_i + (warp_queries * kStride + warp_cols) * kSize, f);
            } else {
                to_a_fragments<Op>(St, Pt);
                if (Bt::kWarpsQ > 1) store_a_fragments<kPStride>(sPt_warp + warp_queries * kSize, Pt, f);
                gemm_ab_rs<Op, Bt::kMTiles, Bt::kOutTiles, Bt::kNTiles / 2, kStride>(
                    dV, Pt, sdO_i + (warp_queries * kStride + warp_cols) * kSize, lane);
            }

            // dP_ij^T = V_j dO_i^T, then dS_ij^T = P^T ∘ (dP^T - D_i) in place.
            zero(dPt);
            if constexpr (kF64)
                gemm_abt_ss_f64<Op, Bt::kMTiles, Bt::kNTiles, Bt::kKSteps, kStride>(
                    dPt, sV_warp, sdO_i + warp_queries * kStride * kSize, f);
            else
                gemm_abt_ss<Op, Bt::kMTiles, Bt::kNTiles, Bt::kKSteps, kStride, kStride>(
                    dPt, sV_warp, sdO_i + warp_queries * kStride * kSize, lane);
            if constexpr (kScoreMod)
                modified_scores_gradient_t<Bt>(dPt, Pt_dx, sD_i, warp_queries, f);
            else
                scores_gradient_t(dPt, St, sD_i, warp_queries, f);


            // dK_j += dS^T Q_i over this warp's queries; dS^T also goes to shared memory for dQ_i.
            if constexpr (kF64) {
                store_accumulators_f64<kPStride>(sdSt_warp + warp_queries * kSize, dPt, f);
                gemm_pv_f64<Op, Bt::kMTiles, Bt::kOutTiles, Bt::kNTiles, kStride>(
                    dK, dPt, sQ_i + (warp_queries * kStride + warp_cols) * kSize, f);
            } else {
                unsigned dSt[Bt::kMTiles][Bt::kNTiles / 2][4];
                to_a_fragments<Op>(dPt, dSt);
                store_a_fragments<kPStride>(sdSt_warp + warp_queries * kSize, dSt, f);
                gemm_ab_rs<Op, Bt::kMTiles, Bt::kOutTiles, Bt::kNTiles / 2, kStride>(
                    dK, dSt, sQ_i + (warp_queries * kStride + warp_cols) * kSize, lane);
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
            if (params.dq_accum != nullptr && dq_first)
                add_dq_share<Bt, kScoreMod>(params, sdSt, sK, q_row0, col_out0, q_batch, head_idx, warp, lane);
            if (Bt::kDoBuffers == 2) mma_other_queries<Bt>(dV, sPt_warp, sdO_i, wq, warp_cols, lane);
            mma_other_queries<Bt>(dK, sdSt_warp, sQ_i, wq, warp_cols, lane);
            if (params.dq_accum != nullptr && !dq_first)
                add_dq_share<Bt, kScoreMod>(params, sdSt, sK, q_row0, col_out0, q_batch, head_idx, warp, lane);
        }
        __syncthreads();  // every warp is done with this head's last Q_i, dO_i before the next head's land
    }
    cp_async_wait<0>();  // nothing may still be landing when the block exits

    const int warp_key0 = key0 + warp_keys;
    Storage* dk = static_cast<Storage*>(params.dk) + k_batch * params.dk_batch_stride +
                  kv_head * params.dk_head_stride + warp_key0 * params.dk_row_stride + warp_cols;
    Storage* dv = static_cast<Storage*>(params.dv) + k_batch * params.dv_batch_stride +
                  kv_head * params.dv_head_stride + warp_key0 * params.dv_row_stride + warp_cols;
    if constexpr (kScoreMod) {  // dropout's 1 / (1 - p) on both
        const Accum rescale = static_cast<Accum>(params.dropout_rescale);
        store_fragments<typename Bt::Element>(dk, params.dk_row_stride, params.seqlen_k - warp_key0,
                                              params.head_dim - warp_cols, dK,
                                              static_cast<Accum>(params.scale * params.dropout_rescale), f);
        store_fragments<typename Bt::Element>(dv, params.dv_row_stride, params.seqlen_k - warp_key0,
                                              params.head_dim - warp_cols, dV, rescale, f);
    } else {
        store_fragments<typename Bt::Element>(dk, params.dk_row_stride, params.seqlen_k - warp_key0,
                                              params.head_dim - warp_cols, dK, static_cast<Accum>(params.scale), f);
        store_fragments<typename Bt::Element>(dv, params.dv_row_stride, params.seqlen_k - warp_key0,
                                              params.head_dim - warp_cols, dV, 1, f);
    }
}

// Grid: (ceil(seqlen_q / kBlockM) · kOutSplit, heads, batch). Block: Dt::kNThreads.
// Shared memory: Dt::kSmemBytes.
template <typename Dt, bool kIsLocal, bool kIsBlockSparse, bool kScoreMod = false, bool kVarlen = false>
__global__ void __launch_bounds__(Dt::kNThreads, Dt::kMinBlocksPerSm) flash_bwd_dq_sm80_kernel(const BwdParams launch_params) {
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
                                const float x = mod.template apply_at<Tanh::kExp2, kSoftcap>(S[mt][nt][2 * h + e] * scale_log2,
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
