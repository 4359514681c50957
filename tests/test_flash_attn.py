"""cupyflash.flash_attn against flash-attn's documented semantics, and cupyflash.torch's
scaled_dot_product_attention against torch's: argument meanings, layouts, return values, the
one-sided window rule, packed inputs' gradients, the kvcache append, dropout's S_dmask and seed.

Each test runs on CPU tensors (cupyflash's host path, float64) and on CUDA tensors (bfloat16,
marker `gpu`), against a float64 reference written here with torch ops; 16-bit results must be
within 2x the error of the same reference computed in bfloat16, plus 1e-4."""

import math

import numpy
import pytest

torch = pytest.importorskip("torch")
flash_attn = pytest.importorskip("cupyflash.flash_attn")
import cupyflash  # noqa: E402
import cupyflash.torch  # noqa: E402
from cupyflash.frameworks.flash_attn import _flash_block_n  # noqa: E402

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def on(request, rng):
    """(device, dtype, make): make(*shape) gives a fresh random tensor there, requiring grad."""
    device = request.param
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    torch.manual_seed(int(rng.integers(2**31)))

    def make(*shape, grad=True):
        return torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_(grad)
    return device, dtype, make


def reference(q, k, v, visible, *, scale=None, softcap=0.0, alibi=None, keep=None, dropout_p=0.0,
              dtype=torch.float64):
    """Attention in torch ops at `dtype` (softmax in float32 at least): q (b, sq, h, d), k, v
    (b, sk, hk, d), visible (b or 1, sq, sk) boolean. Returns out and lse (b, h, sq)."""
    heads = q.shape[2]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    k, v = (x.repeat_interleave(heads // x.shape[2], dim=2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    s = s.double() if dtype == torch.float64 else s.float()
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[1], k.shape[1]
    if alibi is not None:
        position = torch.arange(sq, device=q.device)[:, None] + sk - sq
        s = s - alibi.to(s.dtype)[None, :, None, None] * (position - torch.arange(sk, device=q.device)).abs()
    s = s.masked_fill(~visible[:, None].to(q.device), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if keep is not None:
        p = p * keep.to(p.device) / (1 - dropout_p)
    return torch.einsum("bhij,bjhd->bihd", p.to(dtype), v), lse


def band(sq, sk, left=None, right=None):
    """Keys j visible to query i under flash-attn's bottom-right band: i + sk - sq - left <= j <=
    i + sk - sq + right (None: unbounded)."""
    position = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right is not None:
        visible &= j <= position + right
    if left is not None:
        visible &= j >= position - left
    return visible[None]


def assert_close(got, exact, lowp, what):
    """The project's rule (`reference.error_bound`): twice the same computation's error in the
    input precision, plus a noise floor of one unit in the last place of a 16-bit result."""
    error, bound = (got.double() - exact).abs().max().item(), 2 * (lowp.double() - exact).abs().max().item()
    name = str(got.dtype).removeprefix("torch.")
    bound += reference_floor(name) * max(1.0, exact.abs().max().item() if exact.numel() else 0.0)
    assert error <= bound, f"{what}: max error {error:.3g} over {bound:.3g}"


def reference_floor(dtype_name):
    return cupyflash.reference.noise_floor(dtype_name) if dtype_name != "float64" else 1e-12


def check(ours, call_reference, inputs, dout, what=""):
    """ours: (out, lse or None) with out differentiable in inputs; call_reference(dtype) -> (out, lse)."""
    out, lse = ours
    exact, lowp = call_reference(torch.float64), call_reference(inputs[0].dtype)
    assert_close(out, exact[0], lowp[0], f"{what} out")
    if lse is not None:
        finite = exact[1].isfinite()
        assert torch.equal(lse.isfinite(), finite), f"{what} lse: -inf in other rows"
        assert_close(lse[finite].float(), exact[1][finite], lowp[1][finite].float(), f"{what} lse")
    grads = torch.autograd.grad(out, inputs, dout)
    exact_grads = torch.autograd.grad(exact[0], inputs, dout)
    lowp_grads = torch.autograd.grad(lowp[0], inputs, dout)
    for name, g, e, lw in zip("qkv", grads, exact_grads, lowp_grads):
        assert_close(g, e, lw, f"{what} d{name}")


CASES = [  # batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, causal, window, softcap, alibi
    (2, 113, 203, 4, 2, 40, False, (-1, -1), 0.0, False),
    (1, 203, 113, 2, 2, 64, True, (-1, -1), 0.0, False),
    (2, 17, 130, 4, 1, 59, True, (30, 5), 0.0, False),
    (1, 128, 128, 2, 2, 128, False, (17, 9), 20.0, True),
    (3, 1, 65, 2, 2, 32, True, (-1, -1), 0.0, True),
]


@pytest.mark.parametrize("case", CASES)
def test_flash_attn_func_matches_the_reference(on, case):
    device, dtype, make = on
    b, sq, sk, h, hk, d, causal, window, softcap, alibi = case
    q, k, v = make(b, sq, h, d), make(b, sk, hk, d), make(b, sk, hk, d)
    slopes = torch.rand(h, dtype=torch.float32, device=device) if alibi else None
    window_size = torch.tensor(window)  # as flash-attn's tests pass it: 0-d tensors
    out, lse, probs = flash_attn.flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                                 alibi_slopes=slopes, return_attn_probs=True)
    assert probs is None and lse.shape == (b, h, sq) and out.shape == q.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    left, right = (None if w < 0 else w for w in window)
    visible = band(sq, sk, left, 0 if causal else right)
    check((out, lse), lambda dt: reference(q, k, v, visible, softcap=softcap, alibi=slopes, dtype=dt),
          (q, k, v), torch.randn_like(out))


def test_one_sided_window_extends_to_seqlen_k(on):
    """flash-attn reads window_size=(left, -1) as (left, seqlen_k): with seqlen_q > seqlen_k + 1
    the first queries see fewer keys than an unbounded right side would give them."""
    device, dtype, make = on
    q, k, v = make(1, 6, 2, 16), make(1, 2, 2, 16), make(1, 2, 2, 16)
    visible = torch.tensor([[0, 0], [0, 0], [1, 0], [1, 1], [1, 1], [0, 1]], dtype=torch.bool)[None]
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, window_size=(0, -1), return_attn_probs=True)
    check((out, lse), lambda dt: reference(q, k, v, visible, dtype=dt), (q, k, v), torch.randn_like(out))
    # The left side's -1 becomes seqlen_k too, which bounds nothing; a side >= seqlen_k is unbounded.
    for window, visible in (((-1, 0), band(6, 2, None, 0)), ((5, 2), band(6, 2)),
                            ((1, 9), band(6, 2, 1, 2))):
        out, lse, _ = flash_attn.flash_attn_func(q, k, v, window_size=window, return_attn_probs=True)
        exact = reference(q, k, v, visible)
        assert_close(out, exact[0], reference(q, k, v, visible, dtype=dtype)[0], f"window {window}")


def test_packed_inputs_give_the_unpacked_results_and_gradients(on):
    device, dtype, make = on
    qkv, q, kv = make(2, 77, 3, 4, 32), make(2, 50, 4, 32), make(2, 77, 2, 2, 32)
    dout = torch.randn(2, 77, 4, 32, device=device, dtype=dtype)
    out = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True)
    separate = [qkv[:, :, i].detach().clone().requires_grad_() for i in range(3)]
    want = flash_attn.flash_attn_func(*separate, causal=True)
    assert torch.equal(out, want)
    (grad,) = torch.autograd.grad(out, qkv, dout)
    assert grad.shape == qkv.shape
    assert torch.equal(grad, torch.stack(torch.autograd.grad(want, separate, dout), dim=2))
    out = flash_attn.flash_attn_kvpacked_func(q, kv, window_size=(10, 3))
    k, v = (kv[:, :, i].detach().clone().requires_grad_() for i in range(2))
    want = flash_attn.flash_attn_func(q, k, v, window_size=(10, 3))
    assert torch.equal(out, want)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, kv, dout)
    assert torch.equal(grad, torch.stack(torch.autograd.grad(want, (k, v), dout), dim=2))


def packed_lengths(device):
    lengths_q, lengths_k = [17, 1, 0, 130], [40, 1, 33, 130]
    cu = [torch.tensor(numpy.cumsum([0] + x), dtype=torch.int32, device=device) for x in (lengths_q, lengths_k)]
    return lengths_q, lengths_k, cu


def test_varlen_func_is_flash_attn_func_per_sequence(on):
    device, dtype, make = on
    lengths_q, lengths_k, (cu_q, cu_k) = packed_lengths(device)
    q, k, v = make(sum(lengths_q), 4, 40), make(sum(lengths_k), 2, 40), make(sum(lengths_k), 2, 40)
    out, lse, probs = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                        causal=True, window_size=(20, 0), return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, sum(lengths_q)) and probs is None
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one, one_lse, _ = flash_attn.flash_attn_func(q[None, rows], k[None, keys], v[None, keys], causal=True,
                                                     window_size=(20, 0), return_attn_probs=True)
        exact = reference(q[None, rows], k[None, keys], v[None, keys], band(lengths_q[b], lengths_k[b], 20, 0))
        lowp = reference(q[None, rows], k[None, keys], v[None, keys], band(lengths_q[b], lengths_k[b], 20, 0),
                         dtype=dtype)
        if lengths_q[b]:  # (the varlen and fixed-length kernels may sum in other orders)
            assert_close(out[rows], exact[0][0], lowp[0][0], f"sequence {b}")
            assert_close(one[0], exact[0][0], lowp[0][0], f"sequence {b} alone")
            finite = exact[1][0].isfinite()
            assert torch.equal(lse[:, rows].isfinite(), finite)
            assert_close(lse[:, rows][finite].float(), exact[1][0][finite], lowp[1][0][finite].float(), f"lse {b}")
    qkv = make(sum(lengths_k), 3, 2, 40)
    packed = flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu_k, max(lengths_k), causal=True)
    assert torch.equal(packed, flash_attn.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_k, cu_k,
                                                                  max(lengths_k), max(lengths_k), causal=True))
    (grad,) = torch.autograd.grad(packed, qkv, torch.ones_like(packed))
    assert grad.shape == qkv.shape and grad.isfinite().all()
    kv = make(sum(lengths_k), 2, 2, 40)
    packed = flash_attn.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lengths_q), max(lengths_k))
    assert torch.equal(packed, flash_attn.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_q, cu_k, max(lengths_q),
                                                                  max(lengths_k)))


def test_attn_probs_encode_dropout_as_flash_attn_does(on):
    """S_dmask: (batch, heads, seqlen_q and seqlen_k rounded up to 128), negative where dropout
    dropped the element; FlashAttention-2's tests normalise it by exp(running block max - lse),
    which must give the probabilities back. The output is the reference's with that mask."""
    device, dtype, make = on
    b, sq, sk, h, d, p = 2, 70, 150, 2, 64, 11 / 64  # (dropout_p acts at 2^-32 resolution)
    q, k, v = make(b, sq, h, d), make(b, sk, h, d), make(b, sk, h, d)
    out, lse, s_dmask = flash_attn.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    assert s_dmask.shape == (b, h, 128, 256) and s_dmask.dtype == dtype
    s = s_dmask[:, :, :sq, :sk]
    keep = s >= 0
    visible = band(sq, sk, None, 0)
    exact = reference(q, k, v, visible, keep=keep, dropout_p=p)
    assert_close(out, exact[0], reference(q, k, v, visible, keep=keep, dropout_p=p, dtype=dtype)[0], "out")
    fraction = 1 - keep[visible[:, None].expand_as(keep).to(keep.device)].float().mean().item()
    assert abs(fraction - p) < 0.02
    scores = (torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * d ** -0.5).masked_fill(
        ~visible[:, None].to(device), -math.inf)
    width = _flash_block_n(q.device, d)
    block_max = torch.stack([x.amax(-1) for x in scores.split(width, dim=-1)], dim=-1)
    running = block_max.flip(-1).cummax(-1).values.flip(-1).repeat_interleave(width, dim=-1)[..., :sk]
    probabilities = s.abs().double() * torch.exp(running - lse.double()[..., None])
    want = torch.softmax(scores, dim=-1)
    assert (probabilities - want).abs().max().item() < (1e-9 if dtype == torch.float64 else 1e-2)


@pytest.mark.gpu
def test_dropout_seed_comes_from_the_cuda_generator():
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    torch.cuda.manual_seed(11)
    first = [flash_attn.flash_attn_func(q, q, q, dropout_p=0.3) for _ in range(2)]
    torch.cuda.manual_seed(11)
    again = [flash_attn.flash_attn_func(q, q, q, dropout_p=0.3) for _ in range(2)]
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], first[1])


def test_with_kvcache_appends_in_place_and_attends(on):
    device, dtype, make = on
    b, cache_len, h, hk, d, new = 3, 90, 4, 2, 48, 2
    k_cache, v_cache = make(b, cache_len, hk, d, grad=False), make(b, cache_len, hk, d, grad=False)
    q, k, v = make(b, new, h, d, grad=False), make(b, new, hk, d, grad=False), make(b, new, hk, d, grad=False)
    lengths = torch.tensor([5, 0, 60], dtype=torch.int32, device=device)
    before = k_cache.clone()
    out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                                  num_splits=0, return_softmax_lse=True)
    assert lse.shape == (b, h, new)
    for i, n in enumerate(lengths.tolist()):
        assert torch.equal(k_cache[i, n : n + new], k[i]) and torch.equal(k_cache[i, :n], before[i, :n])
        keys = slice(0, n + new)
        exact = reference(q[i : i + 1], k_cache[i : i + 1, keys], v_cache[i : i + 1, keys], band(new, n + new, None, 0))
        lowp = reference(q[i : i + 1], k_cache[i : i + 1, keys], v_cache[i : i + 1, keys],
                         band(new, n + new, None, 0), dtype=dtype)
        assert_close(out[i : i + 1], exact[0], lowp[0], f"sequence {i}")
    # cache_batch_idx: sequence i uses (and appends into) cache entry index[i].
    index = torch.tensor([2, 0], device=device)
    k_cache2, v_cache2 = k_cache.clone(), v_cache.clone()
    got = flash_attn.flash_attn_with_kvcache(q[:2], k_cache2, v_cache2, k[:2], v[:2], cache_seqlens=7,
                                             cache_batch_idx=index)
    assert torch.equal(k_cache2[2, 7 : 7 + new], k[0]) and torch.equal(k_cache2[0, 7 : 7 + new], k[1])
    assert torch.equal(k_cache2[1], k_cache[1])
    want = flash_attn.flash_attn_with_kvcache(q[:2], k_cache2[index], v_cache2[index], cache_seqlens=7 + new)
    assert torch.equal(got, want)
    for unsupported in ({"rotary_cos": q}, {"rotary_sin": q}, {"block_table": lengths}, {"cache_leftpad": lengths}):
        with pytest.raises(NotImplementedError, match=next(iter(unsupported)).split("_")[0]):
            flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, **unsupported)


def test_bad_arguments_raise_before_any_work(on):
    device, dtype, make = on
    q = make(1, 8, 2, 16)
    with pytest.raises(TypeError, match="window_size"):
        flash_attn.flash_attn_func(q, q, q, window_size=(1.5, 0))
    with pytest.raises(ValueError, match=r"qkv must be a tensor of shape \(batch, seqlen, 3, heads, head_dim\)"):
        flash_attn.flash_attn_qkvpacked_func(q)
    with pytest.raises(ValueError, match="k and v must be given together"):
        flash_attn.flash_attn_with_kvcache(q, q.detach(), q.detach(), k=q.detach())
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn.flash_attn_func(q, q, q, dropout_p=1.5)


@pytest.mark.parametrize("seqlens", [(40, 40), (25, 70), (70, 25), (1, 9)])
def test_sdpa_signature_and_top_left_causal(on, seqlens):
    device, dtype, make = on
    sq, sk = seqlens
    q, k, v = make(2, 4, sq, 32), make(2, 2, sk, 32), make(2, 2, sk, 32)
    out = cupyflash.torch.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    assert out.shape == q.shape
    visible = torch.ones(sq, sk, dtype=torch.bool).tril()[None]  # SDPA's is_causal: j <= i
    q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))  # the reference's (batch, seq, heads, dim)
    check((out.transpose(1, 2), None), lambda dt: reference(q_, k_, v_, visible, scale=0.3, dtype=dt), (q, k, v),
          torch.randn_like(out.transpose(1, 2)))


def test_sdpa_hands_what_it_cannot_take_to_torch(on):
    device, dtype, make = on
    q, k, v = make(1, 2, 9, 16), make(1, 2, 12, 16), make(1, 2, 12, 8)
    mask = torch.rand(9, 12, device=device) > 0.3
    mask[:, 0] = True
    for args, kwargs in (((q, k, k), {"attn_mask": mask}), ((q, k, v), {})):
        got = cupyflash.torch.scaled_dot_product_attention(*args, **kwargs)
        want = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
        assert torch.equal(got, want)
    three = cupyflash.torch.scaled_dot_product_attention(q[0], k[0], k[0], is_causal=True)
    assert torch.allclose(three, torch.nn.functional.scaled_dot_product_attention(q[0], k[0], k[0], is_causal=True),
                          atol=1e-2 if dtype == torch.bfloat16 else 1e-10)


def test_sdpa_swapped_in_for_torchs_hands_masked_calls_to_torchs_own(on, monkeypatch):
    """`torch.nn.functional.scaled_dot_product_attention = cupyflash.torch.scaled_dot_product_attention`,
    the usual swap: a masked call still reaches torch's own SDPA (it recursed without end)."""
    device, dtype, make = on
    q, k = make(1, 2, 9, 16), make(1, 2, 12, 16)
    mask = torch.rand(9, 12, device=device) > 0.3
    mask[:, 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        cupyflash.torch.scaled_dot_product_attention)
    assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask), want)
