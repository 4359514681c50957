"""The kernels' argument structs as byte images (catalog/params.py's dtypes), filled from a checked
problem and its arrays, and kept in its prepared launches (`LaunchRecord`, dispatch/plan.py): a
training or inference loop calls with the same shapes, strides, dtypes and options again and
again, and building these images was most of a call's host time."""

from __future__ import annotations

import functools
import math
import threading

import numpy

from cupyflash.cpu import philox
from cupyflash.problem import AttentionProblem, lse_dtype
from cupyflash.runtime import launch
from cupyflash.runtime.workspace import keep_bounded

LOG2E = math.log2(math.e)  # log2(e): the kernels' scores are in base 2


def pointer_and_strides(fields: dict, name: str, x) -> None:
    """x's pointer and (batch, row, head) strides in elements. A packed (total, heads, head_dim)
    array of a variable-length batch gets its row stride as batch stride: the kernels index it
    with a sequence's first row in place of the batch index (sequence_params)."""
    item = x.dtype.itemsize
    strides = x.strides if x.ndim == 4 else x.strides[:1] + x.strides
    fields[name] = x.data.ptr
    fields[f"{name}_batch_stride"] = strides[0] // item
    fields[f"{name}_row_stride"] = strides[1] // item
    fields[f"{name}_head_stride"] = strides[2] // item


def no_array(fields: dict, name: str) -> None:
    """A null pointer and zero strides for an array a launch does not have (decode's k_new, v_new)."""
    fields.update({name: 0, f"{name}_batch_stride": 0, f"{name}_row_stride": 0, f"{name}_head_stride": 0})


def problem_fields(fields: dict, p: AttentionProblem, device_id: int):
    """The problem's fields of FwdParams / BwdParams. Returns the device arrays they point to (ALiBi
    slopes, sequence lengths), which must stay alive until the launches are queued."""
    fields["heads"] = p.heads
    fields["seqlen_q"] = p.seqlen_q
    fields["seqlen_k"] = p.seqlen_k
    fields["head_dim"] = p.head_dim
    fields["kv_group"] = p.kv_group
    fields["band_first"], fields["band_last"] = p.kernel_band()
    fields["scale_log2"] = p.scale * LOG2E
    _mask_fields(fields, p.block_mask, device_id)
    fields["softcap_log2"] = 0.0 if p.softcap is None else p.softcap * LOG2E
    fields["dropout_seed"], fields["dropout_offset"] = p.seed, p.offset
    fields["dropout_state"] = 0  # (a captured torch call writes its own: dispatch/plan.py's _SEED)
    fields["dropout_threshold"] = philox.threshold(p.dropout_p)
    fields["dropout_rescale"] = philox.rescale(p.dropout_p)
    return slopes_fields(fields, p), _varlen_fields(fields, p)


def _varlen_fields(fields: dict, p: AttentionProblem):
    """cu_seqlens_q, cu_seqlens_k, seqused_k (nullptr for a fixed-length batch); returns the device
    arrays, which must stay alive until the launches are queued."""
    import cupy

    fields["cu_seqlens_q"] = fields["cu_seqlens_k"] = fields["seqused_k"] = 0
    arrays = []
    if p.cu_seqlens is not None:
        device_id = cupy.cuda.Device().id
        arrays = [_device_lengths(device_id, cu.tobytes()) for cu in p.cu_seqlens]
        fields["cu_seqlens_q"], fields["cu_seqlens_k"] = (x.data.ptr for x in arrays)
    if p.seqlens_k is not None:
        arrays.append(cupy.asarray(p.seqlens_k))
        fields["seqused_k"] = arrays[-1].data.ptr
    return arrays


@functools.lru_cache(maxsize=64)
def _device_lengths(device_id: int, lengths: bytes):
    """Checked int32 cu_seqlens on the device, kept for the next call with the same lengths (the
    forward and its backward, a benchmark): the upload from pageable memory waits for the GPU."""
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.asarray(numpy.frombuffer(lengths, dtype=numpy.int32))


def row_statistics_strides(p: AttentionProblem) -> tuple[int, int]:
    """(batch, head) strides of a contiguous per-row vector (lse, D): (batch, heads, seqlen_q), or
    packed (heads, total_q) indexed by each sequence's first row."""
    return (1, p.total_q) if p.cu_seqlens is not None else (p.heads * p.seqlen_q, p.seqlen_q)


def slopes_fields(fields: dict, p: AttentionProblem):
    """The ALiBi fields; returns the slopes as the kernels read them (contiguous, Accum type)."""
    if p.alibi_slopes is None:
        fields["alibi_slopes"] = fields["alibi_batch_stride"] = 0
        return None
    import cupy

    slopes = p.alibi_slopes
    if isinstance(slopes, numpy.ndarray):
        slopes = numpy.ascontiguousarray(slopes, dtype=numpy.float64)  # bfloat16 has no CuPy cast
    slopes = cupy.ascontiguousarray(cupy.asarray(slopes), dtype=lse_dtype(p.dtype_name))
    fields["alibi_slopes"] = slopes.data.ptr
    fields["alibi_batch_stride"] = p.heads if slopes.shape[0] > 1 else 0
    return slopes


_MASK_POINTERS = ("kv_block_count", "kv_block_index", "q_block_count", "q_block_index", "key_block_order")


def _mask_fields(fields: dict, block_mask, device_id: int) -> None:
    """The block mask's compressed form (kernels' kv_block_*/q_block_*, mask_*); zeros (nullptr)
    for dense attention. A mask slab is one (batch, head) of the mask; a size-1 axis broadcasts."""
    if block_mask is None:
        fields.update(dict.fromkeys(_MASK_POINTERS, 0))
        fields.update(mask_batch_stride=0, mask_head_stride=0, mask_q_blocks=0, mask_k_blocks=0)
        fields.update(mask_block_q=0, mask_block_k=0)
        return
    for name, x in zip(_MASK_POINTERS, block_mask.device_arrays(device_id)):
        fields[name] = x.data.ptr
    heads = block_mask.mask_heads
    fields["mask_batch_stride"] = heads if block_mask.mask_batch > 1 else 0
    fields["mask_head_stride"] = 1 if heads > 1 else 0
    fields["mask_q_blocks"], fields["mask_k_blocks"] = block_mask.blocks
    fields["mask_block_q"], fields["mask_block_k"] = block_mask.block_size


def image(dtype: numpy.dtype, fields: dict) -> numpy.ndarray:
    """The kernel-argument struct: one record of `dtype`, filled in a single assignment (setting
    fields one at a time costs microseconds each, and this runs on every call)."""
    params = numpy.empty(1, dtype=dtype)
    params[0] = tuple(fields[name] for name in dtype.names)
    return params


class LaunchRecord:
    """A launch's parameter struct with every field but its array pointers (and the per-call
    values named with them: dropout's seed and offset) filled in, into which each call writes its
    values; and the tensor maps made for the pointers seen lately (a map holds its array's address)."""

    # A model's layers share one problem and call it with their own arrays, at addresses that the
    # memory pools give back step after step: 8 kept sets were rebuilt on every call of a loop over
    # 16 array sets (+17-19 us a forward call on an H200's host).
    MAPS_KEPT = 64

    def __init__(self, dtype: numpy.dtype, fields: dict, pointer_names: tuple, word_names: tuple = ()):
        self.dtype = dtype
        self.fields = fields  # pointers as given at first: the map makers take theirs from `pointers`
        self.image = image(dtype, fields).view(numpy.uint64)  # the structs are 8-byte multiples; pointers 8-aligned
        self.slots = tuple((name, dtype.fields[name][1] // 8) for name in pointer_names)
        # 4-byte fields a call writes too (dropout's offset), by their index in 32-bit words
        self.words = tuple((name, dtype.fields[name][1] // 4) for name in word_names)
        self.maps: dict = {}
        self._local = threading.local()

    def params(self, pointers: dict, copy: int = 0) -> numpy.ndarray:
        """The struct (a one-element record of `dtype`) with these pointers (and 4-byte fields):
        this thread's own image (`copy` 0 or 1: a plan may take two), written in place. The driver
        copies a launch's arguments when it is queued, so a struct is good until the thread's next
        call of `params` for the same copy: a plan is launched before the next is bound. The same
        array on every call is what lets runtime/launch.py keep each launch made ready."""
        images = getattr(self._local, "images", None)
        if images is None:
            images = self._local.images = [None, None]
        if images[copy] is None:  # (a record made for one call, as varlen's are, makes one)
            images[copy] = self._own_image()
        words, halves, struct = images[copy]
        for name, slot in self.slots:
            words[slot] = pointers[name]
        for name, slot in self.words:
            halves[slot] = pointers[name]
        return struct

    def _own_image(self) -> tuple:
        words = self.image.copy()
        return words, words.view(numpy.uint32), launch.pinned(words.view(self.dtype))

    def tensor_maps(self, key: tuple, make, pointers: dict):
        """make(fields)'s maps (or None) for `key`, which must hold every pointer they describe."""
        maps = self.maps.get(key, self)  # one lookup: another thread may drop the entry meanwhile
        if maps is not self:
            return maps
        maps = make({**self.fields, **pointers})
        if isinstance(maps, numpy.ndarray):  # (None: the driver declined them)
            maps = launch.pinned(maps)
        keep_bounded(self.maps, key, maps, self.MAPS_KEPT)  # (a model of more layers: the oldest go)
        return maps
