"""The traits tables: the tile shape of every kernel family, by dtype and padded head dim.

The C++ traits (kernels/*/traits.cuh) derive everything else from the template arguments chosen
here; where the host needs a derived number (shared-memory bytes), the compiled source carries a
static_assert that the host's number is the device's (specs.py), so the two cannot drift apart.
Every tile fits an A100's shared memory (H100-only tiles say so) and compiles without spills
(`python -m cupyflash check-kernels`); why each one was chosen: docs/performance.md.
"""

from __future__ import annotations

import dataclasses

# Padded head dims the kernels are specialised on; a head dim d runs on the smallest one >= d,
# the tail columns masked inside the kernel.
PADDED_HEAD_DIMS = (16, 32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = PADDED_HEAD_DIMS[-1]

# NumPy dtype name -> C++ element type of kernels/common/numeric.cuh.
ELEMENT_TYPES = {
    "float16": "cupyflash::Float16",
    "bfloat16": "cupyflash::BFloat16",
    "float32": "float",
    "float64": "double",
}
DTYPE_NAMES = tuple(ELEMENT_TYPES)
# float16 / bfloat16 run on tensor cores (sm80/, sm90/); float32 and float64 on the scalar kernels,
# and float32's forward also on sm80/'s mma.sync kernel as TF32 products (TF32_FORWARD_DTYPES) at
# head dims up to TF32_MAX_HEAD_DIM: above it, O's registers leave none for the key tile's own P V
# accumulator (which float32 accuracy needs: sm80/gemm.cuh), and 12 of the 28 builds spill.
# float64's forward and dK/dV kernel run on the same kernels' FP64 tensor-core (DMMA) products
# (F64_FORWARD_DTYPES) at head dims up to F64_MAX_HEAD_DIM: a warp's 16 rows of O take 128
# registers at d128, as its 16 keys' dK and dV over half the head dim.
TENSOR_CORE_DTYPES = ("float16", "bfloat16")
TF32_FORWARD_DTYPES = ("float32",)
TF32_MAX_HEAD_DIM = 128
F64_FORWARD_DTYPES = ("float64",)
F64_MAX_HEAD_DIM = 128

# float32's precisions, PyTorch's words (torch.set_float32_matmul_precision): "highest" computes on
# CUDA cores, "high" splits each operand into two TF32 numbers and takes three TF32 products
# ("3xTF32", float32 accuracy), "medium" one TF32 product. The kernels' Tf32<passes> element tags.
FLOAT32_PRECISIONS = ("highest", "high", "medium")
TF32_PASSES = {"high": 3, "medium": 1}

# Opt-in shared memory per block: an A100's (sm_80, the smallest of the tensor-core GPUs the tables
# are sized for) and an H100's (sm_90). The dK/dV table has larger tiles for the latter.
SMEM_A100 = 163 * 1024
SMEM_H100 = 227 * 1024

# The Hopper kernels (wgmma, TMA; built for sm_90a only: the "a" features are not in later
# architectures) exist at head dims padded to whole 64-column panels of the swizzled tiles.
WGMMA_HEAD_DIMS = (64, 128)
WGMMA_ARCH = "sm_90a"
WGMMA_COMPUTE_CAPABILITY = 90
TENSOR_CORE_MIN_CC = 80
# Builds that exist at these padded head dims: the forward's TMA builds, and the warp-specialised
# forward and dK/dV kernels.
TMA_FORWARD_HEAD_DIMS = (64, 128)
# ... and those of its builds with score modifiers (softcap, ALiBi, dropout): at d64 the build sat at
# the 168 registers its launch bounds allow and spilled 8 bytes once dropout's device seed came in.
TMA_SCORE_MOD_HEAD_DIMS = (128,)
WS_FORWARD_HEAD_DIMS = (64, 128)
WS_BACKWARD_HEAD_DIMS = (64, 128)

# KV-cache decoding: warps per block, and the most splits decode_combine_splits merges (lanes x 4).
DECODE_WARPS = 4
DECODE_MAX_SPLITS = 128


def itemsize(dtype_name: str) -> int:
    """Bytes of an element of dtype_name in device memory (the kernels' Storage)."""
    return {"float64": 8, "float32": 4}.get(dtype_name, 2)  # float16, bfloat16: 2


def accum_itemsize(dtype_name: str) -> int:
    """Bytes of the accumulator type: float32 for 16-bit and float32 inputs, float64 for float64."""
    return 8 if dtype_name == "float64" else 4


def padded_head_dim(head_dim: int) -> int:
    for d in PADDED_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


def row_stride(dtype_name: str, columns: int) -> int:
    """A scalar kernel's shared-memory row of `columns` Accum elements plus its 16-byte pad."""
    return columns + 16 // accum_itemsize(dtype_name)


# --------------------------------------------------------------------------- scalar (CUDA-core) kernels


@dataclasses.dataclass(frozen=True)
class TileShape:
    block_m: int  # B_r, query rows per thread block
    block_n: int  # B_c, key rows per iteration
    num_warps: int
    rows_per_thread: int
    min_blocks_per_sm: int  # occupancy target: caps registers at 64K / (threads * this)


def tile_shape(dtype_name: str, padded: int, varlen: bool = False, one_block: bool = False) -> TileShape:
    """The scalar forward's tile. varlen: the variable-length kernel, whose float64 d64 tile spills
    24 bytes at sm_90a in the 128 registers two blocks per SM leave (its sequence's lengths take
    registers): one block. one_block: likewise (the score-modifier kernels: 84-92 bytes with
    dropout's generator)."""
    varlen = varlen or one_block
    if accum_itemsize(dtype_name) == 4:
        if padded <= 64:
            return TileShape(64, 32, num_warps=4, rows_per_thread=4, min_blocks_per_sm=2)
        if padded <= 128:
            return TileShape(128, 32, num_warps=8, rows_per_thread=8, min_blocks_per_sm=1)
        return TileShape(64, 32, num_warps=8, rows_per_thread=4, min_blocks_per_sm=1)
    if padded <= 64:
        return TileShape(64, 32, num_warps=8, rows_per_thread=4, min_blocks_per_sm=1 if varlen else 2)
    if padded <= 128:
        return TileShape(64, 16, num_warps=4, rows_per_thread=4, min_blocks_per_sm=2)
    return TileShape(32, 16, num_warps=4, rows_per_thread=4, min_blocks_per_sm=1)


@dataclasses.dataclass(frozen=True)
class DkdvTileShape:
    block_m: int  # B_r, query rows per iteration
    block_n: int  # B_c, key rows per thread block
    num_warps: int
    rows_per_thread: int  # keys per thread (dK_j, dV_j rows in its registers)
    dq_rows_per_thread: int  # queries per thread in dQ_i += dS_ij K_j
    min_blocks_per_sm: int


def dkdv_tile_shape(dtype_name: str, padded: int, block_sparse: bool = False, varlen: bool = False) -> DkdvTileShape:
    """The scalar dK/dV kernel keeps K_j, V_j, Q_i, dO_i and three score-sized tiles in shared
    memory and dK_j, dV_j in registers, so its tiles are smaller than the forward's.
    block_sparse: at d64 the block-sparse kernel's tile walk does not fit in the 128 registers two
    blocks per SM leave (16-24 bytes of spills at sm_80 and sm_90a): one block per SM. The
    score-modifier kernel (its derivative tile beside P^T) takes the same (12 bytes otherwise).
    varlen: likewise for the float64 variable-length kernel (20 bytes at sm_90a with dropout)."""
    if accum_itemsize(dtype_name) == 4:
        if padded <= 64:
            dq_rows = 2 if padded < 32 else 4  # dQ's 32 column groups need head_dim >= 32
            return DkdvTileShape(32, 64, 8, 4, dq_rows, min_blocks_per_sm=1 if block_sparse else 2)
        if padded <= 128:
            return DkdvTileShape(32, 64, 8, 4, 4, min_blocks_per_sm=1)
        return DkdvTileShape(32, 32, 8, 4, 4, min_blocks_per_sm=1)
    if padded <= 64:
        return DkdvTileShape(16, 32, 8, 2, 1, min_blocks_per_sm=1 if varlen else 2)
    if padded <= 128:
        return DkdvTileShape(16, 32, 8, 2, 1, min_blocks_per_sm=1)
    return DkdvTileShape(16, 16, 8, 1, 1, min_blocks_per_sm=1)


def dq_tile_shape(dtype_name: str, padded: int, varlen: bool = False) -> TileShape:
    """The scalar deterministic dQ kernel: the forward's tile plus dO_i in shared memory. varlen:
    the variable-length kernel, whose float64 d64 tile spills 12 bytes at sm_80 with dropout's
    per-element keep test in the 128 registers two blocks per SM leave: one block."""
    if accum_itemsize(dtype_name) == 4:
        if padded <= 64:
            return TileShape(64, 32, num_warps=4, rows_per_thread=4, min_blocks_per_sm=2)
        if padded <= 128:
            return TileShape(64, 32, num_warps=8, rows_per_thread=4, min_blocks_per_sm=1)
        return TileShape(32, 32, num_warps=8, rows_per_thread=4, min_blocks_per_sm=1)
    if padded <= 64:
        return TileShape(32, 32, num_warps=8, rows_per_thread=2, min_blocks_per_sm=1 if varlen else 2)
    if padded <= 128:
        return TileShape(32, 16, num_warps=4, rows_per_thread=4, min_blocks_per_sm=1)
    return TileShape(16, 16, num_warps=4, rows_per_thread=2, min_blocks_per_sm=1)


# --------------------------------------------------------------------------- mma.sync (sm80/) kernels


@dataclasses.dataclass(frozen=True)
class TcTileShape:
    block_m: int  # B_r, queries per block
    block_n: int  # B_c, keys per iteration
    num_warps: int  # block_m / num_warps rows per warp, in whole m16 tiles
    min_blocks_per_sm: int


@dataclasses.dataclass(frozen=True)
class TcDkdvTileShape:
    block_m: int  # B_r, queries per iteration
    block_n: int  # B_c, keys per block
    num_warps: int
    warps_q: int  # the warps form a (num_warps / warps_q) x warps_q grid over keys x queries
    do_buffers: int  # dO_i double-buffered (2) or reloaded behind one more barrier (1)
    out_split: int  # column slices of dK, dV, dQ, one per block (bounds registers at large d)
    min_blocks_per_sm: int


@dataclasses.dataclass(frozen=True)
class TcBwdTileShape:
    block_m: int  # B_r, queries (per iteration in dK/dV, per block in dQ)
    block_n: int  # B_c, keys (per block in dK/dV, per iteration in dQ)
    num_warps: int
    out_split: int  # column slices of dK, dV, dQ, one per block (bounds registers at large d)
    min_blocks_per_sm: int


def tc_fwd_tile_shape(padded: int, block_sparse: bool = False, local: bool = False, score_mod: bool = False,
                      varlen: bool = False) -> TcTileShape:
    """block_sparse: the tile of the block-sparse instantiation, which keeps its tile list's state
    in registers beside the dense kernel's. At d128 the dense tile has none to spare (it spills
    16-24 bytes); (128, 32) is the fastest that fits (0.85x the dense tile's TFLOP/s, where
    (128, 64, 8 warps) gave 0.67x). At d64 and d256 the same holds for the block-sparse local
    (causal, windowed) kernel: 12 and 4 bytes of spills at sm_90a, and at d64 for the
    score-modifier kernel (24-36 bytes at sm_80 with dropout's generator)."""
    if padded <= 64:
        narrow = (block_sparse and local) or score_mod
        return TcTileShape(128, 64 if narrow else 128, num_warps=4, min_blocks_per_sm=1)
    if padded <= 128:
        # The variable-length kernel at d128 spills 56 bytes with 64 keys (sm_90a): its sequence's
        # lengths and band live in registers where the fixed-length kernel reads parameters.
        narrow = block_sparse or (varlen and padded > 96)
        return TcTileShape(128, 32 if narrow else 64, num_warps=4, min_blocks_per_sm=1)
    if padded <= 224:
        # The score-modifier kernel spills 32 bytes at d224 with 64 keys (sm_90a): 32.
        block_n = 32 if score_mod and padded > 192 else 64
        return TcTileShape(64, block_n, num_warps=4, min_blocks_per_sm=1)
    # (64, 64, 4) is 11% faster at 256 but spills with causal; (64, 32, 4) fits and is slower.
    # The block-sparse local kernel takes (128, 32, 8): with 64 keys it spills 4 bytes at sm_90a.
    # The score-modifier kernel likewise (8 bytes at sm_90a, bf16).
    if (block_sparse and local) or score_mod:
        return TcTileShape(128, 32, num_warps=8, min_blocks_per_sm=1)
    return TcTileShape(128, 64, num_warps=8, min_blocks_per_sm=1)


def tf32_fwd_tile_shape(padded: int, block_sparse: bool = False, local: bool = False, score_mod: bool = False,
                        varlen: bool = False) -> TcTileShape:
    """The float32 (TF32) forward's tile: 16 query rows a warp, as the split operands take twice
    the 16-bit kernels' registers, and float32 tiles twice their shared memory."""
    return TcTileShape(64, 32 if varlen else 64, num_warps=4, min_blocks_per_sm=1)


def f64_fwd_tile_shape(padded: int, block_sparse: bool = False, local: bool = False, score_mod: bool = False,
                       varlen: bool = False) -> TcTileShape:
    """The float64 (DMMA) forward's tile: 16 query rows a warp (O alone takes 128 registers at d128),
    and as many keys a step as fit beside O: 64 up to d64, 32 at d96, 16 at d128 (with 32, 40-128
    bytes of spills at sm_90a)."""
    block_n = 16 if padded > 96 else 32 if padded > 64 else 64
    return TcTileShape(64, block_n, num_warps=4, min_blocks_per_sm=1)


def f64_dkdv_tile_shape(padded: int, large_smem: bool = False, block_sparse: bool = False, score_mod: bool = False,
                        varlen: bool = False) -> TcDkdvTileShape:
    """The float64 (DMMA) dK/dV kernel's tile: 16 keys a warp, 32 queries a step, the warps in a
    grid of key ranges x 2 (each warp half the head dim's columns of dK and dV): 64 keys (8 warps)
    to d64, 32 keys (4 warps) above it, only on an H100's shared memory (families.dkdv_kernel).
    Above d64 the other warps' products and dQ's unroll their B loop by 4 (gemm_ab_ss_f64): fully
    unrolled, this grid spills 24-72 bytes."""
    if padded <= 16:  # too narrow to split dK's and dV's columns between two warps
        return TcDkdvTileShape(32, 64, num_warps=4, warps_q=1, do_buffers=2 if large_smem else 1, out_split=1,
                               min_blocks_per_sm=1)
    if padded <= 64:
        return TcDkdvTileShape(32, 64, num_warps=8, warps_q=2, do_buffers=2 if large_smem else 1, out_split=1,
                               min_blocks_per_sm=1)
    return TcDkdvTileShape(32, 32, num_warps=4, warps_q=2, do_buffers=2, out_split=1, min_blocks_per_sm=1)


def tc_dkdv_tile_shape(padded: int, large_smem: bool = False, block_sparse: bool = False, score_mod: bool = False,
                       varlen: bool = False) -> TcDkdvTileShape:
    """The dK/dV tile; large_smem: for a device with an H100's shared memory (dO double-buffered,
    and 64 queries per step above d192, dense only: the block-sparse kernel's tile list does not
    fit beside it in registers), else one that fits an A100. score_mod: smaller tiles from d32 on
    (the score modifiers' state and derivative do not fit beside the full tile in 255 registers:
    4-124 bytes of spills at sm_90a): half the queries per step at d32-64 and d256, and 64 keys
    per block at d96-128, where 32 queries per step still spill 12 bytes at sm_80."""
    do_buffers = 2 if large_smem else 1
    if padded <= 16:  # too narrow to split the columns of dK, dV between two warps
        return TcDkdvTileShape(128, 128, num_warps=8, warps_q=1, do_buffers=1, out_split=1, min_blocks_per_sm=1)
    if padded <= 64:
        block_m = 64 if score_mod else 128
        return TcDkdvTileShape(block_m, 128, num_warps=8, warps_q=2, do_buffers=do_buffers, out_split=1,
                               min_blocks_per_sm=1)
    if padded <= 128:
        block_n = 64 if score_mod else 128
        return TcDkdvTileShape(64, block_n, num_warps=8, warps_q=2, do_buffers=do_buffers, out_split=1,
                               min_blocks_per_sm=1)
    if padded <= 192:
        return TcDkdvTileShape(64, 64, num_warps=8, warps_q=2, do_buffers=1, out_split=1, min_blocks_per_sm=1)
    block_m = 64 if large_smem and not (block_sparse or score_mod) else 32
    if varlen:
        # The variable-length kernel spills 8 bytes at d256 (sm_90a): dK, dV in two column slices.
        # (d224 has no such split of its warps' columns: its problems take this kernel, see
        # families.dkdv_kernel.)
        return TcDkdvTileShape(32, 64, num_warps=8, warps_q=2, do_buffers=1, out_split=2, min_blocks_per_sm=1)
    return TcDkdvTileShape(block_m, 64, num_warps=8, warps_q=2, do_buffers=1, out_split=1, min_blocks_per_sm=1)


def tc_dq_tile_shape(padded: int) -> TcBwdTileShape:
    if padded <= 128:
        return TcBwdTileShape(128, 64, num_warps=8, out_split=1, min_blocks_per_sm=1)
    return TcBwdTileShape(64, 32, num_warps=4, out_split=2, min_blocks_per_sm=1)


# --------------------------------------------------------------------------- Hopper (sm90/) kernels

# The one-block forward: d64, one warpgroup of 64 rows, three blocks per SM, whose softmax and
# wgmma the SM can interleave (383-394 TFLOP/s on an H100; two warpgroups of 64 rows in one block,
# 303-305). d128: two warpgroups, 128 keys per step (430-434; one warpgroup at two blocks per SM,
# 379-394).
WGMMA_FWD_TILES = {
    64: TcTileShape(64, 128, num_warps=4, min_blocks_per_sm=3),
    128: TcTileShape(128, 128, num_warps=8, min_blocks_per_sm=1),
}
# The unmasked d128 TMA builds (dense or block-sparse, not local) take one warpgroup at two blocks
# per SM: with K_j, V_j coming by the TMA it is the faster tile there, one block's first copies and
# O_i store passing behind the other's steps (H100: dense 4-7% faster at s4096 and s16384,
# block-sparse 4-8% at densities 1 to 0.05). Their cp.async twins keep two warpgroups (with one
# they spill 24-32 bytes at 255 registers), and so do the local TMA builds: causal, one warpgroup
# took 1.02-1.04x the time of two (H200).
WGMMA_FWD_UNMASKED_TMA_TILES = {
    128: TcTileShape(64, 128, num_warps=4, min_blocks_per_sm=2),
}


def wgmma_fwd_tile_shape(padded: int, tma: bool = False, local: bool = False) -> TcTileShape:
    """Warpgroups of 64 query rows, 128 keys per step (one m64n128 wgmma per k-step of S); the
    block-sparse kernels take the same tiles. tma and not local: the unmasked TMA builds' tile
    (WGMMA_FWD_UNMASKED_TMA_TILES)."""
    if tma and not local and padded in WGMMA_FWD_UNMASKED_TMA_TILES:
        return WGMMA_FWD_UNMASKED_TMA_TILES[padded]
    return WGMMA_FWD_TILES[padded]


@dataclasses.dataclass(frozen=True)
class WsTileShape:
    block_m: int  # B_r, queries per tile: 64 per consumer warpgroup
    block_n: int  # B_c, keys per step
    stages: int  # K_j, V_j buffers each

    @property
    def num_warps(self) -> int:
        return 4 * (self.block_m // 64 + 1)


# The warp-specialised forward: two consumer warpgroups; at d128 two stages fill the shared memory
# with both Q_i buffers (193 KiB). d64 (98 KiB) measured three and four stages no faster (H200).
WGMMA_FWD_WS_TILES = {
    64: WsTileShape(128, 128, 2),
    128: WsTileShape(128, 128, 2),
}


def wgmma_dkdv_tile_shape(padded: int, score_mod: bool = False) -> TcDkdvTileShape:
    """The Hopper dK/dV kernels: 128 keys per block (two warpgroups); queries per step: 128 at d64
    (S^T and dP^T 64 registers each beside dK_j, dV_j's 64), 64 at d128 (dK_j, dV_j take 128).
    score_mod (the variable-length kernel included): 64 at d64 too; with 128 the score-modifier
    builds sit at 255 registers and the variable-length one spills 8 bytes (sm_90a)."""
    block_m = 128 if padded == 64 and not score_mod else 64
    return TcDkdvTileShape(block_m, 128, num_warps=8, warps_q=1, do_buffers=2, out_split=1, min_blocks_per_sm=1)


# --------------------------------------------------------------------------- decode


def decode_rows(dtype_name: str, padded: int) -> int:
    """The most packed rows per block of the CUDA-core decode kernel: each lane holds rows x
    ceil(d / 32) output accumulators, kept to 64 32-bit registers."""
    words = accum_itemsize(dtype_name) // 4 * -(-padded // 32)
    return min(16, 64 // words)


# Packed rows per block the CUDA-core decode kernel is built for.
DECODE_ROW_BLOCKS = (4, 8, 16)


def decode_row_block(dtype_name: str, padded: int, rows: int) -> int:
    """Packed rows per block of the CUDA-core decode kernel for `rows` rows a K/V head (seqlen_q x
    the GQA group): the fewest of DECODE_ROW_BLOCKS that hold them, at most decode_rows. Unused
    rows cost registers, which set the blocks an SM holds (float32 d128: 144 at 4 rows, 208 at 16)."""
    most = decode_rows(dtype_name, padded)
    return min(most, next((b for b in DECODE_ROW_BLOCKS if b >= rows), most))
