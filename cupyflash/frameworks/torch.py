"""cupyflash attention as a differentiable PyTorch function.

    import cupyflash.torch
    out = cupyflash.torch.attention(q, k, v, causal=True)   # q, k, v: torch tensors
    out.sum().backward()                                     # runs cupyflash.attention_backward

Tensors have the layout of `cupyflash.attention`: (batch, seq, heads, head_dim); a
(batch, heads, seq, head_dim) tensor passes as ``x.transpose(1, 2)`` without a copy. CUDA tensors
are read in place, the kernels run on PyTorch's current stream of their device, and the results
are allocated by torch's caching allocator (as its own operators' are). CPU tensors take
`cupyflash.attention`'s host path. The dense, varlen and decode calls are torch.library operators
(below), so torch.compile traces them; `attention_decode` declares its writes to the caches.
Importing this module imports torch, which cupyflash does not otherwise need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import weakref
from typing import Optional

import numpy
import torch

from cupyflash import validation
from cupyflash.api import common, decode, prepared, varlen
from cupyflash.dispatch import decode as decode_planner
from cupyflash.dispatch import plan as planner
from cupyflash.dispatch import policy as policies
from cupyflash.frameworks import arrays as frameworks
from cupyflash.problem import Options, lse_dtype
from cupyflash.runtime import launch, workspace
from cupyflash.validation import BFLOAT16

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_decode",
           "scaled_dot_product_attention", "FlashAttentionFunction", "FlashAttentionVarlenFunction"]

_CUPY_DTYPES = {torch.float16: numpy.float16, torch.bfloat16: BFLOAT16, torch.float32: numpy.float32,
                torch.float64: numpy.float64}
_NUMPY_DTYPES = {t: numpy.dtype(d) for t, d in _CUPY_DTYPES.items()}

# torch's own SDPA, taken when this module is imported: what scaled_dot_product_attention hands on
# the calls its kernels do not take, also after a program has set
# torch.nn.functional.scaled_dot_product_attention to it (looked up at call time, it found itself
# and recursed without end).
_torch_sdpa = torch.nn.functional.scaled_dot_product_attention


def attention(
    q, k, v, *, causal=False, scale=None, deterministic=False, block_mask=None, window=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, return_lse=False,
):
    """`cupyflash.attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
    alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset)` for torch tensors
    (k, v with fewer heads for GQA/MQA), with a backward pass (`cupyflash.attention_backward`) for
    autograd. `deterministic=True` makes the gradients bitwise reproducible (see
    attention_backward). With a `cupyflash.BlockMask` as block_mask,
    `cupyflash.block_sparse_attention` and its backward. The ALiBi slopes (a tensor or array) get
    no gradient. With dropout_p > 0 and no seed, the seed and offset come from torch's generator of
    q's device (`torch.cuda.manual_seed` makes CUDA calls reproducible, `torch.manual_seed` CPU
    ones), whose offset each call advances, as flash-attn draws its Philox state; the backward
    reuses them. Returns out, or (out, lse) with return_lse=True (lse gets no gradient)."""
    if isinstance(alibi_slopes, torch.Tensor):
        alibi_slopes = alibi_slopes.detach()
    args = None if block_mask is not None else _operator_args(
        q, k, v, causal, scale, window, softcap, alibi_slopes, dropout_p, seed, offset, deterministic)
    if args is not None:  # (the operator draws an absent dropout seed itself: torch.compile traces it whole)
        out, lse, _ = _AttentionOperator.apply(*args) if _needs_grad(q, k, v) else _attention_forward(*args)
    else:
        seed, offset = dropout_seed(dropout_p, seed, offset, q)
        options = Options(causal=causal, scale=scale, deterministic=deterministic, block_mask=block_mask,
                          window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                          offset=offset, return_lse=True)
        out, lse = _eager(FlashAttentionFunction.apply)(q, k, v, options)
    return (out, lse) if return_lse else out


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, causal=False, scale=None,
    deterministic=False, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
    return_lse=False,
):
    """`cupyflash.attention_varlen` for packed torch tensors (total, heads, head_dim) with integer
    cu_seqlens tensors (or arrays), with `cupyflash.attention_varlen_backward` for autograd
    (the lengths and ALiBi slopes get no gradient); dropout as `attention`. Returns out, or
    (out, lse) with return_lse=True, lse (heads, total_q) without gradient."""
    seed, offset = dropout_seed(dropout_p, seed, offset, q)
    args = _operator_args(q, k, v, causal, scale, window, softcap, alibi_slopes, dropout_p, seed, offset,
                          deterministic)
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if (args is not None and all(isinstance(c, torch.Tensor) for c in lengths[:2])
            and all(m is None or _is_int(m) for m in lengths[2:])):
        args = (*args[:3], *lengths, *args[3:])
        out, lse = _VarlenOperator.apply(*args) if _needs_grad(q, k, v) else _attention_varlen_forward(*args)
    else:
        out, lse = _eager(FlashAttentionVarlenFunction.apply)(q, k, v, *lengths, causal, scale, deterministic, window,
                                                              softcap, alibi_slopes, (dropout_p, seed, offset))
    return (out, lse) if return_lse else out


def _eager(function):
    """function run by torch.compile outside its graph (a graph break): the autograd.Function paths,
    whose host work it cannot trace."""
    return torch.compiler.disable(function, recursive=True)


# Philox offsets a call takes from torch's CUDA generator: it keeps them in multiples of 4.
_OFFSET_STEP = 4


def dropout_seed(dropout_p, seed, offset, x) -> tuple:
    """(seed, offset): as given, or with dropout and no seed, drawn from torch's generator of x's
    device. A CUDA generator gives its seed and its Philox offset, which the call advances (no
    device work, no synchronisation: flash-attn's way); the CPU generator a random seed."""
    if seed is not None or not (isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool)
                                and dropout_p > 0):
        return seed, offset
    if isinstance(x, torch.Tensor) and x.is_cuda:
        generator = torch.cuda.default_generators[x.device.index if x.device.index is not None else
                                                   torch.cuda.current_device()]
        position = generator.get_offset()
        generator.set_offset(position + _OFFSET_STEP)
        if not isinstance(offset, numbers.Integral) or isinstance(offset, bool):
            return generator.initial_seed(), offset  # the checks name what is wrong with it
        return generator.initial_seed(), (offset + position // _OFFSET_STEP) % 2**32
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64)), offset


def _view(x) -> frameworks.DeviceView:
    """A CUDA tensor that `_on_gpu` took, as the kernels read it in place."""
    itemsize = x.element_size()
    return frameworks.DeviceView(x.data_ptr(), tuple(x.shape), tuple(s * itemsize for s in x.stride()),
                                 _NUMPY_DTYPES[x.dtype], x.device.index, x)


def _as_torch(x):
    """A result of the generic path as a torch tensor (DLPack, no copy)."""
    return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)


def _on_gpu(*tensors) -> bool:
    """Whether the kernels take these tensors in place: CUDA tensors of the dtypes they read. Others
    (CPU tensors, other dtypes, empty ones) go the generic way, whose checks name what is wrong."""
    return all(isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in _CUPY_DTYPES and x.numel() for x in tensors)


def empty(shape, dtype, device):
    """Result allocation from torch's caching allocator, on its current stream (tests fill it with
    NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def empty_like(x):
    """A gradient for x: x's strides where x is dense (autograd would otherwise copy it to them)."""
    return torch.empty_like(x)


# CuPy streams wrapping torch's, by (device, cudaStream_t): one per stream a process uses, not one a
# call.
_STREAMS: dict = {}
_STREAMS_KEPT = 64


class _TorchStream:
    """`with _TorchStream(x):` runs CuPy on x's device and PyTorch's current stream there."""

    __slots__ = ("device", "stream")

    def __init__(self, x):
        import cupy

        index = x.device.index
        self.device = cupy.cuda.Device(index)
        handle = torch.cuda.current_stream(index).cuda_stream
        stream = _STREAMS.get((index, handle))
        if stream is None:
            with self.device:
                stream = frameworks.external_stream(handle, index)
            workspace.keep_bounded(_STREAMS, (index, handle), stream, _STREAMS_KEPT)
        self.stream = stream

    def __enter__(self):
        self.device.__enter__()
        self.stream.__enter__()

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)


def _on_torch_stream(x):
    """CuPy's current stream set to PyTorch's current stream on x's device (nothing for CPU)."""
    return _TorchStream(x) if x.is_cuda else contextlib.nullcontext()


_LSE_DTYPES = {numpy.dtype(numpy.float32): torch.float32, numpy.dtype(numpy.float64): torch.float64}


# --------------------------------------------------------------------------- prepared calls
#
# The dense, varlen and decode operators' CUDA calls without ALiBi slopes go through
# api/prepared.py's cache of prepared calls, keyed by each tensor's shape, strides, dtype, device and
# 16-byte alignment, the options (typed by the operators' schemas; with their types for varlen,
# whose autograd.Function path passes anything), dropout's probability (its seed and offset are
# written per call) and, for varlen, the lengths' values: a call whose signature was prepared
# allocates its results and workspaces from torch's caching allocator and launches on torch's
# current stream, nothing else (no checks, no CuPy stream or array objects).


def _signature(x) -> tuple:
    return x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() % 16 == 0


def _raw_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


# torch's own accessor of the current cudaStream_t (what code that torch.compile generates calls):
# ~0.2 us against current_stream's ~3.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _raw_stream)


_ALLOCATORS: dict = {}  # device index -> (empty, zeros) of workspace.Stream


def _allocators(index: int) -> tuple:
    allocators = _ALLOCATORS.get(index)
    if allocators is None:
        def allocate(make, n, dtype):
            x = make(n, dtype=_LSE_DTYPES.get(numpy.dtype(dtype)) or _TORCH_DTYPES[numpy.dtype(dtype)], device=index)
            return x, x.data_ptr()

        allocators = _ALLOCATORS[index] = (functools.partial(allocate, torch.empty),
                                           functools.partial(allocate, torch.zeros))
    return allocators


# (the counters: uint32 to the kernels, int32 to torch, whose uint32 tensors have few operators)
_TORCH_DTYPES = {numpy.dtype(numpy.uint32): torch.int32, numpy.dtype(numpy.int32): torch.int32}


def _torch_stream(index: int) -> workspace.Stream:
    """torch's current stream on the device, with its caching allocator (`workspace.Stream`)."""
    import cupy

    ptr = _raw_stream(index)
    capturing = cupy.cuda.runtime.streamIsCapturing(ptr) != cupy.cuda.runtime.streamCaptureStatusNone
    return workspace.Stream(ptr, index, capturing, *_allocators(index))


def _prepared_forward(q, k, v, options: tuple, seed, offset):
    """out, lse of the dense forward operator through the signature's prepared call (made by this
    call if it is the first), or None where the tensors are not the kernels' to read in place (or
    dropout's seed or offset is out of range: the checks name it). Dropout's probability is part of
    the signature, its seed and offset the call's own."""
    causal, scale, windowed, left, right, softcap, dropout_p = options
    values = _dropout_values(dropout_p, seed, offset)
    if values is None:
        return None

    def check(arrays, origins):
        return common.checked_problem("forward", arrays, origins, Options(
            causal=causal, scale=scale, window=(left, right) if windowed else None, softcap=softcap, return_lse=True,
            dropout_p=dropout_p, seed=seed, offset=offset))

    return _prepared_forward_call(("torch forward", _signature(q) + _signature(k) + _signature(v), options),
                                  q, k, v, check, values)


def _dropout_values(dropout_p, seed, offset):
    """The seed and offset a prepared bind writes (none without dropout), or None where they are out
    of the kernels' range (the full path's checks then say so)."""
    if not dropout_p > 0:
        return {}
    if not (0 <= seed < 2**64 and 0 <= offset < 2**32):
        return None
    return {"dropout_seed": seed, "dropout_offset": offset}


def _prepared_backward(dout, q, k, v, out, lse, options: tuple, seed, offset):
    """dq, dk, dv of the dense backward operator through the signature's prepared call, as
    `_prepared_forward`."""
    if dout.dim() == 4 and dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum()
        dout = dout.contiguous()
    causal, scale, windowed, left, right, softcap, deterministic, dropout_p = options
    values = _dropout_values(dropout_p, seed, offset)
    if values is None:
        return None

    def check(arrays, origins):
        return common.checked_problem("backward", arrays, origins, Options(
            causal=causal, scale=scale, window=(left, right) if windowed else None, softcap=softcap,
            deterministic=deterministic, dropout_p=dropout_p, seed=seed, offset=offset))

    key = ("torch backward", _signature(dout) + _signature(q) + _signature(k) + _signature(v) + _signature(out)
           + _signature(lse), options)
    return _prepared_backward_call(key, (dout, q, k, v, out, lse), check, values)


def _prepared_varlen_forward(q, k, v, lengths: tuple, options: dict):
    """out, lse of a varlen forward without ALiBi slopes or dropout through its signature's prepared
    call, the lengths' values (host copies) part of the signature; None where it takes the generic
    path."""
    key = _varlen_key("torch varlen forward", (q, k, v), lengths, options, ())
    values = None if key is None else _dropout_values(options["dropout_p"], options["seed"], options["offset"])
    if values is None:
        return None
    cu_q, cu_k, max_q, max_k = lengths

    def check(arrays, origins):
        p = validation.check_varlen_args(
            *arrays.values(), cu_q, cu_k, max_q, max_k, causal=options["causal"], scale=options["scale"],
            return_lse=True, window=options["window"], softcap=options["softcap"])
        return validation.check_dropout(options["dropout_p"], options["seed"], options["offset"], p)

    return _prepared_forward_call(key, q, k, v, check, values)


def _prepared_varlen_backward(dout, q, k, v, out, lse, lengths: tuple, options: dict):
    """dq, dk, dv of a varlen backward through its signature's prepared call, as
    `_prepared_varlen_forward`."""
    key = _varlen_key("torch varlen backward", (dout, q, k, v, out, lse), lengths, options,
                      (options["deterministic"],))
    values = None if key is None else _dropout_values(options["dropout_p"], options["seed"], options["offset"])
    if values is None:
        return None
    cu_q, cu_k, max_q, max_k = lengths

    def check(arrays, origins):
        p = validation.check_varlen_backward_args(
            *arrays.values(), cu_q, cu_k, max_q, max_k, causal=options["causal"], scale=options["scale"],
            deterministic=options["deterministic"], window=options["window"], softcap=options["softcap"])
        return validation.check_dropout(options["dropout_p"], options["seed"], options["offset"], p)

    return _prepared_backward_call(key, (dout, q, k, v, out, lse), check, values)


def _varlen_key(kind: str, tensors: tuple, lengths: tuple, options: dict, more: tuple):
    """A varlen call's signature: its tensors', its host lengths' dtypes and values, max_seqlen,
    and its options with their types (dropout's probability; its seed and offset are the call's
    own); None for a call the prepared calls do not take (ALiBi, lengths that are not host arrays,
    options of other types: the checks name them)."""
    cu_q, cu_k, max_q, max_k = lengths
    dropout_p, seed, offset = options["dropout_p"], options["seed"], options["offset"]
    if not (options["alibi_slopes"] is None and type(dropout_p) is float and 0.0 <= dropout_p < 1.0
            and (seed is None if dropout_p == 0.0 else _is_int(seed)) and _is_int(offset)
            and type(cu_q) is numpy.ndarray and type(cu_k) is numpy.ndarray
            and all(m is None or _is_int(m) for m in (max_q, max_k))):
        return None
    try:
        flags = common.option_key((options["causal"], options["scale"], options["window"], options["softcap"],
                                   dropout_p, *more))
    except TypeError:
        return None
    signature = ()
    for x in tensors:
        signature += _signature(x)
    return (kind, signature, cu_q.dtype.str, cu_q.tobytes(), cu_k.dtype.str, cu_k.tobytes(), max_q, max_k, flags)


def _prepared_forward_call(key, q, k, v, check, values: dict):
    """out, lse through the prepared call of `key`, made on a miss from check(arrays, origins) ->
    the checked problem; None where the tensors are not the kernels' to read in place."""
    entry = prepared.lookup(key)
    if entry is None:
        if not _on_gpu(q, k, v):
            return None
        with _TorchStream(q):  # (the checks, and what the first plan uploads, on torch's stream)
            arrays, origins = common.ingest({"q": _view(q), "k": _view(k), "v": _view(v)})
            p = check(arrays, origins)
            shapes = common.forward_shapes(p)
            out, lse = empty(shapes[0], q.dtype, q.device), empty(shapes[1], _LSE_DTYPES[lse_dtype(p.dtype_name)], q.device)
            bind = planner.prepare_forward(p, *arrays.values(), _view(out), _view(lse), policies.current())
        entry = prepared.PreparedCall(p, bind, policies.current(), (*shapes, lse.dtype))
        prepared.keep(key, entry)
    else:
        out = empty(entry.shapes[0], q.dtype, q.device)
        lse = empty(entry.shapes[1], entry.shapes[2], q.device)
    index = q.get_device()
    with prepared.on_device(index):
        stream = _torch_stream(index)
        pointers = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": out.data_ptr(),
                    "lse": lse.data_ptr(), **values}
        launch.run(entry.bind(pointers, stream), stream.ptr)
    return out, lse


def _prepared_backward_call(key, tensors: tuple, check, values: dict):
    """dq, dk, dv through the prepared call of `key`, as `_prepared_forward_call`; tensors: dout,
    q, k, v, out, lse."""
    dout, q, k, v, out, lse = tensors
    entry = prepared.lookup(key)
    grads = None
    if entry is None:
        if not _on_gpu(*tensors):
            return None
        with _TorchStream(q):
            arrays, origins = common.ingest(dict(zip(common.BACKWARD_ARRAYS, map(_view, tensors))))
            p = check(arrays, origins)
            if p.batch == 0 or p.heads == 0:
                return None
            grads = tuple(empty_like(x) for x in (q, k, v))
            bind = planner.prepare_backward(p, *arrays.values(), *map(_view, grads), policies.current())
        entry = prepared.PreparedCall(p, bind, policies.current(), None)
        prepared.keep(key, entry)
    if grads is None:
        grads = tuple(empty_like(x) for x in (q, k, v))
    index = q.get_device()
    with prepared.on_device(index):
        stream = _torch_stream(index)
        named = zip(planner.BACKWARD_POINTERS, (q, k, v, out, dout, *grads, lse))
        launch.run(entry.bind({**{name: x.data_ptr() for name, x in named}, **values}, stream), stream.ptr)
    return grads


def _forward(q, k, v, options: Options) -> tuple:
    """out, lse of `cupyflash.attention` (options.return_lse True): CUDA tensors read in place and
    the results allocated by torch; other tensors take the generic path (DLPack, and its checks)."""
    if _on_gpu(q, k, v):
        with _TorchStream(q):
            arrays, origins = common.ingest({"q": _view(q), "k": _view(k), "v": _view(v)})
            p = common.checked_problem("forward", arrays, origins, options)
            out_shape, lse_shape = common.forward_shapes(p)
            out = empty(out_shape, q.dtype, q.device)
            lse = empty(lse_shape, _LSE_DTYPES[lse_dtype(p.dtype_name)], q.device)
            # (workspaces from torch's allocator: a CUDA-graph capture takes them from its pool)
            common.forward_gpu(*arrays.values(), p, _view(out), _view(lse), _torch_stream(q.get_device()))
        return out, lse
    # DLPack refuses tensors that require grad; the kernels only read them.
    given = dict(zip(("q", "k", "v"), (x.detach() if isinstance(x, torch.Tensor) else x for x in (q, k, v))))
    with _on_torch_stream(q):
        return tuple(map(_as_torch, common.forward_call(given, options)))


def _backward(dout, q, k, v, out, lse, options: Options) -> tuple:
    """dq, dk, dv of `cupyflash.attention_backward`, as `_forward` runs the forward."""
    if dout.dim() == 4 and dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum()
        dout = dout.contiguous()
    if _on_gpu(dout, q, k, v, out, lse):
        with _TorchStream(q):
            given = dict(zip(common.BACKWARD_ARRAYS, map(_view, (dout, q, k, v, out, lse))))
            arrays, origins = common.ingest(given)
            p = common.checked_problem("backward", arrays, origins, options)
            grads = tuple(empty_like(x) for x in (q, k, v))
            if p.seqlens_k is not None:  # padding keys are no block's to write: their gradient is 0
                grads[1].zero_()
                grads[2].zero_()
            common.backward_gpu(*arrays.values(), p, tuple(map(_view, grads)), _torch_stream(q.get_device()))
        return grads
    given = dict(zip(common.BACKWARD_ARRAYS, (x.detach() for x in (dout, q, k, v, out, lse))))
    with _on_torch_stream(q):
        grads = tuple(map(_as_torch, common.backward_call(given, options)))
    return _laid_out_like(grads, (q, k, v))


def _laid_out_like(grads, inputs) -> tuple:
    """Gradients in `empty_like(input)`'s layout, which the operators' fake results promise (the
    generic path's come back contiguous)."""
    out = []
    for g, x in zip(grads, inputs):
        like = empty_like(x)
        out.append(g if g.stride() == like.stride() else like.copy_(g))
    return tuple(out)


def _save(ctx, tensors: tuple, options, *non_differentiable) -> None:
    """What an autograd.Function's backward reads: the tensors, the options; and which of its
    outputs get no gradient."""
    ctx.save_for_backward(*tensors)
    ctx.options = options
    ctx.mark_non_differentiable(*non_differentiable)
    if not torch.compiler.is_compiling():
        # The gradients of the outputs without one (lse, rng_state) stay None rather than zeros
        # that autograd would allocate and fill on every backward (two launches, ~40 us a step).
        ctx.set_materialize_grads(False)


class FlashAttentionFunction(torch.autograd.Function):
    """Forward: out, lse = cupyflash.attention(...); saves q, k, v, out, lse (O(seqlen) extra) and
    returns both (lse without gradient). Backward: cupyflash.attention_backward, recomputing the
    attention matrix tile by tile. What the custom operators below do, for the calls whose options
    they cannot carry (a BlockMask, ALiBi slopes that are not a tensor, options of the wrong type,
    which the checks then name)."""

    @staticmethod
    def forward(ctx, q, k, v, options: Options):
        if options.return_lse is not True:  # (lse is saved for the backward)
            options = dataclasses.replace(options, return_lse=True)
        out, lse = _forward(q, k, v, options)
        _save(ctx, (q, k, v, out, lse), options, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # (out took no part in the loss)
            return None, None, None, None
        return (*_backward(dout, *ctx.saved_tensors, ctx.options), None)


# --------------------------------------------------------------------------- torch.library operators
#
# The dense, varlen and decode calls as torch operators (flash-attn's way since 2.7): torch.compile
# traces through them (their fake implementations give the results' shapes, dtypes and strides),
# and autograd.Functions outside them (_AttentionOperator, _VarlenOperator) call the backward
# operators. They are defined with torch.library.define/impl rather than custom_op, whose
# register_autograd wrapper cost ~150 us a call at these 14-21 arguments on torch 2.11 (its
# fill_defaults reads the schema's argument list once per argument): the forward operator alone
# took 281 us of host time a call against the autograd.Function's 111 (H200 machine). A window
# travels as two optional ints and a flag, an absent seed as None.

_LIBRARY = torch.library.Library("cupyflash", "DEF")


def _operator(function, mutates_args=()):
    """Defines cupyflash::<function's name, without its leading underscore> with the schema of its
    annotations and `function` as its implementation on CPU and CUDA tensors; returns the
    operator (an OpOverload, which `torch.library.register_fake` and opcheck take)."""
    name = function.__name__.lstrip("_")
    _LIBRARY.define(name + torch.library.infer_schema(function, mutates_args=mutates_args))
    for key in ("CPU", "CUDA"):
        _LIBRARY.impl(name, function, key)
    return getattr(torch.ops.cupyflash, name).default


def _window_args(window) -> tuple:
    if window is None:
        return False, None, None
    left, right = window
    return True, left, right


def _operator_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p, seed,
                      offset, deterministic) -> Options:
    return Options(causal=causal, scale=scale, window=(window_left, window_right) if windowed else None,
                   softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset,
                   deterministic=deterministic, return_lse=True)


def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float], windowed: bool,
    window_left: Optional[int], window_right: Optional[int], softcap: Optional[float],
    alibi_slopes: Optional[torch.Tensor], dropout_p: float, seed: Optional[int], offset: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seed, offset = dropout_seed(dropout_p, seed, offset, q)
    if alibi_slopes is None and q.is_cuda:
        results = _prepared_forward(q, k, v, (causal, scale, windowed, window_left, window_right, softcap, dropout_p),
                                    seed, offset)
        if results is not None:
            return (*results, _rng_state(q, dropout_p, seed, offset))
    options = _operator_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p,
                                seed, offset, deterministic)
    return (*_forward(q, k, v, options), _rng_state(q, dropout_p, seed, offset))


_attention_forward = _operator(_attention_forward)


def _rng_state(q, dropout_p, seed, offset) -> torch.Tensor:
    """With dropout, the seed and offset the forward drew (from torch's generator where none was
    given) as a host tensor the backward operator reads them from; without, an empty tensor on q's
    device (no host tensor in a graph that CUDA graphs capture, no copy)."""
    if dropout_p > 0:
        return torch.tensor([seed, offset], dtype=torch.int64)
    return q.new_empty((0,), dtype=torch.int64)


def _fake_rng_state(q, dropout_p) -> torch.Tensor:
    if dropout_p > 0:
        return q.new_empty((2,), dtype=torch.int64, device="cpu")
    return q.new_empty((0,), dtype=torch.int64)


@torch.library.register_fake(_attention_forward)
def _(q, k, v, causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset,
      deterministic):
    batch, seqlen_q, heads, _ = q.shape
    lse_type = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=lse_type),
            _fake_rng_state(q, dropout_p))


def _attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: Optional[float], windowed: bool, window_left: Optional[int], window_right: Optional[int],
    softcap: Optional[float], alibi_slopes: Optional[torch.Tensor], dropout_p: float, rng_state: torch.Tensor,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seed, offset = _drawn(dropout_p, rng_state)
    if alibi_slopes is None and q.is_cuda:
        grads = _prepared_backward(dout, q, k, v, out, lse, (causal, scale, windowed, window_left, window_right,
                                                             softcap, deterministic, dropout_p), seed, offset)
        if grads is not None:
            return grads
    options = _operator_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p,
                                seed, offset, deterministic)
    return _backward(dout, q, k, v, out, lse, options)


_attention_backward = _operator(_attention_backward)


def _drawn(dropout_p, rng_state) -> tuple:
    """(seed, offset) as the forward's `_rng_state` holds them (seed None without dropout)."""
    if not dropout_p > 0:
        return None, 0
    seed, offset = rng_state.tolist()
    return seed, offset


@torch.library.register_fake(_attention_backward)
def _(dout, q, k, v, out, lse, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _AttentionOperator(torch.autograd.Function):
    """Autograd of the dense operators: the forward operator, then the backward operator on the
    saved q, k, v, out, lse and the forward's rng_state (its dropout seed and offset)."""

    @staticmethod
    def forward(ctx, q, k, v, *options):
        out, lse, rng_state = _attention_forward(q, k, v, *options)
        _save(ctx, (q, k, v, out, lse, rng_state), options, lse, rng_state)
        return out, lse, rng_state

    @staticmethod
    def backward(ctx, dout, _dlse, _drng):
        if dout is None:
            return (None,) * (3 + len(ctx.options))
        q, k, v, out, lse, rng_state = ctx.saved_tensors
        causal, scale, windowed, left, right, softcap, slopes, dropout_p, _seed, _offset, deterministic = ctx.options
        grads = _attention_backward(dout, q, k, v, out, lse, causal, scale, windowed, left, right, softcap, slopes,
                                    dropout_p, rng_state, deterministic)
        return (*grads,) + (None,) * len(ctx.options)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def _operator_args(q, k, v, causal, scale, window, softcap, alibi_slopes, dropout_p, seed, offset,
                   deterministic):
    """The custom operator's arguments for a call it can carry, else None (the call then takes
    FlashAttentionFunction, whose checks name a wrong argument)."""
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        return None
    if window is not None and not (isinstance(window, (tuple, list)) and len(window) == 2
                                   and all(w is None or _is_int(w) for w in window)):
        return None
    if not (isinstance(causal, bool) and isinstance(deterministic, bool) and _is_int(offset, 0, 2**32)
            and (seed is None or _is_int(seed, 0, 2**63)) and _is_float(dropout_p)
            and all(x is None or _is_float(x) for x in (scale, softcap))
            and (alibi_slopes is None or isinstance(alibi_slopes, torch.Tensor))):
        return None
    windowed, left, right = _window_args(window)
    return (q, k, v, causal, None if scale is None else float(scale), windowed, left, right,
            None if softcap is None else float(softcap), alibi_slopes, float(dropout_p), seed, offset, deterministic)


def _is_int(x, low=-(2**63), high=2**63) -> bool:
    """An int (not a bool) in [low, high): what an operator's int argument carries."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and low <= x < high


def _is_float(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class FlashAttentionVarlenFunction(torch.autograd.Function):
    """As FlashAttentionFunction, for `cupyflash.attention_varlen` and its backward: the calls the
    varlen operators below cannot carry (cu_seqlens that are not tensors, options of other types)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, deterministic,
                window, softcap, alibi_slopes, dropout=(0.0, None, 0)):
        cu_seqlens = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        options = dict(causal=causal, scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                       dropout_p=dropout[0], seed=dropout[1], offset=dropout[2])
        out, lse = _varlen_forward(q, k, v, cu_seqlens, options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu_seqlens, ctx.options = cu_seqlens, dict(options, deterministic=deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        return _varlen_backward(dout, *ctx.saved_tensors, ctx.cu_seqlens, ctx.options) + (None,) * 11


# Host copies of length tensors (cu_seqlens), by tensor: a packed batch's lengths go to every
# layer's forward and backward, and each read of a CUDA tensor waits for the GPU. An entry holds
# only while it is the same live tensor at the same version (an in-place write bumps it) and
# address.
_HOST_LENGTHS: dict = {}
_HOST_LENGTHS_KEPT = 64


def _host_lengths(x):
    """A tensor's values as a read-only NumPy array, read once per tensor and version. The varlen
    checks then read the copy, and the kernels an upload of it that is kept for the same values
    (runtime/params.py's _device_lengths)."""
    kept = _HOST_LENGTHS.get(id(x))
    if kept is not None and kept[0]() is x and kept[1:3] == (x._version, x.data_ptr()):
        return kept[3]
    host = x.detach().cpu().numpy()
    host.setflags(write=False)
    workspace.keep_bounded(_HOST_LENGTHS, id(x), (weakref.ref(x), x._version, x.data_ptr(), host), _HOST_LENGTHS_KEPT)
    return host


_VARLEN_DEFAULTS = dict(causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None,
                       offset=0, deterministic=False)


def _all_varlen_options(options: dict) -> dict:
    """A varlen call's options with the defaults of those it left out."""
    return {**_VARLEN_DEFAULTS, **options}


def _varlen_lengths(lengths: tuple) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) with the cu_seqlens that are
    integer tensors as their kept host copies (others go as given: the checks name them)."""
    return (*(_host_lengths(x) if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex()
              and x.dtype != torch.bool else x for x in lengths[:2]), *lengths[2:])


def _varlen_forward(q, k, v, cu_seqlens, options: dict) -> tuple:
    cu_seqlens = _varlen_lengths(cu_seqlens)
    if all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        results = _prepared_varlen_forward(q, k, v, cu_seqlens, _all_varlen_options(options))
        if results is not None:
            return results
    q, k, v = (x.detach() for x in (q, k, v))
    if isinstance(options.get("alibi_slopes"), torch.Tensor):
        options = dict(options, alibi_slopes=options["alibi_slopes"].detach())
    with _on_torch_stream(q):
        return tuple(map(_as_torch, varlen.attention_varlen(q, k, v, *cu_seqlens, return_lse=True, **options)))


def _varlen_backward(dout, q, k, v, out, lse, cu_seqlens, options: dict) -> tuple:
    cu_seqlens = _varlen_lengths(cu_seqlens)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if all(isinstance(x, torch.Tensor) for x in (q, k, v, out, lse)):
        grads = _prepared_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, _all_varlen_options(options))
        if grads is not None:
            return grads
    inputs = (q, k, v)
    q, k, v, out, lse, dout = (x.detach() for x in (q, k, v, out, lse, dout))
    with _on_torch_stream(q):
        grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, *cu_seqlens, **options)
    return _laid_out_like(tuple(map(_as_torch, grads)), inputs)


def _varlen_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset):
    return dict(causal=causal, scale=scale, window=(window_left, window_right) if windowed else None,
                softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset)


def _attention_varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], causal: bool, scale: Optional[float], windowed: bool,
    window_left: Optional[int], window_right: Optional[int], softcap: Optional[float],
    alibi_slopes: Optional[torch.Tensor], dropout_p: float, seed: Optional[int], offset: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    options = _varlen_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p,
                              seed, offset)
    return _varlen_forward(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), options)


_attention_varlen_forward = _operator(_attention_varlen_forward)


@torch.library.register_fake(_attention_varlen_forward)
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
    total_q, heads, _ = q.shape
    lse_type = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((heads, total_q), dtype=lse_type)


def _attention_varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
    causal: bool, scale: Optional[float], windowed: bool, window_left: Optional[int], window_right: Optional[int],
    softcap: Optional[float], alibi_slopes: Optional[torch.Tensor], dropout_p: float, seed: Optional[int], offset: int,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _varlen_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p,
                              seed, offset)
    return _varlen_backward(dout, q, k, v, out, lse, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                            dict(options, deterministic=deterministic))


_attention_varlen_backward = _operator(_attention_varlen_backward)


@torch.library.register_fake(_attention_varlen_backward)
def _(dout, q, k, v, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _VarlenOperator(torch.autograd.Function):
    """Autograd of the varlen operators, as _AttentionOperator."""

    @staticmethod
    def forward(ctx, q, k, v, *options):
        out, lse = _attention_varlen_forward(q, k, v, *options)
        _save(ctx, (q, k, v, out, lse), options, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * (3 + len(ctx.options))
        q, k, v, out, lse = ctx.saved_tensors
        grads = _attention_varlen_backward(dout, q, k, v, out, lse, *ctx.options)
        return (*grads,) + (None,) * len(ctx.options)


def attention_backward(
    dout, q, k, v, out, lse, *, causal=False, scale=None, deterministic=False, window=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
):
    """`cupyflash.attention_backward` for torch tensors: (dq, dk, dv) of the forward's out and lse,
    on torch's current stream, through the backward operator (for a custom autograd.Function built
    from cupyflash's pieces, such as ring attention's). out and lse are used as given: the backward
    recomputes P from lse, so a merged (global) out and lse give each key block's share of the
    gradients. With dropout, pass the forward's seed and offset."""
    if isinstance(alibi_slopes, torch.Tensor):
        alibi_slopes = alibi_slopes.detach()
    args = _operator_args(q, k, v, causal, scale, window, softcap, alibi_slopes, dropout_p, seed, offset,
                          deterministic)
    tensors = (dout, out, lse)
    if args is None or not all(isinstance(x, torch.Tensor) for x in tensors) or (dropout_p > 0 and seed is None):
        options = Options(causal=causal, scale=scale, deterministic=deterministic, window=window, softcap=softcap,
                          alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset)
        return _eager(_backward)(dout, q, k, v, out, lse, options)
    state = _rng_state(q, args[10], seed, offset)
    return _attention_backward(dout, *args[:3], out, lse, *args[3:11], state, deterministic)


def attention_decode(
    q, k_cache, v_cache, cache_seqlens=None, *, k_new=None, v_new=None, causal=False, window=None, scale=None,
    return_lse=False, num_splits=None, softcap=None, alibi_slopes=None,
):
    """`cupyflash.attention_decode` for torch tensors, as a torch operator that says it writes
    k_cache and v_cache (the append of k_new, v_new), so torch.compile traces a decoding step
    whole. cache_seqlens: an integer tensor (a CUDA one is used as given, never read back), an int,
    a list, or None. No gradient. Returns out, or (out, lse) with return_lse=True."""
    lengths = cache_seqlens
    if isinstance(q, torch.Tensor) and q.dim() == 4 and _is_int(lengths, 0, 2**31):  # one length for every sequence
        lengths = torch.full((q.shape[0],), lengths, dtype=torch.int32)  # host values, checked as such
    elif isinstance(lengths, (list, tuple)) and all(_is_int(n, 0, 2**31) for n in lengths):
        lengths = torch.tensor(lengths, dtype=torch.int32)
    args = _operator_args(q, k_cache, v_cache, causal, scale, window, softcap, alibi_slopes, 0.0, None, 0, False)
    carried = (args is not None and (lengths is None or isinstance(lengths, torch.Tensor))
               and all(x is None or isinstance(x, torch.Tensor) for x in (k_new, v_new))
               and (num_splits is None or _is_int(num_splits)))
    if not carried:  # the generic path, whose checks name a wrong argument
        return _eager(decode.attention_decode)(
            q, k_cache, v_cache, cache_seqlens, k_new=k_new, v_new=v_new, causal=causal, window=window, scale=scale,
            return_lse=return_lse, num_splits=num_splits, softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = _attention_decode(q, k_cache, v_cache, lengths, k_new, v_new, causal, args[4], *args[5:10],
                                 num_splits)
    return (out, lse) if return_lse else out


def _prepared_decode(q, k_cache, v_cache, lengths, k_new, v_new, options: tuple):
    """out, lse of a decoding step through its signature's prepared call, or None where the step
    takes decode.attention_decode (host lengths, whose values are checked; tensors the kernels do
    not read in place; bad arguments, which its checks name). GPU lengths are used as given."""
    signature = _signature(q) + _signature(k_cache) + _signature(v_cache)
    for x in (lengths, k_new, v_new):
        signature += (None,) if x is None else _signature(x)
    key = ("torch decode", signature, options)
    entry = prepared.lookup(key)
    if entry is None:
        tensors = [x for x in (q, k_cache, v_cache, k_new, v_new) if x is not None]
        if not (_on_gpu(*tensors) and len({x.get_device() for x in tensors}) == 1 and (lengths is None or (
                lengths.is_cuda and lengths.dtype == torch.int32 and lengths.dim() == 1 and lengths.is_contiguous()
                and lengths.get_device() == q.get_device()))):
            return None
        causal, scale, windowed, left, right, softcap, num_splits = options
        views = [None if x is None else _view(x) for x in (q, k_cache, v_cache, k_new, v_new)]
        try:  # (host lengths of the same shape stand in for the GPU ones, whose values are never read)
            d = validation.check_decode_args(
                *views[:3], None if lengths is None else numpy.zeros(lengths.shape[0], numpy.int32), *views[3:],
                causal=causal, scale=scale, return_lse=True, window=(left, right) if windowed else None,
                num_splits=num_splits, softcap=softcap)
        except (TypeError, ValueError):
            return None
        p = d.attention
        shapes = ((p.batch, p.seqlen_q, p.heads, p.head_dim), (p.batch, p.heads, p.seqlen_q),
                  _LSE_DTYPES[lse_dtype(p.dtype_name)])
        out, lse = empty(shapes[0], q.dtype, q.device), empty(shapes[1], shapes[2], q.device)
        with _TorchStream(q):
            bind = decode_planner.prepare_decode(d, *views[:3], *views[3:], None if lengths is None else _view(lengths),
                                                 _view(out), _view(lse), policies.current())
        entry = prepared.PreparedCall(d, bind, policies.current(), shapes)
        prepared.keep(key, entry)
    else:
        out, lse = empty(entry.shapes[0], q.dtype, q.device), empty(entry.shapes[1], entry.shapes[2], q.device)
    index = q.get_device()
    with prepared.on_device(index):
        stream = _torch_stream(index)
        pointers = {name: 0 if x is None else x.data_ptr() for name, x in
                    zip(decode_planner.DECODE_POINTERS, (q, k_cache, v_cache, k_new, v_new, out, lse, lengths))}
        launch.run(entry.bind(pointers, stream), stream.ptr)
    return out, lse


def _attention_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: Optional[torch.Tensor],
    k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor], causal: bool, scale: Optional[float], windowed: bool,
    window_left: Optional[int], window_right: Optional[int], softcap: Optional[float],
    alibi_slopes: Optional[torch.Tensor], num_splits: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    if alibi_slopes is None and q.is_cuda:
        results = _prepared_decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                   (causal, scale, windowed, window_left, window_right, softcap, num_splits))
        if results is not None:
            return results
    with _on_torch_stream(q):
        out, lse = decode.attention_decode(
            q, k_cache, v_cache, cache_seqlens, k_new=k_new, v_new=v_new, causal=causal,
            window=(window_left, window_right) if windowed else None, scale=scale, return_lse=True,
            num_splits=num_splits, softcap=softcap, alibi_slopes=alibi_slopes)
    return _as_torch(out), _as_torch(lse)


_attention_decode = _operator(_attention_decode, mutates_args=("k_cache", "v_cache"))


@torch.library.register_fake(_attention_decode)
def _(q, k_cache, v_cache, *options):
    batch, seqlen_q, heads, _ = q.shape
    lse_type = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=lse_type)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """`torch.nn.functional.scaled_dot_product_attention` computed by cupyflash, with autograd:
    the same signature, (batch, heads, seq, head_dim) layout (or (batch, seq, head_dim), one head)
    and result, so that it can stand in for SDPA.

    is_causal is SDPA's: query i sees keys 0..i, the mask aligned top-left (cupyflash's causal
    aligns bottom-right; the two agree when the lengths are equal). enable_gqa lets key and value
    have fewer heads, a divisor of query's. dropout_p applies whenever it is > 0, as in SDPA, with
    the seed drawn as `attention` draws it. The result is a (batch, heads, seq, head_dim) view of
    cupyflash's (batch, seq, heads, head_dim) output, not a contiguous tensor.

    What cupyflash's kernels do not take goes to torch's own SDPA, unchanged: an attn_mask (boolean
    or additive), a value head dim other than the query's, other numbers of dimensions, and key
    heads that differ from the query's without enable_gqa (which SDPA refuses)."""
    plain = (attn_mask is None and query.dim() in (3, 4) and key.dim() == value.dim() == query.dim()
             and value.shape[-1] == query.shape[-1]
             and (query.dim() == 3 or enable_gqa or key.shape[-3] == query.shape[-3]))
    if not plain:
        return _torch_sdpa(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            **({"enable_gqa": enable_gqa} if enable_gqa else {}))
    heads_axis = query.dim() == 4
    q, k, v = (x.transpose(1, 2) if heads_axis else x.unsqueeze(2) for x in (query, key, value))
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    window = None
    if is_causal and seqlen_q <= seqlen_k:  # keys past seqlen_q are seen by no query: top-left = bottom-right
        k, v = k[:, :seqlen_q], v[:, :seqlen_q]
    elif is_causal:
        window = (None, seqlen_q - seqlen_k)  # key j for query i when j <= i
    out = attention(q, k, v, causal=is_causal and window is None, scale=scale, window=window, dropout_p=dropout_p)
    return out.transpose(1, 2) if heads_axis else out.squeeze(2)
