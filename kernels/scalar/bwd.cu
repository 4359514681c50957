// Exact attention backward on CUDA cores: FlashAttention-2, Algorithm 2 (the row passes that come
// before and after it are rows/bwd_rows.cu):
//   flash_bwd_dkdv_kernel: one block per key block; dK_j, dV_j on chip while it walks the query
//     blocks; dQ_i summed into a float workspace with atomics (unless deterministic);
//   flash_bwd_dq_kernel (deterministic mode): one block per query block, recomputes P_ij, dP_ij
//     and sums dQ_i in a fixed order.
// The N x N matrices P and dS exist only tile by tile, in registers and shared memory.
#include "scalar/bwd_steps.cuh"

namespace cupyflash {

// Grid: (ceil(seqlen_k / kBlockN), K/V heads, batch); block-sparse: seqlen_k rounded up to the mask's
// key blocks (key_tile). Block: Bt::kNThreads. Shared memory: Bt::kSmemBytes.
// With GQA/MQA the block walks the query blocks of every query head of its K/V head's group in
// turn, so dK_j, dV_j sum over the group on chip, in a fixed order, with no K/V copy.
// kScoreMod: softcap, ALiBi and dropout, as in the forward (instantiated with kIsLocal only);
// kVarlen: a variable-length batch, as in the forward.
template <typename Bt, bool kIsLocal, bool kIsBlockSparse, bool kScoreMod = false, bool kVarlen = false>
__global__ void __launch_bounds__(Bt::kNThreads, Bt::kMinBlocksPerSm) flash_bwd_dkdv_kernel(const BwdParams launch_params) {
    using G = typename Bt::KeyGrid;     // keys x queries, keys x head dim
    using QG = typename Bt::QueryGrid;  // queries x head dim
    using Accum = typename Bt::Accum;
    using Storage = typename Bt::Storage;
    extern __shared__ __align__(16) unsigned char smem[];
    Accum* sK = reinterpret_cast<Accum*>(smem) + Bt::kSmemKOffset;
    Accum* sV = reinterpret_cast<Accum*>(smem) + Bt::kSmemVOffset;
    Accum* sQ = reinterpret_cast<Accum*>(smem) + Bt::kSmemQOffset;
    Accum* sdO = reinterpret_cast<Accum*>(smem) + Bt::kSmemdOOffset;
    Accum* sPt = reinterpret_cast<Accum*>(smem) + Bt::kSmemPtOffset;
    Accum* sdSt = reinterpret_cast<Accum*>(smem) + Bt::kSmemdStOffset;
    Accum* sdS = reinterpret_cast<Accum*>(smem) + Bt::kSmemdSOffset;
    Accum* sLse2 = reinterpret_cast<Accum*>(smem) + Bt::kSmemLseOffset;
    Accum* sD = reinterpret_cast<Accum*>(smem) + Bt::kSmemDOffset;

    const int kv_head = blockIdx.y;
    const int batch_idx = blockIdx.z;
    const int n_block = key_tile<Bt::kBlockN, kIsBlockSparse>(launch_params, batch_idx, kv_head * launch_params.kv_group,
                                                               blockIdx.x);
    const int ty = threadIdx.x / G::kColGroups;
    const int tx = threadIdx.x % G::kColGroups;
    const int col0 = n_block * Bt::kBlockN;
    int q_batch, k_batch;
    const BwdParams params = sequence_params<kVarlen>(launch_params, batch_idx, q_batch, k_batch);
    if ((kVarlen || kIsBlockSparse) && col0 >= params.seqlen_k) return;  // past this sequence's end
    const int keys_valid = min(Bt::kBlockN, params.seqlen_k - col0);
    const Accum scale_log2 = static_cast<Accum>(params.scale_log2);

    const Storage* k = static_cast<const Storage*>(params.k) + k_batch * params.k_batch_stride +
                       kv_head * params.k_head_stride + col0 * params.k_row_stride;
    const Storage* v = static_cast<const Storage*>(params.v) + k_batch * params.v_batch_stride +
                       kv_head * params.v_head_stride + col0 * params.v_row_stride;

    // K_j and V_j stay on chip for the whole loop (Algorithm 2, line 6).
    load_tile<G, Bt::kBlockN>(sK, k, params.k_row_stride, keys_valid, params.head_dim, Accum(1));
    load_tile<G, Bt::kBlockN>(sV, v, params.v_row_stride, keys_valid, params.head_dim, Accum(1));

    Accum dK[G::kRowsPerThread][G::kOColsPerThread];
    Accum dV[G::kRowsPerThread][G::kOColsPerThread];
    zero_tile<G>(dK);
    zero_tile<G>(dV);

    for (int g = 0; g < params.kv_group; ++g) {
        const int head_idx = kv_head * params.kv_group + g;
        const Storage* q = static_cast<const Storage*>(params.q) + q_batch * params.q_batch_stride +
                           head_idx * params.q_head_stride;
        const Storage* dout = static_cast<const Storage*>(params.dout) + q_batch * params.dout_batch_stride +
                              head_idx * params.dout_head_stride;
        const long long vec_offset = row_vector_offset(params, q_batch, head_idx);
        const Accum* lse_log2 = static_cast<const Accum*>(params.lse_log2) + vec_offset;
        const Accum* d = static_cast<const Accum*>(params.d) + vec_offset;
        const auto mod = score_mod<kScoreMod, Accum>(params, batch_idx, head_idx);
        const auto dropout = dropout_for<kScoreMod>(params, batch_idx, head_idx);
        // Query blocks outside this key block's band (causal: those before its diagonal) see nothing
        // of it and are skipped, as are those a block mask leaves out.
        const auto query_blocks =
            query_tiles<Bt::kBlockM, kIsLocal, kIsBlockSparse>(params, batch_idx, head_idx, col0, keys_valid);
        for (int t = query_blocks.begin; t < query_blocks.end; ++t) {
            const int row0 = query_blocks[t] * Bt::kBlockM;
            const int rows_valid = min(Bt::kBlockM, params.seqlen_q - row0);
            __syncthreads();  // every thread is done with the previous Q_i, dO_i, P^T, dS^T, dS
            // Q_i prescaled by scale·log2(e) as in the forward, so that S_ij comes out bit for bit
            // the scores the forward's lse_i was summed from (same products, same order over d):
            // P_ij then sums to 1 over the row up to lse's own rounding.
            load_tile<G, Bt::kBlockM>(sQ, q + row0 * params.q_row_stride, params.q_row_stride, rows_valid,
                                      params.head_dim, scale_log2);
            load_tile<G, Bt::kBlockM>(sdO, dout + row0 * params.dout_row_stride, params.dout_row_stride,
                                      rows_valid, params.head_dim, Accum(1));
            if (threadIdx.x < Bt::kBlockM) {
                // Padding rows get P = exp2(s - inf) = 0, so they add nothing to dV_j, dK_j or dQ.
                const bool valid = static_cast<int>(threadIdx.x) < rows_valid;
                sLse2[threadIdx.x] = valid ? lse_log2[row0 + threadIdx.x] : pos_inf<Accum>();
                sD[threadIdx.x] = valid ? d[row0 + threadIdx.x] : Accum(0);
            }
            __syncthreads();  // Q_i, dO_i, lse_i, D_i (and, first time round, K_j, V_j) are in shared memory

            // P_ij^T = exp(S_ij^T - lse_i), in base 2 (Algorithm 2, lines 9-10). kScoreMod: of the
            // modified scores, keeping the modifier's derivative dx for dS.
            Accum Pt[G::kRowsPerThread][G::kSColsPerThread];
            Accum dx[G::kRowsPerThread][G::kSColsPerThread];
            compute_scores<G>(Pt, sK, sQ, ty, tx);
            if (keys_valid < Bt::kBlockN || (kIsLocal && band_cuts(params, row0, rows_valid, col0, keys_valid))) {
                apply_mask_transposed<G, kIsLocal>(Pt, col0, row0, params, ty, tx);
            }
#pragma unroll
            for (int i = 0; i < G::kRowsPerThread; ++i)
#pragma unroll
                for (int jm = 0; jm < G::kSColsPerThread; ++jm) {
                    if constexpr (kScoreMod)
                        Pt[i][jm] = mod.template apply<Tanh::kAccurate>(Pt[i][jm], row0 + tx + jm * G::kColGroups,
                                                              col0 + ty * G::kRowsPerThread + i, dx[i][jm]);
                    Pt[i][jm] = exp2_(Pt[i][jm] - sLse2[tx + jm * G::kColGroups]);
                }

            // dP_ij^T = V_j dO_i^T, then dS_ij^T = P_ij^T ∘ (dP_ij^T - D_i) (lines 12-14), ∘ dx;
            // with dropout, dropped elements take -D_i' and leave P^T (for dV_j) as 0.
            Accum dSt[G::kRowsPerThread][G::kSColsPerThread];
            compute_scores<G>(dSt, sV, sdO, ty, tx);
#pragma unroll
            for (int i = 0; i < G::kRowsPerThread; ++i)
#pragma unroll
                for (int jm = 0; jm < G::kSColsPerThread; ++jm) {
                    const Accum d_i = sD[tx + jm * G::kColGroups];
                    if constexpr (kScoreMod) {
                        const bool kept = !dropout.active() || dropout.keep(row0 + tx + jm * G::kColGroups,
                                                                           col0 + ty * G::kRowsPerThread + i);
                        dSt[i][jm] = Pt[i][jm] * (kept ? dSt[i][jm] - d_i : -d_i) * dx[i][jm];
                        if (!kept) Pt[i][jm] = Accum(0);
                    } else {
                        dSt[i][jm] = Pt[i][jm] * (dSt[i][jm] - d_i);
                    }
                }

            store_P<G>(sPt, Pt, ty, tx);
            store_P<G>(sdSt, dSt, ty, tx);
            // dQ's grid reads dS by query rows: store it transposed back as well.
#pragma unroll
            for (int i = 0; i < G::kRowsPerThread; ++i)
#pragma unroll
                for (int jm = 0; jm < G::kSColsPerThread; ++jm)
                    sdS[(tx + jm * G::kColGroups) * Bt::kDSStride + ty * G::kRowsPerThread + i] = dSt[i][jm];
            // Each thread reads back only its own key rows of P^T and dS^T, written by its warp.
            __syncwarp();
            accumulate_tile_sum<G>(dV, sPt, sdO, ty, tx);   // dV_j += P_ij^T dO_i  (line 11)
            accumulate_tile_sum<G>(dK, sdSt, sQ, ty, tx);   // dK_j += dS_ij^T Q_i  (line 16; Q_i prescaled)

            if (params.dq_accum != nullptr) {  // uniform across the block
                __syncthreads();  // all of dS_ij is in shared memory
                const int qy = threadIdx.x / QG::kColGroups, qx = threadIdx.x % QG::kColGroups;
                Accum dQ[QG::kRowsPerThread][QG::kOColsPerThread];
                zero_tile<QG>(dQ);
                accumulate_pv<QG>(dQ, sdS, sK, qy, qx);  // dQ_i += dS_ij K_j  (line 15)
                atomic_add_dq<QG, kScoreMod>(params, dQ, q_batch, head_idx, row0, qy, qx);
            }
        }
    }

    // dK_j = scale · sum_i dS_ij^T Q_i = ln(2) · sum_i dS_ij^T (scale·log2(e) Q_i); dV_j as summed
    // (each times dropout's 1 / (1 - p)). Written once (lines 18-19).
    Storage* dk = static_cast<Storage*>(params.dk) + k_batch * params.dk_batch_stride +
                  kv_head * params.dk_head_stride + col0 * params.dk_row_stride;
    Storage* dv = static_cast<Storage*>(params.dv) + k_batch * params.dv_batch_stride +
                  kv_head * params.dv_head_stride + col0 * params.dv_row_stride;
    const Accum rescale = dropout_rescale<kScoreMod, Accum>(params);
    store_tile<G>(dk, params.dk_row_stride, keys_valid, params.head_dim, dK,
                  kScoreMod ? static_cast<Accum>(kLn2) * rescale : static_cast<Accum>(kLn2), ty, tx);
    store_tile<G>(dv, params.dv_row_stride, keys_valid, params.head_dim, dV, kScoreMod ? rescale : Accum(1), ty, tx);
}

// Grid: (ceil(seqlen_q / kBlockM), heads, batch). Block: Dt::kNThreads. Shared memory: Dt::kSmemBytes.
// The forward's loop with dQ_i = scale · sum_j dS_ij K_j in place of O_i = sum_j P_ij V_j: each dQ_i
// is summed by one thread block in a fixed order, so the result is the same bits every run.
template <typename Dt, bool kIsLocal, bool kIsBlockSparse, bool kScoreMod = false, bool kVarlen = false>
__global__ void __launch_bounds__(Dt::kNThreads, Dt::kMinBlocksPerSm) flash_bwd_dq_kernel(const BwdParams launch_params) {
    using Accum = typename Dt::Accum;
    using Storage = typename Dt::Storage;
    extern __shared__ __align__(16) unsigned char smem[];
    Accum* sQ = reinterpret_cast<Accum*>(smem) + Dt::kSmemQOffset;
    Accum* sdO = reinterpret_cast<Accum*>(smem) + Dt::kSmemdOOffset;
    Accum* sK = reinterpret_cast<Accum*>(smem) + Dt::kSmemKOffset;
    Accum* sV = reinterpret_cast<Accum*>(smem) + Dt::kSmemVOffset;
    Accum* sdS = reinterpret_cast<Accum*>(smem) + Dt::kSmemdSOffset;

    const int m_block = blockIdx.x;
    const int head_idx = blockIdx.y;
    const int batch_idx = blockIdx.z;
    const int ty = threadIdx.x / Dt::kColGroups;
    const int tx = threadIdx.x % Dt::kColGroups;
    const int row0 = m_block * Dt::kBlockM;
    int q_batch, k_batch;
    const BwdParams params = sequence_params<kVarlen>(launch_params, batch_idx, q_batch, k_batch);
    if (kVarlen && row0 >= params.seqlen_q) return;  // past this sequence's end
    const int rows_valid = min(Dt::kBlockM, params.seqlen_q - row0);
    const Accum scale_log2 = static_cast<Accum>(params.scale_log2);

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
    // Prescaled as in the forward: the same scores, bit for bit (see flash_bwd_dkdv_kernel).
    load_tile<Dt, Dt::kBlockM>(sQ, q, params.q_row_stride, rows_valid, params.head_dim, scale_log2);
    load_tile<Dt, Dt::kBlockM>(sdO, dout, params.dout_row_stride, rows_valid, params.head_dim, Accum(1));

    // This thread's rows' lse_i (log2 units) and D_i, in registers for the whole loop.
    const long long vec_offset = row_vector_offset(params, q_batch, head_idx);
    Accum lse2[Dt::kRowsPerThread], D[Dt::kRowsPerThread];
#pragma unroll
    for (int i = 0; i < Dt::kRowsPerThread; ++i) {
        const int row = ty * Dt::kRowsPerThread + i;
        const bool valid = row < rows_valid;
        lse2[i] = valid ? static_cast<const Accum*>(params.lse_log2)[vec_offset + row0 + row] : pos_inf<Accum>();
        D[i] = valid ? static_cast<const Accum*>(params.d)[vec_offset + row0 + row] : Accum(0);
    }

    Accum dQ[Dt::kRowsPerThread][Dt::kOColsPerThread];
    zero_tile<Dt>(dQ);
    const auto mod = score_mod<kScoreMod, Accum>(params, batch_idx, head_idx);
    const auto dropout = dropout_for<kScoreMod>(params, batch_idx, head_idx);
    for (int t = key_blocks.begin; t < key_blocks.end; ++t) {
        const int col0 = key_blocks[t] * Dt::kBlockN;
        const int keys_valid = min(Dt::kBlockN, params.seqlen_k - col0);
        __syncthreads();  // every thread is done reading the previous K_j, V_j and dS_ij
        load_tile<Dt, Dt::kBlockN>(sK, k + col0 * params.k_row_stride, params.k_row_stride, keys_valid,
                                   params.head_dim, Accum(1));
        load_tile<Dt, Dt::kBlockN>(sV, v + col0 * params.v_row_stride, params.v_row_stride, keys_valid,
                                   params.head_dim, Accum(1));
        __syncthreads();  // K_j, V_j (and, first time round, Q_i, dO_i) are in shared memory

        Accum P[Dt::kRowsPerThread][Dt::kSColsPerThread];
        compute_scores<Dt>(P, sQ, sK, ty, tx);
        if (keys_valid < Dt::kBlockN || (kIsLocal && band_cuts(params, row0, rows_valid, col0, keys_valid))) {
            apply_mask<Dt, kIsLocal>(P, row0, col0, params, ty, tx);
        }
        Accum dS[Dt::kRowsPerThread][Dt::kSColsPerThread];
        compute_scores<Dt>(dS, sdO, sV, ty, tx);  // dP_ij = dO_i V_j^T
#pragma unroll
        for (int i = 0; i < Dt::kRowsPerThread; ++i)
#pragma unroll
            for (int jn = 0; jn < Dt::kSColsPerThread; ++jn) {
                if constexpr (kScoreMod) {  // P_ij of the modified score; dS_ij times its derivative
                    Accum dx;
                    const int query = row0 + ty * Dt::kRowsPerThread + i, key = col0 + tx + jn * Dt::kColGroups;
                    P[i][jn] = exp2_(mod.template apply<Tanh::kAccurate>(P[i][jn], query, key, dx) - lse2[i]);
                    const bool kept = !dropout.active() || dropout.keep(query, key);
                    dS[i][jn] = P[i][jn] * (kept ? dS[i][jn] - D[i] : -D[i]) * dx;
                } else {
                    P[i][jn] = exp2_(P[i][jn] - lse2[i]);
                    dS[i][jn] = P[i][jn] * (dS[i][jn] - D[i]);
                }
            }
        store_P<Dt>(sdS, dS, ty, tx);
        __syncwarp();  // each thread reads back whole rows of dS_ij, written by its row group: one warp
        accumulate_tile_sum<Dt>(dQ, sdS, sK, ty, tx);
    }

    Storage* dq = static_cast<Storage*>(params.dq) + q_batch * params.dq_batch_stride +
                  head_idx * params.dq_head_stride + row0 * params.dq_row_stride;
    store_tile<Dt>(dq, params.dq_row_stride, rows_valid, params.head_dim, dQ,
                   static_cast<Accum>(dropout_scaled<kScoreMod>(params, params.scale)), ty, tx);
}

}  // namespace cupyflash
