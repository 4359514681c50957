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

// float32 elements whose products run on the tensor cores as TF32 (arch/sm80.cuh's Mma<Tf32>):
// kPasses 3 splits each operand in two ("3xTF32", float32 accuracy), 1 takes one TF32 product.
template <int kPasses> struct Tf32 {};
template <int kPasses> struct NumericTraits<Tf32<kPasses>> : NumericTraits<float> {};

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
__device__ __forceinline__ float abs_(float x) { return fabsf(x); }
__device__ __forceinline__ double abs_(double x) { return fabs(x); }
__device__ __forceinline__ float fma_(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_(double a, double b, double c) { return fma(a, b, c); }

// T in a parameter that takes T's value without deducing T from it: a function on float or double
// fragments whose scale argument may be written as a float literal.
template <typename T> struct NonDeduced { using type = T; };

template <typename T> __device__ __forceinline__ T neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
    return __longlong_as_double(static_cast<long long>(0xfff0000000000000ULL));
}

template <typename T> __device__ __forceinline__ T pos_inf() { return -neg_inf<T>(); }

// Whether a row's sum of probabilities l_i says that it saw a key: l_i = 0 only when every key was
// hidden (output 0, lse -inf). A NaN score makes l_i NaN, for which l_i > 0 would be false too and
// turn a NaN in the inputs into output 0 and lse -inf; here it stays NaN in both.
template <typename T> __device__ __forceinline__ bool saw_keys(T l) { return l != T(0); }

template <typename T> __device__ __forceinline__ T shfl_xor(T x, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, x, lane_mask);
}

constexpr double kLn2 = 0.693147180559945309417232121458176568;   // ln(2): lse = m·ln2 + ln(l)
constexpr double kLog2e = 1.442695040888963407359924681001892137;  // log2(e): exp(x) = exp2(x·log2(e))

// The softcap's tanh in the tensor-core kernels. tanh_exp2: 1 - 2 / (e^2x + 1) with the hardware
// exp2 and reciprocal, two MUFU operations where tanhf takes ~20 instructions; within 2 ulp from
// |x| = 0.55 on, but below, where the subtraction cancels, an absolute error of ~1e-7, which the
// softcap multiplies. tanh_fast: the same from 0.55 on, below it x times a fit of tanh(x) / x in
// x^2 (relative error 3e-8, 2 ulp evaluated in float32). The forward and decode kernels take
// tanh_fast: their scores reach lse and out in float32, where tanh_exp2 put lse up to 1.8x past the
// float32 bound with caps of 30-50 and few keys (16 of 3000 random problems). The backward kernels
// take tanh_exp2: they round P to 16 bits, and at 255 registers tanh_fast spilled 8 bytes in
// the d16 mma.sync and d64 wgmma dK/dV kernels. (The one-operation tanh.approx.f32, flash-attn's choice, made softcapped
// forwards 1.09-1.16x faster, but its 2^-11 relative error put lse 2-5x past the float32 bound.)
__device__ __forceinline__ float tanh_exp2(float x) {
    return 1.f - __fdividef(2.f, exp2f(x * static_cast<float>(2.0 * kLog2e)) + 1.f);
}

__device__ __forceinline__ float tanh_fast(float x) {
    const float t = x * x;
    const float near_zero =
        x * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 0.01631566882f, -0.05258943886f), 0.13318878412f), -0.33332794905f),
                 0.99999994040f);
    const float wide = tanh_exp2(x);
    return fabsf(x) < 0.55f ? near_zero : wide;
}

// The type kCondition picks (std::conditional, which NVRTC's headerless builds do not have).
template <bool kCondition, typename A, typename B> struct Conditional { using type = A; };
template <typename A, typename B> struct Conditional<false, A, B> { using type = B; };

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
