// Steps of the Hopper dK/dV kernels (sm90/bwd_dkdv.cu, sm90/bwd_dkdv_ws.cu): Q_i and dO_i by the
// TMA, and dQ_i's 64 x 64 shares, added to the float32 workspace by atomics or by the TMA.
#pragma once
#include "sm90/wgmma.cuh"
#include "tc/bwd_steps.cuh"

namespace cupyflash {

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

}  // namespace cupyflash
