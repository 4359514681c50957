// The tensor-core dK/dV kernels' cp.async loads of a query block: Q_i, dO_i and its row statistics
// (lse_i·log2(e), D_i), shared by the mma.sync and the one-block wgmma kernels.
#pragma once
#include "tc/fragments.cuh"

namespace cupyflash {

// lse_i·log2(e) and D_i for the kBlockM queries of (batch, head) from q_row0. Rows past seqlen_q
// get lse = +inf, so their P_ij are exactly 0 whatever their (zero) scores. (These plain loads hold
// the first warps at their shared-memory stores; copied by cp.async instead, the Hopper d128 dK/dV
// kernel measured 3-4% slower.)
template <typename Bt>
__device__ __forceinline__ void load_row_stats(const BwdParams& params, float* sLse2, float* sD, int batch_idx,
                                               int head_idx, int q_row0) {
    const int rows_valid = min(Bt::kBlockM, params.seqlen_q - q_row0);
    const long long row_stats = row_vector_offset(params, batch_idx, head_idx) + q_row0;
    for (int i = threadIdx.x; i < Bt::kBlockM; i += Bt::kNThreads) {
        sLse2[i] = i < rows_valid ? static_cast<const float*>(params.lse_log2)[row_stats + i] : pos_inf<float>();
        sD[i] = i < rows_valid ? static_cast<const float*>(params.d)[row_stats + i] : 0.f;
    }
}

// Q_i (asynchronously) and its row statistics. The addresses are formed here from the kernel
// parameters, not kept across the loop in registers, which the d64-d128 kernels have none to
// spare for.
template <typename Bt>
__device__ __forceinline__ void load_query_block(const BwdParams& params, unsigned sQ, float* sLse2, float* sD,
                                                 int batch_idx, int head_idx, int q_row0) {
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

}  // namespace cupyflash
