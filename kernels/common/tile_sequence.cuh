// The tiles a thread block walks along one axis: every tile of the band (dense), or those of a block
// mask's nonzero blocks (block-sparse FlashAttention, Algorithm 5), in order.
#pragma once
#include "common/band.cuh"

namespace cupyflash {

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
            // Hopper d128 forward execute 7% more instructions than the dense one.
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
// short ones fill that tail. The launch covers the last mask
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

}  // namespace cupyflash
