// The steps of FlashAttention-2's backward pass (Dao, 2023, Algorithm 2) that the forward does not
// already have. With S_ij = scale · Q_i K_j^T and the saved lse_i:
//   P_ij = exp(S_ij - lse_i)               (recomputed, never stored)
//   dV_j += P_ij^T dO_i,   dP_ij = dO_i V_j^T,   dS_ij = P_ij ∘ (dP_ij - D_i)
//   dK_j += scale · dS_ij^T Q_i,   dQ_i += scale · dS_ij K_j
// where D_i = rowsum(dO_i ∘ O_i) comes from a preprocessing pass (rows/bwd_rows.cu). With dropout
// (keep mask Z, keep probability 1 - p, O = (P ∘ Z / (1 - p)) V) the same steps hold with
// P ∘ Z / (1 - p) in dV_j and dP_ij ∘ Z / (1 - p) in dS_ij; as in FlashAttention-2, D_i is stored
// times (1 - p), so that
//   dS_ij = P_ij ∘ (Z_ij ? dP_ij - D_i' : -D_i') / (1 - p),   D_i' = (1 - p) D_i,
// and the 1 / (1 - p) goes on dV_j, dK_j and dQ_i when they are written. The matrix products reuse the
// forward's compute_scores (A B^T) and accumulate_pv (A B) on shared-memory tiles.
#pragma once
#include "scalar/fwd_steps.cuh"

namespace cupyflash {

// Transposed mask for a tile of S^T (rows: keys from key0, columns: queries from query0): -inf
// for keys past seqlen_k and, with local attention, keys outside the band.
template <typename Grid, bool kIsLocal>
__device__ __forceinline__ void apply_mask_transposed(
    typename Grid::Accum (&St)[Grid::kRowsPerThread][Grid::kSColsPerThread], int key0, int query0,
    const BwdParams& params, int ty, int tx) {
    using Accum = typename Grid::Accum;
#pragma unroll
    for (int i = 0; i < Grid::kRowsPerThread; ++i) {
        const int key = key0 + ty * Grid::kRowsPerThread + i;
#pragma unroll
        for (int jm = 0; jm < Grid::kSColsPerThread; ++jm) {
            const int query = query0 + tx + jm * Grid::kColGroups;
            if (key >= params.seqlen_k || (kIsLocal && band_hides(params, query, key))) St[i][jm] = neg_inf<Accum>();
        }
    }
}

// Writes a register tile laid out like the forward's O_i (this thread's rows, columns in kOChunks
// chunks of kVecO) times `scale` to global memory; rows >= rows_valid and columns >= head_dim are
// padding and are skipped.
template <typename Grid>
__device__ __forceinline__ void store_tile(
    typename Grid::Storage* g_tile, long long row_stride, int rows_valid, int head_dim,
    const typename Grid::Accum (&X)[Grid::kRowsPerThread][Grid::kOColsPerThread],
    typename Grid::Accum scale, int ty, int tx) {
#pragma unroll
    for (int i = 0; i < Grid::kRowsPerThread; ++i) {
        const int row = ty * Grid::kRowsPerThread + i;
        if (row >= rows_valid) continue;
#pragma unroll
        for (int jc = 0; jc < Grid::kOChunks; ++jc)
#pragma unroll
            for (int e = 0; e < Grid::kVecO; ++e) {
                const int col = (jc * Grid::kColGroups + tx) * Grid::kVecO + e;
                if (col < head_dim)
                    g_tile[row * row_stride + col] = Grid::Numeric::from_accum(X[i][jc * Grid::kVecO + e] * scale);
            }
    }
}

// X += A B for a tile (A: this thread's rows of sA, kBlockN columns; B: kBlockN rows of sB), the
// forward's accumulate_pv, except that each tile's contribution is summed on its own before it is
// added (two-level summation). dK_j, dV_j and dQ_i sum over a whole sequence; this way their
// rounding grows with the number of tiles plus the tile length, not with the sequence length.
// Costs kRowsPerThread x kVecO registers and one re-read of A per column chunk.
template <typename Grid>
__device__ __forceinline__ void accumulate_tile_sum(
    typename Grid::Accum (&X)[Grid::kRowsPerThread][Grid::kOColsPerThread],
    const typename Grid::Accum* sA, const typename Grid::Accum* sB, int ty, int tx) {
    using Accum = typename Grid::Accum;
    constexpr int kVec = Grid::kVecK;
    constexpr int kVecO = Grid::kVecO;
#pragma unroll
    for (int jc = 0; jc < Grid::kOChunks; ++jc) {
        Accum part[Grid::kRowsPerThread][kVecO];
#pragma unroll
        for (int i = 0; i < Grid::kRowsPerThread; ++i)
#pragma unroll
            for (int e = 0; e < kVecO; ++e) part[i][e] = Accum(0);
#pragma unroll 2
        for (int n = 0; n < Grid::kBlockN; n += kVec) {
            Vec<Accum, kVec> a[Grid::kRowsPerThread];
#pragma unroll
            for (int i = 0; i < Grid::kRowsPerThread; ++i)
                a[i] = load_vec<kVec>(sA + (ty * Grid::kRowsPerThread + i) * Grid::kPStride + n);
#pragma unroll
            for (int kk = 0; kk < kVec; ++kk) {
                const Vec<Accum, kVecO> b =
                    load_vec<kVecO>(sB + (n + kk) * Grid::kQKVStride + (jc * Grid::kColGroups + tx) * kVecO);
#pragma unroll
                for (int i = 0; i < Grid::kRowsPerThread; ++i)
#pragma unroll
                    for (int e = 0; e < kVecO; ++e) part[i][e] = fma(a[i].x[kk], b.x[e], part[i][e]);
            }
        }
#pragma unroll
        for (int i = 0; i < Grid::kRowsPerThread; ++i)
#pragma unroll
            for (int e = 0; e < kVecO; ++e) X[i][jc * kVecO + e] += part[i][e];
    }
}

template <typename Grid>
__device__ __forceinline__ void zero_tile(typename Grid::Accum (&X)[Grid::kRowsPerThread][Grid::kOColsPerThread]) {
#pragma unroll
    for (int i = 0; i < Grid::kRowsPerThread; ++i)
#pragma unroll
        for (int c = 0; c < Grid::kOColsPerThread; ++c) X[i][c] = typename Grid::Accum(0);
}

// dQ_i += scale · dS_ij K_j into the float32 (float64) workspace (kRescale: scale times dropout's
// 1 / (1 - p)). Atomics, because every key block adds to the same dQ_i; their order, and so the
// last bits of dQ, vary from run to run.
template <typename Grid, bool kRescale = false>
__device__ __forceinline__ void atomic_add_dq(
    const BwdParams& params, const typename Grid::Accum (&dQ)[Grid::kRowsPerThread][Grid::kOColsPerThread],
    int batch_idx, int head_idx, int row0, int ty, int tx) {
    using Accum = typename Grid::Accum;
    Accum* dq_accum = static_cast<Accum*>(params.dq_accum);
    const Accum scale = static_cast<Accum>(params.scale);
#pragma unroll
    for (int i = 0; i < Grid::kRowsPerThread; ++i) {
        const int row = row0 + ty * Grid::kRowsPerThread + i;
        if (row >= params.seqlen_q) continue;
        Accum* dq_row = dq_accum + dq_accum_offset(params, batch_idx, row, head_idx);
#pragma unroll
        for (int jc = 0; jc < Grid::kOChunks; ++jc)
#pragma unroll
            for (int e = 0; e < Grid::kVecO; ++e) {
                const int col = (jc * Grid::kColGroups + tx) * Grid::kVecO + e;
                if (col < params.head_dim) {
                    if constexpr (kRescale)
                        atomicAdd(dq_row + col, dQ[i][jc * Grid::kVecO + e] * (scale * static_cast<Accum>(params.dropout_rescale)));
                    else
                        atomicAdd(dq_row + col, dQ[i][jc * Grid::kVecO + e] * scale);
                }
            }
    }
}

}  // namespace cupyflash
