"""Kernel descriptors of the tensor-core kernels (float16 / bfloat16; float32's TF32 forward;
float64's forward and dK/dV on DMMA): the mma.sync kernels of kernels/sm80/ (sm_80 and newer) and
the Hopper kernels of kernels/sm90/ (wgmma, TMA; sm_90a)."""

from __future__ import annotations

import dataclasses
import functools
import math

from cupyflash.catalog import tiles
from cupyflash.catalog.specs import TiledKernel, smem_check


def _tc_tile_bytes(rows: int, columns: int, itemsize: int = 2) -> int:
    """A [rows][columns] tile's bytes, its rows padded by 16 bytes (TcTileLayout::kPad)."""
    return rows * (columns + 16 // itemsize) * itemsize


@dataclasses.dataclass(frozen=True)
class TcKernel(TiledKernel):
    """What the tensor-core kernels share: a tile from their traits table (`tile_table`, a function
    of the padded head dim) unless overridden."""

    family = "sm80"

    @functools.cached_property
    def tile(self):
        return self.tile_override or type(self).tile_table(self.head_dim)


# --------------------------------------------------------------------------- sm80/


@dataclasses.dataclass(frozen=True)
class TcFwdKernel(TcKernel):
    """kernels/sm80/fwd.cu's flash_fwd_sm80_kernel: one block per query block. precision: float32's
    ("high": 3xTF32, "medium": one TF32 product; tiles.FLOAT32_PRECISIONS), None for 16-bit and
    float64 (DMMA products)."""

    precision: str | None = None

    source_file = "sm80/fwd.cu"
    kernel_name = "flash_fwd_sm80_kernel"
    traits_name = "TcFwdTraits"

    def __post_init__(self):
        if (self.dtype_name in tiles.TF32_FORWARD_DTYPES) != (self.precision in tiles.TF32_PASSES):
            raise ValueError(f"a TF32 precision ({tuple(tiles.TF32_PASSES)}) goes with float32 and only with it, "
                             f"not {self.precision!r} with {self.dtype_name}")

    @property
    def element_type(self) -> str:
        if self.precision is None:
            return super().element_type
        return f"cupyflash::Tf32<{tiles.TF32_PASSES[self.precision]}>"

    @functools.cached_property
    def tile(self) -> tiles.TcTileShape:
        table = (tiles.tf32_fwd_tile_shape if self.precision else
                 tiles.f64_fwd_tile_shape if self.dtype_name in tiles.F64_FORWARD_DTYPES else tiles.tc_fwd_tile_shape)
        return self.tile_override or table(self.head_dim, self.block_sparse, self.local, self.score_mod, self.varlen)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors TcFwdTraits::kSmemBytes: Q_i, K_j, V_j.
        t = self.tile
        return _tc_tile_bytes(t.block_m + 2 * t.block_n, self.head_dim, tiles.itemsize(self.dtype_name))

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int = 0) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.tile.block_m), heads, batch)


@dataclasses.dataclass(frozen=True, eq=False)
class TcBwdDkdvKernel(TcKernel):
    """kernels/sm80/bwd.cu's flash_bwd_dkdv_sm80_kernel (16-bit, or float64 on DMMA: its own table,
    tiles.f64_dkdv_tile_shape): one block per key block and column slice. large_smem picks the
    traits table's tiles for an H100's shared memory. Two of these are equal when they are the same
    instantiation (the tables agree at most head dims)."""

    large_smem: bool = False

    source_file = "sm80/bwd.cu"
    kernel_name = "flash_bwd_dkdv_sm80_kernel"
    traits_name = "TcBwdDkdvTraits"
    per_kv_head = True  # as BwdDkdvKernel

    @functools.cached_property
    def tile(self) -> tiles.TcDkdvTileShape:
        table = tiles.f64_dkdv_tile_shape if self.dtype_name in tiles.F64_FORWARD_DTYPES else tiles.tc_dkdv_tile_shape
        return self.tile_override or table(self.head_dim, self.large_smem, self.block_sparse, self.score_mod,
                                           self.varlen)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.name_expression == self.name_expression

    def __hash__(self) -> int:
        return hash(self.name_expression)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors TcBwdDkdvTraits::kSmemBytes: K_j, V_j, 2 x Q_i, do_buffers x dO_i, P^T, dS^T,
        # 2 x (lse_i, D_i).
        t = self.tile
        rows = 2 * t.block_n + (2 + t.do_buffers) * t.block_m
        size = tiles.itemsize(self.dtype_name)
        return (_tc_tile_bytes(rows, self.head_dim, size) + 2 * _tc_tile_bytes(t.block_n, t.block_m, size)
                + 2 * 2 * t.block_m * tiles.accum_itemsize(self.dtype_name))

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_k / self.tile.block_n) * self.tile.out_split, heads, batch)


@dataclasses.dataclass(frozen=True)
class TcBwdDqKernel(TcKernel):
    """kernels/sm80/bwd.cu's flash_bwd_dq_sm80_kernel (deterministic mode; beside the Hopper dK/dV
    kernels too)."""

    source_file = "sm80/bwd.cu"
    kernel_name = "flash_bwd_dq_sm80_kernel"
    traits_name = "TcBwdDqTraits"
    tile_table = staticmethod(tiles.tc_dq_tile_shape)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors TcBwdDqTraits::kSmemBytes: Q_i, dO_i, 2 x (K_j, V_j).
        t = self.tile
        return _tc_tile_bytes(2 * t.block_m + 4 * t.block_n, self.head_dim)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.tile.block_m) * self.tile.out_split, heads, batch)


# --------------------------------------------------------------------------- sm90/

_SM90_OPTIONS = (f"--gpu-architecture={tiles.WGMMA_ARCH}",)


@dataclasses.dataclass(frozen=True)
class WgmmaFwdKernel(TcKernel):
    """kernels/sm90/fwd.cu's flash_fwd_sm90_kernel: one block per query block. tma: the kTma build
    (not varlen, at TMA_FORWARD_HEAD_DIMS; with score modifiers at TMA_SCORE_MOD_HEAD_DIMS), which
    takes K's and V's tensor maps."""

    tma: bool = False

    source_file = "sm90/fwd.cu"
    kernel_name = "flash_fwd_sm90_kernel"
    traits_name = "WgmmaFwdTraits"
    family = "sm90"
    arch = tiles.WGMMA_ARCH
    compile_options = _SM90_OPTIONS

    def __post_init__(self):
        if self.tma and (self.varlen or self.head_dim not in tiles.TMA_FORWARD_HEAD_DIMS or (
                self.score_mod and self.head_dim not in tiles.TMA_SCORE_MOD_HEAD_DIMS)):
            raise ValueError(f"the Hopper forward's TMA builds have no packed sequences, at head dims "
                             f"{tiles.TMA_FORWARD_HEAD_DIMS} (with score modifiers {tiles.TMA_SCORE_MOD_HEAD_DIMS}); "
                             f"not {self}")

    @functools.cached_property
    def tile(self) -> tiles.TcTileShape:
        return self.tile_override or tiles.wgmma_fwd_tile_shape(self.head_dim, self.tma, self.local)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors WgmmaFwdTraits::kSmemBytes: Q_i, K_j, V_j unpadded, and a swizzle period (1024
        # bytes) to align their base.
        t = self.tile
        return (t.block_m + 2 * t.block_n) * self.head_dim * 2 + 1024

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int = 0) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.tile.block_m), heads, batch)


@dataclasses.dataclass(frozen=True)
class WgmmaFwdWsKernel(TcKernel):
    """kernels/sm90/fwd_ws.cu's flash_fwd_ws_kernel: warp-specialised and persistent, at most one
    block per SM; dense or block-sparse, not local, no score modifiers, not varlen. It takes Q's,
    K's, V's and O's tensor maps (FwdWsTensorMaps) and the number of query tiles."""

    source_file = "sm90/fwd_ws.cu"
    kernel_name = "flash_fwd_ws_kernel"
    traits_name = "WgmmaFwdWsTraits"
    family = "sm90"
    arch = tiles.WGMMA_ARCH
    compile_options = _SM90_OPTIONS
    o_box_rows = 64  # O_i is stored by the TMA a consumer warpgroup's rows at a time

    def __post_init__(self):
        if self.local or self.score_mod or self.varlen or self.head_dim not in tiles.WS_FORWARD_HEAD_DIMS:
            raise ValueError(f"the warp-specialised forward is unmasked, with no score modifiers and no packed "
                             f"sequences, at head dims {tiles.WS_FORWARD_HEAD_DIMS}; not {self}")
        if self.block_sparse and 128 % self.tile.block_m:
            # A query tile must lie in one mask row (block_mask_granularity: 128 at these head dims).
            raise ValueError(f"the block-sparse warp-specialised forward takes 64 or 128 queries a tile; not {self}")

    @functools.cached_property
    def tile(self) -> tiles.WsTileShape:
        return self.tile_override or tiles.WGMMA_FWD_WS_TILES[self.head_dim]

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


@dataclasses.dataclass(frozen=True, eq=False)
class WgmmaBwdDkdvKernel(TcBwdDkdvKernel):
    """kernels/sm90/bwd_dkdv.cu's flash_bwd_dkdv_sm90_kernel: one block per key block. tma: the kTma
    build (no score modifiers, not varlen), which loads Q_i, dO_i and adds dQ through the TMA,
    taking the tensor maps of Q, dO and the dQ workspace. ws (with tma): kernels/sm90/bwd_dkdv_ws.cu's
    flash_bwd_dkdv_ws_kernel, the same steps in at most one block per SM, each claiming key blocks
    in turn, with a producer warpgroup besides; it takes K's and V's maps (KvTensorMaps), the
    number of key-tile positions and items, and zeroed int32 counters."""

    tma: bool = False
    ws: bool = False

    kernel_name = "flash_bwd_dkdv_sm90_kernel"
    traits_name = "WgmmaBwdDkdvTraits"
    family = "sm90"
    arch = tiles.WGMMA_ARCH
    compile_options = _SM90_OPTIONS

    def __post_init__(self):
        if self.tma and (self.score_mod or self.varlen):
            raise ValueError(f"the Hopper dK/dV kernel's TMA builds have no score modifiers; not {self}")
        if self.ws and not (self.tma and self.head_dim in tiles.WS_BACKWARD_HEAD_DIMS):
            raise ValueError(f"the warp-specialised dK/dV kernel is a TMA build at head dims "
                             f"{tiles.WS_BACKWARD_HEAD_DIMS}; not {self}")

    @property
    def source_file(self) -> str:
        return "sm90/bwd_dkdv_ws.cu" if self.ws else "sm90/bwd_dkdv.cu"

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
        """int32 counters the warp-specialised build takes (DkdvCounters): the item claims and the
        rounding warps done, then two per (K/V head, batch) slab."""
        return 2 + 2 * kv_heads * batch

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int, sm_count: int = 132) -> tuple[int, int, int]:
        if not self.ws:
            return super().grid(batch, heads, seqlen_q, seqlen_k)
        return (min(self.positions(seqlen_k) * heads * batch, sm_count), 1, 1)  # (0: nothing to launch)

    def host_checks(self) -> str:
        if not self.tma:
            return super().host_checks()
        return smem_check(self.traits, "kSmemBytesWs" if self.ws else "kSmemBytesTma", self.smem_bytes,
                          self.traits_name)

    @functools.cached_property
    def tile(self) -> tiles.TcDkdvTileShape:
        return self.tile_override or tiles.wgmma_dkdv_tile_shape(self.head_dim, self.score_mod)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors WgmmaBwdDkdvTraits::kSmemBytes: K_j, V_j, 2 x Q_i, 2 x dO_i, dS^T unpadded,
        # 2 x (lse_i, D_i), and a swizzle period to align the tiles' base.
        t = self.tile
        # The TMA builds add two stages of one 64 x 64 float32 dQ share per warpgroup.
        tile_bytes = (2 * t.block_n + 4 * t.block_m) * self.head_dim * 2 + t.block_n * t.block_m * 2
        dq_stages = 2 * (t.num_warps // 4) * 64 * 64 * 4 if self.tma else 0
        # The warp-specialised build rounds dQ through two buffers of one 64 x 32 float32 dQ box.
        round_boxes = 2 * 64 * 32 * 4 if self.ws else 0
        return tile_bytes + 2 * 2 * t.block_m * 4 + 1024 + dq_stages + round_boxes
