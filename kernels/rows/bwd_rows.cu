// The backward's row passes, shared by every backward kernel family:
//   flash_bwd_preprocess_kernel: D_i = rowsum(dO_i ∘ O_i), lse_i in log2 units, and the float dQ
//     workspace cleared (unless deterministic, or the warp-specialised kernel's dQ ring serves);
//   flash_bwd_convert_dq_kernel: the workspace rounded to the input dtype.
#include "common/band.cuh"

namespace cupyflash {

// The row kernels (preprocess, convert_dq): kRowThreads threads per block, kRowsPerBlock query rows.
// They are memory-bound, reading a row or two of head_dim elements per row. One warp per row with
// one element per lane ran at 0.9-1.4 TB/s on an H100: short rows left most of a warp's lanes
// idle, and four rows per block made the launch one block per kilobyte read. So a row is read by
// a group of lanes, each taking 16 bytes at a time (kVec elements of T), as many lanes as the row
// has vectors (a power of two, from 32 / kRowsPerWarp to 32): a warp takes 32 / lanes rows per
// pass, and its kRowsPerWarp rows in as many passes as that needs.
constexpr int kRowThreads = 128;

template <typename T, int kRowsPerBlock>
struct RowGroups {
    static constexpr int kVec = 16 / sizeof(T);
    static constexpr int kRowsPerWarp = kRowsPerBlock / (kRowThreads / 32);
    static constexpr int kMinLanes = 32 / kRowsPerWarp;  // a pass covers at most the warp's rows
    static_assert(kRowsPerWarp > 0 && kRowsPerWarp <= 32 && 32 % kRowsPerWarp == 0, "passes tile a warp's rows");
    int lanes, passes, first_row, lane_in_row;

    __device__ __forceinline__ RowGroups(int head_dim, int row_block) {
        const int vecs = (head_dim + kVec - 1) / kVec;
        lanes = vecs <= kMinLanes ? kMinLanes : min(32, 1 << (32 - __clz(vecs - 1)));
        const int lane = threadIdx.x % 32;
        passes = kRowsPerWarp / (32 / lanes);
        first_row = row_block * kRowsPerBlock + threadIdx.x / 32 * kRowsPerWarp + lane / lanes;
        lane_in_row = lane % lanes;
    }
    __device__ __forceinline__ int row(int pass) const { return first_row + pass * (32 / lanes); }
    // The sum over the row's lanes, in every one of them (all 32 lanes call it).
    template <typename A> __device__ __forceinline__ A sum(A x) const {
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2)
            if (offset < lanes) x += shfl_xor(x, offset);
        return x;
    }
};

// kVec elements of T from 16-byte aligned memory.
template <typename T>
struct Vec16 {
    static constexpr int kSize = 16 / sizeof(T);
    T x[kSize];
    __device__ __forceinline__ static Vec16 load(const T* p) {
        Vec16 v;
        *reinterpret_cast<uint4*>(v.x) = *reinterpret_cast<const uint4*>(p);
        return v;
    }
};

__device__ __forceinline__ bool aligned_to(const void* p, int bytes) {
    return reinterpret_cast<unsigned long long>(p) % bytes == 0;
}

// Zeros to head_dim elements of a float row, the lanes of its group taking 16 bytes at a time
// from lane_in_row on (as the rows are read) where the row is 16-byte aligned.
template <typename A>
__device__ __forceinline__ void clear_row(A* row, int head_dim, int lane_in_row, int lanes) {
    constexpr int kVec = 16 / sizeof(A);
    int tail = 0;
    if (aligned_to(row, 16)) {
        tail = head_dim / kVec * kVec;
        for (int c = lane_in_row * kVec; c < tail; c += lanes * kVec) *reinterpret_cast<uint4*>(row + c) = uint4{};
    }
    for (int c = tail + lane_in_row; c < head_dim; c += lanes) row[c] = A(0);
}

// The row kernels' (head, block of kRowsPerBlock rows): grid (ceil(seqlen_q / kRowsPerBlock), heads,
// batch), or with kHeadsFastest (heads, ceil(seqlen_q / kRowsPerBlock), batch), the heads of a block
// of rows started together (the host takes it where the rows' blocks fit in gridDim.y).
template <bool kHeadsFastest>
__device__ __forceinline__ int2 row_block_of() {
    if constexpr (kHeadsFastest) return make_int2(blockIdx.x, blockIdx.y);
    return make_int2(blockIdx.y, blockIdx.x);
}

// RowGroups' lanes per query row (grid: row_block_of). Serves fixed- and variable-length batches
// alike (sequence_params with a runtime test).
template <typename Element, int kRowsPerBlock, bool kHeadsFastest>
__global__ void __launch_bounds__(kRowThreads) flash_bwd_preprocess_kernel(const BwdParams launch_params) {
    using Numeric = NumericTraits<Element>;
    using Accum = typename Numeric::Accum;
    using Storage = typename Numeric::Storage;
    using Groups = RowGroups<Storage, kRowsPerBlock>;
    const int2 block = row_block_of<kHeadsFastest>();
    const int head_idx = block.x;
    int q_batch, k_batch;
    const BwdParams params = sequence_params<true>(launch_params, blockIdx.z, q_batch, k_batch);
    const Groups groups(params.head_dim, block.y);
    const int j0 = groups.lane_in_row, step = groups.lanes;

    for (int pass = 0; pass < groups.passes; ++pass) {
        const int row = groups.row(pass);
        // The dQ workspace starts at zero: cleared here, where its rows are at hand, rather than by
        // a memset launch of its own (134 MB at 16384 tokens and hidden 2048: 50 us). The stores
        // go out ahead of the row's loads, which are what the kernel waits for.
        if (params.dq_accum != nullptr && row < params.seqlen_q)
            clear_row(static_cast<Accum*>(params.dq_accum) + dq_accum_offset(params, q_batch, row, head_idx),
                      params.head_dim, j0, step);
        // Summed in double (memory-bound, so it costs nothing measurable): every dS_ij of the row
        // subtracts D_i, so its error would reach dQ_i coherently.
        double dot = 0.0;
        if (row < params.seqlen_q) {
            const Storage* o = static_cast<const Storage*>(params.o) + q_batch * params.o_batch_stride +
                               row * params.o_row_stride + head_idx * params.o_head_stride;
            const Storage* dout = static_cast<const Storage*>(params.dout) + q_batch * params.dout_batch_stride +
                                  row * params.dout_row_stride + head_idx * params.dout_head_stride;
            int tail = 0;  // the elements from here on are read one at a time
            if (aligned_to(o, 16) && aligned_to(dout, 16)) {
                tail = params.head_dim / Groups::kVec * Groups::kVec;
                for (int c = j0 * Groups::kVec; c < tail; c += step * Groups::kVec) {
                    const auto ov = Vec16<Storage>::load(o + c), dv = Vec16<Storage>::load(dout + c);
#pragma unroll
                    for (int e = 0; e < Groups::kVec; ++e)
                        dot = fma(static_cast<double>(Numeric::to_accum(dv.x[e])),
                                  static_cast<double>(Numeric::to_accum(ov.x[e])), dot);
                }
            }
            for (int c = tail + j0; c < params.head_dim; c += step)
                dot = fma(static_cast<double>(Numeric::to_accum(dout[c])), static_cast<double>(Numeric::to_accum(o[c])), dot);
        }
        dot = groups.sum(dot);

        if (row < params.seqlen_q && j0 == 0) {
            const long long idx = row_vector_offset(params, q_batch, head_idx) + row;
            // D_i' = (1 - p) D_i (scalar/bwd_steps.cuh); dropout_rescale is exactly 1 without dropout.
            static_cast<Accum*>(params.d)[idx] = static_cast<Accum>(dot / params.dropout_rescale);
            const Accum lse = static_cast<const Accum*>(params.lse)[q_batch * params.lse_batch_stride +
                                                                     head_idx * params.lse_head_stride +
                                                                     row * params.lse_row_stride];
            // A row that saw no key has lse = -inf and P_ij = 0; +inf makes exp2(s - lse) exactly 0
            // where -inf would give exp2(-inf + inf) = NaN on masked scores.
            static_cast<Accum*>(params.lse_log2)[idx] =
                lse == neg_inf<Accum>() ? pos_inf<Accum>() : static_cast<Accum>(static_cast<double>(lse) * kLog2e);
        }
    }
}

// Grid: row_block_of; RowGroups' lanes per query row.
// dq = the atomically summed workspace, rounded once to the input dtype.
// Fixed- and variable-length batches alike, as the preprocess kernel.
template <typename Element, int kRowsPerBlock, bool kHeadsFastest>
__global__ void __launch_bounds__(kRowThreads) flash_bwd_convert_dq_kernel(const BwdParams launch_params) {
    using Numeric = NumericTraits<Element>;
    using Accum = typename Numeric::Accum;
    using Storage = typename Numeric::Storage;
    using Groups = RowGroups<Accum, kRowsPerBlock>;
    constexpr int kVec = Groups::kVec;
    const int2 block = row_block_of<kHeadsFastest>();
    const int head_idx = block.x;
    int q_batch, k_batch;
    const BwdParams params = sequence_params<true>(launch_params, blockIdx.z, q_batch, k_batch);
    const Groups groups(params.head_dim, block.y);
    const int j0 = groups.lane_in_row, step = groups.lanes;

    for (int pass = 0; pass < groups.passes; ++pass) {
        const int row = groups.row(pass);
        if (row >= params.seqlen_q) continue;
        const Accum* __restrict__ dq_accum =
            static_cast<const Accum*>(params.dq_accum) + dq_accum_offset(params, q_batch, row, head_idx);
        Storage* __restrict__ dq = static_cast<Storage*>(params.dq) + q_batch * params.dq_batch_stride +
                                   row * params.dq_row_stride + head_idx * params.dq_head_stride;
        int tail = 0;
        if (aligned_to(dq_accum, 16) && aligned_to(dq, kVec * sizeof(Storage))) {
            tail = params.head_dim / kVec * kVec;
            for (int c = j0 * kVec; c < tail; c += step * kVec) {
                const auto a = Vec16<Accum>::load(dq_accum + c);
                struct alignas(kVec * sizeof(Storage)) { Storage x[kVec]; } out;
#pragma unroll
                for (int e = 0; e < kVec; ++e) out.x[e] = Numeric::from_accum(a.x[e]);
                *reinterpret_cast<decltype(out)*>(dq + c) = out;
            }
        }
        for (int c = tail + j0; c < params.head_dim; c += step) dq[c] = Numeric::from_accum(dq_accum[c]);
    }
}

}  // namespace cupyflash
