"""The forward kernel against the float64 reference, on the GPU (marker `gpu`)."""

import numpy
import pytest

import cupyflash
from cupyflash import reference
from cupyflash.dispatch import plan
from cupyflash.cpu import reference as cpu_reference
from rule import Judge, host
from shapes import AWKWARD_SHAPES, DTYPES, HEAD_DIMS, bits, numpy_dtype, random_qkv

pytestmark = pytest.mark.gpu


def assert_matches_reference(q, k, v, out, lse, dtype, causal, scale=None, block_mask=None, window=None, judge=None,
                             **mods):
    """out and lse against the float64 reference by the tolerance rule (tests/rule.py); with a
    `judge`, added to it as pieces of larger results and judged when it checks.
    mods: softcap, alibi_slopes (as the kernels saw them)."""
    q, k, v = (host(x) for x in (q, k, v))  # the exact values the kernel saw
    options = {"causal": causal, "scale": scale, "block_mask": block_mask, "window": window, **mods}
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    dt = numpy_dtype(dtype)
    lowp = reference.attention_in_precision(q.astype(dt), k.astype(dt), v.astype(dt), dt, **options)
    checking = judge or Judge()
    checking.add("out", out, ref, lowp, dtype, magnitude=reference.output_term_magnitude(q, k, v, **options))

    if lse is None:  # a call that returned no lse
        if judge is None:
            checking.check()
        return
    lse = host(lse)
    assert not numpy.isnan(lse).any(), "NaN in lse"
    numpy.testing.assert_array_equal(numpy.isneginf(lse), numpy.isneginf(ref_lse))
    finite = numpy.isfinite(ref_lse)
    # lse is float32 whatever the input: the same-precision baseline for it is float32 arithmetic.
    lse_lowp = reference.attention_in_precision(q, k, v, numpy.float32, return_lse=True, **options)[1]
    checking.add("lse", lse[finite], ref_lse[finite], lse_lowp[finite], "float32",
                 magnitude=reference.lse_term_magnitude(q, k, v, **options))
    if judge is None:
        checking.check()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim", AWKWARD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_awkward_shapes(rng, nan_outputs, dtype, seqlen_q, seqlen_k, head_dim, causal):
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 2, seqlen_q, seqlen_k, 3, head_dim))
    out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == (numpy.float64 if dtype == "float64" else numpy.float32) and lse.shape == (2, 3, seqlen_q)
    assert_matches_reference(q, k, v, out, lse, dtype, causal)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_head_dim_class(rng, nan_outputs, dtype, head_dim):
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 1, 130, 97, 2, head_dim))
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True, scale=0.3)
    assert_matches_reference(q, k, v, out, lse, dtype, True, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(rng, nan_outputs, dtype):
    import cupy

    b, s, h, d = 2, 150, 4, 72
    dt = numpy_dtype(dtype)
    # q: the transpose of a (batch, heads, seq, head_dim) array; k, v: views into one packed buffer.
    q = cupy.asarray(rng.standard_normal((b, h, s, d)).astype(dt)).transpose(0, 2, 1, 3)
    kv = cupy.asarray(rng.standard_normal((b, 190, 2, h, d + 8)).astype(dt))
    k, v = kv[:, :, 0, :, :d], kv[:, :, 1, :, 8:]
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    before = [x.copy() for x in (q, k, v)]
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, dtype, True)
    for x, x0 in zip((q, k, v), before):  # inputs untouched, bit for bit
        assert bool((bits(x) == bits(x0)).all())


def test_numpy_in_numpy_out(rng):
    q, k, v = random_qkv(rng, "float32", 2, 65, 33, 2, 24)
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    assert isinstance(out, numpy.ndarray) and isinstance(lse, numpy.ndarray)
    assert_matches_reference(q, k, v, out, lse, "float32", False)


def test_large_scores_do_not_overflow(rng, nan_outputs):
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float32", 1, 77, 300, 2, 64))
    out, lse = cupyflash.attention(q * 30, k, v, causal=True, return_lse=True)
    assert_matches_reference(q * 30, k, v, out, lse, "float32", True)


def test_runs_on_the_current_stream(rng):
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float16", 1, 300, 300, 2, 64))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = cupyflash.attention(q, k, v, return_lse=True)
        stream.synchronize()
    assert_matches_reference(q, k, v, out, lse, "float16", False)


def test_captured_calls_keep_what_their_replays_write(rng):
    """A forward whose lse is not returned and a backward (its row statistics and dQ workspace),
    captured into a CUDA graph, keep the buffers that the graph's replays write: arrays the pool
    hands out after the capture, in the buffers' sizes, are left as they were by a replay."""
    import cupy
    from shapes import captured

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float16", 1, 300, 300, 2, 64))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    graph, _, stream = captured(lambda: (cupyflash.attention(q, k, v),
                                         cupyflash.attention_backward(dout, q, k, v, out, lse)))
    with stream:  # lse and the row statistics (float32, a row each), the dQ workspace
        probes = [cupy.full(n, 7.0, cupy.float32) for n in [2 * 300] * 8 + [300 * 2 * 64] * 2]
        for _ in range(2):
            graph.launch(stream)
    stream.synchronize()
    assert all(bool((x == 7.0).all()) for x in probes), "a replay wrote into memory the pool handed on"


def _record_pointers(monkeypatch):
    seen = {}
    real = plan.plan_forward

    def spy(p, q, k, v, out, lse, **kwargs):
        seen.update(q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, out=out.data.ptr)
        return real(p, q, k, v, out, lse, **kwargs)

    monkeypatch.setattr(plan, "plan_forward", spy)
    return seen


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_round_trip_is_zero_copy(rng, monkeypatch, dtype):
    torch = pytest.importorskip("torch")
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 100, 3, 64))).cuda().to(tdtype) for _ in range(3))
    seen = _record_pointers(monkeypatch)
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == tdtype and out.is_cuda
    assert seen["q"] == q.data_ptr() and seen["k"] == k.data_ptr() and seen["v"] == v.data_ptr()
    assert seen["out"] == out.data_ptr()
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).double() for x in (q, k, v)), is_causal=True
    ).transpose(1, 2)
    assert (out.double() - ref).abs().max().item() < {"float16": 2e-3, "bfloat16": 2e-2, "float32": 1e-5}[dtype]
    # (batch, heads, seq, dim) tensors pass transposed, without a copy.
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    out2 = cupyflash.attention(qt, k, v, causal=True)
    assert seen["q"] == qt.data_ptr()
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_jax_round_trip_is_zero_copy(rng, monkeypatch, jax_gpu):
    jax = jax_gpu
    jnp = jax.numpy
    q, k, v = (jnp.asarray(rng.standard_normal((1, 80, 2, 32)), dtype=jnp.bfloat16) for _ in range(3))
    seen = _record_pointers(monkeypatch)
    out = cupyflash.attention(q, k, v)
    assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16
    assert seen["q"] == q.unsafe_buffer_pointer()
    assert seen["out"] == out.unsafe_buffer_pointer()
    ref = reference.attention(*(numpy.asarray(x.astype(jnp.float32)) for x in (q, k, v)))
    assert numpy.abs(numpy.asarray(out.astype(jnp.float32)) - ref).max() < 2e-2


def test_too_much_shared_memory_is_a_clear_error(monkeypatch):
    import cupy

    from cupyflash import catalog
    from cupyflash.catalog.specs import FwdKernel
    from cupyflash.runtime import compiler

    kernel = catalog.forward_kernel("scalar", "float64", 256)
    monkeypatch.setattr(FwdKernel, "smem_bytes", property(lambda self: 10**7))
    with pytest.raises(ValueError, match="shared memory"):
        compiler.get_function.__wrapped__(kernel, 0)
    q = cupy.zeros((1, 8, 1, 256), cupy.float64)  # the planner says so before any launch
    with pytest.raises(ValueError, match="no kernel serves it"):
        cupyflash.attention(q, q, q)


@pytest.mark.parametrize("source_file,struct", [
    ("scalar/fwd.cu", "cupyflash::FwdParams"),
    ("scalar/bwd.cu", "cupyflash::BwdParams"),
    ("decode/decode.cu", "cupyflash::DecodeParams"),
    ("decode/cuda_cores.cu", "cupyflash::DecodeParams"),
])
def test_params_struct_layout_matches_host(source_file, struct):
    import cupy

    from cupyflash.catalog import params
    from cupyflash.runtime import compiler

    dtype = params.STRUCTS[struct]
    code = compiler.kernel_source(source_file) + params.layout_probe(struct)
    probe = cupy.RawModule(code=code, options=compiler.COMPILE_OPTIONS).get_function("params_layout_probe")
    offsets = cupy.zeros(len(dtype.names), dtype=numpy.int64)
    probe((1,), (1,), (offsets,))
    assert offsets.get().tolist() == [dtype.fields[name][1] for name in dtype.names]


@pytest.mark.parametrize("dtype", DTYPES)
def test_standard_attention_baseline_is_correct(rng, dtype):
    import cupy

    from cupyflash.standard import standard_attention

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 2, 97, 131, 3, 48))
    out = standard_attention(q, k, v, causal=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    ref = reference.attention(q, k, v, causal=True)
    lowp = reference.attention_in_precision(q.get(), k.get(), v.get(), numpy_dtype(dtype), causal=True)
    err = numpy.abs(cpu_reference.as_float64(out) - ref).max()
    assert err <= reference.error_bound(ref, lowp, dtype)
