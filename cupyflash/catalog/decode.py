"""Kernel descriptors of KV-cache decoding (kernels/decode/: decode.cu, cuda_cores.cu). Decoding
reads the whole cache for a handful of query rows, so its tiles are chosen for bytes in flight, not
for FLOPs: the tensor-core kernel keeps kStages - 1 tiles of K and V (64 keys each) loading while
one is used, as the CUDA-core kernel for one row does (`DecodeStagedKernel`); the kernels pack a
GQA group's heads and the query positions into the rows of one tile (`DecodeLayout`)."""

from __future__ import annotations

import dataclasses
import functools

from cupyflash.catalog import tiles
from cupyflash.catalog.tiles import DECODE_MAX_SPLITS, DECODE_WARPS, ELEMENT_TYPES, accum_itemsize, itemsize


@dataclasses.dataclass(frozen=True)
class DecodeKernelBase:
    """What the two decode kernels share: one instantiation per (dtype, padded head dim), whose
    traits' template arguments and shared memory the subclasses give (`traits_args`, `smem_bytes`)."""

    dtype_name: str
    head_dim: int  # padded
    score_mod: bool = False  # softcap / ALiBi: the kernels' kScoreMod instantiation

    source_file = "decode/decode.cu"
    num_threads = 32 * DECODE_WARPS
    per_kv_head = False
    arch = None
    compile_options = ()

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
                f'"cupyflash/catalog and {self.traits_name} disagree on shared memory");\n'
                f"static_assert(cupyflash::kDecodeMaxSplits == {DECODE_MAX_SPLITS}, "
                f'"cupyflash/catalog and decode/decode.cuh disagree on the most splits");\n')


@dataclasses.dataclass(frozen=True)
class TcDecodeKernel(DecodeKernelBase):
    """flash_decode_tc_kernel: 16 packed rows per block, the keys split over warps and blocks."""

    kernel_name = "flash_decode_tc_kernel"
    traits_name = "TcDecodeTraits"
    family = "sm80"
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
        tile_bytes = (self.rows + 2 * self.stages * self.block_n) * (self.head_dim + 8) * 2
        return max(tile_bytes, self.merge_bytes())


@dataclasses.dataclass(frozen=True)
class DecodeKernel(DecodeKernelBase):
    """flash_decode_kernel (CUDA cores, every dtype): `rows` packed rows per block (one of
    tiles.DECODE_ROW_BLOCKS below tiles.decode_rows, or that: tiles.decode_row_block picks it), a
    key per lane, K staged through a ring of chunks per warp."""

    rows: int = 0  # 0: the most, tiles.decode_rows

    kernel_name = "flash_decode_kernel"
    traits_name = "DecodeTraits"
    family = "scalar"
    source_file = "decode/cuda_cores.cu"
    block_n = 32 * DECODE_WARPS

    def __post_init__(self):
        most = tiles.decode_rows(self.dtype_name, self.head_dim)
        if self.rows == 0:
            object.__setattr__(self, "rows", most)
        elif self.rows != most and (self.rows not in tiles.DECODE_ROW_BLOCKS or self.rows > most):
            raise ValueError(f"no {self.rows}-row CUDA-core decode build for {self.dtype_name} d{self.head_dim}")

    @property
    def traits_args(self) -> tuple:
        return self.rows, DECODE_WARPS

    k_stages = 3  # DecodeTraits::kKStages: each warp's ring of K chunks

    @functools.cached_property  # on every decoding step's launch path
    def smem_bytes(self) -> int:
        # Mirrors DecodeTraits::kSmemBytes: Q [rows][d] in Accum, then each warp's ring of K chunks
        # (32 keys x up to 128 bytes of columns dividing d, padded by 16 bytes), or the warps' merge.
        size = itemsize(self.dtype_name)
        cols = 128 // size
        while self.head_dim % cols:
            cols //= 2
        q_bytes = -(-self.rows * self.head_dim * accum_itemsize(self.dtype_name) // 16) * 16
        ring_bytes = DECODE_WARPS * self.k_stages * 32 * (cols * size + 16)
        return max(q_bytes + ring_bytes, self.merge_bytes())


@dataclasses.dataclass(frozen=True)
class DecodeStagedKernel(DecodeKernelBase):
    """flash_decode_staged_kernel (CUDA cores, every dtype): one packed row per block (one query
    row per K/V head), K and V tiles of about 8 KiB each in a ring of `stages`."""

    kernel_name = "flash_decode_staged_kernel"
    traits_name = "DecodeStagedTraits"
    family = "scalar"
    source_file = "decode/cuda_cores.cu"
    rows = 1
    stages = 4

    @functools.cached_property
    def block_n(self) -> int:
        # Mirrors decode_warp_keys: a power of two up to 32 keys a warp, a K tile within 8 KiB.
        keys = 32
        while keys > 1 and keys * DECODE_WARPS * self.head_dim * itemsize(self.dtype_name) > 8 * 1024:
            keys //= 2
        return keys * DECODE_WARPS

    @property
    def traits_args(self) -> tuple:
        return DECODE_WARPS, self.stages

    @functools.cached_property  # on every decoding step's launch path
    def smem_bytes(self) -> int:
        # Mirrors DecodeStagedTraits::kSmemBytes: Q [1][d] in Accum, then kStages x (K_j, V_j) with
        # rows padded by kPadChunks 16-byte chunks; or the warps' merge.
        size = itemsize(self.dtype_name)
        chunk = 16 // size
        lanes, row_chunks = 32 * DECODE_WARPS // self.block_n, self.head_dim // chunk
        pad = 0 if lanes >= 8 or row_chunks < 8 else (lanes - row_chunks) % 8
        tile_bytes = self.block_n * (self.head_dim + pad * chunk) * size
        q_bytes = -(-self.rows * self.head_dim * accum_itemsize(self.dtype_name) // 16) * 16
        return max(q_bytes + self.stages * 2 * tile_bytes, self.merge_bytes())

    def host_checks(self) -> str:
        return super().host_checks() + (f"static_assert({self.traits}::kBlockN == {self.block_n}, "
                                        f'"cupyflash/catalog and {self.traits_name} disagree on the key tile");\n')


@dataclasses.dataclass(frozen=True)
class DecodeAppendKernel:
    """flash_decode_append_kernel: new keys and values copied into the caches before a step."""

    dtype_name: str

    source_file = "decode/decode.cu"
    smem_bytes = 0
    head_dim = 0  # any
    num_threads = 128
    per_kv_head = False
    family = "decode"
    arch = None
    compile_options = ()

    @functools.cached_property
    def name_expression(self) -> str:
        return f"cupyflash::flash_decode_append_kernel<{ELEMENT_TYPES[self.dtype_name]}>"

    def host_checks(self) -> str:
        return ""
