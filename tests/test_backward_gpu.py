"""The backward kernels against the float64 reference gradients, and the torch / JAX adapters,
on the GPU (marker `gpu`)."""

import numpy
import pytest

import cupyflash
from cupyflash import validation, reference
from cupyflash.runtime import launch
from rule import Judge, assert_within_rule, host
from shapes import AWKWARD_SHAPES, DTYPES, HEAD_DIMS, bits, numpy_dtype, random_qkv

pytestmark = pytest.mark.gpu


def assert_gradients_match_reference(
    dout, q, k, v, grads, dtype, causal, scale=None, block_mask=None, window=None, judge=None, **mods
):
    """dq, dk, dv against the float64 gradients by the tolerance rule (tests/rule.py), the
    baseline standard attention's backward in the input precision, the floor relative to the
    terms each gradient sums (`reference.gradient_term_magnitudes`); with a `judge`, added to it
    and judged when it checks. mods: softcap, alibi_slopes."""
    dout, q, k, v = (host(x) for x in (dout, q, k, v))  # the values the kernels saw
    options = {"causal": causal, "scale": scale, "block_mask": block_mask, "window": window, **mods}
    exact = reference.attention_backward(dout, q, k, v, **options)
    dt = numpy_dtype(dtype)
    lowp = reference.attention_backward_in_precision(*(x.astype(dt) for x in (dout, q, k, v)), dt, **options)
    magnitudes = reference.gradient_term_magnitudes(dout, q, k, v, **options)
    checking = judge or Judge()
    for name, got, ref, base, magnitude in zip(("dq", "dk", "dv"), grads, exact, lowp, magnitudes):
        checking.add(name, got, ref, base, dtype, magnitude)
    if judge is None:
        checking.check()


def run_forward_backward(rng, dtype, shape, causal, deterministic, scale=None):
    import cupy

    batch, seqlen_q, seqlen_k, heads, head_dim = shape
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, batch, seqlen_q, seqlen_k, heads, head_dim))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    out, lse = cupyflash.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, deterministic=deterministic)
    for g, x in zip(grads, (q, k, v)):
        assert isinstance(g, cupy.ndarray) and g.dtype == x.dtype and g.shape == x.shape
    return (dout, q, k, v), grads


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim", AWKWARD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_awkward_shapes(rng, nan_outputs, dtype, seqlen_q, seqlen_k, head_dim, causal, deterministic):
    inputs, grads = run_forward_backward(rng, dtype, (2, seqlen_q, seqlen_k, 3, head_dim), causal, deterministic)
    assert_gradients_match_reference(*inputs, grads, dtype, causal)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_head_dim_class(rng, nan_outputs, dtype, head_dim, deterministic):
    inputs, grads = run_forward_backward(rng, dtype, (1, 130, 97, 2, head_dim), True, deterministic, scale=0.3)
    assert_gradients_match_reference(*inputs, grads, dtype, True, scale=0.3)


def assert_workspace_poisoned(allocated, rows, heads, head_dim, dtype):
    """The dQ workspace, (rows, heads, head_dim) in the accumulator type, came from the poisoned
    cupy.empty (so the test cannot pass on memory that happened to be zero): an allocation of its
    own, or the row statistics' one that ends with it (lse_log2 and D, each rounded to 256 bytes)."""
    accum = numpy.dtype(validation.lse_dtype(dtype))
    stats = -(-rows * heads * accum.itemsize // 256) * 256 // accum.itemsize
    shared = ((2 * stats + rows * heads * head_dim,), accum)
    assert ((rows, heads, head_dim), accum) in allocated or shared in allocated, f"no dQ workspace among {allocated}"


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 113, 203, 3, 64), (1, 1023, 1024, 2, 128), (2, 17, 300, 3, 40)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dq_workspace_is_cleared_by_the_backward(rng, nan_outputs, poisoned_empty, policy, dtype, shape, causal, tma):
    """The float32 dQ workspace is allocated uninitialised and cleared by the preprocess kernel
    (rows/bwd_rows.cu), on the Hopper TMA path and the atomic one (the same kernels elsewhere): here
    it starts as NaN, so a row the clear missed puts NaN into dq."""
    policy(tma=tma)
    inputs, grads = run_forward_backward(rng, dtype, shape, causal, deterministic=False)
    batch, seqlen_q, _, heads, head_dim = shape
    assert_workspace_poisoned(poisoned_empty, batch * seqlen_q, heads, head_dim, dtype)
    assert_gradients_match_reference(*inputs, grads, dtype, causal)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_deterministic_mode_is_bitwise_reproducible(rng, dtype):
    import cupy

    # Many key blocks per query block, so the atomic path's summation order really varies.
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 2, 700, 1500, 4, 64))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    first = cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=True)
    for _ in range(3):
        again = cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=True)
        for a, b in zip(first, again):
            assert bool((bits(a) == bits(b)).all())
    # The atomic path computes the same gradients up to summation order.
    fast = cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=False)
    assert_gradients_match_reference(dout, q, k, v, fast, dtype, False)
    for a, b in zip(first[1:], fast[1:]):  # dk and dv never use atomics: identical in both modes
        assert bool((bits(a) == bits(b)).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(rng, nan_outputs, dtype):
    import cupy

    b, s, h, d = 2, 150, 4, 72
    dt = numpy_dtype(dtype)
    q = cupy.asarray(rng.standard_normal((b, h, s, d)).astype(dt)).transpose(0, 2, 1, 3)
    kv = cupy.asarray(rng.standard_normal((b, 190, 2, h, d + 8)).astype(dt))
    k, v = kv[:, :, 0, :, :d], kv[:, :, 1, :, 8:]
    dout = cupy.asarray(rng.standard_normal((b, h, s, d)).astype(dt)).transpose(0, 2, 1, 3)
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    # out and lse as other layouts: out in a wider buffer, lse transposed (batch, seq, heads) storage.
    out_wide = cupy.zeros((b, s, h, d + 4), dtype=dt)
    out_wide[..., 2 : d + 2] = out
    lse_t = cupy.ascontiguousarray(lse.transpose(0, 2, 1)).transpose(0, 2, 1)
    args = (dout, q, k, v, out_wide[..., 2 : d + 2], lse_t)
    assert not any(x.flags.c_contiguous for x in args)
    before = [x.copy() for x in args]
    grads = cupyflash.attention_backward(*args, causal=True)
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, True)
    for x, x0 in zip(args, before):  # inputs untouched, bit for bit
        assert bool((bits(x) == bits(x0)).all())


def test_numpy_in_numpy_out(rng):
    q, k, v = random_qkv(rng, "float32", 2, 65, 33, 2, 24)
    dout = rng.standard_normal(q.shape).astype(numpy.float32)
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse)
    assert all(isinstance(g, numpy.ndarray) for g in grads)
    assert_gradients_match_reference(dout, q, k, v, grads, "float32", False)


def test_runs_on_the_current_stream(rng):
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float16", 1, 300, 300, 2, 64))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(numpy.float16))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = cupyflash.attention(q, k, v, return_lse=True)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse)
        stream.synchronize()
    assert_gradients_match_reference(dout, q, k, v, grads, "float16", False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_standard_attention_backward_baseline_is_correct(rng, dtype):
    import cupy

    from cupyflash.standard import standard_attention_forward_backward

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, dtype, 2, 97, 131, 3, 48))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    out, grads = standard_attention_forward_backward(q, k, v, dout, causal=True)
    assert out.dtype == q.dtype and all(g.dtype == q.dtype and g.shape == x.shape for g, x in zip(grads, (q, k, v)))
    assert_gradients_match_reference(dout, q, k, v, grads, dtype, True)


# --------------------------------------------------------------------------- PyTorch


def _torch_standard_attention(q, k, v, causal, scale=None):
    """Standard attention in torch ops, (batch, seq, heads, dim) layout, differentiable."""
    import torch

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, dim=-1).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_torch_adapter_gradients(rng, dtype, causal, deterministic, nan_torch_outputs):
    torch = pytest.importorskip("torch")
    import cupyflash.torch

    tdtype = getattr(torch, dtype)
    shape_q, shape_k = (2, 173, 3, 72), (2, 211, 3, 72)
    inputs = [torch.from_numpy(rng.standard_normal(s)).cuda().to(tdtype) for s in (shape_q, shape_k, shape_k)]
    dout = torch.from_numpy(rng.standard_normal(shape_q)).cuda().to(tdtype)

    def grads_of(fn, dt):
        xs = [x.detach().to(dt).clone().requires_grad_() for x in inputs]
        fn(*xs).backward(dout.to(dt))
        return [x.grad.double() for x in xs]

    ours = grads_of(lambda q, k, v: cupyflash.torch.attention(q, k, v, causal=causal, deterministic=deterministic), tdtype)
    exact = grads_of(lambda q, k, v: _torch_standard_attention(q, k, v, causal), torch.float64)  # autograd, float64
    lowp = grads_of(lambda q, k, v: _torch_standard_attention(q, k, v, causal), tdtype)  # autograd, same dtype
    for name, g, e, b in zip(("dq", "dk", "dv"), ours, exact, lowp):
        err = (g - e).abs().max().item()
        bound = reference.error_bound(e.cpu().numpy(), b.cpu().numpy(), dtype)
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"


def launched_pointers(monkeypatch) -> list:
    """The q, k, v (and dq) addresses in the parameters of each plan that launch.run queues, in
    order: what the kernels read and write, whatever path planned them."""
    seen = []
    real = launch.run

    def spy(made, stream=None):
        params = made.launches[-1].args[0]
        seen.append({name: int(params[name][0]) for name in ("q", "k", "v", "dq") if name in params.dtype.names})
        return real(made, stream)

    monkeypatch.setattr(launch, "run", spy)
    return seen


def test_torch_adapter_out_sum_backward_and_zero_copy(rng, monkeypatch):
    torch = pytest.importorskip("torch")
    import cupyflash.torch

    seen = launched_pointers(monkeypatch)
    q, k, v = (torch.randn(1, 64, 2, 32, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = cupyflash.torch.attention(q, k, v, causal=True)
    # out.sum()'s gradient reaches the backward as an expanded tensor with stride 0.
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    forward, backward = seen
    assert forward["q"] == backward["q"] == q.data_ptr() and backward["dq"] == grads[0].data_ptr()  # no copies
    assert_gradients_match_reference(torch.ones_like(out), q, k, v, grads, "float16", True)


def test_torch_adapter_reads_strided_views_in_place(rng, monkeypatch):
    """q a (batch, heads, seq, head_dim) tensor transposed, k and v views of one packed tensor: the
    kernels read them where they lie, forward and backward, and match autograd on standard attention."""
    torch = pytest.importorskip("torch")
    import cupyflash.torch

    seen = launched_pointers(monkeypatch)
    q0, kv0, dout = (torch.from_numpy(rng.standard_normal(s)).cuda().to(torch.bfloat16)
                     for s in ((2, 3, 150, 64), (2, 190, 2, 3, 64), (2, 150, 3, 64)))

    def grads_of(fn, dt):
        q = q0.to(dt).transpose(1, 2).requires_grad_()  # (batch, seq, heads, dim) view, not contiguous
        kv = kv0.to(dt).requires_grad_()
        k, v = kv.unbind(2)
        grads = torch.autograd.grad(fn(q, k, v), (q, kv), dout.to(dt))
        return (q, k, v), [g.double() for g in grads]

    (q, k, v), ours = grads_of(lambda q, k, v: cupyflash.torch.attention(q, k, v, causal=True), torch.bfloat16)
    assert [tuple(x[name] for name in "qkv") for x in seen] == [(q.data_ptr(), k.data_ptr(), v.data_ptr())] * 2
    exact = grads_of(lambda q, k, v: _torch_standard_attention(q, k, v, True), torch.float64)[1]
    lowp = grads_of(lambda q, k, v: _torch_standard_attention(q, k, v, True), torch.bfloat16)[1]
    for name, g, e, b in zip(("dq", "dkv"), ours, exact, lowp):
        assert_within_rule(name, g, e, b, "bfloat16")


def test_torch_adapter_on_a_side_stream(rng):
    torch = pytest.importorskip("torch")
    import cupyflash.torch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # inputs, forward and backward all on the side stream
        q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", requires_grad=True) for _ in range(3))
        out = cupyflash.torch.attention(q, k, v)
        out.backward(torch.ones_like(out))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert_gradients_match_reference(torch.ones_like(out), q, k, v, (q.grad, k.grad, v.grad), "float32", False)


class _TinyModel:
    """Two pre-norm attention layers with output projections, then a linear readout."""

    def __init__(self, torch, attention, dim=64, heads=4, seed=0, dtype=None):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.torch, self.attention, self.heads = torch, attention, heads
        params = [
            (torch.randn(dim, 3 * dim, device="cuda", generator=gen) / dim**0.5),
            (torch.randn(dim, dim, device="cuda", generator=gen) / dim**0.5),
            (torch.randn(dim, 3 * dim, device="cuda", generator=gen) / dim**0.5),
            (torch.randn(dim, dim, device="cuda", generator=gen) / dim**0.5),
            (torch.randn(dim, 1, device="cuda", generator=gen) / dim**0.5),
        ]
        self.params = [p.to(dtype or p.dtype).requires_grad_() for p in params]

    def __call__(self, x):
        torch = self.torch
        b, s, dim = x.shape
        for w_qkv, w_o in (self.params[0:2], self.params[2:4]):
            h = torch.nn.functional.layer_norm(x, (dim,))
            q, k, v = (h @ w_qkv).reshape(b, s, 3, self.heads, dim // self.heads).unbind(2)
            x = x + self.attention(q, k, v).reshape(b, s, dim) @ w_o
        return (x @ self.params[4]).squeeze(-1)


def test_tiny_model_trains_the_same_through_the_torch_adapter(rng):
    """50 Adam steps of a float32 model: its loss curve through cupyflash against the same model in
    float64 (standard attention), by the rule, the baseline standard attention in float32."""
    torch = pytest.importorskip("torch")
    import cupyflash.torch

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8, 100, 64, device="cuda", generator=gen)
    y = torch.randn(8, 100, device="cuda", generator=gen)
    curves = {}
    for name, attention, dtype in (
        ("cupyflash", lambda q, k, v: cupyflash.torch.attention(q, k, v, causal=True), torch.float32),
        ("standard", lambda q, k, v: _torch_standard_attention(q, k, v, True), torch.float32),
        ("exact", lambda q, k, v: _torch_standard_attention(q, k, v, True), torch.float64),
    ):
        model = _TinyModel(torch, attention, dtype=dtype)
        opt = torch.optim.Adam(model.params, lr=3e-3)
        losses = []
        for _ in range(50):
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[name] = numpy.array(losses)
    assert curves["exact"][-1] < 0.8 * curves["exact"][0], "the model did not learn"
    assert_within_rule("loss", curves["cupyflash"], curves["exact"], curves["standard"], "float32")


# --------------------------------------------------------------------------- JAX


def _jnp_attention(q, k, v, causal):
    import jax

    jnp = jax.numpy
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = jnp.where(jnp.arange(sk)[None, :] > jnp.arange(sq)[:, None] + sk - sq, -jnp.inf, s)
    p = jax.nn.softmax(s.astype(jnp.float32) if s.dtype.itemsize == 2 else s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(q.dtype), v)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_jax_adapter_gradients(rng, dtype, jit, jax_gpu):
    jax = jax_gpu
    jnp = jax.numpy
    import cupyflash.jax

    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype=dtype) for s in ((2, 90, 3, 40), (2, 120, 3, 40), (2, 120, 3, 40)))
    dout = jnp.asarray(rng.standard_normal(q.shape), dtype=dtype)

    def vjp(fn):
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(dout)

    ours = lambda q, k, v: cupyflash.jax.attention(q, k, v, causal=True)
    out, grads = vjp(jax.jit(ours) if jit else ours)
    assert isinstance(out, jax.Array) and out.dtype == q.dtype and all(g.dtype == q.dtype for g in grads)
    as64 = [numpy.asarray(x.astype(jnp.float32)).astype(numpy.float64) for x in (dout, q, k, v)]
    exact = reference.attention_backward(*as64, causal=True)
    # jax.grad of the jnp reference in the same dtype is the same-precision baseline.
    _, jax_grads = vjp(lambda q, k, v: _jnp_attention(q, k, v, True))
    for name, g, j, e in zip(("dq", "dk", "dv"), grads, jax_grads, exact):
        g, j = (numpy.asarray(x.astype(jnp.float32)).astype(numpy.float64) for x in (g, j))
        err = numpy.abs(g - e).max()
        bound = reference.error_bound(e, j, dtype)
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"
