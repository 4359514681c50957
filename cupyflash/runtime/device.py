"""What the planner needs to know of a GPU, read once per device: `DeviceInfo`. `described()`
gives a device by its compute capability alone (an A100- or H100-like one), so that a plan can be
made and explained on a machine without a GPU."""

from __future__ import annotations

import dataclasses
import functools

from cupyflash.catalog.tiles import SMEM_A100, SMEM_H100


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    device_id: int  # CUDA ordinal; -1 for a described device
    name: str
    compute_capability: int  # e.g. 90
    sm_count: int
    smem_per_block: int  # opt-in shared memory per block, bytes
    smem_per_sm: int

    @property
    def arch(self) -> str:
        return "sm_90a" if self.compute_capability == 90 else f"sm_{self.compute_capability}"


def gpu_available() -> bool:
    """Whether CuPy is installed and sees a CUDA GPU with a working driver."""
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.is_available())


@functools.cache
def info(device_id: int) -> DeviceInfo:
    """The CUDA device's properties (memoised: the planner asks on every call)."""
    import cupy

    device = cupy.cuda.Device(device_id)
    attributes = device.attributes
    name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    return DeviceInfo(device_id, name.decode() if isinstance(name, bytes) else str(name),
                      int(device.compute_capability), int(attributes["MultiProcessorCount"]),
                      int(attributes["MaxSharedMemoryPerBlockOptin"]),
                      int(attributes["MaxSharedMemoryPerMultiprocessor"]))


def described(compute_capability: int) -> DeviceInfo:
    """A device known by its compute capability alone: an H100's SMs and shared memory from sm_90
    on, an A100's from sm_80, a Volta's below."""
    if compute_capability >= 90:
        return DeviceInfo(-1, "an H100-like device", compute_capability, 132, SMEM_H100,
                          SMEM_H100 + 1024)
    if compute_capability >= 80:
        return DeviceInfo(-1, "an A100-like device", compute_capability, 108, SMEM_A100,
                          SMEM_A100 + 1024)
    return DeviceInfo(-1, "a Volta-like device", compute_capability, 80, 96 * 1024, 96 * 1024)


def require_gpu(what: str) -> None:
    """Raises RuntimeError saying that `what` needs an NVIDIA GPU, where CuPy sees none (no CuPy,
    no device, or no driver), rather than the CUDA runtime's own error."""
    if not gpu_available():
        raise RuntimeError(f"{what} needs an NVIDIA GPU with a CUDA driver and CuPy; none is available here "
                           f"(cupy.cuda.is_available() is False)")
