// Attention backward's dK/dV kernel on Hopper (float16 / bfloat16, sm_90a), one block per key block:
// FlashAttention-2's Algorithm 2 with warpgroup wgmma products, 64 keys per warpgroup: a warp holds
// 16 keys x every query of the step, so P^T and dS^T feed dV_j and dK_j whole from registers;
// products are left running while the warp computes where registers allow (kOverlap, kDpWithS). Its
// TMA builds (kTma) bring Q_i and dO_i by the TMA and hand dQ_i's float32 shares to the TMA, which
// adds them in L2 (cp.reduce.async.bulk.tensor). The row passes are rows/bwd_rows.cu's, the
// deterministic dQ kernel sm80/bwd.cu's; the warp-specialised form is sm90/bwd_dkdv_ws.cu.
#include "sm90/bwd_steps.cuh"

namespace cupyflash {

// Grid: (ceil(seqlen_k / kBlockN) · kOutSplit, K/V heads, batch), block-sparse with seqlen_k rounded up
// to the mask's key blocks (key_tile). Block: Bt::kNThreads.
// Shared memory: Bt::kSmemBytes. With GQA/MQA the block walks the query blocks of each query head
// of its K/V head's group in turn (as the scalar kernel): dK_j, dV_j sum over the group on chip.
// kScoreMod: softcap, ALiBi and dropout, as in the forward (instantiated with kIsLocal only);
// kVarlen: a variable-length batch, as in the forward. kTma (neither of those): the copy engine
// does the step's data movement through `maps` (cupyflash/runtime/tma.py; the other builds take
// them and ignore them): it brings Q_i and dO_i, one thread asking and every thread waiting on the
// buffer's mbarrier, in place of every thread's 16-byte cp.async copies and their address
// arithmetic (as the forward's K_j, V_j); and it adds dQ_i's shares into dq_accum (4-D map: head
// dim, queries, heads, batch).
template <typename Bt, bool kIsLocal, bool kIsBlockSparse, bool kScoreMod = false, bool kVarlen = false,
          bool kTma = false>
__global__ void __launch_bounds__(Bt::kNThreads, Bt::kMinBlocksPerSm)
    flash_bwd_dkdv_sm90_kernel(const BwdParams launch_params, const __grid_constant__ BwdTensorMaps maps) {
    using Storage = typename Bt::Storage;
    using Op = typename Bt::Op;
    extern __shared__ __align__(16) unsigned char smem[];
    // (The tiles' base: the first swizzle period in the block's shared memory.)
    const unsigned tiles = Bt::tile_base(smem_address(smem));
    unsigned char* const smem_tiles = smem + (tiles - smem_address(smem));
    const unsigned sK = tiles + Bt::kSmemKOffset * 2;     // K_j [kBlockN][head dim], swizzled panels
    const unsigned sV = tiles + Bt::kSmemVOffset * 2;     // V_j [kBlockN][head dim]
    const unsigned sQ = tiles + Bt::kSmemQOffset * 2;     // Q_i [2][kBlockM][head dim]
    const unsigned sdO = tiles + Bt::kSmemDoOffset * 2;   // dO_i [2][kBlockM][head dim]
    const unsigned sdSt = tiles + Bt::kSmemDsOffset * 2;  // dS_ij^T [kBlockM / 64][kBlockN][64]
    float* sLse2 = reinterpret_cast<float*>(smem_tiles + Bt::kSmemRowStatsOffset);  // [2][kBlockM]
    float* sD = sLse2 + 2 * Bt::kBlockM;                                      // [2][kBlockM]
    static_assert(!kTma || (!kScoreMod && !kVarlen), "the TMA builds: no score modifiers, not packed");
    unsigned sDq = 0;  // kTma: dQ_i's shares, [2 stages][kWarpgroups][kDqShareBytes]
    if constexpr (kTma) sDq = tiles + Bt::kDqStageOffset;
    int dq_stage = 0;

    const int kv_head = blockIdx.y, batch_idx = blockIdx.z;
    // Block-sparse, the key blocks in the mask's key_order (most query blocks first).
    const int n_block = key_tile<Bt::kBlockN, kIsBlockSparse>(launch_params, batch_idx, kv_head * launch_params.kv_group,
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

    // kOverlap leaves dV_j's and dK_j's products running while the warp goes on (waited for at
    // the end of the step), and kDpWithS issues dP^T together with S^T, so the tensor cores
    // compute it while the warp works out P^T. kDpWithS needs S^T and dP^T in registers at once:
    // taken where they are 32 each (64 queries per step); at 128 queries (64 each, d64) it
    // measured 2-7% slower than issuing dP^T after P^T. The d128 score-modifier builds hold
    // P^T ∘ dx besides and wait for each product at once (overlapped, the variable-length one
    // spilled at 255 registers).
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
                // made the d128 kernel 5-6% slower.)
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
                wgmma_tiles_landed();
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
            // With kDpWithS, dP_ij^T = V_j dO_i^T (below) is issued with it.
            float St[Bt::kMTiles][Bt::kNTiles][4], dPt[Bt::kMTiles][Bt::kNTiles][4];
            {  // this warpgroup's 64 keys against all of Q_i
                const unsigned group_rows = Bt::row_bytes(64 * (warp / 4));
                wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN, false>(St[0], sK + group_rows, sQ_i);
                if constexpr (kDpWithS)
                    wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN, false>(dPt[0], sV + group_rows, sdO_i);
                wgmma_wait<kDpWithS ? 1 : 0>();  // S^T (dP^T may still run)
                fence_operands(St[0]);
            }
            unsigned Pt_dx[Bt::kMTiles][Bt::kNTiles / 2][4];  // kScoreMod: dS's factor P^T ∘ dx
            probabilities_t<Bt, kIsLocal, kScoreMod>(St, Pt_dx, params, mod, dropout, sLse2_i, scale_log2, q_row0, key0,
                                                     keys_valid, warp_keys, warp_queries, f);

            // dV_j += P^T dO_i over this warp's queries, P^T rounded to the input type as the product
            // takes it; dS below takes P^T from that rounding and its remainders (bwd_steps.cuh's
            // p_remainders: float32 P^T spilled; with score modifiers, the rounded P^T ∘ dx).
            unsigned Pt[Bt::kMTiles][Bt::kNTiles / 2][4], Rt[Bt::kMTiles][Bt::kNTiles / 2][2];
            to_a_fragments<Op>(St, Pt);
            if constexpr (!kScoreMod) p_remainders<Op>(St, Pt, Rt);
            // kOverlap: left running while dS^T is formed
            wgmma_ab_rs<Bt, Bt::kBlockM, !kOverlap>(dV[0], Pt[0], sdO_i);

            // dP_ij^T = V_j dO_i^T, then dS_ij^T = P^T ∘ (dP^T - D_i) in place.
            if constexpr (kDpWithS) {
                wgmma_wait<1>();  // dP^T (batches complete in order; dV_j's may still run)
            } else {  // (waits for dV_j's product too)
                wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN>(dPt[0], sV + Bt::row_bytes(64 * (warp / 4)), sdO_i);
            }
            fence_operands(dPt[0]);
            if constexpr (kScoreMod)
                modified_scores_gradient_t<Bt>(dPt, Pt_dx, sD_i, warp_queries, f);
            else
                scores_gradient_t<Op>(dPt, Pt, Rt, sD_i, warp_queries, f);


            // dK_j += dS^T Q_i over this warp's queries; dS^T also goes to shared memory for dQ_i.
            unsigned dSt[Bt::kMTiles][Bt::kNTiles / 2][4];
            to_a_fragments<Op>(dPt, dSt);
            store_a_fragments_swizzled<Bt, Bt::kBlockN>(sdSt, dSt[0], warp_keys, f);
            wgmma_ab_rs<Bt, Bt::kBlockM, !kOverlap>(dK[0], dSt[0], sQ_i);  // kOverlap: waited for below
            __syncthreads();  // P^T and dS^T are complete

            // dQ_i += dS_ij K_j, and dV_j (double-buffered dO) and dK_j over the other warps'
            // queries. Half the warps add their dQ share first, half last (one of the two warps on
            // each of an SM's four schedulers, warp w and w + 4): the atomics of all warps at once
            // would queue up in the load/store unit.
            const bool dq_first = warp % 8 < 4;
            unsigned sDq_stage = 0;
            if constexpr (kTma) sDq_stage = sDq + dq_stage * Bt::kWarpgroups * Bt::kDqShareBytes;
            if (params.dq_accum != nullptr && dq_first)
                add_dq_shares_wgmma<Bt, kScoreMod, kTma>(params, maps.dq, sDq_stage, sdSt, sK, q_row0, q_batch,
                                                         head_idx, warp, lane);
            if (params.dq_accum != nullptr && !dq_first)
                add_dq_shares_wgmma<Bt, kScoreMod, kTma>(params, maps.dq, sDq_stage, sdSt, sK, q_row0, q_batch,
                                                         head_idx, warp, lane);
            dq_stage ^= 1;
            if constexpr (kOverlap) {
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
    {
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
    }
}

}  // namespace cupyflash
