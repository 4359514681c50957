"""The kernel catalogue, on any machine: the instantiation list covers every dtype, head dim and
variant; each family's finder gives an instantiation of the list; the compile-time checks that tie
the host's numbers to the kernels' fire; the NVRTC source holds every header byte."""

import dataclasses
import pathlib
import shutil
import subprocess
import sys

import numpy
import pytest

from cupyflash import catalog
from cupyflash.catalog import Unavailable, Variant, params, tiles
from cupyflash.catalog.decode import DecodeAppendKernel
from cupyflash.catalog.specs import BWD_ROW_STEPS, MAX_GRID_Y, BwdDkdvKernel, BwdDqKernel, BwdRowKernel, FwdKernel
from cupyflash.catalog.tensor_cores import (
    TcBwdDkdvKernel, TcBwdDqKernel, TcFwdKernel, WgmmaBwdDkdvKernel, WgmmaFwdKernel, WgmmaFwdWsKernel,
)
from cupyflash.runtime import compiler

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy's NVRTC bindings are needed")
VARIANTS = [Variant(local, sparse) for local in (False, True) for sparse in (False, True)]


def test_the_hopper_kernels_are_built_for_sm_90a_only():
    hopper = [k for k in catalog.all_kernels() if k.arch is not None]
    assert hopper and all(isinstance(k, (WgmmaFwdKernel, WgmmaFwdWsKernel, WgmmaBwdDkdvKernel)) for k in hopper)
    assert all(catalog.runs_on(k, "sm_90a") for k in hopper)
    assert not any(catalog.runs_on(k, arch) for k in hopper for arch in ("sm_80", "sm_90", "sm_100a"))
    large = [k for k in catalog.all_kernels() if getattr(k, "large_smem", False)]
    assert large and not any(catalog.runs_on(k, "sm_80") for k in large)


def test_the_list_covers_every_dtype_head_dim_and_variant():
    everything = catalog.all_kernels()
    assert len(set(everything)) == len(everything)
    # dense, causal x block-sparse, the score-modifier kernels with causal's band, and the varlen one
    assert len([k for k in everything if isinstance(k, FwdKernel)]) == 4 * len(tiles.PADDED_HEAD_DIMS) * 7
    for dtype_name in tiles.DTYPE_NAMES:
        tensor_cores = dtype_name in tiles.TENSOR_CORE_DTYPES
        for d in range(1, 257, 7):
            for v in VARIANTS + [Variant(True, False, True), Variant(True, True, True), Variant(varlen=True)]:
                families = ["scalar"] + (["sm80", "sm90", "sm90-tma", "sm90-ws"] if tensor_cores else [])
                for family in families:
                    for make in (catalog.forward_kernel, catalog.dkdv_kernel):
                        try:
                            assert make(family, dtype_name, d, v) in everything
                        except Unavailable:
                            assert family != "scalar" and family != "sm80"
                if tensor_cores:
                    assert catalog.dkdv_kernel("sm80", dtype_name, d, v, large_smem=True) in everything
                assert catalog.dq_kernel(tensor_cores, dtype_name, d, v) in everything
        for step in BWD_ROW_STEPS:
            most = BwdRowKernel(step, dtype_name).rows_per_block * MAX_GRID_Y
            for seqlen_q in (1, 4096, most, most + 1):  # the last: too many row blocks for gridDim.y
                kernel = catalog.bwd_row_kernel(step, dtype_name, seqlen_q)
                assert kernel in everything and kernel.heads_fastest == (seqlen_q <= most)
                assert max(kernel.grid(2, 16, seqlen_q)[1:]) <= MAX_GRID_Y
    for d in range(1, 257):
        assert d <= tiles.padded_head_dim(d) in tiles.PADDED_HEAD_DIMS
    with pytest.raises(ValueError, match="at most 256"):
        tiles.padded_head_dim(257)


def test_each_family_builds_what_it_can():
    assert isinstance(catalog.forward_kernel("sm90-ws", "bfloat16", 128), WgmmaFwdWsKernel)
    assert catalog.forward_kernel("sm90-tma", "float16", 64, Variant(local=True)).tma
    assert isinstance(catalog.dkdv_kernel("sm90-ws", "bfloat16", 100, Variant(True, True)), WgmmaBwdDkdvKernel)
    assert catalog.forward_kernel("sm80", "float32", 128, Variant(), "medium").element_type == "cupyflash::Tf32<1>"
    with pytest.raises(Unavailable, match="up to 128"):
        catalog.forward_kernel("sm80", "float32", 160, Variant(), "high")
    with pytest.raises(ValueError, match="goes with float32 and only with it"):
        TcFwdKernel("float16", 64, False, precision="high")
    assert catalog.forward_kernel("sm80", "float64", 128, Variant(local=True)).element_type == "double"
    with pytest.raises(Unavailable, match="float64 builds at head dims up to 128"):
        catalog.forward_kernel("sm80", "float64", 160)
    # float64's dK/dV kernel on DMMA: every variant to d64, above it an H100's shared memory
    assert catalog.dkdv_kernel("sm80", "float64", 64, Variant(varlen=True)).element_type == "double"
    assert catalog.dkdv_kernel("sm80", "float64", 128, Variant(varlen=True), large_smem=True).tile.block_n == 32
    for d, v, large, why in [(128, Variant(), False, "H100's shared memory"), (160, Variant(), True, "up to 128")]:
        with pytest.raises(Unavailable, match=why):
            catalog.dkdv_kernel("sm80", "float64", d, v, large_smem=large)
    for family, dtype_name, d, v, why in [
        ("sm90", "float64", 64, Variant(), "float16 or bfloat16"),
        ("sm80", "float32", 64, Variant(), "precision 'highest' computes on CUDA cores"),
        ("sm90", "bfloat16", 160, Variant(), "head dims"),
        ("sm90-ws", "bfloat16", 64, Variant(score_mod=True), "softcap"),
        ("sm90-tma", "bfloat16", 64, Variant(True, varlen=True), "variable lengths"),
        ("sm90-tma", "bfloat16", 64, Variant(True, score_mod=True), "registers spill"),
        ("sm90-ws", "bfloat16", 64, Variant(varlen=True), "variable lengths"),
        ("sm90-ws", "bfloat16", 64, Variant(local=True), "causal"),
        ("scalar", "float32", 64, Variant(block_sparse=True, varlen=True), "block-sparse"),
    ]:
        with pytest.raises(Unavailable, match=why):
            catalog.forward_kernel(family, dtype_name, d, v)
    # Packed sequences have the forward's cp.async builds only; score modifiers (softcap, ALiBi,
    # dropout) have its TMA builds too, at d128.
    assert catalog.forward_kernel("sm90-tma", "bfloat16", 128, Variant(True, score_mod=True)).score_mod
    with pytest.raises(ValueError, match="TMA builds"):
        WgmmaFwdKernel("bfloat16", 64, True, block_sparse=False, varlen=True, tma=True)
    with pytest.raises(ValueError, match="TMA builds"):
        WgmmaFwdKernel("bfloat16", 256, False, tma=True)
    with pytest.raises(ValueError, match="TMA builds"):
        WgmmaFwdKernel("bfloat16", 64, True, score_mod=True, tma=True)
    with pytest.raises(ValueError, match="TMA builds"):
        WgmmaBwdDkdvKernel("bfloat16", 64, True, score_mod=True, tma=True)
    with pytest.raises(ValueError, match="warp-specialised"):
        WgmmaBwdDkdvKernel("bfloat16", 64, False, ws=True)
    for args, kwargs in ((("bfloat16", 128, True), {}), (("bfloat16", 64, False), {"score_mod": True}),
                         (("bfloat16", 128, False), {"block_sparse": True,
                                                     "tile_override": tiles.WsTileShape(192, 64, 2)})):
        with pytest.raises(ValueError, match="warp-specialised"):
            WgmmaFwdWsKernel(*args, **kwargs)


def test_the_warp_specialised_kernels_grids_and_threads():
    fwd = catalog.forward_kernel("sm90-ws", "bfloat16", 128, Variant(block_sparse=True))
    assert fwd.num_threads == 384 and fwd.name_expression.endswith(", true>")
    assert fwd.grid(2, 3, 1000, sm_count=132) == (2 * 3 * 8, 1, 1)
    assert fwd.grid(4, 32, 4096, sm_count=132) == (132, 1, 1)
    for d in (64, 128):  # a mask block always holds whole query tiles of it
        assert catalog.block_mask_granularity("bfloat16", d)[0] % fwd.tile.block_m == 0
    ws = catalog.dkdv_kernel("sm90-ws", "bfloat16", 128, Variant(local=True))
    one_block = catalog.dkdv_kernel("sm90-tma", "bfloat16", 128, Variant(local=True))
    assert ws.name_expression == f"cupyflash::flash_bwd_dkdv_ws_kernel<{ws.traits}, true, false>"
    assert ws.source_file == "sm90/bwd_dkdv_ws.cu" and one_block.source_file == "sm90/bwd_dkdv.cu"
    assert ws.smem_bytes == one_block.smem_bytes + 2 * 64 * 32 * 4  # and the two dQ boxes it rounds through
    assert (ws.num_threads, one_block.num_threads) == (384, 256)
    assert ws.grid(2, 3, 300, 700, sm_count=132) == (2 * 3 * 6, 1, 1)  # 6 key tiles of 128
    assert ws.grid(4, 16, 4096, 4096, sm_count=132) == (132, 1, 1)
    assert ws.grid(2, 3, 300, 0, sm_count=132)[0] == 0 == one_block.grid(2, 3, 300, 0)[0]  # no keys: no launch
    assert one_block.grid(4, 16, 4096, 4096) == (32, 16, 4)
    cp_async = catalog.dkdv_kernel("sm90", "bfloat16", 128, Variant(local=True))
    assert cp_async.smem_bytes + 2 * 2 * 64 * 64 * 4 == one_block.smem_bytes


# The planner picks its kernels on every call: the finders hand back one object per
# instantiation, whose cached name, tile and shared-memory size are those a fresh one computes.
@pytest.mark.parametrize("pick", [
    lambda: (catalog.forward_kernel("sm90", "bfloat16", 100, Variant(local=True)),),
    lambda: (catalog.dkdv_kernel("sm90", "bfloat16", 100, Variant(local=True)),
             catalog.dq_kernel(True, "bfloat16", 100, Variant(local=True))),
    lambda: (catalog.dkdv_kernel("sm80", "float16", 96, large_smem=True),),
    lambda: (catalog.dkdv_kernel("scalar", "float64", 59, Variant(True, True)),),
])
def test_the_finders_are_memoised_with_the_fresh_figures(pick):
    first, again = pick(), pick()
    assert all(a is b for a, b in zip(first, again))
    for kernel in first:
        fresh = dataclasses.replace(kernel)
        assert fresh is not kernel and fresh == kernel and hash(fresh) == hash(kernel)
        for name in ("name_expression", "tile", "smem_bytes", "num_threads"):
            assert getattr(fresh, name) == getattr(kernel, name)


# --------------------------------------------------------------------------- compile-time agreement


def test_wrong_shared_memory_size_fails_to_compile(monkeypatch):
    kernel = catalog.forward_kernel("scalar", "float32", 64)
    true_bytes = kernel.smem_bytes
    monkeypatch.setattr(FwdKernel, "smem_bytes", property(lambda self: true_bytes + 16))
    with pytest.raises(RuntimeError, match="disagree on shared memory"):
        compiler.compile_offline([kernel], "sm_80")


@pytest.mark.parametrize("kernel_class", [BwdDkdvKernel, BwdDqKernel, TcFwdKernel, TcBwdDkdvKernel, TcBwdDqKernel])
def test_wrong_backward_shared_memory_size_fails_to_compile(monkeypatch, kernel_class):
    dtype_name = "float16" if kernel_class.__name__.startswith("Tc") else "float64"
    kernel = kernel_class(dtype_name, 96, True)
    true_bytes = kernel.smem_bytes
    monkeypatch.setattr(kernel_class, "smem_bytes", property(lambda self: true_bytes - 8))
    with pytest.raises(RuntimeError, match="disagree on shared memory"):
        compiler.compile_offline([kernel], "sm_80")


@pytest.mark.parametrize("backward", [False, True])
def test_wrong_hopper_shared_memory_size_fails_to_compile(monkeypatch, backward):
    make = catalog.dkdv_kernel if backward else catalog.forward_kernel
    kernel = make("sm90", "bfloat16", 100, Variant(local=True))
    true_bytes = kernel.smem_bytes
    monkeypatch.setattr(type(kernel), "smem_bytes", property(lambda self: true_bytes - 1024))
    with pytest.raises(RuntimeError, match="disagree on shared memory"):
        compiler.compile_offline([kernel], "sm_90a")


@pytest.mark.parametrize("kernel", [
    catalog.decode_kernel("float16", 100, tensor_cores=True), catalog.decode_kernel("float64", 200),
])
def test_wrong_decode_shared_memory_size_fails_to_compile(monkeypatch, kernel):
    true_bytes = kernel.smem_bytes
    monkeypatch.setattr(type(kernel), "smem_bytes", property(lambda self: true_bytes + 4))
    with pytest.raises(RuntimeError, match="disagree"):
        compiler.compile_offline([kernel], "sm_80")


def test_wrong_row_kernel_threads_fail_to_compile(monkeypatch):
    kernel = BwdRowKernel("preprocess", "bfloat16")
    monkeypatch.setattr(BwdRowKernel, "num_threads", kernel.num_threads // 2)
    with pytest.raises(RuntimeError, match="disagree on the row kernels' threads"):
        compiler.compile_offline([kernel], "sm_80")


@pytest.mark.parametrize("struct,kernel", [
    ("cupyflash::FwdParams", catalog.forward_kernel("scalar", "float32", 64)),
    ("cupyflash::BwdParams", BwdRowKernel("preprocess", "float32")),
    ("cupyflash::DecodeParams", DecodeAppendKernel("float32")),
])
def test_wrong_params_layout_fails_to_compile(monkeypatch, struct, kernel):
    wider = numpy.dtype(params.STRUCTS[struct].descr + [("extra", "i8")], align=True)
    monkeypatch.setitem(params.STRUCTS, struct, wider)
    compiler.kernel_source.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="size differs from the host"):
            compiler.compile_offline([kernel], "sm_80")
    finally:
        compiler.kernel_source.cache_clear()


def test_source_holds_every_header_byte_so_the_cache_key_sees_edits(tmp_path, monkeypatch):
    root = compiler.kernels_dir()
    sources = {str(cu.relative_to(root)): compiler.kernel_source(str(cu.relative_to(root)))
               for cu in root.rglob("*.cu")}
    assert set(sources) == {k.source_file for k in catalog.all_kernels()}
    for header in root.rglob("*.cuh"):
        # Every run of text between #include / #pragma once lines appears verbatim in a source.
        for chunk in compiler._INCLUDE.split(compiler._PRAGMA_ONCE.sub("", header.read_text()))[::2]:
            assert any(chunk in s for s in sources.values()), f"part of {header.name} is not inlined"
    assert not any('#include "' in s for s in sources.values())
    source = sources["scalar/bwd.cu"]

    copy = tmp_path / "kernels"
    shutil.copytree(root, copy)
    (copy / "common" / "numeric.cuh").write_text((copy / "common" / "numeric.cuh").read_text() + "\n// an edit\n")
    monkeypatch.setattr(compiler, "kernels_dir", lambda: copy)
    compiler.kernel_source.cache_clear()
    try:
        edited = compiler.kernel_source("scalar/bwd.cu")
        assert edited != source and "// an edit" in edited
    finally:
        compiler.kernel_source.cache_clear()


def test_the_layers_include_only_downwards():
    """kernels/ in layers: common <- arch <- tc <- sm80 | sm90 (sm90's traits extend sm80's) <- the
    kernels; scalar/ and decode/ beside them. A Hopper source is no Ampere build's include."""
    root = compiler.kernels_dir()
    allowed = {"common": {"common"}, "arch": {"common"}, "tc": {"common", "arch", "tc"},
               "sm80": {"common", "arch", "tc", "sm80"}, "sm90": {"common", "arch", "tc", "sm80", "sm90"},
               "scalar": {"common", "scalar"}, "rows": {"common"}, "decode": {"common", "arch", "tc", "sm80", "decode"}}
    for path in list(root.rglob("*.cu")) + list(root.rglob("*.cuh")):
        layer = path.relative_to(root).parts[0]
        for included in compiler._INCLUDE.findall(path.read_text()):
            assert included.split("/")[0] in allowed[layer], f"{path.relative_to(root)} includes {included}"

    def closure(name, seen):
        if name not in seen:
            seen.add(name)
            for included in compiler._INCLUDE.findall((root / name).read_text()):
                closure(included, seen)
        return seen

    for source in {k.source_file for k in catalog.all_kernels("sm_80")}:
        assert not any(name.startswith("sm90/") for name in closure(source, set())), source


# ptxas' log (NVRTC 13.5, sm_90a) for a kernel that scales an accumulator between wgmma and its wait.
_SERIALIZED_LOG = """\
ptxas info    : (C7517) wgmma.wait_group is injected in around line 124 by compiler to allow use of registers defined by GMMA in function 'k2'
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the wgmma pipeline in the function 'k' in line 158
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 58 registers, used 0 barriers
ptxas info    : Compiling entry function 'k2' for 'sm_90a'
ptxas info    : Function properties for k2
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
ptxas info    : Compiling entry function 'k3' for 'sm_90a'
ptxas info    : Function properties for k3
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
"""


def test_ptxas_notes_of_serialized_wgmma_are_reported():
    kernels = {name: catalog.forward_kernel("sm90", "bfloat16", d) for name, d in (("k", 64), ("k2", 128))}
    kernels["k3"] = catalog.forward_kernel("sm90", "bfloat16", 64, Variant(local=True))
    reports = {r.name_expression: r for r in compiler.parse_ptxas_log(_SERIALIZED_LOG, kernels, "sm_90a")}
    assert [reports[kernels[n].name_expression].wgmma_serialized for n in ("k", "k2", "k3")] == [True, True, False]
    assert reports[kernels["k"].name_expression].registers == 58


def test_check_kernels_command():
    """The command compiles a selection and reports it; a bad architecture fails. (Every build:
    `python -m cupyflash check-kernels`, CI's own step, and the compile-marked tests.)"""
    cmd = [sys.executable, "-m", "cupyflash", "check-kernels", "--arch", "sm_80", "--dtype", "float64",
           "--source", "rows/bwd_rows.cu"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=pathlib.Path(__file__).parents[1])
    assert done.returncode == 0, done.stdout + done.stderr
    # the preprocess and the conversion, each in both launch shapes
    assert "4 of 4 kernel builds compiled; 0 spill; 0 wgmma serialized" in done.stdout
    assert "[1/1] sm_80 rows/bwd_rows.cu float64: 4 kernels" in done.stdout
    bad = subprocess.run(cmd[:4] + ["--arch", "sm_10", "--dtype", "float64", "--source", "rows/bwd_rows.cu"],
                         capture_output=True, text=True, cwd=pathlib.Path(__file__).parents[1])
    assert bad.returncode == 1 and "FAILED to compile" in bad.stdout  # (NVRTC knows no sm_10)
