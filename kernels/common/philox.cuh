// Dropout's random numbers: Philox4x32-10 (Salmon et al., "Parallel Random Numbers: As Easy as 1,
// 2, 3", SC 2011), a counter-based generator: four 32-bit words that are a pure function of a
// 128-bit counter and a 64-bit key. The forward and both backward kernels regenerate the same keep
// mask from element coordinates alone, so the mask is never stored; cupyflash/cpu/philox.py mirrors
// this file in NumPy, bit for bit (and the tests check it against Random123's known answers).
#pragma once
#include "common/numeric.cuh"

namespace cupyflash {

struct PhiloxWords { unsigned x[4]; };

// Ten rounds of the Philox S-box, the key bumped by the Weyl constants between rounds.
__device__ __forceinline__ PhiloxWords philox4x32_10(unsigned c0, unsigned c1, unsigned c2, unsigned c3,
                                                     unsigned k0, unsigned k1) {
    constexpr unsigned kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // multipliers
    constexpr unsigned kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // golden ratio, sqrt(3) - 1
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) k0 += kW0, k1 += kW1;
        const unsigned hi0 = __umulhi(kM0, c0), lo0 = kM0 * c0;
        const unsigned hi1 = __umulhi(kM1, c2), lo1 = kM1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    return {{c0, c1, c2, c3}};
}

// Dropout on the attention probabilities, with keep probability 1 - p. The element (query i, key j)
// of (batch b, head h) is dropped when a 32-bit word W < threshold = round(p·2^32); W comes from
//   key     = (seed mod 2^32, seed / 2^32)     (seed, offset: the struct's, or dropout_state's)
//   counter = (group(j), group(i), b·heads + h, offset),  group(x) = 8·(x / 16) + x mod 8
//   word    = 2·((i / 8) mod 2) + (j / 8) mod 2
// so one call gives the 2 x 2 elements {i, i + 8} x {j, j + 8}: the elements one lane holds together
// both in an mma accumulator (rows i, i + 8; columns j, j + 8 as n8 tiles 0 and 1) and in its
// transpose, the dK/dV kernel's S^T. Coordinates are a sequence's own (varlen: b is the sequence).
struct Dropout {
    unsigned k0, k1;      // the key: the seed
    unsigned stream;      // b·heads + h
    unsigned offset;
    unsigned threshold;   // round(p·2^32); 0: no dropout

    template <typename Params>
    __device__ __forceinline__ Dropout(const Params& params, int batch_idx, int head_idx)
        : k0(static_cast<unsigned>(params.dropout_seed)),
          k1(static_cast<unsigned>(params.dropout_seed >> 32)),
          stream(static_cast<unsigned>(batch_idx) * static_cast<unsigned>(params.heads) + static_cast<unsigned>(head_idx)),
          offset(params.dropout_offset),
          threshold(params.dropout_threshold) {
        if (params.dropout_state != nullptr) {  // one address for every thread: a broadcast read
            const unsigned long long seed = __ldg(params.dropout_state);
            k0 = static_cast<unsigned>(seed);
            k1 = static_cast<unsigned>(seed >> 32);
            offset = static_cast<unsigned>(__ldg(params.dropout_state + 1));
        }
    }

    __device__ __forceinline__ bool active() const { return threshold != 0u; }

    static __device__ __forceinline__ unsigned group(int x) { return static_cast<unsigned>((x >> 4) * 8 + (x & 7)); }

    // The words of the 2 x 2 group holding (query, key); query and key may be any member of it.
    __device__ __forceinline__ PhiloxWords words(int query, int key) const {
        return philox4x32_10(group(key), group(query), stream, offset, k0, k1);
    }

    __device__ __forceinline__ bool keeps(unsigned word) const { return word >= threshold; }

    // Whether (query, key) is kept: one generator call per element (the scalar kernels; the
    // tensor-core ones use all four words of a call).
    __device__ __forceinline__ bool keep(int query, int key) const {
        const PhiloxWords w = words(query, key);
        // Selects, not w.x[runtime index], which would put w in local memory.
        const unsigned upper = key & 8 ? w.x[1] : w.x[0], lower = key & 8 ? w.x[3] : w.x[2];
        return keeps(query & 8 ? lower : upper);
    }
};

}  // namespace cupyflash
