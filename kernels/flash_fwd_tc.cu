// Attention forward on tensor cores (float16 / bfloat16): FlashAttention-2, Algorithm 1, with
// float32 accumulation. Same algorithm, arguments and results as the scalar flash_fwd.cu (the
// readable baseline); what changes is where the arithmetic runs:
//   - S_ij = Q_i K_j^T and O_i += P_ij V_j are tensor-core products: on sm_80 and newer,
//     warp-level mma.sync on ldmatrix'd fragments of padded tiles; on Hopper (sm_90a,
//     WgmmaFwdTraits), warpgroup-level wgmma reading swizzled tiles through descriptors, 64 query
//     rows per warpgroup (flash_wgmma.cuh);
//   - P_ij never leaves registers: its accumulator tile is rounded to 16 bits and used directly as
//     the A operand of P V (so P is rounded to the input type, as in every fused 16-bit kernel);
//   - K_j and V_j stream in through cp.async (or, in the Hopper TMA builds, the copy engine), each
//     loaded while the other is being used;
//   - scores stay unscaled in the products; scale·log2(e) is folded into exp2's argument.
// Either way a warp holds whole rows of S_ij and O_i in mma.sync's fragment layout, so the online
// softmax, masks, score modifiers, dropout and epilogue are one code.
#include "flash_wgmma.cuh"

namespace cupyflash {

// Grid: (ceil(seqlen_q / kBlockM), heads, batch). Block: Kt::kNThreads. Shared memory: Kt::kSmemBytes.
// kScoreMod: softcap and ALiBi (ScoreMod) on every score, dropout (Dropout) on the probabilities;
// instantiated with kIsLocal only, whose band arithmetic covers the unmasked problem too (a band as
// wide as the score matrix).
// kVarlen: a variable-length batch (sequence_params; with kIsLocal and kScoreMod only).
// kTma (Hopper): K_j and V_j come by the TMA, through `maps` (unused otherwise), one thread asking
// for each tile and every thread waiting on the tile's mbarrier, instead of 16-byte cp.async copies
// by every thread: the copies and their address arithmetic were a quarter of the d64 loop's
// instructions, and that kernel is bound by instruction issue. Dense, block-sparse and local (causal,
// windows); not with score modifiers or packed sequences, whose rows past a sequence's keys would
// arrive as the next sequence's, not as zeros.
template <typename Kt, bool kIsLocal, bool kIsBlockSparse, bool kScoreMod = false, bool kVarlen = false,
          bool kTma = false>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocksPerSm)
    flash_fwd_tc_kernel(const FwdParams launch_params, const __grid_constant__ KvTensorMaps maps) {
    static_assert(!kTma || (Kt::kWgmma && !kScoreMod && !kVarlen), "TMA builds: Hopper, no score modifiers, not packed");
    using Storage = typename Kt::Storage;
    using Op = typename Kt::Op;
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned tiles = Kt::tile_base(smem_address(smem));
    const unsigned sQ = tiles + Kt::kSmemQOffset * 2;  // Q_i [kBlockM][head dim], laid out as Kt says
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
    zero(O);
#pragma unroll
    for (int mt = 0; mt < Kt::kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) m[mt][h] = neg_inf<float>(), l[mt][h] = 0.f;

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
            tiles_landed<Kt>();
            load_tile_async<Kt, Kt::kBlockN>(sV, v + col0 * params.v_row_stride, params.v_row_stride, keys_valid,
                                             params.head_dim);
            cp_async_commit();
        }
        // Block-sparse at one block per SM (Hopper d128, the mma.sync tiles), where no other
        // block's work hides it: the next K_j's first column is read from the mask here, its
        // latency passing behind S_ij and the softmax rather than stalling the K_j prefetch. (At
        // Hopper d64's three blocks per SM the register it holds meanwhile spilled 8 bytes in the
        // non-local build.)
        constexpr bool kEarlyIndex = kIsBlockSparse && Kt::kMinBlocksPerSm == 1;
        const int early_next = kEarlyIndex && t + 1 < key_blocks.end ? key_blocks[t + 1] * Kt::kBlockN : 0;

        float S[Kt::kMTiles][Kt::kNTiles][4];
        // (The mma.sync products stay written out here: called through a wrapper, NVRTC scheduled
        // 35 of the 63 16-bit kernels differently.)
        if constexpr (Kt::kWgmma) {
            // This warpgroup's 64 rows of Q_i against all of K_j.
            wgmma_abt<Kt, Kt::kBlockN, Kt::kBlockM>(S[0], sQ + Kt::row_bytes(64 * (warp / 4)), sK);
        } else {
            zero(S);
            gemm_abt_ss<Op, Kt::kMTiles, Kt::kNTiles, Kt::kKSteps, Kt::kStride, Kt::kStride>(
                S, sQ + warp * Kt::kWarpRows * Kt::kStride * 2, sK, lane);
        }
        if (keys_valid < Kt::kBlockN || (kIsLocal && band_cuts(params, row0, rows_valid, col0, keys_valid)))
            mask_fragments<kIsLocal, false>(S, warp_row0, col0, params, f);
        if constexpr (kScoreMod) {
            // S becomes the modified scores in log2 units, which the softmax takes unscaled.
            if (mod.softcap())
                score_mod_fragments<true>(S, mod, scale_log2, warp_row0, col0, f);
            else
                score_mod_fragments<false>(S, mod, scale_log2, warp_row0, col0, f);
            online_softmax_tc<Kt>(S, O, m, l, 1.f);
            // P_ij ∘ Z_ij after l_i took every probability in (apply_dropout in flash_fwd.cuh).
            if (dropout.active())
                for_dropped<false, Kt::kMTiles, Kt::kNTiles>(dropout, warp_row0, col0, f,
                                                             [&](int mt, int nt, int i) { S[mt][nt][i] = 0.f; });
        } else {
            // Lazy rescaling (online_softmax_tc) where other blocks on the SM work through the
            // vote's branch: Hopper d64, three blocks per SM. (Its local builds spill 12-56 bytes
            // with it.)
            constexpr bool kLazy = Kt::kWgmma && Kt::kMinBlocksPerSm > 1 && !kIsLocal;
            online_softmax_tc<Kt, kLazy>(S, O, m, l, scale_log2);
        }
        unsigned P[Kt::kMTiles][Kt::kNTiles / 2][4];
        to_a_fragments<Op>(S, P);

        // V_j has landed; every warp is done reading K_j.
        if constexpr (kTma)
            tma_tile_landed(v_landed, phase);
        else
            tiles_landed<Kt>();
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
        if constexpr (Kt::kWgmma)
            wgmma_ab_rs<Kt, Kt::kBlockN>(O[0], P[0], sV);
        else
            gemm_ab_rs<Op, Kt::kMTiles, Kt::kHeadDim / 8, Kt::kNTiles / 2, Kt::kStride>(O, P, sV, lane);
    }

    epilogue_tc<Kt, kScoreMod>(params, O, m, l, q_batch, head_idx, warp_row0, f, dropout_rescale<kScoreMod, float>(params),
                               sQ);
}

// The warp-specialised forward's tensor maps: Q's, K's and V's like KvTensorMaps' (Q's boxes a
// query tile's rows), and O's, whose boxes are a consumer warpgroup's 64 rows.
struct FwdWsTensorMaps {
    TensorMap q, k, v, o;
};
static_assert(sizeof(FwdWsTensorMaps) == 512, "cupyflash/_tma.py passes 4 x 128 bytes");

// The warp-specialised, persistent forward (WgmmaFwdWsTraits): dense or block-sparse, not local,
// no score modifiers, not packed. Grid: (blocks, at most one per SM). Block: Kt::kNThreadsAll.
// The n_tiles = query tiles x heads x batch go in order, query tiles fastest (a head's K, V stay
// in L2 while its tiles run): block b takes tile b first, then the next unclaimed one
// (`next_tile`: zero at launch and at exit, it counts the claims), so that blocks whose tiles had
// few key blocks take more tiles. A block mask whose rows differ in length gives the order
// (params.query_tile_order: the longest rows' tiles first). Per tile the same steps as
// flash_fwd_tc_kernel, Algorithm 1 of FlashAttention-2, split between the roles:
//   producer (thread 0): claims the next tile, reads its key blocks (the mask row's list), asks
//     for Q_i into a free Q buffer, then K_j and V_j into the ring's next free stage, each counted
//     on its `full` mbarrier;
//   consumers: wait for a buffer's `full` phase, compute, arrive on its `empty` mbarrier once
//     read (K_j, V_j: one arrival per warp; Q_i: one per warpgroup, once the TMA has read the O_i
//     rows staged in it). The producer passes each tile's index, query block, head, batch index
//     and key-block count and each stage's first key along in shared memory, written before the
//     arrival that completes the phase the consumers wait for; a tile index of -1 tells the
//     consumers there are no more.
template <typename Kt, bool kIsBlockSparse>
__global__ void __launch_bounds__(Kt::kNThreadsAll, 1)
    flash_fwd_ws_kernel(const FwdParams params, const __grid_constant__ FwdWsTensorMaps maps, const int n_tiles,
                        int* const next_tile) {
    constexpr int kStages = Kt::kStages;
    constexpr int kConsumerWarps = Kt::kConsumerThreads / 32;
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned tiles = Kt::tile_base(smem_address(smem));
    const unsigned sQ0 = tiles + Kt::kSmemQBytesOffset;  // Q_i [kBlockM][head dim], two buffers
    const unsigned sK0 = tiles + Kt::kSmemKBytesOffset;  // K_j [kBlockN][head dim], kStages buffers
    const unsigned sV0 = tiles + Kt::kSmemVBytesOffset;  // V_j likewise

    // full: the buffer's copy has landed (the producer's arrival and its bytes); empty: the
    // consumers are done with it (K_j, V_j: every consumer warp; Q_i: every consumer warpgroup,
    // its O_i rows read out of the buffer by the TMA).
    __shared__ alignas(8) unsigned long long q_barriers[2][2], k_barriers[kStages][2], v_barriers[kStages][2];
    // The tile in each Q buffer (-1: none left), its key blocks, and its query block, head and batch
    // index (decoded by the producer: the consumers' divisions sat at every tile's start).
    __shared__ int q_tile[2], q_blocks[2], q_coords[2][3];
    __shared__ int stage_col0[kStages];  // each stage's first key
    if (threadIdx.x == 0) {
        for (int b = 0; b < 2; ++b) {
            mbarrier_init(smem_address(&q_barriers[b][0]), 1);
            mbarrier_init(smem_address(&q_barriers[b][1]), Kt::kConsumers);
        }
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(smem_address(&k_barriers[s][0]), 1);
            mbarrier_init(smem_address(&k_barriers[s][1]), kConsumerWarps);
            mbarrier_init(smem_address(&v_barriers[s][0]), 1);
            mbarrier_init(smem_address(&v_barriers[s][1]), kConsumerWarps);
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the last block-wide barrier: the roles part here

    const int m_tiles = ceil_div(params.seqlen_q, Kt::kBlockM);
    if (threadIdx.x < 128) {
        setmaxnreg_dec<Kt::kProducerRegs>();
        if (threadIdx.x != 0) return;
        // The empty barriers' phases start "completed" for the producer: it waits on the parity
        // before the current one (phase ^ 1), which a fresh mbarrier reports as done.
        int stage = 0, q_buffer = 0;
        unsigned phase = 0, q_phase = 0;
        for (int tile = blockIdx.x;;) {
            const unsigned q_full = smem_address(&q_barriers[q_buffer][0]);
            mbarrier_wait(smem_address(&q_barriers[q_buffer][1]), q_phase ^ 1);
            if (tile >= n_tiles) {
                q_tile[q_buffer] = -1;
                mbarrier_arrive(q_full);  // no more tiles: the consumers leave
                return;
            }
            // Block-sparse, the tiles of the longest mask rows first (FwdParams::query_tile_order).
            const int work = kIsBlockSparse && params.query_tile_order ? params.query_tile_order[tile] : tile;
            const int m_block = work % m_tiles, head_idx = work / m_tiles % params.heads,
                      batch_idx = work / m_tiles / params.heads;
            const int row0 = m_block * Kt::kBlockM, kv_head = head_idx / params.kv_group;
            const auto key_blocks = key_tiles<Kt::kBlockN, false, kIsBlockSparse>(
                params, batch_idx, head_idx, row0, min(Kt::kBlockM, params.seqlen_q - row0));
            q_tile[q_buffer] = tile;
            q_blocks[q_buffer] = key_blocks.end - key_blocks.begin;
            q_coords[q_buffer][0] = m_block;
            q_coords[q_buffer][1] = head_idx;
            q_coords[q_buffer][2] = batch_idx;
            if (key_blocks.begin < key_blocks.end)
                load_tile_tma<Kt, Kt::kBlockM>(sQ0 + q_buffer * Kt::kQTileBytes, maps.q, q_full, row0, head_idx,
                                               batch_idx);
            else
                mbarrier_arrive(q_full);  // no keys: the consumers write zeros and -inf
            if (++q_buffer == 2) q_buffer = 0, q_phase ^= 1;
            for (int t = key_blocks.begin; t < key_blocks.end; ++t) {
                const int col0 = key_blocks[t] * Kt::kBlockN;
                mbarrier_wait(smem_address(&k_barriers[stage][1]), phase ^ 1);
                stage_col0[stage] = col0;
                load_tile_tma<Kt, Kt::kBlockN>(sK0 + stage * Kt::kKvTileBytes, maps.k, smem_address(&k_barriers[stage][0]),
                                               col0, kv_head, batch_idx);
                mbarrier_wait(smem_address(&v_barriers[stage][1]), phase ^ 1);
                load_tile_tma<Kt, Kt::kBlockN>(sV0 + stage * Kt::kKvTileBytes, maps.v, smem_address(&v_barriers[stage][0]),
                                               col0, kv_head, batch_idx);
                if (++stage == kStages) stage = 0, phase ^= 1;
            }
            // Every tile makes one claim, and the launch's last sets the counter back to zero, so
            // that a launch replayed (a CUDA graph, a benchmark) starts as a fresh one does.
            const int claims = atomicAdd(next_tile, 1);
            if (claims == n_tiles - 1) *next_tile = 0;
            tile = gridDim.x + claims;
        }
    }

    setmaxnreg_inc<Kt::kConsumerRegs>();
    const int warp = threadIdx.x / 32 - 4, lane = threadIdx.x % 32;  // consumer warp 0..
    const int warpgroup = warp / 4;
    const Fragment f(lane);
    const float scale_log2 = static_cast<float>(params.scale_log2);
    // Each buffer is handed back by every warp once its products have read it.
    const auto release = [&](unsigned long long (&barriers)[kStages][2], int s) {
        __syncwarp();
        if (lane == 0) mbarrier_arrive(smem_address(&barriers[s][1]));
    };
    // The last tile's O_i rows leave through its Q_i buffer (the other one) while this tile's
    // first product runs: its storing thread waits for the TMA's read of them and hands the buffer
    // back there, not at the end of that tile, where its warpgroup would wait with it.
    bool store_pending = false;
    const auto hand_back_last = [&](int q_buffer) {
        if (store_pending && threadIdx.x % 128 == 0) {
            bulk_wait_group_read<0>();
            mbarrier_arrive(smem_address(&q_barriers[q_buffer ^ 1][1]));
        }
        store_pending = false;
    };
    int stage = 0, q_buffer = 0;
    unsigned phase = 0, q_phase = 0;
    for (;;) {
        mbarrier_wait(smem_address(&q_barriers[q_buffer][0]), q_phase);
        const int tile = q_tile[q_buffer];
        if (tile < 0) {
            hand_back_last(q_buffer);
            return;
        }
        const int m_block = q_coords[q_buffer][0], head_idx = q_coords[q_buffer][1], batch_idx = q_coords[q_buffer][2];
        const int warp_row0 = m_block * Kt::kBlockM + warp * Kt::kWarpRows;
        const unsigned sQ = sQ0 + q_buffer * Kt::kQTileBytes;

        float O[Kt::kMTiles][Kt::kHeadDim / 8][4];
        float m[Kt::kMTiles][2], l[Kt::kMTiles][2];
        // One step of Algorithm 1 over the next key block. The first (kFirst) starts m_i and l_i
        // and overwrites O_i with its P_ij V_j, FlashAttention-3's first step: no zeroing of O_i
        // and no rescale by 0. (d128 on an H200: 3% faster dense, 1-2% at density 0.1;
        // benchmarks/NOTES.md, session 44.)
        const auto step = [&](auto first) {
            constexpr bool kFirst = decltype(first)::value != 0;
            mbarrier_wait(smem_address(&k_barriers[stage][0]), phase);
            const int col0 = stage_col0[stage];
            float S[Kt::kMTiles][Kt::kNTiles][4];
            // This warpgroup's 64 rows of Q_i against all of K_j.
            wgmma_abt<Kt, Kt::kBlockN, Kt::kBlockM>(S[0], sQ + Kt::row_bytes(64 * warpgroup),
                                                    sK0 + stage * Kt::kKvTileBytes);
            release(k_barriers, stage);
            if constexpr (kFirst) hand_back_last(q_buffer);
            if (params.seqlen_k - col0 < Kt::kBlockN) mask_fragments<false, false>(S, warp_row0, col0, params, f);
            online_softmax_tc<Kt, false, kFirst>(S, O, m, l, scale_log2);
            unsigned P[Kt::kMTiles][Kt::kNTiles / 2][4];
            to_a_fragments<typename Kt::Op>(S, P);
            mbarrier_wait(smem_address(&v_barriers[stage][0]), phase);
            wgmma_ab_rs<Kt, Kt::kBlockN, true, kFirst>(O[0], P[0], sV0 + stage * Kt::kKvTileBytes);
            release(v_barriers, stage);
            if (++stage == kStages) stage = 0, phase ^= 1;
        };
        const int n_blocks = q_blocks[q_buffer];
        if (n_blocks > 0) {
            step(Index<1>());
            for (int t = 1; t < n_blocks; ++t) step(Index<0>());
        } else {
            // No key blocks: O_i = 0 and lse = -inf.
            zero(O);
#pragma unroll
            for (int h = 0; h < 2; ++h) m[0][h] = neg_inf<float>(), l[0][h] = 0.f;
            hand_back_last(q_buffer);
        }
        // O_i / l_i goes into this warp's rows of its Q_i buffer (every wgmma reading them is
        // done). Once the warpgroup's 64 rows are there, one thread has the TMA store them (rows
        // past seqlen_q and columns past head_dim clipped); it hands the buffer back during the
        // next tile's first product (hand_back_last), and the others go on at once. (Each warp
        // storing its own rows took 1.7-1.9 us a tile on an H200: benchmarks/NOTES.md, session 32.)
        normalize_rows<Kt>(params, O, m, l, batch_idx, head_idx, warp_row0, f);
        stage_rows<Kt, Kt::kBlockM>(sQ, O, warp * Kt::kWarpRows, f);
        fence_proxy_async();  // each thread's writes, before the TMA reads them
        named_barrier_sync(1 + warpgroup, 128);
        if (threadIdx.x % 128 == 0) {
            const unsigned rows = sQ + Kt::row_bytes(64 * warpgroup);
#pragma unroll
            for (int panel = 0; panel < Kt::kPanels; ++panel)
                tma_store_4d(maps.o, rows + panel * Kt::row_bytes(Kt::kBlockM), panel * kPanelColumns,
                             m_block * Kt::kBlockM + 64 * warpgroup, head_idx, batch_idx);
            bulk_commit_group();
        }
        store_pending = true;
        if (++q_buffer == 2) q_buffer = 0, q_phase ^= 1;
    }
}

}  // namespace cupyflash
