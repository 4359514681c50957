"""Framework interop: NumPy, CuPy and DLPack arrays in; the caller's array type out.

Device arrays of other frameworks (PyTorch, JAX, ...) come in through `cupy.from_dlpack`, which
shares their memory and orders their producer stream before CuPy's current stream. Never
`cupy.asarray`: through __cuda_array_interface__ a torch bfloat16 tensor becomes a void array.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import sys

import numpy

from cupyflash.validation import BFLOAT16

# DLPack device types (dlpack.h).
_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_HOST = 3
_DL_CUDA_MANAGED = 13

# Module roots whose from_dlpack gives the result back in the caller's framework.
_FROM_DLPACK = {"torch": "torch", "jax": "jax.numpy", "jaxlib": "jax.numpy"}


@dataclasses.dataclass(frozen=True)
class Origin:
    kind: str  # "numpy", "cupy" or "foreign"
    module: str = ""  # for "foreign": the array type's top-level module
    on_gpu: bool = True
    device_id: int = -1  # CUDA device ordinal when on_gpu


_NUMPY = Origin("numpy", on_gpu=False)


@functools.cache
def _cupy_origin(device_id: int) -> Origin:
    return Origin("cupy", device_id=device_id)


def cupy_ndarray_type():
    cupy = sys.modules.get("cupy")  # an array cannot be a CuPy array unless CuPy was imported
    return cupy.ndarray if cupy is not None else None


class DeviceView:
    """Another framework's device array as the checks and the planner read it: its address (`data.ptr`),
    shape, strides in bytes, NumPy dtype and device (`device.id`), keeping the owner alive. For the
    adapters' in-place path, which only launches on it: a cupy.ndarray of the same memory took
    about 8 us to make on an H200 machine's host, for each of a forward's five arrays and a
    backward's nine."""

    __slots__ = ("data", "shape", "strides", "dtype", "ndim", "size", "device", "owner")

    def __init__(self, ptr: int, shape: tuple, strides: tuple, dtype: numpy.dtype, device_id: int, owner):
        self.data = _Address(ptr)
        self.shape, self.strides, self.dtype, self.owner = shape, strides, dtype, owner
        self.ndim = len(shape)
        self.size = math.prod(shape)
        self.device = _device(device_id)

    def __getitem__(self, key):
        """x[None], the one indexing the shared checks do (a packed array seen as a batch of one)."""
        if key is not None:
            raise TypeError(f"only x[None] is supported, got {key!r}")
        return DeviceView(self.data.ptr, (1, *self.shape), (max(self.size, 1) * self.dtype.itemsize, *self.strides),
                          self.dtype, self.device.id, self.owner)


class _Address:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class _Device:
    __slots__ = ("id",)

    def __init__(self, device_id: int):
        self.id = device_id


@functools.cache
def _device(device_id: int) -> _Device:
    return _Device(device_id)


def classify(x, arg: str) -> Origin:
    """Where x lives and what it is, read without touching its data; TypeError for non-arrays."""
    if isinstance(x, numpy.ndarray):
        return _NUMPY
    if type(x) is DeviceView:  # (as a CuPy array: read in place, never exported)
        return _cupy_origin(x.device.id)
    cupy_ndarray = cupy_ndarray_type()
    if cupy_ndarray is not None and isinstance(x, cupy_ndarray):
        return _cupy_origin(x.data.device_id)
    if not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
        raise TypeError(
            f"{arg} must be an array (numpy.ndarray, cupy.ndarray, or a GPU array with __dlpack__ "
            f"such as a torch.Tensor or jax.Array), got {type(x).__module__}.{type(x).__qualname__}"
        )
    module = type(x).__module__.split(".")[0]
    device_type, device_id = x.__dlpack_device__()
    if device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        return Origin("foreign", module, on_gpu=True, device_id=int(device_id))
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        return Origin("foreign", module, on_gpu=False)
    raise TypeError(f"{arg} lives on DLPack device type {device_type}; cupyflash runs on CUDA GPUs")


def check_placement(origins: dict) -> None:
    """All arrays on the host, or all on one GPU."""
    if len({(o.on_gpu, o.device_id) for o in origins.values()}) == 1:  # every call's path
        return
    names = list(origins)
    listed = ", ".join(names[:-1]) + " and " + names[-1]
    on_gpu = {name: o.on_gpu for name, o in origins.items()}
    if len(set(on_gpu.values())) > 1:
        where = ", ".join(f"{n} on the {'GPU' if g else 'host'}" for n, g in on_gpu.items())
        raise ValueError(f"{listed} must all be on the GPU or all on the host; got {where}")
    devices = {name: o.device_id for name, o in origins.items()}
    where = ", ".join(f"{n} on GPU {d}" for n, d in devices.items())
    raise ValueError(f"{listed} must be on the same GPU; got {where}")


def ingest(x, origin: Origin, arg: str):
    """A NumPy or CuPy array sharing x's memory (foreign arrays through DLPack, no copy)."""
    if origin.kind in ("numpy", "cupy"):
        return x
    try:
        if origin.on_gpu:
            import cupy

            return cupy.from_dlpack(x)
        return numpy.from_dlpack(x)
    except (TypeError, ValueError, RuntimeError, BufferError) as e:
        host = None if origin.on_gpu else _host_bfloat16(x)
        if host is None:
            raise TypeError(f"{arg} could not be imported through DLPack: {e}") from e
        return host


def _host_bfloat16(x):
    """x as a NumPy bfloat16 array through its __array__ (JAX's host arrays give ml_dtypes'
    bfloat16, in place), where NumPy's DLPack import knows no bfloat16; None otherwise."""
    try:
        host = numpy.asarray(x)
    except (TypeError, ValueError, RuntimeError):
        return None
    return host if host.dtype == BFLOAT16 else None


def export(x, origin: Origin):
    """Returns x (NumPy or CuPy) as the array type that `origin` came in as.

    A foreign framework without a module-level `from_dlpack` (torch and jax have one) gets the
    CuPy array (NumPy for host arrays) itself, which it can import through DLPack."""
    if origin.kind == "cupy":
        return x
    if origin.kind == "numpy":
        return x if isinstance(x, numpy.ndarray) else x.get()
    target = _FROM_DLPACK.get(origin.module, origin.module)
    if not origin.on_gpu and not isinstance(x, numpy.ndarray):
        x = x.get()
    try:
        module = importlib.import_module(target)
    except ImportError:
        return x
    if not origin.on_gpu and hasattr(module, "asarray") and x.dtype == BFLOAT16:
        return module.asarray(x)  # (NumPy exports no bfloat16 through DLPack; jax.numpy.asarray takes ml_dtypes')
    try:
        return module.from_dlpack(x)
    except AttributeError:
        return x


class _StreamHandle:
    """A raw cudaStream_t presented through the CUDA stream protocol."""

    def __init__(self, handle: int):
        self.handle = int(handle)

    def __cuda_stream__(self):
        return (0, self.handle)


def external_stream(handle: int, device_id: int):
    """A CuPy stream wrapping another library's CUDA stream (a cudaStream_t given as an int), for
    `with` blocks that make it CuPy's current stream. Enter the device's context first."""
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14 deprecates ExternalStream
        return cupy.cuda.Stream.from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(int(handle), device_id)
