"""The planner, without a GPU: which family, instantiation and fallback a problem takes on an
A100-like and an H100-like device (runtime.device.described) under each policy, and what explain
says; the dQ ring's arithmetic; the decode split heuristic."""

import dataclasses

import numpy
import pytest

import cupyflash
from cupyflash import catalog, validation
from cupyflash.api.common import check_block_mask
from cupyflash.block_mask import BlockMask
from cupyflash.catalog.tensor_cores import TcBwdDqKernel, WgmmaBwdDkdvKernel, WgmmaFwdKernel, WgmmaFwdWsKernel
from cupyflash.cpu import fallback
from cupyflash.dispatch import plan
from cupyflash.dispatch.decode import choose_splits
from cupyflash.dispatch.policy import Policy, current, override
from cupyflash.runtime.device import described
from shapes import numpy_dtype

H100, A100 = described(90), described(80)


def problem(head_dim, seqlen_q=300, seqlen_k=None, dtype="bfloat16", mask=None, deterministic=False, heads=2,
            heads_kv=None, **options):
    q = numpy.zeros((1, seqlen_q, heads, head_dim), numpy_dtype(dtype))
    k = numpy.zeros((1, seqlen_k or seqlen_q, heads_kv or heads, head_dim), numpy_dtype(dtype))
    p = validation.check_attention_args(q, k, k, scale=None, return_lse=True, **{"causal": False, **options})
    if mask is not None:
        p = check_block_mask(mask, p)
    return dataclasses.replace(p, deterministic=deterministic), q, k


def layouts(q, k, aligned=True):
    """The forward's and the backward's layouts of contiguous arrays (out and dout like q)."""
    forward = tuple((n, x.strides, aligned) for n, x in (("q", q), ("k", k), ("v", k), ("o", q)))
    backward = tuple((n, x.strides, aligned) for n, x in (("q", q), ("dout", q), ("k", k), ("v", k)))
    return forward, backward


def decide(p, q, k, device=H100, policy=Policy(), aligned=True):
    forward, backward = layouts(q, k, aligned)
    return plan.decide_forward(p, device, policy, forward), plan.decide_backward(p, device, policy, backward)


@pytest.mark.parametrize("cc,dtype,head_dim,hopper_backward", [
    (90, "bfloat16", 100, False), (90, "float16", 64, True), (90, "bfloat16", 160, True),
    (90, "float32", 64, True), (80, "bfloat16", 64, True), (100, "float16", 128, True),
])
def test_hopper_kernels_are_chosen_on_sm_90_only(cc, dtype, head_dim, hopper_backward):
    """The Hopper forward on sm_90 for 16-bit head dims padded to 64 or 128 unless switched off, the
    Hopper dK/dV kernel likewise; the deterministic dQ kernel is mma.sync on every tensor-core GPU."""
    p, q, k = problem(head_dim, dtype=dtype, causal=True, deterministic=True)
    forward, backward = decide(p, q, k, described(cc), Policy(hopper_backward=hopper_backward))
    hopper = cc == 90 and dtype != "float32" and head_dim <= 128
    assert isinstance(forward.kernel, WgmmaFwdKernel) == hopper
    assert isinstance(backward.kernel, WgmmaBwdDkdvKernel) == (hopper and hopper_backward)
    assert isinstance(backward.dq, TcBwdDqKernel) == (dtype != "float32")
    forward, _ = decide(p, q, k, described(cc), Policy(hopper_forward=False))
    assert not isinstance(forward.kernel, WgmmaFwdKernel)


@pytest.mark.parametrize("head_dim,causal,sparse,tma", [
    (64, False, False, True), (40, False, True, True), (112, False, False, True), (128, False, True, True),
    (64, True, False, True), (128, True, True, True), (104, True, False, True), (160, False, False, False),
    (160, True, False, False),
])
def test_the_hopper_forward_takes_its_tma_builds_where_they_exist(head_dim, causal, sparse, tma):
    """Dense, block-sparse and local (causal) at the TMA head dims; CUPYFLASH_HOPPER_TMA=0 takes the
    cp.async build, its twin (its fallback too), which has the TMA build's tile except in the
    unmasked d128 builds."""
    mask = BlockMask(numpy.ones((1, 3, 3), bool)) if sparse else None
    p, q, k = problem(head_dim, mask=mask, causal=causal)
    policy = Policy(ws_forward=False)
    forward, _ = decide(p, q, k, policy=policy)
    assert getattr(forward.kernel, "tma", False) == tma and forward.kernel in catalog.all_kernels()
    if tma:
        twin = forward.kernels[1]
        assert not twin.tma and twin.block_sparse == sparse and twin.local == causal
        assert forward.kernel.name_expression.endswith(f"{str(causal).lower()}, {str(sparse).lower()}, false, false, true>")
        assert (twin.tile == forward.kernel.tile) == (causal or forward.kernel.head_dim != 128)
        assert decide(p, q, k, policy=dataclasses.replace(policy, tma=False))[0].kernel == twin
        assert [c.family for c in forward.choices if c.taken] == ["sm90-tma"]


@pytest.mark.parametrize("head_dim,causal,sparse,ws", [
    (104, False, False, True), (112, False, True, True), (128, False, False, True), (128, False, True, True),
    (64, False, False, True), (40, False, True, True), (128, True, True, False), (160, False, False, False),
])
def test_the_warp_specialised_forward_serves_unmasked_tma_problems(head_dim, causal, sparse, ws):
    """Without the d64 rule the unmasked problems (dense or block-sparse) at the warp-specialised
    head dims take it, with the TMA build and the cp.async one as fallbacks; local ones keep the TMA
    build; CUPYFLASH_HOPPER_WS=0 switches it off. By default d64 takes it only for sparse enough
    masks (the next test)."""
    mask = BlockMask(numpy.ones((1, 3, 3), bool)) if sparse else None
    p, q, k = problem(head_dim, mask=mask, causal=causal)
    forward, _ = decide(p, q, k, policy=Policy(ws_forward_max_steps=()))
    assert isinstance(forward.kernel, WgmmaFwdWsKernel) == ws
    if ws:
        assert forward.kernel.block_sparse == sparse
        assert [type(x) for x in forward.kernels] == [WgmmaFwdWsKernel, WgmmaFwdKernel, WgmmaFwdKernel]
        assert forward.kernels[1].tma and not forward.kernels[2].tma
    off, _ = decide(p, q, k, policy=Policy(ws_forward=False))
    assert not isinstance(off.kernel, WgmmaFwdWsKernel)
    assert "CUPYFLASH_HOPPER_WS=0" in next(c.reason for c in off.choices if c.family == "sm90-ws") or not ws
    default, _ = decide(p, q, k)  # (the d64 mask walks 3 key blocks a tile)
    assert isinstance(default.kernel, WgmmaFwdWsKernel) == (ws and (head_dim > 64 or sparse))


@pytest.mark.parametrize("seqlen_k,kept,takes", [
    (4096, 0.1, True), (4096, 0.125, True), (4096, 0.13, False), (4096, 0.25, False), (4096, 1.0, False),
    (16384, 0.03, True), (16384, 0.05, False), (300, 1.0, True), (300, 0.0, True), (None, None, False),
])
def test_d64_takes_the_warp_specialised_forward_for_short_query_tiles(seqlen_k, kept, takes):
    """At d64 it serves by default only block masks whose query tiles walk at most 4 key blocks of
    128 on average: density x ceil(seqlen_k / 128). Unmasked problems keep the TMA build."""
    mask = None
    if kept is not None:
        dense = numpy.zeros((2, 2, -(-(seqlen_k or 300) // 128)), bool)
        dense.reshape(-1)[:round(kept * dense.size)] = True
        mask = BlockMask(dense)
        assert mask.density == pytest.approx(kept, abs=5e-3)
    p, q, k = problem(64, seqlen_q=256, seqlen_k=seqlen_k or 300, mask=mask)
    forward, _ = decide(p, q, k)
    assert isinstance(forward.kernel, WgmmaFwdWsKernel) == takes
    assert decide(p, q, k, policy=Policy(ws_forward=False))[0].kernel.tma


def test_layouts_without_tensor_maps_take_the_cp_async_builds():
    """Where an array cannot take a tensor map (an odd head dim's rows, a misaligned base), the TMA
    families are not taken, and explain says why."""
    p, q, k = problem(59)  # 118-byte rows
    forward, backward = decide(p, q, k)
    assert not forward.kernel.tma and not backward.kernel.tma
    assert "cannot take a tensor map" in next(c.reason for c in forward.choices if c.family == "sm90-tma")
    p, q, k = problem(64)
    forward, backward = decide(p, q, k, aligned=False)
    assert not forward.kernel.tma and not backward.kernel.tma


@pytest.mark.parametrize("head_dim,causal,sparse,mods,deterministic,tma", [
    (64, False, False, {}, False, True), (40, True, True, {}, False, True), (128, True, False, {}, False, True),
    (112, False, True, {}, False, True), (64, False, False, {}, True, False),
    (128, False, False, {"softcap": 5.0}, False, False), (160, False, False, {}, False, False),
])
def test_the_hopper_dkdv_kernel_takes_its_tma_builds_where_they_exist(head_dim, causal, sparse, mods,
                                                                       deterministic, tma):
    """Every variant without score modifiers, at both Hopper head dims, when the dQ sums are atomic;
    CUPYFLASH_HOPPER_TMA=0 takes the atomic build, its twin."""
    mask = BlockMask(numpy.ones((1, 3, 3), bool)) if sparse else None
    p, q, k = problem(head_dim, mask=mask, causal=causal, deterministic=deterministic, **mods)
    policy = Policy(ws_backward=False)
    _, backward = decide(p, q, k, policy=policy)
    kernel = backward.kernel
    assert getattr(kernel, "tma", False) == tma and kernel in catalog.all_kernels("sm_90a")
    if tma:
        twin = backward.kernels[1]
        assert not twin.tma and twin.local == causal and twin.block_sparse == sparse
        assert twin.smem_bytes + 2 * 2 * 64 * 64 * 4 == kernel.smem_bytes
        assert kernel.name_expression.endswith(f"{str(sparse).lower()}, false, false, true>")
        assert decide(p, q, k, policy=dataclasses.replace(policy, tma=False))[1].kernel == twin


@pytest.mark.parametrize("head_dim", [64, 40, 128, 112])
@pytest.mark.parametrize("causal,sparse", [(False, False), (True, False), (False, True), (True, True)])
def test_the_warp_specialised_dkdv_kernel_and_its_fallbacks(head_dim, causal, sparse):
    """CUPYFLASH_HOPPER_WS_BWD=1: the warp-specialised kernel, then the one-block TMA build, then the
    cp.async build (where a tensor map cannot be made); =0: the one-block TMA build."""
    mask = BlockMask(numpy.ones((1, 3, 3), bool)) if sparse else None
    p, q, k = problem(head_dim, mask=mask, causal=causal)
    _, backward = decide(p, q, k, policy=Policy(ws_backward=True))
    ws, one_block, cp_async = backward.kernels
    assert ws.ws and one_block.tma and not one_block.ws and not cp_async.tma
    assert dataclasses.replace(ws, ws=False) == one_block
    assert decide(p, q, k, policy=Policy(ws_backward=False))[1].kernel == one_block


@pytest.mark.parametrize("head_dim,density,seqlen_q,ws", [
    (64, None, 512, False), (64, None, 384, True), (64, None, 16384, False), (128, None, 512, True),
    (128, None, 16384, True), (112, None, 64, True), (64, 1.0, 512, False), (64, 0.25, 512, True),
    (64, 0.5, 512, False), (112, 1.0, 512, True), (40, 0.125, 512, True), (128, 0.5, 512, True)])
def test_the_warp_specialised_dkdv_kernel_serves_by_default(head_dim, density, seqlen_q, ws):
    """By default block-sparse problems up to the policy's density of their head dim take it,
    unmasked ones (density None) up to its query count (d64: 384, d128: any)."""
    mask = None
    if density is not None:
        dense = numpy.zeros(16, bool)
        dense[:round(16 * density)] = True
        mask = BlockMask(dense.reshape(1, 4, 4))
    p, q, k = problem(head_dim, seqlen_q=seqlen_q, seqlen_k=512, mask=mask)
    _, backward = decide(p, q, k)
    assert backward.kernel.tma and backward.kernel.ws == ws


def test_the_dq_ring_holds_the_slabs_in_flight():
    """The ring: twice the slabs the blocks hold items of, plus two, or the policy's bytes' worth if
    more, never more than the launch's slabs; forced slots are capped at the slabs too."""
    mb = 1 << 20
    kernel = catalog.dkdv_kernel("sm90-ws", "bfloat16", 64)

    def slots(batch, heads, seqlen_q, positions, blocks, policy=Policy(ring_min_steps=0)):
        p, _, _ = problem(64, seqlen_q=seqlen_q, heads=heads)
        return plan.ring_slots(dataclasses.replace(p, batch=batch), kernel, policy, positions, blocks)

    # s4096, batch 4 x 16 heads: 32 key tiles a slab, 0.5 MB a slab (bf16 d64: float32 rows of 256 bytes)
    assert slots(4, 16, 4096, 32, 132) == min(64, max(2 * 5 + 2, 24 * mb // (4096 * 64 * 4)))
    assert slots(4, 3, 16, 3, 12) == 12  # a short launch: every slab its own slot
    assert slots(4, 16, 4096, 32, 132, Policy(ring_slabs=2)) == 2
    assert slots(1, 1, 4096, 32, 132, Policy(ring_slabs=2)) == 1


def test_the_dq_ring_serves_masks_that_give_its_rounding_time():
    """At the ring's head dims where a key block walks 4 query blocks or more on average: at 4096
    queries from density 0.125, at 16384 from 0.05; never at d128; forced slots at any density."""
    def takes(head_dim, density, seqlen_q, policy=Policy()):
        n_q = -(-seqlen_q // 128)
        dense = numpy.zeros((1, n_q, 4), bool)
        dense.reshape(-1)[:round(density * dense.size)] = True
        p, _, _ = problem(head_dim, seqlen_q=seqlen_q, seqlen_k=512, mask=BlockMask(dense))
        kernel = catalog.dkdv_kernel("sm90-ws", "bfloat16", head_dim, catalog.Variant(block_sparse=True))
        return plan.ring_slots(p, kernel, policy, 4, 132) > 0

    assert [takes(64, d, 4096) for d in (1.0, 0.25, 0.125, 0.1, 0.05)] == [True] * 3 + [False] * 2
    assert takes(64, 0.05, 16384) and takes(64, 1.0, 385) and not takes(64, 1.0, 384)
    assert not takes(128, 1.0, 16384)
    assert takes(64, 0.01, 4096, Policy(ring_slabs=2)) and not takes(128, 1.0, 16384, Policy(ring_slabs=2))


def test_a_family_left_out_and_a_device_too_small():
    p, q, k = problem(128, dtype="float16")
    forward = plan.decide_forward(p, H100, Policy(families=("sm80", "scalar")), layouts(q, k)[0])
    assert forward.kernel.family == "sm80"
    assert next(c.reason for c in forward.choices if c.family == "sm90") == "left out by the policy"
    p, q, k = problem(256, dtype="float64")
    small = dataclasses.replace(A100, smem_per_block=48 * 1024)
    with pytest.raises(ValueError, match="no kernel serves it"):
        plan.decide_forward(p, small, Policy(), layouts(q, k)[0])


def test_the_policy_reads_the_environment_once_and_overrides_nest():
    env = {"CUPYFLASH_HOPPER_FORWARD": "0", "CUPYFLASH_HOPPER_TMA": "0", "CUPYFLASH_HOPPER_WS_BWD": "1",
           "CUPYFLASH_WS_DQ_RING_SLABS": "2"}
    policy = Policy.from_environment(env)
    assert (policy.hopper_forward, policy.hopper_backward, policy.tma, policy.ws_backward, policy.ring_slabs) == (
        False, True, False, True, 2)
    assert Policy.from_environment({}) == Policy() and hash(Policy.from_environment({})) == hash(Policy())
    before = current()
    with override(tma=False) as outer:
        assert current() is outer and not outer.tma
        with override(ws_forward=False):
            assert not current().tma and not current().ws_forward
        assert current() is outer
    assert current() is before


def test_float32_precision_is_set_for_the_process_or_a_block_and_checked():
    q = numpy.zeros((1, 300, 2, 40), numpy.float32)

    def forward_line():  # the forward's family and kernel
        text = str(cupyflash.explain(q, q, q, compute_capability=80))
        return text[text.index("forward:"):text.index("tile (")]

    assert cupyflash.get_float32_precision() == "highest" and forward_line().startswith("forward: scalar")
    with cupyflash.float32_precision("medium"):
        assert cupyflash.get_float32_precision() == "medium" and "Tf32<1>" in forward_line()
        with cupyflash.float32_precision("highest"):
            assert forward_line().startswith("forward: scalar")
            assert "float32 at precision 'highest' computes on CUDA cores" in str(
                cupyflash.explain(q, q, q, compute_capability=80))
        assert cupyflash.get_float32_precision() == "medium"
    assert cupyflash.get_float32_precision() == "highest"
    try:
        cupyflash.set_float32_precision("high")
        assert cupyflash.get_float32_precision() == "high" and "Tf32<3>" in forward_line()
        with cupyflash.float32_precision("highest"):  # a block keeps its own
            assert forward_line().startswith("forward: scalar")
    finally:
        cupyflash.set_float32_precision("highest")
    for bad in ("tf32", "HIGH", None, 3):
        with pytest.raises(ValueError, match="precision must be one of 'highest', 'high', 'medium'"):
            cupyflash.set_float32_precision(bad)
        with pytest.raises(ValueError, match="precision must be one of"):
            cupyflash.float32_precision(bad).__enter__()
    assert cupyflash.get_float32_precision() == "highest"
    assert Policy.from_environment({"CUPYFLASH_FLOAT32_PRECISION": "medium"}).float32_precision == "medium"
    with pytest.raises(ValueError, match="CUPYFLASH_FLOAT32_PRECISION must be one of"):
        Policy.from_environment({"CUPYFLASH_FLOAT32_PRECISION": "fast"})
    # 16-bit and float64 problems take the same kernels at every precision
    for dtype in ("bfloat16", "float64"):
        x = q.astype(numpy_dtype(dtype))
        with cupyflash.float32_precision("medium"):
            medium = str(cupyflash.explain(x, x, x, compute_capability=80))
        assert medium == str(cupyflash.explain(x, x, x, compute_capability=80))


def test_explain_reports_every_family():
    q = numpy.zeros((2, 1000, 4, 128), numpy_dtype("bfloat16"))
    text = str(cupyflash.explain(q, q, q, causal=True, compute_capability=90))
    assert "forward: sm90-tma" in text and "no causal or windowed build" in text
    assert "backward dK/dV: sm90-ws" in text and "backward dQ: float32 atomic adds" in text
    for family in catalog.FAMILIES:
        assert text.count(f"    {family} ") == 2
    x = q[..., :40].astype("float32")
    with cupyflash.float32_precision("high"):
        text = str(cupyflash.explain(x, x, x, deterministic=True, compute_capability=80))
    assert "forward: sm80" in text and "TcFwdTraits<cupyflash::Tf32<3>, 64" in text  # 3xTF32
    assert "take float16 or bfloat16, not float32" in text  # (the backward's families)
    assert "the deterministic kernel cupyflash::flash_bwd_dq_kernel" in text
    # float64: the FP64 tensor cores for the forward and dK/dV, float64 dQ adds (or the CUDA-core
    # deterministic kernel); above d64 on an A100's shared memory, the CUDA-core dK/dV kernel
    x = q[..., :40].astype("float64")
    text = str(cupyflash.explain(x, x, x, compute_capability=90))
    assert "forward: sm80" in text and "backward dK/dV: sm80" in text and "float64 atomic adds" in text
    text = str(cupyflash.explain(x, x, x, deterministic=True, compute_capability=90))
    assert "the deterministic kernel cupyflash::flash_bwd_dq_kernel<cupyflash::BwdDqTraits<double" in text
    x = q[..., :100].astype("float64")
    assert "backward dK/dV: scalar" in str(cupyflash.explain(x, x, x, compute_capability=80))
    with pytest.raises(TypeError, match="causal must be True or False"):
        cupyflash.explain(q, q, q, causal=1, compute_capability=90)


@pytest.mark.cpu_only
def test_explain_without_a_gpu_names_the_fallback():
    q = numpy.zeros((1, 8, 2, 16), numpy.float32)
    assert f"no GPU: {fallback.SUMMARY}" in str(cupyflash.explain(q, q, q))


def test_decode_splits_fill_the_gpu_by_the_critical_path():
    assert choose_splits(132 * 4, 100, 132) == 1  # the blocks fill the GPU already
    assert choose_splits(8, 4, 132) == 1  # too few key tiles to split
    assert choose_splits(0, 4096, 132) == 1  # an empty batch, or no heads
    splits = choose_splits(8, 128, 132)  # one sequence, 8 K/V heads, 8192 keys of 64
    assert 1 < splits <= 128 // 4 and 8 * splits <= 4 * 132
    assert choose_splits(8, 128, 132, Policy(decode_full_wave=0.01)) == 1


def test_explain_knows_each_architectures_shared_memory():
    """compute_capability takes the architectures' own limits (a T4 has 64 KB a block, an A40 99 KB,
    an A100 163 KB) and refuses one it does not know, naming the argument."""
    assert described(75).smem_per_block == 64 * 1024 and described(86).smem_per_block == 99 * 1024
    assert described(80).smem_per_block == 163 * 1024 and described(90).sm_count == 132
    q = numpy.zeros((1, 64, 2, 128), numpy.float32)
    with pytest.raises(ValueError, match="compute_capability must be one of 70, 72, 75, 80"):
        cupyflash.explain(q, q, q, compute_capability=0)


def test_bfloat16_before_sm_80_is_refused_before_any_launch():
    p, q, k = problem(128, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"bfloat16's conversions need sm_80 or newer; the device is sm_75"):
        plan.decide_forward(p, described(75), Policy(), layouts(q, k)[0])
    p, q, k = problem(32, dtype="float16")
    assert plan.decide_forward(p, described(75), Policy(), layouts(q, k)[0]).kernel.family == "scalar"


def test_float32_head_dim_256_needs_an_a100s_shared_memory():
    p, q, k = problem(256, dtype="float32")
    for small in (75, 86):  # 64 KB and 99 KB a block
        with pytest.raises(ValueError, match="shared memory a block, the device has .*smaller head_dim"):
            plan.decide_forward(p, described(small), Policy(), layouts(q, k)[0])
    assert plan.decide_forward(p, described(80), Policy(), layouts(q, k)[0]).kernel.family == "scalar"
