// The steps the tensor-core dK/dV kernels share, the mma.sync (sm80/bwd.cu) and the one-block
// wgmma (sm90/bwd_dkdv.cu) ones: the cp.async loads of a query block (Q_i, dO_i and its row
// statistics lse_i·log2(e), D_i), and the element-wise steps on a warp's keys x queries fragments
// (both kernels' warps hold mma.sync's fragment layout): P_ij^T from S_ij^T, dS_ij^T from dP_ij^T.
#pragma once
#include "tc/fragments.cuh"

namespace cupyflash {

// lse_i·log2(e) and D_i for the kBlockM queries of (batch, head) from q_row0. Rows past seqlen_q
// get lse = +inf, so their P_ij are exactly 0 whatever their (zero) scores. (These plain loads hold
// the first warps at their shared-memory stores; copied by cp.async instead, the Hopper d128 dK/dV
// kernel measured 3-4% slower.)
template <typename Bt, typename T = typename Bt::Accum>
__device__ __forceinline__ void load_row_stats(const BwdParams& params, T* sLse2, T* sD, int batch_idx, int head_idx,
                                               int q_row0) {
    const int rows_valid = min(Bt::kBlockM, params.seqlen_q - q_row0);
    const long long row_stats = row_vector_offset(params, batch_idx, head_idx) + q_row0;
    for (int i = threadIdx.x; i < Bt::kBlockM; i += Bt::kNThreads) {
        sLse2[i] = i < rows_valid ? static_cast<const T*>(params.lse_log2)[row_stats + i] : pos_inf<T>();
        sD[i] = i < rows_valid ? static_cast<const T*>(params.d)[row_stats + i] : T(0);
    }
}

// Q_i (asynchronously) and its row statistics. The addresses are formed here from the kernel
// parameters, not kept across the loop in registers, which the d64-d128 kernels have none to
// spare for.
template <typename Bt, typename T = typename Bt::Accum>
__device__ __forceinline__ void load_query_block(const BwdParams& params, unsigned sQ, T* sLse2, T* sD, int batch_idx,
                                                 int head_idx, int q_row0) {
    const int rows_valid = min(Bt::kBlockM, params.seqlen_q - q_row0);
    const auto* q = static_cast<const typename Bt::Storage*>(params.q) + batch_idx * params.q_batch_stride +
                    head_idx * params.q_head_stride + q_row0 * params.q_row_stride;
    load_tile_async<Bt, Bt::kBlockM>(sQ, q, params.q_row_stride, rows_valid, params.head_dim);
    load_row_stats<Bt>(params, sLse2, sD, batch_idx, head_idx, q_row0);
}

template <typename Bt>
__device__ __forceinline__ void load_dout_block(const BwdParams& params, unsigned sdO, int batch_idx, int head_idx,
                                                int q_row0) {
    const auto* dout = static_cast<const typename Bt::Storage*>(params.dout) + batch_idx * params.dout_batch_stride +
                       head_idx * params.dout_head_stride + q_row0 * params.dout_row_stride;
    load_tile_async<Bt, Bt::kBlockM>(sdO, dout, params.dout_row_stride, min(Bt::kBlockM, params.seqlen_q - q_row0),
                                     params.head_dim);
}

// P_ij^T = exp2(S_ij^T·scale·log2(e) - lse_i·log2(e)) in place of S_ij^T (the warp's keys from
// key0 + warp_keys, queries from q_row0 + warp_queries), masked where seqlen_k or the band cuts the
// tile. kScoreMod: P^T of the modified scores, and P^T ∘ dx (the modifier's derivative) rounded
// into Pt_dx as dS's factor in place of P^T: no fp32 tile outlives the step. float64 (Bt::kF64)
// keeps P^T ∘ dx unrounded, in an accumulator tile (PtDx: T[kMTiles][kNTiles][4]), and its sign
// marks a dropped element as the packed form's sign bit does.
template <typename Bt, bool kIsLocal, bool kScoreMod, typename Mod, typename Drop, typename PtDx,
          typename T = typename Bt::Accum>
__device__ __forceinline__ void probabilities_t(T (&St)[Bt::kMTiles][Bt::kNTiles][4], PtDx& Pt_dx,
                                                const BwdParams& params, const Mod& mod, const Drop& dropout,
                                                const T* sLse2_i, T scale_log2, int q_row0, int key0, int keys_valid,
                                                int warp_keys, int warp_queries, const Fragment& f) {
    using Op = typename Bt::Op;
    constexpr Tanh kTanh = Bt::kF64 ? Tanh::kAccurate : Tanh::kExp2;
    if (keys_valid < Bt::kBlockN ||
        (kIsLocal && band_cuts(params, q_row0, min(Bt::kBlockM, params.seqlen_q - q_row0), key0, keys_valid)))
        mask_fragments<kIsLocal, true>(St, key0 + warp_keys, q_row0 + warp_queries, params, f);
    if constexpr (kScoreMod) {
        // ALiBi's query + diagonal - key at this lane's first element; the others add a constant.
        const T offset0 = mod.offset(q_row0 + warp_queries + f.col(0, 0), key0 + warp_keys + f.row(0, 0));
        const auto modified_probabilities = [&](auto softcap) {
            constexpr bool kSoftcap = decltype(softcap)::value;
#pragma unroll
            for (int nt = 0; nt < Bt::kNTiles; ++nt) {
                const Vec<T, 2> lse2 = load_vec<2>(sLse2_i + warp_queries + f.col(nt, 0));
#pragma unroll
                for (int mt = 0; mt < Bt::kMTiles; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const T offset = offset0 + static_cast<T>(8 * nt - 16 * mt - 8 * h);
                        T dx0, dx1;
                        const T x0 = mod.template apply_at<kTanh, kSoftcap>(St[mt][nt][2 * h] * scale_log2,
                                                                            abs_(offset), dx0);
                        const T x1 = mod.template apply_at<kTanh, kSoftcap>(St[mt][nt][2 * h + 1] * scale_log2,
                                                                            abs_(offset + T(1)), dx1);
                        St[mt][nt][2 * h] = exp2_(x0 - lse2.x[0]);
                        St[mt][nt][2 * h + 1] = exp2_(x1 - lse2.x[1]);
                        if constexpr (Bt::kF64) {
                            Pt_dx[mt][nt][2 * h] = St[mt][nt][2 * h] * dx0;
                            Pt_dx[mt][nt][2 * h + 1] = St[mt][nt][2 * h + 1] * dx1;
                        } else {
                            Pt_dx[mt][nt / 2][(nt % 2) * 2 + h] =
                                Op::pack(St[mt][nt][2 * h] * dx0, St[mt][nt][2 * h + 1] * dx1);
                        }
                    }
            }
        };
        if (mod.softcap())
            modified_probabilities(BoolConstant<true>());
        else
            modified_probabilities(BoolConstant<false>());
        // Dropout (scalar/bwd_steps.cuh): a dropped P^T is 0 for dV_j, and its factor of dS carries
        // the drop in its sign, P^T ∘ dx >= 0 being negated.
        if (dropout.active())
            for_dropped<true, Bt::kMTiles, Bt::kNTiles>(
                dropout, key0 + warp_keys, q_row0 + warp_queries, f, [&](int mt, int nt, int i) {
                    St[mt][nt][i] = T(0);
                    if constexpr (Bt::kF64)
                        Pt_dx[mt][nt][i] = -Pt_dx[mt][nt][i];
                    else
                        Pt_dx[mt][nt / 2][(nt % 2) * 2 + i / 2] ^= i % 2 ? 0x80000000u : 0x8000u;  // sign bit
                });
    } else {
#pragma unroll
        for (int nt = 0; nt < Bt::kNTiles; ++nt) {
            const Vec<T, 2> lse2 = load_vec<2>(sLse2_i + warp_queries + f.col(nt, 0));
#pragma unroll
            for (int mt = 0; mt < Bt::kMTiles; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    St[mt][nt][2 * h] = exp2_(fma_(St[mt][nt][2 * h], scale_log2, -lse2.x[0]));
                    St[mt][nt][2 * h + 1] = exp2_(fma_(St[mt][nt][2 * h + 1], scale_log2, -lse2.x[1]));
                }
        }
    }
}

// dS_ij^T = P^T ∘ (dP^T - D_i) in place of dP_ij^T, with P^T in float32 as computed (St), not as
// rounded to the input type for dV_j's product: FlashAttention-2's order. Taken from the rounded
// P^T, dS carried that rounding on top of its own, and on problems of a few keys (large P) the
// 16-bit dq and dk exceeded the 2x rule about twice as often as FlashAttention-2's. (The Hopper
// kernels keep P^T as its rounding and FP8 remainders: sm90/bwd_steps.cuh's p_remainders.)
template <typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void scores_gradient_t(T (&dPt)[kMTiles][kNTiles][4], const T (&St)[kMTiles][kNTiles][4],
                                                  const T* sD_i, int warp_queries, const Fragment& f) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
        const Vec<T, 2> d_i = load_vec<2>(sD_i + warp_queries + f.col(nt, 0));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                dPt[mt][nt][2 * h] = St[mt][nt][2 * h] * (dPt[mt][nt][2 * h] - d_i.x[0]);
                dPt[mt][nt][2 * h + 1] = St[mt][nt][2 * h + 1] * (dPt[mt][nt][2 * h + 1] - d_i.x[1]);
            }
    }
}

// The same with score modifiers or dropout: dS's factor P^T ∘ dx as rounded into A fragments by
// probabilities_t (float64: as computed), its sign bit marking a dropped element.
template <typename Bt, typename PtDx, typename T = typename Bt::Accum>
__device__ __forceinline__ void modified_scores_gradient_t(T (&dPt)[Bt::kMTiles][Bt::kNTiles][4], const PtDx& Pt_dx,
                                                           const T* sD_i, int warp_queries, const Fragment& f) {
    using Op = typename Bt::Op;
#pragma unroll
    for (int nt = 0; nt < Bt::kNTiles; ++nt) {
        const Vec<T, 2> d_i = load_vec<2>(sD_i + warp_queries + f.col(nt, 0));
#pragma unroll
        for (int mt = 0; mt < Bt::kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // dropped (negative): -D_i' instead of dP - D_i'
                if constexpr (Bt::kF64) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const T p = Pt_dx[mt][nt][2 * h + e];
                        dPt[mt][nt][2 * h + e] = p * (p >= T(0) ? dPt[mt][nt][2 * h + e] - d_i.x[e] : d_i.x[e]);
                    }
                } else {
                    // A fragment register r holds rows h = r % 2 of n8 tile 2kk + r / 2.
                    const float2 p = Op::unpack(Pt_dx[mt][nt / 2][(nt % 2) * 2 + h]);
                    dPt[mt][nt][2 * h] = p.x * (p.x >= 0.f ? dPt[mt][nt][2 * h] - d_i.x[0] : d_i.x[0]);
                    dPt[mt][nt][2 * h + 1] = p.y * (p.y >= 0.f ? dPt[mt][nt][2 * h + 1] - d_i.x[1] : d_i.x[1]);
                }
            }
    }
}

}  // namespace cupyflash
