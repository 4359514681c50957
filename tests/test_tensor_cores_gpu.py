"""The tensor-core (mma.sync) kernels: that 16-bit attention takes them (and float32's forward, as
TF32 products, at each precision, and float64's, on DMMA), every padded head dim and both tile-load
paths (cp.async and element-wise) against the float64 reference, and the scalar 16-bit and float64
kernels kept as the baseline. The awkward grids of test_attention_gpu.py and test_backward_gpu.py
run the tensor-core path too for float16/bfloat16 (and float32's and float64's forward). Marker
`gpu`."""

import dataclasses

import numpy
import pytest

import cupyflash
from cupyflash import catalog, validation
from cupyflash.catalog import Variant, tiles
from cupyflash.catalog.tensor_cores import TcFwdKernel
from cupyflash.catalog.specs import BwdRowKernel
from cupyflash.dispatch.policy import current
from cupyflash.problem import lse_dtype
from cupyflash.runtime import device as devices
from families import MMA_SYNC, SCALAR, TENSOR_CORES, backward, forward
from shapes import numpy_dtype, random_qkv
from test_attention_gpu import assert_matches_reference
from test_backward_gpu import assert_gradients_match_reference

pytestmark = pytest.mark.gpu

TC_DTYPES = list(tiles.TENSOR_CORE_DTYPES)


@pytest.fixture
def launched(launches):
    """The kernels attention() and attention_backward() launch, in order."""
    kernels = []
    launches(lambda kernel, arguments: kernels.append(kernel))
    return kernels


@pytest.mark.parametrize("dtype", tiles.DTYPE_NAMES)
def test_16_bit_dtypes_take_the_tensor_core_kernels(rng, launched, dtype):
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 1, 70, 70, 2, 64))
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    cupyflash.attention_backward(out, q, k, v, out, lse)
    cupyflash.attention_backward(out, q, k, v, out, lse, deterministic=True)
    tiled = [type(kn).__name__ for kn in launched if not isinstance(kn, BwdRowKernel)]
    if dtype in TC_DTYPES:
        # The Hopper kernels on sm_90 unless switched off (CUPYFLASH_HOPPER_FORWARD=0,
        # CUPYFLASH_HOPPER_BACKWARD=0); the deterministic dQ kernel is mma.sync everywhere.
        sm_90 = cupy.cuda.Device().compute_capability == "90"
        fwd = "WgmmaFwdKernel" if current().hopper_forward and sm_90 else "TcFwdKernel"
        dkdv = "WgmmaBwdDkdvKernel" if current().hopper_backward and sm_90 else "TcBwdDkdvKernel"
        assert tiled == [fwd, dkdv, dkdv, "TcBwdDqKernel"]
    elif dtype == "float32":  # on CUDA cores at the default precision, "highest"
        assert tiled == ["FwdKernel", "BwdDkdvKernel", "BwdDkdvKernel", "BwdDqKernel"]
    else:  # float64 on the FP64 tensor cores, the deterministic dQ kernel on CUDA cores
        assert tiled == ["TcFwdKernel", "TcBwdDkdvKernel", "TcBwdDkdvKernel", "BwdDqKernel"]
        assert launched[0].element_type == "double"


@pytest.mark.parametrize("precision,kernel",
                         [("highest", "FwdKernel"), ("high", "cupyflash::Tf32<3>"), ("medium", "cupyflash::Tf32<1>")])
def test_float32_precision_picks_the_forward(rng, launched, precision, kernel):
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float32", 1, 70, 70, 2, 64))
    with cupyflash.float32_precision(precision):
        cupyflash.attention(q, k, v)
    assert kernel in (type(launched[0]).__name__, getattr(launched[0], "element_type", None))


@pytest.mark.parametrize("head_dim", [1, 16, 40, 64, 111, 128])  # (tiles.TF32_MAX_HEAD_DIM)
@pytest.mark.parametrize("causal", [False, True])
def test_float32_forward_on_3xtf32_meets_the_float32_rule(rng, nan_outputs, causal, head_dim):
    """Long key rows (errors add up over 3000 keys) and awkward lengths, against float64 under the
    rule float32 arithmetic is held to; scores spread wide (scale 1/8, inputs of norm ~ sqrt(d))."""
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float32", 2, 257, 3001, 3, head_dim))
    with cupyflash.float32_precision("high"):
        out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True, scale=1.0 / 8)
    assert_matches_reference(q, k, v, out, lse, "float32", causal, scale=1.0 / 8)


def _tf32(x):
    """float32 values rounded to TF32 (10 mantissa bits), to nearest, ties away (cvt.rna.tf32)."""
    bits = numpy.ascontiguousarray(x, numpy.float32).view(numpy.uint32)
    return ((bits + numpy.uint32(0x1000)) & numpy.uint32(0xFFFFE000)).view(numpy.float32)


def _attention_on_one_tf32_product(q, k, v, causal, scale):
    """The baseline of precision "medium": the same attention in float32 with every product's
    operands rounded to TF32 (Q, K; P, V), as one TF32 tensor-core product takes them."""
    s = numpy.einsum("bqhd,bkhd->bhqk", _tf32(q), _tf32(k), dtype=numpy.float32) * numpy.float32(scale)
    if causal:  # bottom-right aligned; here every query sees a key
        seqlen_q, seqlen_k = s.shape[-2:]
        s[..., numpy.arange(seqlen_k) > numpy.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q] = -numpy.inf
    m = s.max(axis=-1, keepdims=True)
    p = numpy.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    out = numpy.einsum("bhqk,bkhd->bqhd", _tf32(p), _tf32(v), dtype=numpy.float32) / l.transpose(0, 2, 1, 3)
    return out.astype(numpy.float64), (m + numpy.log(l))[..., 0].astype(numpy.float64)


@pytest.mark.parametrize("head_dim", [1, 40, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_forward_on_one_tf32_product_meets_the_tf32_rule(rng, nan_outputs, causal, head_dim):
    """Precision "medium": within 2x the error of the same attention on TF32 operands."""
    import cupy

    from cupyflash import reference

    q, k, v = random_qkv(rng, "float32", 2, 257, 1501, 3, head_dim)
    with cupyflash.float32_precision("medium"):
        out, lse = cupyflash.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=causal, return_lse=True,
                                       scale=1.0 / 8)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, scale=1.0 / 8, return_lse=True)
    base, base_lse = _attention_on_one_tf32_product(q, k, v, causal, 1.0 / 8)
    magnitude = reference.output_term_magnitude(q, k, v, causal=causal, scale=1.0 / 8)
    err = float(numpy.abs(cupy.asnumpy(out) - ref).max())
    bound = reference.error_bound(ref, base, "float32", magnitude=magnitude)
    assert err <= bound, f"out: max |error| {err:.3e} > bound {bound:.3e}"
    lse_err = float(numpy.abs(cupy.asnumpy(lse) - ref_lse).max())
    lse_bound = reference.error_bound(ref_lse, base_lse, "float32")
    assert lse_err <= lse_bound, f"lse: max |error| {lse_err:.3e} > bound {lse_bound:.3e}"


@pytest.mark.parametrize("head_dim", [1, 16, 40, 64, 96, 111, 128])  # (tiles.F64_MAX_HEAD_DIM)
@pytest.mark.parametrize("causal", [False, True])
def test_float64_forward_on_dmma_meets_the_float64_rule(rng, nan_outputs, launched, causal, head_dim):
    """The FP64 tensor cores over long key rows (3001 keys) and awkward lengths, against the float64
    reference under the rule float64 arithmetic is held to."""
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float64", 2, 257, 3001, 3, head_dim))
    out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
    assert launched[0].element_type == "double"
    assert_matches_reference(q, k, v, out, lse, "float64", causal)


@dataclasses.dataclass(frozen=True)
class _M8n8k4FwdKernel(TcFwdKernel):
    """The float64 forward with sm_80's form of the DMMA step (eight m8n8k4 products) on any GPU."""

    compile_options = ("-DCUPYFLASH_DMMA_M8N8K4",)


@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_float64_forward_on_sm80_dmma_steps(rng, nan_outputs, causal, head_dim):
    """What an A100 runs (sm_90 compiles the k16 step as one m16n8k16), forced on this GPU."""
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float64", 2, 257, 1001, 3, head_dim))
    p = validation.check_attention_args(q, k, v, causal=causal, scale=None, return_lse=True)
    base = catalog.forward_kernel("sm80", "float64", head_dim, Variant(local=causal))
    kernel = _M8n8k4FwdKernel(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    out = cupy.full(q.shape, numpy.nan)
    lse = cupy.full((p.batch, p.heads, p.seqlen_q), numpy.nan)
    forward(p, q, k, v, out, lse, kernel=kernel)
    assert_matches_reference(q, k, v, out, lse, "float64", causal)


def _forward_backward(q, k, v, dout, causal, deterministic, families):
    """attention + attention_backward through the planner, on these kernel families."""
    import cupy

    p = validation.check_attention_args(q, k, v, causal=causal, scale=None, return_lse=True)
    out = cupy.full(q.shape, numpy.nan, dtype=numpy.float32).astype(q.dtype)
    lse = cupy.full((p.batch, p.heads, p.seqlen_q), numpy.nan, dtype=lse_dtype(p.dtype_name))
    forward(p, q, k, v, out, lse, families)
    pb = validation.check_backward_args(dout, q, k, v, out, lse, causal=causal, scale=None, deterministic=deterministic)
    grads = [cupy.full(x.shape, numpy.nan, dtype=numpy.float32).astype(x.dtype) for x in (q, k, v)]
    backward(pb, dout, q, k, v, out, lse, *grads, families=families)
    return out, lse, grads


def check_forward_backward(rng, dtype, shape, causal, deterministic, families):
    """Random q, k, v, dout of shape (batch, seqlen_q, seqlen_k, heads, head_dim) through the
    chosen kernel family, checked against the float64 reference under the tolerance rule."""
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, *shape))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    out, lse, grads = _forward_backward(q, k, v, dout, causal, deterministic, families)
    assert_matches_reference(q, k, v, out, lse, dtype, causal)
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, causal)


# One head dim per padded class (16 ... 256), odd ones included: odd head dims and strides take
# the element-wise tile loader, the others cp.async.
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", [13, 32, 61, 96, 150, 192, 221, 256])
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_every_padded_head_dim(rng, dtype, head_dim, deterministic):
    check_forward_backward(rng, dtype, (2, 150, 190, 2, head_dim), True, deterministic, TENSOR_CORES)


# The mma.sync dK/dV traits table has tiles for an A100's shared memory and larger ones for an
# H100's (double-buffered dO; 64 queries per step above d192). Both run here, whichever this GPU picks.
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("large_smem", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_dkdv_tiles_for_both_shared_memory_sizes(rng, monkeypatch, dtype, head_dim, large_smem, causal):
    import cupy

    info = devices.info(cupy.cuda.Device().id)
    if large_smem and info.smem_per_block < tiles.SMEM_H100:
        pytest.skip("this GPU has less shared memory per block than an H100")
    smem = info.smem_per_block if large_smem else tiles.SMEM_A100
    monkeypatch.setattr(devices, "info", lambda device_id: dataclasses.replace(info, smem_per_block=smem))
    check_forward_backward(rng, dtype, (2, 300, 333, 2, head_dim), causal, False, MMA_SYNC)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("large_smem", [False, True])
@pytest.mark.parametrize("head_dim", [16, 40, 64, 96, 128])
def test_float64_dkdv_on_dmma_for_both_shared_memory_sizes(rng, monkeypatch, launched, head_dim, large_smem, causal,
                                                           deterministic):
    """float64's dK/dV kernel on the FP64 tensor cores: every tile of its table (an A100's shared
    memory to d64, where above it the CUDA-core kernel serves), dQ by atomics or deterministic."""
    import cupy

    info = devices.info(cupy.cuda.Device().id)
    if large_smem and info.smem_per_block < tiles.SMEM_H100:
        pytest.skip("this GPU has less shared memory per block than an H100")
    smem = info.smem_per_block if large_smem else tiles.SMEM_A100
    monkeypatch.setattr(devices, "info", lambda device_id: dataclasses.replace(info, smem_per_block=smem))
    check_forward_backward(rng, "float64", (2, 300, 333, 2, head_dim), causal, deterministic, None)
    dkdv = [type(kn).__name__ for kn in launched if "Dkdv" in type(kn).__name__]
    assert dkdv == ["TcBwdDkdvKernel" if large_smem or head_dim <= 64 else "BwdDkdvKernel"]


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_misaligned_base_pointers_take_the_element_wise_loader(rng, dtype):
    import cupy

    # Offsets of one element: every row start is 2 bytes off 16-byte alignment.
    dt = numpy_dtype(dtype)
    buf = cupy.asarray(rng.standard_normal((3, 1, 300 * 2 * 64 + 1)).astype(dt))
    q, k, v = (buf[i, 0, 1:].reshape(1, 300, 2, 64) for i in range(3))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    assert q.data.ptr % 16 != 0
    out, lse, grads = _forward_backward(q, k, v, dout, False, False, TENSOR_CORES)
    assert_matches_reference(q, k, v, out, lse, dtype, False)
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, False)


# The scalar kernels remain the readable baseline for 16-bit and float64 inputs (and the path on
# GPUs older than sm_80): they must stay correct though attention() no longer picks them there.
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", TC_DTYPES + ["float64"])
def test_scalar_kernels_still_serve_16_bit_and_float64(rng, dtype, causal):
    check_forward_backward(rng, dtype, (2, 113, 203, 3, 111), causal, False, SCALAR)


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_long_sequence_against_the_reference(rng, dtype):
    """Many key blocks and the causal diagonal crossing tiles at a realistic length."""
    check_forward_backward(rng, dtype, (1, 2049, 2049, 1, 128), True, False, TENSOR_CORES)
