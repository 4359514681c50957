// Which keys a query sees: the band of causal and sliding-window attention (aligned bottom-right),
// the lengths of one sequence of a variable-length batch, and the key tiles a query tile visits.
#pragma once
#include "common/params.cuh"

namespace cupyflash {

// The sequence that batch entry batch_idx is, in a variable-length batch (FlashAttention-2's varlen
// layout): its queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of packed
// [total, heads, head_dim] arrays, its keys likewise, or (seqused_k, a padded batch) the first
// seqused_k[b] keys of its row of the batch. Returns the parameters with this sequence's seqlen_q,
// seqlen_k and band, which the host gives relative to the diagonal (band_first = -left) as every
// sequence has its own; q_batch and k_batch become what the addresses take as the batch index:
// the first packed row, the host having set each packed array's batch stride to its row stride.
// Fixed-length kernels (kVarlen false) get the launch's parameters and the batch index unchanged.
template <bool kVarlen, typename Params>
__device__ __forceinline__ Params sequence_params(const Params& launch, int batch_idx, int& q_batch, int& k_batch) {
    q_batch = k_batch = batch_idx;
    if constexpr (!kVarlen) {
        return launch;
    } else {
        Params params = launch;
        if (params.cu_seqlens_q != nullptr) {
            q_batch = params.cu_seqlens_q[batch_idx];
            params.seqlen_q = params.cu_seqlens_q[batch_idx + 1] - q_batch;
        }
        if (params.cu_seqlens_k != nullptr) {
            k_batch = params.cu_seqlens_k[batch_idx];
            params.seqlen_k = params.cu_seqlens_k[batch_idx + 1] - k_batch;
        }
        if (params.seqused_k != nullptr) params.seqlen_k = max(0, min(params.seqused_k[batch_idx], params.seqlen_k));
        const int diagonal = params.seqlen_k - params.seqlen_q;
        params.band_first += diagonal;
        params.band_last += diagonal;
        return params;
    }
}

// Local attention's band, aligned to the bottom-right corner of the score matrix like causal:
// query i sees the keys i + band_first <= j <= i + band_last, where band_first = seqlen_k -
// seqlen_q - window_left and band_last = seqlen_k - seqlen_q + window_right. Causal is the band
// with window_right = 0 and window_left unbounded. The host computes both ends (clamped so that
// no sum overflows): read from the kernel's parameters they take no registers, which the 16-bit
// forward at d64-128 has none to spare for.
template <typename Params>
__device__ __forceinline__ bool band_hides(const Params& params, int query, int key) {
    return key < query + params.band_first || key > query + params.band_last;
}

// Whether an edge of the band runs through the tile of queries [row0, row0 + rows) and keys
// [col0, col0 + cols): only such tiles need the per-element mask.
template <typename Params>
__device__ __forceinline__ bool band_cuts(const Params& params, int row0, int rows, int col0, int cols) {
    return col0 + cols - 1 > row0 + params.band_last || col0 < row0 + rows - 1 + params.band_first;
}

// Key tiles [lo, hi) of kBlockN that the query rows [row0, row0 + rows_valid) can see: all of them,
// or with local attention (causal included) those between the first row's first visible key and
// the last row's last; tiles outside are skipped entirely.
template <int kBlockN, bool kIsLocal, typename Params>
__device__ __forceinline__ int2 visible_key_tiles(const Params& params, int row0, int rows_valid) {
    const int n_blocks = ceil_div(params.seqlen_k, kBlockN);
    if (!kIsLocal) return make_int2(0, n_blocks);
    const int last_key = row0 + rows_valid - 1 + params.band_last;
    const int lo = max(row0 + params.band_first, 0) / kBlockN;
    const int hi = min(n_blocks, last_key < 0 ? 0 : last_key / kBlockN + 1);
    return make_int2(lo, max(lo, hi));
}

}  // namespace cupyflash
