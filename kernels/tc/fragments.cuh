// Warp-level steps shared by every tensor-core kernel, mma.sync (sm80/) and wgmma (sm90/) alike:
// tile loads with cp.async, fragment conversions, the online softmax, masks, score modifiers and
// dropout on fragments, and the epilogues' stores.
//
// A warp's accumulator tile C[kMTiles][kNTiles][4] holds, for m16 tile mt and n8 tile nt, the
// elements (row mt·16 + g + 8h, column nt·8 + 2t + e) at C[mt][nt][2h + e], lane = 4g + t
// (arch/sm80.cuh). Rows are local to the warp's tile, columns to the product's column range.
// A wgmma accumulator is this layout with kMTiles = 1 (arch/sm90.cuh).
#pragma once
#include "tc/layouts.cuh"
#include "common/tile_sequence.cuh"
#include "common/score_mod.cuh"

namespace cupyflash {

struct Fragment {
    int g, t;  // lane = 4g + t
    __device__ __forceinline__ explicit Fragment(int lane) : g(lane / 4), t(lane % 4) {}
    __device__ __forceinline__ int row(int mt, int h) const { return mt * 16 + g + 8 * h; }
    __device__ __forceinline__ int col(int nt, int e) const { return nt * 8 + 2 * t + e; }
};

// Copies a kRows x head_dim tile (rows row_stride apart, head dim contiguous) into a
// [kRows][head dim] shared-memory tile at byte address s_tile, laid out as Lt says (padded rows of
// Lt::kStride, or swizzled panels: Lt::tile_offset), zero-filling rows >= rows_valid
// and columns >= head_dim, so that padding adds nothing to a product and no stale value (possibly
// NaN) meets a zero weight. Thread i always moves the 16-byte chunk (row i / chunks-per-row + a
// multiple of kRowsPerPass, column chunk i % chunks-per-row), so its addresses advance by a fixed
// step per pass: a 64-bit add, not a recomputation. 16-byte cp.async when the source rows are
// 16-byte aligned (the caller commits and waits); otherwise (odd head dims or strides) element by
// element, synchronously. rows_valid >= 1: row 0 is a safe address for the chunks that copy nothing.
template <typename Lt, int kRows>
__device__ __forceinline__ void load_tile_async(unsigned s_tile, const typename Lt::Storage* g_tile,
                                                long long row_stride, int rows_valid, int head_dim) {
    using Storage = typename Lt::Storage;
    constexpr int kChunk = 16 / static_cast<int>(sizeof(Storage));  // elements of a 16-byte chunk
    constexpr int kChunksPerRow = Lt::kHeadDim / kChunk;
    constexpr int kRowsPerPass = Lt::kNThreads / kChunksPerRow;  // threads past a whole row idle
    constexpr int kPasses = (kRows + kRowsPerPass - 1) / kRowsPerPass;
    static_assert(kRowsPerPass > 0, "a block must cover one tile row per pass");
    const int row = threadIdx.x / kChunksPerRow, col = threadIdx.x % kChunksPerRow * kChunk;
    if (Lt::kNThreads % kChunksPerRow != 0 && row >= kRowsPerPass) return;
    // A chunk wholly past head_dim copies nothing; its address stays inside the row.
    const int col_bytes = max(0, min(16, (head_dim - col) * static_cast<int>(sizeof(Storage))));
    const Storage* g = g_tile + row * row_stride + (col_bytes > 0 ? col : 0);
    const unsigned s = s_tile + Lt::template tile_offset<kRows>(row, col);
    const long long g_step = kRowsPerPass * row_stride;
    constexpr unsigned kSStep = Lt::row_bytes(kRowsPerPass);
    static_assert(kRowsPerPass % Lt::kRowPeriod == 0, "a pass moves every chunk by the same shared-memory step");
    const bool vectorised = ((reinterpret_cast<unsigned long long>(g_tile) |
                              static_cast<unsigned long long>(row_stride * sizeof(Storage))) & 15) == 0;
    if (vectorised && rows_valid >= kRows) {
#pragma unroll
        for (int p = 0; p < kPasses; ++p, g += g_step) {
            if (kRows % kRowsPerPass != 0 && row + p * kRowsPerPass >= kRows) break;
            cp_async_16(s + p * kSStep, g, col_bytes);
        }
    } else if (vectorised) {
#pragma unroll
        for (int p = 0; p < kPasses; ++p, g += g_step) {
            if (kRows % kRowsPerPass != 0 && row + p * kRowsPerPass >= kRows) break;
            const bool valid = row + p * kRowsPerPass < rows_valid;
            cp_async_16(s + p * kSStep, valid ? g : g_tile, valid ? col_bytes : 0);
        }
    } else {
#pragma unroll
        for (int p = 0; p < kPasses; ++p, g += g_step) {
            if (kRows % kRowsPerPass != 0 && row + p * kRowsPerPass >= kRows) break;
            const bool valid = row + p * kRowsPerPass < rows_valid;
            Vec<Storage, kChunk> x;
#pragma unroll
            for (int e = 0; e < kChunk; ++e) x.x[e] = valid && col + e < head_dim ? g[e] : Storage(0);
            store_shared_16(s + p * kSStep, &x);
        }
    }
}

// Rounds an accumulator tile to 16-bit A fragments: n8 tiles 2kk and 2kk+1 form k16 step kk.
template <typename Op, int kMTiles, int kNTiles>
__device__ __forceinline__ void to_a_fragments(const float (&C)[kMTiles][kNTiles][4],
                                               unsigned (&A)[kMTiles][kNTiles / 2][4]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int kk = 0; kk < kNTiles / 2; ++kk) {
            A[mt][kk][0] = Op::pack(C[mt][2 * kk][0], C[mt][2 * kk][1]);
            A[mt][kk][1] = Op::pack(C[mt][2 * kk][2], C[mt][2 * kk][3]);
            A[mt][kk][2] = Op::pack(C[mt][2 * kk + 1][0], C[mt][2 * kk + 1][1]);
            A[mt][kk][3] = Op::pack(C[mt][2 * kk + 1][2], C[mt][2 * kk + 1][3]);
        }
}

// Writes A fragments (a [rows][k] tile such as P^T) to a [rows][k] shared tile with row stride
// kStride, for other warps to read; s_tile: byte address of the warp's first row and first k.
// A fragment row holds 4 lanes' consecutive words and the 8 rows of a store phase start
// kStride·2 bytes apart (an odd number of 16-byte chunks), so the 32 words land in 32 banks.
template <int kStride, int kMTiles, int kKSteps>
__device__ __forceinline__ void store_a_fragments(unsigned s_tile, const unsigned (&A)[kMTiles][kKSteps][4],
                                                  const Fragment& f) {
    const unsigned s = s_tile + (f.g * kStride + 2 * f.t) * 2;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                // A register r holds row g + 8·(r % 2), columns 2t + 8·(r / 2) of the k16 step.
                store_shared_4(s + ((mt * 16 + 8 * (r % 2)) * kStride + kk * 16 + 8 * (r / 2)) * 2, A[mt][kk][r]);
}

// Waits for this thread's cp.async tile copies and publishes them to the block: behind the barrier
// every thread's copies have landed (and every warp is done with the tiles read before it).
// (The wgmma kernels' form, which also hands the tiles to the tensor cores, is sm90/wgmma.cuh's.)
template <typename Tt>
__device__ __forceinline__ void tiles_landed() {
    cp_async_wait<0>();
    __syncthreads();
}

template <typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void zero(T (&C)[kMTiles][kNTiles][4]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) C[mt][nt][i] = T(0);
}

// The 4 lanes of a fragment row hold its columns; these reduce over them.
template <typename T> __device__ __forceinline__ T quad_max(T x) {
    x = max_(x, shfl_xor(x, 1));
    return max_(x, shfl_xor(x, 2));
}
template <typename T> __device__ __forceinline__ T quad_sum(T x) {
    x += shfl_xor(x, 1);
    return x + shfl_xor(x, 2);
}

// The maximum of fragment row (mt, h) of S, times scale_log2 (the whole row: over its quad).
template <typename Kt, typename T = typename Kt::Accum>
__device__ __forceinline__ T row_max_log2(const T (&S)[Kt::kMTiles][Kt::kNTiles][4], int mt, int h, T scale_log2) {
    T m_tile = neg_inf<T>();
#pragma unroll
    for (int nt = 0; nt < Kt::kNTiles; ++nt) m_tile = max_(m_tile, max_(S[mt][nt][2 * h], S[mt][nt][2 * h + 1]));
    return quad_max(m_tile) * scale_log2;
}

// P_ij = exp2(S_ij·scale_log2 - m_safe) in place for fragment row (mt, h); returns this lane's
// share of the row's sum.
template <typename Kt, typename T = typename Kt::Accum>
__device__ __forceinline__ T exponentiate_row(T (&S)[Kt::kMTiles][Kt::kNTiles][4], int mt, int h, T scale_log2,
                                              T m_safe) {
    T row_sum = T(0);
#pragma unroll
    for (int nt = 0; nt < Kt::kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const T p = exp2_(fma_(S[mt][nt][2 * h + e], scale_log2, -m_safe));
            S[mt][nt][2 * h + e] = p;
            row_sum += p;
        }
    return row_sum;
}

template <typename Kt, typename T = typename Kt::Accum>
__device__ __forceinline__ void rescale_row(T (&O)[Kt::kMTiles][Kt::kHeadDim / 8][4], int mt, int h, T rescale) {
#pragma unroll
    for (int dt = 0; dt < Kt::kHeadDim / 8; ++dt) {
        O[mt][dt][2 * h] *= rescale;
        O[mt][dt][2 * h + 1] *= rescale;
    }
}

// Online softmax (FlashAttention-2, Algorithm 1, lines 9-10) on a warp's fragments: m_i (log2 units), l_i (a per-lane
// partial sum, reduced in the epilogue: FA2's deferred reduction) and the rescale of O_i. S is
// overwritten with P.
// kLazy: m_i, l_i and O_i are rescaled only in steps where some row of the warp finds a maximum
// more than kLazyRescaleLog2 above its m_i (always at its first finite one); otherwise the old
// m_i stays the reference, P_ij <= 2^kLazyRescaleLog2, and the step skips O_i's multiplies. It is
// the same softmax: O_i and l_i share the reference, and lse_i is formed from m_i and l_i. (On an
// H100: dense d64, three blocks per SM, 1.7-2.3% faster, block-sparse d64 0-1%; d128, one block
// per SM, 2.5% slower.)
constexpr float kLazyRescaleLog2 = 8.f;

template <typename Kt, bool kLazy = false, bool kFirst = false, typename T = typename Kt::Accum>
__device__ __forceinline__ void online_softmax_tc(T (&S)[Kt::kMTiles][Kt::kNTiles][4],
                                               T (&O)[Kt::kMTiles][Kt::kHeadDim / 8][4],
                                               T (&m)[Kt::kMTiles][2], T (&l)[Kt::kMTiles][2], T scale_log2) {
    if constexpr (kLazy) {
        T m_new[Kt::kMTiles][2];
        bool grows = false;
#pragma unroll
        for (int mt = 0; mt < Kt::kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                m_new[mt][h] = max_(m[mt][h], row_max_log2<Kt>(S, mt, h, scale_log2));
                grows |= m_new[mt][h] > m[mt][h] + kLazyRescaleLog2;  // (-inf + 8 = -inf: a first finite max grows)
            }
        if (__any_sync(0xffffffffu, grows)) {
#pragma unroll
            for (int mt = 0; mt < Kt::kMTiles; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const T m_safe = m_new[mt][h] == neg_inf<T>() ? T(0) : m_new[mt][h];
                    const T rescale = exp2_(m[mt][h] - m_safe);
                    m[mt][h] = m_new[mt][h];
                    l[mt][h] *= rescale;
                    rescale_row<Kt>(O, mt, h, rescale);
                }
        }
#pragma unroll
        for (int mt = 0; mt < Kt::kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const T m_safe = m[mt][h] == neg_inf<T>() ? T(0) : m[mt][h];
                l[mt][h] += exponentiate_row<Kt>(S, mt, h, scale_log2, m_safe);
            }
        return;
    }
    if constexpr (kFirst) {
        // A query tile's first key block (FlashAttention-3's first step): m_i and l_i start
        // here, and O_i, which the first P_ij V_j overwrites, has nothing to rescale. The same
        // values as the general step's from m_i = -inf, l_i = 0, O_i = 0.
#pragma unroll
        for (int mt = 0; mt < Kt::kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                m[mt][h] = row_max_log2<Kt>(S, mt, h, scale_log2);
                const T m_safe = m[mt][h] == neg_inf<T>() ? T(0) : m[mt][h];
                l[mt][h] = exponentiate_row<Kt>(S, mt, h, scale_log2, m_safe);
            }
        return;
    }
#pragma unroll
    for (int mt = 0; mt < Kt::kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const T m_new = max_(m[mt][h], row_max_log2<Kt>(S, mt, h, scale_log2));
            // A row with every key masked so far has m_new = -inf; subtracting 0 instead keeps
            // exp2(-inf - (-inf)) = NaN out, and its probabilities come out exactly 0.
            const T m_safe = m_new == neg_inf<T>() ? T(0) : m_new;
            const T rescale = exp2_(m[mt][h] - m_safe);
            m[mt][h] = m_new;
            const T row_sum = exponentiate_row<Kt>(S, mt, h, scale_log2, m_safe);
            l[mt][h] = l[mt][h] * rescale + row_sum;
            rescale_row<Kt>(O, mt, h, rescale);
        }
}

// -inf for keys >= seqlen_k and, with local attention (causal included), keys outside the band.
// Rows are queries from row0 and columns keys from col0, or with kTransposed (S^T in the dK/dV
// kernel) rows are keys and columns queries.
template <bool kIsLocal, bool kTransposed, typename T, int kMTiles, int kNTiles, typename Params>
__device__ __forceinline__ void mask_fragments(T (&S)[kMTiles][kNTiles][4], int row0, int col0,
                                               const Params& params, const Fragment& f) {
    // Each edge in a pass of its own: the two-sided test in one pass costs the 16-bit kernels at
    // 255 registers (forward d64-128, dK/dV) spills.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int row = row0 + f.row(mt, h), col = col0 + f.col(nt, e);
                    const int query = kTransposed ? col : row, key = kTransposed ? row : col;
                    if (key >= params.seqlen_k || (kIsLocal && key > query + params.band_last))
                        S[mt][nt][2 * h + e] = neg_inf<T>();
                }
    // The forward skips the left pass when the band has no left edge (causal); in the dK/dV kernel
    // (kTransposed) the test itself costs the d256 H100 tile spills.
    if (!kIsLocal || (!kTransposed && params.band_first <= -params.seqlen_q)) return;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int row = row0 + f.row(mt, h), col = col0 + f.col(nt, e);
                    const int query = kTransposed ? col : row, key = kTransposed ? row : col;
                    if (key < query + params.band_first) S[mt][nt][2 * h + e] = neg_inf<T>();
                }
}

// S = mod(scale_log2 · S) for a tile of queries from row0 and keys from col0 (the forward's S_ij):
// the softcapped, ALiBi-biased scores in log2 units (ScoreMod). float64 takes the accurate tanh
// (tanh_fast is a float32 approximation).
template <bool kSoftcap, typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void score_mod_fragments(T (&S)[kMTiles][kNTiles][4], const ScoreMod<T>& mod,
                                                    T scale_log2, int row0, int col0, const Fragment& f) {
    constexpr Tanh kTanh = sizeof(T) == 8 ? Tanh::kAccurate : Tanh::kFast;
    const T offset0 = mod.offset(row0 + f.row(0, 0), col0 + f.col(0, 0));
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    T dx;
                    const T distance = abs_(offset0 + static_cast<T>(16 * mt + 8 * h - 8 * nt - e));
                    S[mt][nt][2 * h + e] = mod.template apply_at<kTanh, kSoftcap>(S[mt][nt][2 * h + e] * scale_log2, distance, dx);
                }
}

// Calls on_drop(mt, nt, i) for each element C[mt][nt][i] of a warp's accumulator tile that dropout
// drops: rows are queries from row0 and columns keys from col0, or with kTransposed (S^T in the
// dK/dV kernel) rows are keys and columns queries; row0 and col0 are multiples of 16. A lane's
// elements (rows g, g + 8 of an m16 tile) x (columns 2t + e, 2t + e + 8 of n8 tiles 2np, 2np + 1)
// are one generator call's 2 x 2 group (Dropout) either way round: a call per four elements.
template <bool kTransposed, int kMTiles, int kNTiles, typename OnDrop>
__device__ __forceinline__ void for_dropped(const Dropout& dropout, int row0, int col0, const Fragment& f,
                                            OnDrop on_drop) {
    static_assert(kNTiles % 2 == 0, "a group spans two n8 tiles");
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int row = row0 + f.row(mt, 0), col = col0 + f.col(2 * np, e);
                const PhiloxWords w = kTransposed ? dropout.words(col, row) : dropout.words(row, col);
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        // Word 2·(query + 8) + (key + 8): the row half is h, the column half `half`.
                        const unsigned word = w.x[kTransposed ? 2 * half + h : 2 * h + half];
                        if (!dropout.keeps(word)) on_drop(mt, 2 * np + half, 2 * h + e);
                    }
            }
}

// Writes scale · C to a [rows][cols] global tile (row_stride apart, columns contiguous) in the
// element type; rows >= rows_valid and columns >= cols_valid are padding and are skipped. Pairs of
// columns go out as one 32-bit store where alignment allows.
template <typename Element, typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void store_fragments(typename NumericTraits<Element>::Storage* g_tile, long long row_stride,
                                                int rows_valid, int cols_valid, const T (&C)[kMTiles][kNTiles][4],
                                                typename NonDeduced<T>::type scale, const Fragment& f) {
    using Numeric = NumericTraits<Element>;
    constexpr unsigned kSize = sizeof(typename Numeric::Storage);
    const bool paired = ((reinterpret_cast<unsigned long long>(g_tile) |
                          static_cast<unsigned long long>(row_stride * kSize)) & (2 * kSize - 1)) == 0;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = f.row(mt, h);
            if (row >= rows_valid) continue;
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
                const int col = f.col(nt, 0);
                const T x0 = C[mt][nt][2 * h] * scale, x1 = C[mt][nt][2 * h + 1] * scale;
                auto* p = g_tile + row * row_stride + col;
                if (paired && col + 1 < cols_valid) {
                    if constexpr (kSize == 8)
                        *reinterpret_cast<double2*>(p) = make_double2(x0, x1);
                    else if constexpr (kSize == 4)
                        *reinterpret_cast<float2*>(p) = make_float2(x0, x1);
                    else
                        *reinterpret_cast<unsigned*>(p) = Mma<Element>::pack(x0, x1);
                } else {
                    if (col < cols_valid) p[0] = Numeric::from_accum(x0);
                    if (col + 1 < cols_valid) p[1] = Numeric::from_accum(x1);
                }
            }
        }
}

// A warp's 16 rows of C (one m16 tile of fragments) times scale, in the element type, written to
// rows tile_row0.. of a swizzled [kRows][kHeadDim] shared tile of traits Tt (SwizzledTileLayout).
template <typename Tt, int kRows>
__device__ __forceinline__ void stage_rows(unsigned s_tile, const float (&C)[1][Tt::kHeadDim / 8][4], int tile_row0,
                                           const Fragment& f, float scale = 1.f) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < Tt::kHeadDim / 8; ++nt)  // fragment nt: columns 8·nt.. of rows g, g + 8
            store_shared_4(s_tile + Tt::template tile_offset<kRows>(tile_row0 + f.g + 8 * h, 8 * nt) + 4 * f.t,
                           Mma<typename Tt::Element>::pack(C[0][nt][2 * h] * scale, C[0][nt][2 * h + 1] * scale));
}

// A warp's 16 rows of C (one m16 tile of fragments) written in the element type through a
// swizzled [kRows][kHeadDim] shared tile of traits Tt (SwizzledTileLayout), rows tile_row0.. of
// it: the fragments go into the tile, then out as 16-byte row chunks, so that each store
// instruction writes whole 128-byte lines (the fragments themselves write 4 bytes to each of 8
// rows per instruction: on an H100 the d128 forward's epilogue took 2.4 us of a block and held the
// SM's next block back 0.5 us more). The tile's swizzle puts the
// fragment writes (8 rows, one chunk) and the chunk reads on 32 distinct banks. Only this warp's
// rows are touched, so a __syncwarp orders the two. Where the rows are not 16-byte aligned or not
// all kHeadDim columns are valid, store_fragments. C is written times scale.
template <typename Tt, int kRows>
__device__ __forceinline__ void store_rows_staged(typename Tt::Storage* g_tile, long long row_stride, int rows_valid,
                                                  int cols_valid, const float (&C)[1][Tt::kHeadDim / 8][4],
                                                  unsigned s_tile, int tile_row0, const Fragment& f, int lane,
                                                  float scale = 1.f) {
    constexpr int kChunks = Tt::kHeadDim / 8;  // 16-byte chunks of a row
    const bool chunked = cols_valid >= Tt::kHeadDim &&
        ((reinterpret_cast<unsigned long long>(g_tile) | static_cast<unsigned long long>(row_stride * 2)) & 15) == 0;
    if (!chunked) {
        store_fragments<typename Tt::Element>(g_tile, row_stride, rows_valid, cols_valid, C, scale, f);
        return;
    }
    stage_rows<Tt, kRows>(s_tile, C, tile_row0, f, scale);
    __syncwarp();
#pragma unroll
    for (int i = lane; i < 16 * kChunks; i += 32) {
        const int row = i / kChunks, chunk = i % kChunks;
        if (row < rows_valid)
            *reinterpret_cast<uint4*>(g_tile + row * row_stride + chunk * 8) =
                load_shared_16(s_tile + Tt::template tile_offset<kRows>(tile_row0 + row, 8 * chunk));
    }
}

// 1 / l for a row sum l >= 1 (its largest term is exp2(0)), the same bits as 1.f / l: the
// reciprocal's approximation and one Newton step, which is what the compiled division does for
// such l; written out, it leaves out the division's branch to its slow path for extreme l, behind
// which the compiler would not overlap one row's chain with the next's.
__device__ __forceinline__ float reciprocal_of_row_sum(float l) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(l));
    return fmaf(r, fmaf(-l, r, 1.f), r);
}
__device__ __forceinline__ double reciprocal_of_row_sum(double l) { return 1.0 / l; }

// The epilogue's first part: O_i / l_i (times out_scale with kRescale) in place, and lse_i written.
// Every row's sum, reciprocal and log come first (the log in every lane, with no branch), so that
// their dependent chains overlap rather than run row after row: written row by row, with a branch
// around each, they took most of the warp-specialised forward's epilogue.
template <typename Kt, bool kRescale = false, typename T = typename Kt::Accum>
__device__ __forceinline__ void normalize_rows(const FwdParams& params, T (&O)[Kt::kMTiles][Kt::kHeadDim / 8][4],
                                               const T (&m)[Kt::kMTiles][2], const T (&l)[Kt::kMTiles][2],
                                               int batch_idx, int head_idx, int warp_row0, const Fragment& f,
                                               typename NonDeduced<T>::type out_scale = 1) {
    T* lse = static_cast<T*>(params.lse) + batch_idx * params.lse_batch_stride + head_idx * params.lse_head_stride;
    T inv_l[Kt::kMTiles][2], lse_row[Kt::kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < Kt::kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const T l_row = quad_sum(l[mt][h]);
            inv_l[mt][h] = saw_keys(l_row) ? (kRescale ? out_scale / l_row : reciprocal_of_row_sum(l_row)) : T(0);
            // In float (one rounding more than the scalar kernel's double form: an ulp of lse, far
            // below the 16-bit rounding of the P_ij that the backward rebuilds from it). A row with
            // no key (l = 0) gets -inf from log(0) whatever its m: no select, which the compiler
            // turned into a branch around the log.
            lse_row[mt][h] = fma_(m[mt][h], static_cast<T>(kLn2), log_(l_row));
        }
#pragma unroll
    for (int mt = 0; mt < Kt::kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int dt = 0; dt < Kt::kHeadDim / 8; ++dt) {
                O[mt][dt][2 * h] *= inv_l[mt][h];
                O[mt][dt][2 * h + 1] *= inv_l[mt][h];
            }
            const int row = warp_row0 + f.row(mt, h);
            if (f.t == 0 && row < params.seqlen_q) lse[row] = lse_row[mt][h];
        }
}

// The forward's epilogue (Algorithm 1, lines 12-13): O_i / l_i written in the element type,
// lse_i = m_i·ln2 + ln(l_i).
// kRescale: O_i times out_scale too (dropout's 1 / (1 - p)), as the scalar epilogue.
// Hopper (Kt::kWgmma): O_i goes out through the Q_i tile sQ (store_rows_staged), which no warp
// reads any more once every warp has passed the last step's barrier.
template <typename Kt, bool kRescale = false, typename T = typename Kt::Accum>
__device__ __forceinline__ void epilogue_tc(const FwdParams& params, T (&O)[Kt::kMTiles][Kt::kHeadDim / 8][4],
                                         const T (&m)[Kt::kMTiles][2], const T (&l)[Kt::kMTiles][2],
                                         int batch_idx, int head_idx, int warp_row0, const Fragment& f,
                                         typename NonDeduced<T>::type out_scale = 1, unsigned sQ = 0) {
    normalize_rows<Kt, kRescale>(params, O, m, l, batch_idx, head_idx, warp_row0, f, out_scale);
    typename Kt::Storage* o = static_cast<typename Kt::Storage*>(params.o) + batch_idx * params.o_batch_stride +
                              head_idx * params.o_head_stride + warp_row0 * params.o_row_stride;
    if constexpr (Kt::kWgmma) {
        store_rows_staged<Kt, Kt::kBlockM>(o, params.o_row_stride, params.seqlen_q - warp_row0, params.head_dim, O, sQ,
                                           warp_row0 % Kt::kBlockM, f, threadIdx.x % 32);
    } else {
        store_fragments<typename Kt::Element>(o, params.o_row_stride, params.seqlen_q - warp_row0, params.head_dim, O,
                                              1.f, f);
    }
}

// Two adjacent floats added atomically: one vector reduction on sm_90 (8-byte aligned address),
// two scalar ones before it.
__device__ __forceinline__ void atomic_add_pair(float* p, float x0, float x1) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x0), "f"(x1) : "memory");
#else
    atomicAdd(p, x0);
    atomicAdd(p + 1, x1);
#endif
}
__device__ __forceinline__ void atomic_add_pair(double* p, double x0, double x1) {
    atomicAdd(p, x0);
    atomicAdd(p + 1, x1);
}

// g_tile[row][col] += scale · C with float atomics (red.global.add), for the valid rows and columns.
// A warp tile that is wholly valid, with rows 8-byte aligned (nearly every tile), takes a path with
// no per-element checks, whose addresses are a row pointer plus an immediate column offset.
template <typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void atomic_add_fragments(T* g_tile, long long row_stride, int rows_valid,
                                                     int cols_valid, const T (&C)[kMTiles][kNTiles][4],
                                                     typename NonDeduced<T>::type scale, const Fragment& f) {
    const bool aligned = ((reinterpret_cast<unsigned long long>(g_tile) | static_cast<unsigned long long>(row_stride * 4)) & 7) == 0;
    if (aligned && rows_valid >= kMTiles * 16 && cols_valid >= kNTiles * 8) {
        T* base = g_tile + f.g * row_stride + 2 * f.t;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                T* row = base + (mt * 16 + 8 * h) * row_stride;
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt)
                    atomic_add_pair(row + nt * 8, C[mt][nt][2 * h] * scale, C[mt][nt][2 * h + 1] * scale);
            }
        return;
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = f.row(mt, h);
            if (row >= rows_valid) continue;
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (f.col(nt, e) < cols_valid) atomicAdd(g_tile + row * row_stride + f.col(nt, e), C[mt][nt][2 * h + e] * scale);
        }
}

}  // namespace cupyflash
