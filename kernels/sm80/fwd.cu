// Attention forward on tensor cores with mma.sync (float16 / bfloat16, float32 as TF32 products, float64 on
// the FP64 tensor cores; sm_80 and newer): FlashAttention-2, Algorithm 1, with float32 accumulation
// (float64 for float64). Same algorithm, arguments and results as
// the scalar kernel (scalar/fwd.cu, the readable baseline); what changes is where the arithmetic runs:
//   - S_ij = Q_i K_j^T and O_i += P_ij V_j are warp-level mma.sync products on ldmatrix'd fragments
//     of padded tiles (sm80/gemm.cuh);
//   - P_ij never leaves registers: its accumulator tile is rounded to 16 bits and used directly as
//     the A operand of P V (so P is rounded to the input type, as in every fused 16-bit kernel);
//   - K_j and V_j stream in through cp.async, each loaded while the other is being used;
//   - scores stay unscaled in the products; scale·log2(e) is folded into exp2's argument.
// A warp holds whole rows of S_ij and O_i in mma.sync's fragment layout, so the online softmax,
// masks, score modifiers, dropout and epilogue (tc/fwd_steps.cuh, tc/fragments.cuh) are shared with
// sm90/.
#include "sm80/traits.cuh"
#include "sm80/gemm.cuh"
#include "tc/fwd_steps.cuh"

namespace cupyflash {

// Grid: (ceil(seqlen_q / kBlockM), heads, batch). Block: Kt::kNThreads. Shared memory: Kt::kSmemBytes.
// kScoreMod: softcap and ALiBi (ScoreMod) on every score, dropout (Dropout) on the probabilities;
// instantiated with kIsLocal only, whose band arithmetic covers the unmasked problem too (a band as
// wide as the score matrix).
// kVarlen: a variable-length batch (sequence_params; with kIsLocal and kScoreMod only).
template <typename Kt, bool kIsLocal, bool kIsBlockSparse, bool kScoreMod = false, bool kVarlen = false>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocksPerSm)
    flash_fwd_sm80_kernel(const FwdParams launch_params) {
    using Storage = typename Kt::Storage;
    using Accum = typename Kt::Accum;
    using Op = typename Kt::Op;
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned tiles = Kt::tile_base(smem_address(smem));
    constexpr unsigned kSize = sizeof(Storage);
    const unsigned sQ = tiles + Kt::kSmemQOffset * kSize;  // Q_i [kBlockM][head dim], padded rows
    const unsigned sK = tiles + Kt::kSmemKOffset * kSize;  // K_j [kBlockN][head dim]
    const unsigned sV = tiles + Kt::kSmemVOffset * kSize;  // V_j [kBlockN][head dim]

    // With causal, query blocks further down see more keys; they are started first (the grid
    // runs in blockIdx order), so the short ones fill in the tail of the launch.
    const int m_block = kIsLocal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head_idx = blockIdx.y, batch_idx = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Fragment f(lane);
    const int row0 = m_block * Kt::kBlockM;
    int q_batch, k_batch;
    const FwdParams params = sequence_params<kVarlen>(launch_params, batch_idx, q_batch, k_batch);
    if (kVarlen && row0 >= params.seqlen_q) return;  // past this sequence's end
    const int rows_valid = min(Kt::kBlockM, params.seqlen_q - row0);
    const int warp_row0 = row0 + warp * Kt::kWarpRows;

    // Key blocks K_j, V_j this query block visits (those in its band, or the mask's).
    const auto key_blocks = key_tiles<Kt::kBlockN, kIsLocal, kIsBlockSparse>(params, batch_idx, head_idx, row0, rows_valid);
    const int kv_head = head_idx / params.kv_group;

    const Storage* q = static_cast<const Storage*>(params.q) + q_batch * params.q_batch_stride +
                       head_idx * params.q_head_stride + row0 * params.q_row_stride;
    const Storage* k = static_cast<const Storage*>(params.k) + k_batch * params.k_batch_stride +
                       kv_head * params.k_head_stride;
    const Storage* v = static_cast<const Storage*>(params.v) + k_batch * params.v_batch_stride +
                       kv_head * params.v_head_stride;

    Accum O[Kt::kMTiles][Kt::kHeadDim / 8][4];
    Accum m[Kt::kMTiles][2], l[Kt::kMTiles][2];
    init_row_state<Kt>(O, m, l);

    // (Dense and not local, the first tile is written as the dense kernel always had it, 0:
    // indexing the dense sequence means the same, yet NVRTC then schedules the whole loop differently.)
    int next_col0 = 0;  // block-sparse: the next K_j's first column, read from the mask once
    if (key_blocks.begin < key_blocks.end) {
        const int first = kIsBlockSparse || kIsLocal ? key_blocks.first() * Kt::kBlockN : 0;
        next_col0 = first;
        load_tile_async<Kt, Kt::kBlockM>(sQ, q, params.q_row_stride, rows_valid, params.head_dim);
        load_tile_async<Kt, Kt::kBlockN>(sK, k + first * params.k_row_stride, params.k_row_stride,
                                         min(Kt::kBlockN, params.seqlen_k - first), params.head_dim);
        cp_async_commit();
    }
    const Accum scale_log2 = static_cast<Accum>(params.scale_log2);
    const auto mod = score_mod<kScoreMod, Accum>(params, batch_idx, head_idx);
    const auto dropout = dropout_for<kScoreMod>(params, batch_idx, head_idx);

    // Dense, the loop counts from tile 0 and passes over the tiles left of the band one compare
    // each: started at a runtime tile, NVRTC spills 100 bytes at d64 and d128 (local attention).
    for (int t = kIsBlockSparse ? key_blocks.begin : 0; t < key_blocks.end; ++t) {
        if (!kIsBlockSparse && t < key_blocks.begin) continue;
        const int col0 = kIsBlockSparse ? next_col0 : key_blocks[t] * Kt::kBlockN;
        const int keys_valid = min(Kt::kBlockN, params.seqlen_k - col0);
        // K_j (and Q_i) have landed; every warp is done reading V_{j-1}.
        tiles_landed<Kt>();
        load_tile_async<Kt, Kt::kBlockN>(sV, v + col0 * params.v_row_stride, params.v_row_stride, keys_valid,
                                         params.head_dim);
        cp_async_commit();
        // Block-sparse at one block per SM (the d128 tiles), where no other block's work hides
        // it: the next K_j's first column is read from the mask here, its latency passing behind
        // S_ij and the softmax rather than stalling the K_j prefetch.
        constexpr bool kEarlyIndex = kIsBlockSparse && Kt::kMinBlocksPerSm == 1;
        const int early_next = kEarlyIndex && t + 1 < key_blocks.end ? key_blocks[t + 1] * Kt::kBlockN : 0;

        Accum S[Kt::kMTiles][Kt::kNTiles][4];
        // (The products stay written out here: called through a wrapper, NVRTC scheduled 35 of
        // the 63 16-bit kernels differently.)
        zero(S);
        if constexpr (Kt::kF64)
            gemm_abt_ss_f64<Op, Kt::kMTiles, Kt::kNTiles, Kt::kKSteps, Kt::kStride>(
                S, sQ + Kt::row_bytes(warp * Kt::kWarpRows), sK, f);
        else if constexpr (Kt::kTf32)
            gemm_abt_ss_tf32<Op, Kt::kMTiles, Kt::kNTiles, Kt::kKSteps, Kt::kStride16, Kt::kStride16>(
                S, sQ + Kt::row_bytes(warp * Kt::kWarpRows), sK, lane);
        else
            gemm_abt_ss<Op, Kt::kMTiles, Kt::kNTiles, Kt::kKSteps, Kt::kStride, Kt::kStride>(
                S, sQ + warp * Kt::kWarpRows * Kt::kStride * 2, sK, lane);
        softmax_step<Kt, kIsLocal, kScoreMod, false>(S, O, m, l, params, mod, dropout, scale_log2, row0, rows_valid,
                                                     warp_row0, col0, keys_valid, f);
        // 16-bit: P_ij rounded to A fragments here; TF32 and float64: P_ij stays in S, taken per
        // k-step below.
        constexpr bool kPInS = Kt::kTf32 || Kt::kF64;
        unsigned P[kPInS ? 1 : Kt::kMTiles][Kt::kNTiles / 2][4];
        if constexpr (!kPInS) to_a_fragments<Op>(S, P);

        // V_j has landed; every warp is done reading K_j.
        tiles_landed<Kt>();
        if (t + 1 < key_blocks.end) {
            const int next = kEarlyIndex ? early_next
                             : kIsBlockSparse ? key_blocks[t + 1] * Kt::kBlockN : col0 + Kt::kBlockN;
            next_col0 = next;
            load_tile_async<Kt, Kt::kBlockN>(sK, k + next * params.k_row_stride, params.k_row_stride,
                                             min(Kt::kBlockN, params.seqlen_k - next), params.head_dim);
        }
        cp_async_commit();
        if constexpr (Kt::kF64)
            gemm_pv_f64<Op, Kt::kMTiles, Kt::kHeadDim / 8, Kt::kNTiles, Kt::kStride>(O, S, sV, f);
        else if constexpr (Kt::kTf32)
            gemm_pv_tf32<Op, Kt::kMTiles, Kt::kHeadDim / 8, Kt::kNTiles, Kt::kStride>(O, S, sV, f);
        else
            gemm_ab_rs<Op, Kt::kMTiles, Kt::kHeadDim / 8, Kt::kNTiles / 2, Kt::kStride>(O, P, sV, lane);
    }

    epilogue_tc<Kt, kScoreMod>(params, O, m, l, q_batch, head_idx, warp_row0, f, dropout_rescale<kScoreMod, Accum>(params),
                               sQ);
}

}  // namespace cupyflash
