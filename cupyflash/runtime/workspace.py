"""Device buffers the launches need beside their arguments: buffers their kernels leave zeroed,
kept per stream; the arrays of calls captured into CUDA graphs, kept for the graphs' replays; and
the one lock of every bounded cache."""

from __future__ import annotations

import threading
import typing

import numpy

# Buffers that their kernels leave zeroed, kept per (purpose, device, stream), as the launches on a
# stream run one after another: "counters" (the persistent kernels' claims and dQ slab counts,
# decode's split counts) and "dq ring" (the warp-specialised dK/dV kernel's dQ ring, which would
# otherwise be cleared by a memset on every call).
ZEROED: dict = {}  # (purpose, device, stream handle) -> Zeroed


class Zeroed(typing.NamedTuple):
    owner: object  # the CuPy array or torch tensor
    size: int
    dtype: numpy.dtype
    ptr: int

# The workspaces and counters of calls captured into CUDA graphs, which replays go on using (a
# graph holds the addresses for its life, which may be the process's).
CAPTURED: list = []
_BOUNDED_LOCK = threading.Lock()


class Stream:
    """Where a call's launches go and its workspaces come from: the CUDA stream's handle, whether it
    is being captured into a graph, and the allocator whose blocks are reused in that stream's
    order (CuPy's pool on its current stream, `cupy_stream`; torch's caching allocator for the
    torch adapter). `empty(shape, dtype)` and `zeros(shape, dtype)` give (owner, address) of an array
    of that shape (an int or a tuple); a workspace stays valid while its owner is referenced.

    `held` keeps what a call being captured allocates: for the process's life (CAPTURED) where the
    allocator would hand the blocks to later calls while the graph replays (CuPy's pool); for the
    Stream's life, that is the call's, where the capture has a pool of its own that the graph keeps
    (torch's: it also requires that a capture keeps nothing beyond its outputs)."""

    __slots__ = ("ptr", "device_id", "capturing", "empty", "zeros", "held", "graph_pool")

    def __init__(self, ptr: int, device_id: int, capturing: bool, empty, zeros, graph_pool: bool = False):
        self.ptr, self.device_id, self.capturing, self.empty, self.zeros = ptr, device_id, capturing, empty, zeros
        self.held = None if not capturing else [] if graph_pool else CAPTURED
        self.graph_pool = graph_pool


def _cupy_empty(shape, dtype):
    import cupy

    x = cupy.empty(shape, dtype)
    return x, x.data.ptr


def _cupy_zeros(shape, dtype):
    import cupy

    x = cupy.zeros(shape, dtype)
    return x, x.data.ptr


def cupy_stream() -> Stream:
    """CuPy's current stream on the current device, with CuPy's memory pool."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    return Stream(stream.ptr, cupy.cuda.runtime.getDevice(), stream.is_capturing(), _cupy_empty, _cupy_zeros)


def zeroed(purpose: str, n: int, dtype, stream: Stream, least: int = 0) -> int:
    """The address of a zeroed buffer of at least n elements of dtype for a launch on `stream`, which
    the launch must leave zeroed. A call being captured into a CUDA graph gets one of its own, as its
    replays may run on any stream beside calls on this one (the clear is captured too: harmless)."""
    if stream.capturing:
        owner, ptr = stream.zeros(n, dtype)
        stream.held.append(owner)
        return ptr
    key = (purpose, stream.device_id, stream.ptr)
    kept = ZEROED.get(key)
    if kept is None or kept.size < n or kept.dtype != dtype:
        size = max(n, least)
        owner, ptr = _outside_pools(size, dtype, stream) if stream.graph_pool else stream.zeros(size, dtype)
        kept = ZEROED[key] = Zeroed(owner, size, dtype, ptr)
    return kept.ptr


def _outside_pools(size: int, dtype, stream: Stream):
    """A zeroed CuPy array of its own cudaMalloc, for a buffer kept per stream beside an allocator
    whose captures own pools (torch's): torch's cudagraph trees warm a graph up in its pool and then
    refuse any tensor there that outlives the call. cudaFree, when the buffer is replaced, waits for
    the launches still using it."""
    import cupy

    nbytes = size * dtype.itemsize
    with cupy.cuda.Device(stream.device_id):
        memory = cupy.cuda.memory.Memory(nbytes)
        cupy.cuda.runtime.memsetAsync(memory.ptr, 0, nbytes, stream.ptr)
        owner = cupy.ndarray(size, dtype, cupy.cuda.MemoryPointer(memory, 0))
    return owner, memory.ptr


def zeroed_counters(n: int, stream: Stream) -> int:
    """`zeroed`'s uint32 counters, at least 1024 of them."""
    return zeroed("counters", n, numpy.dtype(numpy.uint32), stream, 1024)


def keep_if_captured(stream: Stream, *owners) -> None:
    """Keeps the owners given (None: skipped) alive as long as `stream.held` if `stream` is being
    captured into a graph."""
    if stream.capturing:
        stream.held.extend(x for x in owners if x is not None)


def keep_bounded(cache: dict, key, value, limit: int) -> None:
    """cache[key] = value, the oldest entry dropped first once `limit` are kept. Under one lock for
    every such cache: two threads dropping at once would both take the same oldest key (a KeyError),
    and an insert between iter() and next() makes next() raise."""
    with _BOUNDED_LOCK:
        if key not in cache and len(cache) >= limit:
            cache.pop(next(iter(cache)))
        cache[key] = value
