"""Kernel sources, run-time compilation through CuPy, and offline compilation for check-kernels.

CuPy's on-disk cache keys on the `code` string, not on files pulled in with -I, so the .cuh
headers are inlined into the source text here: editing any header changes the key and recompiles.
Include paths are relative to the kernels/ folder (`#include "common/numeric.cuh"`).

CUPYFLASH_LINEINFO=1 (read at each compile) adds -lineinfo, so that compute-sanitizer's and
Nsight's reports name source lines (tools/sanitize.py sets it).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re

from cupyflash.catalog import params

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$", re.MULTILINE)

# Compiler options beyond the ones CuPy adds itself (-arch from the device, -ftz=true, its
# include dirs). Offline compilation adds those explicitly, so both builds see the same flags.
COMPILE_OPTIONS = ("-std=c++17",)
OFFLINE_OPTIONS = ("-ftz=true", "--ptxas-options=-v")


def kernels_dir() -> pathlib.Path:
    """The kernels/ folder: packaged inside an installed wheel (cupyflash/kernels), top-level in a
    source tree."""
    package = pathlib.Path(__file__).resolve().parents[1]
    for candidate in (package / "kernels", package.parent / "kernels"):
        if (candidate / "scalar" / "fwd.cu").is_file() and (candidate / "common" / "params.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cupyflash kernel sources not found next to {package}")


def _inline(name: str, seen: set[str]) -> str:
    if name in seen:  # every header is #pragma once
        return ""
    seen.add(name)
    text = (kernels_dir() / name).read_text()
    text = _PRAGMA_ONCE.sub("", text)
    return _INCLUDE.sub(lambda m: _inline(m.group(1), seen), text)


@functools.cache
def kernel_source(filename: str = "scalar/fwd.cu") -> str:
    """The translation unit with its headers inlined and the host/device agreement checks."""
    code = f"// ---- {filename} (headers inlined by cupyflash/runtime/compiler.py)\n"
    code += _inline(filename, set())
    code += "\n// ---- host/device agreement checks (generated)\n"
    for struct in params.structs_of(filename):
        code += params.size_check(struct)
    return code


def _source_for(kernels) -> str:
    """One translation unit for kernels that all come from the same .cu file."""
    (filename,) = {k.source_file for k in kernels}
    return kernel_source(filename) + "".join(k.host_checks() for k in kernels)


# --------------------------------------------------------------------------- run time (a GPU)


def _lineinfo() -> tuple:
    return ("-lineinfo",) if os.environ.get("CUPYFLASH_LINEINFO", "0") != "0" else ()


@functools.cache
def get_function(kernel, device_id: int):
    """The compiled kernel for the device, memoised; raises ValueError if its tiles cannot fit."""
    import cupy

    with cupy.cuda.Device(device_id) as device:
        limit = device.attributes["MaxSharedMemoryPerBlockOptin"]
        if kernel.smem_bytes > limit:
            raise ValueError(
                f"{kernel.dtype_name} attention with head_dim padded to {kernel.head_dim} needs "
                f"{kernel.smem_bytes} bytes of shared memory per block; device {device_id} allows "
                f"{limit}. Use a smaller head_dim or a lower precision."
            )
        # A kernel built for one architecture's own features (wgmma: sm_90a) names it; NVRTC takes
        # that over the -arch CuPy adds from the device.
        options = COMPILE_OPTIONS + kernel.compile_options + _lineinfo()
        module = cupy.RawModule(code=_source_for([kernel]), options=options, name_expressions=[kernel.name_expression])
        function = module.get_function(kernel.name_expression)
        if kernel.smem_bytes > 48 * 1024:  # above 48 KiB a launch needs the opt-in attribute
            function.max_dynamic_shared_size_bytes = kernel.smem_bytes
        return function


# --------------------------------------------------------------------------- offline (no GPU)


@dataclasses.dataclass
class KernelReport:
    name_expression: str
    arch: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    smem_bytes: int
    # ptxas made the kernel's wgmma products wait for each other or for their results early (its
    # C7511/C7517 notes), e.g. where accumulators are touched between issue and wait: correct, but slower.
    wgmma_serialized: bool = False


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\S+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
# ptxas' notes that it serialized a kernel's wgmma products (C7511 and kin) or waited for them early
# (C7517, "wgmma.wait_group is injected"), naming the function.
_PTXAS_WGMMA_SERIALIZED = re.compile(r"wgmma\S* (?:instructions are serialized|is injected).*? function '(\S+)'")


def offline_unavailable() -> str | None:
    """Why `compile_offline` cannot run on this machine (None: it can). It needs no GPU, but CuPy's
    NVRTC bindings and NVRTC itself: the CUDA extra (pip install -e ".[cuda13]")."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        return 'it needs CuPy and NVRTC, which come with the CUDA extra: pip install -e ".[cuda13]" (or ".[cuda12]")'
    try:
        nvrtc.getVersion()
    except Exception as e:  # (CuPy's bindings raise what the loader found: no libnvrtc on the path)
        return f'CuPy finds no NVRTC library ({e}); the CUDA extra brings it: pip install -e ".[cuda13]"'
    return None


def compile_offline(kernels, arch: str) -> list[KernelReport]:
    """Compiles with NVRTC for `arch` (no GPU needed) and reads ptxas' resource report.

    The kernels must come from one .cu file. Raises RuntimeError with NVRTC's log when
    compilation fails.
    """
    from cupy_backends.cuda.libs import nvrtc

    kernels = list(kernels)
    prog = nvrtc.createProgram(_source_for(kernels), kernels[0].source_file, [], [])
    try:
        for k in kernels:
            nvrtc.addNameExpression(prog, k.name_expression)
        options = [*COMPILE_OPTIONS, *OFFLINE_OPTIONS, f"--gpu-architecture={arch}"]
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {arch}:\n{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog)
        lowered = {nvrtc.getLoweredName(prog, k.name_expression): k for k in kernels}
    finally:
        nvrtc.destroyProgram(prog)
    return parse_ptxas_log(log, lowered, arch)


def compile_cubin(kernel, arch: str) -> bytes:
    """One kernel's cubin for `arch`, compiled with NVRTC as compile_offline does (no GPU needed),
    for tools that read its machine code (tools/sass_hashes.py)."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(_source_for([kernel]), kernel.source_file, [], [])
    try:
        nvrtc.addNameExpression(prog, kernel.name_expression)
        try:
            nvrtc.compileProgram(prog, [*COMPILE_OPTIONS, "-ftz=true", f"--gpu-architecture={arch}"])
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {arch}:\n{nvrtc.getProgramLog(prog)}") from e
        return nvrtc.getCUBIN(prog) + b"\0"  # getCUBIN drops the trailing NUL byte
    finally:
        nvrtc.destroyProgram(prog)


def parse_ptxas_log(log: str, lowered: dict, arch: str) -> list[KernelReport]:
    reports, current, frame = [], None, None
    serialized = {lowered[m.group(1)].name_expression for m in _PTXAS_WGMMA_SERIALIZED.finditer(log)
                  if m.group(1) in lowered}
    for line in log.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            current, frame = lowered.get(m.group(1)), None
        elif (m := _PTXAS_FRAME.search(line)) and current is not None:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _PTXAS_REGS.search(line)) and current is not None and frame is not None:
            reports.append(
                KernelReport(current.name_expression, arch, int(m.group(1)), *frame, current.smem_bytes,
                             current.name_expression in serialized)
            )
            current = None
    missing = set(k.name_expression for k in lowered.values()) - {r.name_expression for r in reports}
    if missing:
        raise RuntimeError(f"ptxas printed no resource usage for: {sorted(missing)}\n{log}")
    return reports
