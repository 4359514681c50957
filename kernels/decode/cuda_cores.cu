// KV-cache decoding on CUDA cores (see decode/decode.cuh for the scheme), every dtype: a kernel
// staged through shared memory for one query row per K/V head, and one with a key per lane for
// more rows; each merges its splits at the end (decode_combine_splits). Instantiations:
// cupyflash/catalog.
#include "decode/steps.cuh"

namespace cupyflash {

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

}  // namespace cupyflash
