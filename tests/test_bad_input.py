"""Bad input to every public function, and to the torch adapters and cupyflash.flash_attn: a
TypeError or ValueError that names the argument, raised before any work, the inputs untouched.
NumPy inputs (the checks are the same for every array type; GPU placement: test_attention_gpu.py)."""

import numpy
import pytest

import cupyflash

rng = numpy.random.default_rng(0)
Q = rng.standard_normal((2, 5, 4, 8)).astype(numpy.float32)
K = rng.standard_normal((2, 7, 2, 8)).astype(numpy.float32)
V = rng.standard_normal((2, 7, 2, 8)).astype(numpy.float32)
OUT, LSE = cupyflash.attention(Q, K, V, return_lse=True)
CU = numpy.array([0, 3, 5], numpy.int32)
QP, KP = Q.reshape(-1, 4, 8)[:5], K.reshape(-1, 2, 8)[:5]
NAN = float("nan")

CASES = [  # (what, call, error, the argument the message must name)
    ("scale nan", lambda: cupyflash.attention(Q, K, V, scale=NAN), ValueError, "scale"),
    ("softcap inf", lambda: cupyflash.attention(Q, K, V, softcap=float("inf")), ValueError, "softcap"),
    ("dropout_p nan", lambda: cupyflash.attention(Q, K, V, dropout_p=NAN, seed=1), ValueError, "dropout_p"),
    ("dropout without seed", lambda: cupyflash.attention(Q, K, V, dropout_p=0.1), ValueError, "seed"),
    ("offset too large", lambda: cupyflash.attention(Q, K, V, dropout_p=0.1, seed=1, offset=2**40), ValueError,
     "offset"),
    ("window side -2", lambda: cupyflash.attention(Q, K, V, window=(-2, 0)), ValueError, "window"),
    ("window side float", lambda: cupyflash.attention(Q, K, V, window=(2.5, 0)), TypeError, "window"),
    ("alibi_slopes nan", lambda: cupyflash.attention(Q, K, V, alibi_slopes=numpy.full(4, NAN, numpy.float32)),
     ValueError, "alibi_slopes"),
    ("alibi_slopes shape", lambda: cupyflash.attention(Q, K, V, alibi_slopes=numpy.ones(3, numpy.float32)),
     ValueError, "alibi_slopes"),
    ("seqlens_k past seqlen_k", lambda: cupyflash.attention(Q, K, V, seqlens_k=[9, 2]), ValueError, "seqlens_k"),
    ("seqlens_k float", lambda: cupyflash.attention(Q, K, V, seqlens_k=numpy.ones(2)), TypeError, "seqlens_k"),
    ("causal 1", lambda: cupyflash.attention(Q, K, V, causal=1), TypeError, "causal"),
    ("q a list", lambda: cupyflash.attention(Q.tolist(), K, V), TypeError, "q"),
    ("q int32", lambda: cupyflash.attention(Q.astype(numpy.int32), K, V), TypeError, "q"),
    ("k float64", lambda: cupyflash.attention(Q, K.astype(numpy.float64), V), TypeError, "k"),
    ("k head_dim", lambda: cupyflash.attention(Q, K[..., :4], V), ValueError, "k"),
    ("heads_kv not dividing", lambda: cupyflash.attention(Q[:, :, :3], K, V), ValueError, "heads_kv"),
    ("head_dim strided", lambda: cupyflash.attention(Q[..., ::2], K[..., ::2], V[..., ::2]), ValueError, "head_dim"),
    ("head_dim 300", lambda: cupyflash.attention(*(numpy.zeros((1, 2, 1, 300), numpy.float32),) * 3), ValueError,
     "head_dim"),
    ("backward lse shape", lambda: cupyflash.attention_backward(OUT, Q, K, V, OUT, LSE[:, :, :2]), ValueError, "lse"),
    ("backward lse dtype", lambda: cupyflash.attention_backward(OUT, Q, K, V, OUT, LSE.astype(numpy.float16)),
     TypeError, "lse"),
    ("backward dout shape", lambda: cupyflash.attention_backward(OUT[:, :2], Q, K, V, OUT, LSE), ValueError, "dout"),
    ("backward deterministic", lambda: cupyflash.attention_backward(OUT, Q, K, V, OUT, LSE, deterministic="no"),
     TypeError, "deterministic"),
    ("block_mask heads", lambda: cupyflash.block_sparse_attention(
        Q, K, V, cupyflash.BlockMask(numpy.ones((3, 1, 1), bool))), ValueError, "block_mask"),
    ("block_mask an array", lambda: cupyflash.block_sparse_attention(Q, K, V, numpy.ones((4, 1, 1), bool)),
     TypeError, "block_mask"),
    ("cu_seqlens float", lambda: cupyflash.attention_varlen(QP, KP, KP, CU.astype(float), CU), TypeError,
     "cu_seqlens_q"),
    ("cu_seqlens end", lambda: cupyflash.attention_varlen(QP, KP, KP, CU, numpy.array([0, 3, 4])), ValueError,
     "cu_seqlens_k"),
    ("max_seqlen_q short", lambda: cupyflash.attention_varlen(QP, KP, KP, CU, CU, max_seqlen_q=2), ValueError,
     "max_seqlen_q"),
    ("cache_seqlens past the cache", lambda: cupyflash.attention_decode(Q, K, V, [8, 1]), ValueError,
     "cache_seqlens"),
    ("num_splits 0", lambda: cupyflash.attention_decode(Q, K, V, [3, 1], num_splits=0), ValueError, "num_splits"),
    ("k_new without cache_seqlens", lambda: cupyflash.attention_decode(Q, K, V, k_new=K[:, :1], v_new=V[:, :1]),
     ValueError, "cache_seqlens"),
    ("k_new heads", lambda: cupyflash.attention_decode(Q, K, V, [3, 1], k_new=K[:, :1, :1], v_new=V[:, :1]),
     ValueError, "k_new"),
    ("dropout_mask dropout_p 1", lambda: cupyflash.dropout_mask(1, 1, 2, 2, dropout_p=1.0, seed=1), ValueError,
     "dropout_p"),
    ("dropout_mask batch -1", lambda: cupyflash.dropout_mask(-1, 1, 2, 2, dropout_p=0.1, seed=1), ValueError,
     "batch"),
    ("explain causal", lambda: cupyflash.explain(Q, K, V, causal="x"), TypeError, "causal"),
]


@pytest.mark.parametrize("what,call,error,name", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument_and_leaves_inputs(what, call, error, name):
    before = [x.copy() for x in (Q, K, V, OUT, LSE, CU)]
    with pytest.raises(error) as raised:
        call()
    assert name in str(raised.value), f"{what}: {raised.value}"
    for x, y in zip((Q, K, V, OUT, LSE, CU), before):
        numpy.testing.assert_array_equal(x, y)


def test_the_torch_adapters_check_as_the_functions_do():
    torch = pytest.importorskip("torch")
    import cupyflash.torch
    from cupyflash import flash_attn

    q, k, v = (torch.from_numpy(x.copy()) for x in (Q, K, V))
    with pytest.raises(ValueError, match="scale"):
        cupyflash.torch.attention(q, k, v, scale=NAN)
    with pytest.raises(TypeError, match="causal"):
        cupyflash.torch.attention(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="heads_kv"):
        cupyflash.torch.attention(q[:, :, :3], k, v)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        cupyflash.torch.attention_varlen(q.reshape(-1, 4, 8)[:5], k.reshape(-1, 2, 8)[:5], k.reshape(-1, 2, 8)[:5],
                                         torch.tensor([0.0, 3, 5]), torch.tensor([0, 3, 5]))
    with pytest.raises(TypeError, match="window_size"):
        flash_attn.flash_attn_func(q, k, v, window_size=(1, "a"))
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn.flash_attn_func(q, k, v, dropout_p=NAN)
    with pytest.raises(ValueError, match="kv must be a tensor of shape"):
        flash_attn.flash_attn_kvpacked_func(q, k)
    for x, y in zip((q, k, v), (Q, K, V)):
        numpy.testing.assert_array_equal(x.numpy(), y)
