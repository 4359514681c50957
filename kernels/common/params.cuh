// The kernels' arguments. The host builds the same layouts as NumPy structured scalars
// (cupyflash/catalog/params.py), and the generated source checks that both agree in size; a GPU
// test compares every field's offset.
#pragma once
#include "common/numeric.cuh"

namespace cupyflash {

// Kernel arguments; the host builds the same layout as a NumPy structured scalar
// (cupyflash/catalog/params.py), and the generated source checks both agree.
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
    // (seed, offset) in device memory, read in place of dropout_seed and dropout_offset where not
    // nullptr: a call captured into a CUDA graph, whose replays write them (fresh masks each replay).
    const unsigned long long* dropout_state;
    // The block-sparse warp-specialised forward (flash_fwd_ws_kernel; the other kernels ignore
    // it): the order it claims the launch's query tiles in (entries: query tile + m_tiles x
    // (head + heads x batch)), the tiles of mask rows with many key blocks first, so that the
    // launch does not end on a long tile claimed last. nullptr: index order (BlockMask.query_tile_order).
    const int* query_tile_order;
};

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
    const unsigned long long* dropout_state;
};

// Offset of row 0 of (batch, head) in the row statistics lse_log2 and d.
__device__ __forceinline__ long long row_vector_offset(const BwdParams& params, int batch_idx, int head_idx) {
    return batch_idx * params.stats_batch_stride + head_idx * params.stats_head_stride;
}

// Offset of (batch, row, head) in the dQ workspace dq_accum.
__device__ __forceinline__ long long dq_accum_offset(const BwdParams& params, int batch_idx, int row, int head_idx) {
    return batch_idx * params.dq_accum_batch_stride +
           (static_cast<long long>(row) * params.heads + head_idx) * params.head_dim;
}

}  // namespace cupyflash
