"""The torch adapter's calls on tensors (cupyflash.torch's operators run these): CUDA tensors read
in place, through the prepared call of their signature (api/prepared.py) where the call has one,
else checked and planned in full; torch's current stream and caching allocator as a
workspace.Stream; host copies of varlen lengths, read once per tensor; other tensors (CPU ones,
other dtypes) through cupyflash's generic path (DLPack, and its checks)."""

from __future__ import annotations

import contextlib
import functools
import numbers
import weakref

import numpy
import torch

from cupyflash import validation
from cupyflash.api import common, prepared, varlen
from cupyflash.dispatch import decode as decode_planner
from cupyflash.dispatch import plan as planner
from cupyflash.dispatch import policy as policies
from cupyflash.frameworks import arrays as frameworks
from cupyflash.problem import Options, lse_dtype
from cupyflash.runtime import launch, workspace
from cupyflash.validation import BFLOAT16

CUPY_DTYPES = {torch.float16: numpy.float16, torch.bfloat16: BFLOAT16, torch.float32: numpy.float32,
                torch.float64: numpy.float64}
_NUMPY_DTYPES = {**{t: numpy.dtype(d) for t, d in CUPY_DTYPES.items()}, torch.int32: numpy.dtype(numpy.int32)}


def is_int(x, low=-(2**63), high=2**63) -> bool:
    """An int (not a bool) in [low, high): what an operator's int argument carries."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and low <= x < high



def view(x) -> frameworks.DeviceView:
    """A CUDA tensor that `on_gpu` took, as the kernels read it in place."""
    itemsize = x.element_size()
    return frameworks.DeviceView(x.data_ptr(), tuple(x.shape), tuple(s * itemsize for s in x.stride()),
                                 _NUMPY_DTYPES[x.dtype], x.device.index, x)


def as_torch(x):
    """A result of the generic path as a torch tensor (DLPack, no copy)."""
    return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)


def on_gpu(*tensors) -> bool:
    """Whether the kernels take these tensors in place: CUDA tensors of the dtypes they read. Others
    (CPU tensors, other dtypes, empty ones) go the generic way, whose checks name what is wrong."""
    return all(isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in CUPY_DTYPES and x.numel() for x in tensors)


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


class TorchStream:
    """`with TorchStream(x):` runs CuPy on x's device and PyTorch's current stream there."""

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


def on_torch_stream(x):
    """CuPy's current stream set to PyTorch's current stream on x's device (nothing for CPU)."""
    return TorchStream(x) if x.is_cuda else contextlib.nullcontext()


LSE_DTYPES = {numpy.dtype(numpy.float32): torch.float32, numpy.dtype(numpy.float64): torch.float64}


# --------------------------------------------------------------------------- prepared calls
#
# The dense, varlen and decode operators' CUDA calls without ALiBi slopes go through
# api/prepared.py's cache of prepared calls, keyed by each tensor's shape, strides, dtype, device and
# 16-byte alignment, the options (typed by the operators' schemas; with their types for varlen,
# whose autograd.Function path passes anything), dropout's probability (its seed and offset are
# written per call), key padding's shape (its int32 CUDA lengths' address written per call) and,
# for varlen, the lengths' values: a call whose signature was prepared
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
            x = make(n, dtype=LSE_DTYPES.get(numpy.dtype(dtype)) or _TORCH_DTYPES[numpy.dtype(dtype)], device=index)
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
    return workspace.Stream(ptr, index, capturing, *_allocators(index), graph_pool=True)


def prepared_forward(q, k, v, options: tuple, seed, offset, state=None, seqlens_k=None):
    """out, lse of the dense forward operator through the signature's prepared call (made by this
    call if it is the first), or None where the tensors are not the kernels' to read in place (or
    dropout's seed or offset is out of range: the checks name it). Dropout's probability is part of
    the signature, its seed and offset the call's own; `state`, a CUDA int64 tensor (seed, offset),
    is read by the kernels in their place; so are the key lengths `seqlens_k` (`_padding_values`)."""
    causal, scale, windowed, left, right, softcap, dropout_p = options
    values = _dropout_values(dropout_p, seed, offset, state)
    padding = _padding_values(seqlens_k, q)
    if values is None or padding is None:
        return None

    def check(arrays, origins):
        return common.checked_problem("forward", arrays, origins, Options(
            causal=causal, scale=scale, window=(left, right) if windowed else None, softcap=softcap, return_lse=True,
            seqlens_k=seqlens_k, dropout_p=dropout_p, seed=seed, offset=offset))

    key = ("torch forward", _signature(q) + _signature(k) + _signature(v), options, _padding_key(seqlens_k))
    return _prepared_forward_call(key, q, k, v, check, {**values, **padding})


def _padding_values(seqlens_k, q):
    """The per-call address of a padded batch's key lengths (`seqused_k`): {} without them, None
    where the prepared calls do not take them (not an int32 vector on q's GPU: host lengths, whose
    values the full path checks)."""
    if seqlens_k is None:
        return {}
    if (seqlens_k.is_cuda and seqlens_k.dtype == torch.int32 and seqlens_k.dim() == 1 and seqlens_k.is_contiguous()
            and seqlens_k.get_device() == q.get_device()):
        return {"seqused_k": seqlens_k.data_ptr()}
    return None


def _padding_key(seqlens_k):
    """The key lengths' part of a signature: their shape (the checks read nothing else of a GPU
    vector; its values are each call's own)."""
    return None if seqlens_k is None else tuple(seqlens_k.shape)


def _dropout_values(dropout_p, seed, offset, state=None):
    """The seed and offset a prepared bind writes, and the address of a device (seed, offset) that
    the kernels read in their place (none without dropout), or None where they are out of the
    kernels' range (the full path's checks then say so)."""
    if not dropout_p > 0:
        return {}
    if not (0 <= seed < 2**64 and 0 <= offset < 2**32):
        return None
    return {"dropout_seed": seed, "dropout_offset": offset, "dropout_state": 0 if state is None else state.data_ptr()}


def prepared_backward(dout, q, k, v, out, lse, options: tuple, seed, offset, state=None, seqlens_k=None):
    """dq, dk, dv of the dense backward operator through the signature's prepared call, as
    `prepared_forward`."""
    if dout.dim() == 4 and dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum()
        dout = dout.contiguous()
    causal, scale, windowed, left, right, softcap, deterministic, dropout_p = options
    values = _dropout_values(dropout_p, seed, offset, state)
    padding = _padding_values(seqlens_k, q)
    if values is None or padding is None:
        return None

    def check(arrays, origins):
        return common.checked_problem("backward", arrays, origins, Options(
            causal=causal, scale=scale, window=(left, right) if windowed else None, softcap=softcap,
            deterministic=deterministic, seqlens_k=seqlens_k, dropout_p=dropout_p, seed=seed, offset=offset))

    key = ("torch backward", _signature(dout) + _signature(q) + _signature(k) + _signature(v) + _signature(out)
           + _signature(lse), options, _padding_key(seqlens_k))
    return _prepared_backward_call(key, (dout, q, k, v, out, lse), check, {**values, **padding})


def _prepared_varlen(kind: str, tensors: tuple, lengths: tuple, options: dict):
    """A varlen call without ALiBi slopes through its signature's prepared call, the lengths' values
    (host copies) part of the signature: kind "forward" (tensors q, k, v; returns out, lse) or
    "backward" (dout, q, k, v, out, lse; returns dq, dk, dv). None where it takes the generic path."""
    forward = kind == "forward"
    more = () if forward else (options["deterministic"],)
    signed = _varlen_key(f"torch varlen {kind}", tensors, lengths, options, more)
    if signed is None:
        return None
    key, values = signed
    cu_q, cu_k, max_q, max_k = lengths

    def check(arrays, origins):
        flags = dict(causal=options["causal"], scale=options["scale"], window=options["window"],
                     softcap=options["softcap"])
        if forward:
            p = validation.check_varlen_args(*arrays.values(), cu_q, cu_k, max_q, max_k, return_lse=True, **flags)
        else:
            p = validation.check_varlen_backward_args(*arrays.values(), cu_q, cu_k, max_q, max_k,
                                                      deterministic=options["deterministic"], **flags)
        return validation.check_dropout(options["dropout_p"], options["seed"], options["offset"], p)

    if forward:
        return _prepared_forward_call(key, *tensors, check, values)
    return _prepared_backward_call(key, tensors, check, values)


def _varlen_key(kind: str, tensors: tuple, lengths: tuple, options: dict, more: tuple):
    """(signature, dropout's per-call values) of a varlen call: its tensors', its host lengths'
    dtypes and values, max_seqlen, and its options with their types (dropout's probability; its
    seed and offset are the call's own); None for a call the prepared calls do not take (ALiBi,
    lengths that are not host arrays, options of other types or out of range: the checks name
    them)."""
    cu_q, cu_k, max_q, max_k = lengths
    dropout_p, seed, offset = options["dropout_p"], options["seed"], options["offset"]
    if not (options["alibi_slopes"] is None and type(dropout_p) is float and 0.0 <= dropout_p < 1.0
            and (seed is None if dropout_p == 0.0 else is_int(seed)) and is_int(offset)
            and type(cu_q) is numpy.ndarray and type(cu_k) is numpy.ndarray
            and all(m is None or is_int(m) for m in (max_q, max_k))):
        return None
    try:
        flags = common.option_key((options["causal"], options["scale"], options["window"], options["softcap"],
                                   dropout_p, *more))
    except TypeError:
        return None
    values = _dropout_values(dropout_p, seed, offset)
    if values is None:
        return None
    signature = ()
    for x in tensors:
        signature += _signature(x)
    return (kind, signature, cu_q.dtype.str, cu_q.tobytes(), cu_k.dtype.str, cu_k.tobytes(), max_q, max_k, flags), values


def _prepared_forward_call(key, q, k, v, check, values: dict):
    """out, lse through the prepared call of `key`, made on a miss from check(arrays, origins) ->
    the checked problem; None where the tensors are not the kernels' to read in place."""
    entry = prepared.lookup(key)
    if entry is None:
        if not on_gpu(q, k, v):
            return None
        with TorchStream(q):  # (the checks, and what the first plan uploads, on torch's stream)
            arrays, origins = common.ingest({"q": view(q), "k": view(k), "v": view(v)})
            p = check(arrays, origins)
            shapes = common.forward_shapes(p)
            out, lse = empty(shapes[0], q.dtype, q.device), empty(shapes[1], LSE_DTYPES[lse_dtype(p.dtype_name)], q.device)
            bind = planner.prepare_forward(p, *arrays.values(), view(out), view(lse), policies.current())
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
        if not on_gpu(*tensors):
            return None
        with TorchStream(q):
            arrays, origins = common.ingest(dict(zip(common.BACKWARD_ARRAYS, map(view, tensors))))
            p = check(arrays, origins)
            if p.batch == 0 or p.heads == 0:
                return None
            grads = _gradients(q, k, v, "seqused_k" in values)
            bind = planner.prepare_backward(p, *arrays.values(), *map(view, grads), policies.current())
        entry = prepared.PreparedCall(p, bind, policies.current(), None)
        prepared.keep(key, entry)
    if grads is None:
        grads = _gradients(q, k, v, "seqused_k" in values)
    index = q.get_device()
    with prepared.on_device(index):
        stream = _torch_stream(index)
        named = zip(planner.BACKWARD_POINTERS, (q, k, v, out, dout, *grads, lse))
        launch.run(entry.bind({**{name: x.data_ptr() for name, x in named}, **values}, stream), stream.ptr)
    return grads


def forward(q, k, v, options: Options) -> tuple:
    """out, lse of `cupyflash.attention` (options.return_lse True): CUDA tensors read in place and
    the results allocated by torch; other tensors take the generic path (DLPack, and its checks)."""
    if on_gpu(q, k, v):
        with TorchStream(q):
            arrays, origins = common.ingest({"q": view(q), "k": view(k), "v": view(v)})
            p = common.checked_problem("forward", arrays, origins, options)
            out_shape, lse_shape = common.forward_shapes(p)
            out = empty(out_shape, q.dtype, q.device)
            lse = empty(lse_shape, LSE_DTYPES[lse_dtype(p.dtype_name)], q.device)
            # (workspaces from torch's allocator: a CUDA-graph capture takes them from its pool)
            common.forward_gpu(*arrays.values(), p, view(out), view(lse), _torch_stream(q.get_device()))
        return out, lse
    # DLPack refuses tensors that require grad; the kernels only read them.
    given = dict(zip(("q", "k", "v"), (x.detach() if isinstance(x, torch.Tensor) else x for x in (q, k, v))))
    with on_torch_stream(q):
        return tuple(map(as_torch, common.forward_call(given, options)))


def backward(dout, q, k, v, out, lse, options: Options) -> tuple:
    """dq, dk, dv of `cupyflash.attention_backward`, as `forward` runs the forward."""
    if dout.dim() == 4 and dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum()
        dout = dout.contiguous()
    if on_gpu(dout, q, k, v, out, lse):
        with TorchStream(q):
            given = dict(zip(common.BACKWARD_ARRAYS, map(view, (dout, q, k, v, out, lse))))
            arrays, origins = common.ingest(given)
            p = common.checked_problem("backward", arrays, origins, options)
            grads = _gradients(q, k, v, p.seqlens_k is not None)
            common.backward_gpu(*arrays.values(), p, tuple(map(view, grads)), _torch_stream(q.get_device()))
        return grads
    given = dict(zip(common.BACKWARD_ARRAYS, (x.detach() for x in (dout, q, k, v, out, lse))))
    with on_torch_stream(q):
        grads = tuple(map(as_torch, common.backward_call(given, options)))
    return laid_out_like(grads, (q, k, v))


def _gradients(q, k, v, padded: bool) -> tuple:
    """dq, dk, dv to be written; a padded batch's dk and dv zeroed, its padding keys being no
    block's to write (their gradient is 0)."""
    dq, dk, dv = (empty_like(x) for x in (q, k, v))
    if padded:
        dk.zero_()
        dv.zero_()
    return dq, dk, dv


def laid_out_like(grads, inputs) -> tuple:
    """Gradients in `empty_like(input)`'s layout, which the operators' fake results promise (the
    generic path's come back contiguous)."""
    out = []
    for g, x in zip(grads, inputs):
        like = empty_like(x)
        out.append(g if g.stride() == like.stride() else like.copy_(g))
    return tuple(out)


# Host copies of length tensors (cu_seqlens), by tensor: a packed batch's lengths go to every
# layer's forward and backward, and each read of a CUDA tensor waits for the GPU. An entry holds
# only while it is the same live tensor at the same version (an in-place write bumps it) and
# address.
_HOST_LENGTHS: dict = {}
_HOST_LENGTHS_KEPT = 64


def host_lengths(x):
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
    return (*(host_lengths(x) if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex()
              and x.dtype != torch.bool else x for x in lengths[:2]), *lengths[2:])


def varlen_forward(q, k, v, cu_seqlens, options: dict) -> tuple:
    cu_seqlens = _varlen_lengths(cu_seqlens)
    if all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        results = _prepared_varlen("forward", (q, k, v), cu_seqlens, _all_varlen_options(options))
        if results is not None:
            return results
    q, k, v = (x.detach() for x in (q, k, v))
    if isinstance(options.get("alibi_slopes"), torch.Tensor):
        options = dict(options, alibi_slopes=options["alibi_slopes"].detach())
    with on_torch_stream(q):
        return tuple(map(as_torch, varlen.attention_varlen(q, k, v, *cu_seqlens, return_lse=True, **options)))


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens, options: dict) -> tuple:
    cu_seqlens = _varlen_lengths(cu_seqlens)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if all(isinstance(x, torch.Tensor) for x in (q, k, v, out, lse)):
        grads = _prepared_varlen("backward", (dout, q, k, v, out, lse), cu_seqlens, _all_varlen_options(options))
        if grads is not None:
            return grads
    inputs = (q, k, v)
    q, k, v, out, lse, dout = (x.detach() for x in (q, k, v, out, lse, dout))
    with on_torch_stream(q):
        grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, *cu_seqlens, **options)
    return laid_out_like(tuple(map(as_torch, grads)), inputs)


def prepared_decode(q, k_cache, v_cache, lengths, k_new, v_new, options: tuple):
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
        if not (on_gpu(*tensors) and len({x.get_device() for x in tensors}) == 1 and (lengths is None or (
                lengths.is_cuda and lengths.dtype == torch.int32 and lengths.dim() == 1 and lengths.is_contiguous()
                and lengths.get_device() == q.get_device()))):
            return None
        causal, scale, windowed, left, right, softcap, num_splits = options
        views = [None if x is None else view(x) for x in (q, k_cache, v_cache, k_new, v_new)]
        try:  # (host lengths of the same shape stand in for the GPU ones, whose values are never read)
            d = validation.check_decode_args(
                *views[:3], None if lengths is None else numpy.zeros(lengths.shape[0], numpy.int32), *views[3:],
                causal=causal, scale=scale, return_lse=True, window=(left, right) if windowed else None,
                num_splits=num_splits, softcap=softcap)
        except (TypeError, ValueError):
            return None
        p = d.attention
        shapes = ((p.batch, p.seqlen_q, p.heads, p.head_dim), (p.batch, p.heads, p.seqlen_q),
                  LSE_DTYPES[lse_dtype(p.dtype_name)])
        out, lse = empty(shapes[0], q.dtype, q.device), empty(shapes[1], shapes[2], q.device)
        with TorchStream(q):
            bind = decode_planner.prepare_decode(d, *views[:3], *views[3:], None if lengths is None else view(lengths),
                                                 view(out), view(lse), policies.current())
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
