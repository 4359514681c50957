// Shared-memory tile layouts of the tensor-core kernels (float16 / bfloat16). The forward and the
// dQ kernel split a block's rows (queries) evenly over its warps, 16·kMTiles rows per warp, and each
// warp owns every column of its rows' score tile: the softmax's row reductions stay inside the 4
// lanes that share a fragment row, and score tiles turn into A operands in registers.
#pragma once
#include "arch/sm80.cuh"

namespace cupyflash {

__host__ __device__ constexpr int largest_divisor_at_most(int n, int cap) {
    for (int c = cap; c > 1; --c)
        if (n % c == 0) return c;
    return 1;
}

// What every tensor-core kernel's tiles share: the element type and the padded shared-memory rows
// of [rows][head dim] tiles. 16-bit elements take mma.sync.m16n8k16 (Mma); float32 elements, as
// Tf32 tags, TF32 products on m16n8k8, whose fragments come from the same ldmatrix lane addresses
// over 32-byte k-steps; float64 elements DMMA k16 steps, read with 16-byte shared loads
// (arch/sm80.cuh).
template <typename Element_, int kHeadDim_, int kNWarps_>
struct TcTileLayout {
    using Element = Element_;
    using Numeric = NumericTraits<Element>;
    using Storage = typename Numeric::Storage;
    using Accum = typename Numeric::Accum;  // float, or double for float64
    using Op = Mma<Element>;
    static constexpr bool kTf32 = sizeof(Storage) == 4;  // Element is a Tf32 tag
    static constexpr bool kF64 = sizeof(Storage) == 8;

    static constexpr int kHeadDim = kHeadDim_;  // padded head dim d; columns >= head_dim are zero
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    // Elements of a k-step: k16 (16-bit), k8 (tf32), k16 (float64)
    static constexpr int kKStep = kF64 ? 16 : 32 / sizeof(Storage);
    static constexpr int kKSteps = kHeadDim / kKStep;  // k-steps of a product over the head dim

    // Shared-memory rows are padded by 16 bytes: a row is then an odd number of 16-byte chunks,
    // so the 8 rows an ldmatrix phase reads fall in 8 different bank groups (no conflicts), and
    // every row start stays 16-byte aligned for cp.async.
    static constexpr int kPad = 16 / sizeof(Storage);
    static constexpr int kStride = kHeadDim + kPad;  // row stride of a [rows][head dim] tile, elements
    static constexpr int kStride16 = kStride * sizeof(Storage) / 2;  // the same in b16 units (ldmatrix's)

    // Byte offset of (row, col) in a [kRows][kHeadDim] tile, col a multiple of 16 bytes; rows a
    // multiple of kRowPeriod apart are row_bytes(rows) apart in every column.
    static constexpr int kRowPeriod = 1;
    template <int kRows>
    static __device__ __forceinline__ unsigned tile_offset(int row, int col) {
        return (row * kStride + col) * sizeof(Storage);
    }
    static __host__ __device__ constexpr unsigned row_bytes(int rows) { return rows * kStride * sizeof(Storage); }
    // Where the tiles start in the block's shared memory (byte address): at its start.
    static __device__ __forceinline__ unsigned tile_base(unsigned smem) { return smem; }

    static_assert(sizeof(Storage) != 1, "tensor-core kernels take 16-bit, float32 or float64 elements");
    static_assert(kHeadDim % 16 == 0, "the head dim is padded to a multiple of the k16 step");
};

// kRows rows split evenly over the warps, whole m16 tiles each.
template <typename Element_, int kHeadDim_, int kRows_, int kNWarps_>
struct TcWarpLayout : TcTileLayout<Element_, kHeadDim_, kNWarps_> {
    static constexpr int kWarpRows = kRows_ / kNWarps_;  // rows of the block's row tile per warp
    static constexpr int kMTiles = kWarpRows / 16;       // m16 tiles per warp

    static_assert(kRows_ % (16 * kNWarps_) == 0, "each warp needs whole m16 tiles of rows");
};

}  // namespace cupyflash
