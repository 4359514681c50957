"""The host's images of the kernels' argument structs (kernels/common/params.cuh,
kernels/decode/decode.cuh) as NumPy structured dtypes, and the checks compiled into every module
that the two layouts agree."""

from __future__ import annotations

import numpy

# The block mask's shape fields, then the score modifiers', at the end of both structs (zero for
# dense attention with no softcap or ALiBi).
_MASK_FIELDS = [("mask_batch_stride", "i8"), ("mask_head_stride", "i8")] + [
    (name, "i4") for name in ("mask_q_blocks", "mask_k_blocks", "mask_block_q", "mask_block_k")
] + [("softcap_log2", "f8"), ("alibi_slopes", "u8"), ("alibi_batch_stride", "i8")]

# Variable-length batches' pointers, last in both structs (zero: a fixed-length batch).
_VARLEN_FIELDS = [("cu_seqlens_q", "u8"), ("cu_seqlens_k", "u8"), ("seqused_k", "u8")]

# Dropout's, after those (zero: no dropout, dropout_rescale 1; dropout_state: nullptr, the seed and
# offset by value).
_DROPOUT_FIELDS = [("dropout_seed", "u8"), ("dropout_offset", "u4"), ("dropout_threshold", "u4"),
                   ("dropout_rescale", "f8"), ("dropout_state", "u8")]

# The problem's int fields, after the pointers and strides of both structs.
_SHAPE_FIELDS = ("heads", "seqlen_q", "seqlen_k", "head_dim", "kv_group", "band_first", "band_last")

# struct FwdParams; align=True gives C's layout.
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

# struct BwdParams.
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

# struct DecodeParams.
DECODE_PARAMS_DTYPE = numpy.dtype(
    [(name, "u8") for name in ("q", "k", "v", "k_new", "v_new", "o", "lse", "o_partial", "lse_partial", "cache_seqlens")]
    + [(f"{t}_{s}_stride", "i8") for t in ("q", "k", "v", "k_new", "v_new", "o") for s in ("batch", "row", "head")]
    + [(name, "i4") for name in ("batch", "heads", "kv_group", "seqlen_q", "cache_len", "seqlen_new", "head_dim")]
    + [(name, "i4") for name in ("window_left", "window_right", "num_splits", "rows")]
    + [("scale_log2", "f8"), ("softcap_log2", "f8"), ("alibi_slopes", "u8"), ("alibi_batch_stride", "i8")]
    + [("split_counters", "u8")],
    align=True,
)

STRUCTS = {"cupyflash::FwdParams": FWD_PARAMS_DTYPE, "cupyflash::BwdParams": BWD_PARAMS_DTYPE,
           "cupyflash::DecodeParams": DECODE_PARAMS_DTYPE}


def structs_of(source_file: str) -> tuple[str, ...]:
    """The argument structs a kernel source defines (decode's own, or the attention kernels' two)."""
    if source_file.startswith("decode/"):
        return ("cupyflash::DecodeParams",)
    return ("cupyflash::FwdParams", "cupyflash::BwdParams")


def size_check(struct: str) -> str:
    """A static_assert that `struct` has the host dtype's size (in every compiled module)."""
    return f'static_assert(sizeof({struct}) == {STRUCTS[struct].itemsize}, "{struct}: size differs from the host");\n'


def layout_probe(struct: str) -> str:
    """A kernel writing each field's offset, in dtype order, for the GPU test that compares them
    with the host layout (offsetof is not a compile-time builtin in every NVRTC)."""
    lines = ['extern "C" __global__ void params_layout_probe(long long* offsets) {', f"    {struct} p{{}};"]
    for i, name in enumerate(STRUCTS[struct].names):
        lines.append(
            f"    offsets[{i}] = reinterpret_cast<const char*>(&p.{name}) - reinterpret_cast<const char*>(&p);"
        )
    return "\n".join(lines) + "\n}\n"
