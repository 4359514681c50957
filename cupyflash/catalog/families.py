"""The instantiation list, and which instantiation of each kernel family serves a problem.

A family is a set of kernels built the same way: "scalar" (CUDA cores, every dtype), "sm80"
(mma.sync, sm_80 and newer: 16-bit, float32's forward as TF32 products, float64's forward and
dK/dV on DMMA), "sm90" (wgmma,
16-bit, sm_90a; one block per tile with cp.async copies), "sm90-tma" (its TMA builds) and
"sm90-ws" (the warp-specialised, persistent TMA kernels). Which family a call takes is the
planner's decision (cupyflash/dispatch/plan.py); this module only says which instantiation serves
a problem in a family, or that the family has none for it (`Unavailable`, with the reason).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from cupyflash.catalog import tiles
from cupyflash.catalog.decode import DecodeAppendKernel, DecodeKernel, DecodeStagedKernel, TcDecodeKernel
from cupyflash.catalog.specs import (
    BWD_ROW_STEPS, MAX_GRID_Y, BwdDkdvKernel, BwdDqKernel, BwdRowKernel, DropoutMaskKernel, FwdKernel,
)
from cupyflash.catalog.tensor_cores import (
    TcBwdDkdvKernel, TcBwdDqKernel, TcFwdKernel, WgmmaBwdDkdvKernel, WgmmaFwdKernel, WgmmaFwdWsKernel,
)

FAMILIES = ("sm90-ws", "sm90-tma", "sm90", "sm80", "scalar")  # fastest first


class Unavailable(ValueError):
    """A family has no build for a problem (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """The kernel template's flags a problem needs: local (causal, windows), block_sparse, score_mod
    (softcap, ALiBi, dropout) and varlen (packed or padded sequences)."""

    local: bool = False
    block_sparse: bool = False
    score_mod: bool = False
    varlen: bool = False

    def built(self) -> Variant:
        """The instantiation that serves it: the score modifiers' includes local, the
        variable-length one both (one instantiation serves every variable-length problem)."""
        if self.varlen and self.block_sparse:
            raise Unavailable("variable-length batches have no block-sparse kernels")
        mod = self.score_mod or self.varlen
        return Variant(self.local or mod, self.block_sparse, mod, self.varlen)


def _variants() -> list[Variant]:
    """Every instantiated variant: score_mod only with local, which keeps the score-modifier builds
    at half the others'; varlen once, with local and score_mod."""
    fixed = [Variant(local, sparse, mod) for local in (False, True) for sparse in (False, True)
             for mod in ((False, True) if local else (False,))]
    return fixed + [Variant(True, False, True, True)]


def _sm90_head_dim(dtype_name: str, head_dim: int, family: str) -> int:
    d = tiles.padded_head_dim(head_dim)
    if dtype_name not in tiles.TENSOR_CORE_DTYPES:
        raise Unavailable(f"takes float16 or bfloat16, not {dtype_name}")
    if d not in tiles.WGMMA_HEAD_DIMS:
        raise Unavailable(f"builds at head dims padded to {tiles.WGMMA_HEAD_DIMS} only, not {d}")
    return d


@functools.cache  # on every call's planning path: one object per instantiation, its properties cached
def forward_kernel(family: str, dtype_name: str, head_dim: int, variant: Variant = Variant(),
                   precision: str = "highest"):
    """The forward instantiation of `family` for a problem; Unavailable if the family has none.
    precision: float32's (tiles.FLOAT32_PRECISIONS); "highest" keeps float32 on CUDA cores."""
    v = variant.built()
    d = tiles.padded_head_dim(head_dim)
    fields = dict(block_sparse=v.block_sparse, score_mod=v.score_mod, varlen=v.varlen)
    if family == "scalar":
        return FwdKernel(dtype_name, d, v.local, **fields)
    if family == "sm80" and dtype_name in tiles.TF32_FORWARD_DTYPES:
        if precision not in tiles.TF32_PASSES:
            raise Unavailable(f"float32 at precision {precision!r} computes on CUDA cores")
        if d > tiles.TF32_MAX_HEAD_DIM:
            raise Unavailable(f"TF32 builds at head dims up to {tiles.TF32_MAX_HEAD_DIM} only, not {d}")
        return TcFwdKernel(dtype_name, d, v.local, precision=precision, **fields)
    if family == "sm80" and dtype_name in tiles.F64_FORWARD_DTYPES:
        if d > tiles.F64_MAX_HEAD_DIM:
            raise Unavailable(f"float64 builds at head dims up to {tiles.F64_MAX_HEAD_DIM} only, not {d}")
        return TcFwdKernel(dtype_name, d, v.local, **fields)
    if dtype_name not in tiles.TENSOR_CORE_DTYPES:
        raise Unavailable(f"the tensor-core kernels take float16 or bfloat16, not {dtype_name}")
    if family == "sm80":
        return TcFwdKernel(dtype_name, d, v.local, **fields)
    d = _sm90_head_dim(dtype_name, head_dim, family)
    if family == "sm90":
        return WgmmaFwdKernel(dtype_name, d, v.local, **fields)
    if v.varlen:
        raise Unavailable("no builds for variable lengths")
    if family == "sm90-tma":
        if v.score_mod and d not in tiles.TMA_SCORE_MOD_HEAD_DIMS:
            raise Unavailable(f"no build with softcap, ALiBi or dropout at head dim {d} (its registers spill)")
        return WgmmaFwdKernel(dtype_name, d, v.local, block_sparse=v.block_sparse, score_mod=v.score_mod, tma=True)
    if family == "sm90-ws":
        if v.score_mod:
            raise Unavailable("no builds with softcap, ALiBi or dropout")
        if v.local:
            raise Unavailable("no causal or windowed build")
        return WgmmaFwdWsKernel(dtype_name, d, False, block_sparse=v.block_sparse)
    raise ValueError(f"unknown kernel family {family!r}")


@functools.cache
def dkdv_kernel(family: str, dtype_name: str, head_dim: int, variant: Variant = Variant(), large_smem: bool = False):
    """The backward's dK/dV instantiation of `family`; large_smem (sm80): the tiles for an H100's
    shared memory. Unavailable if the family has none."""
    v = variant.built()
    d = tiles.padded_head_dim(head_dim)
    fields = dict(block_sparse=v.block_sparse, score_mod=v.score_mod, varlen=v.varlen)
    if family == "scalar":
        return BwdDkdvKernel(dtype_name, d, v.local, **fields)
    if family == "sm80" and dtype_name in tiles.F64_FORWARD_DTYPES:
        if d > tiles.F64_MAX_HEAD_DIM:
            raise Unavailable(f"float64 builds at head dims up to {tiles.F64_MAX_HEAD_DIM} only, not {d}")
        if d > 64 and not large_smem:
            raise Unavailable("float64 builds above head dim 64 need an H100's shared memory")
        return TcBwdDkdvKernel(dtype_name, d, v.local, large_smem=large_smem, **fields)
    if dtype_name not in tiles.TENSOR_CORE_DTYPES:
        raise Unavailable(f"the tensor-core kernels take float16 or bfloat16, not {dtype_name}")
    if family == "sm80":
        if v.varlen and d == 224:
            d = 256  # the variable-length kernel's d224 tiles have no column split (tc_dkdv_tile_shape)
        return TcBwdDkdvKernel(dtype_name, d, v.local, large_smem=large_smem, **fields)
    d = _sm90_head_dim(dtype_name, head_dim, family)
    if family == "sm90":
        return WgmmaBwdDkdvKernel(dtype_name, d, v.local, **fields)
    if v.score_mod or v.varlen:
        raise Unavailable("no builds with softcap, ALiBi, dropout or variable lengths")
    if family == "sm90-tma":
        return WgmmaBwdDkdvKernel(dtype_name, d, v.local, block_sparse=v.block_sparse, tma=True)
    if family == "sm90-ws":
        return WgmmaBwdDkdvKernel(dtype_name, d, v.local, block_sparse=v.block_sparse, tma=True, ws=True)
    raise ValueError(f"unknown kernel family {family!r}")


@functools.cache
def dq_kernel(tensor_cores: bool, dtype_name: str, head_dim: int, variant: Variant = Variant()):
    """The deterministic backward's dQ instantiation: the mma.sync one beside every tensor-core dK/dV
    kernel (tensor_cores), else the scalar one."""
    v = variant.built()
    d = tiles.padded_head_dim(head_dim)
    fields = dict(block_sparse=v.block_sparse, score_mod=v.score_mod, varlen=v.varlen)
    if tensor_cores:
        if dtype_name not in tiles.TENSOR_CORE_DTYPES:
            raise Unavailable(f"the tensor-core kernels take float16 or bfloat16, not {dtype_name}")
        if v.varlen and d == 224:
            d = 256  # as dkdv_kernel's
        return TcBwdDqKernel(dtype_name, d, v.local, **fields)
    return BwdDqKernel(dtype_name, d, v.local, **fields)


def bwd_row_kernel(step: str, dtype_name: str, seqlen_q: int) -> BwdRowKernel:
    """The row pass for `step`: heads fastest unless seqlen_q's blocks of rows overflow gridDim.y
    (more than about two million queries a sequence)."""
    kernel = BwdRowKernel(step, dtype_name)
    if math.ceil(seqlen_q / kernel.rows_per_block) > MAX_GRID_Y:
        return dataclasses.replace(kernel, heads_fastest=False)
    return kernel


def decode_kernel(dtype_name: str, head_dim: int, tensor_cores: bool = False, score_mod: bool = False,
                  one_row: bool = False, rows: int = 16):
    """The decode kernel: TcDecodeKernel with tensor_cores (16-bit only), else DecodeStagedKernel
    for one row per K/V head (one_row) and DecodeKernel for more, built for `rows` rows a K/V head
    (tiles.decode_row_block); their score-modifier (softcap, ALiBi) instantiation with score_mod."""
    if tensor_cores and dtype_name not in tiles.TENSOR_CORE_DTYPES:
        raise Unavailable(f"the tensor-core decode kernel takes float16 or bfloat16, not {dtype_name}")
    d = tiles.padded_head_dim(head_dim)
    if tensor_cores or one_row:
        return (TcDecodeKernel if tensor_cores else DecodeStagedKernel)(dtype_name, d, score_mod)
    return DecodeKernel(dtype_name, d, score_mod, tiles.decode_row_block(dtype_name, d, rows))


def _wide_kernels(dtype_name: str, head_dim: int, variant: Variant) -> list:
    """The sm80 instantiations of a float32 problem (the forward, one per TF32 precision) or a
    float64 one (DMMA: the forward, and the dK/dV kernel for either shared-memory size); none for
    other dtypes or past their largest head dim."""
    d = tiles.padded_head_dim(head_dim)
    if dtype_name in tiles.TF32_FORWARD_DTYPES and d <= tiles.TF32_MAX_HEAD_DIM:
        return [forward_kernel("sm80", dtype_name, head_dim, variant, precision) for precision in tiles.TF32_PASSES]
    if dtype_name in tiles.F64_FORWARD_DTYPES and d <= tiles.F64_MAX_HEAD_DIM:
        kernels = [forward_kernel("sm80", dtype_name, head_dim, variant)]
        for large in (False, True):
            try:
                kernels.append(dkdv_kernel("sm80", dtype_name, head_dim, variant, large))
            except Unavailable:
                pass
        return kernels
    return []


@functools.cache  # on every block-sparse call's path; it depends only on these two values
def block_mask_granularity(dtype_name: str, head_dim: int) -> tuple[int, int]:
    """(queries, keys): what a block mask's block size must be a multiple of for this dtype and
    head dim, the largest tile of every kernel that may run it (every family, either
    shared-memory table), so that each kernel tile lies in one mask block, whatever the GPU."""
    kernels = []
    for v in _variants():
        if v.varlen:  # no block-sparse form
            continue
        v = dataclasses.replace(v, block_sparse=True)
        for family in FAMILIES:
            for make in (forward_kernel, dkdv_kernel):
                try:
                    kernels.append(make(family, dtype_name, head_dim, v))
                except Unavailable:
                    pass
        kernels += _wide_kernels(dtype_name, head_dim, v)
        if dtype_name in tiles.TENSOR_CORE_DTYPES:
            kernels.append(dkdv_kernel("sm80", dtype_name, head_dim, v, large_smem=True))
        kernels.append(dq_kernel(dtype_name in tiles.TENSOR_CORE_DTYPES, dtype_name, head_dim, v))
        kernels.append(dq_kernel(False, dtype_name, head_dim, v))
    return max(k.tile.block_m for k in kernels), max(k.tile.block_n for k in kernels)


# --------------------------------------------------------------------------- the instantiation list


def _attention_kernels() -> list:
    kernels = [DropoutMaskKernel()]
    kernels += [BwdRowKernel(step, dtype_name, heads_fastest=fastest)
                for dtype_name in tiles.DTYPE_NAMES for step in BWD_ROW_STEPS for fastest in (True, False)]
    for dtype_name in tiles.DTYPE_NAMES:
        tensor_cores = dtype_name in tiles.TENSOR_CORE_DTYPES
        for d in tiles.PADDED_HEAD_DIMS:
            for v in _variants():
                kernels += [forward_kernel("scalar", dtype_name, d, v), dkdv_kernel("scalar", dtype_name, d, v),
                            dq_kernel(False, dtype_name, d, v)]
                kernels += _wide_kernels(dtype_name, d, v)
                if not tensor_cores:
                    continue
                kernels += [forward_kernel("sm80", dtype_name, d, v), dq_kernel(True, dtype_name, d, v)]
                kernels += [dkdv_kernel("sm80", dtype_name, d, v, large) for large in (False, True)]
                for family in ("sm90", "sm90-tma", "sm90-ws"):
                    for make in (forward_kernel, dkdv_kernel):
                        try:
                            kernels.append(make(family, dtype_name, d, v))
                        except Unavailable:
                            pass
    return kernels


def _decode_kernels() -> list:
    kernels = [DecodeKernel(name, d, mod, tiles.decode_row_block(name, d, rows)) for name in tiles.DTYPE_NAMES
               for d in tiles.PADDED_HEAD_DIMS for mod in (False, True) for rows in tiles.DECODE_ROW_BLOCKS]
    kernels += [TcDecodeKernel(name, d, mod) for name in tiles.TENSOR_CORE_DTYPES for d in tiles.PADDED_HEAD_DIMS
                for mod in (False, True)]
    kernels += [DecodeStagedKernel(name, d, mod) for name in tiles.DTYPE_NAMES for d in tiles.PADDED_HEAD_DIMS
                for mod in (False, True)]
    return kernels + [DecodeAppendKernel(name) for name in tiles.DTYPE_NAMES]


@functools.cache
def _all_kernels() -> tuple:
    unique = {}
    for k in _attention_kernels() + _decode_kernels():
        unique.setdefault(k, k)
    return tuple(unique)


def all_kernels(arch: str | None = None) -> list:
    """Every instantiation, once: what `check-kernels` and the compile tests build; with arch
    (e.g. "sm_80", "sm_90a"), those that can run on it (`runs_on`)."""
    kernels = list(_all_kernels())
    return kernels if arch is None else [k for k in kernels if runs_on(k, arch)]


def runs_on(kernel, arch: str) -> bool:
    """Whether `kernel` can be chosen on a GPU of this architecture: the dK/dV tiles for an
    H100's shared memory (large_smem) only on sm_90 and newer, the GPUs that have it; the Hopper
    kernels (wgmma, built for sm_90a) only on sm_90a."""
    version = re.fullmatch(r"sm_(\d+)a?", arch)
    if kernel.arch is not None:
        return arch == kernel.arch
    return not getattr(kernel, "large_smem", False) or (version is not None and int(version.group(1)) >= 90)
