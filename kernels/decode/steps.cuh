// What the decode kernels' translation units share (decode.cu: the tensor-core kernel and the
// append; cuda_cores.cu: the CUDA-core kernels): the query rows' load, warp reductions, the
// block's coordinates, the tiles' cp.async load, and the splits' combine.
#pragma once
#include "arch/sm80.cuh"
#include "decode/decode.cuh"

namespace cupyflash {

// The block's kRows packed query rows, [kRows][stride] in shared memory as T (zero past the valid
// rows and head_dim, so padding adds nothing to a score), multiplied by `scale`. The rows are not
// one stride apart (row r is query r / kv_group of head kv_head·kv_group + r % kv_group), and
// they are loaded once per block, so element by element.
template <typename Lt, typename T, typename Convert>
__device__ __forceinline__ void load_decode_queries(T* sQ, int stride, const DecodeParams& params, int batch_idx,
                                                    int kv_head, int row0, Convert convert) {
    using Storage = typename Lt::Storage;
    const Storage* q = static_cast<const Storage*>(params.q) + batch_idx * params.q_batch_stride;
    for (int e = threadIdx.x; e < Lt::kRows * Lt::kHeadDim; e += Lt::kNThreads) {
        const int r = e / Lt::kHeadDim, c = e % Lt::kHeadDim, row = row0 + r;
        T x = convert(Storage(0));
        if (row < params.rows && c < params.head_dim) {
            const int query = row / params.kv_group, head = kv_head * params.kv_group + row % params.kv_group;
            x = convert(q[query * params.q_row_stride + head * params.q_head_stride + c]);
        }
        sQ[r * stride + c] = x;
    }
}

// x reduced with op over the warp's 32 lanes; every lane gets the result.
template <typename T, typename Op> __device__ __forceinline__ T warp_reduce(T x, Op op) {
#pragma unroll
    for (int s = 16; s >= 1; s /= 2) x = op(x, shfl_xor(x, s));
    return x;
}
template <typename T> __device__ __forceinline__ T warp_max(T x) {
    return warp_reduce(x, [](T a, T b) { return max_(a, b); });
}
template <typename T> __device__ __forceinline__ T warp_sum(T x) {
    return warp_reduce(x, [](T a, T b) { return a + b; });
}

// Block coordinates of both decode kernels. Grid: (row blocks x num_splits x K/V heads, batch),
// the row blocks innermost, so that blocks reading the same K/V tiles run side by side (L2).
struct DecodeBlock {
    int row0, split, kv_head, batch_idx;
    template <int kRows> __device__ __forceinline__ static DecodeBlock of(const DecodeParams& params) {
        const int row_blocks = ceil_div(params.rows, kRows);
        const int x = blockIdx.x;
        return {x % row_blocks * kRows, x / row_blocks % params.num_splits, x / row_blocks / params.num_splits,
                static_cast<int>(blockIdx.y)};
    }
};

// 16 bytes of Accum from L2 (ld.global.cg): split results written by other blocks of this launch.
__device__ __forceinline__ float4 load_l2_16(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ double2 load_l2_16(const double* p) { return __ldcg(reinterpret_cast<const double2*>(p)); }

// *counter += 1 as an acquire-release atomic at GPU scope, by one thread between two barriers of its
// block: the release carries the block's writes before the first barrier (as CUTLASS's semaphores
// do), the acquire orders the block's reads after the second. Two __threadfence() (fence.sc) in its
// place cost ~0.5 us of an 8192-key step.
__device__ __forceinline__ unsigned count_acq_rel(unsigned* counter) {
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(before) : "l"(counter) : "memory");
    return before;
}

// Flash-decoding's combine, lse = log sum_s exp(lse_s) and o = sum_s exp(lse_s - lse) o_s over
// the num_splits partial results of each row, done by the last of a row group's blocks to finish,
// so that a step is one launch: each block counts itself done in params.split_counters, releasing
// its results (count_acq_rel); the block that completes the count reads every split's results
// from L2 (ld.cg, past the L1 that is not coherent with the other SMs' writes), merges them and
// resets the counter. This block runs alone at the end of the step, so its loads are issued
// kInFlight splits at a time, the first batch beside the lse loads: a warp per row, its lanes
// over 16-byte vectors of columns, the splits' weights in shared memory (sW, the merge's, free
// now). A row no split saw gives o = 0, lse = -inf.
template <typename Lt>
__device__ __forceinline__ void decode_combine_splits(const DecodeParams& params, const DecodeBlock& block,
                                                      typename Lt::Accum* sW) {
    using Accum = typename Lt::Accum;
    using Storage = typename Lt::Storage;
    constexpr int kVec = 16 / static_cast<int>(sizeof(Accum));
    constexpr int kPasses = (Lt::kHeadDim + 32 * kVec - 1) / (32 * kVec);
    constexpr int kSplitsPerLane = kDecodeMaxSplits / 32;
    constexpr int kInFlight = 16;
    static_assert(kDecodeMaxSplits % kInFlight == 0, "batches of splits stay inside sW");
    __shared__ unsigned s_done;
    const int row_block = block.row0 / Lt::kRows, row_blocks = ceil_div(params.rows, Lt::kRows);
    unsigned* counter = params.split_counters +
                        (block.batch_idx * (params.heads / params.kv_group) + block.kv_head) * row_blocks + row_block;
    __syncthreads();  // every thread's o_partial and lse_partial are written; the merge is done with shared memory
    if (threadIdx.x == 0) s_done = count_acq_rel(counter);
    __syncthreads();  // the other splits' results are read after their counts were seen
    if (s_done != static_cast<unsigned>(params.num_splits - 1)) return;
    if (threadIdx.x == 0) *counter = 0u;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long total_rows = static_cast<long long>(params.batch) * params.heads * params.seqlen_q;
    const Accum* lse_partial = static_cast<const Accum*>(params.lse_partial);
    const Accum* o_partial = static_cast<const Accum*>(params.o_partial);
    const long long split_stride = total_rows * Lt::kHeadDim;
    const int rows_valid = min(Lt::kRows, params.rows - block.row0);
    Accum* weight = sW + warp * kDecodeMaxSplits;  // this warp's row: split s's exp(lse_s - m), 0 past num_splits
    for (int r = warp; r < rows_valid; r += Lt::kNWarps) {
        const int row = block.row0 + r;
        const int query = row / params.kv_group, head = block.kv_head * params.kv_group + row % params.kv_group;
        const long long row_idx = (static_cast<long long>(block.batch_idx) * params.heads + head) * params.seqlen_q + query;
        Storage* out = static_cast<Storage*>(params.o) + block.batch_idx * params.o_batch_stride +
                       query * params.o_row_stride + head * params.o_head_stride;
        Accum inv_sum = 0;
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int c = (pass * 32 + lane) * kVec;  // columns past kHeadDim read the last vector, unused
            const Accum* column = o_partial + row_idx * Lt::kHeadDim + min(c, Lt::kHeadDim - kVec);
            Accum o[kVec] = {};
            for (int s0 = 0; s0 < params.num_splits; s0 += kInFlight) {
                decltype(load_l2_16(column)) x[kInFlight];
#pragma unroll
                for (int j = 0; j < kInFlight; ++j)  // past num_splits: the last split's (finite) results
                    x[j] = load_l2_16(column + min(s0 + j, params.num_splits - 1) * split_stride);
                if (pass == 0 && s0 == 0) {
                    Accum lse[kSplitsPerLane], m = neg_inf<Accum>();
#pragma unroll
                    for (int i = 0; i < kSplitsPerLane; ++i) {
                        const int s = 32 * i + lane;
                        lse[i] = s < params.num_splits ? __ldcg(lse_partial + s * total_rows + row_idx) : neg_inf<Accum>();
                        m = max_(m, lse[i]);
                    }
                    m = warp_max(m);
                    const Accum m_safe = m == neg_inf<Accum>() ? Accum(0) : m;  // no split saw a key: 0, not NaN
                    Accum sum = 0;
#pragma unroll
                    for (int i = 0; i < kSplitsPerLane; ++i) {
                        const Accum w = exp2_((lse[i] - m_safe) * static_cast<Accum>(kLog2e));
                        weight[32 * i + lane] = w;
                        sum += w;
                    }
                    sum = warp_sum(sum);
                    inv_sum = saw_keys(sum) ? Accum(1) / sum : Accum(0);
                    if (lane == 0)
                        static_cast<Accum*>(params.lse)[row_idx] = saw_keys(sum) ? m_safe + log_(sum) : neg_inf<Accum>();
                    __syncwarp();  // the weights are in shared memory
                }
#pragma unroll
                for (int j = 0; j < kInFlight; ++j) {
                    const Accum w = weight[s0 + j];
                    if constexpr (kVec == 4) {
                        o[0] += w * x[j].x, o[1] += w * x[j].y, o[2] += w * x[j].z, o[3] += w * x[j].w;
                    } else {
                        o[0] += w * x[j].x, o[1] += w * x[j].y;
                    }
                }
            }
#pragma unroll
            for (int e = 0; e < kVec; ++e)
                if (c + e < params.head_dim) out[c + e] = Lt::Numeric::from_accum(o[e] * inv_sum);
        }
        __syncwarp();  // the next row's weights overwrite these
    }
}

// A [kBlockN][kStride] tile of K or V, zero past rows_valid and head_dim, as load_tile_async but
// with a rolled loop: unrolled, its 16-32 chunk addresses per tile stay live across the key loop
// and spill beside d224-256's accumulators (a memory-bound kernel loses nothing by the loop).
template <typename Kt>
__device__ __forceinline__ void load_decode_tile(unsigned s_tile, const typename Kt::Storage* g_tile,
                                                 long long row_stride, int rows_valid, int head_dim) {
    using Storage = typename Kt::Storage;
    constexpr int kSize = static_cast<int>(sizeof(Storage));
    constexpr int kChunk = 16 / kSize;  // elements of a 16-byte chunk
    constexpr int kChunksPerRow = Kt::kHeadDim / kChunk;
    const bool vectorised =
        ((reinterpret_cast<unsigned long long>(g_tile) | static_cast<unsigned long long>(row_stride * kSize)) & 15) == 0;
    if constexpr (Kt::kNThreads % kChunksPerRow == 0) {
        // A whole tile (every one but a sequence's last) goes by constant steps, without the
        // per-chunk bounds and addresses: those were most of a small step's instructions.
        constexpr int kRowsPerPass = Kt::kNThreads / kChunksPerRow;
        static_assert(Kt::kBlockN % kRowsPerPass == 0, "whole passes over the tile's rows");
        if (vectorised && rows_valid >= Kt::kBlockN && head_dim == Kt::kHeadDim) {
            const int row = threadIdx.x / kChunksPerRow, col = threadIdx.x % kChunksPerRow * kChunk;
            const Storage* g = g_tile + row * row_stride + col;
            const unsigned s = s_tile + (row * Kt::kStride + col) * kSize;
#pragma unroll
            for (int pass = 0; pass < Kt::kBlockN / kRowsPerPass; ++pass)
                cp_async_16(s + pass * kRowsPerPass * Kt::kStride * kSize, g + pass * kRowsPerPass * row_stride, 16);
            return;
        }
    }
#pragma unroll 2
    for (int i = threadIdx.x; i < Kt::kBlockN * kChunksPerRow; i += Kt::kNThreads) {
        const int row = i / kChunksPerRow, col = i % kChunksPerRow * kChunk;
        const unsigned s = s_tile + (row * Kt::kStride + col) * kSize;
        const bool valid = row < rows_valid;
        if (vectorised) {
            // Chunks past the tile's rows or head_dim copy nothing from row 0 (a safe address).
            const int bytes = valid ? max(0, min(16, (head_dim - col) * kSize)) : 0;
            cp_async_16(s, g_tile + (bytes > 0 ? row * row_stride + col : 0), bytes);
        } else {
            Vec<Storage, kChunk> x;
#pragma unroll
            for (int e = 0; e < kChunk; ++e)
                x.x[e] = valid && col + e < head_dim ? g_tile[row * row_stride + col + e] : Storage(0);
            store_shared_16(s, &x);
        }
    }
}

}  // namespace cupyflash
