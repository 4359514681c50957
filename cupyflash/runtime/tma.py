"""Tensor maps for the Hopper kernels' TMA builds: the forward's (kernels/sm90/fwd.cu, fwd_ws.cu)
and the dK/dV kernel's (kernels/sm90/bwd_dkdv.cu, bwd_dkdv_ws.cu).

A tensor map (CUDA's CUtensorMap: 128 opaque bytes) tells the tensor memory accelerator how a
tensor lies in global memory and which box one copy moves between it and shared memory. The driver
makes it (`cuTensorMapEncodeTiled`, reached through ctypes: CuPy does not wrap it). The forward
takes K's and V's as one 256-byte `KvTensorMaps` argument (its warp-specialised kernel Q's, K's,
V's and O's as a 512-byte `FwdWsTensorMaps`); the dK/dV kernel takes a 384-byte
`BwdTensorMaps`: its float32 dQ workspace's, into which the TMA adds dQ_i's shares, then Q's and
dO's, from which it loads Q_i and dO_i.

Each map is 4-D, innermost first: (head dim, keys or queries, heads, batch), with the arrays' own
byte strides, so strided views need no copy. K's and V's box (and Q's and dO's) is one 64-column
panel (128 bytes, the widest the 128-byte swizzle allows) by a key (query) block's rows; rows past
the sequence, and columns past the head dim, read as zeros. TMA needs a 16-byte-aligned base and
strides that are positive multiples of 16 bytes: the map functions return None for arrays outside
that (odd head dims' rows, some views), or that the driver declines, and those problems keep the
build without TMA (cp.async copies; atomic dQ adds).
"""

from __future__ import annotations

import ctypes
import functools

import numpy

# cuda.h's enumerators.
_DATA_TYPE = {"float16": 6, "float32": 7, "bfloat16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _FLOAT32, _BFLOAT16
_ITEMSIZE = {"float16": 2, "float32": 4, "bfloat16": 2}
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as zeros

TENSOR_MAP_BYTES = 128
PANEL_COLUMNS = 64  # 16-bit elements in a 128-byte swizzled panel row (sm90/traits.cuh)

DQ_BOX = (32, 64)  # float32 columns (128 bytes) x queries: WgmmaBwdDkdvTraits' dQ boxes

# What the Hopper kernels' cp.async builds receive for the arguments they ignore: the forward's
# KvTensorMaps, the dK/dV kernel's BwdTensorMaps.
NO_MAPS = numpy.zeros(2 * TENSOR_MAP_BYTES, numpy.uint8)
NO_BWD_MAPS = numpy.zeros(3 * TENSOR_MAP_BYTES, numpy.uint8)


@functools.cache
def _encode_tiled():
    lib = ctypes.CDLL("libcuda.so.1")
    encode = lib.cuTensorMapEncodeTiled
    u64_4, u64_3, u32_4 = ctypes.c_uint64 * 4, ctypes.c_uint64 * 3, ctypes.c_uint32 * 4
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64_4, u64_3, u32_4, u32_4,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    encode.restype = ctypes.c_int
    return encode, u64_4, u64_3, u32_4


def describable(pointer: int, itemsize: int, strides: tuple[int, int, int], dims: tuple[int, int, int]) -> bool:
    """Whether TMA can describe a (batch, keys, heads, head dim) array: pointer 16-byte aligned and,
    for each of batch, keys and heads with more than one entry, a positive byte stride that is a
    multiple of 16 and below 2^40. `strides` and `dims` are (batch, row, head) in elements."""
    if pointer % 16:
        return False
    return all(n == 1 or (0 < s * itemsize < 1 << 40 and s * itemsize % 16 == 0) for s, n in zip(strides, dims))


def _tensor_map(pointer: int, dtype_name: str, head_dim: int, strides: tuple, dims: tuple,
                box: tuple[int, int]) -> bytes | None:
    """One map: `strides` and `dims` are (batch, row, head) in elements, head_dim the true head dim,
    box (columns, rows). None where the driver declines it (a rule `describable` does not know)."""
    encode, u64_4, u64_3, u32_4 = _encode_tiled()
    itemsize = _ITEMSIZE[dtype_name]
    batch, rows, heads = dims
    # A dimension of one entry has no stride that matters; TMA still wants a valid one.
    byte_strides = [s * itemsize if n > 1 else 16 for s, n in zip(strides, dims)]
    out = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 64)
    address = ctypes.addressof(out)
    aligned = address + (-address % 64)  # CUtensorMap is 64-byte aligned
    status = encode(
        aligned, _DATA_TYPE[dtype_name], 4, pointer,
        u64_4(head_dim, rows, heads, batch),
        u64_3(byte_strides[1], byte_strides[2], byte_strides[0]),
        u32_4(box[0], box[1], 1, 1),
        u32_4(1, 1, 1, 1),
        _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZEROS,
    )
    return ctypes.string_at(aligned, TENSOR_MAP_BYTES) if status == 0 else None


@functools.lru_cache(maxsize=256)  # a few arrays a call, a call per layer of a model: see params.LaunchRecord
def _tile_map(pointer: int, strides: tuple, dims: tuple, dtype_name: str, head_dim: int,
              box_rows: int) -> numpy.ndarray | None:
    """One 16-bit array's map, boxes of one panel by box_rows rows; None where the driver declines it."""
    made = _tensor_map(pointer, dtype_name, head_dim, strides, dims, (PANEL_COLUMNS, box_rows))
    return None if made is None else numpy.frombuffer(made, numpy.uint8).copy()


def _tile_maps(fields: dict, arrays: tuple, dtype_name: str, head_dim: int) -> numpy.ndarray | None:
    """The maps of the 16-bit arrays (name, dims, box rows) of the launch's parameter fields
    (pointers and element strides), in that order; None where any one cannot be made. The driver is
    asked only once every array is `describable`."""
    located = [(fields[name], (fields[f"{name}_batch_stride"], fields[f"{name}_row_stride"],
                               fields[f"{name}_head_stride"]), dims, rows) for name, dims, rows in arrays]
    if not all(describable(pointer, 2, strides, dims) for pointer, strides, dims, _ in located):
        return None
    maps = [_tile_map(pointer, strides, dims, dtype_name, head_dim, rows) for pointer, strides, dims, rows in located]
    return None if any(m is None for m in maps) else numpy.concatenate(maps)


def tile_tensor_maps(fields: dict, names: tuple[str, str], dims: tuple[int, int, int], dtype_name: str,
                     head_dim: int, box_rows: int) -> numpy.ndarray | None:
    """Two 16-bit arrays' maps (256 bytes), boxes of box_rows rows, from the launch's parameter
    fields (`names`: ("k", "v") for the forward's KvTensorMaps, ("q", "dout") for BwdTensorMaps'
    last two; pointers and element strides) and dims = (batch, seqlen, heads of those arrays); None
    where TMA cannot describe them (`describable`). Each map is cached on those integers (on every
    call's path): a map holds no reference to the memory it describes."""
    return _tile_maps(fields, tuple((name, dims, box_rows) for name in names), dtype_name, head_dim)


def kv_tensor_maps(fields: dict, dims: tuple[int, int, int], dtype_name: str, head_dim: int,
                   box_rows: int) -> numpy.ndarray | None:
    """K's and V's maps (KvTensorMaps' layout) from the forward's FwdParams fields; dims = (batch,
    seqlen_k, K/V heads). See `tile_tensor_maps`."""
    return tile_tensor_maps(fields, ("k", "v"), dims, dtype_name, head_dim, box_rows)


def fwd_ws_tensor_maps(fields: dict, q_dims: tuple[int, int, int], kv_dims: tuple[int, int, int], dtype_name: str,
                       head_dim: int, q_rows: int, kv_rows: int, o_rows: int) -> numpy.ndarray | None:
    """The warp-specialised forward's maps (512 bytes, FwdWsTensorMaps' layout) from its FwdParams
    fields: Q's with boxes of q_rows queries, q_dims = (batch, seqlen_q, heads); K's and V's as
    `kv_tensor_maps`; O's (q_dims too) with boxes of o_rows queries, through which it stores O.
    None where any of them cannot be made."""
    return _tile_maps(fields, (("q", q_dims, q_rows), ("k", kv_dims, kv_rows), ("v", kv_dims, kv_rows),
                               ("o", q_dims, o_rows)), dtype_name, head_dim)


@functools.lru_cache(maxsize=256)
def _dq_tensor_map(pointer: int, dims: tuple, head_dim: int) -> numpy.ndarray | None:
    batch, rows, heads = dims
    strides = (rows * heads * head_dim, heads * head_dim, head_dim)
    if not describable(pointer, 4, strides, dims):
        return None
    made = _tensor_map(pointer, "float32", head_dim, strides, dims, DQ_BOX)
    return None if made is None else numpy.frombuffer(made, numpy.uint8).copy()


def dq_tensor_map(pointer: int, dims: tuple[int, int, int], head_dim: int) -> numpy.ndarray | None:
    """The map of the backward's float32 dQ workspace (dq_accum: contiguous (batch, seqlen_q, heads,
    head_dim)), through which the Hopper dK/dV kernel's TMA builds add their dQ shares: 4-D like
    K's, boxes `DQ_BOX`; queries past seqlen_q and columns past head_dim are clipped from the
    adds. dims = (batch, seqlen_q, heads). None where TMA cannot describe it (a head dim that is
    not a multiple of 4 leaves rows off 16-byte boundaries). Cached on those integers."""
    return _dq_tensor_map(pointer, dims, head_dim)


def bwd_tensor_maps(fields: dict, dq_accum: int, dims: tuple[int, int, int], dtype_name: str, head_dim: int,
                    box_rows: int, dq_dims: tuple[int, int, int] | None = None) -> numpy.ndarray | None:
    """The Hopper dK/dV kernel's maps (384 bytes, BwdTensorMaps' layout): dq_accum's
    (`dq_tensor_map`, of dq_dims: by default dims), then Q's and dO's with boxes of box_rows
    queries (`tile_tensor_maps`), from the launch's BwdParams fields; dims = (batch, seqlen_q,
    heads). The warp-specialised kernel's dQ ring has dq_dims (1, seqlen_q, its slots x the
    heads of a K/V head's group). None where any of them cannot be made."""
    dq = dq_tensor_map(dq_accum, dq_dims or dims, head_dim)
    if dq is None:
        return None
    q_dout = tile_tensor_maps(fields, ("q", "dout"), dims, dtype_name, head_dim, box_rows)
    return None if q_dout is None else numpy.concatenate([dq, q_dout])
