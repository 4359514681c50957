// The matrix products of the mma.sync kernels on ldmatrix'd fragments: A B^T with both operands in
// shared memory, A B with A from registers (a score tile turned A fragment), and A B / A^T B with
// both in shared memory.
#pragma once
#include "tc/fragments.cuh"

namespace cupyflash {

// One k16 step of a warp tile from fragments already in registers: every A fragment meets every
// B pair (two n8 tiles per ldmatrix.x4).
template <typename Op, int kMTiles, int kNTiles>
__device__ __forceinline__ void mma_k_step(float (&C)[kMTiles][kNTiles][4], const unsigned (&a)[kMTiles][4],
                                           const unsigned (&b)[kNTiles / 2][4]) {
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np)
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
            Op::run(C[mt][2 * np], a[mt], b[np][0], b[np][1]);
            Op::run(C[mt][2 * np + 1], a[mt], b[np][2], b[np][3]);
        }
}

// C += A B^T, both operands [rows][k] in shared memory (k contiguous): S = Q K^T and its kin.
// sA: byte address of the warp's first row of A; sB: of the first row of B; k runs over 16·kKSteps.
template <typename Op, int kMTiles, int kNTiles, int kKSteps, int kStrideA, int kStrideB>
__device__ __forceinline__ void gemm_abt_ss(float (&C)[kMTiles][kNTiles][4], unsigned sA, unsigned sB, int lane) {
    static_assert(kNTiles % 2 == 0, "B is read 16 rows (two n8 tiles) per ldmatrix.x4");
    const unsigned a0 = sA + ((lane % 16) * kStrideA + (lane / 16) * 8) * 2;
    const unsigned b0 = sB + (((lane / 16) * 8 + lane % 8) * kStrideB + (lane / 8) % 2 * 8) * 2;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
        // All of a k-step's fragments are requested before its first mma: one shared-memory
        // latency per k-step instead of one per fragment.
        unsigned a[kMTiles][4], b[kNTiles / 2][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt], a0 + (mt * 16 * kStrideA + ks * 16) * 2);
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) ldmatrix_x4(b[np], b0 + (np * 16 * kStrideB + ks * 16) * 2);
        mma_k_step<Op>(C, a, b);
    }
}

// B fragments of a k-step are requested in groups of up to 4 ldmatrix.x4 (16 registers) ahead of
// their mma, as many as the register budget allows.
__host__ __device__ constexpr int fragment_group(int pairs) { return pairs % 4 == 0 ? 4 : pairs % 3 == 0 ? 3 : pairs % 2 == 0 ? 2 : 1; }

// One k16 step of C += A B with B [k][n] in shared memory (n contiguous, read transposed by
// ldmatrix): b_k is this lane's ldmatrix address in the step's first k row, at the product's first
// column.
template <typename Op, int kMTiles, int kNTiles>
__device__ __forceinline__ void mma_k_step_trans_b(float (&C)[kMTiles][kNTiles][4], const unsigned (&a)[kMTiles][4],
                                                   unsigned b_k) {
    static_assert(kNTiles % 2 == 0, "B is read 16 columns (two n8 tiles) per ldmatrix.x4");
    constexpr int kGroup = fragment_group(kNTiles / 2);
#pragma unroll
    for (int np0 = 0; np0 < kNTiles / 2; np0 += kGroup) {
        unsigned b[kGroup][4];
#pragma unroll
        for (int i = 0; i < kGroup; ++i) ldmatrix_x4_trans(b[i], b_k + (np0 + i) * 16 * 2);
#pragma unroll
        for (int i = 0; i < kGroup; ++i)
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                Op::run(C[mt][2 * (np0 + i)], a[mt], b[i][0], b[i][1]);
                Op::run(C[mt][2 * (np0 + i) + 1], a[mt], b[i][2], b[i][3]);
            }
    }
}

// C += A B with A already in registers as fragments (P_ij or dS_ij, kKSteps k16 steps) and B
// [k][n] in shared memory (n contiguous): O += P V and its kin. sB: byte address of B's first row
// at the product's first column.
template <typename Op, int kMTiles, int kNTiles, int kKSteps, int kStrideB>
__device__ __forceinline__ void gemm_ab_rs(float (&C)[kMTiles][kNTiles][4], const unsigned (&A)[kMTiles][kKSteps][4],
                                           unsigned sB, int lane) {
    const unsigned b0 = sB + ((lane % 16) * kStrideB + (lane / 16) * 8) * 2;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
        unsigned a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int r = 0; r < 4; ++r) a[mt][r] = A[mt][ks][r];
        mma_k_step_trans_b<Op>(C, a, b0 + ks * 16 * kStrideB * 2);
    }
}

// C += A B with both operands in shared memory, B [k][n] (n contiguous). A is [m][k] (k
// contiguous): dV_j += P^T dO_i over the queries whose P^T another warp computed; or, with
// kATransposed, [k][m] (m contiguous): dQ_i += dS_ij K_j from the dK/dV kernel's dS^T tile.
// sA: byte address of A's element at the warp's first m and the product's first k; sB: of B's
// first k row at the product's first column.
template <typename Op, bool kATransposed, int kMTiles, int kNTiles, int kKSteps, int kStrideA, int kStrideB>
__device__ __forceinline__ void gemm_ab_ss(float (&C)[kMTiles][kNTiles][4], unsigned sA, unsigned sB, int lane) {
    const unsigned a0 = kATransposed ? sA + ((lane % 8 + (lane / 16) * 8) * kStrideA + (lane / 8) % 2 * 8) * 2
                                     : sA + ((lane % 16) * kStrideA + (lane / 16) * 8) * 2;
    const unsigned b0 = sB + ((lane % 16) * kStrideB + (lane / 16) * 8) * 2;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
        unsigned a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
            if (kATransposed)
                ldmatrix_x4_trans(a[mt], a0 + (ks * 16 * kStrideA + mt * 16) * 2);
            else
                ldmatrix_x4(a[mt], a0 + (mt * 16 * kStrideA + ks * 16) * 2);
        }
        mma_k_step_trans_b<Op>(C, a, b0 + ks * 16 * kStrideB * 2);
    }
}

}  // namespace cupyflash
