"""The awkward grid every implementation is tested on: seqlens that are not tile multiples,
seqlen_q != seqlen_k both ways, head dims that are not padded sizes, one-element edges."""

# (seqlen_q, seqlen_k, head_dim)
AWKWARD_SHAPES = [
    (1, 1, 1),
    (1, 17, 40),
    (17, 1, 59),
    (113, 203, 111),
    (203, 113, 256),
    (64, 64, 64),
    (1023, 1024, 40),
    (1024, 1023, 128),
    (17, 0, 32),  # no keys at all: output 0, lse -inf
]
HEAD_DIMS = [1, 16, 40, 59, 111, 128, 200, 256]
DTYPES = ["float16", "bfloat16", "float32", "float64"]


def numpy_dtype(name):
    import numpy

    from cupyflash.validation import BFLOAT16

    return BFLOAT16 if name == "bfloat16" else numpy.dtype(name)


def random_qkv(rng, dtype, batch, seqlen_q, seqlen_k, heads, head_dim, heads_kv=None):
    """q, k, v of standard normal values in `dtype` (NumPy); k and v with heads_kv heads (GQA/MQA)."""
    dtype = numpy_dtype(dtype)
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, heads_kv or heads, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, heads_kv or heads, head_dim)).astype(dtype)
    return q, k, v


def bits(x):
    """x's raw bits, for bit-for-bit comparisons (NaN == NaN, -0 != +0)."""
    import numpy

    return x.view({2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}[x.dtype.itemsize])


def captured(call):
    """(graph, outputs, stream): `call` captured into a CUDA graph on a stream of its own, its
    outputs (the arrays the graph writes) and that stream."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        outputs = call()
        graph = stream.end_capture()
    return graph, outputs, stream


def replay_into_nan(graph, outputs, stream) -> None:
    """Launches `graph` on `stream` with its outputs set to NaN bits first (so that an element a
    replay leaves unwritten fails), without waiting for it."""
    import cupy

    for x in outputs:
        cupy.cuda.runtime.memsetAsync(x.data.ptr, 0xFF, x.nbytes, stream.ptr)
    graph.launch(stream)
