// Attention forward on Hopper, warp-specialised and persistent (FlashAttention-3's structure): a
// producer warpgroup asks the TMA for Q_i, K_j, V_j while two consumer warpgroups compute and have
// the TMA store O_i; one block per SM walks the query tiles in turn (its tile scheduler: a claim
// counter, and for block masks an order that starts the longest rows first).
#include "sm90/wgmma.cuh"

namespace cupyflash {

// The warp-specialised forward's tensor maps: Q's, K's and V's like KvTensorMaps' (Q's boxes a
// query tile's rows), and O's, whose boxes are a consumer warpgroup's 64 rows.
struct FwdWsTensorMaps {
    TensorMap q, k, v, o;
};
static_assert(sizeof(FwdWsTensorMaps) == 512, "cupyflash/runtime/tma.py passes 4 x 128 bytes");

// The warp-specialised, persistent forward (WgmmaFwdWsTraits): dense or block-sparse, not local,
// no score modifiers, not packed. Grid: (blocks, at most one per SM). Block: Kt::kNThreadsAll.
// The n_tiles = query tiles x heads x batch go in order, query tiles fastest (a head's K, V stay
// in L2 while its tiles run): block b takes tile b first, then the next unclaimed one
// (`next_tile`: zero at launch and at exit, it counts the claims), so that blocks whose tiles had
// few key blocks take more tiles. A block mask whose rows differ in length gives the order
// (params.query_tile_order: the longest rows' tiles first). Per tile the same steps as
// flash_fwd_sm90_kernel, Algorithm 1 of FlashAttention-2, split between the roles:
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
        // and no rescale by 0. (d128 on an H200: 3% faster dense, 1-2% at density 0.1.)
        const auto step = [&](auto first) {
            constexpr bool kFirst = decltype(first)::value != 0;
            mbarrier_wait(smem_address(&k_barriers[stage][0]), phase);
            // Lane 0 reads the stage's first key for its warp: the lane that hands the stage back
            // must be the one that read it, or compute-sanitizer's racecheck, which credits an
            // mbarrier arrival only with the arriving thread's own accesses, reports a race.
            int col0 = lane == 0 ? stage_col0[stage] : 0;
            col0 = __shfl_sync(0xffffffffu, col0, 0);
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
        // storing its own rows took 1.7-1.9 us a tile on an H200.)
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
