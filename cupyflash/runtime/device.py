"""What the planner needs to know of a GPU, read once per device: `DeviceInfo`. `described()`
gives a device by its compute capability alone (a typical device of that architecture, with its
real shared-memory limits), so that a plan can be made and explained on a machine without a GPU."""

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


# Compute capability -> (a typical device, its SMs, opt-in shared memory per block and per SM,
# bytes), as the CUDA programming guide's table of limits per compute capability gives them.
ARCHITECTURES = {
    70: ("a V100-like device (Volta)", 80, 96 * 1024, 96 * 1024),
    72: ("a Jetson AGX Xavier-like device (Volta)", 8, 96 * 1024, 96 * 1024),
    75: ("a T4-like device (Turing)", 40, 64 * 1024, 64 * 1024),
    80: ("an A100-like device (Ampere)", 108, SMEM_A100, SMEM_A100 + 1024),
    86: ("an A40-like device (Ampere)", 84, 99 * 1024, 100 * 1024),
    87: ("a Jetson AGX Orin-like device (Ampere)", 16, SMEM_A100, SMEM_A100 + 1024),
    89: ("an L40S-like device (Ada)", 142, 99 * 1024, 100 * 1024),
    90: ("an H100-like device (Hopper)", 132, SMEM_H100, SMEM_H100 + 1024),
    100: ("a B200-like device (Blackwell)", 148, SMEM_H100, SMEM_H100 + 1024),
    120: ("an RTX 5090-like device (Blackwell)", 170, 99 * 1024, 100 * 1024),
}


def described(compute_capability: int) -> DeviceInfo:
    """A typical device of the compute capability (e.g. 80, 90; ARCHITECTURES lists them), with its
    architecture's shared-memory limits; ValueError for one not in the list."""
    if compute_capability not in ARCHITECTURES:
        known = ", ".join(str(cc) for cc in ARCHITECTURES)
        raise ValueError(f"compute_capability must be one of {known} (major * 10 + minor), got {compute_capability}")
    name, sm_count, smem_per_block, smem_per_sm = ARCHITECTURES[compute_capability]
    return DeviceInfo(-1, name, compute_capability, sm_count, smem_per_block, smem_per_sm)


def require_gpu(what: str) -> None:
    """Raises RuntimeError saying that `what` needs an NVIDIA GPU, where CuPy sees none (no CuPy,
    no device, or no driver), rather than the CUDA runtime's own error."""
    if not gpu_available():
        raise RuntimeError(f"{what} needs an NVIDIA GPU with a CUDA driver and CuPy; none is available here "
                           f"(cupy.cuda.is_available() is False)")
