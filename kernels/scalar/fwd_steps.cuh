// The steps of FlashAttention-2's forward pass (Dao, 2023, Algorithm 1), one device function each:
//   load tile -> scores S_ij = Q_i K_j^T -> mask -> online softmax (m_i, l_i, rescale O_i)
//   -> O_i += P_ij V_j -> epilogue (O_i / l_i, lse_i).
// Each thread holds kRowsPerThread rows of S_ij and of O_i in registers; the functions below take
// its row-group (ty) and column-group (tx) coordinates in the FwdTraits thread grid.
#pragma once
#include "scalar/traits.cuh"
#include "common/tile_sequence.cuh"
#include "common/score_mod.cuh"

namespace cupyflash {

// Copies a kRows x head_dim tile from global memory into shared memory, widened to Accum and
// multiplied by `scale`; rows >= rows_valid and columns >= head_dim become 0, so padding adds
// nothing to Q K^T and no stale value (possibly NaN) of V meets a zero probability.
template <typename Kt, int kRows>
__device__ __forceinline__ void load_tile(typename Kt::Accum* s_tile,
                                          const typename Kt::Storage* g_tile, long long row_stride,
                                          int rows_valid, int head_dim, typename Kt::Accum scale) {
    using Storage = typename Kt::Storage;
    constexpr int kPerThread = kRows * Kt::kHeadDim / Kt::kNThreads;
    // Loads are issued in batches of independent registers before any is stored, so a thread
    // waits for one memory latency per batch rather than one per element.
    constexpr int kBatch = gcd_(kPerThread, 8);
    static_assert(kRows * Kt::kHeadDim % Kt::kNThreads == 0, "threads must tile the tile evenly");
#pragma unroll 1
    for (int first = 0; first < kPerThread; first += kBatch) {
        Storage x[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
            // Consecutive threads take consecutive columns: coalesced along the contiguous head dim.
            const int idx = threadIdx.x + (first + b) * Kt::kNThreads;
            const int row = idx / Kt::kHeadDim, col = idx % Kt::kHeadDim;
            x[b] = row < rows_valid && col < head_dim ? g_tile[row * row_stride + col] : Storage(0);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
            const int idx = threadIdx.x + (first + b) * Kt::kNThreads;
            const int row = idx / Kt::kHeadDim, col = idx % Kt::kHeadDim;
            s_tile[row * Kt::kQKVStride + col] = Kt::Numeric::to_accum(x[b]) * scale;
        }
    }
}

// S_ij = Q_i K_j^T for this thread's rows and columns (column c of the tile is tx + jn*kColGroups).
template <typename Kt>
__device__ __forceinline__ void compute_scores(
    typename Kt::Accum (&S)[Kt::kRowsPerThread][Kt::kSColsPerThread],
    const typename Kt::Accum* sQ, const typename Kt::Accum* sK, int ty, int tx) {
    using Accum = typename Kt::Accum;
    constexpr int kVec = Kt::kVecK;
#pragma unroll
    for (int i = 0; i < Kt::kRowsPerThread; ++i)
#pragma unroll
        for (int jn = 0; jn < Kt::kSColsPerThread; ++jn) S[i][jn] = Accum(0);
#pragma unroll 2
    for (int d = 0; d < Kt::kHeadDim; d += kVec) {
        Vec<Accum, kVec> q[Kt::kRowsPerThread], k[Kt::kSColsPerThread];
#pragma unroll
        for (int i = 0; i < Kt::kRowsPerThread; ++i)
            q[i] = load_vec<kVec>(sQ + (ty * Kt::kRowsPerThread + i) * Kt::kQKVStride + d);
#pragma unroll
        for (int jn = 0; jn < Kt::kSColsPerThread; ++jn)
            k[jn] = load_vec<kVec>(sK + (tx + jn * Kt::kColGroups) * Kt::kQKVStride + d);
#pragma unroll
        for (int kk = 0; kk < kVec; ++kk)
#pragma unroll
            for (int i = 0; i < Kt::kRowsPerThread; ++i)
#pragma unroll
                for (int jn = 0; jn < Kt::kSColsPerThread; ++jn)
                    S[i][jn] = fma(q[i].x[kk], k[jn].x[kk], S[i][jn]);
    }
}

// Sets to -inf the scores of keys past seqlen_k and, with local attention, of keys outside the
// band. Called only on tiles that a boundary cuts through.
template <typename Kt, bool kIsLocal, typename Params>
__device__ __forceinline__ void apply_mask(
    typename Kt::Accum (&S)[Kt::kRowsPerThread][Kt::kSColsPerThread], int row0, int col0,
    const Params& params, int ty, int tx) {
    using Accum = typename Kt::Accum;
#pragma unroll
    for (int i = 0; i < Kt::kRowsPerThread; ++i) {
        const int row = row0 + ty * Kt::kRowsPerThread + i;
#pragma unroll
        for (int jn = 0; jn < Kt::kSColsPerThread; ++jn) {
            const int col = col0 + tx + jn * Kt::kColGroups;
            if (col >= params.seqlen_k || (kIsLocal && band_hides(params, row, col))) S[i][jn] = neg_inf<Accum>();
        }
    }
}

// S = mod(S) for this thread's scores (log2 units; queries from row0, keys from col0): softcap
// and ALiBi, kScoreMod instantiations only.
template <typename Kt>
__device__ __forceinline__ void apply_score_mod(
    typename Kt::Accum (&S)[Kt::kRowsPerThread][Kt::kSColsPerThread], const ScoreMod<typename Kt::Accum>& mod,
    int row0, int col0, int ty, int tx) {
    using Accum = typename Kt::Accum;
#pragma unroll
    for (int i = 0; i < Kt::kRowsPerThread; ++i)
#pragma unroll
        for (int jn = 0; jn < Kt::kSColsPerThread; ++jn) {
            Accum dx;
            S[i][jn] = mod.template apply<Tanh::kAccurate>(S[i][jn], row0 + ty * Kt::kRowsPerThread + i,
                                                 col0 + tx + jn * Kt::kColGroups, dx);
        }
}

// P_ij ∘ Z_ij: this thread's dropped probabilities become 0 (rows: queries from row0, columns: keys
// from col0). Applied after the row sums l_i took them in: the softmax is over every key, and
// only what it weighs V with is thinned, as dropout on the attention probabilities means.
template <typename Kt>
__device__ __forceinline__ void apply_dropout(
    typename Kt::Accum (&P)[Kt::kRowsPerThread][Kt::kSColsPerThread], const Dropout& dropout, int row0, int col0,
    int ty, int tx) {
#pragma unroll
    for (int i = 0; i < Kt::kRowsPerThread; ++i)
#pragma unroll
        for (int jn = 0; jn < Kt::kSColsPerThread; ++jn)
            if (!dropout.keep(row0 + ty * Kt::kRowsPerThread + i, col0 + tx + jn * Kt::kColGroups))
                P[i][jn] = typename Kt::Accum(0);
}

// Reduces over the kColGroups threads that share a row (adjacent lanes of one warp).
template <typename Kt, typename T, typename Op>
__device__ __forceinline__ T row_allreduce(T x, Op op) {
#pragma unroll
    for (int offset = Kt::kColGroups / 2; offset > 0; offset /= 2) x = op(x, shfl_xor(x, offset));
    return x;
}

// Online softmax (Algorithm 1, lines 9-10): m_i^(j) = max(m_i^(j-1), rowmax(S_ij)),
// P_ij = exp2(S_ij - m_i^(j)), l_i^(j) = e^(m^(j-1) - m^(j)) l_i^(j-1) + rowsum(P_ij), and O_i is
// rescaled by the same factor. S is overwritten with P. l_i stays a per-thread partial sum (the
// rows' other threads hold the rest) until the epilogue: FA2's deferred reduction.
template <typename Kt>
__device__ __forceinline__ void online_softmax(
    typename Kt::Accum (&S)[Kt::kRowsPerThread][Kt::kSColsPerThread],
    typename Kt::Accum (&O)[Kt::kRowsPerThread][Kt::kOColsPerThread],
    typename Kt::Accum (&m)[Kt::kRowsPerThread], typename Kt::Accum (&l)[Kt::kRowsPerThread]) {
    using Accum = typename Kt::Accum;
#pragma unroll
    for (int i = 0; i < Kt::kRowsPerThread; ++i) {
        Accum m_tile = S[i][0];
#pragma unroll
        for (int jn = 1; jn < Kt::kSColsPerThread; ++jn) m_tile = max_(m_tile, S[i][jn]);
        m_tile = row_allreduce<Kt>(m_tile, [](Accum a, Accum b) { return max_(a, b); });
        const Accum m_new = max_(m[i], m_tile);
        // A row with every key masked so far has m_new = -inf; subtracting 0 instead keeps
        // exp2(-inf - (-inf)) = NaN out, and its probabilities come out exactly 0.
        const Accum m_safe = m_new == neg_inf<Accum>() ? Accum(0) : m_new;
        const Accum rescale = exp2_(m[i] - m_safe);
        Accum row_sum = Accum(0);
#pragma unroll
        for (int jn = 0; jn < Kt::kSColsPerThread; ++jn) {
            S[i][jn] = exp2_(S[i][jn] - m_safe);
            row_sum += S[i][jn];
        }
        l[i] = l[i] * rescale + row_sum;
        m[i] = m_new;
#pragma unroll
        for (int c = 0; c < Kt::kOColsPerThread; ++c) O[i][c] *= rescale;
    }
}

template <typename Kt>
__device__ __forceinline__ void store_P(
    typename Kt::Accum* sP, const typename Kt::Accum (&P)[Kt::kRowsPerThread][Kt::kSColsPerThread],
    int ty, int tx) {
#pragma unroll
    for (int i = 0; i < Kt::kRowsPerThread; ++i)
#pragma unroll
        for (int jn = 0; jn < Kt::kSColsPerThread; ++jn)
            sP[(ty * Kt::kRowsPerThread + i) * Kt::kPStride + tx + jn * Kt::kColGroups] = P[i][jn];
}

// O_i += P_ij V_j. This thread's output columns come in kOChunks chunks of kVecO; chunk jc starts
// at column (jc * kColGroups + tx) * kVecO, so a warp reads contiguous runs of each V row.
template <typename Kt>
__device__ __forceinline__ void accumulate_pv(
    typename Kt::Accum (&O)[Kt::kRowsPerThread][Kt::kOColsPerThread],
    const typename Kt::Accum* sP, const typename Kt::Accum* sV, int ty, int tx) {
    using Accum = typename Kt::Accum;
    constexpr int kVec = Kt::kVecK;
    constexpr int kVecO = Kt::kVecO;
#pragma unroll 2
    for (int n = 0; n < Kt::kBlockN; n += kVec) {
        Vec<Accum, kVec> p[Kt::kRowsPerThread];
#pragma unroll
        for (int i = 0; i < Kt::kRowsPerThread; ++i)
            p[i] = load_vec<kVec>(sP + (ty * Kt::kRowsPerThread + i) * Kt::kPStride + n);
#pragma unroll
        for (int kk = 0; kk < kVec; ++kk) {
#pragma unroll
            for (int jc = 0; jc < Kt::kOChunks; ++jc) {
                const Vec<Accum, kVecO> v = load_vec<kVecO>(
                    sV + (n + kk) * Kt::kQKVStride + (jc * Kt::kColGroups + tx) * kVecO);
#pragma unroll
                for (int i = 0; i < Kt::kRowsPerThread; ++i)
#pragma unroll
                    for (int e = 0; e < kVecO; ++e)
                        O[i][jc * kVecO + e] = fma(p[i].x[kk], v.x[e], O[i][jc * kVecO + e]);
            }
        }
    }
}

// Algorithm 1, lines 12-14: O_i = O_i / l_i and lse_i = m_i + log(l_i), written once. A row that
// saw no key (l_i = 0) gets output 0 and lse -inf; a NaN stays NaN (saw_keys). kRescale: O_i times out_scale as well (dropout's
// 1 / (1 - p)); without it the code is exactly what it was before dropout existed (a division of a
// runtime 1 instead of the constant changed NVRTC's code and spilled some kernels).
template <typename Kt, bool kRescale = false>
__device__ __forceinline__ void epilogue(
    const FwdParams& params, const typename Kt::Accum (&O)[Kt::kRowsPerThread][Kt::kOColsPerThread],
    const typename Kt::Accum (&m)[Kt::kRowsPerThread], const typename Kt::Accum (&l)[Kt::kRowsPerThread],
    int batch_idx, int head_idx, int row0, int ty, int tx, typename Kt::Accum out_scale = 1) {
    using Accum = typename Kt::Accum;
    using Storage = typename Kt::Storage;
    Storage* o = static_cast<Storage*>(params.o);
#pragma unroll
    for (int i = 0; i < Kt::kRowsPerThread; ++i) {
        const Accum l_row = row_allreduce<Kt>(l[i], [](Accum a, Accum b) { return a + b; });
        const int row = row0 + ty * Kt::kRowsPerThread + i;
        if (row >= params.seqlen_q) continue;
        const Accum inv_l = saw_keys(l_row) ? (kRescale ? out_scale / l_row : Accum(1) / l_row) : Accum(0);
        Storage* o_row = o + batch_idx * params.o_batch_stride + row * params.o_row_stride +
                         head_idx * params.o_head_stride;
#pragma unroll
        for (int jc = 0; jc < Kt::kOChunks; ++jc)
#pragma unroll
            for (int e = 0; e < Kt::kVecO; ++e) {
                const int col = (jc * Kt::kColGroups + tx) * Kt::kVecO + e;
                if (col < params.head_dim)
                    o_row[col] = Kt::Numeric::from_accum(O[i][jc * Kt::kVecO + e] * inv_l);
            }
        if (tx == 0) {
            // m_i is in log2 units (scores were prescaled by log2(e)).
            // In double: the backward rebuilds every P_ij = exp(S_ij - lse_i) of the row from it,
            // so its rounding error becomes a relative error common to the whole row.
            const Accum lse = saw_keys(l_row)
                                  ? static_cast<Accum>(static_cast<double>(m[i]) * kLn2 + log(static_cast<double>(l_row)))
                                  : neg_inf<Accum>();
            // Kept in Accum precision: the backward pass recomputes P_ij = exp(S_ij - lse_i) from it.
            static_cast<Accum*>(params.lse)[batch_idx * params.lse_batch_stride + head_idx * params.lse_head_stride +
                                            row] = lse;
        }
    }
}

}  // namespace cupyflash
