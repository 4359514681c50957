// The steps of FlashAttention-2's forward pass (Dao, 2023, Algorithm 1), one device function each:
//   load tile -> scores S_ij = Q_i K_j^T -> mask -> online softmax (m_i, l_i, rescale O_i)
//   -> O_i += P_ij V_j -> epilogue (O_i / l_i, lse_i).
// Each thread holds kRowsPerThread rows of S_ij and of O_i in registers; the functions below take
// its row-group (ty) and column-group (tx) coordinates in the FwdTraits thread grid.
#pragma once
#include "flash_fwd_traits.cuh"
#include "philox.cuh"

namespace cupyflash {

// Kernel arguments; the host builds the same layout as a NumPy structured scalar
// (cupyflash/_instantiations.py), and the generated source checks both agree.
struct FwdParams {
    const void* q;  // [batch, seqlen_q, heads, head_dim], any strides, head_dim contiguous
    const void* k;  // [batch, seqlen_k, heads, head_dim], likewise
    const void* v;  // [batch, seqlen_k, heads, head_dim], likewise
    void* o;        // [batch, seqlen_q, heads, head_dim]
    void* lse;      // [batch, heads, seqlen_q] (lse_*_stride), Accum (float32; float64 for float64), natural log
    // Strides in elements. 64-bit: batch * seqlen * heads * head_dim passes 2^31 easily.
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    int heads;
    int seqlen_q;
    int seqlen_k;
    int head_dim;             // the true head dim, <= the kernel's padded kHeadDim
    int kv_group;             // query heads per K/V head (GQA/MQA; 1: multi-head): K, V head = head / kv_group
    // Local attention (kIsLocal instantiations only): query i sees keys i + band_first <= j <=
    // i + band_last; see band_hides.
    int band_first, band_last;
    double scale_log2;        // softmax scale * log2(e): scores live in base 2, so exp2 suffices
    // Block-sparse attention (FlashAttention, Algorithm 5); nullptr: dense. The mask's nonzero
    // blocks M_ij in compressed form, per mask row (a query block of mask_block_q queries): their
    // count and their ascending key-block indices (blocks of mask_block_k keys), left-packed.
    const int* kv_block_count;  // [mask slabs][mask_q_blocks]
    const int* kv_block_index;  // [mask slabs][mask_q_blocks][mask_k_blocks]
    // Slab of (batch, head) = batch * mask_batch_stride + head * mask_head_stride (0 broadcasts).
    long long mask_batch_stride, mask_head_stride;
    int mask_q_blocks, mask_k_blocks;
    int mask_block_q, mask_block_k;
    // Score modifiers (kScoreMod instantiations only; see ScoreMod).
    double softcap_log2;           // softcap·log2(e); 0: no softcap
    const void* alibi_slopes;      // [batch or 1][heads], contiguous Accum: ALiBi slopes; nullptr: none
    long long alibi_batch_stride;  // 0: one row of slopes for every batch entry
    long long lse_batch_stride, lse_head_stride;  // lse's strides in elements (its rows: 1)
    // Variable-length batches (kVarlen instantiations only; see sequence_params). nullptr: unused.
    const int* cu_seqlens_q;  // [batch + 1]: sequence b's queries are the packed rows cu_seqlens_q[b]..[b+1]-1
    const int* cu_seqlens_k;  // [batch + 1]: likewise its keys
    const int* seqused_k;     // [batch]: sequence b sees its first seqused_k[b] keys only (padded batches)
    // Dropout (kScoreMod instantiations only; see Dropout in philox.cuh).
    unsigned long long dropout_seed;
    unsigned dropout_offset;
    unsigned dropout_threshold;  // round(p·2^32); 0: no dropout
    double dropout_rescale;      // 1 / (1 - p) for that p: the kept probabilities' factor; 1 without dropout
    // The block-sparse warp-specialised forward (flash_fwd_ws_kernel; the other kernels ignore
    // it): the order it claims the launch's query tiles in (entries: query tile + m_tiles x
    // (head + heads x batch)), the tiles of mask rows with many key blocks first, so that the
    // launch does not end on a long tile claimed last. nullptr: index order (BlockMask.query_tile_order).
    const int* query_tile_order;
};

template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T x[N]; };

template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

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

// The tiles a thread block visits along one axis, in order: positions begin..end-1 of either every
// tile (dense: position t is tile t) or, block-sparse, the tiles of one mask row's nonzero blocks,
// per_block tiles to a mask block (a mask block is a whole number of kernel tiles).
template <bool kIsBlockSparse>
struct TileSequence {
    const int* blocks;  // the mask row's ascending nonzero block indices (block-sparse only)
    int per_block;
    int begin, end;
    int head;  // blocks[0], read together with the row's count, whatever it is (block-sparse only)
    __device__ __forceinline__ int operator[](int t) const {
        if constexpr (kIsBlockSparse) {
            // A mask block of one tile (128 x 128 blocks, the default, at the Hopper tiles) needs
            // no division by the runtime per_block: its ~30 instructions per warp and step made the
            // Hopper d128 forward execute 7% more instructions than the dense one (benchmarks/NOTES.md,
            // session 28).
            if (per_block == 1) return blocks[t];
            return blocks[t / per_block] * per_block + t % per_block;
        } else {
            return t;
        }
    }
    // The first tile, (*this)[begin]. A walk from the row's first block takes it from `head`: one
    // dependent load fewer before a block's first K_j can be asked for.
    __device__ __forceinline__ int first() const {
        if (kIsBlockSparse && begin == 0) return head * per_block;
        return (*this)[begin];
    }
};

// First position e in the ascending blocks[0, count) with blocks[e] >= value.
__device__ __forceinline__ int lower_bound(const int* blocks, int count, int value) {
    int lo = 0, hi = count;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (blocks[mid] < value) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// The tiles in [lo, hi) of a mask row whose `count` nonzero blocks are `blocks` (of row_blocks
// blocks in all): tiles outside (past the causal diagonal, past the sequence's end) are never
// visited, whole blocks found by binary search, the first and last cut to the range.
__device__ __forceinline__ TileSequence<true> sparse_tiles(const int* blocks, int count, int row_blocks, int per_block,
                                                           int lo, int hi) {
    const int head = row_blocks > 0 ? blocks[0] : 0;  // (no keys or no queries: the rows are empty)
    if (lo >= hi || count == 0) return {blocks, per_block, 0, 0, head};
    // A range holding every tile of every block of the row (no band, no sequence end inside a
    // block) takes all `count` blocks whole, with no index read: the block's prologue otherwise
    // waits for count, then blocks[count - 1], then its first tile's index, one after the other,
    // before the first tile can be asked for.
    if (lo == 0 && hi >= row_blocks * per_block) return {blocks, per_block, 0, count * per_block, head};
    // Searched only where the range cuts the row (causal); otherwise the whole row is in it.
    const int first = lo == 0 ? 0 : lower_bound(blocks, count, lo / per_block);
    const int hi_block = ceil_div(hi, per_block);
    const int last = blocks[count - 1] < hi_block ? count : lower_bound(blocks, count, hi_block);  // one past
    if (first >= last) return {blocks, per_block, 0, 0, head};
    const int begin = first * per_block + max(0, lo - blocks[first] * per_block);
    const int end = (last - 1) * per_block + min(per_block, hi - blocks[last - 1] * per_block);
    return {blocks, per_block, begin, end, head};
}

// The score modifiers of current models, on a score x = scale·q_i·k_j in the kernels' log2 units:
// the softcap of Gemma 2 and Grok, x -> cap·tanh(x / cap), then ALiBi's linear bias (Press et al.,
// 2022) -slope_h·|i + seqlen_k - seqlen_q - j|: the key's distance from the query's own position,
// aligned bottom-right as causal is. The host passes cap and the slopes in natural units times
// log2(e), which is the same modification of the log2-unit score. Masked scores (-inf) stay -inf.
template <typename Accum>
struct ScoreMod {
    Accum cap, inv_cap;  // the softcap (log2 units) and its inverse; cap = 0: none
    Accum slope;         // this head's ALiBi slope (log2 units); 0: none
    int diagonal;        // seqlen_k - seqlen_q: query i's own key position is i + diagonal

    template <typename Params>
    __device__ __forceinline__ ScoreMod(const Params& params, int batch_idx, int head_idx)
        : cap(static_cast<Accum>(params.softcap_log2)),
          inv_cap(params.softcap_log2 > 0 ? static_cast<Accum>(1.0 / params.softcap_log2) : Accum(0)),
          slope(params.alibi_slopes == nullptr
                    ? Accum(0)
                    : static_cast<Accum>(kLog2e) * static_cast<const Accum*>(params.alibi_slopes)[
                          batch_idx * params.alibi_batch_stride + head_idx]),
          diagonal(params.seqlen_k - params.seqlen_q) {}

    // The decode kernels' form: cap and slope in log2 units, given; positions passed as key positions.
    __device__ __forceinline__ ScoreMod(Accum cap_log2, Accum slope_log2)
        : cap(cap_log2), inv_cap(cap_log2 > Accum(0) ? Accum(1) / cap_log2 : Accum(0)), slope(slope_log2), diagonal(0) {}

    __device__ __forceinline__ bool softcap() const { return cap != Accum(0); }

    // query + diagonal - key, whose absolute value is ALiBi's distance: the tensor-core kernels
    // take it once per tile and add each fragment element's constant offset, a float add where an
    // int-to-float conversion per element would take the MUFU pipe's slots from exp2.
    __device__ __forceinline__ Accum offset(int query, int key) const {
        return static_cast<Accum>(query + diagonal - key);
    }

    // The modified score of x at ALiBi distance `distance`, and in dx its derivative in x
    // (1 - tanh^2 with the softcap, else 1), which the backward's dS_ij = P_ij ∘ (dP_ij - D_i) ∘ dx
    // needs. kSoftcap: whether cap != 0, decided once per tile (softcap()). kFast: the
    // tensor-core kernels' tanh_fast; the scalar kernels keep the accurate tanh.
    template <bool kFast, bool kSoftcap>
    __device__ __forceinline__ Accum apply_at(Accum x, Accum distance, Accum& dx) const {
        dx = Accum(1);
        if constexpr (kSoftcap) {
            const Accum t = kFast ? tanh_fast(x * inv_cap) : tanh_(x * inv_cap);
            dx = Accum(1) - t * t;
            x = x == neg_inf<Accum>() ? x : cap * t;
        }
        return x - slope * distance;
    }

    template <bool kFast>
    __device__ __forceinline__ Accum apply(Accum x, int query, int key, Accum& dx) const {
        const Accum distance = abs(offset(query, key));
        return softcap() ? apply_at<kFast, true>(x, distance, dx) : apply_at<kFast, false>(x, distance, dx);
    }
};

// The kernels' modifiers: read from the parameters in kScoreMod instantiations; elsewhere an
// empty object, as even an unused zero-filled ScoreMod changes NVRTC's code for some kernels.
struct NoScoreMod {};
template <bool kScoreMod, typename Accum> struct ScoreModFor { using type = ScoreMod<Accum>; };
template <typename Accum> struct ScoreModFor<false, Accum> { using type = NoScoreMod; };

template <bool kScoreMod, typename Accum, typename Params>
__device__ __forceinline__ typename ScoreModFor<kScoreMod, Accum>::type score_mod(const Params& params, int batch_idx,
                                                                                  int head_idx) {
    if constexpr (kScoreMod) {
        return ScoreMod<Accum>(params, batch_idx, head_idx);
    } else {
        return NoScoreMod{};
    }
}

// Dropout, like the score modifiers, only in kScoreMod instantiations (an empty object elsewhere).
template <bool kScoreMod> struct DropoutFor { using type = Dropout; };
template <> struct DropoutFor<false> { using type = NoScoreMod; };

template <bool kScoreMod, typename Params>
__device__ __forceinline__ typename DropoutFor<kScoreMod>::type dropout_for(const Params& params, int batch_idx,
                                                                          int head_idx) {
    if constexpr (kScoreMod) {
        return Dropout(params, batch_idx, head_idx);
    } else {
        return NoScoreMod{};
    }
}

// The factor dropout puts on the output and the gradients: 1 / (1 - p), 1 where kernels have no dropout.
template <bool kScoreMod, typename Accum, typename Params>
__device__ __forceinline__ Accum dropout_rescale(const Params& params) {
    if constexpr (kScoreMod) {
        return static_cast<Accum>(params.dropout_rescale);
    } else {
        return Accum(1);
    }
}

// value · dropout's 1 / (1 - p) in kScoreMod kernels, the value itself elsewhere. (An if constexpr:
// `kScoreMod ? value * rescale : value` changed NVRTC's code for the unmodified kernels, which then
// spilled at 255 registers.)
template <bool kScoreMod, typename Params>
__device__ __forceinline__ double dropout_scaled(const Params& params, double value) {
    if constexpr (kScoreMod) {
        return value * params.dropout_rescale;
    } else {
        return value;
    }
}

template <typename Params>
__device__ __forceinline__ long long mask_slab(const Params& params, int batch_idx, int head_idx) {
    return batch_idx * params.mask_batch_stride + head_idx * params.mask_head_stride;
}

// The key tiles of kBlockN a query tile [row0, row0 + rows_valid) visits: with local attention
// (causal included) none outside its band; with a block mask only those of its mask row's nonzero blocks.
template <int kBlockN, bool kIsLocal, bool kIsBlockSparse, typename Params>
__device__ __forceinline__ TileSequence<kIsBlockSparse> key_tiles(const Params& params, int batch_idx, int head_idx,
                                                                  int row0, int rows_valid) {
    const int2 visible = visible_key_tiles<kBlockN, kIsLocal>(params, row0, rows_valid);
    if constexpr (!kIsBlockSparse) {
        return {nullptr, 1, visible.x, visible.y, 0};
    } else {
        const long long row = mask_slab(params, batch_idx, head_idx) * params.mask_q_blocks + row0 / params.mask_block_q;
        return sparse_tiles(params.kv_block_index + row * params.mask_k_blocks, params.kv_block_count[row],
                            params.mask_k_blocks, params.mask_block_k / kBlockN, visible.x, visible.y);
    }
}

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
            S[i][jn] = mod.template apply<false>(S[i][jn], row0 + ty * Kt::kRowsPerThread + i,
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
// saw no key (l_i = 0) gets output 0 and lse -inf. kRescale: O_i times out_scale as well (dropout's
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
        const Accum inv_l = l_row > Accum(0) ? (kRescale ? out_scale / l_row : Accum(1) / l_row) : Accum(0);
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
            const Accum lse = l_row > Accum(0)
                                  ? static_cast<Accum>(static_cast<double>(m[i]) * kLn2 + log(static_cast<double>(l_row)))
                                  : neg_inf<Accum>();
            // Kept in Accum precision: the backward pass recomputes P_ij = exp(S_ij - lse_i) from it.
            static_cast<Accum*>(params.lse)[batch_idx * params.lse_batch_stride + head_idx * params.lse_head_stride +
                                            row] = lse;
        }
    }
}

}  // namespace cupyflash
