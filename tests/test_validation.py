"""Bad input: TypeError/ValueError naming the argument, raised before any device work, inputs untouched."""

import numpy
import pytest

import cupyflash
from cupyflash.cpu import fallback
from cupyflash.dispatch import plan
from shapes import random_qkv


class FakeDeviceArray:
    """Stands in for a GPU array of another framework: only its DLPack device is ever read."""

    def __init__(self, device_type=2, device_id=0):
        self._device = (device_type, device_id)

    def __dlpack__(self, stream=None):
        raise AssertionError("validation must reject before importing any data")

    def __dlpack_device__(self):
        return self._device


@pytest.fixture
def qkv(rng):
    return random_qkv(rng, "float32", 2, 9, 11, 3, 16)


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any kernel launch or GPU fallback during these tests is a failure."""

    def fail(*args, **kwargs):
        raise AssertionError("device work started before validation finished")

    for module, name in ((plan, "plan_forward"), (plan, "plan_backward"), (fallback, "forward"),
                         (fallback, "backward"), (fallback, "decode")):
        monkeypatch.setattr(module, name, fail)


def check_raises(exc, match, q, k, v, **kwargs):
    before = [numpy.array(x, copy=True) if isinstance(x, numpy.ndarray) else None for x in (q, k, v)]
    with pytest.raises(exc, match=match):
        cupyflash.attention(q, k, v, **kwargs)
    for x, x0 in zip((q, k, v), before):
        if x0 is not None:
            numpy.testing.assert_array_equal(x, x0)  # untouched


def test_non_array_inputs(qkv):
    q, k, v = qkv
    check_raises(TypeError, r"^q must be an array .* got builtins.list", q.tolist(), k, v)
    check_raises(TypeError, r"^k must be an array .* got builtins.float", q, 1.0, v)
    check_raises(TypeError, r"^v must be an array .* got builtins.NoneType", q, k, None)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_rank(qkv, which):
    arrays = dict(zip("qkv", qkv))
    arrays[which] = arrays[which][0]
    check_raises(ValueError, rf"^{which} must have 4 dimensions .* got shape \(", **arrays)


@pytest.mark.parametrize("which,axis,label", [("k", 0, "batch"), ("v", 0, "batch"), ("k", 2, "heads"), ("v", 2, "heads"), ("k", 3, "head_dim"), ("v", 3, "head_dim")])
def test_batch_heads_head_dim_mismatch(rng, which, axis, label):
    arrays = dict(zip("qkv", random_qkv(rng, "float32", 2, 9, 11, 3, 16)))
    shape = list(arrays[which].shape)
    shape[axis] += 1
    arrays[which] = rng.standard_normal(shape).astype(numpy.float32)
    check_raises(ValueError, rf"^{which} must have shape \(batch=2, seqlen_k, heads_kv, head_dim=16\) with heads_kv dividing q.s 3 heads", **arrays)


def test_seqlen_mismatch_between_k_and_v(qkv, rng):
    q, k, _ = qkv
    v = rng.standard_normal((2, 12, 3, 16)).astype(numpy.float32)
    check_raises(ValueError, r"^k and v must have the same seqlen_k", q, k, v)


def test_mismatched_dtypes(qkv):
    q, k, v = qkv
    check_raises(TypeError, r"same dtype; q is float32, k is float64", q, k.astype(numpy.float64), v)
    check_raises(TypeError, r"same dtype; q is float32, v is float16", q, k, v.astype(numpy.float16))


@pytest.mark.parametrize("dtype", [numpy.int32, numpy.complex64, numpy.bool_, numpy.uint16])
def test_unsupported_dtypes(qkv, dtype):
    q, k, v = (x.astype(dtype) for x in qkv)
    check_raises(TypeError, r"^q must have dtype float16, bfloat16 \(ml_dtypes\), float32 or float64", q, k, v)
    q32, k32, v32 = qkv
    check_raises(TypeError, r"^k must have dtype float16", q32, k32.astype(dtype), v32)


def test_void_dtype_explains_the_bfloat16_trap(qkv):
    q, k, v = (x.astype(numpy.float16).view("V2") for x in qkv)
    check_raises(TypeError, r"q has the void dtype '\|V2'.*__cuda_array_interface__", q, k, v)


@pytest.mark.parametrize("head_dim", [0, 257, 512])
def test_head_dim_out_of_range(rng, head_dim):
    q, k, v = random_qkv(rng, "float32", 1, 4, 4, 2, head_dim)
    check_raises(ValueError, rf"^head_dim .* between 1 and 256, got {head_dim}", q, k, v)


def test_head_dim_axis_not_contiguous(rng):
    q, k, v = random_qkv(rng, "float32", 1, 4, 4, 2, 32)
    check_raises(ValueError, r"^q's last axis \(head_dim\) must be contiguous", q[..., ::2], k[..., ::2], v[..., ::2])
    k_wide = rng.standard_normal((1, 4, 2, 64)).astype(numpy.float32)
    check_raises(ValueError, r"^k's last axis \(head_dim\) must be contiguous", q, k_wide[..., ::2], v)


def test_other_strides_are_accepted_by_validation(rng):
    from cupyflash import validation

    q = rng.standard_normal((2, 3, 5, 8)).astype(numpy.float32).transpose(0, 2, 1, 3)
    kv = rng.standard_normal((2, 7, 2, 3, 8)).astype(numpy.float32)
    p = validation.check_attention_args(q, kv[:, :, 0], kv[:, :, 1], causal=True, scale=None, return_lse=False)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.head_dim) == (2, 5, 7, 3, 8)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_scale_values(qkv, scale):
    check_raises(ValueError, r"^scale must be finite and positive", *qkv, scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, [0.1], 1j])
def test_bad_scale_types(qkv, scale):
    check_raises(TypeError, r"^scale must be a real number or None", *qkv, scale=scale)


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
def test_flags_must_be_bool(qkv, flag):
    check_raises(TypeError, rf"^{flag} must be True or False, got 'yes'", *qkv, **{flag: "yes"})


def test_mixed_host_and_device(qkv):
    q, k, v = qkv
    check_raises(ValueError, r"all be on the GPU or all on the host; got q on the host, k on the GPU, v on the host", q, FakeDeviceArray(), v)


def test_arrays_on_different_devices():
    arrays = [FakeDeviceArray(2, 0), FakeDeviceArray(2, 1), FakeDeviceArray(2, 0)]
    check_raises(ValueError, r"must be on the same GPU; got q on GPU 0, k on GPU 1, v on GPU 0", *arrays)


def test_unsupported_dlpack_device():
    arrays = [FakeDeviceArray(10, 0)] * 3  # ROCm
    check_raises(TypeError, r"^q lives on DLPack device type 10", *arrays)


# --------------------------------------------------------------------------- attention_backward


@pytest.fixture
def bwd_args(rng, qkv):
    q, k, v = qkv
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out = rng.standard_normal(q.shape).astype(q.dtype)
    lse = rng.standard_normal((2, 3, 9)).astype(numpy.float32)
    return {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}


def check_backward_raises(exc, match, args, **kwargs):
    before = {n: numpy.array(x, copy=True) for n, x in args.items() if isinstance(x, numpy.ndarray)}
    with pytest.raises(exc, match=match):
        cupyflash.attention_backward(*args.values(), **kwargs)
    for n, x0 in before.items():
        numpy.testing.assert_array_equal(args[n], x0)  # untouched


@pytest.mark.parametrize("which", ["dout", "out"])
def test_backward_dout_and_out_must_match_q(bwd_args, which):
    bad = dict(bwd_args, **{which: bwd_args[which][:, :5]})
    check_backward_raises(ValueError, rf"^{which} must have q's shape \(2, 9, 3, 16\), got \(2, 5, 3, 16\)", bad)
    bad = dict(bwd_args, **{which: bwd_args[which].astype(numpy.float64)})
    check_backward_raises(TypeError, rf"^{which} must have q's dtype float32, got float64", bad)
    bad = dict(bwd_args, **{which: numpy.asfortranarray(bwd_args[which])})
    check_backward_raises(ValueError, rf"^{which}'s last axis \(head_dim\) must be contiguous", bad)


def test_backward_lse_shape_and_dtype(bwd_args):
    bad = dict(bwd_args, lse=bwd_args["lse"][:, :, :4])
    check_backward_raises(ValueError, r"^lse must have shape \(batch, heads, seqlen_q\) = \(2, 3, 9\)", bad)
    bad = dict(bwd_args, lse=bwd_args["lse"].astype(numpy.float16))
    check_backward_raises(TypeError, r"^lse must be float32 for float32 inputs", bad)
    as64 = {n: x.astype(numpy.float64) for n, x in bwd_args.items() if n != "lse"}
    check_backward_raises(TypeError, r"^lse must be float64 for float64 inputs", dict(as64, lse=bwd_args["lse"]))


def test_backward_checks_q_k_v_like_the_forward(bwd_args):
    check_backward_raises(ValueError, r"^k must have shape \(batch=2, seqlen_k, heads_kv, head_dim=16\) with heads_kv dividing",
                          dict(bwd_args, k=bwd_args["k"][:, :, :2]))
    check_backward_raises(TypeError, r"^dout must be an array", dict(bwd_args, dout=[1.0]))
    check_backward_raises(ValueError, r"^scale must be finite and positive", bwd_args, scale=-1.0)


@pytest.mark.parametrize("flag", ["causal", "deterministic"])
def test_backward_flags_must_be_bool(bwd_args, flag):
    check_backward_raises(TypeError, rf"^{flag} must be True or False, got 1", bwd_args, **{flag: 1})


def test_backward_mixed_host_and_device(bwd_args):
    check_backward_raises(
        ValueError, r"^dout, q, k, v, out and lse must all be on the GPU or all on the host; got dout on the host, "
        r"q on the host, k on the host, v on the host, out on the host, lse on the GPU",
        dict(bwd_args, lse=FakeDeviceArray()),
    )


# --------------------------------------------------------------------------- block-sparse


def test_block_mask_errors(qkv):
    q, k, v = qkv  # seqlen_q 9, seqlen_k 11, batch 2, heads 3, float32, head_dim 16
    before = [x.copy() for x in (q, k, v)]
    good = cupyflash.BlockMask(numpy.ones((3, 1, 1), bool))
    cases = [
        (numpy.ones((1, 1, 1), bool), TypeError, "block_mask must be a cupyflash.BlockMask"),
        (cupyflash.BlockMask(numpy.ones((1, 2, 1), bool)), ValueError, r"2 x 1 blocks of 128 x 128.*1 x 1"),
        (cupyflash.BlockMask(numpy.ones((2, 1, 1), bool)), ValueError, "batch and head axes"),
        (cupyflash.BlockMask(numpy.ones((3, 1, 1, 1), bool)), ValueError, "batch and head axes"),
        (cupyflash.BlockMask(numpy.ones((1, 1, 1), bool), 16), ValueError, r"multiple of \(64, 64\)"),
    ]
    for mask, exc, match in cases:
        with pytest.raises(exc, match=match):
            cupyflash.block_sparse_attention(q, k, v, mask)
        dout = out = q
        lse = numpy.zeros((2, 3, 9), numpy.float32)
        with pytest.raises(exc, match=match):
            cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask)
    for x, x0 in zip((q, k, v), before):
        numpy.testing.assert_array_equal(x, x0)
    with pytest.raises(TypeError, match="q must have dtype"):  # the arrays are checked first
        cupyflash.block_sparse_attention(q.astype(numpy.int32), k, v, good)
