"""Queues a plan's launches (dispatch/plan.py) on CuPy's current stream: nothing is decided here."""

from __future__ import annotations

import ctypes
import functools

import numpy

from cupyflash.runtime import compiler


def run(plan) -> None:
    """Queues the plan's launches in order."""
    for launch_ in plan.launches:
        launch(launch_.kernel, plan.device_id, launch_.grid, *launch_.args)


def launch(kernel, device_id: int, grid, params: numpy.ndarray, *more: numpy.ndarray) -> None:
    """Launches `kernel` with its parameter struct (`more`: byte images of further by-value
    arguments, such as the Hopper kernels' tensor maps)."""
    cpointer = _cpointer()
    function = compiler.get_function(kernel, device_id)
    # The struct goes by address: CuPy's by-value path for a NumPy record rebuilds its
    # __array_interface__ (the whole field description) on every launch, about 50 us for BwdParams.
    # The arrays outlive the call, and the launch copies the bytes.
    arguments = tuple(cpointer(_address(x)) for x in (params, *more))
    function(grid, (kernel.num_threads,), arguments, shared_mem=kernel.smem_bytes)


@functools.cache
def _cpointer():
    """CuPy's CPointer, imported once: an import inside `launch` costs about 2 us a launch."""
    from cupy.cuda.function import CPointer

    return CPointer


def _address(x: numpy.ndarray) -> int:
    """The address of an array's bytes, through ctypes' view of its buffer: about half the time of
    numpy's .ctypes.data (0.5 against 1.1 us on the H200 machine's host). Arrays ctypes cannot view
    (read-only, empty or not contiguous) take .ctypes.data."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(x))
    except (TypeError, ValueError):
        return x.ctypes.data
