"""Ring attention and its all-gather variant (cupyflash.distributed) across 2 and 4 CPU
processes over gloo, on the NumPy path: every rank's shard of the output and of dq, dk, dv, gathered, against single-device
attention's float64 reference by the tolerance rule (float32 and float64), causal and not, both
layouts, GQA; then the layouts' round trip and the checks."""

import os
import sys

import numpy
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as multiprocessing  # noqa: E402

from cupyflash import reference  # noqa: E402


def joined(rank, world, store):
    """Joins the group through a file store (`store`, a path of the test's tmp_path): no TCP store
    thread, which aborted rank 0 at exit now and then under pytest."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def left(passed: bool):
    """Every rank leaves together; a rank that passed then ends at once. Spawned from pytest, about
    one process in 13 aborted in the interpreter's teardown after destroy_process_group ("terminate
    called without an active exception"), every rank's work done and judged; the same spawns from a
    plain script: 0 of 24."""
    dist.barrier()
    dist.destroy_process_group()
    if passed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def ring_and_reference(rank, world, store, seed, causal, layout, dtype_name, method="ring_attention"):
    """Runs on each rank; rank 0 judges the gathered results (an AssertionError fails the spawn)."""
    import cupyflash.distributed as cfd
    from rule import assert_within_rule

    joined(rank, world, store)
    passed = False
    try:
        dtype = getattr(torch, dtype_name)
        rng = numpy.random.default_rng(seed)
        seqlen = 6 * world
        q, dout = (torch.from_numpy(rng.standard_normal((2, seqlen, 4, 24))).to(dtype) for _ in range(2))
        k, v = (torch.from_numpy(rng.standard_normal((2, seqlen, 2, 24))).to(dtype) for _ in range(2))
        shards = [cfd.shard(x, causal=causal, layout=layout).requires_grad_() for x in (q, k, v)]
        out = getattr(cfd, method)(*shards, causal=causal, layout=layout)
        out.backward(cfd.shard(dout, causal=causal, layout=layout))
        results = [cfd.gather(x, causal=causal, layout=layout) for x in (out.detach(), *(s.grad for s in shards))]
        if rank == 0:
            host = [x.double().numpy() for x in (dout, q, k, v)]
            exact = [reference.attention(*host[1:], causal=causal),
                     *reference.attention_backward(*host, causal=causal)]
            low = numpy.float32 if dtype_name == "float32" else numpy.float64
            baseline = [reference.attention_in_precision(*host[1:], low, causal=causal),
                        *reference.attention_backward_in_precision(*host, low, causal=causal)]
            magnitudes = [reference.output_term_magnitude(*host[1:], causal=causal),
                          *reference.gradient_term_magnitudes(*host, causal=causal)]
            for name, got, want, base, magnitude in zip(("out", "dq", "dk", "dv"), results, exact, baseline,
                                                         magnitudes):
                assert_within_rule(name, got, want, base, dtype_name, magnitude)
        passed = True
    finally:
        left(passed)


RING = [("ring_attention", world, causal, layout, dtype) for world in (2, 4) for dtype in ("float32", "float64")
        for causal, layout in ((False, "contiguous"), (True, "contiguous"), (True, "zigzag"))]
ALL_GATHER = [("allgather_attention", 4, True, "zigzag", "float32"),
              ("allgather_attention", 2, True, "contiguous", "float64"),
              ("allgather_attention", 2, False, "contiguous", "float32")]


@pytest.mark.parametrize("method,world,causal,layout,dtype_name", RING + ALL_GATHER)
def test_context_parallel_attention_equals_attention_on_the_whole_sequence(rng, tmp_path, method, world, causal,
                                                                         layout, dtype_name):
    seed = int(rng.integers(2**31))
    multiprocessing.spawn(ring_and_reference,
                          args=(world, tmp_path / "store", seed, causal, layout, dtype_name, method), nprocs=world)


def layouts_and_checks(rank, world, store):
    import cupyflash.distributed as cfd

    joined(rank, world, store)
    passed = False
    try:
        x = torch.arange(2 * 8 * world, dtype=torch.float32).reshape(2, 8 * world, 1, 1)
        for layout in ("contiguous", "zigzag"):
            assert torch.equal(cfd.gather(cfd.shard(x, layout=layout), layout=layout), x)
        mine = cfd.shard(x, causal=True)[0, :, 0, 0]
        parts = x[0, :, 0, 0].chunk(2 * world)
        assert torch.equal(mine, torch.cat((parts[rank], parts[2 * world - 1 - rank])))  # zigzag by default
        with pytest.raises(ValueError, match="must divide into"):
            cfd.shard(x[:, :-1], causal=True)
        with pytest.raises(ValueError, match="layout must be one of"):
            cfd.shard(x, layout="striped")
        q = torch.zeros(1, 6, 2, 8)
        with pytest.raises(TypeError, match="torch tensors"):
            cfd.ring_attention(q.numpy(), q, q)
        with pytest.raises(ValueError, match="equal query and key shards"):
            cfd.ring_attention(q, q[:, :4], q[:, :4], causal=True)
        with pytest.raises(ValueError, match="must be even"):
            cfd.ring_attention(q[:, :5], q[:, :5], q[:, :5], causal=True)
        passed = True
    finally:
        left(passed)


def test_layouts_round_trip_and_bad_calls_are_named(tmp_path):
    multiprocessing.spawn(layouts_and_checks, args=(2, tmp_path / "store"), nprocs=2)


def tiny_model(dtype, seed):
    """Two causal self-attention layers calling torch's SDPA (GQA), with projections."""
    gen = torch.Generator().manual_seed(seed)  # the same weights in every dtype: drawn in float64
    weights = [torch.randn(32, 32 + 16 + 16, generator=gen, dtype=torch.float64) / 32**0.5,
               torch.randn(32, 32, generator=gen, dtype=torch.float64) / 32**0.5]
    weights = [w.to(dtype).requires_grad_() for w in weights]

    def forward(x):
        for _ in range(2):
            qkv = x @ weights[0]
            q, k, v = qkv.split((32, 16, 16), dim=-1)
            q, k, v = (t.unflatten(-1, (-1, 8)).transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, 8)
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + attended.transpose(1, 2).flatten(-2) @ weights[1]
        return x

    return forward, weights


def model_under_context_parallel(rank, world, store, seed, dtype_name):
    """A model whose inputs are sharded, its SDPA calls ring attention: its output (gathered) and
    its weights' gradients (summed over the ranks) against the model on the whole sequence."""
    import cupyflash.distributed as cfd
    from rule import assert_within_rule

    joined(rank, world, store)
    passed = False
    try:
        dtype = getattr(torch, dtype_name)
        x = torch.from_numpy(numpy.random.default_rng(seed).standard_normal((2, 8 * world, 32))).to(dtype)
        forward, weights = tiny_model(dtype, seed)
        with cfd.context_parallel():
            out = forward(cfd.shard(x, causal=True))
        out.square().sum().backward()
        for w in weights:
            dist.all_reduce(w.grad)
        got = [cfd.gather(out.detach(), causal=True)] + [w.grad for w in weights]
        if rank == 0:
            results = {}
            for name, run_dtype in (("exact", torch.float64), ("baseline", dtype)):
                forward, weights = tiny_model(run_dtype, seed)
                whole = forward(x.to(run_dtype))
                whole.square().sum().backward()
                results[name] = [whole.detach()] + [w.grad for w in weights]
            for name, *triple in zip(("out", "qkv weight gradient", "output weight gradient"), got,
                                     results["exact"], results["baseline"]):
                assert_within_rule(name, *triple, dtype_name)
        passed = True
    finally:
        left(passed)


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_a_model_under_context_parallel(rng, tmp_path, dtype_name):
    multiprocessing.spawn(model_under_context_parallel, args=(2, tmp_path / "store", int(rng.integers(2**31)),
                                                              dtype_name), nprocs=2)


def test_a_group_of_one_is_attention_itself(tmp_path):
    """One rank: its shard is the whole sequence, and the ring (no transfer at all) and the
    all-gather variant are attention, judged by the rule against float64."""
    import cupyflash.distributed as cfd
    from rule import assert_within_rule

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        q, k, v, dout = (torch.randn(1, 12, 2, 8, dtype=torch.float64) for _ in range(4))
        host = [x.numpy() for x in (dout, q, k, v)]
        exact = [reference.attention(*host[1:], causal=True), *reference.attention_backward(*host, causal=True)]
        assert torch.equal(cfd.shard(q, causal=True), q) and torch.equal(cfd.gather(q, causal=True), q)
        for method in (cfd.ring_attention, cfd.allgather_attention):
            inputs = [x.clone().requires_grad_() for x in (q, k, v)]
            out = method(*inputs, causal=True)
            out.backward(dout)
            for name, got, want in zip(("out", "dq", "dk", "dv"), (out.detach(), *(x.grad for x in inputs)), exact):
                assert_within_rule(name, got, want, want, "float64")
    finally:
        dist.destroy_process_group()
