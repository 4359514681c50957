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
their types (causal=1 is refused where True is not), and the policy in force. Calls with ALiBi
slopes, key lengths, a block mask or dropout (arrays and seeds that change from call to call) take
the full path every time. This module serves CuPy arrays; the torch adapter keys its tensors the
same way (frameworks/torch.py).
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
PREPARED_KEPT = 256  # the oldest dropped first: a model's layers share a handful of signatures


class PreparedCall:
    """What the first call of a signature checked and planned: the problem, the bind of its
    launches, the policy it was planned under, and the results' shapes (forward: out and lse)."""

    __slots__ = ("problem", "bind", "policy", "shapes")

    def __init__(self, problem, bind, policy, shapes):
        self.problem, self.bind, self.policy, self.shapes = problem, bind, policy, shapes


def lookup(key) -> PreparedCall | None:
    """The prepared call of a signature, if it was planned under the policy now in force."""
    entry = PREPARED.get(key)
    return entry if entry is not None and entry.policy is policies.current() else None


def keep(key, entry: PreparedCall) -> None:
    workspace.keep_bounded(PREPARED, key, entry, PREPARED_KEPT)


def plain(o: Options) -> bool:
    """Whether a call's options leave its launches the same from call to call: no ALiBi slopes, key
    lengths, block mask or dropout (a float 0.0, no seed, offset 0, as the defaults are)."""
    return (o.alibi_slopes is None and o.seqlens_k is None and o.block_mask is None and type(o.dropout_p) is float
            and o.dropout_p == 0.0 and o.seed is None and type(o.offset) is int and o.offset == 0)


def option_key(o: Options, direction: str) -> tuple:
    """The options that a plain call's checks read, with their types; TypeError where unhashable."""
    flag = o.return_lse if direction == "forward" else o.deterministic
    return common.option_key((o.causal, o.scale, o.window, o.softcap, flag))


def _signature(x) -> tuple:
    """A CuPy array's part of a call's signature."""
    memory = x.data
    return x.shape, x.strides, x.dtype, memory.device_id, memory.ptr % 16 == 0


def _cupy_arrays(arrays) -> bool:
    ndarray = frameworks.cupy_ndarray_type()
    return ndarray is not None and all(type(x) is ndarray for x in arrays)


def on_device(device_id: int):
    """A context that makes the device current, where it is not already (entering one costs a
    microsecond or two on every call)."""
    import cupy

    if cupy.cuda.runtime.getDevice() == device_id:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device_id)


def forward_call(given: dict, options: Options):
    """`common.forward_call`, through the prepared call of the signature where the arrays are CuPy
    arrays and the options plain."""
    arrays = tuple(given[name] for name in common.FORWARD_ARRAYS)
    if not (_cupy_arrays(arrays) and plain(options)):
        return common.forward_call(given, options)
    try:
        key = ("cupy forward", *map(_signature, arrays), option_key(options, "forward"))
    except TypeError:  # an unhashable option: the checks name it
        return common.forward_call(given, options)
    q, k, v = arrays
    with on_device(q.data.device_id):
        entry = lookup(key)
        if entry is None:
            ingested, origins = common.ingest(given)
            p = common.checked_problem("forward", ingested, origins, options)
            if q.size == 0:  # nothing to launch
                return common.forward(ingested, origins, p)
            shapes = common.forward_shapes(p)
            out, lse = common.empty(shapes[0], q.dtype), common.empty(shapes[1], lse_dtype(p.dtype_name))
            bind = planner.prepare_forward(p, q, k, v, out, lse, policies.current())
            entry = PreparedCall(p, bind, policies.current(), shapes)
            keep(key, entry)
        else:
            out = common.empty(entry.shapes[0], q.dtype)
            lse = common.empty(entry.shapes[1], lse_dtype(entry.problem.dtype_name))
        stream = workspace.cupy_stream()
        if not entry.problem.return_lse:
            workspace.keep_if_captured(stream, lse)  # (a graph's replays write it)
        pointers = {"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "o": out.data.ptr, "lse": lse.data.ptr}
        launch.run(entry.bind(pointers, stream), stream.ptr)
    return (out, lse) if entry.problem.return_lse else out


def backward_call(given: dict, options: Options) -> tuple:
    """`common.backward_call`, through the prepared call of the signature as `forward_call`."""
    arrays = tuple(given[name] for name in common.BACKWARD_ARRAYS)
    if not (_cupy_arrays(arrays) and plain(options)):
        return common.backward_call(given, options)
    try:
        key = ("cupy backward", *map(_signature, arrays), option_key(options, "backward"))
    except TypeError:
        return common.backward_call(given, options)
    dout, q, k, v, out, lse = arrays
    with on_device(q.data.device_id):
        entry = lookup(key)
        if entry is None:
            ingested, origins = common.ingest(given)
            p = common.checked_problem("backward", ingested, origins, options)
            if q.size == 0 or k.size == 0 or p.batch == 0 or p.heads == 0:  # no launch: the full path's zeros
                return common.backward(ingested, origins, p)
            grads = tuple(common.empty(x.shape, x.dtype) for x in (q, k, v))
            bind = planner.prepare_backward(p, dout, q, k, v, out, lse, *grads, policies.current())
            entry = PreparedCall(p, bind, policies.current(), None)
            keep(key, entry)
        else:
            grads = tuple(common.empty(x.shape, x.dtype) for x in (q, k, v))
        named = zip(planner.BACKWARD_POINTERS, (q, k, v, out, dout, *grads, lse))
        stream = workspace.cupy_stream()
        launch.run(entry.bind({name: x.data.ptr for name, x in named}, stream), stream.ptr)
    return grads
