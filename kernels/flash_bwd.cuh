// The steps of FlashAttention-2's backward pass (Dao, 2023, Algorithm 2) that the forward does not
// already have. With S_ij = scale · Q_i K_j^T and the saved lse_i:
//   P_ij = exp(S_ij - lse_i)               (recomputed, never stored)
//   dV_j += P_ij^T dO_i,   dP_ij = dO_i V_j^T,   dS_ij = P_ij ∘ (dP_ij - D_i)
//   dK_j += scale · dS_ij^T Q_i,   dQ_i += scale · dS_ij K_j
// where D_i = rowsum(dO_i ∘ O_i) comes from a preprocessing pass. With dropout (keep mask Z, keep
// probability 1 - p, O = (P ∘ Z / (1 - p)) V) the same steps hold with P ∘ Z / (1 - p) in dV_j and
// dP_ij ∘ Z / (1 - p) in dS_ij; as in FlashAttention-2, D_i is stored times (1 - p), so that
//   dS_ij = P_ij ∘ (Z_ij ? dP_ij - D_i' : -D_i') / (1 - p),   D_i' = (1 - p) D_i,
// and the 1 / (1 - p) goes on dV_j, dK_j and dQ_i when they are written. The matrix products reuse the
// forward's compute_scores (A B^T) and accumulate_pv (A B) on shared-memory tiles.
#pragma once
#include "flash_bwd_traits.cuh"
#include "flash_fwd.cuh"

namespace cupyflash {

// Kernel arguments of every backward kernel; mirrored on the host by BWD_PARAMS_DTYPE.
struct BwdParams {
    const void* q;     // [batch, seqlen_q, heads, head_dim], any strides, head_dim contiguous
    const void* k;     // [batch, seqlen_k, heads, head_dim], likewise
    const void* v;     // [batch, seqlen_k, heads, head_dim], likewise
    const void* o;     // [batch, seqlen_q, heads, head_dim], the forward's output
    const void* dout;  // [batch, seqlen_q, heads, head_dim], dL/dO
    const void* lse;   // [batch, heads, seqlen_q], Accum, any strides: the forward's lse (natural log)
    void* dq;          // [batch, seqlen_q, heads, head_dim]
    void* dk;          // [batch, seqlen_k, heads, head_dim]
    void* dv;          // [batch, seqlen_k, heads, head_dim]
    // [batch, seqlen_q, heads, head_dim] (batch stride dq_accum_batch_stride), Accum, zeroed: dQ summed
    // by atomics across key blocks (already multiplied by scale). nullptr in deterministic mode.
    void* dq_accum;
    // Row statistics, [batch, heads, seqlen_q] (strides stats_*_stride; rows contiguous), Accum:
    void* lse_log2;    // lse_i·log2(e); +inf for rows with no key
    void* d;           // D_i = rowsum(dO_i ∘ O_i)
    // Strides in elements.
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long dout_batch_stride, dout_row_stride, dout_head_stride;
    long long dq_batch_stride, dq_row_stride, dq_head_stride;
    long long dk_batch_stride, dk_row_stride, dk_head_stride;
    long long dv_batch_stride, dv_row_stride, dv_head_stride;
    long long lse_batch_stride, lse_head_stride, lse_row_stride;
    int heads;
    int seqlen_q;
    int seqlen_k;
    int head_dim;
    int kv_group;                    // query heads per K/V head, as in FwdParams
    int band_first, band_last;       // local attention, as in FwdParams
    double scale;       // softmax scale
    double scale_log2;  // scale · log2(e)
    // Block-sparse attention, as in FwdParams (nullptr: dense); the mask's rows for the dQ kernel
    // and its columns (per key block, the ascending query blocks that see it) for the dK/dV kernel.
    const int* kv_block_count;  // [mask slabs][mask_q_blocks]
    const int* kv_block_index;  // [mask slabs][mask_q_blocks][mask_k_blocks]
    const int* q_block_count;   // [mask slabs][mask_k_blocks]
    const int* q_block_index;   // [mask slabs][mask_k_blocks][mask_q_blocks]
    const int* key_block_order; // [mask slabs][mask_k_blocks]: the key blocks, most query blocks first
    long long mask_batch_stride, mask_head_stride;
    int mask_q_blocks, mask_k_blocks;
    int mask_block_q, mask_block_k;
    double softcap_log2;           // score modifiers, as in FwdParams
    const void* alibi_slopes;
    long long alibi_batch_stride;
    long long stats_batch_stride, stats_head_stride;  // of lse_log2 and d
    long long dq_accum_batch_stride;                  // dq_accum's rows: heads * head_dim apart
    const int* cu_seqlens_q;  // variable-length batches, as in FwdParams
    const int* cu_seqlens_k;
    const int* seqused_k;
    unsigned long long dropout_seed;  // dropout, as in FwdParams
    unsigned dropout_offset;
    unsigned dropout_threshold;
    double dropout_rescale;
};

// The query tiles of kBlockM that see the key tile [key0, key0 + keys_valid) (the dK/dV kernel's
// loop): with local attention (causal included) only those in its band, query i seeing key j when
// j - band_last <= i <= j - band_first; with a block mask only those of the nonzero blocks of its
// mask column.
template <int kBlockM, bool kIsLocal, bool kIsBlockSparse>
__device__ __forceinline__ TileSequence<kIsBlockSparse> query_tiles(const BwdParams& params, int batch_idx,
                                                                    int head_idx, int key0, int keys_valid) {
    int lo = 0, hi = ceil_div(params.seqlen_q, kBlockM);
    if (kIsLocal) {
        const int last_query = key0 + keys_valid - 1 - params.band_first;
        lo = max(0, key0 - params.band_last) / kBlockM;
        hi = max(lo, min(hi, last_query < 0 ? 0 : last_query / kBlockM + 1));
    }
    if constexpr (!kIsBlockSparse) {
        return {nullptr, 1, lo, hi, 0};
    } else {
        const long long col = mask_slab(params, batch_idx, head_idx) * params.mask_k_blocks + key0 / params.mask_block_k;
        return sparse_tiles(params.q_block_index + col * params.mask_q_blocks, params.q_block_count[col],
                            params.mask_q_blocks, params.mask_block_q / kBlockM, lo, hi);
    }
}

// The key tile of a dK/dV thread block at launch position `position` (of blockIdx.x). Block-sparse:
// the mask's key blocks in key_block_order, most query blocks first, a block's tiles together.
// Thread blocks start in launch order, as many at a time as the GPU holds, and at one a time per
// SM a long block started late runs on alone at the launch's end; started longest first, the
// short ones fill that tail (benchmarks/NOTES.md, session 30). The launch covers the last mask
// block's tiles past seqlen_k too (the host rounds seqlen_k up to a block): those do nothing.
template <int kBlockN, bool kIsBlockSparse>
__device__ __forceinline__ int key_tile(const BwdParams& params, int batch_idx, int head_idx, int position) {
    if constexpr (!kIsBlockSparse) {
        return position;
    } else {
        const int per_block = params.mask_block_k / kBlockN;
        const int* order = params.key_block_order + mask_slab(params, batch_idx, head_idx) * params.mask_k_blocks;
        return order[position / per_block] * per_block + position % per_block;
    }
}

// Offset of row 0 of (batch, head) in the row statistics lse_log2 and d.
__device__ __forceinline__ long long row_vector_offset(const BwdParams& params, int batch_idx, int head_idx) {
    return batch_idx * params.stats_batch_stride + head_idx * params.stats_head_stride;
}

// Offset of (batch, row, head) in the dQ workspace dq_accum.
__device__ __forceinline__ long long dq_accum_offset(const BwdParams& params, int batch_idx, int row, int head_idx) {
    return batch_idx * params.dq_accum_batch_stride +
           (static_cast<long long>(row) * params.heads + head_idx) * params.head_dim;
}

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
