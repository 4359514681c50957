"""The Hopper kernels (wgmma, sm_90a): the forward (kernels/sm90/fwd.cu, fwd_ws.cu) and the dK/dV
kernel (kernels/sm90/bwd_dkdv.cu, bwd_dkdv_ws.cu) on an sm_90 GPU: that the
problems they serve take them once they are switched on, and every variant they have (dense, causal,
windows, GQA, block-sparse, softcap/ALiBi, dropout, variable-length) against the float64 reference
under the tolerance rule, on awkward shapes, strided and misaligned inputs. Each test runs twice:
with the Hopper forward and the mma.sync backward (fed the Hopper forward's out and lse), and with
both on Hopper (the deterministic dQ kernel stays mma.sync). Marker `gpu`; skipped on other GPUs.

attention() and attention_backward() take the Hopper kernels by default on sm_90, so the whole GPU
suite runs through them there (CUPYFLASH_HOPPER_FORWARD=0 / CUPYFLASH_HOPPER_BACKWARD=0 switch them
off). The fixture sets both switches itself."""

import dataclasses

import numpy
import pytest

import cupyflash
from cupyflash import BlockMask
from cupyflash.api import common
from cupyflash.catalog import tiles
from cupyflash.catalog.tensor_cores import (
    TcBwdDkdvKernel, TcFwdKernel, WgmmaBwdDkdvKernel, WgmmaFwdKernel, WgmmaFwdWsKernel,
)
from cupyflash.dispatch.policy import current
from cupyflash.runtime import device as devices
from cupyflash.runtime import workspace
from families import TENSOR_CORES
from families import forward as run_forward
from shapes import numpy_dtype, random_qkv
from test_attention_gpu import assert_matches_reference
from test_backward_gpu import assert_gradients_match_reference
from test_tensor_cores_gpu import _forward_backward, check_forward_backward

pytestmark = pytest.mark.gpu

TC_DTYPES = list(tiles.TENSOR_CORE_DTYPES)


class Launched(list):
    """The forward and dK/dV kernels launched, in order; backward: whether the Hopper dK/dV kernel is on."""

    def __init__(self, backward: bool):
        super().__init__()
        self.backward = backward


@pytest.fixture(params=["forward", "forward+backward"])
def hopper(request, monkeypatch, policy, launches):
    """The Hopper forward switched on, and the Hopper dK/dV kernel with it in the second run;
    `hopper.policy` changes the policy further."""
    import cupy

    if cupy.cuda.Device().compute_capability != str(tiles.WGMMA_COMPUTE_CAPABILITY):
        pytest.skip("the Hopper kernels run on sm_90 devices only")
    launched = Launched(backward=request.param == "forward+backward")
    launched.policy = policy
    policy(hopper_forward=True, hopper_backward=launched.backward)
    launches(lambda kernel, arguments: launched.append(kernel) if (
        "Fwd" in type(kernel).__name__ or isinstance(kernel, TcBwdDkdvKernel)) else None)
    return launched


def set_sm_count(monkeypatch, sm_count: int) -> None:
    """The planner sees a device of `sm_count` SMs (the persistent kernels' grids shrink to it)."""
    import cupy

    info = dataclasses.replace(devices.info(cupy.cuda.Device().id), sm_count=sm_count)
    monkeypatch.setattr(devices, "info", lambda device_id: info)


def took_hopper(launched: Launched) -> bool:
    """Every forward was the Hopper one, and with the backward switched on every dK/dV kernel too
    (tests that run no backward launch none)."""
    forwards = [k for k in launched if "Fwd" in type(k).__name__]
    dkdv = [k for k in launched if isinstance(k, TcBwdDkdvKernel)]
    hopper_dkdv = all(isinstance(k, WgmmaBwdDkdvKernel) == launched.backward for k in dkdv)
    hopper_forwards = all(isinstance(k, (WgmmaFwdKernel, WgmmaFwdWsKernel)) for k in forwards)
    return bool(forwards) and hopper_forwards and hopper_dkdv


@pytest.mark.parametrize("head_dim,hopper_kernel", [(40, True), (64, True), (100, True), (128, True), (160, False)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_16_bit_head_dims_up_to_128_take_it(rng, hopper, dtype, head_dim, hopper_kernel):
    check_forward_backward(rng, dtype, (1, 70, 90, 2, head_dim), False, False, None)
    assert took_hopper(hopper) == (hopper_kernel and dtype != "float32")


# Seqlens inside tiles and across several, seqlen_q != seqlen_k both ways, one-row and one-key
# problems, head dims that are not panel multiples (zero columns inside the last panel).
SHAPES = [(2, 1, 17, 3, 40), (2, 17, 1, 3, 59), (2, 113, 203, 3, 111), (1, 203, 113, 2, 128),
          (1, 1023, 1024, 2, 64), (1, 1024, 1023, 2, 100), (2, 128, 256, 2, 128)]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_awkward_shapes(rng, hopper, dtype, shape, causal, deterministic):
    check_forward_backward(rng, dtype, shape, causal, deterministic, None)
    assert took_hopper(hopper)


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_long_sequence(rng, hopper, dtype):
    check_forward_backward(rng, dtype, (1, 2049, 2049, 1, 128), True, False, None)
    assert took_hopper(hopper)


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_strided_and_misaligned_inputs(rng, hopper, dtype):
    import cupy

    dt = numpy_dtype(dtype)
    # Strided views (heads interleaved with a spare one), and every row 2 bytes off 16-byte
    # alignment (the element-wise tile loader).
    wide = cupy.asarray(rng.standard_normal((3, 2, 150, 4, 64)).astype(dt))
    q, k, v = (wide[i, :, :, ::2, :] for i in range(3))
    buf = cupy.asarray(rng.standard_normal((3, 1, 300 * 2 * 64 + 1)).astype(dt))
    qm, km, vm = (buf[i, 0, 1:].reshape(1, 300, 2, 64) for i in range(3))
    assert not q.flags.c_contiguous and qm.data.ptr % 16 != 0
    for args in ((q, k, v), (qm, km, vm)):
        dout = cupy.asarray(rng.standard_normal(args[0].shape).astype(dt))
        out, lse, grads = _forward_backward(*args, dout, True, False, TENSOR_CORES)
        assert_matches_reference(*args, out, lse, dtype, True)
        assert_gradients_match_reference(dout, *args, grads, dtype, True)
    assert took_hopper(hopper)


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_agrees_with_the_mma_sync_kernel(rng, policy, hopper, dtype):
    """Same inputs through both tensor-core forwards: they differ only by float32 summation order
    and where P_ij was rounded to 16 bits (their running maxima differ with their key tiles)."""
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 2, 515, 700, 2, 128))
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    assert took_hopper(hopper)
    hopper.policy(hopper_forward=False)
    out_mma, lse_mma = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(hopper[-1], TcFwdKernel) and len(hopper) == 2
    unit = 2.0**-11 if dtype == "float16" else 2.0**-8  # the 16-bit type's half ulp at 1
    out, out_mma = out.astype(cupy.float32), out_mma.astype(cupy.float32)
    assert float(cupy.abs(out - out_mma).max()) <= 8 * unit * max(1.0, float(cupy.abs(out_mma).max()))
    assert float(cupy.abs(lse - lse_mma).max()) <= 1e-5 * max(1.0, float(cupy.abs(lse_mma).max()))


@pytest.mark.parametrize("head_dim", [40, 64])
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_maxima_that_rise_drift_and_fall(rng, nan_outputs, hopper, dtype, head_dim):
    """The d64 forward rescales O_i, l_i lazily (online_softmax_tc's kLazy): only when a row's
    maximum rises more than 8 (log2 units) above the one it uses. Scores here carry a ramp along
    the keys, per head: rising 20 per 128 keys (a rescale every step), rising 6 (the old maximum
    kept over steps, P_ij up to 2^8), falling 20, and none; dense and block-sparse."""
    import cupy

    batch, seqlen_q, seqlen_k, heads = 1, 300, 1000, 4
    dt = numpy_dtype(dtype)
    scale = head_dim**-0.5
    q, k, v = (rng.standard_normal((batch, n, heads, head_dim)) for n in (seqlen_q, seqlen_k, seqlen_k))
    slopes = numpy.array([20.0, 6.0, -20.0, 0.0]) / numpy.log2(numpy.e)  # natural units per 128 keys
    q[..., 0] = 1.0
    k[..., 0] = numpy.arange(seqlen_k)[:, None] / 128 * slopes / scale
    q, k, v = (cupy.asarray(x.astype(dt)) for x in (q, k, v))
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, dtype, False)
    mask = BlockMask(rng.random((heads, 3, 8)) < 0.6)
    out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, dtype, False, block_mask=mask)
    assert took_hopper(hopper)


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_windows_and_gqa(rng, nan_outputs, hopper, dtype):
    from test_variants_gpu import run

    run(rng, dtype, (2, 203, 331, 4, 59), 2, causal=True, window=(64, 33))
    run(rng, dtype, (1, 331, 113, 6, 128), 1, window=(17, 0), deterministic=True)
    run(rng, dtype, (1, 700, 700, 2, 64), 2, causal=True, window=(150, None))
    assert took_hopper(hopper)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_block_sparse(rng, nan_outputs, hopper, dtype, density, causal):
    from test_block_sparse_gpu import run_block_sparse

    for shape in ((2, 300, 500, 2, 64), (1, 515, 260, 2, 128)):
        blocks = (2, -(-shape[1] // 128), -(-shape[2] // 128))
        mask = BlockMask(rng.random(blocks) < density)
        run_block_sparse(rng, dtype, shape, mask, causal)
    # Block sizes that are multiples of the tile: 256 x 128 and 128 x 256.
    for size in ((256, 128), (128, 256)):
        shape = (1, 600, 700, 2, 128)
        blocks = (1, -(-600 // size[0]), -(-700 // size[1]))
        run_block_sparse(rng, dtype, shape, BlockMask(rng.random(blocks) < 0.6, size), causal)
    assert took_hopper(hopper)


@pytest.mark.parametrize("softcap,alibi", [(2.0, None), (None, "heads"), (5.0, "batch")])
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_softcap_and_alibi(rng, nan_outputs, hopper, dtype, softcap, alibi):
    from test_score_mods_gpu import run

    run(rng, dtype, (2, 113, 203, 4, 111), 2, softcap, alibi, causal=True)
    run(rng, dtype, (1, 203, 300, 2, 64), 2, softcap, alibi, window=(40, 20),
        block_mask=BlockMask(numpy.array([[[True, False, True], [True, True, False]]])))
    assert took_hopper(hopper)


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_dropout(rng, nan_outputs, hopper, dtype):
    from test_dropout_gpu import run

    run(rng, dtype, (2, 113, 203, 2, 100), 2, 0.3, causal=True)
    run(rng, dtype, (1, 300, 300, 4, 128), 2, 0.1, softcap=3.0, alibi=True, strided=True)
    assert took_hopper(hopper)


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_varlen(rng, nan_outputs, hopper, dtype):
    from test_varlen_gpu import run_varlen

    run_varlen(rng, dtype, ([1, 300, 0, 700], [17, 129, 5, 700]), 4, 2, 128, causal=True)
    run_varlen(rng, dtype, ([129, 64, 5], [300, 64, 0]), 2, 2, 40, window=(33, 10), softcap=4.0, strided=True)
    assert took_hopper(hopper)


# The TMA builds (kTma: K_j, V_j copied by the tensor memory accelerator; dense, block-sparse and
# local, without score modifiers or packed sequences). Seqlen_k ending inside a key block and one
# key (rows past the keys zero-filled by the copy engine), head dims 40 and 112 (columns past the
# head dim likewise), GQA, batch > 1 with heads interleaved in a wider array (strides that are not
# the contiguous ones).
TMA_SHAPES = [(2, 70, 1, 4, 2, 64), (2, 203, 331, 4, 2, 40), (1, 300, 1029, 2, 1, 64), (3, 129, 257, 2, 2, 112),
              (1, 515, 700, 4, 4, 128)]


def _tma_inputs(rng, dtype, shape):
    import cupy

    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = shape
    dt = numpy_dtype(dtype)
    q = cupy.asarray(rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(dt))
    wide = cupy.asarray(rng.standard_normal((2, batch, seqlen_k, 2 * heads_kv, head_dim)).astype(dt))
    k, v = wide[0, :, :, 1::2], wide[1, :, :, ::2]
    return q, k, v


# (causal, window, block-sparse, score modifiers): dense; block-sparse; causal (local); a window,
# with a block mask; causal with a softcap (the score-modifier build).
TMA_VARIANTS = {"dense": (False, None, False, {}), "block-sparse": (False, None, True, {}),
                "causal": (True, None, False, {}), "window-block-sparse": (False, (90, 17), True, {}),
                "causal-softcap": (True, None, False, {"softcap": 5.0})}
# The warp-specialised dK/dV kernel has no score-modifier build (kernels/sm90/bwd_ws.cu).
DKDV_VARIANTS = [name for name, (*_, mods) in TMA_VARIANTS.items() if not mods]


@pytest.mark.parametrize("variant", list(TMA_VARIANTS))
@pytest.mark.parametrize("shape", TMA_SHAPES)
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_tma_build_equals_the_cp_async_build(rng, policy, monkeypatch, nan_outputs, hopper, dtype, shape, variant):
    """Both builds bring the same tiles to shared memory (zeros past the keys and the head dim) and
    compute the same arithmetic on them: at the same tile, outputs equal bit for bit. The cp.async
    build the API takes with the TMA off (at d128 unmasked another tile than the TMA build's,
    tiles.WGMMA_FWD_UNMASKED_TMA_TILES) is within the reference's tolerance."""
    causal, window, block_sparse, mods = TMA_VARIANTS[variant]
    if mods and tiles.padded_head_dim(shape[5]) not in tiles.TMA_SCORE_MOD_HEAD_DIMS:
        pytest.skip("no TMA build with score modifiers at this head dim")
    policy(ws_forward=False)  # (test_warp_specialised_forward)
    q, k, v = _tma_inputs(rng, dtype, shape)
    assert not k.flags.c_contiguous
    mask = None
    if block_sparse:
        mask = BlockMask(rng.random((shape[3], -(-shape[1] // 128), -(-shape[2] // 128))) < 0.6)

    def forward():
        if mask is None:
            return cupyflash.attention(q, k, v, causal=causal, window=window, return_lse=True, **mods)
        return cupyflash.block_sparse_attention(q, k, v, mask, causal=causal, window=window, return_lse=True)

    out, lse = forward()
    tma = hopper[-1]
    assert tma.tma and tma.block_sparse == block_sparse and tma.score_mod == bool(mods)
    assert tma.local == (causal or window is not None or bool(mods))
    assert_matches_reference(q, k, v, out, lse, dtype, causal, block_mask=mask, window=window, **mods)
    policy(tma=False)
    out_cp, lse_cp = forward()
    assert not hopper[-1].tma and dataclasses.replace(tma, tma=False) == hopper[-1]
    assert_matches_reference(q, k, v, out_cp, lse_cp, dtype, causal, block_mask=mask, window=window, **mods)

    twin = dataclasses.replace(tma, tma=False, tile_override=tma.tile)
    assert_build_gives_the_same_bits(twin, q, k, v, out, lse, mask, causal=causal, window=window, **mods)


@pytest.mark.parametrize("mods", [{"alibi_slopes": "slopes"}, {"dropout_p": 0.2, "seed": 11, "offset": 3},
                                  {"softcap": 8.0, "alibi_slopes": "slopes", "dropout_p": 0.1, "seed": 5}],
                         ids=["alibi", "dropout", "all three"])
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_tma_forward_with_score_modifiers(rng, policy, nan_outputs, hopper, dtype, mods):
    """ALiBi, dropout (its keep mask as the reference draws it) and all three with a softcap, on the
    TMA forward's score-modifier build, within the tolerance rule at an awkward shape (d112)."""
    policy(ws_forward=False)
    q, k, v = _tma_inputs(rng, dtype, TMA_SHAPES[3])
    if "alibi_slopes" in mods:
        mods = {**mods, "alibi_slopes": rng.uniform(0.01, 0.5, q.shape[2]).astype(numpy.float32)}
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True, **mods)
    assert hopper[-1].tma and hopper[-1].score_mod
    assert_matches_reference(q, k, v, out, lse, dtype, True, **mods)


def assert_build_gives_the_same_bits(kernel, q, k, v, out, lse, mask, **options):
    """`kernel` launched on the same problem writes out's and lse's bits exactly."""
    import cupy

    from cupyflash import validation
    from shapes import bits

    p = validation.check_attention_args(q, k, v, scale=None, return_lse=True, **{"causal": False, **options})
    if mask is not None:
        p = common.check_block_mask(mask, p)
    out_twin, lse_twin = cupy.full_like(out, numpy.nan), cupy.full_like(lse, numpy.nan)
    run_forward(p, q, k, v, out_twin, lse_twin, kernel=kernel)
    assert (bits(out.get()) == bits(out_twin.get())).all()
    assert (bits(lse.get()) == bits(lse_twin.get())).all()


# (batch, seqlen_q, seqlen_k, heads, K/V heads, head dim padded to 128 or 64, rows of whole 16
# bytes so that the strided K and V of _tma_inputs take tensor maps): one-row and one-key problems,
# tiles cut by both sequence ends, GQA, head dims inside the last panel, seqlen_q a tile multiple
# and not.
WS_SHAPES = [(2, 70, 1, 4, 2, 128), (2, 1, 17, 3, 3, 104), (2, 203, 331, 4, 2, 120), (3, 129, 257, 2, 2, 112),
             (1, 515, 700, 4, 4, 128), (1, 1023, 1024, 2, 1, 128), (1, 1024, 1023, 2, 2, 120),
             (2, 1, 17, 3, 3, 40), (2, 203, 331, 4, 2, 64), (1, 515, 700, 4, 4, 56), (1, 1023, 1024, 2, 1, 64)]


@pytest.mark.parametrize("sm_count", [None, 1, 3])
@pytest.mark.parametrize("block_sparse", [False, True], ids=["dense", "block-sparse"])
@pytest.mark.parametrize("shape", WS_SHAPES)
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_warp_specialised_forward(rng, policy, monkeypatch, nan_outputs, hopper, dtype, shape, block_sparse, sm_count):
    """The warp-specialised kernel (WgmmaFwdWsKernel) against the reference, and bit for bit against
    the TMA build at its tile (128 x 128, two warpgroups, no lazy rescale: the same arithmetic on
    the same tiles). sm_count forces the persistent grid down to 1 or 3 blocks, so that each claims
    many tiles and walks them through both Q_i buffers and round the K_j, V_j ring; the launch
    leaves its claim counter zeroed. Block-sparse masks leave a mask row empty (output 0, lse -inf)
    where there are two. Q, K and V are strided views. d64 takes it here for every problem, not
    only for masks as sparse as the policy's ws_forward_max_steps asks."""
    policy(ws_forward=True)
    policy(ws_forward_max_steps=())
    if sm_count is not None:
        set_sm_count(monkeypatch, sm_count)
    q, k, v = _tma_inputs(rng, dtype, shape)
    q = _strided_like(rng, q)
    assert not q.flags.c_contiguous
    mask = None
    if block_sparse:
        dense = rng.random((shape[3], -(-shape[1] // 128), -(-shape[2] // 128))) < 0.6
        if dense.shape[1] > 1:
            dense[0, 1] = False
        mask = BlockMask(dense)
        out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
    else:
        out, lse = cupyflash.attention(q, k, v, return_lse=True)
    ws = hopper[-1]
    assert isinstance(ws, WgmmaFwdWsKernel) and ws.block_sparse == block_sparse
    assert_matches_reference(q, k, v, out, lse, dtype, False, block_mask=mask)
    assert workspace.ZEROED and not any(c.owner.any() for c in workspace.ZEROED.values())

    twin = WgmmaFwdKernel(dtype, ws.head_dim, False, block_sparse=block_sparse, tma=True,
                               tile_override=tiles.TcTileShape(128, 128, num_warps=8, min_blocks_per_sm=1))
    assert_build_gives_the_same_bits(twin, q, k, v, out, lse, mask)


@pytest.mark.parametrize("sm_count", [None, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_warp_specialised_forward_claims_the_longest_rows_first(rng, monkeypatch, hopper, dtype, head_dim, sm_count):
    """On a mask whose rows differ in length (a global row that sees every key block, a row with
    none, random rows per head), the block-sparse warp-specialised forward claims its query tiles
    in the mask's query_tile_order, not in index order; each tile's result must land where it
    belongs (outputs NaN before). sm_count 3: three blocks claim the reordered tiles in turn.
    Batch 2, seqlen_q 1000 (the last tile cut short); the launch leaves its claim counter zeroed."""
    import cupy

    from cupyflash import validation

    set_sm_count(monkeypatch, sm_count or 132)
    q, k, v = _tma_inputs(rng, dtype, (2, 1000, 900, 3, 3, head_dim))
    dense = rng.random((3, 8, 8)) < 0.3
    dense[:, 3] = True  # a global row in every head
    dense[1, 5] = False  # a row with no key block
    mask = BlockMask(dense)
    p = common.check_block_mask(mask, validation.check_attention_args(q, k, v, causal=False, scale=None,
                                                                            return_lse=True))
    kernel = WgmmaFwdWsKernel(dtype, head_dim, False, block_sparse=True)
    assert mask.query_tile_order(2, 3, 1000, kernel.tile.block_m, q.device.id) is not None
    out, lse = cupy.full(q.shape, numpy.nan, q.dtype), cupy.full((2, 3, 1000), numpy.nan, numpy.float32)
    run_forward(p, q, k, v, out, lse, kernel=kernel)
    assert_matches_reference(q, k, v, out, lse, dtype, False, block_mask=mask)
    assert not any(c.owner.any() for c in workspace.ZEROED.values())


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_warp_specialised_forward_captured_in_a_graph(rng, policy, monkeypatch, hopper, dtype):
    """A captured call keeps a claim counter of its own: replayed on another stream while calls on
    the capturing stream go on, each replay claims every tile afresh and gives the direct call's
    bits (three blocks for 2 x 2 x 9 tiles, so that most are claimed)."""
    import cupy
    from shapes import bits, captured, replay_into_nan

    policy(ws_forward=True)
    set_sm_count(monkeypatch, 3)
    q, k, v = _tma_inputs(rng, dtype, (2, 1100, 900, 2, 1, 128))
    mask = BlockMask(rng.random((2, 9, 8)) < 0.5)
    want = [x.get() for x in cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)]
    assert isinstance(hopper[-1], WgmmaFwdWsKernel)
    graph, outputs, capturing = captured(lambda: cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True))
    other = cupy.cuda.Stream(non_blocking=True)
    for _ in range(3):
        replay_into_nan(graph, outputs, other)
        with capturing:
            beside = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
        other.synchronize()
        capturing.synchronize()
        for got, also, expected in zip(outputs, beside, want):
            numpy.testing.assert_array_equal(bits(got.get()), bits(expected))
            numpy.testing.assert_array_equal(bits(also.get()), bits(expected))


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_warp_specialised_forward_falls_back(rng, policy, monkeypatch, nan_outputs, hopper, dtype):
    """Q 2 bytes off 16-byte alignment has no tensor map: the TMA build serves (K's and V's maps
    still fit). Causal problems take the TMA build too."""
    import cupy

    policy(ws_forward=True)
    dt = numpy_dtype(dtype)
    buf = cupy.asarray(rng.standard_normal(300 * 2 * 128 + 1).astype(dt))
    q = buf[1:].reshape(1, 300, 2, 128)
    k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 1, 300, 300, 2, 128)[1:])
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    assert isinstance(hopper[-1], WgmmaFwdKernel) and hopper[-1].tma
    assert_matches_reference(q, k, v, out, lse, dtype, False)
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(hopper[-1], WgmmaFwdKernel) and hopper[-1].tma and hopper[-1].local
    assert_matches_reference(q, k, v, out, lse, dtype, True)


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_tma_falls_back_where_no_tensor_map_fits(rng, nan_outputs, hopper, dtype):
    """K or V 2 bytes off 16-byte alignment, rows of 59 or 111 elements (118, 222 bytes: not
    multiples of 16): no tensor map describes them, so the cp.async build serves."""
    import cupy

    dt = numpy_dtype(dtype)
    buf = cupy.asarray(rng.standard_normal(300 * 2 * 64 + 1).astype(dt))
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 1, 300, 300, 2, 64))
    misaligned = buf[1:].reshape(1, 300, 2, 64)
    for args in ((q, misaligned, v), (q, k, misaligned)):
        out, lse = cupyflash.attention(*args, return_lse=True)
        assert not hopper[-1].tma
        assert_matches_reference(*args, out, lse, dtype, False)
    for head_dim in (59, 111):
        args = [cupy.asarray(x) for x in random_qkv(rng, dtype, 2, 113, 203, 3, head_dim)]
        out, lse = cupyflash.attention(*args, return_lse=True)
        assert not hopper[-1].tma
        assert_matches_reference(*args, out, lse, dtype, False)
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    assert hopper[-1].tma
    assert took_hopper(hopper)


# The dK/dV kernel's TMA builds (kTma: Q_i and dO_i copied, and dQ_i's shares added to the float32
# workspace, by the TMA, not by every thread's cp.async copies and atomics; every variant without
# score modifiers). Query blocks cut short by seqlen_q (rows the TMA zero-fills in its copies and
# clips from its adds), head dims 40, 104 and 112 (columns likewise), GQA, batch > 1, strided Q, dO,
# K and V.
TMA_DQ_SHAPES = [(2, 70, 1, 4, 2, 64), (2, 203, 331, 4, 2, 40), (3, 129, 257, 2, 2, 112), (1, 515, 700, 4, 4, 128),
                 (2, 1, 90, 2, 1, 104)]


def _strided_like(rng, q):
    """An array of q's shape and dtype whose heads are interleaved in a twice-wider one."""
    import cupy

    batch, seqlen, heads, head_dim = q.shape
    wide = cupy.asarray(rng.standard_normal((batch, seqlen, 2 * heads, head_dim)).astype(q.dtype))
    return wide[:, :, 1::2]


@pytest.mark.parametrize("variant", ["dense", "causal", "block_sparse"])
@pytest.mark.parametrize("shape", TMA_DQ_SHAPES)
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_tma_dq_build_matches_the_atomic_build(rng, policy, monkeypatch, nan_outputs, hopper, dtype, shape, variant):
    """The copy engine brings the same Q_i, dO_i tiles as the threads' copies: dK_j and dV_j are
    equal bit for bit. dQ sums the same shares in another order (neither build's is fixed): within
    the reference's tolerance, as the atomic build's."""
    from shapes import bits

    if not hopper.backward:
        pytest.skip("the Hopper dK/dV kernel is switched off in this run")
    q, k, v = _tma_inputs(rng, dtype, shape)
    q = _strided_like(rng, q)
    dout = _strided_like(rng, q)
    assert not q.flags.c_contiguous and not dout.flags.c_contiguous
    causal = variant == "causal"
    mask = None
    if variant == "block_sparse":
        mask = BlockMask(rng.random((shape[3], -(-shape[1] // 128), -(-shape[2] // 128))) < 0.6)
    if mask is None:
        out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
    else:
        out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)

    def backward():
        if mask is None:
            return cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        return cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask)

    grads = backward()
    assert hopper[-1].tma and hopper[-1].local == causal and hopper[-1].block_sparse == (mask is not None)
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, causal, block_mask=mask)
    policy(tma=False)
    atomic = backward()
    # (the warp-specialised build's cp.async twin is the one-block build)
    assert not hopper[-1].tma and dataclasses.replace(hopper[-2], tma=False, ws=False) == hopper[-1]
    assert_gradients_match_reference(dout, q, k, v, atomic, dtype, causal, block_mask=mask)
    for got, want in zip(grads[1:], atomic[1:]):
        assert (bits(got.get()) == bits(want.get())).all()


# (batch, seqlen_q, seqlen_k, heads, K/V heads, head dim, rows of whole 16 bytes so that the strided
# Q, K, V and dO take tensor maps): one-key and one-query problems, key tiles cut by seqlen_k, GQA,
# seqlen_k a tile multiple and not, head dims padded to 64 and to 128.
WS_BWD_SHAPES = [(2, 70, 1, 4, 2, 64), (2, 1, 17, 3, 3, 40), (2, 203, 331, 4, 2, 56), (1, 515, 700, 4, 4, 64),
                 (1, 1023, 1024, 2, 1, 128), (1, 1024, 1023, 2, 2, 104), (2, 129, 257, 2, 2, 120)]


@pytest.mark.parametrize("sm_count, ring", [(None, 0), (None, 1), (1, 0), (3, 2)])
@pytest.mark.parametrize("variant", DKDV_VARIANTS)
@pytest.mark.parametrize("shape", WS_BWD_SHAPES)
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_warp_specialised_dkdv_kernel(rng, policy, monkeypatch, launches, nan_outputs, hopper, dtype, shape, variant,
                                     sm_count, ring):
    """The warp-specialised dK/dV kernel against the reference, and bit for bit against the
    one-block TMA build for dK and dV (the same steps on the same tiles, each key block's walk
    starting at the same query block); dQ sums the same shares in another order: within the
    reference's tolerance. sm_count forces the grid down to 1 or 3 blocks, so that each claims many
    key blocks, its producer filling both Q_i buffers and K_j, V_j while the consumers write out
    the last key block. Block masks of 256 keys round the launch up past seqlen_k (key tiles with
    nothing to do) and leave a key block with no query block. At the policy's ring_head_dims (d64) the
    kernel adds dQ into its ring and rounds dq itself: no conversion launch follows it (the
    one-block build's does), and every dQ element, NaN before, is written; d128 adds into the
    whole workspace, which the conversion rounds. The ring holds every slab of these problems
    unless `ring` forces one or two slots (at d128 too), so that slabs wait for the rounding of
    those before them (with every block racing, or with one block whose own rounding warps free
    its next slot); with one block and no forced ring, d64 takes the whole workspace (as masks too
    sparse for the ring do); the counters and the stream's kept ring are zero after."""
    import cupy
    from shapes import bits

    if not hopper.backward:
        pytest.skip("the Hopper dK/dV kernel is switched off in this run")
    policy(ws_backward=True)
    if sm_count is not None:
        set_sm_count(monkeypatch, sm_count)
    policy(ring_slabs=ring)
    if ring:
        policy(ring_head_dims=(64, 128))
    # Without a forced ring: at any density on every block, on one block never (d64 then takes the
    # whole workspace, as below the policy's ring_min_steps).
    policy(ring_min_steps=float("inf") if sm_count == 1 else 0.0)
    rounds_dq = tiles.padded_head_dim(shape[5]) in current().ring_head_dims and sm_count != 1
    causal, window, block_sparse, _ = TMA_VARIANTS[variant]
    q, k, v = _tma_inputs(rng, dtype, shape)
    q, dout = _strided_like(rng, q), _strided_like(rng, q)
    mask = None
    if block_sparse:
        dense = rng.random((shape[3], -(-shape[1] // 128), -(-shape[2] // 256))) < 0.6
        dense[:, :, 0] = False  # key block 0: no query block
        mask = BlockMask(dense, (128, 256))
        out, lse = cupyflash.block_sparse_attention(q, k, v, mask, causal=causal, window=window, return_lse=True)
    else:
        out, lse = cupyflash.attention(q, k, v, causal=causal, window=window, return_lse=True)

    def backward():
        if mask is None:
            return cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, window=window)
        return cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask, causal=causal, window=window)

    steps, launched = [], []
    launches(lambda kernel, arguments: (steps.append(getattr(kernel, "step", "dK/dV")), launched.append(arguments)))
    grads = backward()
    ws = hopper[-1]
    assert ws.ws and ws.block_sparse == block_sparse and ws.local == (causal or window is not None)
    assert steps == ["preprocess", "dK/dV"] + ([] if rounds_dq else ["convert_dq"])
    slabs = shape[0] * shape[4]
    dkdv = launched[steps.index("dK/dV")]
    assert int(dkdv[-2]) == (min(ring or slabs, slabs) if rounds_dq else 0)  # the ring's slots
    counters = dkdv[-3]  # (then the item order)
    words = ws.counters(shape[4], shape[0])
    left = cupy.ndarray((words,), cupy.int32, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(int(counters), 4 * words, None), 0))
    assert not left.any(), "the counters are left zero for the next launch"
    rings = [x for key, x in workspace.ZEROED.items() if key[0] == "dq ring"]
    if rounds_dq:  # the stream's kept ring, not a fresh one
        ring_of_stream = workspace.ZEROED[("dq ring", q.device.id, cupy.cuda.get_current_stream().ptr)]
        assert int(dkdv[2]["dq_accum"][0]) == ring_of_stream.ptr
    assert not any(x.owner.any() for x in rings), "the stream's kept ring is left zero for the next launch"
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, causal, block_mask=mask, window=window)
    policy(ws_backward=False)
    steps.clear()
    one_block = backward()
    assert hopper[-1] == dataclasses.replace(ws, ws=False)
    assert steps == ["preprocess", "dK/dV", "convert_dq"]
    assert_gradients_match_reference(dout, q, k, v, one_block, dtype, causal, block_mask=mask, window=window)
    for got, want in zip(grads[1:], one_block[1:]):
        assert (bits(got.get()) == bits(want.get())).all()


@pytest.mark.parametrize("sm_count", [None, 3])
@pytest.mark.parametrize("head_dim, kv_heads", [(64, 3), (128, 1)])
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_warp_specialised_dkdv_kernel_claims_long_columns_first(rng, policy, monkeypatch, launches, nan_outputs, hopper,
                                                                 dtype, head_dim, kv_heads, sm_count):
    """On a mask with a column far longer than the rest (each key block seen by one query block,
    a global key block by all 8: class 3), the warp-specialised dK/dV kernel claims its items in
    the mask's dkdv_item_order, the global columns' first; each item's dK_j, dV_j must land where
    they belong (outputs NaN before), bit for bit as the one-block build's, dQ within the
    reference's tolerance; the counters are left zero. No dQ ring (d64 would take one; the order
    is only given without). GQA (3 heads on 1 K/V head) sums an item's steps over its group;
    sm_count 3: three blocks claim the reordered items in turn. seqlen_k 900: the last key block
    cut short."""
    import cupy
    from shapes import bits

    if not hopper.backward:
        pytest.skip("the Hopper dK/dV kernel is switched off in this run")
    policy(ws_backward=True)
    policy(ring_min_steps=float("inf"))
    set_sm_count(monkeypatch, sm_count or 132)
    q, k, v = _tma_inputs(rng, dtype, (2, 1000, 900, 3, kv_heads, head_dim))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    dense = numpy.zeros((3, 8, 8), bool)
    for h in range(3):
        dense[h, rng.permutation(8), numpy.arange(8)] = True
    dense[:, :, 5] = True  # a global key block in every head
    mask = BlockMask(dense)
    out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
    launched = []
    launches(lambda kernel, arguments: launched.append((kernel, arguments)))
    grads = cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask)
    ws = hopper[-1]
    assert ws.ws and ws.block_sparse
    (dkdv,) = [args for kernel, args in launched if kernel == ws]
    t = ws.tile
    order = mask.dkdv_item_order(2, 3, 3 // kv_heads, 128 // t.block_n, 128 // t.block_m, q.device.id)
    assert order is not None and int(dkdv[-1]) == order.data.ptr and int(dkdv[-2]) == 0  # an order, no ring
    # The global key block is first in every head's key_order, so each slab's first tiles (its
    # tiles) come first, slab after slab, then the rest in launch order.
    tiles, positions, slabs = 128 // t.block_n, 8 * 128 // t.block_n, 2 * kv_heads
    assert (mask.key_order[0, :, 0] == 5).all()
    first = [slab * positions + p for slab in range(slabs) for p in range(tiles)]
    numpy.testing.assert_array_equal(order.get(), first + [i for i in range(slabs * positions) if i not in first])
    words = ws.counters(kv_heads, 2)
    left = cupy.ndarray((words,), cupy.int32, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(int(dkdv[-3]), 4 * words, None), 0))
    assert not left.any(), "the counters are left zero for the next launch"
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, False, block_mask=mask)
    policy(ws_backward=False)
    one_block = cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask)
    assert hopper[-1] == dataclasses.replace(ws, ws=False)
    for got, want in zip(grads[1:], one_block[1:]):
        assert (bits(got.get()) == bits(want.get())).all()


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_warp_specialised_dkdv_kernel_captured_in_a_graph(rng, policy, monkeypatch, hopper, dtype):
    """A captured block-sparse backward keeps its workspaces, counters and dQ ring (two slots for
    four slabs, three blocks) of its own: replayed on another stream while calls on the capturing
    stream go on (with that stream's kept ring), every replay and every call gives the direct
    call's dK, dV bit for bit and dQ within the reference's tolerance (its adds land in another
    order), and the kept buffers are left zero."""
    import cupy
    from shapes import bits, captured, replay_into_nan

    if not hopper.backward:
        pytest.skip("the Hopper dK/dV kernel is switched off in this run")
    policy(ws_backward=True)
    policy(ring_slabs=2)
    set_sm_count(monkeypatch, 3)
    q, k, v = _tma_inputs(rng, dtype, (2, 600, 500, 4, 2, 64))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    mask = BlockMask(rng.random((4, 5, 4)) < 0.6)
    out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)

    def backward():
        return cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask)

    want = [x.get() for x in backward()]
    assert hopper[-1].ws
    graph, outputs, capturing = captured(backward)
    other = cupy.cuda.Stream(non_blocking=True)
    for _ in range(3):
        replay_into_nan(graph, outputs, other)
        with capturing:
            beside = backward()
        other.synchronize()
        capturing.synchronize()
        for grads in (outputs, beside):
            assert_gradients_match_reference(dout, q, k, v, grads, dtype, False, block_mask=mask)
            for got, expected in zip(grads[1:], want[1:]):
                numpy.testing.assert_array_equal(bits(got.get()), bits(expected))
    assert not any(x.owner.any() for x in workspace.ZEROED.values())


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_warp_specialised_dkdv_kernel_falls_back(rng, policy, monkeypatch, nan_outputs, hopper, dtype):
    """V 2 bytes off 16-byte alignment has no tensor map: the one-block TMA build serves (dQ's, Q's
    and dO's maps still fit), with results as ever."""
    import cupy

    if not hopper.backward:
        pytest.skip("the Hopper dK/dV kernel is switched off in this run")
    policy(ws_backward=True)
    q, k = (cupy.asarray(x) for x in random_qkv(rng, dtype, 2, 300, 300, 2, 64)[:2])
    buf = cupy.asarray(rng.standard_normal(k.size + 1).astype(k.dtype))
    v = buf[1:].reshape(k.shape)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse)
    assert isinstance(hopper[-1], WgmmaBwdDkdvKernel) and hopper[-1].tma and not hopper[-1].ws
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, False)


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_tma_dq_falls_back_to_atomics(rng, nan_outputs, hopper, dtype):
    """Head dims 59 and 111 (dQ rows of 236, 444 bytes: not multiples of 16) have no tensor map;
    at head dim 100 the dQ workspace has one but Q and dO (heads 200 bytes apart) have none; a dO
    2 bytes off 16-byte alignment has none; deterministic mode has no workspace. The build without
    TMA serves (or none), with results as ever."""
    import cupy

    if not hopper.backward:
        pytest.skip("the Hopper dK/dV kernel is switched off in this run")
    for head_dim, deterministic, misaligned in ((59, False, False), (111, False, False), (100, False, False),
                                                (64, False, True), (64, True, False)):
        q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 2, 113, 203, 3, head_dim))
        dout = cupy.asarray(rng.standard_normal(q.size + 1).astype(q.dtype))
        dout = dout[1:] if misaligned else dout[:-1]
        dout = dout.reshape(q.shape)
        out, lse = cupyflash.attention(q, k, v, return_lse=True)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic)
        assert isinstance(hopper[-1], WgmmaBwdDkdvKernel) and not hopper[-1].tma
        assert_gradients_match_reference(dout, q, k, v, grads, dtype, False)
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 2, 113, 203, 3, 64))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    cupyflash.attention_backward(dout, q, k, v, out, lse)
    assert hopper[-1].tma
