"""CUDA graphs of the torch adapter's calls in torch's default capture mode ("global": while the
capture runs, no thread may make a CUDA call that could synchronise), forward and backward, for
each family: dense, GQA, windows, softcap, block-sparse, varlen with max_seqlen given, decoding,
dropout. A replay on new inputs equals an eager call on them bit for bit (deterministic=True;
dropout's replays each with the seed and offset it drew); a function compiled with
torch.compile(mode="reduce-overhead") equals eager."""

import numpy
import pytest

import cupyflash
from cupyflash.bench.host import captured

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
import cupyflash.torch  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def assert_replay_equals_eager(step, inputs, others=()):
    """Captures step, replays it on fresh values of inputs (and of `others`, tensors it reads
    without gradient), and compares every output with an eager step on the same values."""
    graph, static = captured(torch, step, inputs)
    with torch.no_grad():
        for x in (*inputs, *others):
            x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [x.clone() for x in static]
    for x in inputs:
        x.grad = None
    eager = step()
    for i, (a, b) in enumerate(zip(replayed, eager)):
        assert a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16)), f"output {i}"


def tensors(*shapes, grad=True):
    return [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for s in shapes]


FAMILIES = {
    "dense": dict(causal=True),
    "gqa": dict(causal=True),
    "window": dict(window=(33, 0)),
    "softcap": dict(causal=True, softcap=5.0),
    "block-sparse": dict(block_mask=cupyflash.BlockMask(numpy.array([[[1, 0], [1, 1]]] * 4, bool))),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_replays_as_eager(family):
    heads_kv = 2 if family == "gqa" else 4
    q, k, v = tensors((2, 200, 4, 64), (2, 200, heads_kv, 64), (2, 200, heads_kv, 64))
    (dout,) = tensors((2, 200, 4, 64), grad=False)

    def step():
        out = cupyflash.torch.attention(q, k, v, deterministic=True, **FAMILIES[family])
        out.backward(dout)
        return out, q.grad, k.grad, v.grad

    assert_replay_equals_eager(step, (q, k, v), (dout,))


def test_a_varlen_training_step_with_max_seqlen_replays_as_eager():
    """cu_seqlens on the GPU with max_seqlen given: the capture reads no lengths back."""
    q, k, v = tensors((203, 4, 64), (203, 2, 64), (203, 2, 64))
    (dout,) = tensors((203, 4, 64), grad=False)
    cu = torch.tensor([0, 17, 130, 203], dtype=torch.int32, device="cuda")

    def step():
        out = cupyflash.torch.attention_varlen(q, k, v, cu, cu, 113, 113, causal=True, deterministic=True)
        out.backward(dout)
        return out, q.grad, k.grad, v.grad

    assert_replay_equals_eager(step, (q, k, v), (dout,))


def test_a_decoding_step_replays_as_eager():
    q, k_new, v_new = tensors((3, 1, 8, 128), (3, 1, 2, 128), (3, 1, 2, 128), grad=False)
    k_cache, v_cache = tensors((3, 4096, 2, 128), (3, 4096, 2, 128), grad=False)
    lengths = torch.tensor([4000, 17, 2048], dtype=torch.int32, device="cuda")

    def step():
        return (cupyflash.torch.attention_decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new,
                                                 causal=True),)

    assert_replay_equals_eager(step, (), (q, k_new, v_new))


def test_reduce_overhead_compiles_a_training_step_that_equals_eager():
    """The forward compiled with CUDA graphs (torch.compile's reduce-overhead: AOT autograd's
    backward graph is replayed too), the loss's backward outside, as a model's training loop."""
    q, k, v = tensors((2, 256, 4, 64), (2, 256, 4, 64), (2, 256, 4, 64))
    (dout,) = tensors((2, 256, 4, 64), grad=False)

    def forward(q, k, v):
        return cupyflash.torch.attention(q, k, v, causal=True, deterministic=True) * 1.0

    compiled = torch.compile(forward, mode="reduce-overhead")
    for _ in range(4):  # (the first calls record; later ones replay)
        for x in (q, k, v):
            x.grad = None
        out = compiled(q, k, v)
        out.backward(dout)
        got = out.detach().clone()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = forward(q, k, v)
    want.backward(dout)
    assert torch.equal(got.view(torch.int16), want.detach().view(torch.int16))
    for a, x in zip(grads, (q, k, v)):
        assert torch.equal(a.view(torch.int16), x.grad.view(torch.int16))


def test_dropout_replays_draw_fresh_masks_that_their_backward_reuses():
    """Dropout from torch's generator (no seed) in a captured training step: each replay draws its
    (seed, offset) on the device, so the masks differ from replay to replay, and a replay's output
    and gradients equal, bit for bit, an eager step given the seed and offset it drew."""
    q, k, v = tensors((2, 200, 4, 64), (2, 200, 4, 64), (2, 200, 4, 64))
    (dout,) = tensors((2, 200, 4, 64), grad=False)
    states = []

    def step(**seeded):
        out = cupyflash.torch.attention(q, k, v, causal=True, dropout_p=0.25, deterministic=True, **seeded)
        states.append(out.grad_fn.saved_tensors[5])  # (the forward's rng_state: on the device when captured)
        out.backward(dout)
        return out, q.grad, k.grad, v.grad

    graph, static = captured(torch, step, (q, k, v))
    state = states[-1]
    assert state.is_cuda and state.shape == (2,)
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append(([x.clone() for x in static], state.tolist()))
    (first, drawn), (second, drawn_again) = replays
    assert drawn != drawn_again and not torch.equal(first[0], second[0])
    for outputs, (seed, offset) in replays:
        for x in (q, k, v):
            x.grad = None
        eager = step(seed=seed, offset=offset % 2**32)
        for i, (a, b) in enumerate(zip(outputs, eager)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"output {i}"
