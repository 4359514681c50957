// KV-cache decoding kernels (see decode/decode.cuh for the scheme): the tensor-core kernel for
// float16/bfloat16 on sm_80+, the CUDA-core kernel for every dtype (each merging its splits at the
// end, decode_combine_splits) and the in-place append of new keys and values. Instantiations:
// cupyflash/catalog.
#include "decode/decode.cuh"
#include "sm80/gemm.cuh"

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
                    inv_sum = sum > Accum(0) ? Accum(1) / sum : Accum(0);
                    if (lane == 0)
                        static_cast<Accum*>(params.lse)[row_idx] = sum > Accum(0) ? m_safe + log_(sum) : neg_inf<Accum>();
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

// ---------------------------------------------------------------------------- tensor cores

// One m16 tile of packed rows; kNWarps warps, 16 keys each per tile of kBlockN = 16·kNWarps keys;
// K_j and V_j in a kStages-deep cp.async ring, so that kStages - 1 tiles are in flight while one is used.
template <typename Element_, int kHeadDim_, int kNWarps_, int kStages_>
struct TcDecodeTraits : DecodeLayout<Element_, kHeadDim_, 16, kNWarps_, 16 * kNWarps_> {
    using Base = DecodeLayout<Element_, kHeadDim_, 16, kNWarps_, 16 * kNWarps_>;
    using Op = Mma<Element_>;
    static constexpr int kMTiles = 1, kNTiles = 2;  // a warp's score tile: 16 rows x 16 keys
    static constexpr int kKSteps = kHeadDim_ / 16;
    static constexpr int kStride = kHeadDim_ + 8;  // padded shared rows, as TcTileLayout (no bank conflicts)
    static constexpr int kStages = kStages_;
    // Q's A fragments stay in registers up to d128. Above, beside O's d/2 accumulators, they take
    // the kernel to 224-248 registers at sm_90a (at the spill edge), so they are read from shared
    // memory at each k-step instead (at 156-204 registers).
    static constexpr bool kQInRegisters = kHeadDim_ <= 128;
    static constexpr int kSmemQOffset = 0;                           // Storage elements: Q [16][kStride]
    static constexpr int kSmemKvOffset = 16 * kStride;               // then per stage K_j, V_j [kBlockN][kStride]
    static constexpr int kStageElements = 2 * Base::kBlockN * kStride;
    static constexpr int kTileBytes = (kSmemKvOffset + kStages * kStageElements) * 2;
    static constexpr int kSmemBytes = kTileBytes > Base::kMergeBytes ? kTileBytes : Base::kMergeBytes;
    // The blocks per SM that shared memory allows on an A100 or H100 (at most 4 counted by the split
    // rule), as the launch bound: left to itself, ptxas held the small head dims to 80-128 registers
    // and spilled beside the split combine.
    static constexpr int kMinBlocks = kSmemBytes <= 40 * 1024 ? 4 : 2;
    static_assert(kHeadDim_ % 16 == 0, "the head dim is padded to a multiple of the k16 step");
    static_assert(kStages >= 2, "a ring of at least two tiles");
    static_assert(kSmemBytes >= Base::kCombineBytes, "decode_combine_splits' weights fit in the block's shared memory");
};

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

// The block's 16 packed query rows into sQ ([16][kStride] Storage) by cp.async, zero past the
// valid rows and head_dim, when every row starts on 16 bytes (false otherwise: load_decode_queries
// then). Issued ahead of the K/V tiles: read after them, Q queued behind the ring's first tiles
// and landed ~5 us into an 8192-key step, the tiles waiting on it.
template <typename Kt>
__device__ __forceinline__ bool load_decode_queries_async(unsigned sQ, const DecodeParams& params, int batch_idx,
                                                          int kv_head, int row0) {
    using Storage = typename Kt::Storage;
    const Storage* q = static_cast<const Storage*>(params.q) + batch_idx * params.q_batch_stride;
    const auto strides = static_cast<unsigned long long>(params.q_row_stride | params.q_head_stride) * sizeof(Storage);
    if (((reinterpret_cast<unsigned long long>(q) | strides) & 15) != 0) return false;
    constexpr int kChunksPerRow = Kt::kHeadDim / 8;
    for (int i = threadIdx.x; i < Kt::kRows * kChunksPerRow; i += Kt::kNThreads) {
        const int r = i / kChunksPerRow, c = i % kChunksPerRow * 8, row = row0 + r;
        const bool valid = row < params.rows && c < params.head_dim;
        const int query = row / params.kv_group, head = kv_head * params.kv_group + row % params.kv_group;
        // Chunks past the rows or head_dim copy nothing from the batch's first query (a safe address).
        const Storage* src = valid ? q + query * params.q_row_stride + head * params.q_head_stride + c : q;
        cp_async_16(sQ + (r * Kt::kStride + c) * 2, src, valid ? min(16, (params.head_dim - c) * 2) : 0);
    }
    return true;
}

// kScoreMod: softcap and ALiBi, in an instantiation of their own that leaves the unmodified kernel as
// it was, with one block per SM as its launch bound (without one, ptxas held it to fewer registers
// than the modifiers need and it spilled).
template <typename Kt, bool kScoreMod = false>
__global__ void __launch_bounds__(Kt::kNThreads, kScoreMod ? 1 : Kt::kMinBlocks) flash_decode_tc_kernel(const DecodeParams params) {
    using Storage = typename Kt::Storage;
    using Op = typename Kt::Op;
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned sQ = smem_address(smem) + Kt::kSmemQOffset * 2;
    const unsigned sKv = smem_address(smem) + Kt::kSmemKvOffset * 2;
    const DecodeBlock block = DecodeBlock::of<Kt::kRows>(params);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Fragment f(lane);
    const int seqlen_k = decode_seqlen_k(params, block.batch_idx);
    const int rows_valid = min(Kt::kRows, params.rows - block.row0);
    const int2 tiles = decode_key_tiles<Kt::kBlockN>(params, seqlen_k, block.row0, rows_valid, block.split);

    const Storage* k = static_cast<const Storage*>(params.k) + block.batch_idx * params.k_batch_stride +
                       block.kv_head * params.k_head_stride;
    const Storage* v = static_cast<const Storage*>(params.v) + block.batch_idx * params.v_batch_stride +
                       block.kv_head * params.v_head_stride;
    auto load_kv = [&](int tile) {  // K_j, V_j of `tile` into its stage of the ring
        const unsigned stage = sKv + (tile - tiles.x) % Kt::kStages * Kt::kStageElements * 2;
        const int col0 = tile * Kt::kBlockN, keys_valid = min(Kt::kBlockN, seqlen_k - col0);
        load_decode_tile<Kt>(stage, k + col0 * params.k_row_stride, params.k_row_stride, keys_valid, params.head_dim);
        load_decode_tile<Kt>(stage + Kt::kBlockN * Kt::kStride * 2, v + col0 * params.v_row_stride,
                             params.v_row_stride, keys_valid, params.head_dim);
    };
    const bool q_async = load_decode_queries_async<Kt>(sQ, params, block.batch_idx, block.kv_head, block.row0);
    cp_async_commit();  // Q's group, the oldest
    for (int s = 0; s < Kt::kStages - 1; ++s) {
        if (tiles.x + s < tiles.y) load_kv(tiles.x + s);
        cp_async_commit();
    }
    if (!q_async)
        load_decode_queries<Kt>(reinterpret_cast<Storage*>(smem) + Kt::kSmemQOffset, Kt::kStride, params,
                                block.batch_idx, block.kv_head, block.row0, [](Storage x) { return x; });
    cp_async_wait<Kt::kStages - 1>();  // Q's group; the tiles' may still be loading
    __syncthreads();  // Q is in shared memory
    const unsigned a0 = sQ + ((lane % 16) * Kt::kStride + (lane / 16) * 8) * 2;  // each warp multiplies all 16 rows
    unsigned Q[Kt::kQInRegisters ? Kt::kKSteps : 1][4];
    if constexpr (Kt::kQInRegisters) {
#pragma unroll
        for (int ks = 0; ks < Kt::kKSteps; ++ks) ldmatrix_x4(Q[ks], a0 + ks * 16 * 2);
    }

    // The keys this lane's two fragment rows see: [first, last] of the bottom-right band; with
    // ALiBi, their slopes.
    int first[2], last[2];
    float slope[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int query = (block.row0 + f.row(0, h)) / params.kv_group + seqlen_k - params.seqlen_q;
        first[h] = query - params.window_left;
        last[h] = min(seqlen_k - 1, query + params.window_right);
        slope[h] = decode_row_slope<float>(params, block.batch_idx, block.kv_head, block.row0 + f.row(0, h));
    }
    const bool modified = kScoreMod && decode_scores_modified(params);

    float O[1][Kt::kHeadDim / 8][4];
    float m[1][2] = {{neg_inf<float>(), neg_inf<float>()}}, l[1][2] = {{0.f, 0.f}};
    zero(O);
    const float scale_log2 = static_cast<float>(params.scale_log2);
    for (int t = tiles.x; t < tiles.y; ++t) {
        cp_async_wait<Kt::kStages - 2>();
        __syncthreads();  // tile t has landed; every warp is done with tile t - 1, whose stage is reloaded now
        if (t + Kt::kStages - 1 < tiles.y) load_kv(t + Kt::kStages - 1);
        cp_async_commit();

        const unsigned stage = sKv + (t - tiles.x) % Kt::kStages * Kt::kStageElements * 2;
        const unsigned sK = stage + warp * 16 * Kt::kStride * 2;  // this warp's 16 keys of K_j
        const unsigned sV = sK + Kt::kBlockN * Kt::kStride * 2;   // and of V_j
        float S[1][2][4];
        zero(S);
        const unsigned b0 = sK + (((lane / 16) * 8 + lane % 8) * Kt::kStride + (lane / 8) % 2 * 8) * 2;
#pragma unroll
        for (int ks = 0; ks < Kt::kKSteps; ++ks) {
            unsigned b[4];
            ldmatrix_x4(b, b0 + ks * 16 * 2);
            if constexpr (!Kt::kQInRegisters) ldmatrix_x4(Q[0], a0 + ks * 16 * 2);
            const unsigned(&a)[4] = Q[Kt::kQInRegisters ? ks : 0];
            Op::run(S[0][0], a, b[0], b[1]);
            Op::run(S[0][1], a, b[2], b[3]);
        }
        const int col0 = t * Kt::kBlockN + warp * 16;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = col0 + f.col(nt, e);
                    if (key < first[h] || key > last[h]) S[0][nt][2 * h + e] = neg_inf<float>();
                }
        if (modified) {  // softcap, ALiBi: S becomes the modified scores in log2 units
            const auto modify = [&](auto softcap) {
                constexpr bool kSoftcap = decltype(softcap)::value;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const ScoreMod<float> mod(static_cast<float>(params.softcap_log2), slope[h]);
                    const int query = first[h] + params.window_left;  // the row's own key position
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float dx;
                            const float distance = fabsf(static_cast<float>(query - (col0 + f.col(nt, e))));
                            S[0][nt][2 * h + e] = mod.apply_at<Tanh::kFast, kSoftcap>(S[0][nt][2 * h + e] * scale_log2, distance, dx);
                        }
                }
            };
            if (params.softcap_log2 != 0.0)
                modify(BoolConstant<true>());
            else
                modify(BoolConstant<false>());
            online_softmax_tc<Kt>(S, O, m, l, 1.f);
        } else {
            online_softmax_tc<Kt>(S, O, m, l, scale_log2);
        }
        unsigned P[1][1][4];
        to_a_fragments<Op>(S, P);
        gemm_ab_rs<Op, 1, Kt::kHeadDim / 8, 1, Kt::kStride>(O, P, sV, lane);
    }
    cp_async_wait<0>();
    __syncthreads();  // the merge below reuses the tiles' shared memory

    float* sM = reinterpret_cast<float*>(smem);
    float* sL = sM + Kt::kNWarps * Kt::kRows;
    float* sO = sL + Kt::kNWarps * Kt::kRows;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = f.row(0, h);
        const float l_row = quad_sum(l[0][h]);
        if (f.t == 0) sM[warp * Kt::kRows + r] = m[0][h], sL[warp * Kt::kRows + r] = l_row;
#pragma unroll
        for (int dt = 0; dt < Kt::kHeadDim / 8; ++dt)
            *reinterpret_cast<float2*>(&sO[(warp * Kt::kRows + r) * Kt::kOStride + f.col(dt, 0)]) =
                make_float2(O[0][dt][2 * h], O[0][dt][2 * h + 1]);
    }
    __syncthreads();  // every warp's state is in shared memory
    // The warps' states merged by float4s of columns.
    decode_merge_and_store<Kt, 4>(params, sM, sL, sO, block.batch_idx, block.kv_head, block.row0, block.split);
    if (params.num_splits > 1) decode_combine_splits<Kt>(params, block, reinterpret_cast<typename Kt::Accum*>(smem));
}

// ---------------------------------------------------------------------------- CUDA cores, one row

// Keys per warp of the staged kernel's tiles: the largest power of two up to 32 that keeps a
// tile of K within 8 KiB (its V the same): a ring of four stages then keeps 48 KiB in flight per
// block, in at most ~90 KiB of shared memory (two blocks per SM on an H100, one on an A100).
template <typename Storage, int kHeadDim, int kNWarps>
__host__ __device__ constexpr int decode_warp_keys() {
    int keys = 32;
    while (keys > 1 && keys * kNWarps * kHeadDim * static_cast<int>(sizeof(Storage)) > 8 * 1024) keys /= 2;
    return keys;
}

// The CUDA-core kernel for one query row per K/V head (multi-head attention, one new token): K_j
// and V_j of kBlockN = kWarpKeys·kNWarps keys in a kStages-deep cp.async ring (kStages - 1 tiles in
// flight while one is used), each warp taking kWarpKeys keys of a tile. A key's score is summed by
// kLanes = 32 / kWarpKeys lanes, over every kLanes-th 16-byte chunk of its row each, then added
// across them by shuffles; P V takes the head dim's columns lane, lane + 32, ... With more rows
// its softmax step per 2-8 keys costs more than the per-lane kernel's per 32 (docs/performance.md).
template <typename Element_, int kHeadDim_, int kNWarps_, int kStages_, int kRows_ = 1>
struct DecodeStagedTraits
    : DecodeLayout<Element_, kHeadDim_, kRows_, kNWarps_,
                   kNWarps_ * decode_warp_keys<typename NumericTraits<Element_>::Storage, kHeadDim_, kNWarps_>()> {
    using Base = DecodeLayout<Element_, kHeadDim_, kRows_, kNWarps_,
                              kNWarps_ * decode_warp_keys<typename NumericTraits<Element_>::Storage, kHeadDim_, kNWarps_>()>;
    using Storage = typename Base::Storage;
    using Accum = typename Base::Accum;
    static constexpr int kColsPerLane = (kHeadDim_ + 31) / 32;
    static constexpr int kLanes = 32 / Base::kWarpKeys;  // lanes that share a key's scores
    static constexpr int kChunk = 16 / static_cast<int>(sizeof(Storage));  // elements of a 16-byte chunk
    static constexpr int kRowChunks = kHeadDim_ / kChunk;
    static constexpr int kLaneChunks = (kRowChunks + kLanes - 1) / kLanes;  // chunks of a row per lane
    // A 16-byte load's 8-lane phase reads 8 / kLanes keys x kLanes chunks (or 8 chunks of one key):
    // rows kLanes chunks apart modulo 8 put them in 8 different bank groups. (Rows of fewer than 8
    // chunks stay unpadded: up to 7 chunks of padding would more than double them.)
    static constexpr int kPadChunks = kLanes >= 8 || kRowChunks < 8 ? 0 : ((kLanes - kRowChunks) % 8 + 8) % 8;
    static constexpr int kStride = kHeadDim_ + kPadChunks * kChunk;  // K_j, V_j rows in shared memory, elements
    static constexpr int kStages = kStages_;
    static constexpr int kTileBytes = Base::kBlockN * kStride * static_cast<int>(sizeof(Storage));
    static constexpr int kQBytes = kRows_ * kHeadDim_ * static_cast<int>(sizeof(Accum));
    static constexpr int kSmemKvOffset = (kQBytes + 15) / 16 * 16;  // bytes: Q [kRows][kHeadDim] Accum, then the ring
    static constexpr int kRingBytes = kSmemKvOffset + kStages * 2 * kTileBytes;
    static constexpr int kSmemBytes = kRingBytes > Base::kMergeBytes ? kRingBytes : Base::kMergeBytes;
    static_assert(kHeadDim_ % kChunk == 0, "rows of whole 16-byte chunks");
    static_assert(kStages >= 2, "a ring of at least two tiles");
    static_assert(kSmemBytes >= Base::kCombineBytes, "decode_combine_splits' weights fit in the block's shared memory");
};

// kScoreMod: as the tensor-core kernel's.
template <typename Kt, bool kScoreMod = false>
__global__ void __launch_bounds__(Kt::kNThreads, 1) flash_decode_staged_kernel(const DecodeParams params) {
    using Accum = typename Kt::Accum;
    using Storage = typename Kt::Storage;
    using Numeric = typename Kt::Numeric;
    extern __shared__ __align__(16) unsigned char smem[];
    Accum* sQ = reinterpret_cast<Accum*>(smem);  // [kRows][kHeadDim], prescaled: scores in log2 units
    const unsigned sKv = smem_address(smem) + Kt::kSmemKvOffset;
    const DecodeBlock block = DecodeBlock::of<Kt::kRows>(params);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int seqlen_k = decode_seqlen_k(params, block.batch_idx);
    const int rows_valid = min(Kt::kRows, params.rows - block.row0);
    const int2 tiles = decode_key_tiles<Kt::kBlockN>(params, seqlen_k, block.row0, rows_valid, block.split);
    const Accum scale_log2 = static_cast<Accum>(params.scale_log2);

    const Storage* k = static_cast<const Storage*>(params.k) + block.batch_idx * params.k_batch_stride +
                       block.kv_head * params.k_head_stride;
    const Storage* v = static_cast<const Storage*>(params.v) + block.batch_idx * params.v_batch_stride +
                       block.kv_head * params.v_head_stride;
    auto load_kv = [&](int tile) {  // K_j, V_j of `tile` into its stage of the ring
        const unsigned stage = sKv + (tile - tiles.x) % Kt::kStages * 2 * Kt::kTileBytes;
        const int col0 = tile * Kt::kBlockN, keys_valid = min(Kt::kBlockN, seqlen_k - col0);
        load_decode_tile<Kt>(stage, k + col0 * params.k_row_stride, params.k_row_stride, keys_valid, params.head_dim);
        load_decode_tile<Kt>(stage + Kt::kTileBytes, v + col0 * params.v_row_stride, params.v_row_stride, keys_valid,
                             params.head_dim);
    };
    for (int s = 0; s < Kt::kStages - 1; ++s) {
        if (tiles.x + s < tiles.y) load_kv(tiles.x + s);
        cp_async_commit();
    }
    load_decode_queries<Kt>(sQ, Kt::kHeadDim, params, block.batch_idx, block.kv_head, block.row0,
                            [&](Storage x) { return Numeric::to_accum(x) * scale_log2; });

    Accum O[Kt::kRows][Kt::kColsPerLane], m[Kt::kRows], l[Kt::kRows];
#pragma unroll
    for (int r = 0; r < Kt::kRows; ++r) {
        m[r] = neg_inf<Accum>(), l[r] = Accum(0);
#pragma unroll
        for (int j = 0; j < Kt::kColsPerLane; ++j) O[r][j] = Accum(0);
    }
    const int offset = seqlen_k - params.seqlen_q;  // query i sits at key position i + offset
    const bool modified = kScoreMod && decode_scores_modified(params);
    const int u = lane / Kt::kLanes, part = lane % Kt::kLanes;  // this lane's key of the warp's, its share
    for (int t = tiles.x; t < tiles.y; ++t) {
        cp_async_wait<Kt::kStages - 2>();
        __syncthreads();  // tile t (and Q) have landed; every warp is done with tile t - 1, whose stage is reloaded now
        if (t + Kt::kStages - 1 < tiles.y) load_kv(t + Kt::kStages - 1);
        cp_async_commit();

        const unsigned char* stage = smem + Kt::kSmemKvOffset + (t - tiles.x) % Kt::kStages * 2 * Kt::kTileBytes;
        const Storage* sK = reinterpret_cast<const Storage*>(stage) + warp * Kt::kWarpKeys * Kt::kStride;
        const Storage* sV = sK + Kt::kBlockN * Kt::kStride;
        const int col0 = t * Kt::kBlockN + warp * Kt::kWarpKeys;
        const int keys = min(Kt::kWarpKeys, seqlen_k - col0);  // may be <= 0 in the last tile
        const int key = col0 + u;
        // S_ij: key u's score against every row, over its chunks part, part + kLanes, ... (held in
        // registers), then summed across its kLanes lanes. Columns past head_dim are zero in sQ,
        // sK. The row loops stop at the valid rows: a step of one query row leaves the other
        // kRows - 1 unissued (predicated, they were most of its instructions).
        Accum x[Kt::kLaneChunks][Kt::kChunk];
#pragma unroll
        for (int i = 0; i < Kt::kLaneChunks; ++i) {
            const int chunk = part + i * Kt::kLanes;
            const bool inside = Kt::kRowChunks % Kt::kLanes == 0 || chunk < Kt::kRowChunks;
            const Vec<Storage, Kt::kChunk> raw = *reinterpret_cast<const Vec<Storage, Kt::kChunk>*>(
                sK + u * Kt::kStride + (inside ? chunk : 0) * Kt::kChunk);
#pragma unroll
            for (int e = 0; e < Kt::kChunk; ++e) x[i][e] = inside ? Numeric::to_accum(raw.x[e]) : Accum(0);
        }
        constexpr int kQVec = 16 / static_cast<int>(sizeof(Accum));  // Q's elements per 16-byte load
        Accum S[Kt::kRows];
#pragma unroll
        for (int r = 0; r < Kt::kRows; ++r) {
            S[r] = Accum(0);
            if (r >= rows_valid) continue;
#pragma unroll
            for (int i = 0; i < Kt::kLaneChunks; ++i) {
                const int chunk = min(part + i * Kt::kLanes, Kt::kRowChunks - 1);  // (x is 0 past the row)
#pragma unroll
                for (int e0 = 0; e0 < Kt::kChunk; e0 += kQVec) {
                    const Vec<Accum, kQVec> q =
                        *reinterpret_cast<const Vec<Accum, kQVec>*>(sQ + r * Kt::kHeadDim + chunk * Kt::kChunk + e0);
#pragma unroll
                    for (int e = 0; e < kQVec; ++e) S[r] += q.x[e] * x[i][e0 + e];
                }
            }
        }
        // Mask, then the online softmax of each row over the warp's keys (each held by kLanes lanes;
        // the row sums take it once).
#pragma unroll
        for (int r = 0; r < Kt::kRows; ++r) {
            if (r >= rows_valid) break;
#pragma unroll
            for (int s = 1; s < Kt::kLanes; s *= 2) S[r] += shfl_xor(S[r], s);
            const int query = (block.row0 + r) / params.kv_group + offset;
            if (u >= keys || key < query - params.window_left || key > query + params.window_right)
                S[r] = neg_inf<Accum>();
            if (modified) {  // softcap, ALiBi (S is in log2 units: Q was prescaled)
                const ScoreMod<Accum> mod(static_cast<Accum>(params.softcap_log2),
                                          decode_row_slope<Accum>(params, block.batch_idx, block.kv_head, block.row0 + r));
                Accum dx;
                S[r] = mod.template apply<Tanh::kAccurate>(S[r], query, key, dx);
            }
            const Accum m_new = max_(m[r], warp_max(S[r]));
            const Accum m_safe = m_new == neg_inf<Accum>() ? Accum(0) : m_new;
            const Accum rescale = exp2_(m[r] - m_safe);
            S[r] = exp2_(S[r] - m_safe);  // P_ij
            l[r] = l[r] * rescale + (part == 0 ? S[r] : Accum(0));  // a per-lane partial sum, reduced at the end
            m[r] = m_new;
#pragma unroll
            for (int j = 0; j < Kt::kColsPerLane; ++j) O[r][j] *= rescale;
        }
        // O_i += P_ij V_j: each key's probability broadcast from the first of its lanes, V_j's rows
        // from shared memory (consecutive columns: no bank conflicts).
#pragma unroll
        for (int uu = 0; uu < Kt::kWarpKeys; ++uu) {
            if (uu >= keys) break;
            Accum x[Kt::kColsPerLane];
#pragma unroll
            for (int j = 0; j < Kt::kColsPerLane; ++j) {
                const int c = lane + 32 * j;
                x[j] = Kt::kHeadDim % 32 == 0 || c < Kt::kHeadDim ? Numeric::to_accum(sV[uu * Kt::kStride + c]) : Accum(0);
            }
#pragma unroll
            for (int r = 0; r < Kt::kRows; ++r) {
                if (r >= rows_valid) break;
                const Accum p = __shfl_sync(0xffffffffu, S[r], uu * Kt::kLanes);
#pragma unroll
                for (int j = 0; j < Kt::kColsPerLane; ++j) O[r][j] += p * x[j];
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the merge below overwrites Q and the ring

    Accum* sM = reinterpret_cast<Accum*>(smem);
    Accum* sL = sM + Kt::kNWarps * Kt::kRows;
    Accum* sO = sL + Kt::kNWarps * Kt::kRows;
#pragma unroll
    for (int r = 0; r < Kt::kRows; ++r) {
        const Accum l_row = warp_sum(l[r]);
        if (lane == 0) sM[warp * Kt::kRows + r] = m[r], sL[warp * Kt::kRows + r] = l_row;
#pragma unroll
        for (int j = 0; j < Kt::kColsPerLane; ++j)
            if (lane + 32 * j < Kt::kHeadDim) sO[(warp * Kt::kRows + r) * Kt::kOStride + lane + 32 * j] = O[r][j];
    }
    __syncthreads();  // every warp's state is in shared memory
    decode_merge_and_store<Kt, 1>(params, sM, sL, sO, block.batch_idx, block.kv_head, block.row0, block.split);
    if (params.num_splits > 1) decode_combine_splits<Kt>(params, block, reinterpret_cast<typename Kt::Accum*>(smem));
}

// ---------------------------------------------------------------------------- CUDA cores

// kRows packed rows; each warp takes 32 keys of every tile of kBlockN = 32·kNWarps keys, one key
// per lane for the scores, then the head dim's columns (lane, lane + 32, ...) for P V. Rows past
// the valid ones are skipped by a warp-uniform branch (decoding often has a single row).
template <typename Element_, int kHeadDim_, int kRows_, int kNWarps_>
struct DecodeTraits : DecodeLayout<Element_, kHeadDim_, kRows_, kNWarps_, 32 * kNWarps_> {
    using Base = DecodeLayout<Element_, kHeadDim_, kRows_, kNWarps_, 32 * kNWarps_>;
    static constexpr int kColsPerLane = (kHeadDim_ + 31) / 32;
    // Keys whose V rows are loaded together: 32 words of registers (8 at d128 in float32), at
    // most 8 keys, one where a key takes 16 words (more spilled: 16 keys of d16 float32 at
    // sm_90a, 2 keys of d256 float64).
    static constexpr int kVWords = kColsPerLane * static_cast<int>(sizeof(typename Base::Accum)) / 4;
    static constexpr int kVKeys = kVWords >= 16 ? 1 : (32 / kVWords < 8 ? 32 / kVWords : 8);
    static constexpr int kQBytes = kRows_ * kHeadDim_ * static_cast<int>(sizeof(typename Base::Accum));
    static constexpr int kSmemBytes = kQBytes > Base::kMergeBytes ? kQBytes : Base::kMergeBytes;
    static_assert(kSmemBytes >= Base::kCombineBytes, "decode_combine_splits' weights fit in the block's shared memory");
};

// kScoreMod: as the tensor-core kernel's.
template <typename Kt, bool kScoreMod = false>
__global__ void __launch_bounds__(Kt::kNThreads, kScoreMod ? 1 : 0) flash_decode_kernel(const DecodeParams params) {
    using Accum = typename Kt::Accum;
    using Storage = typename Kt::Storage;
    using Numeric = typename Kt::Numeric;
    extern __shared__ __align__(16) unsigned char smem[];
    Accum* sQ = reinterpret_cast<Accum*>(smem);  // [kRows][kHeadDim], prescaled: scores in log2 units
    const DecodeBlock block = DecodeBlock::of<Kt::kRows>(params);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int seqlen_k = decode_seqlen_k(params, block.batch_idx);
    const int rows_valid = min(Kt::kRows, params.rows - block.row0);
    const int2 tiles = decode_key_tiles<Kt::kBlockN>(params, seqlen_k, block.row0, rows_valid, block.split);
    const Accum scale_log2 = static_cast<Accum>(params.scale_log2);
    load_decode_queries<Kt>(sQ, Kt::kHeadDim, params, block.batch_idx, block.kv_head, block.row0,
                            [&](Storage x) { return Numeric::to_accum(x) * scale_log2; });
    __syncthreads();  // Q is in shared memory

    const Storage* k = static_cast<const Storage*>(params.k) + block.batch_idx * params.k_batch_stride +
                       block.kv_head * params.k_head_stride;
    const Storage* v = static_cast<const Storage*>(params.v) + block.batch_idx * params.v_batch_stride +
                       block.kv_head * params.v_head_stride;
    Accum O[Kt::kRows][Kt::kColsPerLane], m[Kt::kRows], l[Kt::kRows];
#pragma unroll
    for (int r = 0; r < Kt::kRows; ++r) {
        m[r] = neg_inf<Accum>(), l[r] = Accum(0);
#pragma unroll
        for (int j = 0; j < Kt::kColsPerLane; ++j) O[r][j] = Accum(0);
    }
    const int offset = seqlen_k - params.seqlen_q;  // query i sits at key position i + offset
    const bool modified = kScoreMod && decode_scores_modified(params);
    constexpr int kVec = 16 / static_cast<int>(sizeof(Storage));
    const bool k_vectors = params.head_dim % kVec == 0 && params.k_row_stride % kVec == 0 &&
                           reinterpret_cast<unsigned long long>(k) % 16 == 0;
    for (int t = tiles.x; t < tiles.y; ++t) {
        const int col0 = t * Kt::kBlockN + warp * Kt::kWarpKeys;
        const int keys = min(Kt::kWarpKeys, seqlen_k - col0);  // may be <= 0 in the last tile
        const int key = col0 + lane;
        // S_ij: lane `key`'s score against every row.
        Accum S[Kt::kRows];
#pragma unroll
        for (int r = 0; r < Kt::kRows; ++r) S[r] = Accum(0);
        if (lane < keys) {
            const Storage* k_row = k + key * params.k_row_stride;
            const auto add_column = [&](int c, Storage element) {
                const Accum x = Numeric::to_accum(element);
#pragma unroll
                for (int r = 0; r < Kt::kRows; ++r)
                    if (r < rows_valid) S[r] += sQ[r * Kt::kHeadDim + c] * x;
            };
            if (k_vectors) {  // 16 bytes per load: a quarter of the load instructions for float32
#pragma unroll 2
                for (int c = 0; c < params.head_dim; c += kVec) {
                    const uint4 raw = *reinterpret_cast<const uint4*>(k_row + c);
                    const Storage* elements = reinterpret_cast<const Storage*>(&raw);
#pragma unroll
                    for (int e = 0; e < kVec; ++e) add_column(c + e, elements[e]);
                }
            } else {
#pragma unroll 4
                for (int c = 0; c < params.head_dim; ++c) add_column(c, k_row[c]);
            }
        }
        // Mask, then the online softmax of each row over the warp's 32 keys.
#pragma unroll
        for (int r = 0; r < Kt::kRows; ++r) {
            if (r >= rows_valid) continue;
            const int query = (block.row0 + r) / params.kv_group + offset;
            if (lane >= keys || key < query - params.window_left || key > query + params.window_right)
                S[r] = neg_inf<Accum>();
            if (modified) {  // softcap, ALiBi (S is in log2 units: Q was prescaled)
                const ScoreMod<Accum> mod(static_cast<Accum>(params.softcap_log2),
                                          decode_row_slope<Accum>(params, block.batch_idx, block.kv_head, block.row0 + r));
                Accum dx;
                S[r] = mod.template apply<Tanh::kAccurate>(S[r], query, key, dx);
            }
            const Accum m_new = max_(m[r], warp_max(S[r]));
            const Accum m_safe = m_new == neg_inf<Accum>() ? Accum(0) : m_new;
            const Accum rescale = exp2_(m[r] - m_safe);
            S[r] = exp2_(S[r] - m_safe);  // P_ij
            l[r] = l[r] * rescale + S[r];  // a per-lane partial sum, reduced at the end
            m[r] = m_new;
#pragma unroll
            for (int j = 0; j < Kt::kColsPerLane; ++j) O[r][j] *= rescale;
        }
        // O_i += P_ij V_j: kVKeys keys at a time, their V rows loaded before any is used (one key
        // per step left a DRAM latency per key on the path), their probabilities broadcast from the
        // lanes that hold them. Keys past `keys` load nothing (x = 0): the lane their index wraps
        // to in the shuffle then adds nothing.
        for (int kk0 = 0; kk0 < keys; kk0 += Kt::kVKeys) {
            Accum x[Kt::kVKeys][Kt::kColsPerLane];
#pragma unroll
            for (int u = 0; u < Kt::kVKeys; ++u) {
                const Storage* v_row = v + (col0 + kk0 + u) * params.v_row_stride;
#pragma unroll
                for (int j = 0; j < Kt::kColsPerLane; ++j) {
                    const int c = lane + 32 * j;
                    x[u][j] = kk0 + u < keys && c < params.head_dim ? Numeric::to_accum(v_row[c]) : Accum(0);
                }
            }
#pragma unroll
            for (int u = 0; u < Kt::kVKeys; ++u)
#pragma unroll
                for (int r = 0; r < Kt::kRows; ++r) {
                    if (r >= rows_valid) continue;
                    const Accum p = __shfl_sync(0xffffffffu, S[r], kk0 + u);
#pragma unroll
                    for (int j = 0; j < Kt::kColsPerLane; ++j) O[r][j] += p * x[u][j];
                }
        }
    }
    __syncthreads();  // the merge below overwrites Q

    Accum* sM = reinterpret_cast<Accum*>(smem);
    Accum* sL = sM + Kt::kNWarps * Kt::kRows;
    Accum* sO = sL + Kt::kNWarps * Kt::kRows;
#pragma unroll
    for (int r = 0; r < Kt::kRows; ++r) {
        const Accum l_row = warp_sum(l[r]);
        if (lane == 0) sM[warp * Kt::kRows + r] = m[r], sL[warp * Kt::kRows + r] = l_row;
#pragma unroll
        for (int j = 0; j < Kt::kColsPerLane; ++j)
            if (lane + 32 * j < Kt::kHeadDim) sO[(warp * Kt::kRows + r) * Kt::kOStride + lane + 32 * j] = O[r][j];
    }
    __syncthreads();  // every warp's state is in shared memory
    decode_merge_and_store<Kt, 1>(params, sM, sL, sO, block.batch_idx, block.kv_head, block.row0, block.split);
    if (params.num_splits > 1) decode_combine_splits<Kt>(params, block, reinterpret_cast<typename Kt::Accum*>(smem));
}

// ---------------------------------------------------------------------------- append

// k[b, cache_seqlens[b] + j, h] = k_new[b, j, h] (and v), for j < seqlen_new; rows past the
// cache's capacity are dropped (the host rejects such calls when it can see cache_seqlens).
// Grid: (seqlen_new, heads_kv, batch).
template <typename Element>
__global__ void __launch_bounds__(128) flash_decode_append_kernel(const DecodeParams params) {
    using Storage = typename NumericTraits<Element>::Storage;
    const int j = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int pos = (params.cache_seqlens ? max(params.cache_seqlens[b], 0) : 0) + j;
    if (pos >= params.cache_len) return;
    Storage* k = static_cast<Storage*>(params.k) + b * params.k_batch_stride + pos * params.k_row_stride +
                 h * params.k_head_stride;
    Storage* v = static_cast<Storage*>(params.v) + b * params.v_batch_stride + pos * params.v_row_stride +
                 h * params.v_head_stride;
    const Storage* k_new = static_cast<const Storage*>(params.k_new) + b * params.k_new_batch_stride +
                           j * params.k_new_row_stride + h * params.k_new_head_stride;
    const Storage* v_new = static_cast<const Storage*>(params.v_new) + b * params.v_new_batch_stride +
                           j * params.v_new_row_stride + h * params.v_new_head_stride;
    for (int c = threadIdx.x; c < params.head_dim; c += blockDim.x) {
        k[c] = k_new[c];
        v[c] = v_new[c];
    }
}

}  // namespace cupyflash
