"""The one place that decides how a call runs: given a checked problem, its arrays and a device,
which kernel family, instantiation, tile and grid, which workspaces, and which fallback where a
tensor map cannot be made, all resolved before any launch.

`decide_forward` / `decide_backward` are pure: from the problem, a DeviceInfo, a Policy and the
arrays' layout (strides and alignment) they return a Decision that lists every kernel family in
order of preference with the reason it was taken or not (what `cupyflash.explain` prints).
`prepare_forward` / `prepare_backward` turn a decision into a bind for arrays of one layout: all
that does not depend on the arrays' addresses (the parameter struct's other fields, grids, static
arguments) made once; bind(pointers, stream) allocates the workspaces on the stream, writes the
addresses, picks the tensor maps made for them (taking the next family where the driver declines
a map) and returns a Plan that runtime.launch.run queues as it is. `plan_forward` /
`plan_backward` are prepare-then-bind on real arrays; api/prepared.py keeps a bind per call
signature.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy

from cupyflash.catalog import FAMILIES, Unavailable, Variant, bwd_row_kernel, dkdv_kernel, dq_kernel, forward_kernel
from cupyflash.catalog import params as structs
from cupyflash.catalog import tiles
from cupyflash.catalog.specs import BwdDkdvKernel
from cupyflash.catalog.tensor_cores import TcBwdDkdvKernel, WgmmaBwdDkdvKernel, WgmmaFwdWsKernel
from cupyflash.dispatch import policy as policies
from cupyflash.problem import AttentionProblem, lse_dtype
from cupyflash.runtime import device as devices
from cupyflash.runtime import launch, params, tma, workspace


@dataclasses.dataclass(frozen=True)
class Choice:
    family: str
    kernel: object | None  # the instantiation the family would run (None: it has none for the problem)
    taken: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """The kernels a problem can take on a device, best first (the later ones: fallbacks where the
    driver declines a tensor map), and every family's verdict; for the backward, the kernel that
    sums dQ (the deterministic dQ kernel or the conversion pass)."""

    direction: str
    kernels: tuple
    choices: tuple
    dq: object = None

    @property
    def kernel(self):
        return self.kernels[0]


class Launch(typing.NamedTuple):
    kernel: object
    grid: tuple
    args: tuple  # numpy arrays passed by value (the parameter struct first), or by address


@dataclasses.dataclass
class Plan:
    decision: Decision
    device_id: int
    launches: list
    keep_alive: tuple  # device arrays the launches read, alive until they are queued


def layout(**arrays) -> tuple:
    """The layout key of a call's arrays: each one's strides and whether its address is 16-byte
    aligned (what tensor maps need), in the order given."""
    return tuple((name, x.strides, x.data.ptr % 16 == 0) for name, x in arrays.items())


def _describable(lay: tuple, name: str, dims: tuple, itemsize: int = 2) -> bool:
    for n, strides, aligned in lay:
        if n == name:
            s = strides if len(strides) == 4 else strides[:1] + strides
            return aligned and tma.describable(0, itemsize, tuple(x // itemsize for x in s[:3]), dims)
    return False


def _fits(kernel, device: devices.DeviceInfo) -> str | None:
    if kernel.smem_bytes > device.smem_per_block:
        return f"needs {kernel.smem_bytes} bytes of shared memory a block, the device has {device.smem_per_block}"
    return None


def _device_verdict(family: str, p: AttentionProblem, device: devices.DeviceInfo) -> str | None:
    cc = device.compute_capability
    if family.startswith("sm90") and cc != tiles.WGMMA_COMPUTE_CAPABILITY:
        return f"built for sm_90a; the device is sm_{cc}"
    if family == "sm80" and cc < tiles.TENSOR_CORE_MIN_CC:
        return f"needs sm_80 or newer; the device is sm_{cc}"
    if p.dtype_name == "bfloat16" and cc < tiles.TENSOR_CORE_MIN_CC:
        return f"bfloat16's conversions need sm_80 or newer; the device is sm_{cc}"
    return None


def _variant(p: AttentionProblem) -> Variant:
    return Variant(p.local, p.block_mask is not None, p.modified, p.varlen)


def _verdicts(p: AttentionProblem, device: devices.DeviceInfo, kernels: list, choices: list) -> tuple:
    """Every family's verdict: the first accepted one taken, the others accepted after it as
    fallbacks (where a tensor map cannot be made), the families after the last never needed."""
    if not kernels:
        raise _no_kernel(p, device, choices)
    first = next(i for i, c in enumerate(choices) if c.taken)
    verdicts = [c if i <= first or not c.taken else
                dataclasses.replace(c, taken=False, reason="fallback, where the driver declines a tensor map")
                for i, c in enumerate(choices)]
    served = choices[first].family
    verdicts += [Choice(family, None, False, f"not needed: {served} serves the problem")
                 for family in FAMILIES[len(choices):]]
    return tuple(verdicts)


def _no_kernel(p: AttentionProblem, device: devices.DeviceInfo, choices: list) -> ValueError:
    scalar = next(c for c in choices if c.family == "scalar")
    too_large = scalar.kernel is not None and _fits(scalar.kernel, device) is not None
    return ValueError(f"{p.dtype_name} attention with head_dim {p.head_dim} on {device.name}: no kernel serves it "
                      f"({scalar.reason})." + (" Use a smaller head_dim or a lower precision." if too_large else ""))


# --------------------------------------------------------------------------- forward


_TMA_FAMILIES = ("sm90-tma", "sm90-ws")  # the builds that take tensor maps


def _unmappable(lay: tuple, names: tuple, dims: dict) -> str | None:
    """Why the named arrays cannot all take a tensor map (None: they can)."""
    bad = [n for n in names if not _describable(lay, n, dims[n])]
    if bad:
        return f"{', '.join(bad)} cannot take a tensor map (a base 16-byte aligned, strides multiples of 16 bytes)"
    return None


def _choose(p: AttentionProblem, device: devices.DeviceInfo, policy: policies.Policy, make, verdict) -> tuple:
    """Each family's kernel for the problem (make(family), or Unavailable) and its verdict (the
    device's, then verdict(family), then whether it fits: None is taken), best first, until a family
    that needs no tensor map is taken. Returns (the kernels taken, the verdicts)."""
    kernels, choices = [], []
    for family in FAMILIES:
        if family not in policy.families:
            choices.append(Choice(family, None, False, "left out by the policy"))
            continue
        try:
            kernel = make(family)
        except Unavailable as e:
            choices.append(Choice(family, None, False, str(e)))
            continue
        reason = _device_verdict(family, p, device) or verdict(family) or _fits(kernel, device)
        choices.append(Choice(family, kernel, reason is None, reason or "taken"))
        if reason is None:
            kernels.append(kernel)
            if family not in _TMA_FAMILIES:
                break  # needs no tensor map: nothing after it is ever taken
    return kernels, _verdicts(p, device, kernels, choices)


def decide_forward(p: AttentionProblem, device: devices.DeviceInfo, policy: policies.Policy, lay: tuple) -> Decision:
    """The forward's families for the problem, best first, and why each was taken or not (only
    those of policy.families are considered)."""
    d = tiles.padded_head_dim(p.head_dim)
    q_dims, kv_dims = (p.batch, p.seqlen_q, p.heads), (p.batch, p.seqlen_k, p.heads // p.kv_group)

    def verdict(family: str) -> str | None:
        if family.startswith("sm90") and not policy.hopper_forward:
            return "switched off (CUPYFLASH_HOPPER_FORWARD=0)"
        if family not in _TMA_FAMILIES:
            return None
        if not policy.tma:
            return "switched off (CUPYFLASH_HOPPER_TMA=0)"
        if family == "sm90-ws" and (why := _ws_forward_verdict(p, d, policy)):
            return why
        names = ("q", "k", "v", "o") if family == "sm90-ws" else ("k", "v")
        return _unmappable(lay, names, {"q": q_dims, "o": q_dims, "k": kv_dims, "v": kv_dims})

    kernels, choices = _choose(p, device, policy, lambda family: forward_kernel(
        family, p.dtype_name, p.head_dim, _variant(p), policy.float32_precision), verdict)
    return Decision("forward", tuple(kernels), choices)


def _ws_forward_verdict(p: AttentionProblem, d: int, policy: policies.Policy) -> str | None:
    if not policy.ws_forward:
        return "switched off (CUPYFLASH_HOPPER_WS=0)"
    most = policy.ws_forward_steps(d)
    if most is None:
        return None
    if p.block_mask is None:
        return f"at head dim {d} only for block masks of at most {most:g} key blocks a query tile"
    steps = p.block_mask.density * math.ceil(p.seqlen_k / tiles.WGMMA_FWD_WS_TILES[d].block_n)
    if steps > most:
        return f"the mask's query tiles walk {steps:.2g} key blocks on average, more than {most:g}"
    return None


def plan_forward(p: AttentionProblem, q, k, v, out, lse, policy: policies.Policy | None = None, kernel=None,
                 stream: workspace.Stream | None = None) -> Plan:
    """The forward's launch on these (validated) arrays: the decision's first kernel whose tensor maps
    the driver makes; or `kernel` (any forward instantiation, for tests and tuning). On `stream`
    (default: CuPy's current stream)."""
    bind = prepare_forward(p, q, k, v, out, lse, policy or policies.current(), kernel)
    pointers = {"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "o": out.data.ptr, "lse": lse.data.ptr,
                **dropout_values(p)}
    return bind(pointers, stream or workspace.cupy_stream())


def dropout_values(p: AttentionProblem, state: int = 0) -> dict:
    """The per-call values a bind of a problem with dropout takes beside the pointers: its seed and
    offset (which change from call to call; the rest of dropout is in the struct), and the address
    of a device (seed, offset) that the kernels read in their place (0: none)."""
    return {"dropout_seed": p.seed, "dropout_offset": p.offset, "dropout_state": state} if p.dropout else {}


# the 8-byte and the 4-byte per-call fields, by p.dropout
_SEED = {False: (), True: ("dropout_seed", "dropout_state")}
_OFFSET = {False: (), True: ("dropout_offset",)}


def _padding_slot(p: AttentionProblem, fields: dict) -> tuple:
    """A padded batch's key lengths as a per-call pointer (a prepared torch call writes each call's
    own) and its default, the problem's own lengths on the device; () and None without them."""
    return (("seqused_k",), fields["seqused_k"]) if p.seqlens_k is not None else ((), None)


def _memoisable(p: AttentionProblem) -> bool:
    """Whether a problem's launches can be prepared once: not with ALiBi slopes or sequence lengths,
    device arrays that each call makes."""
    return p.alibi_slopes is None and p.cu_seqlens is None and p.seqlens_k is None


def prepare_forward(p: AttentionProblem, q, k, v, out, lse, policy: policies.Policy, kernel=None):
    """The forward of arrays laid out as these (strides, 16-byte alignment) made ready: a function
    bind(pointers, stream) -> Plan of the call's addresses (q, k, v, o, lse) and stream, which only
    writes the addresses into the parameter struct and picks the tensor maps made for them. Everything
    else (the decision, the struct's other fields, grids, static arguments) is decided here once and
    kept in the problem's memo."""
    device_id = q.device.id
    lay = layout(q=q, k=k, v=v, o=out)
    key = ("forward", device_id, policy, lay, lse.strides, kernel)
    bind = p.memo.get(key)
    if bind is None:
        bind = _prepare_forward(p, device_id, policy, lay, (q, k, v, out, lse), kernel)
        if _memoisable(p):
            p.memo[key] = bind
    return bind


def _prepare_forward(p: AttentionProblem, device_id: int, policy: policies.Policy, lay: tuple, arrays: tuple, kernel):
    info = devices.info(device_id)
    decision = decide_forward(p, info, policy, lay)
    q, k, v, out, lse = arrays
    fields = {}
    fields["lse_batch_stride"], fields["lse_head_stride"] = params.row_statistics_strides(p)
    for name, x in (("q", q), ("k", k), ("v", v), ("o", out)):
        params.pointer_and_strides(fields, name, x)
    fields["lse"] = lse.data.ptr
    # keep_alive: the ALiBi slopes and sequence lengths the struct points to, until the launch is queued
    keep_alive = params.problem_fields(fields, p, device_id)
    padding, lengths = _padding_slot(p, fields)
    record = params.LaunchRecord(structs.FWD_PARAMS_DTYPE, {**fields, "query_tile_order": 0},
                                 ("q", "k", "v", "o", "lse", "query_tile_order", *_SEED[p.dropout], *padding),
                                 _OFFSET[p.dropout])
    kv_dims = (p.batch, p.seqlen_k, p.heads // p.kv_group)
    binders = []
    for candidate in ((kernel,) if kernel is not None else decision.kernels):
        if isinstance(candidate, WgmmaFwdWsKernel):
            binders.append(_ws_forward_binder(p, candidate, record, kv_dims, device_id, info))
        elif candidate.family == "sm90" and candidate.tma:  # the Hopper one-block kernel takes K's and V's maps
            binders.append(_kv_maps_forward_binder(p, candidate, record, kv_dims))
        else:
            extra = (launch.pinned(tma.NO_MAPS),) if candidate.family == "sm90" else ()
            grid = candidate.grid(p.batch, p.heads, p.seqlen_q)
            binders.append(lambda pointers, stream, c=candidate, g=grid, e=extra: (
                Launch(c, g, (record.params({**pointers, "query_tile_order": 0}), *e)),))

    def bind(pointers: dict, stream: workspace.Stream) -> Plan:
        if padding:
            pointers.setdefault("seqused_k", lengths)
        for binder in binders:
            launches = binder(pointers, stream)
            if launches is not None:
                return Plan(decision, device_id, list(launches), (keep_alive,))
        raise ValueError(f"no tensor map could be made for {kernel}")  # (only a forced TMA kernel gets here)

    return bind


def _ws_forward_binder(p: AttentionProblem, kernel, record, kv_dims: tuple, device_id: int, info):
    """The warp-specialised forward's launch for a call's pointers (None where the driver declines
    its tensor maps)."""
    tile = kernel.tile
    order = _query_tile_order(p, kernel, device_id)
    n_tiles = launch.pinned(numpy.array(kernel.n_tiles(p.batch, p.heads, p.seqlen_q), numpy.int32))
    grid = kernel.grid(p.batch, p.heads, p.seqlen_q, sm_count=info.sm_count)

    def make(fields):
        return tma.fwd_ws_tensor_maps(fields, (p.batch, p.seqlen_q, p.heads), kv_dims, p.dtype_name, p.head_dim,
                                      tile.block_m, tile.block_n, kernel.o_box_rows)

    def bind(pointers: dict, stream: workspace.Stream):
        maps = record.tensor_maps(("ws", tile.block_m, tile.block_n, kernel.o_box_rows,
                                   pointers["q"], pointers["k"], pointers["v"], pointers["o"]), make, pointers)
        if maps is None:
            return None
        claims = _address_argument(workspace.zeroed_counters(1, stream))
        return (Launch(kernel, grid, (record.params({**pointers, "query_tile_order": order}), maps, n_tiles, claims)),)

    return bind


def _kv_maps_forward_binder(p: AttentionProblem, kernel, record, kv_dims: tuple):
    """The Hopper one-block forward's launch with K's and V's tensor maps (KvTensorMaps) for a
    call's pointers (None where the driver declines them)."""
    block_n = kernel.tile.block_n
    grid = kernel.grid(p.batch, p.heads, p.seqlen_q)

    def make(fields):
        return tma.kv_tensor_maps(fields, kv_dims, p.dtype_name, p.head_dim, block_n)

    def bind(pointers: dict, stream: workspace.Stream):
        maps = record.tensor_maps(("kv", block_n, pointers["k"], pointers["v"]), make, pointers)
        if maps is None:
            return None
        return (Launch(kernel, grid, (record.params({**pointers, "query_tile_order": 0}), maps)),)

    return bind


def _address_argument(address: int) -> numpy.ndarray:
    """A device address passed by value (a counters buffer's): one pinned array per address, as the
    stream's buffers stay (workspace.zeroed)."""
    argument = _ADDRESS_ARGUMENTS.get(address)
    if argument is None:
        argument = launch.pinned(numpy.array(address, numpy.uint64))
        workspace.keep_bounded(_ADDRESS_ARGUMENTS, address, argument, 256)
    return argument


_ADDRESS_ARGUMENTS: dict = {}


def _query_tile_order(p: AttentionProblem, kernel, device_id: int) -> int:
    """FwdParams.query_tile_order for the warp-specialised forward: the address of its tiles' order
    on the problem's block mask (BlockMask.query_tile_order), or 0 (the launch's own order). The
    one-block-per-tile builds do not read it (in the d64 TMA build, the tile coordinates read from
    it made every block-sparse launch 5-7% slower on an H100, whatever the order)."""
    if p.block_mask is None or not kernel.block_sparse:
        return 0
    order = p.block_mask.query_tile_order(p.batch, p.heads, p.seqlen_q, kernel.tile.block_m, device_id)
    return 0 if order is None else order.data.ptr



# --------------------------------------------------------------------------- backward


def decide_backward(p: AttentionProblem, device: devices.DeviceInfo, policy: policies.Policy, lay: tuple) -> Decision:
    """The backward's dK/dV families for the problem, best first, why each was taken or not, and
    what sums dQ: the deterministic dQ kernel, or the conversion of the float workspace (none where
    the warp-specialised kernel's dQ ring serves; plan_backward decides that)."""
    d = tiles.padded_head_dim(p.head_dim)
    q_dims, kv_dims = (p.batch, p.seqlen_q, p.heads), (p.batch, p.seqlen_k, p.heads // p.kv_group)
    density = None if p.block_mask is None else p.block_mask.density
    large_smem = device.smem_per_block >= tiles.SMEM_H100

    def verdict(family: str) -> str | None:
        if family.startswith("sm90") and not policy.hopper_backward:
            return "switched off (CUPYFLASH_HOPPER_BACKWARD=0)"
        if family not in _TMA_FAMILIES:
            return None
        if not policy.tma:
            return "switched off (CUPYFLASH_HOPPER_TMA=0)"
        if p.deterministic:
            return "deterministic: its dQ adds go through the float workspace, which that mode has not"
        if p.head_dim % 4:
            return "the float dQ workspace's rows are not 16-byte multiples (head_dim % 4 != 0)"
        names = ("q", "dout", "k", "v") if family == "sm90-ws" else ("q", "dout")
        why = _unmappable(lay, names, {"q": q_dims, "dout": q_dims, "k": kv_dims, "v": kv_dims})
        if why or family != "sm90-ws":
            return why
        takes, rule = policy.ws_backward_for(d, density, p.seqlen_q)
        return None if takes else f"not by the rule: {rule}"

    kernels, choices = _choose(
        p, device, policy,
        lambda family: dkdv_kernel(family, p.dtype_name, p.head_dim, _variant(p), large_smem and family == "sm80"),
        verdict)
    if p.deterministic:
        # (float64's dK/dV kernel on the tensor cores goes with the CUDA-core dQ kernel)
        tensor_cores = kernels[-1].family != "scalar" and p.dtype_name in tiles.TENSOR_CORE_DTYPES
        dq = dq_kernel(tensor_cores, p.dtype_name, p.head_dim, _variant(p))
        if _fits(dq, device):
            raise _no_kernel(p, device, [Choice("scalar", dq, False, _fits(dq, device))])
    else:
        dq = bwd_row_kernel("convert_dq", p.dtype_name, p.seqlen_q)
    return Decision("backward", tuple(kernels), choices, dq)


def launch_seqlen_k(p: AttentionProblem, kernel) -> int:
    """The dK/dV launch's keys: block-sparse, seqlen_k rounded up to whole mask blocks (the kernels
    take the mask's key blocks in its key_order, whole: key_tile), whose tiles past seqlen_k return
    at once."""
    if p.block_mask is not None and isinstance(kernel, (BwdDkdvKernel, TcBwdDkdvKernel)):
        block_k = p.block_mask.block_size[1]
        return -(-p.seqlen_k // block_k) * block_k
    return p.seqlen_k


def ring_slots(p: AttentionProblem, kernel, policy: policies.Policy, positions: int, blocks: int) -> int:
    """Slots of the warp-specialised dK/dV kernel's dQ ring (sm90/bwd_dkdv_ws.cu, wait_for_slot), 0
    for none: at policy.ring_head_dims where a key block walks policy.ring_min_steps query blocks or
    more on average, room for twice the slabs that the launch's `blocks` hold items of at once and
    two being rounded, or policy.ring_bytes if that holds more, never more than the launch's slabs.
    policy.ring_slabs forces the number."""
    if kernel.head_dim not in policy.ring_head_dims or not blocks or not p.seqlen_q:
        return 0
    density = 1.0 if p.block_mask is None else p.block_mask.density
    if not policy.ring_slabs and density * math.ceil(p.seqlen_q / kernel.tile.block_m) < policy.ring_min_steps:
        return 0
    slabs = p.batch * (p.heads // p.kv_group)
    if policy.ring_slabs:
        return min(slabs, policy.ring_slabs)
    slab_bytes = p.kv_group * p.seqlen_q * p.head_dim * lse_dtype(p.dtype_name).itemsize
    return min(slabs, max(2 * math.ceil(blocks / positions) + 2, policy.ring_bytes // slab_bytes))


def plan_backward(p: AttentionProblem, dout, q, k, v, out, lse, dq, dk, dv, policy: policies.Policy | None = None,
                  kernel=None, stream: workspace.Stream | None = None) -> Plan:
    """The backward's launches on these (validated) arrays: the row preprocess, the decision's first
    dK/dV kernel whose tensor maps the driver makes (or `kernel`, for tests and tuning), and the dQ
    kernel or conversion; its workspaces (the row statistics, the float dQ workspace or ring, the
    counters) allocated on `stream` (default: CuPy's current stream)."""
    if p.batch == 0 or p.heads == 0:  # nothing to launch over
        return Plan(None, q.device.id, [], ())
    bind = prepare_backward(p, dout, q, k, v, out, lse, dq, dk, dv, policy or policies.current(), kernel)
    named = zip(BACKWARD_POINTERS, (q, k, v, out, dout, dq, dk, dv, lse))
    return bind({**{name: x.data.ptr for name, x in named}, **dropout_values(p)}, stream or workspace.cupy_stream())


BACKWARD_POINTERS = ("q", "k", "v", "o", "dout", "dq", "dk", "dv", "lse")  # the call's arrays, as bind takes them


def prepare_backward(p: AttentionProblem, dout, q, k, v, out, lse, dq, dk, dv, policy: policies.Policy, kernel=None):
    """The backward of arrays laid out as these made ready, as `prepare_forward` makes the forward:
    bind(pointers, stream) -> Plan allocates the workspaces on the stream, writes the addresses and
    picks the tensor maps; the rest is decided once and kept in the problem's memo."""
    device_id = q.device.id
    lay = layout(q=q, dout=dout, k=k, v=v)
    arrays = (q, k, v, out, dout, dq, dk, dv, lse)
    key = ("backward", device_id, policy, lay, kernel, *(x.strides for x in arrays))
    bind = p.memo.get(key)
    if bind is None:
        bind = _prepare_backward(p, device_id, policy, lay, arrays, kernel)
        if _memoisable(p):
            p.memo[key] = bind
    return bind


def _prepare_backward(p: AttentionProblem, device_id: int, policy: policies.Policy, lay: tuple, arrays: tuple,
                      kernel):
    info = devices.info(device_id)
    decision = decide_backward(p, info, policy, lay)
    accum = lse_dtype(p.dtype_name)  # the kernels' accumulator type
    kv_heads = p.heads // p.kv_group
    lse = arrays[-1]
    fields = {"scale": p.scale}
    for name, x in zip(BACKWARD_POINTERS[:-1], arrays[:-1]):
        params.pointer_and_strides(fields, name, x)
    lse_strides = [stride // lse.dtype.itemsize for stride in lse.strides]
    if p.cu_seqlens is not None:  # (heads, total_q): a sequence's first row stands for its batch index
        lse_strides = [lse_strides[1], lse_strides[0], lse_strides[1]]
    for name, stride in zip(("batch", "head", "row"), lse_strides):
        fields[f"lse_{name}_stride"] = stride
    fields["stats_batch_stride"], fields["stats_head_stride"] = params.row_statistics_strides(p)
    rows_per_batch = 1 if p.cu_seqlens is not None else p.seqlen_q
    fields["dq_accum_batch_stride"] = rows_per_batch * p.heads * p.head_dim
    fields.update(lse=lse.data.ptr, lse_log2=0, d=0, dq_accum=0)
    # keep_alive: the ALiBi slopes and sequence lengths the struct points to, until the launches are queued
    keep_alive = params.problem_fields(fields, p, device_id)
    padding, lengths = _padding_slot(p, fields)
    record = params.LaunchRecord(structs.BWD_PARAMS_DTYPE, fields,
                                 (*BACKWARD_POINTERS, "lse_log2", "d", "dq_accum", *_SEED[p.dropout], *padding),
                                 _OFFSET[p.dropout])
    rows = p.heads * p.total_q  # row statistics, as row_statistics_strides
    stats_offset = -(-rows * accum.itemsize // 256) * 256 // accum.itemsize
    preprocess = bwd_row_kernel("preprocess", p.dtype_name, p.seqlen_q)
    preprocess_grid = preprocess.grid(p.batch, p.heads, p.seqlen_q)
    dq_grid = decision.dq.grid(p.batch, p.heads, p.seqlen_q, p.seqlen_k)
    dq_shape = (p.total_q, p.heads, p.head_dim)

    def query_maps(kernel, pointers, ring=0):
        block_m = kernel.tile.block_m
        dq_dims = (1, p.seqlen_q, ring * p.kv_group) if ring else None
        return record.tensor_maps(
            ("dq q dout", block_m, dq_dims, pointers["dq_accum"], pointers["q"], pointers["dout"]),
            lambda fields: tma.bwd_tensor_maps(fields, fields["dq_accum"], (p.batch, p.seqlen_q, p.heads),
                                               p.dtype_name, p.head_dim, block_m, dq_dims),
            pointers)

    def ws_binder(candidate):
        """The warp-specialised dK/dV kernel's launch: its dQ workspace or ring, its maps, counters."""
        seqlen_k = launch_seqlen_k(p, candidate)
        positions = candidate.positions(seqlen_k)
        grid = candidate.grid(p.batch, kv_heads, p.seqlen_q, seqlen_k, sm_count=info.sm_count)
        ring = ring_slots(p, candidate, policy, positions, grid[0])
        ring_elements = p.seqlen_q * ring * p.kv_group * p.head_dim  # (query, slot, head of the group, head dim)
        ring_kept = ring_elements * accum.itemsize <= policy.ring_kept_bytes
        n_counters = candidate.counters(kv_heads, p.batch)
        order = launch.pinned(numpy.array(0 if ring else _dkdv_item_order(p, candidate, device_id), numpy.uint64))
        scalars = tuple(launch.pinned(numpy.array(n, numpy.int32)) for n in (positions, positions * kv_heads * p.batch))
        slots = launch.pinned(numpy.array(ring, numpy.int32))

        def bind(pointers, stream, owners):
            if not ring:
                owner, pointers["dq_accum"] = dq_workspace(pointers, stream)
            elif ring_kept:
                owner, pointers["dq_accum"] = None, workspace.zeroed("dq ring", ring_elements, accum, stream)
            else:
                owner, pointers["dq_accum"] = stream.zeros(ring_elements, accum)
            maps = query_maps(candidate, pointers, ring)
            kv_maps = None if maps is None else record.tensor_maps(
                ("k v", candidate.tile.block_n, kv_heads, pointers["k"], pointers["v"]),
                lambda fields: tma.kv_tensor_maps(fields, (p.batch, p.seqlen_k, kv_heads), p.dtype_name,
                                                  p.head_dim, candidate.tile.block_n),
                pointers)
            if kv_maps is None:
                return None
            owners.append(owner)
            counters = _address_argument(workspace.zeroed_counters(n_counters, stream))
            return ring, (candidate, grid, (maps, kv_maps, *scalars, counters, slots, order))

        return bind, not ring

    def one_block_binder(candidate):
        """A one-block-per-key-tile dK/dV kernel's launch (the Hopper one with its BwdTensorMaps)."""
        grid = candidate.grid(p.batch, kv_heads, p.seqlen_q, launch_seqlen_k(p, candidate))
        hopper = isinstance(candidate, WgmmaBwdDkdvKernel)

        def bind(pointers, stream, owners):
            if not p.deterministic:
                owner, pointers["dq_accum"] = dq_workspace(pointers, stream)
                owners.append(owner)
            extra = (launch.pinned(tma.NO_BWD_MAPS),) if hopper else ()
            if hopper and candidate.tma:
                maps = query_maps(candidate, pointers) if not p.deterministic and p.cu_seqlens is None else None
                if maps is None:
                    return None
                extra = (maps,)
            return 0, (candidate, grid, extra)

        return bind, not p.deterministic

    binders = [ws_binder(c) if getattr(c, "ws", False) else one_block_binder(c)
               for c in ((kernel,) if kernel is not None else decision.kernels)]

    # The row statistics and, where the first kernel tried takes one, the dQ accumulator in one
    # allocation (an allocator call is ~5 us of host time), each at a 256-byte boundary: lse_log2, D, dQ.
    spare = math.prod(dq_shape) if binders[0][1] else 0

    def dq_workspace(pointers, stream):
        """(owner, address) of an unset dQ accumulator: the allocation's spare part where it has one."""
        if pointers["dq_spare"]:
            return None, pointers["dq_spare"]
        return stream.empty(dq_shape, accum)

    def bind(pointers: dict, stream: workspace.Stream) -> Plan:
        if padding:
            pointers.setdefault("seqused_k", lengths)
        owner, pointers["lse_log2"] = stream.empty(2 * stats_offset + spare, accum)
        pointers["d"] = pointers["lse_log2"] + stats_offset * accum.itemsize
        pointers["dq_spare"] = pointers["lse_log2"] + 2 * stats_offset * accum.itemsize if spare else 0
        owners = [owner]
        pointers["dq_accum"] = 0
        for binder, _ in binders:
            chosen = binder(pointers, stream, owners)
            if chosen is not None:
                break
        else:
            raise ValueError(f"no tensor map could be made for {kernel}")  # (only a forced TMA kernel gets here)
        ring, (dkdv, dkdv_grid, extra) = chosen
        workspace.keep_if_captured(stream, *owners)  # the workspaces, which a graph's replays use
        image = record.params(pointers)
        launches = []

        def add(kernel, grid, args):
            if all(grid):  # (seqlen_q == 0 or seqlen_k == 0 leaves some kernels nothing to do)
                launches.append(Launch(kernel, grid, args))

        # (no clear with a ring: its slots are zero already)
        add(preprocess, preprocess_grid, (record.params({**pointers, "dq_accum": 0}, copy=1) if ring else image,))
        add(dkdv, dkdv_grid, (image, *extra))
        if not ring:  # the ring's kernel rounds dq itself
            add(decision.dq, dq_grid, (image,))
        return Plan(decision, device_id, launches, (keep_alive, *owners))

    return bind


def _dkdv_item_order(p: AttentionProblem, kernel, device_id: int) -> int:
    """The warp-specialised dK/dV kernel's item_order: the address of the order of its claims on the
    problem's block mask (BlockMask.dkdv_item_order), or 0 (the launch's own order). Never with a
    dQ ring: a ring slot's next slab waits for the slab before it to complete, and an order that
    started later slabs' items early could leave every block waiting."""
    if p.block_mask is None:
        return 0
    block_q, block_k = p.block_mask.block_size
    t = kernel.tile
    order = p.block_mask.dkdv_item_order(p.batch, p.heads, p.kv_group, block_k // t.block_n, block_q // t.block_m,
                                         device_id)
    return 0 if order is None else order.data.ptr
