// Element types and the few math functions the kernels need.
//
// The kernels include no CUDA headers: 16-bit conversions are single PTX instructions, so NVRTC
// compiles this project with nothing but its own library (no cuda_fp16.h on the include path).
#pragma once

namespace cupyflash {

// Tags for the 16-bit element types; their bits travel as unsigned short.
struct Float16 {};
struct BFloat16 {};

// Storage: how an element sits in device memory. Accum: the type scores, softmax and the output
// accumulator are computed in (float32 for 16-bit inputs, the input's own precision otherwise).
template <typename Element> struct NumericTraits;

template <> struct NumericTraits<Float16> {
    using Storage = unsigned short;
    using Accum = float;
    static __device__ __forceinline__ float to_accum(unsigned short bits) {
        float x;
        asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(x) : "h"(bits));
        return x;
    }
    static __device__ __forceinline__ unsigned short from_accum(float x) {
        unsigned short bits;
        asm("{ .reg .b16 h; cvt.rn.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(bits) : "f"(x));
        return bits;
    }
};

template <> struct NumericTraits<BFloat16> {
    using Storage = unsigned short;
    using Accum = float;
    // bfloat16 is the top half of a float32: widening is exact.
    static __device__ __forceinline__ float to_accum(unsigned short bits) {
        return __uint_as_float(static_cast<unsigned int>(bits) << 16);
    }
    static __device__ __forceinline__ unsigned short from_accum(float x) {
        unsigned short bits;
        asm("{ .reg .b16 h; cvt.rn.bf16.f32 h, %1; mov.b16 %0, h; }" : "=h"(bits) : "f"(x));
        return bits;
    }
};

template <> struct NumericTraits<float> {
    using Storage = float;
    using Accum = float;
    static __device__ __forceinline__ float to_accum(float x) { return x; }
    static __device__ __forceinline__ float from_accum(float x) { return x; }
};

template <> struct NumericTraits<double> {
    using Storage = double;
    using Accum = double;
    static __device__ __forceinline__ double to_accum(double x) { return x; }
    static __device__ __forceinline__ double from_accum(double x) { return x; }
};

// Overloads on the accumulator type, so one kernel body serves float and double.
__device__ __forceinline__ float exp2_(float x) { return exp2f(x); }
__device__ __forceinline__ double exp2_(double x) { return exp2(x); }
__device__ __forceinline__ float log_(float x) { return logf(x); }
__device__ __forceinline__ double log_(double x) { return log(x); }
__device__ __forceinline__ float max_(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float tanh_(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_(double x) { return tanh(x); }

template <typename T> __device__ __forceinline__ T neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
    return __longlong_as_double(static_cast<long long>(0xfff0000000000000ULL));
}

template <typename T> __device__ __forceinline__ T pos_inf() { return -neg_inf<T>(); }

template <typename T> __device__ __forceinline__ T shfl_xor(T x, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, x, lane_mask);
}

constexpr double kLn2 = 0.693147180559945309417232121458176568;   // ln(2): lse = m·ln2 + ln(l)
constexpr double kLog2e = 1.442695040888963407359924681001892137;  // log2(e): exp(x) = exp2(x·log2(e))

// tanh(x) = 1 - 2 / (e^2x + 1) with the hardware exp2 and reciprocal: an absolute error of a few
// 1e-7, as float32 arithmetic gives, in two MUFU operations where tanhf takes ~20 instructions.
// The one-operation tanh.approx.f32 (flash-attn's choice) made softcapped forwards 1.09-1.16x
// faster, but its 2^-11 relative error put lse 2-5x past the float32 bound.
__device__ __forceinline__ float tanh_fast(float x) {
    return 1.f - __fdividef(2.f, exp2f(x * static_cast<float>(2.0 * kLog2e)) + 1.f);
}

// A compile-time bool as a type, for generic lambdas instantiated on a runtime-uniform flag.
template <bool kValue> struct BoolConstant { static constexpr bool value = kValue; };

__host__ __device__ constexpr int gcd_(int a, int b) { return b == 0 ? a : gcd_(b, a % b); }

template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T x[N]; };

template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace cupyflash
