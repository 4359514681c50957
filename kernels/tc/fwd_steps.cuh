// The steps the tensor-core forward kernels share, the mma.sync (sm80/fwd.cu) and the one-block
// wgmma (sm90/fwd.cu) ones, on a warp's rows x keys fragments (both kernels' warps hold mma.sync's
// fragment layout).
#pragma once
#include "tc/fragments.cuh"

namespace cupyflash {

// O_i = 0, m_i = -inf, l_i = 0: a query tile's running softmax before its first key tile.
template <typename Kt, typename T = typename Kt::Accum>
__device__ __forceinline__ void init_row_state(T (&O)[Kt::kMTiles][Kt::kHeadDim / 8][4], T (&m)[Kt::kMTiles][2],
                                               T (&l)[Kt::kMTiles][2]) {
    zero(O);
#pragma unroll
    for (int mt = 0; mt < Kt::kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) m[mt][h] = neg_inf<T>(), l[mt][h] = T(0);
}

// One key tile's S_ij (the warp's rows from warp_row0, keys from col0) into the running softmax:
// masked where seqlen_k or the band cuts the tile, modified (kScoreMod), folded into m_i, l_i and
// O_i's rescale, and left as P_ij in S (online_softmax_tc; kLazy: its lazy rescale).
template <typename Kt, bool kIsLocal, bool kScoreMod, bool kLazy, typename Mod, typename Drop,
          typename T = typename Kt::Accum>
__device__ __forceinline__ void softmax_step(T (&S)[Kt::kMTiles][Kt::kNTiles][4], T (&O)[Kt::kMTiles][Kt::kHeadDim / 8][4],
                                             T (&m)[Kt::kMTiles][2], T (&l)[Kt::kMTiles][2], const FwdParams& params,
                                             const Mod& mod, const Drop& dropout, T scale_log2, int row0, int rows_valid,
                                             int warp_row0, int col0, int keys_valid, const Fragment& f) {
    if (keys_valid < Kt::kBlockN || (kIsLocal && band_cuts(params, row0, rows_valid, col0, keys_valid)))
        mask_fragments<kIsLocal, false>(S, warp_row0, col0, params, f);
    if constexpr (kScoreMod) {
        // S becomes the modified scores in log2 units, which the softmax takes unscaled.
        if (mod.softcap())
            score_mod_fragments<true>(S, mod, scale_log2, warp_row0, col0, f);
        else
            score_mod_fragments<false>(S, mod, scale_log2, warp_row0, col0, f);
        online_softmax_tc<Kt>(S, O, m, l, T(1));
        // P_ij ∘ Z_ij after l_i took every probability in (apply_dropout in scalar/fwd_steps.cuh).
        if (dropout.active())
            for_dropped<false, Kt::kMTiles, Kt::kNTiles>(dropout, warp_row0, col0, f,
                                                         [&](int mt, int nt, int i) { S[mt][nt][i] = T(0); });
    } else {
        online_softmax_tc<Kt, kLazy>(S, O, m, l, scale_log2);
    }
}

}  // namespace cupyflash
