// KV-cache decoding on tensor cores (see decode/decode.cuh for the scheme): the kernel for
// float16/bfloat16 on sm_80+ (merging its splits at the end, decode_combine_splits) and the
// in-place append of new keys and values. The CUDA-core kernels: cuda_cores.cu. Instantiations:
// cupyflash/catalog.
#include "decode/steps.cuh"
#include "sm80/gemm.cuh"

namespace cupyflash {

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
