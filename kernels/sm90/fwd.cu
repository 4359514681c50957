// Attention forward on Hopper (float16 / bfloat16, sm_90a), one block per query block:
// FlashAttention-2's Algorithm 1 with warpgroup wgmma products reading swizzled tiles through
// descriptors, 64 query rows per warpgroup (sm90/wgmma.cuh). K_j and V_j stream in through cp.async,
// or in the TMA builds through the tensor memory accelerator, each loaded while the other is being
// used. A warp holds 16 rows of S_ij and O_i in mma.sync's fragment layout, so the online softmax,
// masks, score modifiers, dropout and epilogue (tc/fwd_steps.cuh, tc/fragments.cuh) are shared with
// sm80/. The warp-specialised, persistent form of the unmasked forward is sm90/fwd_ws.cu.
#include "sm90/wgmma.cuh"
#include "tc/fwd_steps.cuh"

namespace cupyflash {

// Grid: (ceil(seqlen_q / kBlockM), heads, batch). Block: Kt::kNThreads. Shared memory: Kt::kSmemBytes.
// kScoreMod: softcap and ALiBi (ScoreMod) on every score, dropout (Dropout) on the probabilities;
// instantiated with kIsLocal only, whose band arithmetic covers the unmasked problem too (a band as
// wide as the score matrix).
// kVarlen: a variable-length batch (sequence_params; with kIsLocal and kScoreMod only).
// kTma: K_j and V_j come by the TMA, through `maps` (unused otherwise), one thread asking for each
// tile and every thread waiting on the tile's mbarrier, instead of 16-byte cp.async copies by
// every thread: the copies and their address arithmetic were a quarter of the d64 loop's
// instructions, and that kernel is bound by instruction issue. Dense, block-sparse, local (causal,
// windows) and with score modifiers; not with packed sequences, whose rows past a sequence's keys
// would arrive as the next sequence's, not as zeros.
template <typename Kt, bool kIsLocal, bool kIsBlockSparse, bool kScoreMod = false, bool kVarlen = false,
          bool kTma = false>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocksPerSm)
    flash_fwd_sm90_kernel(const FwdParams launch_params, const __grid_constant__ KvTensorMaps maps) {
    static_assert(!kTma || !kVarlen, "TMA builds: not packed");
    using Storage = typename Kt::Storage;
    using Op = typename Kt::Op;
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned tiles = Kt::tile_base(smem_address(smem));
    const unsigned sQ = tiles + Kt::kSmemQOffset * 2;  // Q_i [kBlockM][head dim], swizzled panels
    const unsigned sK = tiles + Kt::kSmemKOffset * 2;  // K_j [kBlockN][head dim]
    const unsigned sV = tiles + Kt::kSmemVOffset * 2;  // V_j [kBlockN][head dim]

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

    float O[Kt::kMTiles][Kt::kHeadDim / 8][4];
    float m[Kt::kMTiles][2], l[Kt::kMTiles][2];
    init_row_state<Kt>(O, m, l);

    // (Dense and not local, the first tile is written as the dense kernel always had it, 0:
    // indexing the dense sequence means the same, yet NVRTC then schedules the whole loop differently.)
    int next_col0 = 0;  // block-sparse: the next K_j's first column, read from the mask once
    // kTma: K_j's and V_j's mbarriers, and the parity of the phase this iteration waits for.
    unsigned k_landed = 0, v_landed = 0, phase = 0;
    if constexpr (kTma) {
        __shared__ alignas(8) unsigned long long barriers[2];
        k_landed = smem_address(&barriers[0]), v_landed = smem_address(&barriers[1]);
        if (threadIdx.x == 0) {
            mbarrier_init(k_landed, 1);
            mbarrier_init(v_landed, 1);
            fence_mbarrier_init();
        }
        __syncthreads();
    }
    if (key_blocks.begin < key_blocks.end) {
        const int first = kIsBlockSparse || kIsLocal ? key_blocks.first() * Kt::kBlockN : 0;
        next_col0 = first;
        if constexpr (kTma)
            load_tile_tma<Kt, Kt::kBlockN>(sK, maps.k, k_landed, first, kv_head, k_batch);
        load_tile_async<Kt, Kt::kBlockM>(sQ, q, params.q_row_stride, rows_valid, params.head_dim);
        if constexpr (!kTma)
            load_tile_async<Kt, Kt::kBlockN>(sK, k + first * params.k_row_stride, params.k_row_stride,
                                             min(Kt::kBlockN, params.seqlen_k - first), params.head_dim);
        cp_async_commit();
        if constexpr (kTma) {
            // Q_i is the only cp.async copy: published at the first K_j's barrier.
            cp_async_wait<0>();
            fence_proxy_async();
        }
    }
    const float scale_log2 = static_cast<float>(params.scale_log2);
    const auto mod = score_mod<kScoreMod, float>(params, batch_idx, head_idx);
    const auto dropout = dropout_for<kScoreMod>(params, batch_idx, head_idx);

    // Dense, the loop counts from tile 0 and passes over the tiles left of the band one compare
    // each: started at a runtime tile, NVRTC spills 100 bytes at d64 and d128 (local attention).
    for (int t = kIsBlockSparse ? key_blocks.begin : 0; t < key_blocks.end; ++t) {
        if (!kIsBlockSparse && t < key_blocks.begin) continue;
        const int col0 = kIsBlockSparse ? next_col0 : key_blocks[t] * Kt::kBlockN;
        const int keys_valid = min(Kt::kBlockN, params.seqlen_k - col0);
        // K_j (and Q_i) have landed; every warp is done reading V_{j-1}.
        if constexpr (kTma) {
            tma_tile_landed(k_landed, phase);
            load_tile_tma<Kt, Kt::kBlockN>(sV, maps.v, v_landed, col0, kv_head, k_batch);
        } else {
            wgmma_tiles_landed();
            load_tile_async<Kt, Kt::kBlockN>(sV, v + col0 * params.v_row_stride, params.v_row_stride, keys_valid,
                                             params.head_dim);
            cp_async_commit();
        }
        // Block-sparse at one block per SM (d128), where no other block's work hides it: the next
        // K_j's first column is read from the mask here, its latency passing behind S_ij and the
        // softmax rather than stalling the K_j prefetch. (At d64's three blocks per SM the register
        // it holds meanwhile spilled 8 bytes in the non-local build.)
        constexpr bool kEarlyIndex = kIsBlockSparse && Kt::kMinBlocksPerSm == 1;
        const int early_next = kEarlyIndex && t + 1 < key_blocks.end ? key_blocks[t + 1] * Kt::kBlockN : 0;

        float S[Kt::kMTiles][Kt::kNTiles][4];
        // This warpgroup's 64 rows of Q_i against all of K_j.
        wgmma_abt<Kt, Kt::kBlockN, Kt::kBlockM>(S[0], sQ + Kt::row_bytes(64 * (warp / 4)), sK);
        // Lazy rescaling (online_softmax_tc) where other blocks on the SM work through the vote's
        // branch: d64, three blocks per SM. (Its local builds spill 12-56 bytes with it.)
        constexpr bool kLazy = Kt::kMinBlocksPerSm > 1 && !kIsLocal;
        softmax_step<Kt, kIsLocal, kScoreMod, kLazy>(S, O, m, l, params, mod, dropout, scale_log2, row0, rows_valid,
                                                     warp_row0, col0, keys_valid, f);
        unsigned P[Kt::kMTiles][Kt::kNTiles / 2][4];
        to_a_fragments<Op>(S, P);

        // V_j has landed; every warp is done reading K_j.
        if constexpr (kTma)
            tma_tile_landed(v_landed, phase);
        else
            wgmma_tiles_landed();
        if (t + 1 < key_blocks.end) {
            const int next = kEarlyIndex ? early_next
                             : kIsBlockSparse ? key_blocks[t + 1] * Kt::kBlockN : col0 + Kt::kBlockN;
            next_col0 = next;
            if constexpr (kTma)
                load_tile_tma<Kt, Kt::kBlockN>(sK, maps.k, k_landed, next, kv_head, k_batch);
            else
                load_tile_async<Kt, Kt::kBlockN>(sK, k + next * params.k_row_stride, params.k_row_stride,
                                                 min(Kt::kBlockN, params.seqlen_k - next), params.head_dim);
        }
        if constexpr (!kTma) cp_async_commit();
        phase ^= 1;
        wgmma_ab_rs<Kt, Kt::kBlockN>(O[0], P[0], sV);
    }

    epilogue_tc<Kt, kScoreMod>(params, O, m, l, q_batch, head_idx, warp_row0, f, dropout_rescale<kScoreMod, float>(params),
                               sQ);
}

}  // namespace cupyflash
