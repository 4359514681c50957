"""Kernel descriptors: one frozen dataclass per instantiation of a kernel template, naming its
source file (under kernels/), its C++ name expression, its tile, shared memory, grid and the
compile-time checks that tie those host numbers to the device's.

Pure Python (no CuPy import): `check-kernels` compiles every entry on machines without a GPU.
Which instantiation serves a problem in each family: families.py; which family a call takes: the
planner (cupyflash/dispatch).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from cupyflash.catalog import tiles
from cupyflash.catalog.tiles import ELEMENT_TYPES, accum_itemsize, row_stride


@dataclasses.dataclass(frozen=True)
class TiledKernel:
    """What the attention kernels share. Their traits' template arguments are the element type, the
    padded head dim and the tile shape's fields in declaration order; the kernel's are the traits,
    local, block_sparse, then score_mod, varlen and tma up to the last one set. local: the
    instantiation that skips and masks outside a band of keys (causal, sliding-window attention,
    both); block_sparse: the one that walks a block mask's lists; score_mod: softcap, ALiBi and
    dropout (always with local, whose band also covers an unbanded problem); varlen:
    variable-length batches (always with local and score_mod, dense: one instantiation serves
    every varlen problem). tile_override: a tile shape in place of the traits table's (tuning,
    tests). Subclasses give source_file, kernel_name, traits_name, tile, smem_bytes and grid."""

    dtype_name: str
    head_dim: int  # padded
    local: bool
    tile_override: object = None  # None: the traits table's tile
    block_sparse: bool = False
    score_mod: bool = False
    varlen: bool = False

    per_kv_head = False  # grid over query heads (True: over K/V heads, the dK/dV kernels)
    family = "scalar"  # the planner's name for the kernels this one sits among
    arch = None  # the one architecture it is built for (None: sm_80 and newer)
    compile_options = ()

    @functools.cached_property
    def num_threads(self) -> int:
        return 32 * self.tile.num_warps

    @property
    def element_type(self) -> str:
        """The traits' element type: the C++ type of dtype_name (TcFwdKernel's float32: a Tf32 tag)."""
        return ELEMENT_TYPES[self.dtype_name]

    @functools.cached_property
    def traits(self) -> str:
        tile_args = ", ".join(str(x) for x in dataclasses.astuple(self.tile))
        return f"cupyflash::{self.traits_name}<{self.element_type}, {self.head_dim}, {tile_args}>"

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
        return smem_check(self.traits, "kSmemBytes", self.smem_bytes, self.traits_name)


def smem_check(traits: str, constant: str, smem_bytes: int, traits_name: str) -> str:
    return (f"static_assert({traits}::{constant} == {smem_bytes}, "
            f'"cupyflash/catalog and {traits_name} disagree on shared memory");\n')


# --------------------------------------------------------------------------- scalar/


@dataclasses.dataclass(frozen=True)
class FwdKernel(TiledKernel):
    """kernels/scalar/fwd.cu's flash_fwd_kernel."""

    source_file = "scalar/fwd.cu"
    kernel_name = "flash_fwd_kernel"
    traits_name = "FwdTraits"

    @functools.cached_property
    def tile(self) -> tiles.TileShape:
        return self.tile_override or tiles.tile_shape(self.dtype_name, self.head_dim, self.varlen, self.score_mod)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors FwdTraits::kSmemBytes (checked by the static_assert in host_checks()).
        t = self.tile
        stride, p_stride = row_stride(self.dtype_name, self.head_dim), row_stride(self.dtype_name, t.block_n)
        elements = (t.block_m + 2 * t.block_n) * stride + t.block_m * p_stride
        return elements * accum_itemsize(self.dtype_name)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int = 0) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.tile.block_m), heads, batch)


@dataclasses.dataclass(frozen=True)
class DropoutMaskKernel:
    """kernels/scalar/fwd.cu's flash_dropout_mask_kernel: dropout's keep mask as bytes, one thread
    per (query, key), for `cupyflash.dropout_mask`."""

    num_threads: int = 256

    source_file = "scalar/fwd.cu"
    smem_bytes = 0
    dtype_name = "uint8"
    per_kv_head = False
    family = "scalar"
    arch = None
    compile_options = ()

    @functools.cached_property
    def name_expression(self) -> str:
        return f"cupyflash::flash_dropout_mask_kernel<{self.num_threads}>"

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q * seqlen_k / self.num_threads), heads, batch)

    def host_checks(self) -> str:
        return ""


@dataclasses.dataclass(frozen=True)
class BwdDkdvKernel(TiledKernel):
    """kernels/scalar/bwd.cu's flash_bwd_dkdv_kernel: one block per key block."""

    source_file = "scalar/bwd.cu"
    kernel_name = "flash_bwd_dkdv_kernel"
    traits_name = "BwdDkdvTraits"
    per_kv_head = True  # its grid's heads are K/V heads; each block walks its group's query heads

    @functools.cached_property
    def tile(self) -> tiles.DkdvTileShape:
        return self.tile_override or tiles.dkdv_tile_shape(self.dtype_name, self.head_dim,
                                                           self.block_sparse or self.score_mod, self.varlen)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors BwdDkdvTraits::kSmemBytes: K_j, V_j, Q_i, dO_i, P^T, dS^T, dS, lse_i, D_i.
        t, name = self.tile, self.dtype_name
        stride = row_stride(name, self.head_dim)
        elements = (2 * (t.block_n + t.block_m) * stride + 2 * t.block_n * row_stride(name, t.block_m)
                    + t.block_m * row_stride(name, t.block_n) + 2 * t.block_m)
        return elements * accum_itemsize(name)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_k / self.tile.block_n), heads, batch)


@dataclasses.dataclass(frozen=True)
class BwdDqKernel(TiledKernel):
    """kernels/scalar/bwd.cu's flash_bwd_dq_kernel (deterministic mode): one block per query block."""

    source_file = "scalar/bwd.cu"
    kernel_name = "flash_bwd_dq_kernel"
    traits_name = "BwdDqTraits"

    @functools.cached_property
    def tile(self) -> tiles.TileShape:
        return self.tile_override or tiles.dq_tile_shape(self.dtype_name, self.head_dim, self.varlen)

    @functools.cached_property
    def smem_bytes(self) -> int:
        # Mirrors BwdDqTraits::kSmemBytes: Q_i, dO_i, K_j, V_j, dS_ij.
        t, name = self.tile, self.dtype_name
        elements = 2 * (t.block_m + t.block_n) * row_stride(name, self.head_dim)
        elements += t.block_m * row_stride(name, t.block_n)
        return elements * accum_itemsize(name)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.tile.block_m), heads, batch)


# --------------------------------------------------------------------------- rows/

MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (and z)
BWD_ROW_STEPS = ("preprocess", "convert_dq")


@dataclasses.dataclass(frozen=True)
class BwdRowKernel:
    """A row pass of kernels/rows/bwd_rows.cu (a group of lanes per query row, its RowGroups):
    "preprocess" (D_i, lse_i in log2 units) or "convert_dq" (the dQ workspace rounded to the input
    dtype)."""

    step: str
    dtype_name: str
    # kRowsPerBlock (8 per warp: RowGroups) and kHeadsFastest (the launch takes the heads of a
    # block of rows in turn, so blocks in flight read neighbouring parts of the same rows of O, dO
    # and the workspace): heads fastest took 4.5 us off the preprocess and 2.5 off the conversion at
    # d64 s16384 on an H200 (about 5% and 4%), and was within noise elsewhere; 64 or 128 rows were
    # no faster. Heads fastest puts the row blocks on the grid's y axis: `families.bwd_row_kernel`
    # takes it where they fit.
    rows_per_block: int = 32
    heads_fastest: bool = True

    source_file = "rows/bwd_rows.cu"
    num_threads = 128  # kRowThreads
    smem_bytes = 0
    per_kv_head = False
    family = "rows"
    arch = None
    compile_options = ()

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
                f'"cupyflash/catalog and rows/bwd_rows.cu disagree on the row kernels\' threads");\n')
