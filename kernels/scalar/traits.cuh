// Tile shapes of the scalar (CUDA-core) kernels. The catalogue (cupyflash/catalog/tiles.py) chooses
// the template arguments; everything else is derived here and checked with static_assert.
#pragma once
#include "common/numeric.cuh"

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

// The dK/dV kernel: one thread block per key block K_j, V_j (B_c = kBlockN rows), walking the
// query blocks Q_i, dO_i (B_r = kBlockM rows) of FlashAttention-2's Algorithm 2.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_,
          int kRowsPerThread_, int kDQRowsPerThread_, int kMinBlocksPerSm_>
struct BwdDkdvTraits {
    using Element = Element_;
    using Numeric = NumericTraits<Element>;
    using Storage = typename Numeric::Storage;
    using Accum = typename Numeric::Accum;

    static constexpr int kHeadDim = kHeadDim_;  // padded head dim
    static constexpr int kBlockM = kBlockM_;    // B_r: query rows per iteration
    static constexpr int kBlockN = kBlockN_;    // B_c: key rows per thread block
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;

    // S_ij^T, P_ij^T, dP_ij^T, dS_ij^T (keys x queries) and dK_j, dV_j (keys x head dim) use the
    // forward's thread grid with keys as rows: each thread owns kRowsPerThread keys, so dK_j and
    // dV_j accumulate in its registers exactly as O_i does in the forward pass, and
    // dV_j += P_ij^T dO_i is the forward's O_i += P_ij V_j with (P^T, dO) for (P, V).
    using KeyGrid = FwdTraits<Element, kHeadDim, kBlockN, kBlockM, kNWarps, kRowsPerThread_, kMinBlocksPerSm>;
    // dQ_i += dS_ij K_j (queries x head dim) uses the forward's grid as it is.
    using QueryGrid = FwdTraits<Element, kHeadDim, kBlockM, kBlockN, kNWarps, kDQRowsPerThread_, kMinBlocksPerSm>;

    static constexpr int kQKVStride = KeyGrid::kQKVStride;  // rows of sK, sV, sQ, sdO
    static constexpr int kPtStride = KeyGrid::kPStride;     // rows of sPt, sdSt: B_r + pad
    static constexpr int kDSStride = QueryGrid::kPStride;   // rows of sdS: B_c + pad

    // Shared memory, in Accum elements.
    static constexpr int kSmemKOffset = 0;                                        // K_j   [B_c][kQKVStride]
    static constexpr int kSmemVOffset = kSmemKOffset + kBlockN * kQKVStride;      // V_j   [B_c][kQKVStride]
    static constexpr int kSmemQOffset = kSmemVOffset + kBlockN * kQKVStride;      // Q_i   [B_r][kQKVStride]
    static constexpr int kSmemdOOffset = kSmemQOffset + kBlockM * kQKVStride;     // dO_i  [B_r][kQKVStride]
    static constexpr int kSmemPtOffset = kSmemdOOffset + kBlockM * kQKVStride;    // P^T   [B_c][kPtStride]
    static constexpr int kSmemdStOffset = kSmemPtOffset + kBlockN * kPtStride;    // dS^T  [B_c][kPtStride]
    static constexpr int kSmemdSOffset = kSmemdStOffset + kBlockN * kPtStride;    // dS    [B_r][kDSStride]
    static constexpr int kSmemLseOffset = kSmemdSOffset + kBlockM * kDSStride;    // lse_i·log2(e) [B_r]
    static constexpr int kSmemDOffset = kSmemLseOffset + kBlockM;                 // D_i   [B_r]
    static constexpr int kSmemElements = kSmemDOffset + kBlockM;
    static constexpr int kSmemBytes = kSmemElements * static_cast<int>(sizeof(Accum));

    static_assert(KeyGrid::kNThreads == kNThreads && QueryGrid::kNThreads == kNThreads, "one block, one thread count");
    static_assert(kNThreads >= kBlockM, "one thread per query row loads lse_i and D_i");
};

// The dQ kernel of deterministic mode: the forward's shape (one thread block per query block,
// walking the key blocks), recomputing P_ij and dP_ij to build dQ_i without atomics.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_,
          int kRowsPerThread_, int kMinBlocksPerSm_>
struct BwdDqTraits : FwdTraits<Element_, kHeadDim_, kBlockM_, kBlockN_, kNWarps_, kRowsPerThread_, kMinBlocksPerSm_> {
    using Base = FwdTraits<Element_, kHeadDim_, kBlockM_, kBlockN_, kNWarps_, kRowsPerThread_, kMinBlocksPerSm_>;
    using Accum = typename Base::Accum;
    static constexpr int kSmemQOffset = 0;                                                // Q_i  [B_r][kQKVStride]
    static constexpr int kSmemdOOffset = kSmemQOffset + Base::kBlockM * Base::kQKVStride;  // dO_i [B_r][kQKVStride]
    static constexpr int kSmemKOffset = kSmemdOOffset + Base::kBlockM * Base::kQKVStride;  // K_j  [B_c][kQKVStride]
    static constexpr int kSmemVOffset = kSmemKOffset + Base::kBlockN * Base::kQKVStride;   // V_j  [B_c][kQKVStride]
    static constexpr int kSmemdSOffset = kSmemVOffset + Base::kBlockN * Base::kQKVStride;  // dS   [B_r][kPStride]
    static constexpr int kSmemElements = kSmemdSOffset + Base::kBlockM * Base::kPStride;
    static constexpr int kSmemBytes = kSmemElements * static_cast<int>(sizeof(Accum));
};

}  // namespace cupyflash
