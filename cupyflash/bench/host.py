"""Host (Python) time per call of attention / attention_backward, a development tool.

    python -m cupyflash bench --host

On a tiny problem (batch 1, seqlen 128, 2 heads, head_dim 128, bfloat16) the GPU work is a few
microseconds, so 2000 back-to-back calls run at the host's pace: the wall time per call is the
launch overhead (validation, argument packing, kernel launches). PyTorch SDPA's forward on the
same tensors is printed for scale, and cupyflash.torch's forward (the adapter) beside it; with
--profile, the top functions of a cProfile run follow. The "cupy floor" line allocates a forward's
two results with cupy.empty and launches one empty kernel, as cupyflash launches: the least any
forward on CuPy arrays costs on the host.

The "train" lines time a training step, forward then `out.backward(dout)` (bfloat16, causal), at
(1, 256, 8, 64) and (4, 1024, 16, 128): PyTorch SDPA, cupyflash.torch.attention and
cupyflash.flash_attn.flash_attn_func, each the loop's wall time per step; and "python function",
a torch.autograd.Function written in Python around torch's own FlashAttention-2 operators (as
flash-attn's package is): what any adapter whose backward runs Python pays, on the same kernels
as SDPA's; the "graph" lines replay a CUDA graph of the step (SDPA's and cupyflash.torch's),
captured in torch's default mode. The "jax jit" lines time a jitted causal forward at
(4, 4096, 16, 128) bf16 through cupyflash.jax (a buffer callback) and through
jax.nn.dot_product_attention's cuDNN backend.

--fresh N: the calls go round N sets of arrays, and each call's results are kept until its set
comes round again, as a model's layers keep theirs: every call then sees arrays at new addresses
(new TMA descriptors), where the default loop gets its output back at the address just freed.
"""

import cProfile
import gc
import io
import pstats
import time

import numpy

from cupyflash import arguments
from cupyflash.bench import common


def parser() -> arguments.Parser:
    ap = arguments.Parser("python -m cupyflash bench --host", __doc__)
    ap.add_argument("--calls", type=arguments.positive_int, default=2000, help="back-to-back calls timed per line")
    ap.add_argument("--profile", action="store_true", help="also print the top functions of a cProfile run")
    ap.add_argument("--no-gc", action="store_true", help="with Python's cyclic garbage collector off")
    ap.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"), help="the profile's order")
    ap.add_argument("--only", help="time (and profile) only the calls whose name contains this")
    ap.add_argument("--fresh", type=arguments.positive_int, default=1, metavar="N",
                    help="go round N sets of arrays, keeping each call's results until its set comes round")
    ap.add_argument("--pieces", action="store_true",
                    help="instead: the time of each piece of a prepared call, timed on its own (docs/performance.md)")
    return ap


def main(args):
    import cupy

    import cupyflash
    from cupyflash.validation import BFLOAT16

    print(f"# measured on {common.measured_on('kernels')}")
    if args.pieces:
        return _pieces(args.calls)
    rs = cupy.random.default_rng(0)
    sets = []
    for _ in range(args.fresh):
        q, k, v, dout = (rs.standard_normal((1, 128, 2, 128), dtype=numpy.float32).astype(BFLOAT16) for _ in range(4))
        out, lse = cupyflash.attention(q, k, v, return_lse=True)
        sets.append((q, k, v, dout, out, lse))
    mask = cupyflash.BlockMask(numpy.ones((2, 1, 1), bool))
    kept = [None] * args.fresh
    turn = iter(range(1 << 62))

    def each(call, arrays=sets):
        """call(*arrays[i]) for the next set i, its result kept until i's next turn (with one set,
        dropped at once, so that the next call's output takes the address just freed)."""
        def run():
            i = next(turn) % args.fresh
            kept[i] = None
            result = call(*arrays[i])
            if args.fresh > 1:
                kept[i] = result
        return run

    calls = {
        "attention": each(lambda q, k, v, dout, out, lse: cupyflash.attention(q, k, v, return_lse=True)),
        "attention_backward": each(lambda q, k, v, dout, out, lse: cupyflash.attention_backward(dout, q, k, v, out, lse)),
        "block_sparse fwd": each(lambda q, k, v, dout, out, lse: cupyflash.block_sparse_attention(
            q, k, v, mask, return_lse=True)),
        "block_sparse bwd": each(lambda q, k, v, dout, out, lse: cupyflash.block_sparse_attention_backward(
            dout, q, k, v, out, lse, mask)),
        "cupy floor (2 cupy.empty, 1 launch)": each(_cupy_floor()),
    }
    try:
        import torch

        import cupyflash.torch

        tsets = [tuple(torch.from_dlpack(x) for x in s[:3]) for s in sets]
        calls["torch sdpa forward"] = each(torch.nn.functional.scaled_dot_product_attention,
                                           [tuple(x.transpose(1, 2) for x in s) for s in tsets])
        # The adapter on (batch, seq, heads, head_dim) tensors: DLPack in and out, torch's stream.
        calls["cupyflash.torch forward"] = each(cupyflash.torch.attention, tsets)
        calls.update(_training_steps(torch))
    except ImportError:
        print("# torch not installed: no SDPA line")
    calls.update(_jax_calls())
    if args.no_gc:
        gc.disable()
    for name, fn in calls.items():
        if args.only and args.only not in name:
            continue
        if getattr(fn, "failure", None):  # (a CUDA-graph capture that failed: said, the other lines go on)
            print(f"{name:42} {fn.failure}")
            continue
        fn()
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        getattr(fn, "finish", lambda: None)()  # (JAX dispatches asynchronously: its last result first)
        cupy.cuda.Device().synchronize()
        print(f"{name:42} {(time.perf_counter() - start) / args.calls * 1e6:7.1f} us per call")
        if args.profile and not name.startswith("torch"):
            profile = cProfile.Profile()
            profile.runcall(lambda: [fn() for _ in range(500)])
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(args.sort).print_stats(14 if args.sort == "tottime" else 40)
            print(text.getvalue())
    return 0



def _cupy_floor():
    """call(q, k, v, dout, out, lse) that does only what any CuPy function with a forward's results
    must: allocate out and lse (cupy.empty), write their addresses into kept kernel arguments and
    launch one kernel (an empty one) on CuPy's current stream through cuLaunchKernel, as cupyflash
    launches: the least a forward on CuPy arrays can cost on this host."""
    import cupy

    kernel = cupy.RawKernel('extern "C" __global__ void cupyflash_bench_nothing(void* o, void* lse) {}',
                            "cupyflash_bench_nothing")
    function = kernel.kernel.ptr
    arguments = numpy.zeros(2, numpy.uint64)  # the kernel's two pointers, passed by value
    addresses = numpy.array([arguments.ctypes.data, arguments.ctypes.data + 8], numpy.uint64)
    address = addresses.ctypes.data
    driver = cupy.cuda.driver

    def call(q, k, v, dout, out, lse):
        o, l = cupy.empty(q.shape, q.dtype), cupy.empty(lse.shape, lse.dtype)
        arguments[0], arguments[1] = o.data.ptr, l.data.ptr
        driver.launchKernel(function, 1, 1, 1, 32, 1, 1, 0, cupy.cuda.get_current_stream().ptr, address, 0)
        return o, l

    call.keep = (kernel, arguments, addresses)  # (alive as long as the call)
    return call


def _timed(calls: int, fn) -> float:
    """Host microseconds per call of fn: a loop of `calls`, synchronised once at its end."""
    import cupy

    fn()
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _pieces(calls: int) -> int:
    """Each piece of a prepared call timed on its own, beside the whole call: a CuPy forward at
    (1, 128, 2, 128) bf16 and the torch adapter's training step at (1, 256, 8, 64) bf16 causal,
    with SDPA's. The pieces' sum falls short of the whole by what is not listed (the call's own
    lines, Python's calls between them)."""
    import cupy

    import cupyflash
    from cupyflash.api import prepared
    from cupyflash.api import common as calls_common
    from cupyflash.runtime import launch, workspace
    from cupyflash.validation import BFLOAT16

    rs = cupy.random.default_rng(0)
    q, k, v = (rs.standard_normal((1, 128, 2, 128), dtype=numpy.float32).astype(BFLOAT16) for _ in range(3))
    cupyflash.attention(q, k, v, return_lse=True)  # (prepares the signature)
    flags = (False, None, None, None, True)  # causal, scale, window, softcap, return_lse

    def signature():
        return ("cupy forward", prepared.signature(q) + prepared.signature(k) + prepared.signature(v),
                prepared.flags_key(*flags))

    key = signature()
    entry = prepared.lookup(key)
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    stream = workspace.cupy_stream()
    pointers = {"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "o": out.data.ptr, "lse": lse.data.ptr}
    plan = entry.bind(dict(pointers), stream)
    rows = [("CuPy forward, the whole call", lambda: cupyflash.attention(q, k, v, return_lse=True)),
            ("  signature (3 arrays, the options)", signature),
            ("  lookup", lambda: prepared.lookup(key)),
            ("  allocate out and lse", lambda: (calls_common.empty(entry.shapes[0], q.dtype),
                                                calls_common.empty(entry.shapes[1], entry.shapes[2]))),
            ("  the stream", workspace.cupy_stream),
            ("  bind (the struct, the tensor maps)", lambda: entry.bind(dict(pointers), stream)),
            ("  launch", lambda: launch.run(plan, stream.ptr))]
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        rows += _torch_pieces(torch)
    print(f"{'piece':48} {'us':>8}")
    for name, fn in rows:
        print(f"{name:48} {_timed(calls, fn):8.1f}")
    return 0


def _torch_pieces(torch) -> list:
    """(name, call) of the torch adapter's training step and its pieces, through public names: the
    step, the forward with autograd (the autograd.Function and the operator), the forward and the
    backward operators called alone, the dispatcher's way into a Python operator (an operator of
    the forward's schema that returns at once), the allocations; and SDPA's step and forward."""
    import cupyflash.torch  # noqa: F401  (defines the cupyflash operators)

    q, k, v, dout = (torch.randn((1, 256, 8, 64), device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def step(forward):
        def run():
            for x in (qg, kg, vg):
                x.grad = None
            forward().backward(dout)
        return run

    ours = step(lambda: cupyflash.torch.attention(qg, kg, vg, causal=True))
    sdpa = step(lambda: torch.nn.functional.scaled_dot_product_attention(
        qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), is_causal=True).transpose(1, 2))
    # causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset, deterministic
    options = (True, None, False, None, None, None, None, 0.0, None, 0, False)
    forward_op, backward_op = torch.ops.cupyflash.attention_forward.default, torch.ops.cupyflash.attention_backward.default
    out, lse, rng_state = forward_op(q, k, v, *options)
    empty_op = _empty_operator(torch)
    return [("torch training step (1, 256, 8, 64)", ours),
            ("  forward, autograd.Function and operator", lambda: cupyflash.torch.attention(qg, kg, vg, causal=True)),
            ("  forward operator alone", lambda: forward_op(q, k, v, *options)),
            ("  backward operator alone", lambda: backward_op(dout, q, k, v, out, lse, *options[:8], rng_state, False)),
            ("  an operator that returns at once (dispatch)", lambda: empty_op(q, k, v, *options)),
            ("  allocate out, lse and rng_state", lambda: (
                torch.empty_like(q), torch.empty(lse.shape, dtype=lse.dtype, device=lse.device),
                q.new_empty((0,), dtype=torch.int64))),
            ("  allocate dq, dk and dv", lambda: tuple(torch.empty_like(x) for x in (q, k, v))),
            ("SDPA training step (1, 256, 8, 64)", sdpa),
            ("  SDPA forward", lambda: torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True))]


def _empty_operator(torch):
    """An operator with cupyflash::attention_forward's arguments whose CUDA implementation returns
    at once (defined once per process): what the dispatcher's way into and out of Python costs."""
    if not hasattr(_empty_operator, "library"):
        library = _empty_operator.library = torch.library.Library("cupyflash_bench", "DEF")  # (lives with it)
        library.define("dispatch_probe(Tensor q, Tensor k, Tensor v, bool causal, float? scale, bool windowed, "
                       "int? window_left, int? window_right, float? softcap, Tensor? alibi_slopes, float dropout_p, "
                       "int? seed, int offset, bool deterministic) -> ()")
        library.impl("dispatch_probe", lambda *arguments: None, "CUDA")
    return torch.ops.cupyflash_bench.dispatch_probe.default


def _jax_calls() -> dict:
    """name -> a jitted causal forward at (4, 4096, 16, 128) bf16: cupyflash.jax.attention and
    jax.nn.dot_product_attention's cuDNN implementation, the last call's result blocked on at the
    loop's end (`finish`). Empty without JAX on a GPU."""
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (beside torch's and CuPy's pools)
    try:
        import jax

        import cupyflash.jax
    except ImportError:
        print("# jax not installed: no JAX lines")
        return {}
    if jax.default_backend() != "gpu":
        print("# jax has no GPU backend: no JAX lines")
        return {}
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (4, 4096, 16, 128), jax.numpy.bfloat16) for key in keys)
    ours = jax.jit(lambda q, k, v: cupyflash.jax.attention(q, k, v, causal=True))
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    error = float(jax.numpy.abs(ours(q, k, v).astype(float) - cudnn(q, k, v).astype(float)).max())
    if not error <= 0.05:
        raise RuntimeError(f"cupyflash.jax differs from cuDNN's attention by {error:.3g}")
    kept = []

    def call(fn):
        def run():
            kept[:] = [fn(q, k, v)]  # (one result alive, as the torch loops keep theirs)
        run.finish = lambda: jax.block_until_ready(kept)
        return run

    return {"jax jit cudnn (4, 4096, 16, 128)": call(cudnn), "jax jit cupyflash (4, 4096, 16, 128)": call(ours)}


def _training_steps(torch) -> dict:
    """name -> one training step (forward, then out.backward(dout)) of each method and shape."""
    import cupyflash.torch
    from cupyflash.flash_attn import flash_attn_func

    python_function = _python_function(torch)
    steps = {}
    for shape in ((1, 256, 8, 64), (4, 1024, 16, 128)):
        q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        forwards = {
            "sdpa": lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2),
            "cupyflash.torch": lambda q=q, k=k, v=v: cupyflash.torch.attention(q, k, v, causal=True),
            "flash_attn_func": lambda q=q, k=k, v=v: flash_attn_func(q, k, v, causal=True),
            "python function": lambda q=q, k=k, v=v: python_function.apply(q, k, v),
        }
        _check_gradients(torch, forwards, (q, k, v), dout)
        for method, forward in forwards.items():
            def step(forward=forward, inputs=(q, k, v), dout=dout):
                for x in inputs:
                    x.grad = None
                forward().backward(dout)
            steps[f"train {method} {shape}"] = step
        for method in ("sdpa", "cupyflash.torch"):
            steps[f"train {method} graph {shape}"] = _graphed(torch, forwards[method], (q, k, v), dout)
    return steps


def captured(torch, step, inputs: tuple):
    """(graph, step()'s outputs): step captured into a CUDA graph by torch.cuda.graph (its default,
    global, capture mode) after two warm-up calls on a side stream, torch's recipe; the inputs'
    gradients are None at the capture, so the graph's backward writes them. Raises the capture's
    error. (tests/test_torch_graphs_gpu.py captures the same way.)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for x in inputs:
                x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for x in inputs:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def _graphed(torch, forward, inputs: tuple, dout):
    """A training step (forward().backward(dout)) as a call that replays its CUDA graph
    (`captured`); where the capture fails, a call whose `failure` says why (the loop prints it)."""
    def step():
        forward().backward(dout)

    try:
        graph, _ = captured(torch, step, inputs)
    except RuntimeError as e:
        def failed():
            raise RuntimeError(failed.failure)
        failed.failure = f"CUDA-graph capture failed: {e}"
        return failed
    return graph.replay


def _check_gradients(torch, forwards: dict, inputs: tuple, dout) -> None:
    """Every method's output and gradients as SDPA's (within bfloat16 rounding), before any is timed."""
    results = {}
    for method, forward in forwards.items():
        for x in inputs:
            x.grad = None
        out = forward()
        out.backward(dout)
        results[method] = [out.detach().float()] + [x.grad.float() for x in inputs]
    for method, got in results.items():
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, results["sdpa"]):
            error = (a - b).abs().max().item()
            if not error <= 0.05 * max(b.abs().max().item(), 1.0):
                raise RuntimeError(f"{method}: {name} differs from SDPA's by {error:.3g}")
    for x in inputs:
        x.grad = None


def _python_function(torch):
    """Causal attention on (batch, seq, heads, head_dim) tensors as a torch.autograd.Function in
    Python whose forward and backward each call one of torch's FlashAttention-2 operators."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward

    class PythonFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = flash(q, k, v, 0.0, True)
            ctx.save_for_backward(q, k, v, out, lse, cum_q, cum_k, seed, offset)
            ctx.max_seqlens = max_q, max_k
            return out.transpose(1, 2)

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse, cum_q, cum_k, seed, offset = ctx.saved_tensors
            grads = flash_backward(dout.transpose(1, 2), q, k, v, out, lse, cum_q, cum_k, *ctx.max_seqlens, 0.0, True,
                                   seed, offset)
            return tuple(g.transpose(1, 2) for g in grads)

    return PythonFunction
