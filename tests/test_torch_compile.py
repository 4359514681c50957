"""cupyflash's torch entry points as torch.library operators: `torch.library.opcheck` on each
operator, `torch.compile(fullgraph=True)` through attention, varlen, the SDPA entry and
`cupyflash.flash_attn` with no graph break, a dynamic sequence length compiled once, dropout's
seed drawn inside the operator. CPU tensors take the NumPy path; the CUDA cases carry `gpu`."""

import numpy
import pytest

torch = pytest.importorskip("torch")
import cupyflash.flash_attn  # noqa: E402
import cupyflash.torch  # noqa: E402
from cupyflash.frameworks import torch as adapter  # noqa: E402
from test_attention_gpu import assert_matches_reference  # noqa: E402
from test_backward_gpu import assert_gradients_match_reference  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
OPTIONS = [{}, {"causal": True}, {"window": (5, None), "softcap": 3.0}, {"dropout_p": 0.2, "seed": 7},
           {"causal": True, "scale": 0.3, "deterministic": True}]


@pytest.fixture(params=DEVICES)
def device(request, rng):
    torch.manual_seed(int(rng.integers(2**31)))
    torch._dynamo.reset()
    return request.param


def dtypes(device):
    return (torch.float32, torch.float64) if device == "cpu" else (torch.bfloat16, torch.float32)


def operator_args(q, k, v, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0,
                  seed=None, offset=0, deterministic=False):
    args = adapter._operator_args(q, k, v, causal, scale, window, softcap, alibi_slopes, dropout_p, seed, offset,
                                  deterministic)
    assert args is not None, "the operator does not carry these options"
    return args


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_opcheck_dense(device, options):
    for dtype in dtypes(device):
        q = torch.randn(2, 17, 4, 40, dtype=dtype, device=device)
        k, v = (torch.randn(2, 23, 2, 40, dtype=dtype, device=device) for _ in range(2))
        args = operator_args(q, k, v, **options)
        torch.library.opcheck(adapter._attention_forward, args)
        out, lse, rng_state = adapter._attention_forward(*args)
        # (opcheck compares repeated runs: on CUDA only deterministic gradients repeat their bits)
        backward = (torch.randn_like(out), q, k, v, out, lse, *args[3:11], rng_state, args[13] or device == "cuda")
        torch.library.opcheck(adapter._attention_backward, backward)


def test_opcheck_strided_views(device):
    """q, k, v views of one packed tensor, and a (batch, heads, seq, dim) tensor transposed: the
    results' layouts are the ones the fake implementations give."""
    packed = torch.randn(2, 17, 3, 4, 32, device=device)
    transposed = torch.randn(2, 4, 17, 32, device=device).transpose(1, 2)
    for q, k, v in ((packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]), (transposed,) * 3):
        args = operator_args(q, k, v, causal=True)
        torch.library.opcheck(adapter._attention_forward, args)
        out, lse, rng_state = adapter._attention_forward(*args)
        torch.library.opcheck(adapter._attention_backward,
                              (torch.randn_like(out), q, k, v, out, lse, *args[3:11], rng_state, device == "cuda"))


def test_opcheck_varlen(device):
    cu_q = torch.tensor([0, 5, 5, 38], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 7, 9, 42], dtype=torch.int32, device=device)
    q = torch.randn(38, 4, 32, device=device)
    k, v = (torch.randn(42, 2, 32, device=device) for _ in range(2))
    dense = operator_args(q, k, v, causal=True, deterministic=device == "cuda")
    for lengths in ((cu_q, cu_k, None, None), (cu_q, cu_k, 33, 33)):
        args = (*dense[:3], *lengths, *dense[3:-1])  # (the dense operators' seqlens_k last)
        torch.library.opcheck(adapter._attention_varlen_forward, args)
        out, lse = adapter._attention_varlen_forward(*args)
        torch.library.opcheck(adapter._attention_varlen_backward, (torch.randn_like(out), q, k, v, out, lse, *args[3:]))


def compiled_equals_eager(fn, *inputs):
    """fn compiled whole (no graph break) gives eager's result and gradients, bit for bit (the
    calls below ask for deterministic gradients, which CUDA's dq atomics otherwise are not)."""
    assert torch._dynamo.explain(fn)(*inputs).graph_break_count == 0
    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        out = run(*xs)
        out.backward(torch.ones_like(out))
        results.append([out.detach()] + [x.grad for x in xs])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_compile_attention_sdpa_flash_attn_and_varlen(device):
    q = torch.randn(2, 17, 4, 32, device=device)
    k, v = (torch.randn(2, 23, 2, 32, device=device) for _ in range(2))
    compiled_equals_eager(lambda q, k, v: cupyflash.torch.attention(q, k, v, causal=True, window=(8, None),
                                                                    deterministic=True), q, k, v)
    compiled_equals_eager(lambda q, k, v: cupyflash.flash_attn.flash_attn_func(q, k, v, causal=True,
                                                                               deterministic=True), q, k, v)
    cu_q = torch.tensor([0, 5, 17], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 7, 23], dtype=torch.int32, device=device)
    compiled_equals_eager(lambda q, k, v: cupyflash.torch.attention_varlen(q, k, v, cu_q, cu_k, causal=True,
                                                                           deterministic=True), q[0], k[0], v[0])
    # SDPA's signature has no deterministic flag: its compiled gradients are judged by the rule.
    sdpa = torch.compile(lambda q, k, v: cupyflash.torch.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True), fullgraph=True, backend="aot_eager")
    q, k, v = (x[:, :17].detach().requires_grad_() for x in (q, k, v))  # is_causal: equal lengths
    out = sdpa(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert_gradients_match_reference(dout, q, k, v, (q.grad, k.grad, v.grad), "float32", True)


def test_opcheck_and_compile_key_padding(device):
    """seqlens_k through the dense operators: opcheck (forward, backward), a compiled call with no
    graph break equal to eager's, and the same results as each batch entry cut to its keys."""
    q = torch.randn(3, 17, 4, 32, device=device)
    k, v = (torch.randn(3, 23, 2, 32, device=device) for _ in range(2))
    lengths = torch.tensor([23, 0, 9], dtype=torch.int32, device=device)
    args = operator_args(q, k, v, deterministic=device == "cuda")[:-1] + (lengths,)
    torch.library.opcheck(adapter._attention_forward, args)
    out, lse, rng_state = adapter._attention_forward(*args)
    torch.library.opcheck(adapter._attention_backward,
                          (torch.randn_like(out), q, k, v, out, lse, *args[3:11], rng_state, args[13], lengths))
    compiled_equals_eager(lambda q, k, v: cupyflash.torch.attention(q, k, v, seqlens_k=lengths, deterministic=True),
                          q, k, v)
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = cupyflash.torch.attention(*xs, seqlens_k=lengths)
    out.backward(torch.ones_like(out))
    for b, n in enumerate(lengths.tolist()):
        qb, kb, vb = (x.detach()[b:b + 1, :m].clone().requires_grad_() for x, m in zip(xs, (17, n, n)))
        want = cupyflash.torch.attention(qb, kb, vb) if n else torch.zeros_like(qb)
        torch.testing.assert_close(out[b:b + 1].detach(), want.detach(), atol=2e-6, rtol=0)
        if n:
            want.backward(torch.ones_like(want))
            for x, w, m in zip(xs, (qb, kb, vb), (17, n, n)):
                torch.testing.assert_close(x.grad[b:b + 1, :m], w.grad, atol=2e-5, rtol=0)
        for x in xs[1:]:
            assert torch.count_nonzero(x.grad[b, n:]) == 0  # padding keys get no gradient


def test_a_dynamic_sequence_length_compiles_once(device):
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda q, k, v: cupyflash.torch.attention(q, k, v, causal=True), backend=counter,
                         fullgraph=True)
    for seqlen in (17, 33, 64, 129):
        q, k, v = (torch.randn(2, seqlen, 4, 32, device=device, requires_grad=True) for _ in range(3))
        for x in (q, k, v):
            torch._dynamo.mark_dynamic(x, 1)
        step(q, k, v).sum().backward()
        assert q.grad.shape == q.shape
    assert counter.frame_count == 1


def test_compiled_dropout_draws_its_seed_in_the_operator(device, rng):
    """With dropout and no seed, the seed comes from torch's generator inside the forward operator
    (no graph break), and the backward drops the same entries the forward did."""
    seed = int(rng.integers(2**31))
    q, k, v = (torch.randn(1, 19, 2, 16, dtype=torch.float64 if device == "cpu" else torch.float32, device=device,
                           requires_grad=True) for _ in range(3))
    fn = torch.compile(lambda q, k, v: cupyflash.torch.attention(q, k, v, dropout_p=0.3, return_lse=True),
                       fullgraph=True, backend="aot_eager")
    torch.manual_seed(seed)  # (the CUDA generator's too: torch.manual_seed seeds every device)
    out, lse = fn(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    torch.manual_seed(seed)  # (the CUDA generator's too: torch.manual_seed seeds every device)
    seed, offset = adapter.dropout_seed(0.3, None, 0, q)
    options = {"dropout_p": 0.3, "seed": seed, "offset": offset}
    dtype = "float64" if device == "cpu" else "float32"
    assert_matches_reference(q, k, v, out, lse, dtype, False, **options)
    assert_gradients_match_reference(dout, q, k, v, (q.grad, k.grad, v.grad), dtype, False, **options)


def test_calls_the_operators_cannot_carry_still_run_and_fail_as_before(device):
    """A BlockMask, slopes given as a NumPy array: the autograd.Function path; a wrong option: the
    checks' message, not the dispatcher's."""
    q, k, v = (torch.randn(1, 256, 2, 32, device=device, requires_grad=True) for _ in range(3))
    mask = cupyflash.BlockMask.causal(256, 256, block_size=(128, 128))

    def sparse(q, k, v):
        return cupyflash.torch.attention(q, k, v, block_mask=mask, deterministic=True)

    sparse(q, k, v).sum().backward()
    eager = [x.grad for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    torch.compile(sparse, backend="aot_eager")(q, k, v).sum().backward()  # outside the graph, with autograd
    for got, want in zip((q.grad, k.grad, v.grad), eager):
        assert torch.equal(got, want)
    out = cupyflash.torch.attention(q, k, v, alibi_slopes=numpy.array([0.5, 0.25], numpy.float32))
    assert out.shape == q.shape
    with pytest.raises(TypeError, match="causal"):
        cupyflash.torch.attention(q, k, v, causal="yes")
    assert adapter._operator_args(q, k, v, False, None, None, None, None, 0.1, 2**63, 0, False) is None


def test_decode_operator_and_a_compiled_decoding_step(device):
    """The decode operator declares its writes to the caches (opcheck checks it); a compiled
    decoding step appends and attends as the eager one does, with no graph break."""
    q = torch.randn(2, 1, 4, 32, device=device)
    k_cache, v_cache = (torch.randn(2, 40, 2, 32, device=device) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 32, device=device) for _ in range(2))
    lengths = torch.tensor([3, 39], dtype=torch.int32, device=device)
    torch.library.opcheck(adapter._attention_decode, (q, k_cache.clone(), v_cache.clone(), lengths, k_new, v_new, True,
                                                      None, False, None, None, None, None, None))

    def step(q, k_cache, v_cache, lengths, k_new, v_new):
        return cupyflash.torch.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, causal=True,
                                                return_lse=True)

    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    assert torch._dynamo.explain(step)(q, *caches[0], lengths, k_new, v_new).graph_break_count == 0
    eager = step(q, *caches[0], lengths, k_new, v_new)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *caches[1], lengths, k_new, v_new)
    for a, b in zip((*eager, *caches[0]), (*compiled, *caches[1])):
        assert torch.equal(a, b)
    assert torch.equal(caches[1][0][0, 3], k_new[0, 0]) and torch.equal(caches[1][1][1, 39], v_new[1, 0])
    with_kvcache = torch.compile(
        lambda q, kc, vc, n: cupyflash.flash_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n),
        fullgraph=True, backend="aot_eager")
    assert torch.equal(with_kvcache(q, *caches[1], lengths + 1), eager[0])
