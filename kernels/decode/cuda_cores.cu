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

// Columns of K per chunk of the CUDA-core kernel's ring: up to 128 bytes of a key's row (a whole
// line), a power of two dividing the head dim.
template <typename Storage, int kHeadDim>
__host__ __device__ constexpr int decode_k_chunk_cols() {
    int cols = 128 / static_cast<int>(sizeof(Storage));
    while (kHeadDim % cols != 0) cols /= 2;
    return cols;
}

// kRows packed rows; each warp takes 32 keys of every tile of kBlockN = 32·kNWarps keys, one key
// per lane for the scores, then the head dim's columns (lane, lane + 32, ...) for P V. Rows past
// the valid ones are skipped by a warp-uniform branch (decoding often has a single row).
// K reaches shared memory by chunks of a warp's 32 keys x kKCols columns, in a ring of kKStages
// chunks per warp: the loads are whole lines, and each lane then reads its own key's row from
// shared memory (read from global memory, a lane's 16 bytes of 32 different lines per load held
// the kernel to 0.16-0.32 of a copy's bandwidth). V's rows are read across the lanes, coalesced.
template <typename Element_, int kHeadDim_, int kRows_, int kNWarps_>
struct DecodeTraits : DecodeLayout<Element_, kHeadDim_, kRows_, kNWarps_, 32 * kNWarps_> {
    using Base = DecodeLayout<Element_, kHeadDim_, kRows_, kNWarps_, 32 * kNWarps_>;
    using Storage = typename Base::Storage;
    static constexpr int kColsPerLane = (kHeadDim_ + 31) / 32;
    // Keys whose V rows are loaded together: 32 words of registers (8 at d128 in float32), at
    // most 8 keys, one where a key takes 16 words (more spilled: 16 keys of d16 float32 at
    // sm_90a, 2 keys of d256 float64).
    static constexpr int kVWords = kColsPerLane * static_cast<int>(sizeof(typename Base::Accum)) / 4;
    static constexpr int kVKeys = kVWords >= 16 ? 1 : (32 / kVWords < 8 ? 32 / kVWords : 8);
    static constexpr int kQBytes = kRows_ * kHeadDim_ * static_cast<int>(sizeof(typename Base::Accum));
    static constexpr int kKCols = decode_k_chunk_cols<Storage, kHeadDim_>();
    static constexpr int kKChunks = kHeadDim_ / kKCols;
    // A key's chunk padded by 16 bytes: the 8 lanes of a 16-byte load's phase, 8 keys, then hit 8
    // different bank groups (chunks of 32-128 bytes).
    static constexpr int kKRowBytes = kKCols * static_cast<int>(sizeof(Storage)) + 16;
    static constexpr int kKChunkBytes = 32 * kKRowBytes;
    static constexpr int kKStages = 3;
    static constexpr int kSmemKOffset = (kQBytes + 15) / 16 * 16;  // bytes: Q [kRows][kHeadDim] Accum, then the rings
    static constexpr int kRingBytes = kSmemKOffset + kNWarps_ * kKStages * kKChunkBytes;
    static constexpr int kSmemBytes = kRingBytes > Base::kMergeBytes ? kRingBytes : Base::kMergeBytes;
    static_assert(Base::kWarpKeys == 32, "a key per lane");
    static_assert(kKCols * static_cast<int>(sizeof(Storage)) >= 32, "chunks of 2 to 8 16-byte pieces a key");
    static_assert(kSmemBytes >= Base::kCombineBytes, "decode_combine_splits' weights fit in the block's shared memory");
};

// Chunk [key0, key0 + 32) x [col0, col0 + kKCols) of a warp's K into its ring slot s_chunk
// ([32][kKRowBytes]) by cp.async, zero past keys_valid and head_dim: kPieces 16-byte pieces a key,
// 32 / kPieces keys a pass, so each load instruction reads whole lines. k: the K/V head's first
// row, 16-byte aligned with its row stride.
template <typename Kt>
__device__ __forceinline__ void load_decode_k_chunk(unsigned s_chunk, const typename Kt::Storage* k,
                                                    long long row_stride, int key0, int keys_valid, int col0,
                                                    int head_dim, int lane) {
    constexpr int kSize = static_cast<int>(sizeof(typename Kt::Storage));
    constexpr int kPieces = Kt::kKCols * kSize / 16;
    constexpr int kKeysPerPass = 32 / kPieces;
    const int piece = lane % kPieces, col = col0 + piece * (16 / kSize);
#pragma unroll
    for (int pass = 0; pass < kPieces; ++pass) {
        const int key = lane / kPieces + pass * kKeysPerPass;
        // Pieces past the keys or head_dim copy nothing from the head's first row (a safe address).
        const int bytes = key < keys_valid ? max(0, min(16, (head_dim - col) * kSize)) : 0;
        cp_async_16(s_chunk + key * Kt::kKRowBytes + piece * 16, k + (bytes > 0 ? (key0 + key) * row_stride + col : 0),
                    bytes);
    }
}

// kScoreMod: as the tensor-core kernel's. One block per SM as the launch bound: left to itself,
// ptxas held d16-32 to 128 registers (d224 float64 to 168) and spilled beside the K ring.
template <typename Kt, bool kScoreMod = false>
__global__ void __launch_bounds__(Kt::kNThreads, 1) flash_decode_kernel(const DecodeParams params) {
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
    constexpr int kVec = 16 / static_cast<int>(sizeof(Storage)), kQVec = 16 / static_cast<int>(sizeof(Accum));
    // K through the ring where its rows start on 16 bytes; otherwise each lane reads its key's
    // row from global memory element by element.
    const bool k_staged =
        ((reinterpret_cast<unsigned long long>(k) | static_cast<unsigned long long>(params.k_row_stride * sizeof(Storage))) &
         15) == 0;
    const unsigned char* s_ring = smem + Kt::kSmemKOffset + warp * Kt::kKStages * Kt::kKChunkBytes;
    const int chunks = (tiles.y - tiles.x) * Kt::kKChunks;  // the warp's chunks, tile by tile
    const auto load_k_chunk = [&](int n) {  // chunk n into its slot (a group of its own, empty past the last)
        if (n < chunks) {
            const int key0 = (tiles.x + n / Kt::kKChunks) * Kt::kBlockN + warp * Kt::kWarpKeys;
            load_decode_k_chunk<Kt>(smem_address(s_ring + n % Kt::kKStages * Kt::kKChunkBytes), k, params.k_row_stride,
                                    key0, seqlen_k - key0, n % Kt::kKChunks * Kt::kKCols, params.head_dim, lane);
        }
        cp_async_commit();
    };
    if (k_staged)
        for (int n = 0; n < Kt::kKStages - 1; ++n) load_k_chunk(n);
    for (int t = tiles.x; t < tiles.y; ++t) {
        const int col0 = t * Kt::kBlockN + warp * Kt::kWarpKeys;
        const int keys = min(Kt::kWarpKeys, seqlen_k - col0);  // may be <= 0 in the last tile
        const int key = col0 + lane;
        // S_ij: lane `key`'s score against every row.
        Accum S[Kt::kRows];
#pragma unroll
        for (int r = 0; r < Kt::kRows; ++r) S[r] = Accum(0);
        if (k_staged) {  // every lane: keys past `keys` are zero rows, masked below
            const int n0 = (t - tiles.x) * Kt::kKChunks;
#pragma unroll 1
            for (int ch = 0; ch < Kt::kKChunks; ++ch) {
                cp_async_wait<Kt::kKStages - 2>();
                __syncwarp();  // chunk n0 + ch has landed for every lane; every lane is done with the slot reloaded now
                load_k_chunk(n0 + ch + Kt::kKStages - 1);
                // The key's chunk in registers, then each valid row's product with it. (With the
                // row loop inside the column loop, the invalid rows' FMAs issue predicated off, 12
                // of 16 for a GQA group of 4 in a 16-row build, each with a shared load.)
                const Storage* row = reinterpret_cast<const Storage*>(s_ring + (n0 + ch) % Kt::kKStages * Kt::kKChunkBytes +
                                                                      lane * Kt::kKRowBytes);
                Accum x[Kt::kKCols];
#pragma unroll
                for (int c = 0; c < Kt::kKCols; c += kVec) {
                    const Vec<Storage, kVec> chunk = load_vec<kVec>(row + c);
#pragma unroll
                    for (int e = 0; e < kVec; ++e) x[c + e] = Numeric::to_accum(chunk.x[e]);
                }
#pragma unroll
                for (int r = 0; r < Kt::kRows; ++r) {
                    if (r >= rows_valid) break;
                    const Accum* q = sQ + r * Kt::kHeadDim + ch * Kt::kKCols;
#pragma unroll
                    for (int c = 0; c < Kt::kKCols; c += kQVec) {
                        const Vec<Accum, kQVec> qc = load_vec<kQVec>(q + c);
#pragma unroll
                        for (int e = 0; e < kQVec; ++e) S[r] += qc.x[e] * x[c + e];
                    }
                }
            }
        } else if (lane < keys) {
            const Storage* k_row = k + key * params.k_row_stride;
#pragma unroll 4
            for (int c = 0; c < params.head_dim; ++c) {
                const Accum x = Numeric::to_accum(k_row[c]);
#pragma unroll
                for (int r = 0; r < Kt::kRows; ++r)
                    if (r < rows_valid) S[r] += sQ[r * Kt::kHeadDim + c] * x;
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
            for (int r = 0; r < Kt::kRows; ++r) {  // the valid rows only, as the scores'
                if (r >= rows_valid) break;
#pragma unroll
                for (int u = 0; u < Kt::kVKeys; ++u) {
                    const Accum p = __shfl_sync(0xffffffffu, S[r], kk0 + u);
#pragma unroll
                    for (int j = 0; j < Kt::kColsPerLane; ++j) O[r][j] += p * x[u][j];
                }
            }
        }
    }
    cp_async_wait<0>();  // the groups past the last chunk are empty, but counted
    __syncthreads();  // the merge below overwrites Q and the rings

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
