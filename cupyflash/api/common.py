"""The steps every public call shares: ingest the arrays, check them (through the cache of checked
problems), plan and run on the GPU or the CPU fallback, export the results."""

from __future__ import annotations

import numpy

from cupyflash import validation
from cupyflash.block_mask import BlockMask, checked_for
from cupyflash.catalog import block_mask_granularity
from cupyflash.cpu import fallback
from cupyflash.dispatch import plan as planner
from cupyflash.frameworks import arrays as frameworks
from cupyflash.problem import AttentionProblem, Options, lse_dtype
from cupyflash.runtime import device as devices
from cupyflash.runtime import launch, workspace

FORWARD_ARRAYS = ("q", "k", "v")
BACKWARD_ARRAYS = ("dout", "q", "k", "v", "out", "lse")


# --------------------------------------------------------------------------- ingest


def ingest(given: dict) -> tuple[dict, dict]:
    """The named arrays as NumPy or CuPy (DLPack imports, no copies) and their origins, all on the
    host or all on one GPU."""
    origins = {name: frameworks.classify(x, name) for name, x in given.items()}
    frameworks.check_placement(origins)
    return {name: frameworks.ingest(x, origins[name], name) for name, x in given.items()}, origins


def ingest_side_array(x, name: str, q_origin: frameworks.Origin):
    """An argument array beside q (ALiBi slopes, sequence lengths) as NumPy or CuPy: on the host
    with any q, on a GPU only with q on the same GPU. None, ints and lists pass unchanged."""
    if x is None or isinstance(x, (int, numpy.integer, list, tuple)):
        return x
    origin = frameworks.classify(x, name)
    if origin.on_gpu and (not q_origin.on_gpu or origin.device_id != q_origin.device_id):
        where = f"GPU {q_origin.device_id}" if q_origin.on_gpu else "the host"
        raise ValueError(f"{name} is on GPU {origin.device_id} while q is on {where}; pass it on the host or on "
                         f"q's GPU")
    return frameworks.ingest(x, origin, name)


def ingest_slopes(slopes, q_origin: frameworks.Origin):
    """alibi_slopes as NumPy or CuPy: a host array (or list) with any q, a GPU array only with q on
    the same GPU."""
    if isinstance(slopes, (list, tuple)):
        slopes = numpy.asarray(slopes)
    return ingest_side_array(slopes, "alibi_slopes", q_origin)


# --------------------------------------------------------------------------- check


def check_block_mask(block_mask, p: AttentionProblem) -> AttentionProblem:
    """The problem with its block mask, whose blocks must hold whole tiles of every kernel that may
    run the problem (so that a mask works the same on every GPU, and on the CPU fallback)."""
    return checked_for(block_mask, p, block_mask_granularity(p.dtype_name, p.head_dim))


def checked_problem(direction: str, arrays: dict, origins: dict, options: Options) -> AttentionProblem:
    """A fixed-length call's checked problem: its arrays and options, then the ALiBi slopes, the
    block mask and seqlens_k, through the cache of checked problems where the call has a key; then
    dropout's probability, seed and offset (which change from call to call)."""
    o = options

    def check():
        if direction == "forward":
            p = validation.check_attention_args(*arrays.values(), causal=o.causal, scale=o.scale,
                                                return_lse=o.return_lse, window=o.window, softcap=o.softcap)
        else:
            p = validation.check_backward_args(*arrays.values(), causal=o.causal, scale=o.scale,
                                               deterministic=o.deterministic, window=o.window, softcap=o.softcap)
        p = validation.check_alibi_slopes(ingest_slopes(o.alibi_slopes, origins["q"]), p)
        if o.block_mask is not None:
            p = check_block_mask(o.block_mask, p)
        return validation.check_seqlens_k(ingest_side_array(o.seqlens_k, "seqlens_k", origins["q"]), p)

    key = None
    if o.alibi_slopes is None and o.seqlens_k is None:
        flag = o.return_lse if direction == "forward" else o.deterministic
        key = _call_key(direction, arrays.values(), (o.causal, o.scale, flag, o.window, o.softcap))
    return validation.check_dropout(*o.dropout, _checked(key, o.block_mask, check))


# A training or inference loop calls with the same shapes, strides, dtypes and options again and
# again, and the checks (with the parameter images the launches then build from the problem) were
# most of a call's host time. The checks read nothing else, so a call whose key passed them once
# passes them again: `_checked` gives back the problem object of the first such call, whose `memo`
# keeps what the planner and the launches derived from it. Dropout's seed and offset change from
# call to call and are checked apart; ALiBi slopes and seqlens_k (arrays, whose values matter) and
# unhashable options leave a call without a key, checked every time.
CHECKED: dict = {}  # call key -> AttentionProblem, calls without a block mask
CHECKED_KEPT = 256  # problems kept per cache (this one, and each BlockMask's), oldest dropped first


def _call_key(direction: str, arrays, options: tuple):
    """The key of a call's checks: direction, each array's type, shape, strides and dtype, and the
    options (`option_key`); None where an option cannot be hashed."""
    try:
        return (direction, tuple((type(x), x.shape, x.strides, x.dtype) for x in arrays), option_key(options))
    except TypeError:
        return None


def option_key(value):
    """value as a hashable key that tells apart values which compare equal across types (causal=1,
    refused, against True; scale=True against 1.0), inside tuples too; TypeError where unhashable."""
    if type(value) is tuple:
        return tuple(option_key(x) for x in value)
    hash(value)
    return (type(value), value)


def _checked(key, block_mask, check) -> AttentionProblem:
    """check()'s problem, the same object for every call with this key (and this block mask); a
    call without a key (None) is checked every time. Problems with a mask are kept by the mask,
    without it: a copy that `_with_block_mask` completes on each call, sharing its memo."""
    if key is None or not (block_mask is None or isinstance(block_mask, BlockMask)):
        return check()  # (a block_mask of another type is refused there)
    cache = CHECKED if block_mask is None else block_mask.checked_problems
    problem = cache.get(key)
    if problem is not None:
        return problem if block_mask is None else _with_block_mask(problem, block_mask)
    problem = check()
    workspace.keep_bounded(cache, key, problem if block_mask is None else _with_block_mask(problem, None),
                           CHECKED_KEPT)
    return problem


def _with_block_mask(p: AttentionProblem, block_mask) -> AttentionProblem:
    """p with another block_mask, sharing p's memo (dataclasses.replace starts a new memo, and costs
    ~10 us on every call's path)."""
    copy = object.__new__(type(p))
    copy.__dict__.update(p.__dict__)
    copy.__dict__["block_mask"] = block_mask
    return copy


# --------------------------------------------------------------------------- run and export


def forward(arrays: dict, origins: dict, p: AttentionProblem):
    """The checked forward on the arrays' side (the GPU, or the CPU fallback), results exported:
    out, or (out, lse)."""
    q, k, v = (arrays[name] for name in FORWARD_ARRAYS)
    if not origins["q"].on_gpu and not devices.gpu_available():
        out, lse = fallback.forward(q, k, v, p)
    else:
        if not origins["q"].on_gpu:
            import cupy

            q, k, v = (cupy.asarray(x) for x in (q, k, v))
        out, lse = forward_gpu(q, k, v, p)
    origin = origins["q"]
    out = frameworks.export(out, origin)
    return (out, frameworks.export(lse, origin)) if p.return_lse else out


def empty(shape, dtype):
    """Output allocation (the GPU tests replace it with NaN-filled arrays)."""
    import cupy

    return cupy.empty(shape, dtype=dtype)


def forward_shapes(p: AttentionProblem) -> tuple:
    """The shapes of out and lse: (batch, seqlen_q, heads, head_dim) and (batch, heads, seqlen_q),
    or packed (total_q, heads, head_dim) and (heads, total_q)."""
    if p.cu_seqlens is not None:
        return (p.total_q, p.heads, p.head_dim), (p.heads, p.total_q)
    return (p.batch, p.seqlen_q, p.heads, p.head_dim), (p.batch, p.heads, p.seqlen_q)


def forward_gpu(q, k, v, p: AttentionProblem, out=None, lse=None, stream: workspace.Stream | None = None):
    """out, lse of the checked problem on q's GPU (CuPy arrays), written into `out` and `lse` where
    given (of `forward_shapes`, any strides: the adapters' own tensors), on `stream` (default:
    CuPy's current stream)."""
    import cupy

    with cupy.cuda.Device(q.device.id):
        if out is None:
            out_shape, lse_shape = forward_shapes(p)
            out, lse = empty(out_shape, q.dtype), empty(lse_shape, lse_dtype(p.dtype_name))
        if out.size == 0:
            return out, lse
        stream = stream or workspace.cupy_stream()
        if not p.return_lse:
            workspace.keep_if_captured(stream, lse)  # (a graph's replays write it)
        launch.run(planner.plan_forward(p, q, k, v, out, lse, stream=stream), stream.ptr)
    return out, lse


def backward(arrays: dict, origins: dict, p: AttentionProblem) -> tuple:
    """The checked backward on the arrays' side (the GPU, or the CPU fallback), results exported."""
    given = tuple(arrays[name] for name in BACKWARD_ARRAYS)
    if not origins["q"].on_gpu and not devices.gpu_available():
        grads = fallback.backward(*given, p)
    else:
        if not origins["q"].on_gpu:
            import cupy

            given = tuple(cupy.asarray(x) for x in given)
        grads = backward_gpu(*given, p)
    return tuple(frameworks.export(g, origins["q"]) for g in grads)


def backward_gpu(dout, q, k, v, out, lse, p: AttentionProblem, grads=None, stream: workspace.Stream | None = None):
    """dq, dk, dv of the checked problem on q's GPU (CuPy arrays), written into `grads` where given
    (arrays of q's, k's and v's shapes, any strides; with seqlens_k, zeroed by the caller), its
    workspaces from `stream` (default: CuPy's current stream)."""
    import cupy

    with cupy.cuda.Device(q.device.id):
        if grads is None:
            dq = empty(q.shape, q.dtype)
            # Padding keys (seqlens_k) are no block's to write: their gradient is 0.
            dk, dv = ((cupy.zeros if p.seqlens_k is not None else empty)(x.shape, x.dtype) for x in (k, v))
        else:
            dq, dk, dv = grads
        if q.size == 0 or k.size == 0:  # no query, or no key: every gradient is 0 (and no grid of 0 blocks)
            for g in (dq, dk, dv):
                g.fill(0)
        else:
            stream = stream or workspace.cupy_stream()
            launch.run(planner.plan_backward(p, dout, q, k, v, out, lse, dq, dk, dv, stream=stream), stream.ptr)
    return dq, dk, dv


def forward_call(given: dict, options: Options):
    """A fixed-length forward call (attention, block_sparse_attention, the adapters): ingest, check,
    run, export."""
    arrays, origins = ingest(given)
    return forward(arrays, origins, checked_problem("forward", arrays, origins, options))


def backward_call(given: dict, options: Options) -> tuple:
    """A fixed-length backward call: ingest, check, run, export."""
    arrays, origins = ingest(given)
    return backward(arrays, origins, checked_problem("backward", arrays, origins, options))
