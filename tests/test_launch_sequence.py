"""What the backward's plan (dispatch/plan.py's plan_backward) queues, on any machine: the host side of the backward (kernel choice, the
dQ ring or workspace, the warp-specialised kernel's arguments, what a graph capture keeps) run
against a stand-in Hopper device whose launches and allocations are recorded, not run. The GPU
tests run the same paths for real; these catch wiring mistakes in CI, where no GPU reaches the
launches (one such, a kernel launched with another build's arguments, failed 236 GPU tests)."""

import contextlib
import math
import types

import numpy
import pytest

from cupyflash import BlockMask, validation
from cupyflash.api import common
from cupyflash.catalog.tensor_cores import TcBwdDkdvKernel, TcBwdDqKernel
from cupyflash.dispatch import plan
from cupyflash.dispatch.policy import Policy
from cupyflash.runtime import device as devices
from cupyflash.runtime import tma, workspace
from cupyflash.validation import BFLOAT16

# The stand-in device replaces CuPy's allocators and streams: on an install without the CUDA extra
# there is no CuPy to stand in for.
pytest.importorskip("cupy", reason="CuPy is not installed (the CUDA extra)")


class StandIn:
    """A CuPy array's face, as plan_backward reads it: shape, strides, dtype, an address of its
    own, device 0."""

    _next_address = 1 << 40

    def __init__(self, shape, dtype):
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.dtype = numpy.dtype(dtype)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        strides, step = [], self.dtype.itemsize
        for n in reversed(self.shape):
            strides.insert(0, step)
            step *= n
        self.strides = tuple(strides)
        self.data = types.SimpleNamespace(ptr=StandIn._next_address)
        StandIn._next_address += -(-max(self.nbytes, 1) // 512) * 512
        self.device = types.SimpleNamespace(id=0)


@pytest.fixture
def device(monkeypatch):
    """A stand-in sm_90 device with 132 SMs and an H100's shared memory: `launches` records
    (kernel, grid, extra arguments, params) per launch, `zeroed` the buffers cupy.zeros made,
    `copied` (host array, its stand-in) what cupy.asarray copied, and `capturing` says whether the
    current stream is being captured."""
    import cupy

    state = types.SimpleNamespace(launches=[], zeroed=[], copied=[], capturing=False)

    def asarray(x):
        state.copied.append((numpy.asarray(x), StandIn(numpy.shape(x), numpy.asarray(x).dtype)))
        return state.copied[-1][1]

    def zeros(shape, dtype=float):
        state.zeroed.append(StandIn(shape, dtype))
        return state.zeroed[-1]

    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=float, order="C": StandIn(shape, dtype))
    monkeypatch.setattr(cupy, "zeros", zeros)
    monkeypatch.setattr(cupy, "asarray", asarray)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device_id: contextlib.nullcontext())
    stream = types.SimpleNamespace(ptr=7, is_capturing=lambda: state.capturing)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: stream)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(devices, "info", lambda device_id: devices.described(90))
    monkeypatch.setattr(tma, "bwd_tensor_maps", lambda *args, **kwargs: numpy.ones(3 * tma.TENSOR_MAP_BYTES, numpy.uint8))
    monkeypatch.setattr(tma, "kv_tensor_maps", lambda *args, **kwargs: numpy.ones(2 * tma.TENSOR_MAP_BYTES, numpy.uint8))
    monkeypatch.setattr(BlockMask, "device_arrays", lambda self, device_id: tuple(
        StandIn(x.shape, x.dtype) for x in (self.kv_count, self.kv_index, self.q_count, self.q_index, self.key_order)))
    monkeypatch.setattr(workspace, "ZEROED", {})
    monkeypatch.setattr(workspace, "CAPTURED", [])
    return state


def backward(state, rng, head_dim, density=None, seqlen=4096, deterministic=False, heads=2, mask=None, dropout=None):
    """Plans one bfloat16 backward (batch 1, `heads` heads) with a random block mask of `density`
    (None: unmasked), or with `mask`, and dropout's (p, seed, offset) if given, under the default
    policy; its launches go to state.launches as (kernel, grid, further arguments, params)."""
    shape = (1, seqlen, heads, head_dim)
    q, k, v, out, dout = (numpy.empty(shape, BFLOAT16) for _ in range(5))
    lse = numpy.empty((1, heads, seqlen), numpy.float32)
    p = validation.check_backward_args(dout, q, k, v, out, lse, causal=False, scale=None, deterministic=deterministic)
    if density is not None:
        n = -(-seqlen // 128)
        mask = BlockMask(rng.random((heads, n, n)) < density)
    if mask is not None:
        p = common.check_block_mask(mask, p)
    if dropout is not None:
        p = validation.check_dropout(*dropout, p)
    arrays = [StandIn(x.shape, x.dtype) for x in (dout, q, k, v, out, lse, q, k, v)]
    made = plan.plan_backward(p, *arrays, policy=Policy())
    state.launches += [(x.kernel, x.grid, x.args[1:], x.args[0]) for x in made.launches]
    return p


def steps(state):
    names = {TcBwdDkdvKernel: "dK/dV", TcBwdDqKernel: "dQ"}
    return [getattr(kernel, "step", None) or next(name for kind, name in names.items() if isinstance(kernel, kind))
            for kernel, *_ in state.launches]


def field(params, name: str) -> int:
    return int(params[name][0])


def dkdv_launch(state):
    (launch,) = [x for x in state.launches if isinstance(x[0], TcBwdDkdvKernel)]
    return launch


@pytest.mark.parametrize("density,ring", [(0.25, True), (0.05, False)])
def test_warp_specialised_launch_takes_its_arguments(rng, device, density, ring):
    """A d64 block-sparse backward: preprocess, then the warp-specialised dK/dV kernel with its
    seven further arguments (Q/dO/dQ maps, K/V maps, positions, items, counters, ring slots, item
    order: none with the ring, the mask's otherwise, none unless a column is 6x the median or
    more); with the ring (8 query blocks a key block) no conversion follows and the preprocess
    clears nothing, without it (1.6) the conversion rounds the whole workspace."""
    p = backward(device, rng, 64, density)
    kernel, grid, more, params = dkdv_launch(device)
    assert kernel.ws and len(more) == 7
    positions, items, counters, slots, order = (int(x) for x in more[2:])
    expected = None if ring else p.block_mask.dkdv_item_order(1, 2, 1, 1, 1, 0)
    assert order == (0 if expected is None else expected.data.ptr)
    assert (positions, items, grid) == (32, 64, (64, 1, 1))
    assert counters == workspace.ZEROED[("counters", 0, 7)].ptr
    preprocess = device.launches[0][3]
    if ring:
        assert steps(device) == ["preprocess", "dK/dV"] and slots == 2  # every slab its own slot
        assert field(preprocess, "dq_accum") == 0
        assert field(params, "dq_accum") == workspace.ZEROED[("dq ring", 0, 7)].ptr
    else:
        assert steps(device) == ["preprocess", "dK/dV", "convert_dq"] and slots == 0
        assert field(preprocess, "dq_accum") == field(params, "dq_accum") != 0
        assert ("dq ring", 0, 7) not in workspace.ZEROED


@pytest.mark.parametrize("head_dim,density", [(64, None), (128, 0.25)])
def test_the_row_statistics_and_dq_share_one_allocation(rng, device, head_dim, density):
    """A backward whose dK/dV kernel takes an unset dQ accumulator (the one-block TMA build, the
    warp-specialised one without a ring) gets it in the row statistics' allocation: lse_log2, D
    and dQ each at a 256-byte boundary, none overlapping."""
    backward(device, rng, head_dim, density, seqlen=1000)
    params = dkdv_launch(device)[3]
    lse_log2, d, dq = (field(params, name) for name in ("lse_log2", "d", "dq_accum"))
    assert d - lse_log2 == dq - d == 8192  # 2 heads x 1000 float32 rows: 8000 bytes, to 256
    assert lse_log2 % 256 == 0


def test_the_kept_ring_is_not_cleared_again(rng, device):
    """The stream's ring is made (zeroed) once; later calls of the same or a smaller size reuse it."""
    backward(device, rng, 64, 0.25)
    made = len(device.zeroed)
    first = field(dkdv_launch(device)[3], "dq_accum")
    device.launches.clear()
    backward(device, rng, 64, 0.25, heads=1)
    assert len(device.zeroed) == made and field(dkdv_launch(device)[3], "dq_accum") == first


@pytest.mark.parametrize("head_dim,density,deterministic", [(128, 0.25, False), (64, None, False), (64, 0.25, True)])
def test_other_builds_take_the_workspace(rng, device, head_dim, density, deterministic):
    """d128 (warp-specialised, no ring), unmasked d64 (the one-block TMA build) and deterministic
    mode (the one-block build without TMA and the dQ kernel): each dK/dV launch with the arguments
    of its own build (the one-block builds: one map set), and dQ from the workspace or the dQ kernel."""
    backward(device, rng, head_dim, density, deterministic=deterministic)
    kernel, _, more, _ = dkdv_launch(device)
    assert len(more) == (7 if kernel.ws else 1)
    assert kernel.ws == (head_dim == 128) and kernel.tma == (not deterministic)
    assert steps(device) == ["preprocess", "dK/dV", "dQ" if deterministic else "convert_dq"]
    if kernel.ws:
        assert int(more[-2]) == int(more[-1]) == 0  # no ring, no item order


@pytest.mark.parametrize("head_dim", [128, 64])
def test_a_column_far_longer_than_the_rest_is_claimed_first(rng, device, head_dim):
    """A BigBird mask at 16384 tokens: each head's global column sees all 128 query blocks, the
    median one 10, so the d128 dK/dV kernel (no dQ ring) takes the mask's item order, which
    starts with the global columns' key tiles; d64 takes the ring there (10.7 query blocks a key
    block on average) and no order, since its slabs must complete in turn."""
    mask = BlockMask.bigbird(16384, 16384, window=3, n_global=1, n_random=2, seed=0)
    backward(device, rng, head_dim, seqlen=16384, mask=mask)
    kernel, grid, more, params = dkdv_launch(device)
    slots, order = int(more[-2]), int(more[-1])
    if head_dim == 64:
        assert slots > 0 and order == 0 and not device.copied
        return
    assert slots == 0 and field(params, "dq_accum") != 0
    ((host, copy),) = device.copied  # made once and kept on the mask
    assert order == copy.data.ptr == mask.dkdv_item_order(1, 2, 1, 1, 2, 0).data.ptr
    positions = int(more[2])
    global_columns = [h * positions + list(mask.key_order[0, 0]).index(0) for h in range(2)]
    numpy.testing.assert_array_equal(host[:2], global_columns)
    numpy.testing.assert_array_equal(numpy.sort(host), numpy.arange(2 * positions))


def test_a_captured_backward_keeps_its_buffers(rng, device):
    """Under graph capture the row statistics (lse_log2 and D, one allocation), the ring and the
    counters are the call's own, kept for the process's life, and the stream's kept buffers are
    not touched."""
    device.capturing = True
    backward(device, rng, 64, 0.25)
    _, _, more, params = dkdv_launch(device)
    kept = {x.data.ptr for x in workspace.CAPTURED}
    assert not workspace.ZEROED
    assert {field(params, "dq_accum"), field(params, "lse_log2"), int(more[4])} <= kept
    (stats,) = [x for x in workspace.CAPTURED if x.data.ptr == field(params, "lse_log2")]  # D shares its allocation
    assert field(params, "lse_log2") < field(params, "d") < field(params, "lse_log2") + stats.nbytes


def test_every_launch_takes_the_calls_dropout_seed_and_offset(rng, device):
    """A backward with dropout: each launch's struct holds the call's seed and offset, written per
    call by the prepared bind (dispatch/plan.dropout_values), beside the probability's threshold."""
    from cupyflash.cpu import philox

    for seed, offset in ((1234, 56), (2**64 - 1, 2**32 - 1)):
        device.launches.clear()
        backward(device, rng, 64, dropout=(0.1, seed, offset))
        assert device.launches
        for *_, params in device.launches:
            assert (field(params, "dropout_seed"), field(params, "dropout_offset")) == (seed, offset)
            assert field(params, "dropout_threshold") == philox.threshold(0.1)
            assert field(params, "dropout_state") == 0  # (by value: no device seed and offset)


def test_key_padding_is_each_calls_own_pointer(rng, device):
    """A padded batch's key lengths (seqused_k) are a per-call pointer of the prepared bind, as a
    prepared torch call writes them: every launch of the forward and the backward reads the
    call's own; a bind given none reads the problem's lengths, copied to the device."""
    shape = (2, 300, 2, 64)
    q, k, v, out, dout = (numpy.empty(shape, BFLOAT16) for _ in range(5))
    lse = numpy.empty((2, 2, 300), numpy.float32)
    lengths = numpy.array([300, 17], numpy.int32)
    forward = validation.check_seqlens_k(lengths, validation.check_attention_args(
        q, k, v, causal=False, scale=None, return_lse=True, window=None, softcap=None))
    backward = validation.check_seqlens_k(lengths, validation.check_backward_args(
        dout, q, k, v, out, lse, causal=False, scale=None, deterministic=False))
    fwd_arrays = [StandIn(x.shape, x.dtype) for x in (q, k, v, out, lse)]
    bwd_arrays = [StandIn(x.shape, x.dtype) for x in (dout, q, k, v, out, lse, q, k, v)]
    binds = (plan.prepare_forward(forward, *fwd_arrays, Policy()),
             plan.prepare_backward(backward, *bwd_arrays, Policy()))
    copies = [stand_in for host, stand_in in device.copied if numpy.array_equal(host, lengths)]
    assert len(copies) == 2  # (the problems' own, one each)
    fwd_pointers = dict(zip(("q", "k", "v", "o", "lse"), (x.data.ptr for x in fwd_arrays)))
    bwd_pointers = dict(zip(plan.BACKWARD_POINTERS, (x.data.ptr for x in (bwd_arrays[1:5] + bwd_arrays[:1]
                                                                           + bwd_arrays[6:] + bwd_arrays[5:6]))))
    for own in (1 << 50, (1 << 50) + 512, None):
        for bind, pointers, default in zip(binds, (fwd_pointers, bwd_pointers), copies):
            given = dict(pointers) if own is None else {**pointers, "seqused_k": own}
            made = bind(given, workspace.cupy_stream())
            assert made.launches
            for launch in made.launches:
                assert field(launch.args[0], "seqused_k") == (default.data.ptr if own is None else own)
