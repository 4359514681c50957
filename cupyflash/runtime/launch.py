"""Queues a plan's launches (dispatch/plan.py) on CuPy's current stream: nothing is decided here."""

from __future__ import annotations

import ctypes
import functools

import numpy

from cupyflash.runtime import compiler


def run(plan, stream: int | None = None) -> None:
    """Queues the plan's launches in order on the stream (a cudaStream_t; default: CuPy's current
    stream), each as made ready (`_ready`) the first time its kernel, grid and argument arrays came."""
    stream = _current_stream_ptr() if stream is None else stream
    launch_kernel = _driver().launchKernel
    device_id = plan.device_id
    for launch_ in plan.launches:
        key = (id(launch_.kernel), device_id, launch_.grid, *map(id, launch_.args))
        ready = _READY.get(key)
        if ready is None:
            ready = _ready(key, launch_, device_id)
        launch_kernel(*ready[0], stream, ready[1], 0)


# Launches made ready: the driver's arguments but the stream (function, grid, block, shared memory)
# and the address of the array of their arguments' addresses, by the ids of the kernel and the
# argument arrays. A prepared call passes the same arrays on every call (its thread's parameter
# struct, params.LaunchRecord; pinned scalars and tensor maps), so its launches are made once: the
# array of addresses and the arguments to the driver took ~4 us a launch on a 2-core EPYC. An entry
# keeps the Launch, hence the arrays, alive: no other array can take their ids while it is here.
_READY: dict = {}
_READY_KEPT = 4096


def _ready(key: tuple, launch_, device_id: int) -> tuple:
    from cupyflash.runtime.workspace import keep_bounded

    kernel = launch_.kernel
    addresses = numpy.array([_address(x) for x in launch_.args], numpy.uint64)
    x, y, z = (*launch_.grid, 1, 1)[:3]
    ready = ((_function_pointer(kernel, device_id), x, y, z, kernel.num_threads, 1, 1, kernel.smem_bytes),
             _address(addresses), addresses, launch_)
    keep_bounded(_READY, key, ready, _READY_KEPT)
    return ready


def launch(kernel, device_id: int, grid, params: numpy.ndarray, *more: numpy.ndarray, stream: int | None = None) -> None:
    """Launches `kernel` on the stream (default: CuPy's current stream) with its parameter struct
    (`more`: byte images of further by-value arguments, such as the Hopper kernels' tensor maps).

    Straight through the driver's cuLaunchKernel with the arguments' addresses: CuPy's kernel call,
    which wraps each argument, took about 7 us more a launch on an H200 machine's host (a
    backward's three launches: 63 against 42 us). The arrays outlive the call, and the launch
    copies the bytes."""
    addresses = numpy.array([_address(x) for x in (params, *more)], numpy.uint64)
    x, y, z = (*grid, 1, 1)[:3]
    _driver().launchKernel(_function_pointer(kernel, device_id), x, y, z, kernel.num_threads, 1, 1, kernel.smem_bytes,
                           _current_stream_ptr() if stream is None else stream, _address(addresses), 0)


@functools.cache
def _function_pointer(kernel, device_id: int) -> int:
    """The CUfunction of the kernel compiled for the device (compiler.get_function's)."""
    import cupy

    with cupy.cuda.Device(device_id):
        return compiler.get_function(kernel, device_id).kernel.ptr


@functools.cache
def _driver():
    """CuPy's binding of the CUDA driver API, imported once."""
    from cupy.cuda import driver

    return driver


def _current_stream_ptr() -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


# Arguments made once and passed on every call (a prepared launch's static scalars, the tensor maps
# kept for a pointer set), by id with the array itself: an entry keeps its array alive, so its id
# is not another's while it is here. A backward's three launches take 13 addresses.
_PINNED: dict = {}
_PINNED_KEPT = 4096


def pinned(x: numpy.ndarray) -> numpy.ndarray:
    """x, its address kept for the launches that pass it again (`_address` then takes ~0.06 us
    where it took 0.3-1.3)."""
    from cupyflash.runtime.workspace import keep_bounded

    keep_bounded(_PINNED, id(x), (x, _address(x)), _PINNED_KEPT)
    return x


def _address(x: numpy.ndarray) -> int:
    """The address of an array's bytes, through ctypes' view of its buffer: about half the time of
    numpy's .ctypes.data (0.5 against 1.1 us on the H200 machine's host). A parameter struct (a
    record) is viewed as bytes first, through the uint64 image it is a view of where it is one
    (params.LaunchRecord's): its own buffer would carry the struct's whole field format, which
    numpy writes out on every request (about 5 us for BwdParams on a 2-core EPYC). Arrays ctypes
    cannot view (read-only, empty or not contiguous) take .ctypes.data."""
    kept = _PINNED.get(id(x))
    if kept is not None and kept[0] is x:
        return kept[1]
    if x.dtype.names is not None:
        base = x.base
        x = base if type(base) is numpy.ndarray and base.dtype == numpy.uint64 and base.size * 8 == x.nbytes \
            else x.view(numpy.uint8)
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(x))
    except (TypeError, ValueError):
        return x.ctypes.data
