"""cupyflash attention as a differentiable JAX function.

    import cupyflash.jax
    out = cupyflash.jax.attention(q, k, v, causal=True)            # q, k, v: jax arrays
    dq = jax.grad(lambda q: cupyflash.jax.attention(q, k, v).sum())(q)

Works eagerly and under `jax.jit`: the kernels run through `jax.experimental.buffer_callback`,
which hands XLA's own device buffers and CUDA stream to cupyflash, so nothing is copied and the
launches are ordered with the rest of the XLA computation. The gradient is a `jax.custom_vjp`
whose backward is `cupyflash.attention_backward`; `attention_varlen` does the same for packed
variable-length batches. On JAX's CPU backend the NumPy tiled fallback
runs instead. Importing this module imports jax, which cupyflash does not otherwise need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy

from cupyflash import validation
from cupyflash.api import common
from cupyflash.api.common import check_block_mask
from cupyflash.cpu import fallback
from cupyflash.dispatch import plan as planner
from cupyflash.frameworks import arrays as frameworks
from cupyflash.problem import Options, lse_dtype
from cupyflash.runtime import launch, workspace

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError as e:  # pragma: no cover - depends on the JAX version
    raise ImportError(
        "cupyflash.jax needs a JAX with jax.experimental.buffer_callback (JAX 0.7 or newer)"
    ) from e

__all__ = ["attention", "attention_varlen"]


def attention(
    q, k, v, *, causal=False, scale=None, deterministic=False, block_mask=None, window=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
):
    """`cupyflash.attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
    alibi_slopes=alibi_slopes)` for JAX arrays (k, v with fewer heads for GQA/MQA),
    differentiable through `cupyflash.attention_backward`. `deterministic=True` makes the
    gradients bitwise reproducible. With a `cupyflash.BlockMask` as block_mask,
    `cupyflash.block_sparse_attention` and its backward (the mask, the window and the softcap
    are static arguments, like causal; the ALiBi slopes are an array, which gets a zero
    gradient). Dropout (dropout_p, seed, offset as `cupyflash.attention`) takes Python numbers,
    static arguments too: under `jax.jit` a new seed or offset means a new trace, so pass them as
    static arguments of the jitted step (or call eagerly). Returns out only; arguments are checked
    when the call is traced."""
    dropout_p, seed, offset = validation.check_dropout_args(dropout_p, seed, offset)
    # The options are a static argument: hashable (the window a tuple), the slopes travel apart.
    options = Options(causal=bool(causal), scale=scale, deterministic=bool(deterministic), block_mask=block_mask,
                      window=None if window is None else tuple(window), softcap=softcap, dropout_p=dropout_p,
                      seed=seed, offset=offset)
    return _attention_vjp(q, k, v, _slopes(alibi_slopes, q), options)


def _slopes(alibi_slopes, q):
    """The ALiBi slopes in the kernels' accumulator type, as (batch or 1, heads); None for none."""
    if alibi_slopes is None:
        return None
    alibi_slopes = jnp.asarray(alibi_slopes, lse_dtype(validation.dtype_name(q.dtype, "q")))
    return alibi_slopes.reshape(1, -1) if alibi_slopes.ndim == 1 else alibi_slopes


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention_vjp(q, k, v, slopes, options):
    return _forward(q, k, v, slopes, options)[0]


def _attention_fwd(q, k, v, slopes, options):
    out, lse = _forward(q, k, v, slopes, options)
    return out, (q, k, v, slopes, out, lse)


def _attention_bwd(options, residuals, dout):
    q, k, v, slopes, out, lse = residuals
    grads = _backward(dout, q, k, v, slopes, out, lse, options)
    return (*grads, None if slopes is None else jnp.zeros_like(slopes))


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)


class _Spec:
    """Shape and dtype of a (possibly traced) JAX array, with the C-contiguous strides XLA's
    default layout gives a callback's buffers, for the shared argument checks."""

    def __init__(self, x):
        self.shape = tuple(x.shape)
        self.dtype = numpy.dtype(x.dtype)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        strides, step = [], self.dtype.itemsize
        for n in reversed(self.shape):
            strides.append(step)
            step *= max(n, 1)
        self.strides = tuple(reversed(strides))

    def __getitem__(self, key):
        """x[None], the one indexing the shared checks do (a packed array seen as a batch of one)."""
        if key is not None:
            raise TypeError(f"only x[None] is supported, got {key!r}")
        spec = object.__new__(_Spec)
        spec.shape, spec.dtype, spec.ndim, spec.size = (1, *self.shape), self.dtype, self.ndim + 1, self.size
        spec.strides = (max(self.size, 1) * self.dtype.itemsize, *self.strides)
        return spec


def _with_slopes(p, slopes, buffers):
    """The problem with the ALiBi slopes' buffer (the callback's last input) in place of its spec."""
    if slopes is None:
        return p
    buffer = buffers[-1]
    value = _as_cupy(buffer, slopes.dtype) if _on_gpu(buffer) else numpy.asarray(buffer)
    return dataclasses.replace(p, alibi_slopes=value)


def _forward(q, k, v, slopes, o: Options):
    p = validation.check_attention_args(
        *map(_Spec, (q, k, v)), causal=o.causal, scale=o.scale, return_lse=True, window=o.window, softcap=o.softcap
    )
    p = validation.check_alibi_slopes(None if slopes is None else _Spec(slopes), p)
    if o.block_mask is not None:
        p = check_block_mask(o.block_mask, p)
    return _forward_call(validation.check_dropout(*o.dropout, p), q, k, v, slopes)


def _forward_call(p, q, k, v, slopes):
    """out, lse of the validated problem p through a buffer callback: the kernels on XLA's
    buffers and stream, or the CPU fallback on JAX's CPU backend."""
    lse_shape = (p.heads, p.total_q) if p.cu_seqlens is not None else (p.batch, p.heads, p.seqlen_q)
    result = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, lse_dtype(p.dtype_name)))

    def run(ctx, outs, q, k, v, *rest):
        out, lse = outs
        run_p = _with_slopes(p, slopes, rest)
        if not _on_gpu(q):
            o, l = fallback.forward(*map(numpy.asarray, (q, k, v)), run_p)
            numpy.asarray(out)[...] = o
            numpy.asarray(lse)[...] = l
            return
        device_id = _device_of(q)
        with _on_xla_stream(ctx, device_id):
            views = [_device_view(x, spec, device_id) for x, spec in zip((q, k, v, out, lse), specs)]
            if views[3].size:
                launch.run(planner.plan_forward(run_p, *views))

    given = (q, k, v)
    specs = [_Spec(x) for x in (*given, *result)]
    return buffer_callback(run, result)(q, k, v, *([] if slopes is None else [slopes]))


def _backward(dout, q, k, v, slopes, out, lse, o: Options):
    p = validation.check_backward_args(
        *map(_Spec, (dout, q, k, v, out, lse)), causal=o.causal, scale=o.scale, deterministic=o.deterministic,
        window=o.window, softcap=o.softcap,
    )
    p = validation.check_alibi_slopes(None if slopes is None else _Spec(slopes), p)
    if o.block_mask is not None:
        p = check_block_mask(o.block_mask, p)
    return _backward_call(validation.check_dropout(*o.dropout, p), dout, q, k, v, slopes, out, lse)


def _backward_call(p, dout, q, k, v, slopes, out, lse):
    """dq, dk, dv of the validated problem p through a buffer callback, as `_forward_call`."""
    result = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))

    def run(ctx, grads, dout, q, k, v, out, lse, *rest):
        run_p = _with_slopes(p, slopes, rest)
        if not _on_gpu(q):
            values = fallback.backward(*map(numpy.asarray, (dout, q, k, v, out, lse)), run_p)
            for g, value in zip(grads, values):
                numpy.asarray(g)[...] = value
            return
        device_id = _device_of(q)
        buffers = (dout, q, k, v, out, lse, *grads)
        with _on_xla_stream(ctx, device_id):
            if specs[1].size and specs[2].size:
                arrays = [_device_view(x, spec, device_id) for x, spec in zip(buffers, specs)]
            else:  # an empty problem's gradients are zeroed, which takes CuPy arrays
                arrays = [_as_cupy(x, spec.dtype) for x, spec in zip(buffers, specs)]
            common.backward_gpu(*arrays[:6], run_p, tuple(arrays[6:]))

    given = (dout, q, k, v, out, lse)
    specs = [_Spec(x) for x in (*given, *result)]
    return buffer_callback(run, result)(dout, q, k, v, out, lse, *([] if slopes is None else [slopes]))


# --------------------------------------------------------------------------- variable-length batches


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, causal=False, scale=None,
    deterministic=False, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
):
    """`cupyflash.attention_varlen` for packed JAX arrays (total, heads, head_dim), differentiable
    through `cupyflash.attention_varlen_backward`. The lengths are static, like causal: cu_seqlens_q,
    cu_seqlens_k must be concrete int32 values (NumPy arrays, lists, or JAX arrays that are not
    traced; under `jax.jit`, close over them or pass them as static arguments), checked when the
    call is traced; new lengths mean a new trace. Other arguments as `attention`. Returns out only."""
    cu_seqlens = tuple(_concrete_lengths(x, name) for x, name in ((cu_seqlens_q, "cu_seqlens_q"),
                                                                 (cu_seqlens_k, "cu_seqlens_k")))
    dropout_p, seed, offset = validation.check_dropout_args(dropout_p, seed, offset)
    options = Options(causal=bool(causal), scale=scale, deterministic=bool(deterministic),
                      window=None if window is None else tuple(window), softcap=softcap, dropout_p=dropout_p,
                      seed=seed, offset=offset)
    return _varlen_vjp(q, k, v, _slopes(alibi_slopes, q), (cu_seqlens, max_seqlen_q, max_seqlen_k), options)


def _concrete_lengths(x, name: str) -> tuple:
    """cu_seqlens as a hashable value (for a static argument) from which `_lengths` rebuilds it
    exactly, dtype included, for the shared checks."""
    if isinstance(x, (list, tuple)):
        return ("list", tuple(x))
    try:
        array = numpy.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(
            f"{name} must be concrete (NumPy, a list, or a JAX array that is not traced): "
            f"cupyflash.jax.attention_varlen takes the lengths as static arguments; under jax.jit close over them "
            f"or mark them static"
        ) from e
    return ("array", array.tobytes(), array.dtype.str, array.shape)


def _lengths(static) -> object:
    if static[0] == "list":
        return list(static[1])
    _, data, dtype, shape = static
    return numpy.frombuffer(data, numpy.dtype(dtype)).reshape(shape)


def _varlen_problem(q, k, v, slopes, lengths: tuple, o: Options, dout=None, out=None, lse=None):
    cu_seqlens, max_q, max_k = lengths
    cu_seqlens = [_lengths(cu) for cu in cu_seqlens]
    options = dict(causal=o.causal, scale=o.scale, window=o.window, softcap=o.softcap)
    if dout is None:
        p = validation.check_varlen_args(*map(_Spec, (q, k, v)), *cu_seqlens, max_q, max_k, return_lse=True, **options)
    else:
        p = validation.check_varlen_backward_args(*map(_Spec, (dout, q, k, v, out, lse)), *cu_seqlens, max_q, max_k,
                                                  deterministic=o.deterministic, **options)
    p = validation.check_alibi_slopes(None if slopes is None else _Spec(slopes), p)
    return validation.check_dropout(*o.dropout, p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _varlen_vjp(q, k, v, slopes, lengths, options):
    return _forward_call(_varlen_problem(q, k, v, slopes, lengths, options), q, k, v, slopes)[0]


def _varlen_fwd(q, k, v, slopes, lengths, options):
    out, lse = _forward_call(_varlen_problem(q, k, v, slopes, lengths, options), q, k, v, slopes)
    return out, (q, k, v, slopes, out, lse)


def _varlen_bwd(lengths, options, residuals, dout):
    q, k, v, slopes, out, lse = residuals
    p = _varlen_problem(q, k, v, slopes, lengths, options, dout, out, lse)
    grads = _backward_call(p, dout, q, k, v, slopes, out, lse)
    return (*grads, None if slopes is None else jnp.zeros_like(slopes))


_varlen_vjp.defvjp(_varlen_fwd, _varlen_bwd)


def _on_gpu(buffer) -> bool:
    # A CPU buffer has no CUDA interface: newer JAX raises its runtime error (UNIMPLEMENTED) on the
    # attribute, which hasattr does not catch.
    try:
        buffer.__cuda_array_interface__
    except (AttributeError, getattr(jax.errors, "JaxRuntimeError", AttributeError)):
        return False
    return True


def _device_of(buffer) -> int:
    import cupy

    return cupy.cuda.runtime.pointerGetAttributes(buffer.__cuda_array_interface__["data"][0]).device


# CuPy streams wrapping XLA's, by (device, stream handle): one per stream a process uses (making one
# on every call cost microseconds of each callback).
_STREAMS: dict = {}
_STREAMS_KEPT = 64


def _on_xla_stream(ctx, device_id: int):
    """The device and XLA's stream of the callback as CuPy's current ones (so that a workspace
    from CuPy's pool is reused in that stream's order)."""
    import cupy

    stream = _STREAMS.get((device_id, ctx.stream))
    if stream is None:
        with cupy.cuda.Device(device_id):
            stream = frameworks.external_stream(ctx.stream, device_id)
        workspace.keep_bounded(_STREAMS, (device_id, ctx.stream), stream, _STREAMS_KEPT)
    stack = contextlib.ExitStack()
    stack.enter_context(cupy.cuda.Device(device_id))
    stack.enter_context(stream)
    return stack


def _device_view(buffer, spec: _Spec, device_id: int) -> frameworks.DeviceView:
    """An XLA device buffer (C-contiguous, of the call's spec: the interface spells bfloat16 as an
    opaque void type) as the planner reads it: its address, shape, strides and dtype. A view takes
    about a microsecond where a CuPy array of the buffer took several."""
    return frameworks.DeviceView(buffer.__cuda_array_interface__["data"][0], spec.shape, spec.strides, spec.dtype,
                                 device_id, buffer)


def _as_cupy(buffer, dtype):
    """A CuPy view of an XLA device buffer (C-contiguous) of the given dtype, built from the
    interface's pointer: the interface spells bfloat16 as an opaque void type."""
    import cupy

    info = buffer.__cuda_array_interface__
    shape = tuple(info["shape"])
    dtype = numpy.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    memory = cupy.cuda.UnownedMemory(info["data"][0], nbytes, buffer)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))
