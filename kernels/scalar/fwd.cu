// Exact attention forward: FlashAttention-2, Algorithm 1, on CUDA cores.
// The readable baseline kernel of cupyflash: float32/float64 use it, and every faster path is
// checked against the same reference it is. Template arguments: scalar/traits.cuh; the
// instantiations are listed in cupyflash/catalog. Also the dropout mask kernel, which materialises
// the keep mask the kernels regenerate tile by tile.
#include "scalar/fwd_steps.cuh"

namespace cupyflash {

// Grid: (ceil(seqlen_q / kBlockM), heads, batch). Block: Kt::kNThreads threads.
// Dynamic shared memory: Kt::kSmemBytes.
// kScoreMod: softcap and ALiBi (ScoreMod) on every score, and dropout (Dropout) on the
// probabilities; instantiated with kIsLocal only, whose band arithmetic covers the unmasked problem
// too (a band as wide as the score matrix).
// kVarlen: a variable-length batch (sequence_params; with kIsLocal and kScoreMod only), the grid
// covering its longest sequence.
template <typename Kt, bool kIsLocal, bool kIsBlockSparse, bool kScoreMod = false, bool kVarlen = false>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocksPerSm) flash_fwd_kernel(const FwdParams launch_params) {
    using Accum = typename Kt::Accum;
    using Storage = typename Kt::Storage;
    extern __shared__ __align__(16) unsigned char smem[];
    Accum* sQ = reinterpret_cast<Accum*>(smem) + Kt::kSmemQOffset;  // Q_i  [kBlockM][kQKVStride]
    Accum* sK = reinterpret_cast<Accum*>(smem) + Kt::kSmemKOffset;  // K_j  [kBlockN][kQKVStride]
    Accum* sV = reinterpret_cast<Accum*>(smem) + Kt::kSmemVOffset;  // V_j  [kBlockN][kQKVStride]
    Accum* sP = reinterpret_cast<Accum*>(smem) + Kt::kSmemPOffset;  // P_ij [kBlockM][kPStride]

    const int m_block = blockIdx.x;
    const int head_idx = blockIdx.y;
    const int batch_idx = blockIdx.z;
    const int ty = threadIdx.x / Kt::kColGroups;
    const int tx = threadIdx.x % Kt::kColGroups;
    const int row0 = m_block * Kt::kBlockM;
    int q_batch, k_batch;
    const FwdParams params = sequence_params<kVarlen>(launch_params, batch_idx, q_batch, k_batch);
    if (kVarlen && row0 >= params.seqlen_q) return;  // past this sequence's end
    const int rows_valid = min(Kt::kBlockM, params.seqlen_q - row0);

    // Key blocks K_j, V_j this query block visits (those in its band, or the mask's).
    const auto key_blocks = key_tiles<Kt::kBlockN, kIsLocal, kIsBlockSparse>(params, batch_idx, head_idx, row0, rows_valid);
    const int kv_head = head_idx / params.kv_group;

    const Storage* q = static_cast<const Storage*>(params.q) + q_batch * params.q_batch_stride +
                       head_idx * params.q_head_stride + row0 * params.q_row_stride;
    const Storage* k = static_cast<const Storage*>(params.k) + k_batch * params.k_batch_stride +
                       kv_head * params.k_head_stride;
    const Storage* v = static_cast<const Storage*>(params.v) + k_batch * params.v_batch_stride +
                       kv_head * params.v_head_stride;

    // Q_i stays on chip for the whole loop, prescaled so that S_ij comes out in log2 units.
    load_tile<Kt, Kt::kBlockM>(sQ, q, params.q_row_stride, rows_valid, params.head_dim,
                               static_cast<Accum>(params.scale_log2));

    Accum O[Kt::kRowsPerThread][Kt::kOColsPerThread];
    Accum m[Kt::kRowsPerThread];
    Accum l[Kt::kRowsPerThread];
#pragma unroll
    for (int i = 0; i < Kt::kRowsPerThread; ++i) {
        m[i] = neg_inf<Accum>();
        l[i] = Accum(0);
#pragma unroll
        for (int c = 0; c < Kt::kOColsPerThread; ++c) O[i][c] = Accum(0);
    }

    const auto mod = score_mod<kScoreMod, Accum>(params, batch_idx, head_idx);
    const auto dropout = dropout_for<kScoreMod>(params, batch_idx, head_idx);

    // n_block is the tile of position t, read a step ahead: block-sparse, the next index's load
    // then overlaps this tile's work (and the loop needs one register less than indexing twice).
    int n_block = key_blocks.begin < key_blocks.end ? key_blocks[key_blocks.begin] : 0;
    for (int t = key_blocks.begin; t < key_blocks.end; ++t) {
        const int col0 = n_block * Kt::kBlockN;
        if (t + 1 < key_blocks.end) n_block = key_blocks[t + 1];
        const int keys_valid = min(Kt::kBlockN, params.seqlen_k - col0);
        __syncthreads();  // every thread is done reading the previous K_j, V_j and P_ij
        load_tile<Kt, Kt::kBlockN>(sK, k + col0 * params.k_row_stride, params.k_row_stride,
                                   keys_valid, params.head_dim, Accum(1));
        load_tile<Kt, Kt::kBlockN>(sV, v + col0 * params.v_row_stride, params.v_row_stride,
                                   keys_valid, params.head_dim, Accum(1));
        __syncthreads();  // K_j and V_j (and, first time round, Q_i) are in shared memory

        Accum S[Kt::kRowsPerThread][Kt::kSColsPerThread];
        compute_scores<Kt>(S, sQ, sK, ty, tx);
        if (keys_valid < Kt::kBlockN || (kIsLocal && band_cuts(params, row0, rows_valid, col0, keys_valid))) {
            apply_mask<Kt, kIsLocal>(S, row0, col0, params, ty, tx);
        }
        if constexpr (kScoreMod) apply_score_mod<Kt>(S, mod, row0, col0, ty, tx);
        online_softmax<Kt>(S, O, m, l);
        if constexpr (kScoreMod) {
            if (dropout.active()) apply_dropout<Kt>(S, dropout, row0, col0, ty, tx);
        }
        store_P<Kt>(sP, S, ty, tx);
        // Each thread reads whole rows of P_ij below, written by its row group: one warp.
        __syncwarp();
        accumulate_pv<Kt>(O, sP, sV, ty, tx);
    }

    epilogue<Kt, kScoreMod>(params, O, m, l, q_batch, head_idx, row0, ty, tx, dropout_rescale<kScoreMod, Accum>(params));
}

// Grid: (ceil(seqlen_q·seqlen_k / kThreads), heads, batch). Dropout's keep mask Z_ij as bytes (1:
// kept), [batch, heads, seqlen_q, seqlen_k] contiguous at params.o: what the attention kernels
// apply, materialised for tests and for checking a small problem (cupyflash.dropout_mask).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) flash_dropout_mask_kernel(const FwdParams params) {
    const long long elements = static_cast<long long>(params.seqlen_q) * params.seqlen_k;
    const long long idx = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
    if (idx >= elements) return;
    const int head_idx = blockIdx.y, batch_idx = blockIdx.z;
    const Dropout dropout(params, batch_idx, head_idx);
    const int query = static_cast<int>(idx / params.seqlen_k), key = static_cast<int>(idx % params.seqlen_k);
    unsigned char* keep = static_cast<unsigned char*>(params.o) +
                          (static_cast<long long>(batch_idx) * params.heads + head_idx) * elements;
    keep[idx] = dropout.keep(query, key) ? 1 : 0;
}

}  // namespace cupyflash
