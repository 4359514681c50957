"""The cache of prepared calls (api/prepared.py): a call whose signature was prepared launches from
it, and any property the checks or the planner read (a stride, a dtype, an option, the policy)
makes another signature; a full cache drops its oldest; bad input on a new signature is still
refused before any launch. The results are judged against float64 on every call."""

import numpy
import pytest

import cupyflash
from cupyflash.api import common, prepared
from cupyflash.problem import Options
from cupyflash.dispatch import policy as policies
from shapes import random_qkv
from test_attention_gpu import assert_matches_reference

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    monkeypatch.setattr(prepared, "PREPARED", {})


def check(q, k, v, out, causal=False, **options):
    assert_matches_reference(q, k, v, out, None, str(q.dtype), causal, **options)


def test_each_property_of_a_call_is_its_own_signature(rng):
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float16", 2, 113, 203, 4, 64))
    calls = [
        ((q, k, v), dict(causal=True)),
        ((q, k, v), dict(causal=True)),  # the same signature: launched from the prepared call
        ((q, k, v), dict(causal=False)),
        ((q.astype(cupy.float32), k.astype(cupy.float32), v.astype(cupy.float32)), dict(causal=True)),
        ((cupy.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3), k, v), dict(causal=True)),
        ((q[:, 1:], k, v), dict(causal=True)),  # a shape, and an address no longer 16-byte aligned
        ((q, k, v), dict(causal=True, window=(17, 0))),
    ]
    sizes = []
    for arrays, options in calls:
        check(*arrays, cupyflash.attention(*arrays, **options), **options)
        sizes.append(len(prepared.PREPARED))
    assert sizes == [1, 1, 2, 3, 4, 5, 6]


def test_a_changed_policy_prepares_again(rng):
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "bfloat16", 1, 256, 256, 2, 64))
    cupyflash.attention(q, k, v, causal=True)
    (entry,) = prepared.PREPARED.values()
    with policies.override(tma=False):
        check(q, k, v, cupyflash.attention(q, k, v, causal=True), causal=True)
        (again,) = prepared.PREPARED.values()
    assert again is not entry and again.policy is not entry.policy


def test_a_full_cache_drops_its_oldest(rng, monkeypatch):
    monkeypatch.setattr(prepared, "PREPARED_KEPT", 2)
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float16", 1, 64, 64, 2, 40))
    for scale in (0.1, 0.2, 0.3):
        check(q, k, v, cupyflash.attention(q, k, v, scale=scale), scale=scale)
    assert len(prepared.PREPARED) == 2
    assert [key[-1][2:4] for key in prepared.PREPARED] == [(float, 0.2), (float, 0.3)]  # (type, scale)


def test_bad_input_is_refused_after_its_good_twin_was_prepared(rng):
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float16", 1, 64, 64, 2, 64))
    cupyflash.attention(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal"):
        cupyflash.attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="scale"):
        cupyflash.attention(q, k, v, causal=True, scale=-1.0)


def test_the_backward_is_prepared_and_matches_the_full_path(rng):
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float16", 2, 203, 113, 4, 59))
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    dout = cupy.asarray(rng.standard_normal(out.shape).astype(numpy.float16))
    first = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    again = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    assert len(prepared.PREPARED) == 2  # the forward's and the backward's
    full = common.backward_call(dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse),
                                              Options(causal=True, deterministic=True))
    for a, b, c in zip(first, again, full):
        assert cupy.array_equal(a.view(cupy.uint16), b.view(cupy.uint16))
        assert cupy.array_equal(a.view(cupy.uint16), c.view(cupy.uint16))


def test_torch_operators_share_the_cache(rng):
    torch = pytest.importorskip("torch")
    import cupyflash.torch as adapter

    q, k, v = (torch.randn(2, 113, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    for _ in range(2):
        out = adapter.attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
    kinds = sorted(key[0] for key in prepared.PREPARED)
    assert kinds == ["torch backward", "torch forward"]
    strided = torch.randn(2, 4, 113, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    adapter.attention(strided, k.detach(), v.detach(), causal=True)
    assert len(prepared.PREPARED) == 3
    got = adapter.attention(strided, k.detach(), v.detach(), causal=True)
    assert_matches_reference(strided, k, v, got, None, "float16", True)


def test_torch_varlen_calls_are_prepared_by_their_lengths(rng):
    """A packed batch's calls with the same lengths launch from one prepared call (its lengths'
    values are part of the signature); other lengths prepare another. Both match the full path."""
    torch = pytest.importorskip("torch")
    import cupyflash.torch as adapter

    q, k, v = (torch.randn(203, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    firsts = []
    for lengths in ([0, 17, 130, 203], [0, 17, 130, 203], [0, 100, 203]):
        cu = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        out = adapter.attention_varlen(q, k, v, cu, cu, causal=True, deterministic=True)
        out.backward(torch.ones_like(out))
        firsts.append((out.detach().clone(), q.grad.clone()))
        q.grad = k.grad = v.grad = None
    kinds = sorted(key[0] for key in prepared.PREPARED)
    assert kinds == ["torch varlen backward"] * 2 + ["torch varlen forward"] * 2
    for a, b in zip(firsts[0], firsts[1]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    full = cupyflash.attention_varlen(q.detach(), k.detach(), v.detach(), cu, cu, causal=True)
    assert torch.equal(firsts[2][0].view(torch.int16), full.view(torch.int16))


def test_torch_dropout_calls_are_prepared_with_their_own_seeds(rng):
    """Dropout's probability is part of the signature, its seed and offset each call's own: one
    prepared call serves them all, the same seed and offset give the same output, others another,
    each equal to the full path's bit for bit."""
    torch = pytest.importorskip("torch")
    import cupyflash.torch as adapter

    q, k, v = (torch.randn(2, 113, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    outs = [adapter.attention(q, k, v, causal=True, dropout_p=0.2, seed=seed, offset=offset)
            for seed, offset in ((1, 0), (1, 0), (2, 0), (1, 4))]
    assert [key[0] for key in prepared.PREPARED] == ["torch forward"]
    bits = [x.view(torch.int16) for x in outs]
    assert torch.equal(bits[0], bits[1]) and not torch.equal(bits[0], bits[2]) and not torch.equal(bits[0], bits[3])
    for out, (seed, offset) in zip(outs[2:], ((2, 0), (1, 4))):
        full = cupyflash.attention(q, k, v, causal=True, dropout_p=0.2, seed=seed, offset=offset)
        assert torch.equal(out.view(torch.int16), full.view(torch.int16))


def test_torch_decoding_steps_are_prepared(rng):
    """The decode operator's steps with GPU lengths launch from one prepared call, which appends the
    new keys as the full path does, and match it bit for bit; new lengths' values need no new one."""
    torch = pytest.importorskip("torch")
    import cupyflash.torch as adapter

    def caches():
        generator = torch.Generator(device="cuda").manual_seed(5)
        return [torch.randn((3, 1024, 2, 128), device="cuda", dtype=torch.bfloat16, generator=generator)
                for _ in range(2)]

    q, k_new, v_new = (torch.randn(s, device="cuda", dtype=torch.bfloat16)
                       for s in ((3, 1, 8, 128), (3, 1, 2, 128), (3, 1, 2, 128)))
    ours, theirs = caches(), caches()
    for lengths in ([1000, 17, 512], [1001, 18, 513]):
        cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        got = adapter.attention_decode(q, *ours, cache_seqlens, k_new=k_new, v_new=v_new, causal=True)
        want = cupyflash.attention_decode(q, *theirs, cache_seqlens, k_new=k_new, v_new=v_new, causal=True)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert [key[0] for key in prepared.PREPARED] == ["torch decode"]
    for a, b in zip(ours, theirs):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # the appends
