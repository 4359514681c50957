// Score modifiers (softcap, ALiBi) and dropout, as the kernels take them: real objects in the
// kScoreMod instantiations, empty ones elsewhere, so that the unmodified kernels' code is unchanged.
#pragma once
#include "common/philox.cuh"
#include "common/params.cuh"

namespace cupyflash {

// How a kernel evaluates the softcap's tanh: tanhf / tanh in the CUDA-core kernels, tanh_fast or
// tanh_exp2 in the tensor-core ones (common/numeric.cuh says which and why).
enum class Tanh { kAccurate, kFast, kExp2 };

// The score modifiers of current models, on a score x = scale·q_i·k_j in the kernels' log2 units:
// the softcap of Gemma 2 and Grok, x -> cap·tanh(x / cap), then ALiBi's linear bias (Press et al.,
// 2022) -slope_h·|i + seqlen_k - seqlen_q - j|: the key's distance from the query's own position,
// aligned bottom-right as causal is. The host passes cap and the slopes in natural units times
// log2(e), which is the same modification of the log2-unit score. Masked scores (-inf) stay -inf.
template <typename Accum>
struct ScoreMod {
    Accum cap, inv_cap;  // the softcap (log2 units) and its inverse; cap = 0: none
    Accum slope;         // this head's ALiBi slope (log2 units); 0: none
    int diagonal;        // seqlen_k - seqlen_q: query i's own key position is i + diagonal

    template <typename Params>
    __device__ __forceinline__ ScoreMod(const Params& params, int batch_idx, int head_idx)
        : cap(static_cast<Accum>(params.softcap_log2)),
          inv_cap(params.softcap_log2 > 0 ? static_cast<Accum>(1.0 / params.softcap_log2) : Accum(0)),
          slope(params.alibi_slopes == nullptr
                    ? Accum(0)
                    : static_cast<Accum>(kLog2e) * static_cast<const Accum*>(params.alibi_slopes)[
                          batch_idx * params.alibi_batch_stride + head_idx]),
          diagonal(params.seqlen_k - params.seqlen_q) {}

    // The decode kernels' form: cap and slope in log2 units, given; positions passed as key positions.
    __device__ __forceinline__ ScoreMod(Accum cap_log2, Accum slope_log2)
        : cap(cap_log2), inv_cap(cap_log2 > Accum(0) ? Accum(1) / cap_log2 : Accum(0)), slope(slope_log2), diagonal(0) {}

    __device__ __forceinline__ bool softcap() const { return cap != Accum(0); }

    // query + diagonal - key, whose absolute value is ALiBi's distance: the tensor-core kernels
    // take it once per tile and add each fragment element's constant offset, a float add where an
    // int-to-float conversion per element would take the MUFU pipe's slots from exp2.
    __device__ __forceinline__ Accum offset(int query, int key) const {
        return static_cast<Accum>(query + diagonal - key);
    }

    // The modified score of x at ALiBi distance `distance`, and in dx its derivative in x
    // (1 - tanh^2 with the softcap, else 1), which the backward's dS_ij = P_ij ∘ (dP_ij - D_i) ∘ dx
    // needs. kSoftcap: whether cap != 0, decided once per tile (softcap()). kTanh: how the
    // softcap's tanh is evaluated (Tanh).
    template <Tanh kTanh, bool kSoftcap>
    __device__ __forceinline__ Accum apply_at(Accum x, Accum distance, Accum& dx) const {
        dx = Accum(1);
        if constexpr (kSoftcap) {
            // (A conditional expression: an if constexpr chain here changed NVRTC's code for the
            // forward kernels, though not what they compute.)
            const Accum t = kTanh == Tanh::kFast   ? tanh_fast(x * inv_cap)
                            : kTanh == Tanh::kExp2 ? tanh_exp2(x * inv_cap)
                                                   : tanh_(x * inv_cap);
            dx = Accum(1) - t * t;
            x = x == neg_inf<Accum>() ? x : cap * t;
        }
        return x - slope * distance;
    }

    template <Tanh kTanh>
    __device__ __forceinline__ Accum apply(Accum x, int query, int key, Accum& dx) const {
        const Accum distance = abs(offset(query, key));
        return softcap() ? apply_at<kTanh, true>(x, distance, dx) : apply_at<kTanh, false>(x, distance, dx);
    }
};

// The kernels' modifiers: read from the parameters in kScoreMod instantiations; elsewhere an
// empty object, as even an unused zero-filled ScoreMod changes NVRTC's code for some kernels.
struct NoScoreMod {};
template <bool kScoreMod, typename Accum> struct ScoreModFor { using type = ScoreMod<Accum>; };
template <typename Accum> struct ScoreModFor<false, Accum> { using type = NoScoreMod; };

template <bool kScoreMod, typename Accum, typename Params>
__device__ __forceinline__ typename ScoreModFor<kScoreMod, Accum>::type score_mod(const Params& params, int batch_idx,
                                                                                  int head_idx) {
    if constexpr (kScoreMod) {
        return ScoreMod<Accum>(params, batch_idx, head_idx);
    } else {
        return NoScoreMod{};
    }
}

// Dropout, like the score modifiers, only in kScoreMod instantiations (an empty object elsewhere).
template <bool kScoreMod> struct DropoutFor { using type = Dropout; };
template <> struct DropoutFor<false> { using type = NoScoreMod; };

template <bool kScoreMod, typename Params>
__device__ __forceinline__ typename DropoutFor<kScoreMod>::type dropout_for(const Params& params, int batch_idx,
                                                                          int head_idx) {
    if constexpr (kScoreMod) {
        return Dropout(params, batch_idx, head_idx);
    } else {
        return NoScoreMod{};
    }
}

// The factor dropout puts on the output and the gradients: 1 / (1 - p), 1 where kernels have no dropout.
template <bool kScoreMod, typename Accum, typename Params>
__device__ __forceinline__ Accum dropout_rescale(const Params& params) {
    if constexpr (kScoreMod) {
        return static_cast<Accum>(params.dropout_rescale);
    } else {
        return Accum(1);
    }
}

// value · dropout's 1 / (1 - p) in kScoreMod kernels, the value itself elsewhere. (An if constexpr:
// `kScoreMod ? value * rescale : value` changed NVRTC's code for the unmodified kernels, which then
// spilled at 255 registers.)
template <bool kScoreMod, typename Params>
__device__ __forceinline__ double dropout_scaled(const Params& params, double value) {
    if constexpr (kScoreMod) {
        return value * params.dropout_rescale;
    } else {
        return value;
    }
}

}  // namespace cupyflash
