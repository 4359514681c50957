"""The one list of kernel instantiations, and the host's mirror of the kernels' argument layout.

Pure Python (no CuPy import): the NumPy tiled reference follows the same block schedule, and
`check-kernels` compiles every entry on machines without a GPU.

The C++ traits (kernels/flash_fwd_traits.cuh) derive everything from the template arguments chosen
here. Where the host must know a derived number (shared-memory bytes, the FwdParams layout), the
compiled source carries a static_assert that the host's number is the device's, so the two cannot
drift apart silently.
"""

from __future__ import annotations

import dataclasses
import math

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
def tile_shape(dtype_name: str, padded_head_dim: int) -> TileShape:
    if accum_itemsize(dtype_name) == 4:
        if padded_head_dim <= 64:
            return TileShape(64, 32, num_warps=4, rows_per_thread=4, min_blocks_per_sm=2)
        if padded_head_dim <= 128:
            return TileShape(128, 32, num_warps=8, rows_per_thread=8, min_blocks_per_sm=1)
        return TileShape(64, 32, num_warps=8, rows_per_thread=4, min_blocks_per_sm=1)
    if padded_head_dim <= 64:
        return TileShape(64, 32, num_warps=8, rows_per_thread=4, min_blocks_per_sm=2)
    if padded_head_dim <= 128:
        return TileShape(64, 16, num_warps=4, rows_per_thread=4, min_blocks_per_sm=2)
    return TileShape(32, 16, num_warps=4, rows_per_thread=4, min_blocks_per_sm=1)


def padded_head_dim(head_dim: int) -> int:
    for d in PADDED_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


@dataclasses.dataclass(frozen=True)
class FwdKernel:
    """One instantiation of kernels/flash_fwd.cu's flash_fwd_kernel."""

    dtype_name: str
    head_dim: int  # padded
    causal: bool
    tile_override: TileShape | None = None  # for tuning experiments; None: the traits table

    @property
    def tile(self) -> TileShape:
        return self.tile_override or tile_shape(self.dtype_name, self.head_dim)

    @property
    def num_threads(self) -> int:
        return 32 * self.tile.num_warps

    @property
    def traits(self) -> str:
        t = self.tile
        return (
            f"cupyflash::FwdTraits<{ELEMENT_TYPES[self.dtype_name]}, {self.head_dim}, "
            f"{t.block_m}, {t.block_n}, {t.num_warps}, {t.rows_per_thread}, {t.min_blocks_per_sm}>"
        )

    @property
    def name_expression(self) -> str:
        return f"cupyflash::flash_fwd_kernel<{self.traits}, {'true' if self.causal else 'false'}>"

    @property
    def smem_bytes(self) -> int:
        # Mirrors FwdTraits::kSmemBytes (checked by the static_assert in host_checks()).
        t, size = self.tile, accum_itemsize(self.dtype_name)
        pad = 16 // size
        qkv_stride, p_stride = self.head_dim + pad, t.block_n + pad
        elements = (t.block_m + 2 * t.block_n) * qkv_stride + t.block_m * p_stride
        return elements * size

    def grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.tile.block_m), heads, batch)

    def host_checks(self) -> str:
        return (
            f"static_assert({self.traits}::kSmemBytes == {self.smem_bytes}, "
            f'"cupyflash/_instantiations.py and FwdTraits disagree on shared memory");\n'
        )


def fwd_kernel(dtype_name: str, head_dim: int, causal: bool) -> FwdKernel:
    return FwdKernel(dtype_name, padded_head_dim(head_dim), bool(causal))


def all_fwd_kernels() -> list[FwdKernel]:
    return [
        FwdKernel(dtype_name, d, causal)
        for dtype_name in DTYPE_NAMES
        for d in PADDED_HEAD_DIMS
        for causal in (False, True)
    ]


# The host's image of struct FwdParams (kernels/flash_fwd.cuh); align=True gives C's layout.
FWD_PARAMS_DTYPE = numpy.dtype(
    [("q", "u8"), ("k", "u8"), ("v", "u8"), ("o", "u8"), ("lse", "u8")]
    + [(f"{t}_{s}_stride", "i8") for t in "qkvo" for s in ("batch", "row", "head")]
    + [("heads", "i4"), ("seqlen_q", "i4"), ("seqlen_k", "i4"), ("head_dim", "i4")]
    + [("scale_log2", "f8")],
    align=True,
)


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
