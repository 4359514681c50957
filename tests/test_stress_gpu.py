"""Races show up as results that change from run to run: the warp-specialised Hopper kernels (a
producer warp and consumer warpgroups handing shared-memory buffers to each other, a persistent
tile scheduler, the dQ ring's counters) run the same problem many times, and every run must give
the first run's out, lse, dk and dv bit for bit (those are always reproducible; dq is summed by
float atomics in any order, and deterministic=True takes another kernel). Many shapes: seqlens
that leave partial tiles, GQA, causal, block masks, a dQ ring of one and two slots (every slab
waits for the one before). Marker `gpu`; sm_90 only."""

import numpy
import pytest

import cupyflash
from shapes import bits, random_qkv

pytestmark = pytest.mark.gpu

RUNS = 8
SHAPES = [  # batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim
    (1, 257, 130, 2, 2, 128), (2, 300, 520, 2, 1, 64), (3, 64, 1000, 4, 2, 128), (1, 1023, 1024, 2, 2, 64),
    (2, 129, 129, 3, 3, 104), (4, 17, 384, 2, 2, 40), (1, 700, 333, 4, 1, 128), (2, 384, 384, 2, 2, 64),
]


@pytest.fixture
def warp_specialised(policy):
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the warp-specialised kernels run on sm_90 devices only")
    return policy


@pytest.mark.parametrize("ring_slabs", [0, 1, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_repeated_runs_give_the_same_bits(rng, warp_specialised, shape, causal, ring_slabs):
    import cupy

    warp_specialised(ws_backward=True, ring_slabs=ring_slabs)
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = shape
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "bfloat16", batch, seqlen_q, seqlen_k, heads, head_dim,
                                                   heads_kv))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    assert cupyflash.explain(q, k, v, causal=causal).backward.kernel.source_file == "sm90/bwd_dkdv_ws.cu"

    def run():
        out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
        return (out, lse, *cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)[1:])
    assert_runs_repeat(run)


@pytest.mark.parametrize("density", [0.1, 0.3])
def test_repeated_block_sparse_runs_give_the_same_bits(rng, warp_specialised, density):
    import cupy

    warp_specialised(ws_backward=True)
    seqlen, heads, head_dim = 1024, 2, 64
    mask = cupyflash.BlockMask.from_dense(rng.random((heads, seqlen // 128, seqlen // 128)) < density)
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, "float16", 2, seqlen, seqlen, heads, head_dim))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    taken = cupyflash.explain(q, k, v, block_mask=mask)
    assert (taken.forward.kernel.source_file, taken.backward.kernel.source_file) == ("sm90/fwd_ws.cu", "sm90/bwd_dkdv_ws.cu")

    def run():
        out, lse = cupyflash.block_sparse_attention(q, k, v, mask, return_lse=True)
        return (out, lse, *cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask)[1:])
    assert_runs_repeat(run)


def assert_runs_repeat(run):
    """run() -> (out, lse, dk, dv), RUNS times: every run's bits must be the first run's."""
    first = None
    for i in range(RUNS):
        got = [bits(x.get()) for x in run()]
        if first is None:
            first = got
            continue
        for name, a, b in zip(("out", "lse", "dk", "dv"), first, got):
            assert numpy.array_equal(a, b), f"{name} differs in run {i} from run 0"
