"""The one list of kernel instantiations, and the host's mirror of the kernels' argument layouts.

Pure Python (no CuPy import): the NumPy tiled reference follows the same block schedule, and
`check-kernels` compiles every entry on machines without a GPU.

The C++ traits (kernels/flash_fwd_traits.cuh, flash_bwd_traits.cuh) derive everything from the template arguments chosen
here. Where the host must know a derived number (shared-memory bytes, the FwdParams / BwdParams layouts), the
compiled source carries a static_assert that the host's number is the device's, so the two cannot
drift apart silently.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re

import numpy

# Padded head dims the kernels are specialised on; a head dim d runs on the smallest one >= d,
# the tail columns masked inside the kernel.
PADDED_HEAD_DIMS = (16, 32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = PADDED_HEAD_DIMS[-1]

# NumPy dtype name -> C++ element type of kernels/numeric.cuh.
ELEMENT_TYPES = {
    "float16": "cupyflash::Float16",
    "bfloat16": "cupyflash::BFloat16",
    "float32": "float",
    "float64": "double",
}
DTYPE_NAMES = tuple(ELEMENT_TYPES)


def accum_itemsize(dtype_name: str) -> int:
    """Bytes of the accumulator type: float32 for 16-bit and float32 inputs, float64 for float64."""
    return 8 if dtype_name == "float64" else 4


@dataclasses.dataclass(frozen=True)
class TileShape:
    block_m: int  # B_r, query rows per thread block
    block_n: int  # B_c, key rows per iteration
    num_warps: int
    rows_per_thread: int
    min_blocks_per_sm: int  # occupancy target: caps registers at 64K / (threads * this)


# The traits table: tile shape by (accumulator bytes, padded head dim). The fastest shapes of a
# sweep on an H200 (benchmarks/NOTES.md) among those whose shared memory fits an A100's 163 KiB
# opt-in and whose registers do not spill (see `python -m cupyflash check-kernels`).
def tile_shape(dtype_name: str, padded_head_dim: int, varlen: bool = False, one_block: bool = False) -> TileShape:
    """varlen: the variable-length kernel, whose float64 d64 tile spills 24 bytes at sm_90a in the
    128 registers two blocks per SM leave (its sequence's lengths take registers): one block.
    one_block: likewise (the score-modifier kernels: 84-92 bytes with dropout's generator)."""
    varlen = varlen or one_block
    if accum_itemsize(dtype_name) == 4:
        if padded_head_dim <= 64:
            return TileShape(64, 32, num_warps=4, rows_per_thread=4, min_blocks_per_sm=2)
        if padded_head_dim <= 128:
            return TileShape(128, 32, num_warps=8, rows_per_thread=8, min_blocks_per_sm=1)
        return TileShape(64, 32, num_warps=8, rows_per_thread=4, min_blocks_per_sm=1)
    if padded_head_dim <= 64:
        return TileShape(64, 32, num_warps=8, rows_per_thread=4, min_blocks_per_sm=1 if varlen else 2)
    if padded_head_dim <= 128:
        return TileShape(64, 16, num_warps=4, rows_per_thread=4, min_blocks_per_sm=2)
    return TileShape(32, 16, num_warps=4, rows_per_thread=4, min_blocks_per_sm=1)


def padded_head_dim(head_dim: int) -> int:
    for d in PADDED_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


class _TiledKernel:
    """What the tiled kernels share. Their traits' template arguments are the element type, the
    padded head dim and the tile shape's fields in declaration order; the kernel's are the traits,
    local, block_sparse, then score_mod, varlen and tma (the Hopper kernels' TMA builds) up to the last
    one set. local: the instantiation that
    skips and masks outside a band of keys (causal, sliding-window attention, both); block_sparse:
    the one that walks a block mask's lists (the dense one compiles to the same code as before
    block-sparse attention existed); score_mod: softcap and ALiBi on the scores (always with local,
    whose band also covers an unbanded problem); varlen: variable-length batches (always with local
    and score_mod, dense: one instantiation serves every varlen problem). Subclasses give
    source_file, kernel_name, traits_name, tile, smem_bytes, grid and block_sparse, score_mod and
    varlen fields."""

    per_kv_head = False  # grid over query heads (True: over K/V heads, the dK/dV kernels)

    @functools.cached_property
    def num_threads(self) -> int:
        return 32 * self.tile.num_warps

    @functools.cached_property
    def traits(self) -> str:
        tile_args = ", ".join(str(x) for x in dataclasses.astuple(self.tile))
        return f"cupyflash::{self.traits_name}<{ELEMENT_TYPES[self.dtype_name]}, {self.head_dim}, {tile_args}>"

    @functools.cached_property
    def name_expression(self) -> str:
        # The kernel's flag parameters past the first two default to false: those left unset are left out.
        flags = [self.local, self.block_sparse, self.score_mod, self.varlen, getattr(self, "tma", False)]
        while len(flags) > 2 and not flags[-1]:
            flags.pop()
        flags = ", ".join("true" if flag else "false" for flag in flags)
        return f"cupyflash::{self.kernel_name}<{self.traits}, {flags}>"

    def host_checks(self) -> str:
        """A static_assert that the traits' shared-memory bytes are the host's smem_bytes."""
        return (
            f"static_assert({self.traits}::kSmemBytes == {self.smem_bytes}, "
            f'"cupyflash/_instantiations.py and {self.traits_name} disagree on shared memory");\n'
        )


@dataclasses.dataclass(frozen=True)
class FwdKernel(_TiledKernel):
    """One instantiation of kernels/flash_fwd.cu's flash_fwd_kernel."""

    dtype_name: str
    head_dim: int  # padded
    local: bool
    tile_override: TileShape | None = None  # for tuning experiments; None: the traits table
    block_sparse: bool = False
    score_mod: bool = False
    varlen: bool = False

    source_file = "flash_fwd.cu"
    kernel_name = "flash_fwd_kernel"
    traits_name = "FwdTraits"

    @functools.cached_property
    def tile(self) -> TileShape:
        return self.tile_override or tile_shape(self.dtype_name, self.head_dim, self.varlen, self.score_mod)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors FwdTraits::kSmemBytes (checked by the static_assert in host_checks()).
        t = self.tile
        stride, p_stride = _row_stride(self.dtype_name, self.head_dim), _row_stride(self.dtype_name, t.block_n)
        elements = (t.block_m + 2 * t.block_n) * stride + t.block_m * p_stride
        return elements * accum_itemsize(self.dtype_name)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int = 0) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.tile.block_m), heads, batch)


def _row_stride(dtype_name: str, columns: int) -> int:
    """A shared-memory row of `columns` Accum elements plus the kernels' 16-byte pad."""
    return columns + 16 // accum_itemsize(dtype_name)


@functools.cache  # on every call's launch path: one object per instantiation, its properties cached
def fwd_kernel(
    dtype_name: str, head_dim: int, local: bool, tensor_cores: bool = False, block_sparse: bool = False,
    score_mod: bool = False, varlen: bool = False, wgmma: bool = False, tma: bool = False, ws: bool = False,
):
    """The forward kernel for a problem: TcFwdKernel with tensor_cores (16-bit dtypes only), or
    WgmmaFwdKernel with wgmma too (Hopper; head dims padded to WGMMA_HEAD_DIMS), else FwdKernel; its
    local instantiation for causal or windowed attention, its block-sparse one with block_sparse,
    its score-modifier one (softcap, ALiBi; local) with score_mod, its variable-length one (local,
    score modifiers, dense) with varlen. tma (with wgmma): the TMA build where one exists (no score
    modifiers, not varlen, at TMA_FORWARD_HEAD_DIMS); the launch falls back to the cp.async build
    for arrays a tensor map cannot describe. ws (with tma): the warp-specialised kernel
    (WgmmaFwdWsKernel) where it serves the problem (unmasked, at WS_FORWARD_HEAD_DIMS)."""
    _check_tensor_core_dtype(dtype_name, tensor_cores or wgmma)
    if wgmma and padded_head_dim(head_dim) not in WGMMA_HEAD_DIMS:
        raise ValueError(f"the Hopper forward kernel takes head dims padded to {WGMMA_HEAD_DIMS}, not {head_dim}")
    kind = WgmmaFwdKernel if wgmma else TcFwdKernel if tensor_cores else FwdKernel
    local, sparse, mod, var = _variant_flags(local, block_sparse, score_mod, varlen)
    padded = padded_head_dim(head_dim)
    if wgmma and tma and not (mod or var) and padded in TMA_FORWARD_HEAD_DIMS:
        if ws and not local and padded in WS_FORWARD_HEAD_DIMS:
            return WgmmaFwdWsKernel(dtype_name, padded, False, block_sparse=sparse)
        return WgmmaFwdKernel(dtype_name, padded, local, block_sparse=sparse, tma=True)
    return kind(dtype_name, padded, local, block_sparse=sparse, score_mod=mod, varlen=var)


@functools.cache
def without_tma(kernel):
    """A TMA build's twin without TMA (WgmmaFwdKernel: cp.async copies; WgmmaBwdDkdvKernel: cp.async
    copies and atomic dQ adds, one block per key block): the same instantiation otherwise."""
    if getattr(kernel, "ws", False):
        return dataclasses.replace(kernel, tma=False, ws=False)
    return dataclasses.replace(kernel, tma=False)


def _variant_flags(local, block_sparse, score_mod, varlen) -> tuple:
    """(local, block_sparse=, score_mod=, varlen=) of the instantiation that serves a problem: the
    score modifiers' includes local, the variable-length one both, and it has no block-sparse form."""
    if varlen and block_sparse:
        raise ValueError("variable-length batches have no block-sparse kernels")
    local, mod = bool(local or score_mod or varlen), bool(score_mod or varlen)
    return local, bool(block_sparse), mod, bool(varlen)


def _variants():
    """(local, block_sparse, score_mod, varlen) of every instantiation of a tiled kernel: score_mod
    only with local, which keeps the score-modifier builds at half the others'; varlen once, with
    local and score_mod (one kernel serves every variable-length problem)."""
    fixed = [(local, sparse, mod, False) for local in (False, True) for sparse in (False, True)
             for mod in ((False, True) if local else (False,))]
    return fixed + [(True, False, True, True)]


def _check_tensor_core_dtype(dtype_name: str, tensor_cores: bool) -> None:
    if tensor_cores and dtype_name not in ("float16", "bfloat16"):
        raise ValueError(f"the tensor-core kernels take float16 or bfloat16, not {dtype_name}")


def all_fwd_kernels() -> list[FwdKernel]:
    return [
        FwdKernel(dtype_name, d, local, block_sparse=sparse, score_mod=mod, varlen=var)
        for dtype_name in DTYPE_NAMES
        for d in PADDED_HEAD_DIMS
        for local, sparse, mod, var in _variants()
    ]


@dataclasses.dataclass(frozen=True)
class DropoutMaskKernel:
    """kernels/flash_fwd.cu's flash_dropout_mask_kernel: dropout's keep mask as bytes, one thread per
    (query, key), for `cupyflash.dropout_mask`."""

    num_threads: int = 256

    source_file = "flash_fwd.cu"
    smem_bytes = 0
    dtype_name = "uint8"
    per_kv_head = False

    @functools.cached_property
    def name_expression(self) -> str:
        return f"cupyflash::flash_dropout_mask_kernel<{self.num_threads}>"

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q * seqlen_k / self.num_threads), heads, batch)

    def host_checks(self) -> str:
        return ""


# --------------------------------------------------------------------------- backward


@dataclasses.dataclass(frozen=True)
class DkdvTileShape:
    block_m: int  # B_r, query rows per iteration
    block_n: int  # B_c, key rows per thread block
    num_warps: int
    rows_per_thread: int  # keys per thread (dK_j, dV_j rows in its registers)
    dq_rows_per_thread: int  # queries per thread in dQ_i += dS_ij K_j
    min_blocks_per_sm: int


# The dK/dV kernel keeps K_j, V_j, Q_i, dO_i and three score-sized tiles in shared memory and
# dK_j, dV_j in registers, so its tiles are smaller than the forward's. Chosen to fit an A100's
# 163 KiB without spills (`python -m cupyflash check-kernels`); not yet tuned by a sweep.
def dkdv_tile_shape(dtype_name: str, padded_head_dim: int, block_sparse: bool = False,
                    varlen: bool = False) -> DkdvTileShape:
    """block_sparse: at d64 the block-sparse kernel's tile walk does not fit in the 128 registers
    two blocks per SM leave (16-24 bytes of spills at sm_80 and sm_90a): one block per SM. The
    score-modifier kernel (its derivative tile beside P^T) takes the same (12 bytes otherwise).
    varlen: likewise for the float64 variable-length kernel (20 bytes at sm_90a with dropout)."""
    if accum_itemsize(dtype_name) == 4:
        if padded_head_dim <= 64:
            dq_rows = 2 if padded_head_dim < 32 else 4  # dQ's 32 column groups need head_dim >= 32
            return DkdvTileShape(32, 64, 8, 4, dq_rows, min_blocks_per_sm=1 if block_sparse else 2)
        if padded_head_dim <= 128:
            return DkdvTileShape(32, 64, 8, 4, 4, min_blocks_per_sm=1)
        return DkdvTileShape(32, 32, 8, 4, 4, min_blocks_per_sm=1)
    if padded_head_dim <= 64:
        return DkdvTileShape(16, 32, 8, 2, 1, min_blocks_per_sm=1 if varlen else 2)
    if padded_head_dim <= 128:
        return DkdvTileShape(16, 32, 8, 2, 1, min_blocks_per_sm=1)
    return DkdvTileShape(16, 16, 8, 1, 1, min_blocks_per_sm=1)


# The deterministic dQ kernel: the forward's tile plus dO_i in shared memory.
def dq_tile_shape(dtype_name: str, padded_head_dim: int, varlen: bool = False) -> TileShape:
    """varlen: the variable-length kernel, whose float64 d64 tile spills 12 bytes at sm_80 with
    dropout's per-element keep test in the 128 registers two blocks per SM leave: one block."""
    if accum_itemsize(dtype_name) == 4:
        if padded_head_dim <= 64:
            return TileShape(64, 32, num_warps=4, rows_per_thread=4, min_blocks_per_sm=2)
        if padded_head_dim <= 128:
            return TileShape(64, 32, num_warps=8, rows_per_thread=4, min_blocks_per_sm=1)
        return TileShape(32, 32, num_warps=8, rows_per_thread=4, min_blocks_per_sm=1)
    if padded_head_dim <= 64:
        return TileShape(32, 32, num_warps=8, rows_per_thread=2, min_blocks_per_sm=1 if varlen else 2)
    if padded_head_dim <= 128:
        return TileShape(32, 16, num_warps=4, rows_per_thread=4, min_blocks_per_sm=1)
    return TileShape(16, 16, num_warps=4, rows_per_thread=2, min_blocks_per_sm=1)


@dataclasses.dataclass(frozen=True)
class BwdDkdvKernel(_TiledKernel):
    """kernels/flash_bwd.cu's flash_bwd_dkdv_kernel: one block per key block."""

    dtype_name: str
    head_dim: int  # padded
    local: bool
    block_sparse: bool = False
    score_mod: bool = False
    varlen: bool = False

    source_file = "flash_bwd.cu"
    kernel_name = "flash_bwd_dkdv_kernel"
    traits_name = "BwdDkdvTraits"
    per_kv_head = True  # its grid's heads are K/V heads; each block walks its group's query heads

    @functools.cached_property
    def tile(self) -> DkdvTileShape:
        return dkdv_tile_shape(self.dtype_name, self.head_dim, self.block_sparse or self.score_mod, self.varlen)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors BwdDkdvTraits::kSmemBytes: K_j, V_j, Q_i, dO_i, P^T, dS^T, dS, lse_i, D_i.
        t, name = self.tile, self.dtype_name
        stride = _row_stride(name, self.head_dim)
        elements = (
            2 * (t.block_n + t.block_m) * stride
            + 2 * t.block_n * _row_stride(name, t.block_m)
            + t.block_m * _row_stride(name, t.block_n)
            + 2 * t.block_m
        )
        return elements * accum_itemsize(name)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_k / self.tile.block_n), heads, batch)


@dataclasses.dataclass(frozen=True)
class BwdDqKernel(_TiledKernel):
    """kernels/flash_bwd.cu's flash_bwd_dq_kernel (deterministic mode): one block per query block."""

    dtype_name: str
    head_dim: int  # padded
    local: bool
    block_sparse: bool = False
    score_mod: bool = False
    varlen: bool = False

    source_file = "flash_bwd.cu"
    kernel_name = "flash_bwd_dq_kernel"
    traits_name = "BwdDqTraits"

    @functools.cached_property
    def tile(self) -> TileShape:
        return dq_tile_shape(self.dtype_name, self.head_dim, self.varlen)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors BwdDqTraits::kSmemBytes: Q_i, dO_i, K_j, V_j, dS_ij.
        t, name = self.tile, self.dtype_name
        elements = 2 * (t.block_m + t.block_n) * _row_stride(name, self.head_dim)
        elements += t.block_m * _row_stride(name, t.block_n)
        return elements * accum_itemsize(name)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.tile.block_m), heads, batch)


@dataclasses.dataclass(frozen=True)
class BwdRowKernel:
    """A row kernel of flash_bwd.cu (a group of lanes per query row, its RowGroups): "preprocess"
    (D_i, lse_i in log2 units) or "convert_dq" (the dQ workspace rounded to the input dtype)."""

    step: str
    dtype_name: str
    # kRowsPerBlock (8 per warp: flash_bwd.cu's RowGroups) and kHeadsFastest (the launch takes the
    # heads of a block of rows in turn, so blocks in flight read neighbouring parts of the same
    # rows of O, dO and the workspace): on an H200 (benchmarks/row_kernels.py; NOTES session 30)
    # heads fastest took 4.5 us off the preprocess and 2.5 off the conversion at d64 s16384 in each
    # of three runs (about 5% and 4%), and was within noise elsewhere; 64 or 128 rows were no faster.
    # Heads fastest puts the row blocks on the grid's y axis: `bwd_row_kernel` takes it where they fit.
    rows_per_block: int = 32
    heads_fastest: bool = True

    source_file = "flash_bwd.cu"
    num_threads = 128  # kRowThreads
    smem_bytes = 0
    per_kv_head = False

    @functools.cached_property
    def name_expression(self) -> str:
        return (f"cupyflash::flash_bwd_{self.step}_kernel<{ELEMENT_TYPES[self.dtype_name]}, {self.rows_per_block}, "
                f"{str(self.heads_fastest).lower()}>")

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int = 0) -> tuple[int, int, int]:
        if self.heads_fastest:
            return (heads, math.ceil(seqlen_q / self.rows_per_block), batch)
        return (math.ceil(seqlen_q / self.rows_per_block), heads, batch)

    def host_checks(self) -> str:
        # Fewer threads than kRowThreads would leave rows unread with no launch error.
        return (f"static_assert(cupyflash::kRowThreads == {self.num_threads}, "
                f'"cupyflash/_instantiations.py and flash_bwd.cu disagree on the row kernels\' threads");\n')


BWD_ROW_STEPS = ("preprocess", "convert_dq")
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (and z)


def bwd_row_kernel(step: str, dtype_name: str, seqlen_q: int) -> BwdRowKernel:
    """The row kernel for `step`: heads fastest unless seqlen_q's blocks of rows overflow gridDim.y
    (more than about two million queries a sequence)."""
    kernel = BwdRowKernel(step, dtype_name)
    if math.ceil(seqlen_q / kernel.rows_per_block) > MAX_GRID_Y:
        return dataclasses.replace(kernel, heads_fastest=False)
    return kernel


@functools.cache  # as fwd_kernel
def bwd_kernels(
    dtype_name: str, head_dim: int, local: bool, tensor_cores: bool = False, large_smem: bool = False,
    block_sparse: bool = False, score_mod: bool = False, varlen: bool = False, wgmma: bool = False,
    tma: bool = False, ws: bool = False,
):
    """(dK/dV kernel, deterministic dQ kernel) for a problem; with tensor_cores (16-bit dtypes
    only) the flash_bwd_tc.cu pair, which shares flash_bwd.cu's row kernels, its dK/dV tile for
    an H100's shared memory with large_smem (`tc_dkdv_tile_shape`); with wgmma too the Hopper
    dK/dV kernel (head dims padded to WGMMA_HEAD_DIMS) beside the mma.sync dQ kernel, and with
    tma its TMA build where one exists (no score modifiers, not varlen): the launch falls back to
    the build without TMA where the dQ workspace, Q or dO has no tensor map, and in deterministic mode;
    with ws too, that build's warp-specialised form at WS_BACKWARD_HEAD_DIMS; block_sparse,
    score_mod and varlen as `fwd_kernel`."""
    _check_tensor_core_dtype(dtype_name, tensor_cores or wgmma)
    d = padded_head_dim(head_dim)
    if wgmma and d not in WGMMA_HEAD_DIMS:
        raise ValueError(f"the Hopper backward kernel takes head dims padded to {WGMMA_HEAD_DIMS}, not {head_dim}")
    local, sparse, mod, var = _variant_flags(local, block_sparse, score_mod, varlen)
    if wgmma:
        tma = tma and not (mod or var)
        return (WgmmaBwdDkdvKernel(dtype_name, d, local, block_sparse=sparse, score_mod=mod, varlen=var,
                                   tma=tma, ws=tma and ws and d in WS_BACKWARD_HEAD_DIMS),
                TcBwdDqKernel(dtype_name, d, local, block_sparse=sparse, score_mod=mod, varlen=var))
    if tensor_cores and var and d == 224:
        d = 256  # see tc_dkdv_tile_shape
    if tensor_cores:
        return (TcBwdDkdvKernel(dtype_name, d, local, large_smem=large_smem, block_sparse=sparse, score_mod=mod,
                                varlen=var),
                TcBwdDqKernel(dtype_name, d, local, block_sparse=sparse, score_mod=mod, varlen=var))
    return (BwdDkdvKernel(dtype_name, d, local, block_sparse=sparse, score_mod=mod, varlen=var),
            BwdDqKernel(dtype_name, d, local, block_sparse=sparse, score_mod=mod, varlen=var))


@functools.cache  # on every block-sparse call's path; it depends only on these two values
def block_mask_granularity(dtype_name: str, head_dim: int) -> tuple[int, int]:
    """(queries, keys): what a block mask's block size must be a multiple of for this dtype and
    head dim, the largest tile of every kernel that may run it (scalar and tensor-core, either
    shared-memory table), so that each kernel tile lies in one mask block, whatever the GPU."""
    d = padded_head_dim(head_dim)
    kernels = []
    for local, _, mod, varlen in _variants():
        if varlen:  # no block-sparse form
            continue
        kernels += [fwd_kernel(dtype_name, d, local, block_sparse=True, score_mod=mod),
                    *bwd_kernels(dtype_name, d, local, block_sparse=True, score_mod=mod)]
        if dtype_name in TENSOR_CORE_DTYPES:
            kernels += [fwd_kernel(dtype_name, d, local, True, True, mod),
                        *bwd_kernels(dtype_name, d, local, True, block_sparse=True, score_mod=mod)]
            kernels += [bwd_kernels(dtype_name, d, local, True, large_smem=True, block_sparse=True, score_mod=mod)[0]]
            if d in WGMMA_HEAD_DIMS:
                kernels += [fwd_kernel(dtype_name, d, local, True, True, mod, wgmma=True),
                            bwd_kernels(dtype_name, d, local, True, block_sparse=True, score_mod=mod, wgmma=True)[0]]
    return max(k.tile.block_m for k in kernels), max(k.tile.block_n for k in kernels)


def all_bwd_kernels() -> list:
    kernels = [BwdRowKernel(step, dtype_name, heads_fastest=fastest)
               for dtype_name in DTYPE_NAMES for step in BWD_ROW_STEPS for fastest in (True, False)]
    for dtype_name in DTYPE_NAMES:
        for d in PADDED_HEAD_DIMS:
            for local, sparse, mod, var in _variants():
                kernels += list(bwd_kernels(dtype_name, d, local, block_sparse=sparse, score_mod=mod, varlen=var))
    return kernels


def all_kernels(arch: str | None = None) -> list:
    """Every instantiation: what `check-kernels` and the CPU compile tests build; with arch
    (e.g. "sm_80", "sm_90a"), those that can run on it (`runs_on`)."""
    kernels = (all_fwd_kernels() + [DropoutMaskKernel()] + all_bwd_kernels() + all_tc_kernels()
               + all_wgmma_kernels() + all_decode_kernels())
    return kernels if arch is None else [k for k in kernels if runs_on(k, arch)]


def runs_on(kernel, arch: str) -> bool:
    """Whether `kernel` can be chosen on a GPU of this architecture: the dK/dV tiles for an
    H100's shared memory (large_smem) only on sm_90 and newer, the GPUs that have it; the Hopper
    kernels (wgmma, built for sm_90a) only on sm_90a."""
    version = re.fullmatch(r"sm_(\d+)a?", arch)
    if getattr(kernel, "arch", None) is not None:
        return arch == kernel.arch
    return not getattr(kernel, "large_smem", False) or (version is not None and int(version.group(1)) >= 90)


# --------------------------------------------------------------------------- tensor cores

# float16 / bfloat16 run on tensor cores (mma.sync, sm_80 and newer): kernels/flash_fwd_tc.cu and
# flash_bwd_tc.cu. float32 and float64 always take the scalar kernels above, which stay exact.
TENSOR_CORE_DTYPES = ("float16", "bfloat16")
TENSOR_CORE_MIN_CC = 80
_TC_PAD = 8  # elements of padding per shared-memory row (TcWarpLayout::kPad)


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


# The traits table of the tensor-core kernels, by padded head dim. Every tile fits an A100's
# 163 KiB of shared memory and compiles without spills (`python -m cupyflash check-kernels`).
def tc_fwd_tile_shape(
    padded_head_dim: int, block_sparse: bool = False, local: bool = False, score_mod: bool = False,
    varlen: bool = False,
) -> TcTileShape:
    """block_sparse: the tile of the block-sparse instantiation, which keeps its tile list's
    state in registers beside the dense kernel's. At d128 the dense tile has none to spare (it
    spills 16-24 bytes); (128, 32) is the fastest that fits (benchmarks/tune_sparse.py: 0.85x the
    dense tile's TFLOP/s, where (128, 64, 8 warps) gave 0.67x). At d64 and d256 the same holds
    for the block-sparse local (causal, windowed) kernel: 12 and 4 bytes of spills at sm_90a, and
    at d64 for the score-modifier kernel (24-36 bytes at sm_80 with dropout's generator)."""
    if padded_head_dim <= 64:
        narrow = (block_sparse and local) or score_mod
        return TcTileShape(128, 64 if narrow else 128, num_warps=4, min_blocks_per_sm=1)
    if padded_head_dim <= 128:
        # The variable-length kernel at d128 spills 56 bytes with 64 keys (sm_90a): its sequence's
        # lengths and band live in registers where the fixed-length kernel reads parameters.
        narrow = block_sparse or (varlen and padded_head_dim > 96)
        return TcTileShape(128, 32 if narrow else 64, num_warps=4, min_blocks_per_sm=1)
    if padded_head_dim <= 224:
        # The score-modifier kernel spills 32 bytes at d224 with 64 keys (sm_90a): 32.
        block_n = 32 if score_mod and padded_head_dim > 192 else 64
        return TcTileShape(64, block_n, num_warps=4, min_blocks_per_sm=1)
    # (64, 64, 4) is 11% faster at 256 but spills with causal; (64, 32, 4) fits and is slower.
    # The block-sparse local kernel takes (128, 32, 8): with 64 keys it spills 4 bytes at sm_90a.
    # The score-modifier kernel likewise (8 bytes at sm_90a, bf16).
    if (block_sparse and local) or score_mod:
        return TcTileShape(128, 32, num_warps=8, min_blocks_per_sm=1)
    return TcTileShape(128, 64, num_warps=8, min_blocks_per_sm=1)


# Opt-in shared memory per block: an A100's (sm_80, the smallest of the tensor-core GPUs the tables
# are sized for) and an H100's (sm_90). The dK/dV table has larger tiles for the latter.
SMEM_A100 = 163 * 1024
SMEM_H100 = 227 * 1024


def tc_dkdv_tile_shape(
    padded_head_dim: int, large_smem: bool = False, block_sparse: bool = False, score_mod: bool = False,
    varlen: bool = False,
) -> TcDkdvTileShape:
    """The dK/dV tile; large_smem: for a device with an H100's shared memory (dO double-buffered,
    and 64 queries per step above d192, dense only: the block-sparse kernel's tile list does not
    fit beside it in registers), else one that fits an A100. score_mod: smaller tiles from d32 on
    (the score modifiers' state and derivative do not fit beside the full tile in 255 registers:
    4-124 bytes of spills at sm_90a): half the queries per step at d32-64 and d256, and 64 keys
    per block at d96-128, where 32 queries per step still spill 12 bytes at sm_80."""
    do_buffers = 2 if large_smem else 1
    if padded_head_dim <= 16:  # too narrow to split the columns of dK, dV between two warps
        return TcDkdvTileShape(128, 128, num_warps=8, warps_q=1, do_buffers=1, out_split=1, min_blocks_per_sm=1)
    if padded_head_dim <= 64:
        block_m = 64 if score_mod else 128
        return TcDkdvTileShape(block_m, 128, num_warps=8, warps_q=2, do_buffers=do_buffers, out_split=1, min_blocks_per_sm=1)
    if padded_head_dim <= 128:
        block_n = 64 if score_mod else 128
        return TcDkdvTileShape(64, block_n, num_warps=8, warps_q=2, do_buffers=do_buffers, out_split=1, min_blocks_per_sm=1)
    if padded_head_dim <= 192:
        return TcDkdvTileShape(64, 64, num_warps=8, warps_q=2, do_buffers=1, out_split=1, min_blocks_per_sm=1)
    block_m = 64 if large_smem and not (block_sparse or score_mod) else 32
    if varlen:
        # The variable-length kernel spills 8 bytes at d256 (sm_90a): dK, dV in two column slices.
        # (d224 has no such split of its warps' columns: its problems take this kernel, see bwd_kernels.)
        return TcDkdvTileShape(32, 64, num_warps=8, warps_q=2, do_buffers=1, out_split=2, min_blocks_per_sm=1)
    return TcDkdvTileShape(block_m, 64, num_warps=8, warps_q=2, do_buffers=1, out_split=1, min_blocks_per_sm=1)


def tc_dq_tile_shape(padded_head_dim: int) -> TcBwdTileShape:
    if padded_head_dim <= 128:
        return TcBwdTileShape(128, 64, num_warps=8, out_split=1, min_blocks_per_sm=1)
    return TcBwdTileShape(64, 32, num_warps=4, out_split=2, min_blocks_per_sm=1)


def _tc_tile_bytes(rows: int, columns: int) -> int:
    return rows * (columns + _TC_PAD) * 2


@dataclasses.dataclass(frozen=True)
class _TcKernel(_TiledKernel):
    """What the three tensor-core kernels share: their fields and a tile from their traits table
    (`tile_table`, a function of the padded head dim) unless overridden."""

    dtype_name: str
    head_dim: int  # padded
    local: bool
    tile_override: TcTileShape | TcDkdvTileShape | TcBwdTileShape | None = None  # for tuning; None: the traits table
    block_sparse: bool = False
    score_mod: bool = False
    varlen: bool = False

    @functools.cached_property
    def tile(self):
        return self.tile_override or type(self).tile_table(self.head_dim)


@dataclasses.dataclass(frozen=True)
class TcFwdKernel(_TcKernel):
    """kernels/flash_fwd_tc.cu's flash_fwd_tc_kernel: one block per query block."""

    source_file = "flash_fwd_tc.cu"
    kernel_name = "flash_fwd_tc_kernel"
    traits_name = "TcFwdTraits"

    @functools.cached_property
    def tile(self) -> TcTileShape:
        return self.tile_override or tc_fwd_tile_shape(self.head_dim, self.block_sparse, self.local, self.score_mod,
                                                         self.varlen)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors TcFwdTraits::kSmemBytes: Q_i, K_j, V_j.
        t = self.tile
        return _tc_tile_bytes(t.block_m + 2 * t.block_n, self.head_dim)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int = 0) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.tile.block_m), heads, batch)


@dataclasses.dataclass(frozen=True, eq=False)
class TcBwdDkdvKernel(_TcKernel):
    """kernels/flash_bwd_tc.cu's flash_bwd_dkdv_tc_kernel: one block per key block and column slice.
    large_smem picks the traits table's tiles for an H100's shared memory. Two of these are equal
    when they are the same instantiation (the tables agree at most head dims)."""

    large_smem: bool = False

    source_file = "flash_bwd_tc.cu"
    kernel_name = "flash_bwd_dkdv_tc_kernel"
    traits_name = "TcBwdDkdvTraits"
    per_kv_head = True  # as BwdDkdvKernel

    @functools.cached_property
    def tile(self) -> TcDkdvTileShape:
        return self.tile_override or tc_dkdv_tile_shape(self.head_dim, self.large_smem, self.block_sparse, self.score_mod,
                                                           self.varlen)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.name_expression == self.name_expression

    def __hash__(self) -> int:
        return hash(self.name_expression)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors TcBwdDkdvTraits::kSmemBytes: K_j, V_j, 2 x Q_i, do_buffers x dO_i, P^T, dS^T, 2 x (lse_i, D_i).
        t = self.tile
        rows = 2 * t.block_n + (2 + t.do_buffers) * t.block_m
        tiles = _tc_tile_bytes(rows, self.head_dim) + 2 * _tc_tile_bytes(t.block_n, t.block_m)
        return tiles + 2 * 2 * t.block_m * 4

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_k / self.tile.block_n) * self.tile.out_split, heads, batch)


@dataclasses.dataclass(frozen=True)
class TcBwdDqKernel(_TcKernel):
    """kernels/flash_bwd_tc.cu's flash_bwd_dq_tc_kernel (deterministic mode)."""

    source_file = "flash_bwd_tc.cu"
    kernel_name = "flash_bwd_dq_tc_kernel"
    traits_name = "TcBwdDqTraits"
    tile_table = staticmethod(tc_dq_tile_shape)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors TcBwdDqTraits::kSmemBytes: Q_i, dO_i, 2 x (K_j, V_j).
        t = self.tile
        return _tc_tile_bytes(2 * t.block_m + 4 * t.block_n, self.head_dim)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.tile.block_m) * self.tile.out_split, heads, batch)


# --------------------------------------------------------------------------- Hopper (sm_90a)

# The forward on Hopper's warpgroup instructions (wgmma; kernels/flash_fwd_tc.cu with WgmmaFwdTraits), built for
# sm_90a only (the "a" features are not in later architectures). Head dims padded to whole
# 64-column panels of the swizzled tiles; the others keep the mma.sync kernel.
WGMMA_HEAD_DIMS = (64, 128)
WGMMA_ARCH = "sm_90a"
WGMMA_COMPUTE_CAPABILITY = 90
# attention() takes it on sm_90 unless CUPYFLASH_HOPPER_FORWARD=0 is set (then the mma.sync
# kernel serves, as on other GPUs); tests and benchmarks can pick either explicitly (`wgmma=`).
WGMMA_FORWARD_BY_DEFAULT = os.environ.get("CUPYFLASH_HOPPER_FORWARD", "1") != "0"
# The Hopper forward's TMA builds (kTma: K_j, V_j copied by the tensor memory accelerator, one
# thread asking per tile): dense, block-sparse and local (causal, windows), without score modifiers
# or packed sequences, at these padded head dims; taken where the arrays' layout allows a tensor
# map (cupyflash/_tma.py), unless CUPYFLASH_HOPPER_TMA=0. (Local since session 31: causal
# 1.13-1.15x faster than the cp.async build at both head dims, H200.)
TMA_FORWARD_HEAD_DIMS = (64, 128)
TMA_FORWARD_BY_DEFAULT = os.environ.get("CUPYFLASH_HOPPER_TMA", "1") != "0"
# The Hopper dK/dV kernel's TMA builds (kTma: Q_i and dO_i copied, and dQ_i's shares added to the
# float32 workspace, by the TMA instead of every thread's cp.async copies and atomics): every
# variant without score modifiers, at both Hopper head dims; the same switch turns them off.
TMA_BACKWARD_BY_DEFAULT = TMA_FORWARD_BY_DEFAULT
# Their warp-specialised, persistent form (flash_bwd_dkdv_ws_kernel: a block per SM claims key
# blocks in turn; a producer warp asks for each one's tiles while the consumers compute and write
# out the last), at these padded head dims. It serves block-sparse problems up to the mask density
# below (WS_BACKWARD_MAX_DENSITY), and unmasked ones up to the query length below
# (CUPYFLASH_HOPPER_WS_BWD=1: every problem a TMA build serves, 0: none). Against the one-block
# TMA build, whole backward calls on an H200 (bf16, 16384 tokens, the sparse grid's masks;
# benchmarks/NOTES.md, session 33), first form of its step: d128
# block-sparse 0.90-0.99 of its time at every density, d64 0.78-0.99 at density 0.1 and below,
# 0.98-1.01 at 0.25, 1.02-1.05 at 0.5; final form, random masks: d64 0.88-0.98 at 0.1, 0.96-0.99
# at 0.25, d128 0.90-0.95 and 0.93-0.94; unmasked d64 1.03, d128 0.98-0.99.
# Unmasked problems (WS_BACKWARD_UNMASKED_MAX_SEQLEN_Q) since session 50 (benchmarks/NOTES.md; H200,
# bf16, whole calls' launches replayed, ws_bwd_ab.py): d128 0.87-1.00 of the one-block build's time
# at seqlen 256-16384, causal or not (GQA, MQA 0.99-1.00), 0.78-0.98 with fewer queries than keys
# (seqlen_q 128-2048); d64 0.74-0.87 where seqlen_q is 128 or 256, but 0.95-1.06 from 512 queries
# on and 1.4-3.1 where its dQ ring paces short launches (512 queries against 512-1024 keys), so d64
# keeps the one-block build from 4 query blocks of 128 on (where the ring would start:
# WS_DQ_RING_MIN_STEPS).
WS_BACKWARD_HEAD_DIMS = (64, 128)
WS_BACKWARD_MAX_DENSITY = {64: 0.3, 128: 1.0}
WS_BACKWARD_UNMASKED_MAX_SEQLEN_Q = {64: 384, 128: math.inf}
WS_BACKWARD_BY_DEFAULT = {"0": False, "1": True}.get(os.environ.get("CUPYFLASH_HOPPER_WS_BWD", ""))
# Its dQ ring (flash_bwd_tc.cu, wait_for_slot), at these padded head dims: the preprocess clears
# nothing and no conversion follows. Whole backward calls on an H200 (benchmarks/NOTES.md, session
# 41), d64 at 4096 tokens: random 0.25 -2 to -3%, local 0.262 -2 to -3%, local 0.092 -2%, random
# 0.1 within noise; at 16384 random 0.25 -1 to -3%. d128: 12 slots (24 MB) +7% at density 0.1,
# 24 slots or more +2% there and within noise at 0.25, so d128 keeps the whole workspace.
# WS_DQ_RING_BYTES: the bytes it may take (d64: 24 slabs at 4096 tokens);
# CUPYFLASH_WS_DQ_RING_SLABS sets its slots outright (tests force one or two, so that every slab
# waits for the one before).
# WS_DQ_RING_MIN_STEPS: the ring only where a key block walks at least this many query blocks on
# average (mask density x query blocks): each slab's rounding (two warps a block) then hides behind
# the slab's products. Below it the rounding paces the launch (NOTES, session 42): d64 at 4096
# tokens, whole calls on one H100, ring -> workspace: random 0.1 (3.2 steps) 0.608 -> 0.585 ms,
# local 0.092 (2.9) 0.602 -> 0.545, random 0.05 (1.6) 0.590 -> 0.469, local 0.031 (1) 0.555 ->
# 0.430. On an H200 (session 41, kernels alone) the ring was within noise at random 0.1 and 2%
# faster at local 0.092: the rule gives those up for the H100's 4-9%. Random 0.25 (8 steps) and
# the 16384-token masks (6.4 steps at 0.05) keep the ring.
WS_DQ_RING_HEAD_DIMS = (64,)
WS_DQ_RING_MIN_STEPS = 4.0
WS_DQ_RING_BYTES = 24 << 20
WS_DQ_RING_SLABS = int(os.environ.get("CUPYFLASH_WS_DQ_RING_SLABS", "0"))

# Tiles timed by benchmarks/tune_tc.py --forward-only on an H100 (b2 s8192, both dtypes, causal and
# not; benchmarks/NOTES.md, session 16). d64: one warpgroup of 64 rows, three blocks per SM, whose
# softmax and wgmma the SM can interleave (383-394 TFLOP/s; two warpgroups of 64 rows in one
# block, 303-305). d128: two warpgroups, 128 keys per step (430-434; one warpgroup at two blocks
# per SM, 379-394).
WGMMA_FWD_TILES = {
    64: TcTileShape(64, 128, num_warps=4, min_blocks_per_sm=3),
    128: TcTileShape(128, 128, num_warps=8, min_blocks_per_sm=1),
}
# The unmasked d128 TMA builds (dense or block-sparse, not local) take one warpgroup at two blocks
# per SM: since K_j, V_j come by the TMA (session 24) it is the faster tile there, one block's
# first copies and O_i store passing behind the other's steps (benchmarks/tune_sparse_density.py,
# session 31, H100: dense 4-7% faster at s4096 and s16384, block-sparse 4-8% at densities 1 to
# 0.05). Their cp.async twins keep two warpgroups (with one they spill 24-32 bytes at 255
# registers), and so do the local TMA builds: causal, one warpgroup took 1.02-1.04x the time of
# two (H200).
WGMMA_FWD_UNMASKED_TMA_TILES = {
    128: TcTileShape(64, 128, num_warps=4, min_blocks_per_sm=2),
}


def wgmma_fwd_tile_shape(padded_head_dim: int, tma: bool = False, local: bool = False) -> TcTileShape:
    """Warpgroups of 64 query rows, 128 keys per step (one m64n128 wgmma per k-step of S); the
    block-sparse kernels take the same tiles. tma and not local: the unmasked TMA builds' tile
    (WGMMA_FWD_UNMASKED_TMA_TILES). (At d64, three blocks per SM, the non-local block-sparse
    kernel spilled 8 bytes while it read each key block's column from the mask twice, for the
    prefetch and again for the step; it now carries it from one step to the next.)"""
    if tma and not local and padded_head_dim in WGMMA_FWD_UNMASKED_TMA_TILES:
        return WGMMA_FWD_UNMASKED_TMA_TILES[padded_head_dim]
    return WGMMA_FWD_TILES[padded_head_dim]


@dataclasses.dataclass(frozen=True)
class WgmmaFwdKernel(_TcKernel):
    """kernels/flash_fwd_tc.cu's flash_fwd_tc_kernel with the Hopper traits (wgmma products; sm_90a):
    one block per query block. tma: the kTma build (TMA_FORWARD_HEAD_DIMS; no score modifiers, not
    varlen), which takes K's and V's tensor maps."""

    tma: bool = False

    source_file = "flash_fwd_tc.cu"
    kernel_name = "flash_fwd_tc_kernel"
    traits_name = "WgmmaFwdTraits"
    arch = WGMMA_ARCH
    compile_options = (f"--gpu-architecture={WGMMA_ARCH}",)

    def __post_init__(self):
        if self.tma and (self.score_mod or self.varlen or self.head_dim not in TMA_FORWARD_HEAD_DIMS):
            raise ValueError(f"the Hopper forward's TMA builds have no score modifiers and no packed sequences, "
                             f"at head dims {TMA_FORWARD_HEAD_DIMS}; not {self}")

    @functools.cached_property
    def tile(self) -> TcTileShape:
        return self.tile_override or wgmma_fwd_tile_shape(self.head_dim, self.tma, self.local)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors WgmmaFwdTraits::kSmemBytes: Q_i, K_j, V_j unpadded, and a swizzle period (1024
        # bytes) to align their base.
        t = self.tile
        return (t.block_m + 2 * t.block_n) * self.head_dim * 2 + 1024

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int = 0) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.tile.block_m), heads, batch)


# The warp-specialised, persistent Hopper forward (flash_fwd_tc.cu's flash_fwd_ws_kernel,
# WgmmaFwdWsTraits): one producer warpgroup issuing the TMA copies and block_m / 64 consumer
# warpgroups, one block per SM walking the query tiles in turn. It serves the unmasked problems
# (dense or block-sparse) at WS_FORWARD_HEAD_DIMS whose arrays take tensor maps, unless
# CUPYFLASH_HOPPER_WS=0, where `ws_forward_by_default` allows. On an H200 (benchmarks/ws_ab.py,
# session 32; kernels alone, bf16, b4 s4096 h16) it took 0.92x the d128 TMA build's time dense and
# 0.80x at mask densities 0.1-0.05. At d64 it loses to the TMA build (three one-warpgroup blocks
# per SM, whose softmax and products the SM interleaves) where the query tiles are long: 1.03-1.09x
# dense and at 6.4-12.8 key blocks a tile (session 43, H200). It wins where they are short, its
# next tile's Q_i and first K_j, V_j landing while this one ends: 0.91-0.95x at 1-3.2 key blocks a
# tile (s4096 random 0.1 and 0.05, local 0.092 and 0.031). So at d64 it serves block masks whose
# tiles walk at most WS_FORWARD_MAX_STEPS key blocks on average (density x key blocks).
WS_FORWARD_HEAD_DIMS = (64, 128)
WS_FORWARD_MAX_STEPS = {64: 4.0}
WS_FORWARD_BY_DEFAULT = os.environ.get("CUPYFLASH_HOPPER_WS", "1") != "0"


def ws_forward_by_default(padded_head_dim: int, density: float | None, seqlen_k: int) -> bool:
    """Whether the warp-specialised forward serves a problem unless told: at WS_FORWARD_HEAD_DIMS;
    where WS_FORWARD_MAX_STEPS bounds the head dim, only for a block mask (`density`; None without
    one) whose query tiles walk at most that many key blocks of the kernel's tile on average."""
    if padded_head_dim not in WS_FORWARD_HEAD_DIMS:
        return False
    most = WS_FORWARD_MAX_STEPS.get(padded_head_dim)
    if most is None:
        return True
    key_blocks = math.ceil(seqlen_k / WGMMA_FWD_WS_TILES[padded_head_dim].block_n)
    return density is not None and density * key_blocks <= most


@dataclasses.dataclass(frozen=True)
class WsTileShape:
    block_m: int  # B_r, queries per tile: 64 per consumer warpgroup
    block_n: int  # B_c, keys per step
    stages: int  # K_j, V_j buffers each

    @property
    def num_warps(self) -> int:
        return 4 * (self.block_m // 64 + 1)


# Two consumer warpgroups; at d128 two stages fill the shared memory with both Q_i buffers (193
# KiB). d64 (98 KiB) measured three and four stages no faster (session 43, H200).
WGMMA_FWD_WS_TILES = {
    64: WsTileShape(128, 128, 2),
    128: WsTileShape(128, 128, 2),
}


@dataclasses.dataclass(frozen=True)
class WgmmaFwdWsKernel(_TcKernel):
    """kernels/flash_fwd_tc.cu's flash_fwd_ws_kernel (sm_90a): warp-specialised and persistent, at
    most one block per SM; dense or block-sparse, not local, no score modifiers, not varlen. It
    takes Q's, K's, V's and O's tensor maps (FwdWsTensorMaps) and the number of query tiles."""

    source_file = "flash_fwd_tc.cu"
    kernel_name = "flash_fwd_ws_kernel"
    traits_name = "WgmmaFwdWsTraits"
    arch = WGMMA_ARCH
    compile_options = (f"--gpu-architecture={WGMMA_ARCH}",)
    o_box_rows = 64  # O_i is stored by the TMA a consumer warpgroup's rows at a time

    def __post_init__(self):
        if self.local or self.score_mod or self.varlen or self.head_dim not in WS_FORWARD_HEAD_DIMS:
            raise ValueError(f"the warp-specialised forward is unmasked, with no score modifiers and no packed "
                             f"sequences, at head dims {WS_FORWARD_HEAD_DIMS}; not {self}")
        if self.block_sparse and 128 % self.tile.block_m:
            # A query tile must lie in one mask row (block_mask_granularity: 128 at these head dims).
            raise ValueError(f"the block-sparse warp-specialised forward takes 64 or 128 queries a tile; not {self}")

    @functools.cached_property
    def tile(self) -> WsTileShape:
        return self.tile_override or WGMMA_FWD_WS_TILES[self.head_dim]

    @functools.cached_property
    def name_expression(self) -> str:
        return f"cupyflash::{self.kernel_name}<{self.traits}, {str(self.block_sparse).lower()}>"

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors WgmmaFwdWsTraits::kSmemBytes: two Q_i buffers, `stages` of K_j and of V_j, and a
        # swizzle period to align their base.
        t = self.tile
        return (2 * t.block_m + 2 * t.stages * t.block_n) * self.head_dim * 2 + 1024

    def n_tiles(self, batch: int, heads: int, seqlen_q: int) -> int:
        return math.ceil(seqlen_q / self.tile.block_m) * heads * batch

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int = 0, sm_count: int = 132) -> tuple[int, int, int]:
        return (max(1, min(self.n_tiles(batch, heads, seqlen_q), sm_count)), 1, 1)


# The dK/dV kernel on wgmma (flash_bwd_tc.cu with WgmmaBwdDkdvTraits): 64 keys per warpgroup,
# two warpgroups; the deterministic dQ kernel stays mma.sync. attention_backward() takes it on
# sm_90 unless CUPYFLASH_HOPPER_BACKWARD=0 is set (then the mma.sync dK/dV kernel serves, as on
# other GPUs); tests and benchmarks can pick either explicitly (`wgmma=`). On an H100 (b2 s8192
# bf16, benchmarks/tune_tc.py, session 17) it measured 336 TFLOP/s at d64 and 349 at d128, where
# the mma.sync kernel's best tiles give 256 and 274.
WGMMA_BACKWARD_BY_DEFAULT = os.environ.get("CUPYFLASH_HOPPER_BACKWARD", "1") != "0"


def wgmma_dkdv_tile_shape(padded_head_dim: int, score_mod: bool = False) -> TcDkdvTileShape:
    """128 keys per block (two warpgroups); queries per step: 128 at d64 (S^T and dP^T 64 registers
    each beside dK_j, dV_j's 64), 64 at d128 (dK_j, dV_j take 128). score_mod (the variable-length
    kernel included): 64 at d64 too; with 128 the score-modifier builds sit at 255 registers and
    the variable-length one spills 8 bytes (sm_90a)."""
    block_m = 128 if padded_head_dim == 64 and not score_mod else 64
    return TcDkdvTileShape(block_m, 128, num_warps=8, warps_q=1, do_buffers=2, out_split=1, min_blocks_per_sm=1)


@dataclasses.dataclass(frozen=True, eq=False)
class WgmmaBwdDkdvKernel(TcBwdDkdvKernel):
    """kernels/flash_bwd_tc.cu's flash_bwd_dkdv_tc_kernel with the Hopper traits (wgmma products;
    sm_90a): one block per key block. tma: the kTma build (no score modifiers, not varlen), which
    loads Q_i, dO_i and adds dQ through the TMA, taking the tensor maps of Q, dO and the dQ
    workspace. ws (with tma): flash_bwd_dkdv_ws_kernel, the same steps in at most one block per
    SM, each claiming key blocks in turn, with a producer warpgroup besides; it takes K's and V's
    maps (KvTensorMaps), the number of key-tile positions and items, and a zeroed int32 counter."""

    tma: bool = False
    ws: bool = False

    traits_name = "WgmmaBwdDkdvTraits"
    arch = WGMMA_ARCH
    compile_options = (f"--gpu-architecture={WGMMA_ARCH}",)

    def __post_init__(self):
        if self.tma and (self.score_mod or self.varlen):
            raise ValueError(f"the Hopper dK/dV kernel's TMA builds have no score modifiers; not {self}")
        if self.ws and not (self.tma and self.head_dim in WS_BACKWARD_HEAD_DIMS):
            raise ValueError(f"the warp-specialised dK/dV kernel is a TMA build at head dims {WS_BACKWARD_HEAD_DIMS}; "
                             f"not {self}")

    @functools.cached_property
    def name_expression(self) -> str:
        if not self.ws:
            return super().name_expression
        flags = ", ".join(str(flag).lower() for flag in (self.local, self.block_sparse))
        return f"cupyflash::flash_bwd_dkdv_ws_kernel<{self.traits}, {flags}>"

    @functools.cached_property
    def num_threads(self) -> int:
        return 32 * self.tile.num_warps + (128 if self.ws else 0)  # ws: the producer warpgroup

    def positions(self, seqlen_k: int) -> int:
        """Key tiles per (K/V head, batch) for a seqlen_k (block-sparse: rounded up to mask blocks)."""
        return math.ceil(seqlen_k / self.tile.block_n)

    @staticmethod
    def counters(kv_heads: int, batch: int) -> int:
        """int32 counters the warp-specialised build takes (flash_bwd_tc.cu's DkdvCounters): the
        item claims and the rounding warps done, then two per (K/V head, batch) slab."""
        return 2 + 2 * kv_heads * batch

    def takes_ring(self, density: float, seqlen_q: int) -> bool:
        """Whether the warp-specialised build adds dQ into its ring (flash_bwd_tc.cu, wait_for_slot)
        for a mask of this density (1: none): at WS_DQ_RING_HEAD_DIMS where a key block walks
        WS_DQ_RING_MIN_STEPS query blocks or more on average, or wherever WS_DQ_RING_SLABS forces it."""
        if not self.ws or self.head_dim not in WS_DQ_RING_HEAD_DIMS:
            return False
        return bool(WS_DQ_RING_SLABS) or density * math.ceil(seqlen_q / self.tile.block_m) >= WS_DQ_RING_MIN_STEPS

    def ring_slabs(self, slabs: int, positions: int, blocks: int, slab_bytes: int) -> int:
        """Slots of the warp-specialised build's dQ ring (flash_bwd_tc.cu, wait_for_slot): room for
        twice the slabs that the launch's `blocks` hold items of at once and two being rounded, or
        WS_DQ_RING_BYTES if that holds more, and never more than the launch's `slabs`."""
        if WS_DQ_RING_SLABS:
            return min(slabs, WS_DQ_RING_SLABS)
        in_flight = 2 * math.ceil(blocks / positions) + 2
        return min(slabs, max(in_flight, WS_DQ_RING_BYTES // slab_bytes))

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int, sm_count: int = 132) -> tuple[int, int, int]:
        if not self.ws:
            return super().grid(batch, heads, seqlen_q, seqlen_k)
        return (min(self.positions(seqlen_k) * heads * batch, sm_count), 1, 1)  # (0: nothing to launch)

    def host_checks(self) -> str:
        if not self.tma:
            return super().host_checks()
        total = "kSmemBytesWs" if self.ws else "kSmemBytesTma"
        return (f"static_assert({self.traits}::{total} == {self.smem_bytes}, "
                f'"cupyflash/_instantiations.py and {self.traits_name} disagree on shared memory");\n')

    @functools.cached_property
    def tile(self) -> TcDkdvTileShape:
        return self.tile_override or wgmma_dkdv_tile_shape(self.head_dim, self.score_mod)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors WgmmaBwdDkdvTraits::kSmemBytes: K_j, V_j, 2 x Q_i, 2 x dO_i, dS^T unpadded,
        # 2 x (lse_i, D_i), and a swizzle period to align the tiles' base.
        t = self.tile
        # The TMA builds add two stages of one 64 x 64 float32 dQ share per warpgroup.
        tiles = (2 * t.block_n + 4 * t.block_m) * self.head_dim * 2 + t.block_n * t.block_m * 2
        dq_stages = 2 * (t.num_warps // 4) * 64 * 64 * 4 if self.tma else 0
        # The warp-specialised build rounds dQ through two buffers of one 64 x 32 float32 dQ box.
        round_boxes = 2 * 64 * 32 * 4 if self.ws else 0
        return tiles + 2 * 2 * t.block_m * 4 + 1024 + dq_stages + round_boxes


def uses_wgmma(dtype_name: str, padded_head_dim: int, compute_capability: int) -> bool:
    """Whether the Hopper kernels can serve a problem on a device of this compute capability."""
    return (dtype_name in TENSOR_CORE_DTYPES and padded_head_dim in WGMMA_HEAD_DIMS
            and compute_capability == WGMMA_COMPUTE_CAPABILITY)


def all_wgmma_kernels() -> list:
    return [
        kind(dtype_name, d, local, block_sparse=sparse, score_mod=mod, varlen=var)
        for kind in (WgmmaFwdKernel, WgmmaBwdDkdvKernel)
        for dtype_name in TENSOR_CORE_DTYPES
        for d in WGMMA_HEAD_DIMS
        for local, sparse, mod, var in _variants()
    ] + [
        WgmmaFwdKernel(dtype_name, d, local, block_sparse=sparse, tma=True)
        for dtype_name in TENSOR_CORE_DTYPES
        for d in TMA_FORWARD_HEAD_DIMS
        for local in (False, True)
        for sparse in (False, True)
    ] + [
        WgmmaFwdWsKernel(dtype_name, d, False, block_sparse=sparse)
        for dtype_name in TENSOR_CORE_DTYPES
        for d in WS_FORWARD_HEAD_DIMS
        for sparse in (False, True)
    ] + [
        WgmmaBwdDkdvKernel(dtype_name, d, local, block_sparse=sparse, tma=True, ws=ws)
        for dtype_name in TENSOR_CORE_DTYPES
        for d in WGMMA_HEAD_DIMS
        for local in (False, True)
        for sparse in (False, True)
        for ws in ((False, True) if d in WS_BACKWARD_HEAD_DIMS else (False,))
    ]


def uses_tensor_cores(dtype_name: str, compute_capability: int) -> bool:
    """Whether attention on a device of this compute capability (e.g. 90) takes the tensor-core kernels."""
    return dtype_name in TENSOR_CORE_DTYPES and compute_capability >= TENSOR_CORE_MIN_CC


def all_tc_kernels() -> list:
    kernels = [
        kind(dtype_name, d, local, block_sparse=sparse, score_mod=mod, varlen=var)
        for dtype_name in TENSOR_CORE_DTYPES
        for d in PADDED_HEAD_DIMS
        for local, sparse, mod, var in _variants()
        for kind in (TcFwdKernel, TcBwdDkdvKernel, TcBwdDqKernel)
        if not (var and d == 224 and kind is not TcFwdKernel)  # bwd_kernels takes d256's
    ]
    large = [TcBwdDkdvKernel(k.dtype_name, k.head_dim, k.local, large_smem=True, block_sparse=k.block_sparse,
                             score_mod=k.score_mod, varlen=k.varlen)
             for k in kernels if isinstance(k, TcBwdDkdvKernel)]
    return kernels + [k for k in large if k not in kernels]


# The block mask's shape fields, then the score modifiers', at the end of both structs (zero for
# dense attention with no softcap or ALiBi).
_MASK_FIELDS = [("mask_batch_stride", "i8"), ("mask_head_stride", "i8")] + [
    (name, "i4") for name in ("mask_q_blocks", "mask_k_blocks", "mask_block_q", "mask_block_k")
] + [("softcap_log2", "f8"), ("alibi_slopes", "u8"), ("alibi_batch_stride", "i8")]

# Variable-length batches' pointers, last in both structs (zero: a fixed-length batch).
_VARLEN_FIELDS = [("cu_seqlens_q", "u8"), ("cu_seqlens_k", "u8"), ("seqused_k", "u8")]

# Dropout's, after those (zero: no dropout, dropout_rescale 1).
_DROPOUT_FIELDS = [("dropout_seed", "u8"), ("dropout_offset", "u4"), ("dropout_threshold", "u4"),
                   ("dropout_rescale", "f8")]

# The problem's int fields, after the pointers and strides of both structs.
_SHAPE_FIELDS = ("heads", "seqlen_q", "seqlen_k", "head_dim", "kv_group", "band_first", "band_last")

# The host's image of struct FwdParams (kernels/flash_fwd.cuh); align=True gives C's layout.
FWD_PARAMS_DTYPE = numpy.dtype(
    [("q", "u8"), ("k", "u8"), ("v", "u8"), ("o", "u8"), ("lse", "u8")]
    + [(f"{t}_{s}_stride", "i8") for t in "qkvo" for s in ("batch", "row", "head")]
    + [(name, "i4") for name in _SHAPE_FIELDS]
    + [("scale_log2", "f8")]
    + [("kv_block_count", "u8"), ("kv_block_index", "u8")]
    + _MASK_FIELDS
    + [("lse_batch_stride", "i8"), ("lse_head_stride", "i8")]
    + _VARLEN_FIELDS
    + _DROPOUT_FIELDS
    + [("query_tile_order", "u8")],
    align=True,
)

# The host's image of struct BwdParams (kernels/flash_bwd.cuh).
BWD_PARAMS_DTYPE = numpy.dtype(
    [(name, "u8") for name in ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "dq_accum", "lse_log2", "d")]
    + [(f"{t}_{s}_stride", "i8") for t in ("q", "k", "v", "o", "dout", "dq", "dk", "dv") for s in ("batch", "row", "head")]
    + [("lse_batch_stride", "i8"), ("lse_head_stride", "i8"), ("lse_row_stride", "i8")]
    + [(name, "i4") for name in _SHAPE_FIELDS]
    + [("scale", "f8"), ("scale_log2", "f8")]
    + [(name, "u8") for name in ("kv_block_count", "kv_block_index", "q_block_count", "q_block_index",
                                 "key_block_order")]
    + _MASK_FIELDS
    + [("stats_batch_stride", "i8"), ("stats_head_stride", "i8"), ("dq_accum_batch_stride", "i8")]
    + _VARLEN_FIELDS
    + _DROPOUT_FIELDS,
    align=True,
)

# --------------------------------------------------------------------------- KV-cache decoding

# kernels/flash_decode.cu. Decoding reads the whole cache for a handful of query rows, so its tiles
# are chosen for bytes in flight, not for FLOPs: the tensor-core kernel keeps kStages - 1 tiles of
# K and V (64 keys each) loading while one is used, and both kernels pack a GQA group's heads and
# the query positions into the rows of one tile (`DecodeLayout`).
DECODE_WARPS = 4
DECODE_MAX_SPLITS = 128  # kDecodeMaxSplits: the splits decode_combine_splits merges (lanes x 4)


@dataclasses.dataclass(frozen=True)
class _DecodeKernel:
    """What the two decode kernels share: one instantiation per (dtype, padded head dim), whose
    traits' template arguments and shared memory the subclasses give (`traits_args`, `smem_bytes`)."""

    dtype_name: str
    head_dim: int  # padded
    score_mod: bool = False  # softcap / ALiBi: the kernels' kScoreMod instantiation

    source_file = "flash_decode.cu"
    num_threads = 32 * DECODE_WARPS

    @functools.cached_property
    def traits(self) -> str:
        args = ", ".join(str(x) for x in (self.head_dim, *self.traits_args))
        return f"cupyflash::{self.traits_name}<{ELEMENT_TYPES[self.dtype_name]}, {args}>"

    @functools.cached_property
    def name_expression(self) -> str:
        return f"cupyflash::{self.kernel_name}<{self.traits}{', true' if self.score_mod else ''}>"

    def merge_bytes(self) -> int:
        """DecodeLayout::kMergeBytes: every warp's m, l and O for the block's rows, in Accum."""
        o_stride = self.head_dim + 8  # DecodeLayout::kOStride (padded against bank conflicts)
        return DECODE_WARPS * self.rows * (o_stride + 2) * accum_itemsize(self.dtype_name)

    def host_checks(self) -> str:
        return (f"static_assert({self.traits}::kSmemBytes == {self.smem_bytes}, "
                f'"cupyflash/_instantiations.py and {self.traits_name} disagree on shared memory");\n'
                f"static_assert(cupyflash::kDecodeMaxSplits == {DECODE_MAX_SPLITS}, "
                f'"cupyflash/_instantiations.py and flash_decode.cuh disagree on the most splits");\n')


@dataclasses.dataclass(frozen=True)
class TcDecodeKernel(_DecodeKernel):
    """flash_decode_tc_kernel: 16 packed rows per block, the keys split over warps and blocks."""

    kernel_name = "flash_decode_tc_kernel"
    traits_name = "TcDecodeTraits"
    rows = 16
    block_n = 16 * DECODE_WARPS

    @property
    def stages(self) -> int:
        # Three stages fit two blocks per SM on an H100 up to d128; above, two (A100's 163 KiB).
        return 3 if self.head_dim <= 128 else 2

    @property
    def traits_args(self) -> tuple:
        return DECODE_WARPS, self.stages

    @functools.cached_property  # on every decoding step's launch path
    def smem_bytes(self) -> int:
        # Mirrors TcDecodeTraits::kSmemBytes: Q and kStages x (K_j, V_j), or the warps' merge.
        tiles = _tc_tile_bytes(self.rows + 2 * self.stages * self.block_n, self.head_dim)
        return max(tiles, self.merge_bytes())


def decode_rows(dtype_name: str, padded_head_dim: int) -> int:
    """Packed rows per block of the CUDA-core decode kernel: each lane holds rows x ceil(d / 32)
    output accumulators, kept to 64 32-bit registers."""
    words = accum_itemsize(dtype_name) // 4 * math.ceil(padded_head_dim / 32)
    return min(16, 64 // words)


@dataclasses.dataclass(frozen=True)
class DecodeKernel(_DecodeKernel):
    """flash_decode_kernel (CUDA cores, every dtype): `decode_rows` packed rows per block."""

    kernel_name = "flash_decode_kernel"
    traits_name = "DecodeTraits"
    block_n = 32 * DECODE_WARPS

    @property
    def rows(self) -> int:
        return decode_rows(self.dtype_name, self.head_dim)

    @property
    def traits_args(self) -> tuple:
        return self.rows, DECODE_WARPS

    @functools.cached_property  # on every decoding step's launch path
    def smem_bytes(self) -> int:
        # Mirrors DecodeTraits::kSmemBytes: Q [rows][d] in Accum, or the warps' merge.
        return max(self.rows * self.head_dim * accum_itemsize(self.dtype_name), self.merge_bytes())


@dataclasses.dataclass(frozen=True)
class DecodeAppendKernel:
    """flash_decode_append_kernel: new keys and values copied into the caches before a step."""

    dtype_name: str

    source_file = "flash_decode.cu"
    smem_bytes = 0
    head_dim = 0  # any
    num_threads = 128

    @functools.cached_property
    def name_expression(self) -> str:
        return f"cupyflash::flash_decode_append_kernel<{ELEMENT_TYPES[self.dtype_name]}>"

    def host_checks(self) -> str:
        return ""


def decode_kernel(dtype_name: str, head_dim: int, tensor_cores: bool = False, score_mod: bool = False):
    """The decode kernel for a problem: TcDecodeKernel with tensor_cores (16-bit only), else
    DecodeKernel; their score-modifier (softcap, ALiBi) instantiation with score_mod."""
    _check_tensor_core_dtype(dtype_name, tensor_cores)
    return (TcDecodeKernel if tensor_cores else DecodeKernel)(dtype_name, padded_head_dim(head_dim), score_mod)


def all_decode_kernels() -> list:
    kernels = [DecodeKernel(name, d, mod) for name in DTYPE_NAMES for d in PADDED_HEAD_DIMS for mod in (False, True)]
    kernels += [TcDecodeKernel(name, d, mod) for name in TENSOR_CORE_DTYPES for d in PADDED_HEAD_DIMS
                for mod in (False, True)]
    return kernels + [DecodeAppendKernel(name) for name in DTYPE_NAMES]


# The host's image of struct DecodeParams (kernels/flash_decode.cuh).
DECODE_PARAMS_DTYPE = numpy.dtype(
    [(name, "u8") for name in ("q", "k", "v", "k_new", "v_new", "o", "lse", "o_partial", "lse_partial", "cache_seqlens")]
    + [(f"{t}_{s}_stride", "i8") for t in ("q", "k", "v", "k_new", "v_new", "o") for s in ("batch", "row", "head")]
    + [(name, "i4") for name in ("batch", "heads", "kv_group", "seqlen_q", "cache_len", "seqlen_new", "head_dim")]
    + [(name, "i4") for name in ("window_left", "window_right", "num_splits", "rows")]
    + [("scale_log2", "f8"), ("softcap_log2", "f8"), ("alibi_slopes", "u8"), ("alibi_batch_stride", "i8")]
    + [("split_counters", "u8")],
    align=True,
)


# The kernel-argument structs each source file defines, for the size checks compiled into it.
PARAMS_STRUCTS = {
    "flash_fwd.cu": (("cupyflash::FwdParams", "FWD_PARAMS_DTYPE"),),
    "flash_bwd.cu": (("cupyflash::FwdParams", "FWD_PARAMS_DTYPE"), ("cupyflash::BwdParams", "BWD_PARAMS_DTYPE")),
    "flash_fwd_tc.cu": (("cupyflash::FwdParams", "FWD_PARAMS_DTYPE"),),
    "flash_bwd_tc.cu": (("cupyflash::FwdParams", "FWD_PARAMS_DTYPE"), ("cupyflash::BwdParams", "BWD_PARAMS_DTYPE")),
    "flash_decode.cu": (("cupyflash::DecodeParams", "DECODE_PARAMS_DTYPE"),),
}


def params_size_check(struct: str, dtype: numpy.dtype) -> str:
    """A static_assert that `struct` has the host dtype's size (in every compiled module)."""
    return f'static_assert(sizeof({struct}) == {dtype.itemsize}, "{struct}: size differs from the host");\n'


def params_layout_probe(struct: str, dtype: numpy.dtype) -> str:
    """A kernel writing each field's offset, in dtype order, for the GPU test that compares them
    with the host layout (offsetof is not a compile-time builtin in every NVRTC)."""
    lines = [f'extern "C" __global__ void params_layout_probe(long long* offsets) {{', f"    {struct} p{{}};"]
    for i, name in enumerate(dtype.names):
        lines.append(
            f"    offsets[{i}] = reinterpret_cast<const char*>(&p.{name}) - reinterpret_cast<const char*>(&p);"
        )
    return "\n".join(lines) + "\n}\n"
