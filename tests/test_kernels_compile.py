"""Every kernel instantiation (forward and backward) compiles with NVRTC for sm_80 and sm_90a, without spills; the
compile-time checks that tie the host's numbers to the kernels' really fire. No GPU needed."""

import dataclasses
import pathlib
import shutil
import subprocess
import sys

import numpy
import pytest

from cupyflash import BlockMask, _compile, _instantiations

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy's NVRTC bindings are needed")
ARCHS = ["sm_80", "sm_90a"]


# One NVRTC program per (architecture, source file, dtype), as check-kernels builds them: the scalar
# kernels for every dtype, the tensor-core kernels for float16 / bfloat16, the Hopper ones for sm_90a only.
GROUPS = sorted({(arch, k.source_file, k.dtype_name) for arch in ARCHS for k in _instantiations.all_kernels(arch)})


def test_groups_cover_every_kernel_and_the_hopper_kernels_only_sm_90a():
    assert {(s, d) for _, s, d in GROUPS} == {(k.source_file, k.dtype_name) for k in _instantiations.all_kernels()}
    hopper = _instantiations.all_wgmma_kernels()
    assert hopper and all(_instantiations.runs_on(k, "sm_90a") for k in hopper)
    assert not any(_instantiations.runs_on(k, arch) for k in hopper for arch in ("sm_80", "sm_90", "sm_100a"))


@pytest.mark.parametrize("arch,source_file,dtype_name", GROUPS)
def test_every_instantiation_compiles_without_spills(arch, dtype_name, source_file):
    kernels = [k for k in _instantiations.all_kernels(arch) if k.dtype_name == dtype_name and k.source_file == source_file]
    assert kernels
    reports = _compile.compile_offline(kernels, arch)
    assert sorted(r.name_expression for r in reports) == sorted(k.name_expression for k in kernels)
    for r in reports:
        assert r.spill_store_bytes == 0 and r.spill_load_bytes == 0 and r.stack_bytes == 0, r
        assert 0 < r.registers <= 255, r
        assert not r.wgmma_serialized, r
    for k, r in zip(sorted(kernels, key=lambda k: k.name_expression), sorted(reports, key=lambda r: r.name_expression)):
        # The Hopper kernels run on sm_90 only: an H100's shared memory.
        large = getattr(k, "large_smem", False) or getattr(k, "arch", None) == _instantiations.WGMMA_ARCH
        limit = _instantiations.SMEM_H100 if large else _instantiations.SMEM_A100
        assert r.smem_bytes <= limit, f"{r.name_expression} does not fit an {'H100' if large else 'A100'}'s shared memory"


def test_instantiation_list_covers_every_dtype_head_dim_and_causal_setting():
    kernels = _instantiations.all_fwd_kernels()
    # dense, causal x block-sparse, the score-modifier (softcap, ALiBi) kernels with causal's band, and
    # the variable-length one (band, score modifiers, dense)
    assert len(set(kernels)) == len(kernels) == 4 * len(_instantiations.PADDED_HEAD_DIMS) * 7
    everything = _instantiations.all_kernels()
    assert len(set(everything)) == len(everything)
    for dtype_name in _instantiations.DTYPE_NAMES:
        for d in range(1, 257, 7):
            for causal in (False, True):
                for sparse in (False, True):
                    assert _instantiations.fwd_kernel(dtype_name, d, causal, block_sparse=sparse) in everything
                    assert all(k in everything for k in _instantiations.bwd_kernels(dtype_name, d, causal, block_sparse=sparse))
                if dtype_name in _instantiations.TENSOR_CORE_DTYPES:
                    for sparse in (False, True):
                        assert _instantiations.fwd_kernel(dtype_name, d, causal, True, sparse) in everything
                        for large in (False, True):
                            pair = _instantiations.bwd_kernels(dtype_name, d, causal, True, large, sparse)
                            assert all(k in everything for k in pair)
                        if _instantiations.padded_head_dim(d) in _instantiations.WGMMA_HEAD_DIMS:
                            assert _instantiations.fwd_kernel(dtype_name, d, causal, True, sparse, wgmma=True) in everything
                            pair = _instantiations.bwd_kernels(dtype_name, d, causal, True, block_sparse=sparse, wgmma=True)
                            assert isinstance(pair[0], _instantiations.WgmmaBwdDkdvKernel)
                            assert all(k in everything for k in pair)
        for step in _instantiations.BWD_ROW_STEPS:
            most = _instantiations.BwdRowKernel(step, dtype_name).rows_per_block * _instantiations.MAX_GRID_Y
            for seqlen_q in (1, 4096, most, most + 1):  # the last: too many row blocks for gridDim.y
                kernel = _instantiations.bwd_row_kernel(step, dtype_name, seqlen_q)
                assert kernel in everything and kernel.heads_fastest == (seqlen_q <= most)
                assert max(kernel.grid(2, 16, seqlen_q)[1:]) <= _instantiations.MAX_GRID_Y
    for d in range(1, 257):
        padded = _instantiations.padded_head_dim(d)
        assert d <= padded and padded in _instantiations.PADDED_HEAD_DIMS
    with pytest.raises(ValueError, match="at most 256"):
        _instantiations.padded_head_dim(257)


def test_wrong_shared_memory_size_fails_to_compile(monkeypatch):
    kernel = _instantiations.fwd_kernel("float32", 64, False)
    true_bytes = kernel.smem_bytes
    monkeypatch.setattr(_instantiations.FwdKernel, "smem_bytes", property(lambda self: true_bytes + 16))
    with pytest.raises(RuntimeError, match="disagree on shared memory"):
        _compile.compile_offline([kernel], "sm_80")


@pytest.mark.parametrize("kernel_class", [
    _instantiations.BwdDkdvKernel, _instantiations.BwdDqKernel,
    _instantiations.TcFwdKernel, _instantiations.TcBwdDkdvKernel, _instantiations.TcBwdDqKernel,
])
def test_wrong_backward_shared_memory_size_fails_to_compile(monkeypatch, kernel_class):
    dtype_name = "float16" if kernel_class.__name__.startswith("Tc") else "float64"
    kernel = kernel_class(dtype_name, 96, True)
    true_bytes = kernel.smem_bytes
    monkeypatch.setattr(kernel_class, "smem_bytes", property(lambda self: true_bytes - 8))
    with pytest.raises(RuntimeError, match="disagree on shared memory"):
        _compile.compile_offline([kernel], "sm_80")


@pytest.mark.parametrize("backward", [False, True])
def test_wrong_hopper_shared_memory_size_fails_to_compile(monkeypatch, backward):
    if backward:
        kernel = _instantiations.bwd_kernels("bfloat16", 100, True, True, wgmma=True)[0]
    else:
        kernel = _instantiations.fwd_kernel("bfloat16", 100, True, wgmma=True)
    true_bytes = kernel.smem_bytes
    monkeypatch.setattr(type(kernel), "smem_bytes", property(lambda self: true_bytes - 1024))
    with pytest.raises(RuntimeError, match="disagree on shared memory"):
        _compile.compile_offline([kernel], "sm_90a")


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
    kernels = {name: _instantiations.fwd_kernel("bfloat16", d, False, wgmma=True) for name, d in (("k", 64), ("k2", 128))}
    kernels["k3"] = _instantiations.fwd_kernel("bfloat16", 64, True, wgmma=True)
    reports = {r.name_expression: r for r in _compile._parse_ptxas_log(_SERIALIZED_LOG, kernels, "sm_90a")}
    assert [reports[kernels[n].name_expression].wgmma_serialized for n in ("k", "k2", "k3")] == [True, True, False]
    assert reports[kernels["k"].name_expression].registers == 58


@pytest.mark.parametrize("kernel", [
    _instantiations.decode_kernel("float16", 100, tensor_cores=True), _instantiations.decode_kernel("float64", 200),
])
def test_wrong_decode_shared_memory_size_fails_to_compile(monkeypatch, kernel):
    true_bytes = kernel.smem_bytes
    monkeypatch.setattr(type(kernel), "smem_bytes", property(lambda self: true_bytes + 4))
    with pytest.raises(RuntimeError, match="disagree"):
        _compile.compile_offline([kernel], "sm_80")


def test_wrong_row_kernel_threads_fail_to_compile(monkeypatch):
    kernel = _instantiations.BwdRowKernel("preprocess", "bfloat16")
    monkeypatch.setattr(_instantiations.BwdRowKernel, "num_threads", kernel.num_threads // 2)
    with pytest.raises(RuntimeError, match="disagree on the row kernels' threads"):
        _compile.compile_offline([kernel], "sm_80")


@pytest.mark.parametrize("attr,kernel", [
    ("FWD_PARAMS_DTYPE", _instantiations.fwd_kernel("float32", 64, False)),
    ("BWD_PARAMS_DTYPE", _instantiations.BwdRowKernel("preprocess", "float32")),
    ("DECODE_PARAMS_DTYPE", _instantiations.DecodeAppendKernel("float32")),
])
def test_wrong_params_layout_fails_to_compile(monkeypatch, attr, kernel):
    wider = numpy.dtype(getattr(_instantiations, attr).descr + [("extra", "i8")], align=True)
    monkeypatch.setattr(_instantiations, attr, wider)
    _compile.kernel_source.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="size differs from the host"):
            _compile.compile_offline([kernel], "sm_80")
    finally:
        _compile.kernel_source.cache_clear()


def test_source_holds_every_header_byte_so_the_cache_key_sees_edits(tmp_path, monkeypatch):
    sources = {cu.name: _compile.kernel_source(cu.name) for cu in _compile.kernels_dir().glob("*.cu")}
    assert set(sources) == {"flash_fwd.cu", "flash_bwd.cu", "flash_fwd_tc.cu", "flash_bwd_tc.cu", "flash_decode.cu"}
    for header in _compile.kernels_dir().glob("*.cuh"):
        # Every run of text between #include / #pragma once lines appears verbatim in a source.
        for chunk in _compile._INCLUDE.split(_compile._PRAGMA_ONCE.sub("", header.read_text()))[::2]:
            assert any(chunk in s for s in sources.values()), f"part of {header.name} is not inlined"
    assert not any('#include "' in s for s in sources.values())
    source = sources["flash_bwd.cu"]

    copy = tmp_path / "kernels"
    shutil.copytree(_compile.kernels_dir(), copy)
    (copy / "numeric.cuh").write_text((copy / "numeric.cuh").read_text() + "\n// an edit\n")
    monkeypatch.setattr(_compile, "kernels_dir", lambda: copy)
    _compile.kernel_source.cache_clear()
    try:
        edited = _compile.kernel_source("flash_bwd.cu")
        assert edited != source and "// an edit" in edited
    finally:
        _compile.kernel_source.cache_clear()


def test_check_kernels_command(tmp_path):
    cmd = [sys.executable, "-m", "cupyflash", "check-kernels", "--arch", "sm_80", "--dtype", "float64"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=pathlib.Path(__file__).parents[1])
    assert done.returncode == 0, done.stdout + done.stderr
    # 63 forward, 126 + 4 backward (dense, block-sparse, score modifiers, varlen; the row kernels in both
    # launch shapes), 9 + 9 + 1 decoding (plain, softcap/ALiBi, append)
    assert "212 of 212 kernel builds compiled; 0 spill; 0 wgmma serialized" in done.stdout
    assert "cupyflash::FwdTraits<double, 256" in done.stdout
    assert "cupyflash::BwdDkdvTraits<double, 256" in done.stdout

    bad = subprocess.run(cmd[:4] + ["--arch", "sm_1", "--dtype", "float64"], capture_output=True, text=True,
                         cwd=pathlib.Path(__file__).parents[1])
    assert bad.returncode == 1 and "FAILED to compile" in bad.stdout


def test_wgmma_probe_tool_compiles():
    """benchmarks/wgmma_probe.py, the Hopper products alone (a debugging aid), keeps compiling."""
    import importlib.util

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "wgmma_probe.py"
    spec = importlib.util.spec_from_file_location("wgmma_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.main(["--compile-only", "--head-dim", "64", "--block-n", "128"]) == 0


@pytest.mark.parametrize("cc,dtype,head_dim,backward_on", [
    (90, "bfloat16", 100, False), (90, "float16", 64, True), (90, "bfloat16", 160, True),
    (90, "float32", 64, True), (80, "bfloat16", 64, True), (100, "float16", 128, True),
])
def test_hopper_kernels_are_chosen_on_sm_90_only(monkeypatch, cc, dtype, head_dim, backward_on):
    """The dispatch, without a GPU: the Hopper forward on sm_90 for 16-bit head dims padded to 64 or
    128 unless switched off, the Hopper dK/dV kernel there only when switched on."""
    from cupyflash import _attention, _validation

    monkeypatch.setattr(_attention, "_compute_capability", lambda device_id: cc)
    monkeypatch.setattr(_attention, "large_shared_memory", lambda device_id: cc >= 90)
    monkeypatch.setattr(_instantiations, "WGMMA_FORWARD_BY_DEFAULT", True)
    monkeypatch.setattr(_instantiations, "WGMMA_BACKWARD_BY_DEFAULT", backward_on)
    q = numpy.zeros((1, 8, 2, head_dim), _validation.BFLOAT16 if dtype == "bfloat16" else dtype)
    p = _validation.check_attention_args(q, q, q, causal=True, scale=None, return_lse=True)
    hopper = cc == 90 and dtype != "float32" and head_dim <= 128
    assert isinstance(_attention.forward_kernel(p, 0), _instantiations.WgmmaFwdKernel) == hopper
    dkdv, dq = _attention.backward_kernels(p, 0)
    assert isinstance(dkdv, _instantiations.WgmmaBwdDkdvKernel) == (hopper and backward_on)
    assert isinstance(dq, _instantiations.TcBwdDqKernel) == (dtype != "float32")  # mma.sync on every GPU
    monkeypatch.setattr(_instantiations, "WGMMA_FORWARD_BY_DEFAULT", False)
    assert not isinstance(_attention.forward_kernel(p, 0), _instantiations.WgmmaFwdKernel)


# The launch path picks its kernels on every call: the tables hand back one object per
# instantiation, whose cached name, tile and shared-memory size are those a fresh one computes.
@pytest.mark.parametrize("pick", [
    lambda: (_instantiations.fwd_kernel("bfloat16", 100, True, wgmma=True),),
    lambda: _instantiations.bwd_kernels("bfloat16", 100, True, True, wgmma=True),
    lambda: _instantiations.bwd_kernels("float16", 96, False, True, large_smem=True),
    lambda: _instantiations.bwd_kernels("float64", 59, True, block_sparse=True),
])
def test_kernel_tables_are_memoised_with_the_fresh_figures(pick):
    first, again = pick(), pick()
    assert all(a is b for a, b in zip(first, again))
    for kernel in first:
        fresh = dataclasses.replace(kernel)
        assert fresh is not kernel and fresh == kernel and hash(fresh) == hash(kernel)
        for name in ("name_expression", "tile", "smem_bytes", "num_threads"):
            assert getattr(fresh, name) == getattr(kernel, name)


@pytest.mark.parametrize("head_dim,causal,sparse,tma", [
    (64, False, False, True), (40, False, True, True), (112, False, False, True), (128, False, True, True),
    (64, True, False, True), (128, True, True, True), (100, True, False, True), (160, False, False, False),
    (160, True, False, False),
])
def test_the_hopper_forward_takes_its_tma_builds_where_they_exist(monkeypatch, head_dim, causal, sparse, tma):
    """Dense, block-sparse and local (causal) at TMA_FORWARD_HEAD_DIMS; tma=False and
    CUPYFLASH_HOPPER_TMA=0 (TMA_FORWARD_BY_DEFAULT) take the cp.async build, its twin, which has the
    TMA build's tile except in the unmasked d128 builds."""
    from cupyflash import _attention, _validation

    monkeypatch.setattr(_attention, "_compute_capability", lambda device_id: 90)
    monkeypatch.setattr(_instantiations, "WGMMA_FORWARD_BY_DEFAULT", True)
    monkeypatch.setattr(_instantiations, "TMA_FORWARD_BY_DEFAULT", True)
    monkeypatch.setattr(_instantiations, "WS_FORWARD_BY_DEFAULT", False)  # (its own test below)
    q = numpy.zeros((1, 300, 2, head_dim), _validation.BFLOAT16)
    p = _validation.check_attention_args(q, q, q, causal=causal, scale=None, return_lse=True)
    if sparse:
        p = _validation.check_block_mask(BlockMask(numpy.ones((1, 3, 3), bool)), p)
    kernel = _attention.forward_kernel(p, 0)
    assert getattr(kernel, "tma", False) == tma
    everything = _instantiations.all_kernels("sm_90a")
    assert kernel in everything
    if tma:
        twin = _instantiations.without_tma(kernel)
        assert twin in everything and not twin.tma and twin.block_sparse == sparse
        assert twin == _attention.forward_kernel(p, 0, tma=False)
        assert kernel.name_expression.endswith(f"{str(causal).lower()}, {str(sparse).lower()}, false, false, true>")
        assert (twin.tile == kernel.tile) == (causal or kernel.head_dim != 128)
        monkeypatch.setattr(_instantiations, "TMA_FORWARD_BY_DEFAULT", False)
        assert _attention.forward_kernel(p, 0) == twin


@pytest.mark.parametrize("head_dim,causal,sparse,ws", [
    (100, False, False, True), (112, False, True, True), (128, False, False, True), (128, False, True, True),
    (64, False, False, True), (40, False, True, True), (128, True, True, False), (160, False, False, False),
])
def test_the_warp_specialised_forward_serves_unmasked_tma_problems(monkeypatch, head_dim, causal, sparse, ws):
    """With ws=True the unmasked problems (dense or block-sparse) at WS_FORWARD_HEAD_DIMS take the
    warp-specialised kernel; local ones keep the TMA build. By default (WS_FORWARD_BY_DEFAULT, off
    with CUPYFLASH_HOPPER_WS=0) d128 takes it, d64 only for a sparse enough mask (next test). Its
    instantiations are in the list every check compiles."""
    from cupyflash import _attention, _validation

    monkeypatch.setattr(_attention, "_compute_capability", lambda device_id: 90)
    monkeypatch.setattr(_instantiations, "WGMMA_FORWARD_BY_DEFAULT", True)
    monkeypatch.setattr(_instantiations, "TMA_FORWARD_BY_DEFAULT", True)
    q = numpy.zeros((1, 300, 2, head_dim), _validation.BFLOAT16)
    p = _validation.check_attention_args(q, q, q, causal=causal, scale=None, return_lse=True)
    if sparse:
        p = _validation.check_block_mask(BlockMask(numpy.ones((1, 3, 3), bool)), p)
    kernel = _attention.forward_kernel(p, 0, ws=True)
    assert isinstance(kernel, _instantiations.WgmmaFwdWsKernel) == ws
    assert kernel in _instantiations.all_kernels("sm_90a")
    assert not isinstance(_attention.forward_kernel(p, 0, ws=False), _instantiations.WgmmaFwdWsKernel)
    monkeypatch.setattr(_instantiations, "WS_FORWARD_BY_DEFAULT", False)
    assert not isinstance(_attention.forward_kernel(p, 0), _instantiations.WgmmaFwdWsKernel)
    monkeypatch.setattr(_instantiations, "WS_FORWARD_BY_DEFAULT", True)
    # (the d64 mask walks 3 key blocks a tile)
    assert (_attention.forward_kernel(p, 0) == kernel) == (not ws or head_dim > 64 or sparse)
    if ws:
        assert kernel.block_sparse == sparse and kernel.num_threads == 384
        assert kernel.name_expression.endswith(f", {str(sparse).lower()}>")
        assert kernel.grid(2, 3, 1000, sm_count=132) == (2 * 3 * 8, 1, 1)
        assert kernel.grid(4, 32, 4096, sm_count=132) == (132, 1, 1)
        # A mask block always holds whole query tiles of it.
        assert _instantiations.block_mask_granularity("bfloat16", head_dim)[0] % kernel.tile.block_m == 0
    for args, kwargs in ((("bfloat16", 128, True), {}), (("bfloat16", 64, False), {"score_mod": True}),
                         (("bfloat16", 128, False), {"block_sparse": True,
                                                     "tile_override": _instantiations.WsTileShape(192, 64, 2)})):
        with pytest.raises(ValueError, match="warp-specialised"):
            _instantiations.WgmmaFwdWsKernel(*args, **kwargs)


@pytest.mark.parametrize("seqlen_k,kept,takes", [
    (4096, 0.1, True), (4096, 0.125, True), (4096, 0.13, False), (4096, 0.25, False), (4096, 1.0, False),
    (16384, 0.03, True), (16384, 0.05, False), (300, 1.0, True), (300, 0.0, True), (None, None, False),
])
def test_d64_takes_the_warp_specialised_forward_for_short_query_tiles(monkeypatch, seqlen_k, kept, takes):
    """At d64 the warp-specialised forward serves by default only block masks whose query tiles walk
    at most WS_FORWARD_MAX_STEPS (4) key blocks of 128 on average: density x ceil(seqlen_k / 128).
    Problems without a mask keep the TMA build (seqlen_k None: an unmasked problem of 300 keys)."""
    from cupyflash import _attention, _validation

    monkeypatch.setattr(_attention, "_compute_capability", lambda device_id: 90)
    monkeypatch.setattr(_instantiations, "WGMMA_FORWARD_BY_DEFAULT", True)
    monkeypatch.setattr(_instantiations, "TMA_FORWARD_BY_DEFAULT", True)
    monkeypatch.setattr(_instantiations, "WS_FORWARD_BY_DEFAULT", True)
    n_k = 3 if seqlen_k is None else -(-seqlen_k // 128)
    q = numpy.zeros((1, 256, 2, 64), _validation.BFLOAT16)
    k = numpy.zeros((1, 300 if seqlen_k is None else seqlen_k, 2, 64), _validation.BFLOAT16)
    p = _validation.check_attention_args(q, k, k, causal=False, scale=None, return_lse=True)
    if kept is not None:
        dense = numpy.zeros((2, 2, n_k), bool)
        dense.reshape(-1)[:round(kept * dense.size)] = True
        mask = BlockMask(dense)
        assert mask.density == pytest.approx(kept, abs=5e-3)
        p = _validation.check_block_mask(mask, p)
    kernel = _attention.forward_kernel(p, 0)
    assert isinstance(kernel, _instantiations.WgmmaFwdWsKernel) == takes
    assert kernel in _instantiations.all_kernels("sm_90a")
    monkeypatch.setattr(_instantiations, "WS_FORWARD_BY_DEFAULT", False)
    assert _attention.forward_kernel(p, 0).tma


def test_tma_builds_take_no_score_modifiers_and_no_packed_sequences():
    for flags in ({"local": True, "score_mod": True}, {"local": True, "varlen": True}):
        with pytest.raises(ValueError, match="TMA builds"):
            _instantiations.WgmmaFwdKernel("bfloat16", 64, block_sparse=False, tma=True, **flags)
    with pytest.raises(ValueError, match="TMA builds"):
        _instantiations.WgmmaFwdKernel("bfloat16", 256, False, tma=True)
    # Score modifiers (softcap, ALiBi, dropout) and packed sequences take the cp.async build.
    assert not _instantiations.fwd_kernel("bfloat16", 64, True, True, score_mod=True, wgmma=True, tma=True).tma
    assert not _instantiations.fwd_kernel("bfloat16", 64, True, True, varlen=True, wgmma=True, tma=True).tma


@pytest.mark.parametrize("pointer,strides,dims,ok", [
    (4096, (384000, 384, 64), (2, 1000, 6), True),      # contiguous d64, 16-bit: 768-byte rows
    (4096 + 2, (384000, 384, 64), (2, 1000, 6), False),  # 2 bytes off alignment
    (4096, (354000, 354, 59), (2, 1000, 6), False),      # d59: 708-byte rows
    (4096, (0, 128, 64), (1, 1000, 2), True),            # one batch entry: its stride does not matter
    (4096, (0, 128, 64), (2, 1000, 2), False),           # a broadcast batch (stride 0)
    (4096, (256000, -128, 64), (2, 1000, 2), False),     # keys reversed
    (4096, (256000, 128, 40), (2, 1000, 2), True),       # d40 heads, 80 bytes apart
    (4096, (256000, 128, 36), (2, 1000, 2), False),      # heads 72 bytes apart
])
def test_tensor_maps_describe_aligned_layouts_only(pointer, strides, dims, ok):
    from cupyflash import _tma

    assert _tma.describable(pointer, 2, strides, dims) == ok
    if not ok:  # no tensor map is made (nor the driver asked): the launch takes the cp.async build
        fields = {"k": pointer, "v": 4096, "v_batch_stride": 256000, "v_row_stride": 128, "v_head_stride": 64}
        fields.update(zip(("k_batch_stride", "k_row_stride", "k_head_stride"), strides))
        assert _tma.kv_tensor_maps(fields, dims, "bfloat16", 64, 128) is None
    assert _tma.NO_MAPS.nbytes == 2 * _tma.TENSOR_MAP_BYTES == 256  # sizeof(KvTensorMaps), static_assert'ed


def test_a_tensor_map_the_driver_declines_means_the_cp_async_build(monkeypatch):
    """cuTensorMapEncodeTiled's rules go beyond `describable`'s: a map it declines (a nonzero
    CUresult) makes kv_tensor_maps answer None, as for a misaligned array, not an error."""
    import ctypes

    from cupyflash import _tma

    calls = []

    def declining(*args):
        calls.append(args)
        return 1  # CUDA_ERROR_INVALID_VALUE

    u64_4, u64_3, u32_4 = ctypes.c_uint64 * 4, ctypes.c_uint64 * 3, ctypes.c_uint32 * 4
    monkeypatch.setattr(_tma, "_encode_tiled", lambda: (declining, u64_4, u64_3, u32_4))
    _tma._tile_map.cache_clear()
    try:
        fields = {"k": 4096, "v": 8192, "k_batch_stride": 64000, "k_row_stride": 128, "k_head_stride": 64,
                  "v_batch_stride": 64000, "v_row_stride": 128, "v_head_stride": 64}
        assert _tma.kv_tensor_maps(fields, (2, 500, 2), "bfloat16", 64, 128) is None
        assert len(calls) == 2 and calls[0][1] == 9 and calls[0][2] == 4  # bfloat16, 4-D
        assert list(calls[0][4]) == [64, 500, 2, 2] and list(calls[0][5]) == [256, 128, 128000]
        assert list(calls[0][6]) == [64, 128, 1, 1]
    finally:
        _tma._tile_map.cache_clear()


def test_the_warp_specialised_forwards_maps(monkeypatch):
    """FwdWsTensorMaps: Q's (boxes of a query tile), K's and V's (boxes of a key block), O's (boxes
    of a consumer warpgroup's 64 rows), each over its own strides; none at all where any one cannot
    be made, so the launch takes the TMA build."""
    from cupyflash import _tma

    calls = _recording_encoder(monkeypatch)
    _tma._tile_map.cache_clear()
    try:
        fields = {}
        for i, name in enumerate("qkvo"):  # q: heads interleaved in a wider array; the rest contiguous
            heads = 4 if name == "q" else 2
            fields.update({name: 4096 * (i + 1), f"{name}_batch_stride": 500 * heads * 128,
                           f"{name}_row_stride": heads * 128, f"{name}_head_stride": 128 * heads // 2})
        maps = _tma.fwd_ws_tensor_maps(fields, (2, 500, 2), (2, 500, 2), "bfloat16", 128, 128, 64, 64)
        assert maps is not None and maps.nbytes == 4 * _tma.TENSOR_MAP_BYTES == 512
        assert [c[3] for c in calls] == [4096, 8192, 12288, 16384]  # q, k, v, o: FwdWsTensorMaps' order
        assert [list(c[6]) for c in calls] == [[64, 128, 1, 1], [64, 64, 1, 1], [64, 64, 1, 1], [64, 64, 1, 1]]
        assert list(calls[0][5]) == [1024, 512, 512000] and list(calls[3][5]) == [512, 256, 256000]
        fields["o"] += 2  # off 16-byte alignment: no map for O, hence none
        assert _tma.fwd_ws_tensor_maps(fields, (2, 500, 2), (2, 500, 2), "bfloat16", 128, 128, 64, 64) is None
    finally:
        _tma._tile_map.cache_clear()


def _on_an_h100_with_the_hopper_backward(monkeypatch):
    """Dispatch as on an H100 (sm_90, its shared memory), the Hopper dK/dV kernel and its TMA builds on."""
    from cupyflash import _attention

    monkeypatch.setattr(_attention, "_compute_capability", lambda device_id: 90)
    monkeypatch.setattr(_attention, "large_shared_memory", lambda device_id: True)
    monkeypatch.setattr(_instantiations, "WGMMA_BACKWARD_BY_DEFAULT", True)
    monkeypatch.setattr(_instantiations, "TMA_BACKWARD_BY_DEFAULT", True)


@pytest.mark.parametrize("head_dim,causal,sparse,mods,deterministic,tma", [
    (64, False, False, {}, False, True), (40, True, True, {}, False, True), (128, True, False, {}, False, True),
    (112, False, True, {}, False, True), (64, False, False, {}, True, False),
    (128, False, False, {"softcap": 5.0}, False, False), (160, False, False, {}, False, False),
])
def test_the_hopper_dkdv_kernel_takes_its_tma_builds_where_they_exist(monkeypatch, head_dim, causal, sparse, mods,
                                                                       deterministic, tma):
    """Every variant without score modifiers, at both Hopper head dims, when the dQ sums are atomic;
    tma=False and CUPYFLASH_HOPPER_TMA=0 (TMA_BACKWARD_BY_DEFAULT) take the atomic build, its twin."""
    from cupyflash import _attention, _validation

    _on_an_h100_with_the_hopper_backward(monkeypatch)
    monkeypatch.setattr(_instantiations, "WS_BACKWARD_BY_DEFAULT", False)  # (the test below)
    q = numpy.zeros((1, 300, 2, head_dim), _validation.BFLOAT16)
    p = _validation.check_attention_args(q, q, q, causal=causal, scale=None, return_lse=True, **mods)
    p = dataclasses.replace(p, deterministic=deterministic)
    if sparse:
        p = _validation.check_block_mask(BlockMask(numpy.ones((1, 3, 3), bool)), p)
    kernel = _attention.backward_kernels(p, 0)[0]
    assert getattr(kernel, "tma", False) == tma
    everything = _instantiations.all_kernels("sm_90a")
    assert kernel in everything
    if tma:
        twin = _instantiations.without_tma(kernel)
        assert twin in everything and not twin.tma and twin.local == causal and twin.block_sparse == sparse
        assert twin == _attention.backward_kernels(p, 0, tma=False)[0]
        assert twin.smem_bytes + 2 * 2 * 64 * 64 * 4 == kernel.smem_bytes
        assert kernel.name_expression.endswith(f"{str(sparse).lower()}, false, false, true>")
        monkeypatch.setattr(_instantiations, "TMA_BACKWARD_BY_DEFAULT", False)
        assert _attention.backward_kernels(p, 0)[0] == twin
    with pytest.raises(ValueError, match="TMA builds"):
        _instantiations.WgmmaBwdDkdvKernel("bfloat16", 64, True, score_mod=True, tma=True)


@pytest.mark.parametrize("head_dim", [64, 40, 128, 112])
@pytest.mark.parametrize("causal,sparse", [(False, False), (True, False), (False, True), (True, True)])
def test_the_warp_specialised_dkdv_kernel_serves_tma_problems(monkeypatch, head_dim, causal, sparse):
    """At WS_BACKWARD_HEAD_DIMS the TMA build's warp-specialised form serves by default; ws=False
    or CUPYFLASH_HOPPER_WS_BWD=0 (WS_BACKWARD_BY_DEFAULT) take the one-block TMA build, and where a
    tensor map of dQ, Q or dO is missing the build without TMA (one block per key block) serves.
    Its grid: one block per key tile x K/V head x batch, at most one per SM, of 256 consumer
    threads and a producer warpgroup."""
    from cupyflash import _attention, _validation

    _on_an_h100_with_the_hopper_backward(monkeypatch)
    monkeypatch.setattr(_instantiations, "WS_BACKWARD_BY_DEFAULT", True)
    q = numpy.zeros((1, 300, 2, head_dim), _validation.BFLOAT16)
    p = _validation.check_attention_args(q, q, q, causal=causal, scale=None, return_lse=True)
    if sparse:
        p = _validation.check_block_mask(BlockMask(numpy.ones((1, 3, 3), bool)), p)
    kernel = _attention.backward_kernels(p, 0)[0]
    assert kernel.tma and kernel.ws and kernel in _instantiations.all_kernels("sm_90a")
    one_block = _attention.backward_kernels(p, 0, ws=False)[0]
    assert one_block.tma and not one_block.ws and dataclasses.replace(kernel, ws=False) == one_block
    assert _instantiations.without_tma(kernel) == _attention.backward_kernels(p, 0, tma=False)[0]
    monkeypatch.setattr(_instantiations, "WS_BACKWARD_BY_DEFAULT", False)
    assert _attention.backward_kernels(p, 0)[0] == one_block
    flags = f"{str(causal).lower()}, {str(sparse).lower()}"
    assert kernel.name_expression == f"cupyflash::flash_bwd_dkdv_ws_kernel<{kernel.traits}, {flags}>"
    assert kernel.smem_bytes == one_block.smem_bytes + 2 * 64 * 32 * 4  # and the two dQ boxes it rounds through
    assert (kernel.num_threads, one_block.num_threads) == (384, 256)
    assert kernel.grid(2, 3, 300, 700, sm_count=132) == (2 * 3 * 6, 1, 1)  # 6 key tiles of 128
    assert kernel.grid(4, 16, 4096, 4096, sm_count=132) == (132, 1, 1)
    assert kernel.grid(2, 3, 300, 0, sm_count=132)[0] == 0 == one_block.grid(2, 3, 300, 0)[0]  # no keys: no launch
    assert one_block.grid(4, 16, 4096, 4096) == (32, 16, 4)
    with pytest.raises(ValueError, match="warp-specialised"):
        _instantiations.WgmmaBwdDkdvKernel("bfloat16", 64, False, ws=True)


def test_the_dq_ring_holds_the_slabs_in_flight(monkeypatch):
    """The warp-specialised dK/dV kernel's dQ ring: twice the slabs its blocks hold items of, plus
    two, or WS_DQ_RING_BYTES' worth if more, never more than the launch's slabs; the override
    (tests, tuning) caps it at the slabs too."""
    kernel = _instantiations.WgmmaBwdDkdvKernel("bfloat16", 128, False, tma=True, ws=True)
    mb = 1 << 20
    # (the arithmetic, which d128 would take too) s4096, batch 4 x 16 heads: 32 key tiles a slab, 2 MB a slab
    assert kernel.ring_slabs(64, 32, 132, 2 * mb) == 2 * 5 + 2 == 24 * mb // (2 * mb)
    assert kernel.ring_slabs(128, 32, 132, 1 * mb) == 24  # d64: 24 MB of 1 MB slabs
    assert kernel.ring_slabs(16, 128, 132, 8 * mb) == 6  # s16384: two slabs in flight, 8 MB each
    assert kernel.ring_slabs(4, 3, 12, 1000) == 4  # a short launch: every slab its own slot
    monkeypatch.setattr(_instantiations, "WS_DQ_RING_SLABS", 2)
    assert kernel.ring_slabs(64, 32, 132, 2 * mb) == 2
    assert kernel.ring_slabs(1, 32, 132, 2 * mb) == 1


def test_the_dq_ring_serves_masks_that_give_its_rounding_time(monkeypatch):
    """The ring at WS_DQ_RING_HEAD_DIMS where a key block walks WS_DQ_RING_MIN_STEPS (4) query blocks
    or more on average: at 4096 tokens from density 0.125 (4 blocks of 128 queries; the sparse
    grid's 0.1 masks walk 3.2), at 16384 tokens from 0.05 (6.4 at 0.05); neither at d128 nor in the
    one-block build; WS_DQ_RING_SLABS forces it at any density."""
    d64 = _instantiations.WgmmaBwdDkdvKernel("bfloat16", 64, False, block_sparse=True, tma=True, ws=True)
    d128 = _instantiations.WgmmaBwdDkdvKernel("bfloat16", 128, False, block_sparse=True, tma=True, ws=True)
    assert [d64.takes_ring(density, 4096) for density in (1.0, 0.25, 0.125, 0.1, 0.05)] == [True] * 3 + [False] * 2
    assert d64.takes_ring(0.05, 16384) and d64.takes_ring(1.0, 385) and not d64.takes_ring(1.0, 384)
    assert not d128.takes_ring(1.0, 16384)
    assert not dataclasses.replace(d64, ws=False).takes_ring(1.0, 16384)
    monkeypatch.setattr(_instantiations, "WS_DQ_RING_SLABS", 2)
    assert d64.takes_ring(0.01, 128) and not d128.takes_ring(1.0, 16384)


@pytest.mark.parametrize("head_dim,density,seqlen_q,ws", [
    (64, None, 512, False), (64, None, 384, True), (64, None, 16384, False), (128, None, 512, True),
    (128, None, 16384, True), (112, None, 64, True), (64, 1.0, 512, False), (64, 0.25, 512, True),
    (64, 0.5, 512, False), (112, 1.0, 512, True), (40, 0.125, 512, True), (128, 0.5, 512, True)])
def test_the_warp_specialised_dkdv_kernel_serves_by_default(monkeypatch, head_dim, density, seqlen_q, ws):
    """Unset, CUPYFLASH_HOPPER_WS_BWD leaves the choice to the problem: block-sparse problems up to
    WS_BACKWARD_MAX_DENSITY of their head dim take the warp-specialised kernel, unmasked ones (density
    None here) up to WS_BACKWARD_UNMASKED_MAX_SEQLEN_Q queries (d64: 384, d128: any), the rest the
    one-block TMA build."""
    from cupyflash import _attention, _validation

    _on_an_h100_with_the_hopper_backward(monkeypatch)
    monkeypatch.setattr(_instantiations, "WS_BACKWARD_BY_DEFAULT", None)
    q = numpy.zeros((1, seqlen_q, 2, head_dim), _validation.BFLOAT16)
    p = _validation.check_attention_args(q, q, q, causal=False, scale=None, return_lse=True)
    if density is not None:
        dense = numpy.zeros(16, bool)
        dense[:round(16 * density)] = True
        p = _validation.check_block_mask(BlockMask(dense.reshape(1, 4, 4)), p)
        assert p.block_mask.density == density
    kernel = _attention.backward_kernels(p, 0)[0]
    assert kernel.tma and kernel.ws == ws


def _recording_encoder(monkeypatch) -> list:
    """Stands in for cuTensorMapEncodeTiled, succeeding; returns the list its calls' arguments go to."""
    import ctypes

    from cupyflash import _tma

    calls = []

    def encoding(*args):
        calls.append(args)
        return 0

    u64_4, u64_3, u32_4 = ctypes.c_uint64 * 4, ctypes.c_uint64 * 3, ctypes.c_uint32 * 4
    monkeypatch.setattr(_tma, "_encode_tiled", lambda: (encoding, u64_4, u64_3, u32_4))
    return calls


def test_the_dq_workspace_map(monkeypatch):
    """dq_accum (float32, contiguous (batch, seqlen_q, heads, head_dim)) as a 4-D map of 32 x 64
    boxes; head dims that are not multiples of 4 have rows off 16-byte boundaries: no map."""
    from cupyflash import _tma

    calls = _recording_encoder(monkeypatch)
    _tma._dq_tensor_map.cache_clear()
    try:
        made = _tma.dq_tensor_map(4096, (2, 500, 3), 100)
        assert made is not None and made.nbytes == _tma.TENSOR_MAP_BYTES
        assert len(calls) == 1 and calls[0][1] == 7 and calls[0][2] == 4  # float32, 4-D
        assert list(calls[0][4]) == [100, 500, 3, 2] and list(calls[0][5]) == [1200, 400, 600000]
        assert list(calls[0][6]) == [32, 64, 1, 1]
        assert _tma.dq_tensor_map(4096, (2, 500, 3), 59) is None and len(calls) == 1
        assert _tma.dq_tensor_map(4096, (1, 500, 1), 100) is not None  # one head, one batch entry
    finally:
        _tma._dq_tensor_map.cache_clear()


def test_the_dkdv_kernels_maps(monkeypatch):
    """BwdTensorMaps: dq_accum's map, then Q's and dO's (16-bit, 64-column panels by the kernel's
    query block, over their own strides); none at all where any one cannot be made, so the launch
    takes the build without TMA."""
    from cupyflash import _tma

    calls = _recording_encoder(monkeypatch)
    _tma._dq_tensor_map.cache_clear()
    _tma._tile_map.cache_clear()
    try:
        # q: heads interleaved in a wider array (head stride 2 x 64); dout contiguous.
        fields = {"q": 8192, "q_batch_stride": 500 * 6 * 64, "q_row_stride": 6 * 64, "q_head_stride": 128,
                  "dout": 16384, "dout_batch_stride": 500 * 3 * 64, "dout_row_stride": 3 * 64, "dout_head_stride": 64}
        maps = _tma.bwd_tensor_maps(fields, 4096, (2, 500, 3), "bfloat16", 64, 128)
        assert maps is not None and maps.nbytes == _tma.NO_BWD_MAPS.nbytes == 3 * _tma.TENSOR_MAP_BYTES == 384
        assert [c[3] for c in calls] == [4096, 8192, 16384]  # dq_accum, q, dout: BwdTensorMaps' order
        assert [c[1] for c in calls] == [7, 9, 9]  # float32, then bfloat16
        assert list(calls[1][4]) == [64, 500, 3, 2] and list(calls[1][5]) == [768, 256, 384000]
        assert list(calls[1][6]) == [64, 128, 1, 1] and list(calls[2][5]) == [384, 128, 192000]
        calls.clear()
        fields["dout"] += 2  # off 16-byte alignment: no map for dO, hence none
        assert _tma.bwd_tensor_maps(fields, 4096, (2, 500, 3), "bfloat16", 64, 128) is None
        fields["dout"] -= 2
        fields["q_head_stride"] = 100  # heads 200 bytes apart
        assert _tma.bwd_tensor_maps(fields, 4096, (2, 500, 3), "bfloat16", 64, 128) is None
    finally:
        _tma._dq_tensor_map.cache_clear()
        _tma._tile_map.cache_clear()
