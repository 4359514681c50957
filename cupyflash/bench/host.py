"""Host (Python) time per call of attention / attention_backward, a development tool.

    python -m cupyflash bench --host

On a tiny problem (batch 1, seqlen 128, 2 heads, head_dim 128, bfloat16) the GPU work is a few
microseconds, so 2000 back-to-back calls run at the host's pace: the wall time per call is the
launch overhead (validation, argument packing, kernel launches). PyTorch SDPA's forward on the
same tensors is printed for scale, and cupyflash.torch's forward (the adapter) beside it; with
--profile, the top functions of a cProfile run follow.

The "train" lines time a training step, forward then `out.backward(dout)` (bfloat16, causal), at
(1, 256, 8, 64) and (4, 1024, 16, 128): PyTorch SDPA, cupyflash.torch.attention and
cupyflash.flash_attn.flash_attn_func, each the loop's wall time per step; and "python function",
a torch.autograd.Function written in Python around torch's own FlashAttention-2 operators (as
flash-attn's package is): what any adapter whose backward runs Python pays, on the same kernels
as SDPA's. The "jax jit" lines time a jitted causal forward at (4, 4096, 16, 128) bf16 through
cupyflash.jax (a buffer callback) and through jax.nn.dot_product_attention's cuDNN backend.

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
    return ap


def main(args):
    import cupy

    import cupyflash
    from cupyflash.validation import BFLOAT16

    print(f"# measured on {common.measured_on('kernels')}")
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
    return steps


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
