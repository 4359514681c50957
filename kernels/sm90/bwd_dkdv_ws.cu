// The Hopper dK/dV kernel, warp-specialised and persistent (FlashAttention-3's structure): a block
// per SM claims key blocks in turn; a producer warp asks the TMA for each key block's K_j, V_j and
// each step's Q_i, dO_i and loads the row statistics, while two consumer warpgroups compute, and,
// where a dQ ring serves, rounds finished dQ slabs into dq.
#include "sm90/bwd_steps.cuh"

namespace cupyflash {

// The query block a key block's walk starts at, the walk wrapping round: its launch position's, as
// flash_bwd_dkdv_sm90_kernel's (dense: its key block's index), so that the blocks in flight add into
// different rows of dQ at a time (atomics on the same addresses serialise in L2).
template <bool kIsBlockSparse>
__device__ __forceinline__ int first_query_tile(const TileSequence<kIsBlockSparse>& query_blocks, int position) {
    const int m_blocks = query_blocks.end - query_blocks.begin;
    return m_blocks > 0 ? query_blocks.begin + position % m_blocks : 0;
}

// The warp-specialised dK/dV kernel's view of WgmmaBwdDkdvTraits' shared memory (the one-block
// kernel's TMA builds' layout), from its tiles' base, the first swizzle period.
struct DkdvTiles {
    unsigned sK, sV;  // K_j, V_j [kBlockN][head dim], swizzled panels
    unsigned sQ;      // Q_i [2][kBlockM][head dim]
    unsigned sdO;     // dO_i [2][kBlockM][head dim]
    unsigned sdSt;    // dS_ij^T [kBlockN][kBlockM]
    unsigned sDq;     // dQ_i's shares, [2 stages][kWarpgroups][kDqShareBytes]
    unsigned sRound;  // the warp-specialised kernel's dQ boxes being rounded, [2][kDqRoundBoxBytes]
    float* sLse2;     // lse_i·log2(e) [2][kBlockM]
    float* sD;        // D_i [2][kBlockM]
};

template <typename Bt>
__device__ __forceinline__ DkdvTiles dkdv_tiles(unsigned char* smem) {
    const unsigned tiles = Bt::tile_base(smem_address(smem));
    DkdvTiles s;
    s.sK = tiles + Bt::kSmemKOffset * 2;
    s.sV = tiles + Bt::kSmemVOffset * 2;
    s.sQ = tiles + Bt::kSmemQOffset * 2;
    s.sdO = tiles + Bt::kSmemDoOffset * 2;
    s.sdSt = tiles + Bt::kSmemDsOffset * 2;
    s.sDq = tiles + Bt::kDqStageOffset;
    s.sRound = tiles + Bt::kDqRoundOffset;
    s.sLse2 = reinterpret_cast<float*>(smem + (tiles - smem_address(smem)) + Bt::kSmemRowStatsOffset);
    s.sD = s.sLse2 + 2 * Bt::kBlockM;
    return s;
}

// One step of the warp-specialised kernel's consumers: flash_bwd_dkdv_sm90_kernel's step as its Hopper
// TMA builds take it (64 keys per warpgroup, a warp's 16 keys against every query, no score
// modifiers), for key block K_j, V_j (from key0) and query block Q_i, dO_i (from q_row0, in buffer
// buf, landed): dV_j += P^T dO_i, dK_j += dS^T Q_i, dQ_i's shares added by the TMA. It returns with
// every product that reads Q_i, dO_i or dS^T done. (Moved into one function that both kernels
// called, the step spilled 8-32 bytes in the one-block kernel's mma.sync builds at head dim 256,
// sm_90a; so that kernel keeps its own text of it.)
template <typename Bt, bool kIsLocal>
__device__ __forceinline__ void dkdv_consumer_step(const BwdParams& params, const BwdTensorMaps& maps,
                                                   const DkdvTiles& s, int key0, int keys_valid, int q_row0,
                                                   int head_idx, int q_batch, int buf,
                                                   float (&dK)[1][Bt::kOutTiles][4], float (&dV)[1][Bt::kOutTiles][4],
                                                   int& dq_stage, int barrier) {
    using Op = typename Bt::Op;
    static_assert(Bt::kWgmma && Bt::kWarpsQ == 1 && Bt::kMTiles == 1, "the Hopper builds' warps");
    constexpr bool kDpWithS = Bt::kBlockM == 64;  // (as flash_bwd_dkdv_sm90_kernel's)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Fragment f(lane);
    const int warp_keys = warp * Bt::kWarpKeys;
    const float scale_log2 = static_cast<float>(params.scale_log2);
    const unsigned sQ_i = s.sQ + buf * Bt::kQueryTileBytes, sdO_i = s.sdO + buf * Bt::kQueryTileBytes;
    const float* sLse2_i = s.sLse2 + buf * Bt::kBlockM;
    const float* sD_i = s.sD + buf * Bt::kBlockM;

    // S_ij^T = K_j Q_i^T (with kDpWithS dP_ij^T = V_j dO_i^T issued with it), masked, then
    // P_ij^T = exp2(S^T·scale·log2(e) - lse_i·log2(e)).
    float St[1][Bt::kNTiles][4], dPt[1][Bt::kNTiles][4];
    const unsigned group_rows = Bt::row_bytes(64 * (warp / 4));
    wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN, false>(St[0], s.sK + group_rows, sQ_i);
    if constexpr (kDpWithS) wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN, false>(dPt[0], s.sV + group_rows, sdO_i);
    wgmma_wait<kDpWithS ? 1 : 0>();
    fence_operands(St[0]);
    if (keys_valid < Bt::kBlockN ||
        (kIsLocal && band_cuts(params, q_row0, min(Bt::kBlockM, params.seqlen_q - q_row0), key0, keys_valid)))
        mask_fragments<kIsLocal, true>(St, key0 + warp_keys, q_row0, params, f);
#pragma unroll
    for (int nt = 0; nt < Bt::kNTiles; ++nt) {
        const float2 lse2 = *reinterpret_cast<const float2*>(sLse2_i + f.col(nt, 0));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            St[0][nt][2 * h] = exp2f(fmaf(St[0][nt][2 * h], scale_log2, -lse2.x));
            St[0][nt][2 * h + 1] = exp2f(fmaf(St[0][nt][2 * h + 1], scale_log2, -lse2.y));
        }
    }
    // dV_j += P^T dO_i (left running), then dS_ij^T = P^T ∘ (dP^T - D_i) in place, from P^T's
    // rounding and remainders (bwd_steps.cuh's p_remainders).
    unsigned Pt[1][Bt::kNTiles / 2][4], Rt[1][Bt::kNTiles / 2][2];
    to_a_fragments<Op>(St, Pt);
    p_remainders<Op>(St, Pt, Rt);
    wgmma_ab_rs<Bt, Bt::kBlockM, false>(dV[0], Pt[0], sdO_i);
    if constexpr (kDpWithS)
        wgmma_wait<1>();
    else
        wgmma_abt<Bt, Bt::kBlockM, Bt::kBlockN>(dPt[0], s.sV + group_rows, sdO_i);
    fence_operands(dPt[0]);
    scores_gradient_t<Op>(dPt, Pt, Rt, sD_i, 0, f);
    // dK_j += dS^T Q_i (left running); dS^T to shared memory, and once every consumer warp's is
    // there, dQ_i += dS_ij K_j.
    unsigned dSt[1][Bt::kNTiles / 2][4];
    to_a_fragments<Op>(dPt, dSt);
    store_a_fragments_swizzled<Bt, Bt::kBlockN>(s.sdSt, dSt[0], warp_keys, f);
    wgmma_ab_rs<Bt, Bt::kBlockM, false>(dK[0], dSt[0], sQ_i);
    named_barrier_sync(barrier, Bt::kNThreads);
    add_dq_shares_wgmma<Bt, false, true>(params, maps.dq, s.sDq + dq_stage * Bt::kWarpgroups * Bt::kDqShareBytes,
                                         s.sdSt, s.sK, q_row0, q_batch, head_idx, warp, lane);
    dq_stage ^= 1;
    wgmma_wait<0>();
    fence_operands(dV[0]);
    fence_operands(dK[0]);
    fence_operands(dSt[0]);
}

// The warp-specialised dK/dV kernel's counters, zero at launch and left zero at exit: its item
// claims, its rounding warps done, then per (K/V head, batch) slab the completions of its items
// (one per consumer warpgroup and item, once that warpgroup's dQ adds for it have landed) and the
// rounding warps done with it (two per block: its ring slot is zero again).
struct DkdvCounters {
    int* base;
    int slabs;
    __device__ __forceinline__ int* next_item() const { return base; }
    __device__ __forceinline__ int* rounders_done() const { return base + 1; }
    __device__ __forceinline__ int* slab_done(int slab) const { return base + 2 + slab; }
    __device__ __forceinline__ int* slab_rounded(int slab) const { return base + 2 + slabs + slab; }
};
constexpr int kRoundingWarps = 2;

__device__ __forceinline__ int load_acquire(const int* p) {
    int x;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(x) : "l"(p) : "memory");
    return x;
}
__device__ __forceinline__ void add_release(int* p, int x) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(x) : "memory");
}
__device__ __forceinline__ int add_acq_rel(int* p, int x) {
    int before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(before) : "l"(p), "r"(x) : "memory");
    return before;
}
__device__ __forceinline__ void wait_at_least(const int* p, int x) {
    while (load_acquire(p) < x) __nanosleep(128);
}

// The warp-specialised kernel's dQ workspace is a ring of `ring` slots, one (K/V head, batch) slab
// each: (query, slot, head of the group, head dim) floats, slab s in slot s % ring (the dq map's
// head coordinate is slot x group + the head within the group, its batch coordinate 0). The
// slots' rows interleave as the whole workspace's heads do: slot-major, the same adds ran 4-9%
// slower. A slot is rounded into dq as soon as its slab's items
// are complete and left zero for slab s + ring, whose items wait for that (wait_for_slot). So
// there is no workspace to clear before the launch nor to round after it. With ring = slabs (a
// short launch) no slab waits. The producer looks while the item's K_j, V_j load (slot_ready: its
// load's latency is off the consumers' path); the consumers' storing threads wait only where it
// found the slot still in use.
__device__ __forceinline__ bool slot_ready(const DkdvCounters& counters, int slab, int ring) {
    if (ring == 0 || slab < ring) return true;
    if (load_acquire(counters.slab_rounded(slab - ring)) < kRoundingWarps * static_cast<int>(gridDim.x)) return false;
    fence_proxy_async_global();  // the slot's zeros (generic stores), before the TMA adds to it
    return true;
}
__device__ __forceinline__ void wait_for_slot(const DkdvCounters& counters, int slab, int ring) {
    wait_at_least(counters.slab_rounded(slab - ring), kRoundingWarps * gridDim.x);
    fence_proxy_async_global();
}

// A consumer warpgroup's count of its last item complete in its slab (`pending`, -1: none), made
// once the item's dQ adds have landed: after the next item's steps (the consumers' loop), or here,
// by the storing thread, at once where the next item must wait for its slot, which might need this
// very count (wait_for_slot), and at the end.
__device__ __forceinline__ void count_item_complete(const DkdvCounters& counters, int& pending) {
    if (pending < 0) return;
    bulk_wait_group<0>();
    fence_proxy_async_global();
    add_release(counters.slab_done(pending), 1);
    pending = -1;
}

// dq rounded from the ring inside the warp-specialised dK/dV kernel, in place of the conversion
// launch, box by box (the dq map's 64 queries x kDqBoxColumns boxes, column boxes fastest, then
// queries, then the query heads of the K/V head; the slabs in the items' order), block b taking
// boxes b, b + gridDim.x, ... of each slab: one thread waits until the slab has `expected`
// completions and asks the TMA for each box into the free one of two buffers (`box_of`: its head
// within the group, first query, first column, slab, and whether it is this block's last box of
// the slab; head -1: no more; and `box_at`: where its first element is in dq and in the ring), and
// the rounding warps round it into dq (round_dq_boxes). Loads by the rounding warps themselves, at
// the producer warpgroup's 40 registers, kept too few bytes in flight: 0.4 TB/s.
enum { kBoxHead, kBoxRow, kBoxCol, kBoxSlab, kBoxLast, kBoxFields };
template <typename Bt>
__device__ __forceinline__ void load_dq_boxes(const BwdParams& params, const TensorMap& dq_map,
                                              const DkdvCounters& counters, int ring, int expected, unsigned sRound,
                                              unsigned long long (&barriers)[2][2], int (&box_of)[2][kBoxFields],
                                              long long (&box_at)[2][2]) {
    const int group = params.kv_group, kv_heads = params.heads / group;
    const int col_boxes = ceil_div(params.head_dim, Bt::kDqBoxColumns), row_boxes = ceil_div(params.seqlen_q, 64);
    const int per_slab = group * row_boxes * col_boxes;
    int b = 0;
    unsigned phase = 0;
    for (int slab = 0; slab < (ring ? counters.slabs : 0); ++slab) {
        if (blockIdx.x >= per_slab) {  // no box of this slab here: its part is done
            add_release(counters.slab_rounded(slab), kRoundingWarps);
            continue;
        }
        wait_at_least(counters.slab_done(slab), expected);
        fence_proxy_async_global();  // the slab's adds, seen here, before the TMA reads them
        for (int box = blockIdx.x; box < per_slab; box += gridDim.x) {
            int local = box;
            const int col0 = local % col_boxes * Bt::kDqBoxColumns;
            local /= col_boxes;
            const int row0 = local % row_boxes * 64, head = local / row_boxes;
            mbarrier_wait(smem_address(&barriers[b][1]), phase ^ 1);
            box_of[b][kBoxHead] = head;
            box_of[b][kBoxRow] = row0;
            box_of[b][kBoxCol] = col0;
            box_of[b][kBoxSlab] = slab;
            box_of[b][kBoxLast] = box + gridDim.x >= per_slab;
            box_at[b][0] = slab / kv_heads * params.dq_batch_stride +
                           (slab % kv_heads * group + head) * params.dq_head_stride + row0 * params.dq_row_stride + col0;
            box_at[b][1] = ((static_cast<long long>(row0) * ring + slab % ring) * group + head) *
                               params.head_dim + col0;
            const unsigned full = smem_address(&barriers[b][0]);
            mbarrier_arrive_expect_tx(full, Bt::kDqRoundBoxBytes);
            tma_load_4d(sRound + b * Bt::kDqRoundBoxBytes, dq_map, full, col0, row0, slab % ring * group + head, 0);
            if (++b == 2) b = 0, phase ^= 1;
        }
    }
    mbarrier_wait(smem_address(&barriers[b][1]), phase ^ 1);
    box_of[b][kBoxHead] = -1;
    mbarrier_arrive(smem_address(&barriers[b][0]));
}

// The rounding warps' part (t: their thread, 0..32·kRoundingWarps - 1): a box's rows in the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ r % 8), each thread one chunk of every
// eighth row, rounded to dq in 8-byte stores, and the box's floats in the ring set back to zero.
// Each warp counts the slab rounded after the block's last box of it; the last rounding warp of
// the launch to finish sets the counters back to zero, after every other count.
template <typename Bt>
__device__ __forceinline__ void round_dq_boxes(const BwdParams& params, const DkdvCounters& counters, int ring,
                                               unsigned sRound, unsigned long long (&barriers)[2][2],
                                               const int (&box_of)[2][kBoxFields], const long long (&box_at)[2][2],
                                               int t) {
    using Numeric = NumericTraits<typename Bt::Element>;
    using Storage = typename Bt::Storage;
    constexpr int kChunks = Bt::kDqBoxColumns / 4, kRowStep = 32 * kRoundingWarps / kChunks;
    // 8-byte stores where every row of dq allows them (its head dim is a multiple of 4: the map's).
    const bool vec = reinterpret_cast<unsigned long long>(params.dq) % 8 == 0 &&
                     (params.dq_row_stride | params.dq_head_stride | params.dq_batch_stride) % 4 == 0;
    const int ring_row_stride = ring * params.kv_group * params.head_dim;
    const int chunk = t % kChunks;
    int b = 0;
    unsigned phase = 0;
    for (;;) {
        mbarrier_wait(smem_address(&barriers[b][0]), phase);
        const int head = box_of[b][kBoxHead];
        if (head < 0) break;
        const int slab = box_of[b][kBoxSlab];
        const bool last = box_of[b][kBoxLast];
        if (box_of[b][kBoxCol] + 4 * chunk < params.head_dim) {
            Storage* dq = static_cast<Storage*>(params.dq) + box_at[b][0] + 4 * chunk;
            float* zeros = static_cast<float*>(params.dq_accum) + box_at[b][1] + 4 * chunk;
            const int rows = min(64, params.seqlen_q - box_of[b][kBoxRow]);
            for (int r = t / kChunks; r < rows; r += kRowStep) {
                const uint4 x = load_shared_16(sRound + b * Bt::kDqRoundBoxBytes + r * Bt::kDqBoxColumns * 4 +
                                               (chunk ^ r % 8) * 16);
                Storage* out = dq + r * params.dq_row_stride;
                const unsigned short e0 = Numeric::from_accum(__uint_as_float(x.x)),
                                     e1 = Numeric::from_accum(__uint_as_float(x.y)),
                                     e2 = Numeric::from_accum(__uint_as_float(x.z)),
                                     e3 = Numeric::from_accum(__uint_as_float(x.w));
                if (vec) {
                    *reinterpret_cast<uint2*>(out) = make_uint2(e0 | static_cast<unsigned>(e1) << 16,
                                                                e2 | static_cast<unsigned>(e3) << 16);
                } else {
                    out[0] = e0, out[1] = e1, out[2] = e2, out[3] = e3;
                }
                // The ring's rows are 16-byte aligned (head dim a multiple of 4, as the map's).
                *reinterpret_cast<uint4*>(zeros + r * ring_row_stride) = uint4{};
            }
        }
        mbarrier_arrive(smem_address(&barriers[b][1]));
        __syncwarp();  // the warp's zeros, before its lane 0's release counts them
        if (threadIdx.x % 32 == 0 && last) add_release(counters.slab_rounded(slab), 1);
        if (++b == 2) b = 0, phase ^= 1;
    }
    if (threadIdx.x % 32 == 0 && add_acq_rel(counters.rounders_done(), 1) == kRoundingWarps * gridDim.x - 1) {
        for (int slab = 0; slab < counters.slabs; ++slab) *counters.slab_done(slab) = *counters.slab_rounded(slab) = 0;
        *counters.rounders_done() = 0;
    }
}

// The Hopper TMA builds' warp-specialised, persistent form (WgmmaBwdDkdvTraits; no score modifiers,
// not varlen), FlashAttention-3's structure: Bt::kNThreads consumer threads (threads 0.., the
// one-block kernel's warps, with its steps) and a producer warpgroup after them, of which one warp
// works. Grid: (at most one block per SM). Work items are flash_bwd_dkdv_sm90_kernel's blocks in its
// launch order: `positions` key tiles (block-sparse: in key_block_order) fastest, then K/V heads,
// then batch; `items` in all. Block b makes claim b first, then the next unclaimed one
// (DkdvCounters' next_item: it counts the claims); claim c is item c, or block-sparse
// item_order[c] where the host gives an order (BlockMask.dkdv_item_order: columns far longer than
// the median's first; only with ring = 0, whose slabs need not complete in turn). With ring > 0
// the dQ adds go to a ring of `ring` slabs (params.dq_accum, zero at launch and left zero at
// exit; wait_for_slot), rounded into dq here (load_dq_boxes), slab by slab as each slab's items
// complete: no preprocess clear, no conversion launch. With ring = 0 they go to the whole
// workspace (dq_accum_offset's layout), cleared before and rounded after, as the one-block
// kernel's do.
//   producer: claims and decodes items, walks each item's query blocks (every head of its K/V
//     head's group, each from its launch position's query block, as the one-block kernel), asks
//     the TMA for K_j, V_j into their one buffer once the consumers are done with the last item's
//     (`kv` barriers), and for Q_i, dO_i into the free one of two buffers, whose row statistics its
//     lanes load (`q` barriers); it passes each item's indices and each buffer's query block in
//     shared memory, written before the arrival that completes the phase the consumers wait for.
//   consumers: wait for the item's ring slot where the producer found it in use (wait_for_slot),
//     then per step wait for the buffer, run dkdv_consumer_step, hand the buffer back; after an
//     item's last step hand K_j, V_j back, then write dK_j, dV_j out through the dQ stages while
//     the next item's tiles land; each warpgroup's storing thread counts the item complete in its
//     slab once its dQ adds have landed (count_item_complete).
//   the producer warpgroup's other warps: round dQ (load_dq_boxes) while the consumers work.
// A key block's loads no longer wait behind its own launch and the last one's stores, and its
// index loads stall only the producer.
template <typename Bt, bool kIsLocal, bool kIsBlockSparse>
__global__ void __launch_bounds__(Bt::kNThreads + 128, 1)
    flash_bwd_dkdv_ws_kernel(const BwdParams params, const __grid_constant__ BwdTensorMaps maps,
                             const __grid_constant__ KvTensorMaps kv_maps, const int positions, const int items,
                             int* const counter_buffer, const int ring, const int* const item_order) {
    static_assert(Bt::kWgmma && Bt::kOutSplit == 1 && Bt::kNThreads == 256, "the Hopper TMA builds' two warpgroups");
    static_assert(Bt::kBlockM % 32 == 0, "the producer's lanes load the row statistics");
    using Storage = typename Bt::Storage;
    static_assert(2 * Bt::kBlockN * Bt::kHeadDim * 2 <= 2 * Bt::kWarpgroups * Bt::kDqShareBytes,
                  "dK_j and dV_j are staged in the dQ stages");
    constexpr int kConsumerBarrier = 3;  // (1 and 2: add_dq_shares_wgmma's, one per warpgroup)
    constexpr int kStatsBarrier = 4;     // 4 and 5: Q_i buffer 0's and 1's row statistics
    // setmaxnreg's split of the registers a thread has at launch (launch_registers: 168): the
    // consumers' share is what their steps need without spilling, at d128 outside the local builds
    // 232 (224 spilled 36 bytes), and the producer keeps the rest (at 40 the block-sparse d64
    // builds spilled 60-68 bytes).
    constexpr int kConsumerRegs = Bt::kHeadDim == 128 && !kIsLocal ? 232 : 224;
    constexpr int kProducerRegs = 3 * launch_registers(Bt::kNThreads + 128) - 2 * kConsumerRegs;
    extern __shared__ __align__(16) unsigned char smem[];
    const DkdvTiles s = dkdv_tiles<Bt>(smem);
    // kv: K_j, V_j landed (the producer's two arrivals, before and after its slot lookup, and the
    // bytes) / read (one arrival per consumer thread); q[b]: Q_i and dO_i in buffer b landed (the
    // producer's arrival and the bytes) / read (one arrival per consumer thread). Buffer b's row
    // statistics and coordinates are handed over at named barrier kStatsBarrier + b: the
    // producer's lanes arrive once they have stored them, the consumers wait there at the start of
    // each step. Every thread that reads or writes what is handed over arrives itself, rather than
    // one lane after __syncwarp(): the same order under the PTX memory model, and the one
    // compute-sanitizer's racecheck sees (tools/sanitize.py).
    __shared__ alignas(8) unsigned long long kv_barriers[2], q_barriers[2][2];
    // Two items' indices, alternately (a slot is rewritten once the consumers are done with the
    // next item's steps, and so with this one's stores): first key (-1: no more items), K/V head,
    // batch index, steps, whether its ring slot was free. And each Q_i buffer's first query and head.
    enum { kKey0, kKvHead, kBatch, kSteps, kSlotReady, kItemFields };
    __shared__ int item_of[2][kItemFields], query_of[2][2];
    // box[b]: dQ box buffer b landed (the loading thread's arrival and the bytes) / rounded (one
    // arrival per rounding thread); box_of: its coordinates (load_dq_boxes).
    __shared__ alignas(8) unsigned long long box_barriers[2][2];
    __shared__ int box_of[2][kBoxFields];
    __shared__ long long box_at[2][2];
    if (threadIdx.x == 0) {
        mbarrier_init(smem_address(&kv_barriers[0]), 2);
        mbarrier_init(smem_address(&kv_barriers[1]), Bt::kNThreads);
        for (int b = 0; b < 2; ++b) {
            mbarrier_init(smem_address(&q_barriers[b][0]), 1);
            mbarrier_init(smem_address(&q_barriers[b][1]), Bt::kNThreads);
            mbarrier_init(smem_address(&box_barriers[b][0]), 1);
            mbarrier_init(smem_address(&box_barriers[b][1]), 32 * kRoundingWarps);
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the last block-wide barrier: the roles part here

    const int slabs = items / positions;
    const DkdvCounters counters{counter_buffer, slabs};
    if (threadIdx.x >= Bt::kNThreads) {
        setmaxnreg_dec<kProducerRegs>();
        // The other three warps round dQ: one thread of the second loads the boxes, the last two round them.
        if (threadIdx.x >= Bt::kNThreads + 64) {
            round_dq_boxes<Bt>(params, counters, ring, s.sRound, box_barriers, box_of, box_at,
                               threadIdx.x - Bt::kNThreads - 64);
            return;
        }
        if (threadIdx.x >= Bt::kNThreads + 32) {
            if (threadIdx.x == Bt::kNThreads + 32)
                load_dq_boxes<Bt>(params, maps.dq, counters, ring, Bt::kWarpgroups * positions, s.sRound, box_barriers,
                                  box_of, box_at);
            return;
        }
        const int lane = threadIdx.x % 32;
        const int kv_heads = params.heads / params.kv_group;
        // The empty barriers' phases start "completed" for the producer: it waits on the parity
        // before the current one (phase ^ 1), which a fresh mbarrier reports as done.
        unsigned kv_phase = 0, q_phase = 0;
        int q_buffer = 0, slot = 0;
        for (int claim = blockIdx.x;;) {
            const bool last = claim >= items;  // (no more items: the consumers are told to leave)
            const int item = !last && kIsBlockSparse && item_order ? item_order[claim] : claim;
            const int position = last ? 0 : item % positions, kv_head = last ? 0 : item / positions % kv_heads;
            const int batch_idx = last ? 0 : item / positions / kv_heads;
            const int first_head = kv_head * params.kv_group;
            const int key0 = last ? -1
                                  : key_tile<Bt::kBlockN, kIsBlockSparse>(params, batch_idx, first_head, position) *
                                        Bt::kBlockN;
            if (key0 < params.seqlen_k) {  // (the launch's rounding up to whole mask blocks: nothing)
                const int keys_valid = min(Bt::kBlockN, params.seqlen_k - key0);
                int steps = 0;
                for (int head_idx = first_head; key0 >= 0 && head_idx < first_head + params.kv_group; ++head_idx) {
                    const auto query_blocks = query_tiles<Bt::kBlockM, kIsLocal, kIsBlockSparse>(
                        params, batch_idx, head_idx, key0, keys_valid);
                    steps += query_blocks.end - query_blocks.begin;
                }
                // Whether the item's ring slot is free, looked up while the consumers finish the last item.
                const bool slot_free = lane != 0 || key0 < 0 || slot_ready(counters, item / positions, ring);
                mbarrier_wait(smem_address(&kv_barriers[1]), kv_phase ^ 1);
                if (lane == 0) {
                    item_of[slot][kKey0] = key0;
                    item_of[slot][kKvHead] = kv_head;
                    item_of[slot][kBatch] = batch_idx;
                    item_of[slot][kSteps] = steps;
                    const unsigned kv_full = smem_address(&kv_barriers[0]);
                    if (key0 < 0) {
                        mbarrier_arrive(kv_full);  // no more items: the consumers leave
                    } else {
                        mbarrier_arrive_expect_tx(kv_full, 2 * Bt::row_bytes(Bt::kBlockN) * Bt::kPanels);
#pragma unroll
                        for (int panel = 0; panel < Bt::kPanels; ++panel) {
                            const unsigned offset = panel * Bt::row_bytes(Bt::kBlockN);
                            tma_load_4d(s.sK + offset, kv_maps.k, kv_full, panel * kPanelColumns, key0, kv_head,
                                        batch_idx);
                            tma_load_4d(s.sV + offset, kv_maps.v, kv_full, panel * kPanelColumns, key0, kv_head,
                                        batch_idx);
                        }
                    }
                    item_of[slot][kSlotReady] = slot_free;
                    mbarrier_arrive(kv_full);  // (the second arrival, once the slot's state is written)
                }
                kv_phase ^= 1;
                slot ^= 1;
                if (key0 < 0) return;
                for (int head_idx = first_head; head_idx < first_head + params.kv_group; ++head_idx) {
                    const auto query_blocks = query_tiles<Bt::kBlockM, kIsLocal, kIsBlockSparse>(
                        params, batch_idx, head_idx, key0, keys_valid);
                    const int m_blocks = query_blocks.end - query_blocks.begin;
                    for (int step = 0, t = first_query_tile(query_blocks, position); step < m_blocks; ++step) {
                        const int q_row0 = query_blocks[t] * Bt::kBlockM;
                        t = t + 1 < query_blocks.end ? t + 1 : query_blocks.begin;
                        mbarrier_wait(smem_address(&q_barriers[q_buffer][1]), q_phase ^ 1);
                        // Q_i, dO_i first, then their statistics: two arrivals complete the phase.
                        const unsigned q_full = smem_address(&q_barriers[q_buffer][0]);
                        if (lane == 0) {
                            mbarrier_arrive_expect_tx(q_full, 2 * Bt::kQueryTileBytes);
#pragma unroll
                            for (int panel = 0; panel < Bt::kPanels; ++panel) {
                                const unsigned offset =
                                    q_buffer * Bt::kQueryTileBytes + panel * Bt::row_bytes(Bt::kBlockM);
                                tma_load_4d(s.sQ + offset, maps.q, q_full, panel * kPanelColumns, q_row0, head_idx,
                                            batch_idx);
                                tma_load_4d(s.sdO + offset, maps.dout, q_full, panel * kPanelColumns, q_row0, head_idx,
                                            batch_idx);
                            }
                        }
                        // Rows past seqlen_q get lse = +inf, so their P_ij are exactly 0. Every load
                        // is asked for before the first store: one round trip to L2 a step, not one
                        // per 32 rows.
                        const int rows_valid = min(Bt::kBlockM, params.seqlen_q - q_row0);
                        const long long row_stats = row_vector_offset(params, batch_idx, head_idx) + q_row0;
                        constexpr int kRowsPerLane = Bt::kBlockM / 32;
                        float lse2[kRowsPerLane], d[kRowsPerLane];
#pragma unroll
                        for (int r = 0; r < kRowsPerLane; ++r) {
                            const int i = lane + 32 * r;
                            lse2[r] = i < rows_valid ? static_cast<const float*>(params.lse_log2)[row_stats + i]
                                                     : pos_inf<float>();
                            d[r] = i < rows_valid ? static_cast<const float*>(params.d)[row_stats + i] : 0.f;
                        }
#pragma unroll
                        for (int r = 0; r < kRowsPerLane; ++r) {
                            s.sLse2[q_buffer * Bt::kBlockM + lane + 32 * r] = lse2[r];
                            s.sD[q_buffer * Bt::kBlockM + lane + 32 * r] = d[r];
                        }
                        if (lane == 0) {
                            query_of[q_buffer][0] = q_row0;
                            query_of[q_buffer][1] = head_idx;
                        }
                        // (the barrier's id as a constant: from a register it cost the producer's 40
                        // registers a 4-byte spill in a d128 build)
                        if (q_buffer)
                            named_barrier_arrive(kStatsBarrier + 1, Bt::kNThreads + 32);
                        else
                            named_barrier_arrive(kStatsBarrier, Bt::kNThreads + 32);
                        if (++q_buffer == 2) q_buffer = 0, q_phase ^= 1;
                    }
                }
            } else if (lane == 0 && ring) {
                add_release(counters.slab_done(item / positions), Bt::kWarpgroups);  // (no adds to wait for)
            }
            // The next item: every item makes one claim, and the launch's last sets the counter back
            // to zero, so that a launch replayed (a CUDA graph, a benchmark) starts as a fresh one does.
            int claims = 0;
            if (lane == 0 && !last) {
                claims = atomicAdd(counters.next_item(), 1);
                if (claims == items - 1) *counters.next_item() = 0;
            }
            claim = last ? claim : gridDim.x + __shfl_sync(0xffffffffu, claims, 0);
        }
    }

    setmaxnreg_inc<kConsumerRegs>();
    unsigned kv_phase = 0, q_phase = 0;
    int q_buffer = 0, slot = 0, dq_stage = 0;
    const int kv_heads = params.heads / params.kv_group;
    int pending = -1;  // the last item's slab, not yet counted complete (-1: none)
    for (;;) {
        mbarrier_wait(smem_address(&kv_barriers[0]), kv_phase);
        kv_phase ^= 1;
        const int* const item = item_of[slot];
        slot ^= 1;
        const int key0 = item[kKey0];
        if (key0 < 0) break;
        float dV[Bt::kMTiles][Bt::kOutTiles][4], dK[Bt::kMTiles][Bt::kOutTiles][4];
        zero(dV);
        zero(dK);
        const int steps = item[kSteps], slab = item[kKvHead] + item[kBatch] * kv_heads;
        // A query head's coordinate in the ring's map is ring_head + its index (wait_for_slot).
        const int ring_head = ring ? (slab % ring - item[kKvHead]) * params.kv_group : 0;
        if (!item[kSlotReady]) {  // (every consumer thread reads alike)
            if (threadIdx.x % 128 == 0) {
                count_item_complete(counters, pending);
                wait_for_slot(counters, slab, ring);
            }
            pending = -1;
        }
        for (int step = 0; step < steps; ++step) {
            mbarrier_wait(smem_address(&q_barriers[q_buffer][0]), q_phase);
            // The buffer's statistics are stored, and every consumer warp is done with the last
            // step's dS^T and dQ stage.
            named_barrier_sync(kStatsBarrier + q_buffer, Bt::kNThreads + 32);
            dkdv_consumer_step<Bt, kIsLocal>(params, maps, s, key0, min(Bt::kBlockN, params.seqlen_k - key0),
                                             query_of[q_buffer][0], ring_head + query_of[q_buffer][1],
                                             ring ? 0 : item[kBatch], q_buffer, dK, dV, dq_stage, kConsumerBarrier);
            mbarrier_arrive(smem_address(&q_barriers[q_buffer][1]));
            if (++q_buffer == 2) q_buffer = 0, q_phase ^= 1;
        }
        // The item's products are done with K_j, V_j; the dQ stages are free once the TMA has read them.
        mbarrier_arrive(smem_address(&kv_barriers[1]));
        // The last item's adds have landed once all but this item's newest bulk group have; then a
        // thread with no copy of its own in flight counts it (a release waits for the thread's
        // outstanding writes: in the storing thread it held the warpgroup, item after item).
        if (threadIdx.x % 128 == 0) {
            bulk_wait_group_read<0>();
            if (pending >= 0) {
                if (steps > 0)
                    bulk_wait_group<1>();
                else
                    bulk_wait_group<0>();
                fence_proxy_async_global();
            }
        }
        named_barrier_sync(kConsumerBarrier, Bt::kNThreads);
        if (threadIdx.x % 128 == 32 && pending >= 0) add_release(counters.slab_done(pending), 1);
        pending = ring ? slab : -1;
        // dK_j and dV_j go out through the dQ stages as whole row chunks, as the one-block kernel's
        // through K_j and V_j.
        const int warp_key0 = key0 + threadIdx.x / 32 * Bt::kWarpKeys;
        Storage* dk = static_cast<Storage*>(params.dk) + item[kBatch] * params.dk_batch_stride +
                      item[kKvHead] * params.dk_head_stride + warp_key0 * params.dk_row_stride;
        Storage* dv = static_cast<Storage*>(params.dv) + item[kBatch] * params.dv_batch_stride +
                      item[kKvHead] * params.dv_head_stride + warp_key0 * params.dv_row_stride;
        const Fragment f(threadIdx.x % 32);
        store_rows_staged<Bt, Bt::kBlockN>(dk, params.dk_row_stride, params.seqlen_k - warp_key0, params.head_dim, dK,
                                           s.sDq, warp_key0 - key0, f, threadIdx.x % 32,
                                           static_cast<float>(params.scale));
        store_rows_staged<Bt, Bt::kBlockN>(dv, params.dv_row_stride, params.seqlen_k - warp_key0, params.head_dim, dV,
                                           s.sDq + Bt::kBlockN * Bt::kHeadDim * 2, warp_key0 - key0, f,
                                           threadIdx.x % 32);
    }
    if (threadIdx.x % 128 == 0) count_item_complete(counters, pending);
}

}  // namespace cupyflash
