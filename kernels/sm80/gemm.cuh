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

// float32 tiles on TF32 products (Op: Mma<Tf32<kPasses>>): C += A B^T, both operands [rows][k]
// float32 in shared memory (k contiguous), as gemm_abt_ss: ldmatrix at the same lane addresses
// (strides in b16 units, k-steps of 8 floats = 32 bytes) gives the tf32 A and B fragments; each is
// split into hi and lo once. The tensor cores round their float32 accumulator toward zero: chained
// over the head dim's k-steps, that bias put S's error at 2-3x float32's and lse's past float32's
// rule (a model, d128, 4096 keys; on the H200, dV 1.65x over it through lse). So each k-step's
// products go into a zeroed accumulator that C takes with a rounding add (the model: 0.1-0.4x of
// float32's S error). The k-steps are then independent chains, which NVRTC, fully unrolled,
// interleaves until 62 of the 140 builds spill: they run one at a time.
template <typename Op, int kMTiles, int kNTiles, int kKSteps, int kStrideA16, int kStrideB16>
__device__ __forceinline__ void gemm_abt_ss_tf32(float (&C)[kMTiles][kNTiles][4], unsigned sA, unsigned sB,
                                                   int lane) {
    static_assert(kNTiles % 2 == 0, "B is read 16 rows (two n8 tiles) per ldmatrix.x4");
    const unsigned a0 = sA + ((lane % 16) * kStrideA16 + (lane / 16) * 8) * 2;
    const unsigned b0 = sB + (((lane / 16) * 8 + lane % 8) * kStrideB16 + (lane / 8) % 2 * 8) * 2;
#pragma unroll 1
    for (int ks = 0; ks < kKSteps; ++ks) {
        unsigned a[kMTiles][4], b[kNTiles / 2][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt], a0 + (mt * 16 * kStrideA16 + ks * 16) * 2);
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) ldmatrix_x4(b[np], b0 + (np * 16 * kStrideB16 + ks * 16) * 2);
        unsigned a_hi[kMTiles][4], a_lo[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int r = 0; r < 4; ++r) Op::split(a[mt][r], a_hi[mt][r], a_lo[mt][r]);
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
            // ldmatrix register r of pair np: n8 tile 2np + r / 2, B register r % 2
            unsigned b_hi[2][2], b_lo[2][2];
#pragma unroll
            for (int r = 0; r < 4; ++r) Op::split(b[np][r], b_hi[r / 2][r % 2], b_lo[r / 2][r % 2]);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float acc[4] = {0.f, 0.f, 0.f, 0.f};
                    Op::run(acc, a_hi[mt], a_lo[mt], b_hi[h], b_lo[h]);
#pragma unroll
                    for (int r = 0; r < 4; ++r) C[mt][2 * np + h][r] += acc[r];
                }
        }
    }
}

// float32 tiles on TF32 products (Op): O += P V with P an accumulator tile in registers (keys as its columns)
// and V [keys][head dim] float32 rows in shared memory (row stride kStride floats). A k8 step is
// one n8 tile of P with its keys taken in the order 0, 2, 4, 6, 1, 3, 5, 7: lane (g, t) holds keys
// 2t and 2t + 1 of rows g and g + 8, which are then A's (g, t), (g, t + 4), (g + 8, t), (g + 8,
// t + 4); B takes V's rows in the same order, read 4 bytes at a time (ldmatrix cannot transpose
// 32-bit elements): lane (g, t) reads rows 2t, 2t + 1 of column g, on banks 8t + g, all distinct
// (kStride is the padded head dim, a multiple of 16, plus 4).
// The tensor cores add each product into their float32 accumulator rounded toward zero: over the
// thousands of keys a row of O sums, that bias grows past float32's error (a model of it: 1.9x the
// float32 bound at head dim 256, 3001 keys). So a key tile's P V goes into a zeroed accumulator,
// a group of kGroup n8 column tiles at a time, and O takes it with an ordinary (rounding) add
// (the same model: 0.06x).
template <typename Op, int kMTiles, int kDTiles, int kNTiles, int kStride>
__device__ __forceinline__ void gemm_pv_tf32(float (&O)[kMTiles][kDTiles][4], const float (&P)[kMTiles][kNTiles][4],
                                               unsigned sV, const Fragment& f) {
    constexpr int kGroup = kDTiles % 4 == 0 ? 4 : kDTiles % 2 == 0 ? 2 : 1;
    unsigned a_hi[kNTiles][kMTiles][4], a_lo[kNTiles][kMTiles][4];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
            const float a[4] = {P[mt][nt][0], P[mt][nt][2], P[mt][nt][1], P[mt][nt][3]};
#pragma unroll
            for (int r = 0; r < 4; ++r) Op::split(__float_as_uint(a[r]), a_hi[nt][mt][r], a_lo[nt][mt][r]);
        }
    const unsigned v0 = sV + (2 * f.t * kStride + f.g) * 4;
#pragma unroll
    for (int dg = 0; dg < kDTiles; dg += kGroup) {
        float acc[kMTiles][kGroup][4];
        zero(acc);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int i = 0; i < kGroup; ++i) {
                const unsigned row = v0 + (nt * 8 * kStride + (dg + i) * 8) * 4;
                unsigned b_hi[2], b_lo[2];
                Op::split(load_shared_4(row), b_hi[0], b_lo[0]);
                Op::split(load_shared_4(row + kStride * 4), b_hi[1], b_lo[1]);
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) Op::run(acc[mt][i], a_hi[nt][mt], a_lo[nt][mt], b_hi, b_lo);
            }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int i = 0; i < kGroup; ++i)
#pragma unroll
                for (int r = 0; r < 4; ++r) O[mt][dg + i][r] += acc[mt][i][r];
    }
}

// float64 tiles on DMMA k16 steps (Op: Mma<double>): C += A B^T, both operands [rows][k] float64 in
// shared memory (k contiguous, row stride kStride doubles): S = Q K^T. Slot (t, i) of a k-step
// (arch/sm80.cuh) is element 4t + i, so that lane (g, t) reads each of its rows' four elements
// with two 16-byte loads: A's rows g and g + 8, B's row g of each n8 tile. With kStride·8 bytes
// = 16 (mod 128), the 8 lanes of a load phase (two rows, four lanes each) hit 8 distinct
// 16-byte bank groups.
template <typename Op, int kMTiles, int kNTiles, int kKSteps, int kStride>
__device__ __forceinline__ void gemm_abt_ss_f64(double (&C)[kMTiles][kNTiles][4], unsigned sA, unsigned sB,
                                                const Fragment& f) {
    static_assert(kStride * 8 % 128 == 16, "rows fall 16 bytes apart in the banks");
    const unsigned a0 = sA + (f.g * kStride + 4 * f.t) * 8;
    const unsigned b0 = sB + (f.g * kStride + 4 * f.t) * 8;
#pragma unroll 2
    for (int ks = 0; ks < kKSteps; ++ks) {
        double a[kMTiles][8];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned row = a0 + ((mt * 16 + 8 * h) * kStride + ks * 16) * 8;
                load_shared_f64x2(row, a[mt][h], a[mt][2 + h]);
                load_shared_f64x2(row + 16, a[mt][4 + h], a[mt][6 + h]);
            }
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
            double b[4];
            const unsigned row = b0 + (nt * 8 * kStride + ks * 16) * 8;
            load_shared_f64x2(row, b[0], b[1]);
            load_shared_f64x2(row + 16, b[2], b[3]);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) Op::run(C[mt][nt], a[mt], b);
        }
    }
}

// One DMMA k16 step of C += A B, float64 (Op: Mma<double>), with A's fragments in registers in the
// order of an accumulator tile's columns: lane (g, t)'s slot i is k = 2t + i % 2 + 8·(i / 2), the
// columns 2t, 2t + 1 of n8 tiles 2kk and 2kk + 1 that the lane holds. B [k][n] float64 rows in shared
// memory (row stride kStrideB doubles): slot i of B is its row of the same k at column g, read 8
// bytes at a time (b_k: this lane's address, row 2t of the step at column g of the first n8 tile;
// the 16 lanes of a load phase: 4 rows 2 apart, 32 bytes apart in the banks, by 4 columns: 16
// distinct 8-byte bank pairs). kUnroll: the n8 tiles unrolled together (default all).
template <typename Op, int kMTiles, int kNTiles, int kStrideB, int kUnroll = kNTiles>
__device__ __forceinline__ void mma_k16_f64(double (&C)[kMTiles][kNTiles][4], const double (&a)[kMTiles][8],
                                            unsigned b_k) {
#pragma unroll kUnroll
    for (int nt = 0; nt < kNTiles; ++nt) {
        const unsigned row = b_k + nt * 8 * 8;
        const double b[4] = {load_shared_f64(row), load_shared_f64(row + kStrideB * 8),
                             load_shared_f64(row + 8 * kStrideB * 8), load_shared_f64(row + 9 * kStrideB * 8)};
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) Op::run(C[mt][nt], a[mt], b);
    }
}

// float64 tiles on DMMA k16 steps (Op): O += P V with P an accumulator tile in registers (keys as its
// columns), its k16 step kk the n8 tiles 2kk and 2kk + 1 (mma_k16_f64's slot order), and V [keys][head
// dim] float64 rows in shared memory (row stride kStride doubles). Also dV += P^T dO and dK += dS^T Q.
template <typename Op, int kMTiles, int kDTiles, int kNTiles, int kStride>
__device__ __forceinline__ void gemm_pv_f64(double (&O)[kMTiles][kDTiles][4], const double (&P)[kMTiles][kNTiles][4],
                                            unsigned sV, const Fragment& f) {
    static_assert(kNTiles % 2 == 0, "a k16 step takes two n8 tiles of P");
    const unsigned v0 = sV + (2 * f.t * kStride + f.g) * 8;
#pragma unroll
    for (int kk = 0; kk < kNTiles / 2; ++kk) {
        double a[kMTiles][8];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) a[mt][2 * i + h] = P[mt][2 * kk + i / 2][2 * h + i % 2];
        mma_k16_f64<Op, kMTiles, kDTiles, kStride>(O, a, v0 + 16 * kk * kStride * 8);
    }
}

// float64 tiles on DMMA k16 steps (Op): C += A B with both operands in shared memory, B [k][n] (n
// contiguous), A [m][k] (k contiguous: dV_j += P^T dO_i over the queries whose P^T another warp
// wrote) or, with kATransposed, [k][m] (m contiguous: dQ_i += dS_ij K_j from the dS^T tile). A is
// read into mma_k16_f64's slot order: two 16-byte loads a row (two rows of a load phase share 2
// bank groups at kStrideA·8 = 16 mod 128), or (transposed) one 8-byte load an element (16 distinct
// bank pairs a phase). sA: A's element at the warp's first m and the product's first k; sB: B's
// first k row at the product's first column.
template <typename Op, bool kATransposed, int kMTiles, int kNTiles, int kKSteps, int kStrideA, int kStrideB>
__device__ __forceinline__ void gemm_ab_ss_f64(double (&C)[kMTiles][kNTiles][4], unsigned sA, unsigned sB,
                                               const Fragment& f) {
    const unsigned b0 = sB + (2 * f.t * kStrideB + f.g) * 8;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
        double a[kMTiles][8];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = mt * 16 + f.g + 8 * h, k = ks * 16 + 2 * f.t;
                if constexpr (kATransposed) {
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        a[mt][2 * i + h] = load_shared_f64(sA + ((k + i % 2 + 8 * (i / 2)) * kStrideA + m) * 8);
                } else {
                    const unsigned row = sA + (m * kStrideA + k) * 8;
                    load_shared_f64x2(row, a[mt][h], a[mt][2 + h]);
                    load_shared_f64x2(row + 8 * 8, a[mt][4 + h], a[mt][6 + h]);
                }
            }
        // 4 n8 tiles at a time: fully unrolled, the d65-128 dK/dV tile (tiles.f64_dkdv_tile_shape)
        // spills 24-72 bytes.
        mma_k16_f64<Op, kMTiles, kNTiles, kStrideB, 4>(C, a, b0 + 16 * ks * kStrideB * 8);
    }
}

// Writes a float64 accumulator tile to a [rows][cols] shared tile (row stride kStride doubles) for
// other warps to read: s_tile at the warp's first row and column; a lane's two adjacent columns
// go out as one 16-byte store.
template <int kStride, int kMTiles, int kNTiles>
__device__ __forceinline__ void store_accumulators_f64(unsigned s_tile, const double (&C)[kMTiles][kNTiles][4],
                                                       const Fragment& f) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
                store_shared_f64x2(s_tile + ((mt * 16 + f.g + 8 * h) * kStride + nt * 8 + 2 * f.t) * 8,
                                   C[mt][nt][2 * h], C[mt][nt][2 * h + 1]);
}

}  // namespace cupyflash
