"""Every kernel instantiation compiles with NVRTC for sm_80 and sm_90a, without spills, and fits its
GPU's shared memory. No GPU needed, but tens of minutes on two cores: marked `compile`, left out of
the default run (`pytest -m compile` runs it; so does `python -m cupyflash check-kernels`)."""

import pytest

from cupyflash import catalog
from cupyflash.catalog import tiles
from cupyflash.runtime import compiler

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy's NVRTC bindings are needed")
pytestmark = pytest.mark.compile
ARCHS = ["sm_80", "sm_90a"]

# One NVRTC program per (architecture, source file, dtype), as check-kernels builds them.
GROUPS = sorted({(arch, k.source_file, k.dtype_name) for arch in ARCHS for k in catalog.all_kernels(arch)})


def test_groups_cover_every_kernel():
    assert {(s, d) for _, s, d in GROUPS} == {(k.source_file, k.dtype_name) for k in catalog.all_kernels()}


@pytest.mark.parametrize("arch,source_file,dtype_name", GROUPS)
def test_every_instantiation_compiles_without_spills(arch, dtype_name, source_file):
    kernels = [k for k in catalog.all_kernels(arch) if k.dtype_name == dtype_name and k.source_file == source_file]
    assert kernels
    reports = compiler.compile_offline(kernels, arch)
    assert sorted(r.name_expression for r in reports) == sorted(k.name_expression for k in kernels)
    for r in reports:
        assert r.spill_store_bytes == 0 and r.spill_load_bytes == 0 and r.stack_bytes == 0, r
        assert 0 < r.registers <= 255, r
        assert not r.wgmma_serialized, r
    for k, r in zip(sorted(kernels, key=lambda k: k.name_expression), sorted(reports, key=lambda r: r.name_expression)):
        # The Hopper kernels and the large_smem tiles run on sm_90 only: an H100's shared memory.
        large = getattr(k, "large_smem", False) or k.arch == tiles.WGMMA_ARCH
        limit = tiles.SMEM_H100 if large else tiles.SMEM_A100
        assert r.smem_bytes <= limit, f"{r.name_expression} does not fit an {'H100' if large else 'A100'}'s shared memory"
