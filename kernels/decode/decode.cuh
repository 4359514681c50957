// KV-cache decoding (flash-decoding): few query rows against a long key/value cache.
//
// A decoding step has 1..16 new queries per sequence, so the forward kernels' parallelism over query
// blocks leaves the GPU idle and a 128-row tile mostly empty. Here instead:
//   - the query heads that share a K/V head (GQA) and the query positions are packed into the rows
//     of one tile (row r: query r / kv_group, head kv_head·kv_group + r % kv_group), so each K/V
//     tile is read once for the whole group;
//   - the keys are split over thread blocks (split-KV) and, inside a block, over its warps; each warp
//     keeps its own online-softmax state (m, l, O) for the rows, as FlashAttention's outer loop;
//   - the warps' states are merged through their log-sum-exp in shared memory, and the splits'
//     partial results (o_partial, lse_partial) by the last split of each group of rows to finish
//     (decode_combine_splits): a second kernel would add a launch and its ramp, a third of a
//     one-sequence step's time.
// The cache holds cache_seqlens[b] valid keys of batch b (its capacity is cache_len); new keys and
// values are first appended in place (flash_decode_append_kernel) and then attended to like the rest.
#pragma once
#include "common/score_mod.cuh"

namespace cupyflash {

// Kernel arguments; the host builds the same layout (cupyflash/catalog/params.py, DECODE_PARAMS_DTYPE).
struct DecodeParams {
    const void* q;       // [batch, seqlen_q, heads, head_dim]
    void* k;             // K cache [batch, cache_len, heads_kv, head_dim] (written by the append kernel)
    void* v;             // V cache, likewise
    const void* k_new;   // [batch, seqlen_new, heads_kv, head_dim] appended at cache_seqlens[b]; nullptr: none
    const void* v_new;   // likewise
    void* o;             // [batch, seqlen_q, heads, head_dim]
    void* lse;           // [batch, heads, seqlen_q], contiguous, Accum, natural log
    void* o_partial;     // [num_splits, batch, heads, seqlen_q, kHeadDim], contiguous, Accum (num_splits > 1)
    void* lse_partial;   // [num_splits, batch, heads, seqlen_q], contiguous, Accum (num_splits > 1)
    const int* cache_seqlens;  // [batch]: valid keys in the cache before the append; nullptr: cache_len
    long long q_batch_stride, q_row_stride, q_head_stride;  // elements
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long k_new_batch_stride, k_new_row_stride, k_new_head_stride;
    long long v_new_batch_stride, v_new_row_stride, v_new_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    int batch;
    int heads;
    int kv_group;      // query heads per K/V head
    int seqlen_q;
    int cache_len;     // the caches' capacity (axis 1)
    int seqlen_new;    // keys appended per sequence (0: none)
    int head_dim;      // the true head dim, <= the kernel's padded kHeadDim
    // Query i of batch b sees keys i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k -
    // seqlen_q + window_right, seqlen_k = cache_seqlens[b] + seqlen_new: the band aligned
    // bottom-right as in the forward kernels. Unbounded sides come clamped to cache_len + seqlen_new
    // and seqlen_q, which hide nothing; causal is window_right = 0.
    int window_left, window_right;
    int num_splits;    // thread blocks per (row block, K/V head, batch) along the keys
    int rows;          // seqlen_q * kv_group: packed rows per K/V head
    double scale_log2;  // softmax scale * log2(e)
    // Score modifiers, as in FwdParams (ScoreMod): a runtime choice here, as decoding is memory-bound.
    double softcap_log2;           // softcap·log2(e); 0: none
    const void* alibi_slopes;      // [batch or 1][heads], contiguous Accum; nullptr: none
    long long alibi_batch_stride;  // 0: one row of slopes for every batch entry
    // Splits done per (batch, K/V head, row block), num_splits > 1: zero before a launch, and zero
    // after it (the last split resets its counter), so one buffer serves launch after launch on a stream.
    unsigned* split_counters;
};

// Splits merged by decode_combine_splits: each lane of a warp holds the lse of kDecodeMaxSplits / 32.
constexpr int kDecodeMaxSplits = 128;

__device__ __forceinline__ bool decode_scores_modified(const DecodeParams& params) {
    return params.softcap_log2 != 0.0 || params.alibi_slopes != nullptr;
}

// ALiBi's slope of packed row `row` (its head: kv_head·kv_group + row % kv_group) in log2 units; 0
// without ALiBi or past the valid rows.
template <typename Accum>
__device__ __forceinline__ Accum decode_row_slope(const DecodeParams& params, int batch_idx, int kv_head, int row) {
    if (params.alibi_slopes == nullptr || row >= params.rows) return Accum(0);
    const int head = kv_head * params.kv_group + row % params.kv_group;
    return static_cast<Accum>(kLog2e) *
           static_cast<const Accum*>(params.alibi_slopes)[batch_idx * params.alibi_batch_stride + head];
}

// Keys of batch b after the append (never past the cache's capacity).
__device__ __forceinline__ int decode_seqlen_k(const DecodeParams& params, int batch_idx) {
    const int cached = params.cache_seqlens ? params.cache_seqlens[batch_idx] : params.cache_len;
    return min(params.cache_len, max(cached, 0) + params.seqlen_new);
}

// A thread block's key tiles: the tiles of kBlockN keys that rows [row0, row0 + rows) of batch b
// can see (the band), cut into num_splits near-equal runs, this block's run [begin, end).
template <int kBlockN>
__device__ __forceinline__ int2 decode_key_tiles(const DecodeParams& params, int seqlen_k, int row0, int rows,
                                                  int split) {
    const int first_query = row0 / params.kv_group, last_query = (row0 + rows - 1) / params.kv_group;
    const int offset = seqlen_k - params.seqlen_q;  // query i sits at key position i + offset
    const int first_key = max(0, first_query + offset - params.window_left);
    const int last_key = min(seqlen_k - 1, last_query + offset + params.window_right);
    if (last_key < first_key) return make_int2(0, 0);
    const int lo = first_key / kBlockN, hi = last_key / kBlockN + 1;
    const int per_split = ceil_div(hi - lo, params.num_splits);
    const int begin = min(hi, lo + split * per_split);
    return make_int2(begin, min(hi, begin + per_split));
}

// Traits shared by both decode kernels: kRows packed rows per block, kNWarps warps that each walk
// their own share of every key tile of kBlockN keys, and the shared memory the warps' states are
// merged in (reusing the tiles' memory: the merge starts after the last tile).
template <typename Element_, int kHeadDim_, int kRows_, int kNWarps_, int kBlockN_>
struct DecodeLayout {
    using Element = Element_;
    using Numeric = NumericTraits<Element>;
    using Storage = typename Numeric::Storage;
    using Accum = typename Numeric::Accum;
    static constexpr int kHeadDim = kHeadDim_;  // padded
    static constexpr int kRows = kRows_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = 32 * kNWarps;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kWarpKeys = kBlockN / kNWarps;  // keys of a tile per warp
    // Merge: each warp's m, l per row and its unnormalised O [kRows][kOStride], Accum. The padding
    // spreads the rows of an mma accumulator's column pair over the banks (unpadded, 8 rows share one).
    static constexpr int kOStride = kHeadDim + 8;
    static constexpr int kMergeBytes = kNWarps * kRows * (kOStride + 2) * static_cast<int>(sizeof(Accum));
    // decode_combine_splits keeps each warp's split weights in the block's shared memory (each
    // kernel's traits check that its kSmemBytes holds them).
    static constexpr int kCombineBytes = kNWarps * kDecodeMaxSplits * static_cast<int>(sizeof(Accum));
    static_assert(kBlockN % kNWarps == 0, "the warps share a tile's keys evenly");
};

// The end of both decode kernels: every warp has left its row maxima m (log2 units), row sums l
// and unnormalised O in shared memory (sM, sL: [kNWarps][kRows]; sO: [kNWarps][kRows][kOStride]).
// They are merged as FlashAttention merges key blocks, O = sum_w 2^(m_w - m) O_w / l with
// l = sum_w 2^(m_w - m) l_w, and written: to o and lse when the block holds the whole key range,
// else to this split's slot of o_partial and lse_partial for decode_combine_splits. A thread takes
// kVec columns of a row: element by element, the tensor-core kernel's merge took 2.2 us of an
// 8192-key step's 18, so it takes 16 bytes; the CUDA-core kernel
// stays element by element (with vectors ptxas gave it 138-149 registers, not 128).
template <typename Lt, int kVec>
__device__ __forceinline__ void decode_merge_and_store(const DecodeParams& params, const typename Lt::Accum* sM,
                                                       const typename Lt::Accum* sL, const typename Lt::Accum* sO,
                                                       int batch_idx, int kv_head, int row0, int split) {
    using Accum = typename Lt::Accum;
    using Storage = typename Lt::Storage;
    static_assert(Lt::kHeadDim % kVec == 0 && Lt::kOStride % kVec == 0, "rows of whole vectors");
    using Vector = Vec<Accum, kVec>;
    const int total_rows = params.batch * params.heads * params.seqlen_q;
    const int rows_valid = min(Lt::kRows, params.rows - row0);
    // With splits, whole padded rows (zero past head_dim) go to o_partial, which
    // decode_combine_splits reads whole (initcheck saw its reads past head_dim unwritten).
    const int vecs_per_row = params.num_splits > 1 ? Lt::kHeadDim / kVec : ceil_div(params.head_dim, kVec);
    for (int i = threadIdx.x; i < rows_valid * vecs_per_row; i += Lt::kNThreads) {
        const int r = i / vecs_per_row, c = i % vecs_per_row * kVec, row = row0 + r;
        Accum m = neg_inf<Accum>();
#pragma unroll
        for (int w = 0; w < Lt::kNWarps; ++w) m = max_(m, sM[w * Lt::kRows + r]);
        const Accum m_safe = m == neg_inf<Accum>() ? Accum(0) : m;  // no key seen: weights 0, not NaN
        Accum l = 0;
        Vector o = {};
#pragma unroll
        for (int w = 0; w < Lt::kNWarps; ++w) {
            const Accum weight = exp2_(sM[w * Lt::kRows + r] - m_safe);
            const Vector x = *reinterpret_cast<const Vector*>(&sO[(w * Lt::kRows + r) * Lt::kOStride + c]);
            l += weight * sL[w * Lt::kRows + r];
#pragma unroll
            for (int e = 0; e < kVec; ++e) o.x[e] += weight * x.x[e];
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) o.x[e] = saw_keys(l) ? o.x[e] / l : Accum(0);
        const int query = row / params.kv_group, head = kv_head * params.kv_group + row % params.kv_group;
        const Accum lse = saw_keys(l) ? m * Accum(kLn2) + log_(l) : neg_inf<Accum>();
        const long long row_idx = (static_cast<long long>(batch_idx) * params.heads + head) * params.seqlen_q + query;
        if (params.num_splits == 1) {
            Storage* out = static_cast<Storage*>(params.o) + batch_idx * params.o_batch_stride +
                           query * params.o_row_stride + head * params.o_head_stride;
#pragma unroll
            for (int e = 0; e < kVec; ++e)
                if (c + e < params.head_dim) out[c + e] = Lt::Numeric::from_accum(o.x[e]);
            if (c == 0) static_cast<Accum*>(params.lse)[row_idx] = lse;
        } else {  // o_partial rows are kHeadDim long: whole vectors
            const long long slot = split * static_cast<long long>(total_rows) + row_idx;
            *reinterpret_cast<Vector*>(static_cast<Accum*>(params.o_partial) + slot * Lt::kHeadDim + c) = o;
            if (c == 0) static_cast<Accum*>(params.lse_partial)[slot] = lse;
        }
    }
}

}  // namespace cupyflash
