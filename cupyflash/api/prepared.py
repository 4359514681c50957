"""One prepared call per call signature.

A training or inference loop calls with the same shapes, strides, dtypes, device and options again
and again. The first call with a signature is checked and planned in full; it leaves a
`PreparedCall` behind: the checked problem, its results' shapes and dtypes, and the planner's bind
(dispatch/plan.py's prepare_forward: the kernels, grids, the parameter structs with their pointer
slots, the tensor maps made for the addresses seen). A later call with that signature reads its
arrays' addresses, allocates the results and binds and launches: the checks read nothing that could
have changed. Bad input misses (it was never prepared) and is refused by the full path.

The signature holds everything the checks and the planner read: each array's type, shape, strides,
dtype, device and whether its address is 16-byte aligned (tensor maps need it), the options with
their types (causal=1 is refused where True is not), and the policy in force. Here, for
`cupyflash.attention` and `attention_backward` on CuPy arrays, calls with ALiBi slopes, key
lengths, a block mask or dropout take the full path every time. The torch adapter keys its
tensors the same way, in this one cache (frameworks/torch_calls.py), and also prepares its varlen calls
(the lengths' values in the signature), dropout (the seed and offset written per call) and
decoding steps.
"""

from __future__ import annotations

import contextlib

from cupyflash.api import common
from cupyflash.dispatch import plan as planner
from cupyflash.dispatch import policy as policies
from cupyflash.frameworks import arrays as frameworks
from cupyflash.problem import Options, lse_dtype
from cupyflash.runtime import launch, workspace

PREPARED: dict = {}  # signature -> PreparedCall, for every framework
PREPARED_KEPT = 256  # the first kept dropped first: a model's layers share a handful of signatures


class PreparedCall:
    """What the first call of a signature checked and planned: the problem (a DecodeProblem for a
    decoding step), the bind of its launches, the policy it was planned under, and the results'
    (out's shape, lse's shape, lse's dtype) for a forward or a decoding step."""

    __slots__ = ("problem", "bind", "policy", "shapes")

    def __init__(self, problem, bind, policy, shapes):
        self.problem, self.bind, self.policy, self.shapes = problem, bind, policy, shapes


def lookup(key) -> PreparedCall | None:
    """The prepared call of a signature, if it was planned under the policy now in force."""
    entry = PREPARED.get(key)
    return entry if entry is not None and entry.policy is policies.current() else None


def keep(key, entry: PreparedCall) -> None:
    workspace.keep_bounded(PREPARED, key, entry, PREPARED_KEPT)


def plain(alibi_slopes, seqlens_k, dropout_p, seed, offset) -> bool:
    """Whether a call's launches are the same from call to call: no ALiBi slopes, key lengths or
    dropout (a float 0.0, no seed, offset 0, as the defaults are)."""
    return (alibi_slopes is None and seqlens_k is None and type(dropout_p) is float and dropout_p == 0.0
            and seed is None and type(offset) is int and offset == 0)


def flags_key(causal, scale, window, softcap, flag) -> tuple:
    """A plain call's options as its signature holds them: with their types (causal=1 is refused
    where True is not; scale=True where 1.0 is not)."""
    return (type(causal), causal, type(scale), scale, None if window is None else common.option_key(window),
            type(softcap), softcap, type(flag), flag)


def signature(x) -> tuple:
    """A CuPy array's part of a call's signature: shape, strides, dtype, device, 16-byte alignment."""
    memory = x.data
    return x.shape, x.strides, x.dtype, memory.device_id, memory.ptr % 16 == 0


def on_device(device_id: int):
    """A context that makes the device current, where it is not already (entering one costs a
    microsecond or two on every call)."""
    import cupy

    if cupy.cuda.runtime.getDevice() == device_id:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device_id)


def forward_call(q, k, v, causal, scale, window, softcap, return_lse):
    """`cupyflash.attention`'s plain call (`plain`): through the prepared call of its signature
    where q, k and v are CuPy arrays, else `common.forward_call`."""
    ndarray = frameworks.cupy_ndarray_type()
    if ndarray is not None and type(q) is ndarray and type(k) is ndarray and type(v) is ndarray:
        try:
            key = ("cupy forward", signature(q) + signature(k) + signature(v),
                   flags_key(causal, scale, window, softcap, return_lse))
            entry = lookup(key)
        except TypeError:  # an unhashable option: the checks name it
            key = None
        if key is not None:
            return _forward(key, entry, q, k, v, lambda: Options(
                causal=causal, scale=scale, return_lse=return_lse, window=window, softcap=softcap))
    return common.forward_call({"q": q, "k": k, "v": v}, Options(
        causal=causal, scale=scale, return_lse=return_lse, window=window, softcap=softcap))


def _forward(key, entry, q, k, v, options):
    with on_device(q.data.device_id):
        if entry is None:
            given = {"q": q, "k": k, "v": v}
            ingested, origins = common.ingest(given)
            p = common.checked_problem("forward", ingested, origins, options())
            if q.size == 0:  # nothing to launch
                return common.forward(ingested, origins, p)
            shapes = common.forward_shapes(p)
            out, lse = common.empty(shapes[0], q.dtype), common.empty(shapes[1], lse_dtype(p.dtype_name))
            bind = planner.prepare_forward(p, q, k, v, out, lse, policies.current())
            entry = PreparedCall(p, bind, policies.current(), (*shapes, lse.dtype))
            keep(key, entry)
        else:
            out, lse = common.empty(entry.shapes[0], q.dtype), common.empty(entry.shapes[1], entry.shapes[2])
        stream = workspace.cupy_stream()
        if not entry.problem.return_lse:
            workspace.keep_if_captured(stream, lse)  # (a graph's replays write it)
        pointers = {"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "o": out.data.ptr, "lse": lse.data.ptr}
        launch.run(entry.bind(pointers, stream), stream.ptr)
    return (out, lse) if entry.problem.return_lse else out


def backward_call(dout, q, k, v, out, lse, causal, scale, window, softcap, deterministic) -> tuple:
    """`cupyflash.attention_backward`'s plain call, as `forward_call`."""
    arrays = (dout, q, k, v, out, lse)
    ndarray = frameworks.cupy_ndarray_type()
    if ndarray is not None and all(type(x) is ndarray for x in arrays):
        try:
            key = ("cupy backward", signature(dout) + signature(q) + signature(k) + signature(v)
                   + signature(out) + signature(lse), flags_key(causal, scale, window, softcap, deterministic))
            entry = lookup(key)
        except TypeError:
            key = None
        if key is not None:
            return _backward(key, entry, arrays, lambda: Options(
                causal=causal, scale=scale, deterministic=deterministic, window=window, softcap=softcap))
    return common.backward_call(dict(zip(common.BACKWARD_ARRAYS, arrays)), Options(
        causal=causal, scale=scale, deterministic=deterministic, window=window, softcap=softcap))


def _backward(key, entry, arrays: tuple, options) -> tuple:
    dout, q, k, v, out, lse = arrays
    with on_device(q.data.device_id):
        if entry is None:
            ingested, origins = common.ingest(dict(zip(common.BACKWARD_ARRAYS, arrays)))
            p = common.checked_problem("backward", ingested, origins, options())
            if q.size == 0 or k.size == 0 or p.batch == 0 or p.heads == 0:  # no launch: the full path's zeros
                return common.backward(ingested, origins, p)
            grads = tuple(common.empty(x.shape, x.dtype) for x in (q, k, v))
            bind = planner.prepare_backward(p, dout, q, k, v, out, lse, *grads, policies.current())
            entry = PreparedCall(p, bind, policies.current(), None)
            keep(key, entry)
        else:
            grads = (common.empty(q.shape, q.dtype), common.empty(k.shape, k.dtype), common.empty(v.shape, v.dtype))
        named = zip(planner.BACKWARD_POINTERS, (q, k, v, out, dout, *grads, lse))
        stream = workspace.cupy_stream()
        launch.run(entry.bind({name: x.data.ptr for name, x in named}, stream), stream.ptr)
    return grads
