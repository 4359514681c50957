"""Device buffers the launches need beside their arguments: buffers their kernels leave zeroed,
kept per stream; the arrays of calls captured into CUDA graphs, kept for the graphs' replays; and
the one lock of every bounded cache."""

from __future__ import annotations

import threading

import numpy

# Buffers that their kernels leave zeroed, kept per (purpose, device, stream), as the launches on a
# stream run one after another: "counters" (the persistent kernels' claims and dQ slab counts,
# decode's split counts) and "dq ring" (the warp-specialised dK/dV kernel's dQ ring, which would
# otherwise be cleared by a memset on every call).
ZEROED: dict = {}
# The workspaces and counters of calls captured into CUDA graphs, which replays go on using (a
# graph holds the addresses for its life, which may be the process's).
CAPTURED: list = []
_BOUNDED_LOCK = threading.Lock()


def zeroed(purpose: str, device_id: int, n: int, dtype, least: int = 0):
    """A zeroed buffer of at least n elements of dtype for a launch on the current stream, which the
    launch must leave zeroed. A call being captured into a CUDA graph gets one of its own, as its
    replays may run on any stream beside calls on this one (the memset is captured too: harmless)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        return keep_if_captured(cupy.zeros(n, dtype))
    key = (purpose, device_id, stream.ptr)
    buffer = ZEROED.get(key)
    if buffer is None or buffer.size < n or buffer.dtype != dtype:
        buffer = ZEROED[key] = cupy.zeros(max(n, least), dtype)
    return buffer


def zeroed_counters(device_id: int, n: int):
    """`zeroed`'s uint32 counters, at least 1024 of them."""
    return zeroed("counters", device_id, n, numpy.dtype(numpy.uint32), 1024)


def keep_if_captured(x, *more):
    """x, kept alive for the process's life with the other arrays given (None: skipped) if the
    current stream is being captured into a graph."""
    import cupy

    if cupy.cuda.get_current_stream().is_capturing():
        CAPTURED.extend(y for y in (x, *more) if y is not None)
    return x


def keep_bounded(cache: dict, key, value, limit: int) -> None:
    """cache[key] = value, the oldest entry dropped first once `limit` are kept. Under one lock for
    every such cache: two threads dropping at once would both take the same oldest key (a KeyError),
    and an insert between iter() and next() makes next() raise."""
    with _BOUNDED_LOCK:
        if key not in cache and len(cache) >= limit:
            cache.pop(next(iter(cache)))
        cache[key] = value
