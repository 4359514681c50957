// Steps of the Hopper dK/dV kernels (sm90/bwd_dkdv.cu, sm90/bwd_dkdv_ws.cu): Q_i and dO_i by the
// TMA, and dQ_i's 64 x 64 shares, added to the float32 workspace by atomics or by the TMA.
#pragma once
#include "sm90/wgmma.cuh"
#include "tc/bwd_steps.cuh"

namespace cupyflash {

// P^T's remainders after its rounding to the input type (the A fragments Pt that dV_j's product
// takes), kept for dS (tc/bwd_steps.cuh's scores_gradient_t says why) in a quarter of float32
// P^T's registers: four per register as FP8 e4m3 after scaling by 2^16 (a remainder is at most
// 2^-9 of a probability <= 1; e4m3's 4 significant bits then carry P^T to 12 of bf16, 15 of
// fp16). The remainders of probabilities below about 2^-13 fall under e4m3's range, and their
// dS is off by less than 2^-22 of |dP - D|. Register q of k16 step kk: n8 tile 2kk + q.
constexpr float kRemainderScale = 65536.f;
__device__ __forceinline__ unsigned e4m3x4(float x0, float x1, float x2, float x3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
    return lo | static_cast<unsigned>(hi) << 16;
}
// Elements 2h and 2h + 1 of an e4m3x4 register, as floats.
__device__ __forceinline__ float2 from_e4m3x2(unsigned x, int h) {
    const unsigned short pair = static_cast<unsigned short>(x >> (16 * h));
    float lo, hi;
    asm("{\n .reg .b32 h2;\n .reg .b16 l, u;\n cvt.rn.f16x2.e4m3x2 h2, %2;\n mov.b32 {l, u}, h2;\n"
        " cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, u;\n}\n"
        : "=f"(lo), "=f"(hi)
        : "h"(pair));
    return make_float2(lo, hi);
}
template <typename Op, int kNTiles>
__device__ __forceinline__ void p_remainders(const float (&St)[1][kNTiles][4], const unsigned (&Pt)[1][kNTiles / 2][4],
                                             unsigned (&Rt)[1][kNTiles / 2][2]) {
#pragma unroll
    for (int kk = 0; kk < kNTiles / 2; ++kk)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const float* c = St[0][2 * kk + q];
            const float2 a = Op::unpack(Pt[0][kk][2 * q]), b = Op::unpack(Pt[0][kk][2 * q + 1]);
            Rt[0][kk][q] = e4m3x4((c[0] - a.x) * kRemainderScale, (c[1] - a.y) * kRemainderScale,
                                  (c[2] - b.x) * kRemainderScale, (c[3] - b.y) * kRemainderScale);
        }
}
// dS_ij^T = P^T ∘ (dP^T - D_i) in place of dP_ij^T (kNTiles n8 tiles of queries from sD_i +
// query0), P^T from its rounding Pt and remainders Rt.
template <typename Op, int kNTiles>
__device__ __forceinline__ void scores_gradient_t(float (&dPt)[1][kNTiles][4], const unsigned (&Pt)[1][kNTiles / 2][4],
                                                  const unsigned (&Rt)[1][kNTiles / 2][2], const float* sD_i,
                                                  int query0, const Fragment& f) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
        const float2 d_i = *reinterpret_cast<const float2*>(sD_i + query0 + f.col(nt, 0));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 p = Op::unpack(Pt[0][nt / 2][(nt % 2) * 2 + h]);
            const float2 r = from_e4m3x2(Rt[0][nt / 2][nt % 2], h);
            dPt[0][nt][2 * h] = fmaf(r.x, 1.f / kRemainderScale, p.x) * (dPt[0][nt][2 * h] - d_i.x);
            dPt[0][nt][2 * h + 1] = fmaf(r.y, 1.f / kRemainderScale, p.y) * (dPt[0][nt][2 * h + 1] - d_i.y);
        }
    }
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
