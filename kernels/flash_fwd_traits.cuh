// Tile shapes of the scalar forward kernel. Python (cupyflash/_instantiations.py) chooses the
// template arguments; everything else is derived here and checked with static_assert.
#pragma once
#include "numeric.cuh"

namespace cupyflash {

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_,
          int kRowsPerThread_, int kMinBlocksPerSm_>
struct FwdTraits {
    using Element = Element_;
    using Numeric = NumericTraits<Element>;
    using Storage = typename Numeric::Storage;
    using Accum = typename Numeric::Accum;

    static constexpr int kHeadDim = kHeadDim_;  // padded head dim d; columns >= head_dim are zero
    static constexpr int kBlockM = kBlockM_;    // B_r: query rows per thread block
    static constexpr int kBlockN = kBlockN_;    // B_c: key rows per iteration
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    // Blocks meant to share an SM: caps registers at 64K / (kNThreads * kMinBlocksPerSm).
    static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;

    // Threads form a kRowGroups x kColGroups grid over the S_ij tile; each thread owns
    // kRowsPerThread consecutive rows (and the same rows of O_i, so m_i and l_i stay in its
    // registers) and every kColGroups-th column of S_ij.
    static constexpr int kRowsPerThread = kRowsPerThread_;
    static constexpr int kRowGroups = kBlockM / kRowsPerThread;
    static constexpr int kColGroups = kNThreads / kRowGroups;
    static constexpr int kSColsPerThread = kBlockN / kColGroups;
    static constexpr int kOColsPerThread = kHeadDim / kColGroups;

    // Shared-memory loads are up to 16 bytes wide; rows are padded by 16 bytes so that threads
    // reading different rows at the same column hit different banks.
    static constexpr int kVecK = 16 / static_cast<int>(sizeof(Accum));  // along head dim / keys
    static constexpr int kVecO = gcd_(kVecK, kOColsPerThread);          // along O's columns
    static constexpr int kOChunks = kOColsPerThread / kVecO;
    static constexpr int kPad = kVecK;
    static constexpr int kQKVStride = kHeadDim + kPad;  // row stride of sQ, sK, sV (elements)
    static constexpr int kPStride = kBlockN + kPad;     // row stride of sP

    // Shared memory, in Accum elements: Q_i, K_j, V_j, P_ij (inputs are widened once on load).
    static constexpr int kSmemQOffset = 0;
    static constexpr int kSmemKOffset = kSmemQOffset + kBlockM * kQKVStride;
    static constexpr int kSmemVOffset = kSmemKOffset + kBlockN * kQKVStride;
    static constexpr int kSmemPOffset = kSmemVOffset + kBlockN * kQKVStride;
    static constexpr int kSmemElements = kSmemPOffset + kBlockM * kPStride;
    static constexpr int kSmemBytes = kSmemElements * static_cast<int>(sizeof(Accum));

    static_assert(kBlockM % kRowsPerThread == 0, "kBlockM must be a multiple of kRowsPerThread");
    static_assert(kNThreads % kRowGroups == 0, "threads must tile the rows evenly");
    static_assert(kColGroups >= 1 && kColGroups <= 32 && (kColGroups & (kColGroups - 1)) == 0,
                  "a row's threads must be a power of two within one warp (shuffle reductions)");
    static_assert(kBlockN % kColGroups == 0, "kBlockN must be a multiple of kColGroups");
    static_assert(kHeadDim % kColGroups == 0, "kHeadDim must be a multiple of kColGroups");
    static_assert(kHeadDim % kVecK == 0, "kHeadDim must be a multiple of the 16-byte vector");
    static_assert(kBlockN % kVecK == 0, "kBlockN must be a multiple of the 16-byte vector");
};

}  // namespace cupyflash
