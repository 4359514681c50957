"""The plan of a KV-cache decoding step (attention_decode): its kernel, the split of the keys over
thread blocks, the workspace of the splits' partial results, and the launches (the append of new
keys and values, then the decode kernel, which merges its splits itself)."""

from __future__ import annotations

import functools
import math


from cupyflash.catalog import decode_kernel as catalog_decode_kernel
from cupyflash.catalog.decode import DecodeAppendKernel
from cupyflash.catalog import params as structs
from cupyflash.catalog.tiles import DECODE_MAX_SPLITS, TENSOR_CORE_DTYPES, TENSOR_CORE_MIN_CC
from cupyflash.dispatch import policy as policies
from cupyflash.dispatch.plan import Launch, Plan
from cupyflash.problem import DecodeProblem, lse_dtype
from cupyflash.runtime import device as devices
from cupyflash.runtime import params, workspace


def decode_kernel(d: DecodeProblem, info: devices.DeviceInfo, policy: policies.Policy):
    """The decode kernel: the tensor-core one for 16-bit inputs on sm_80 and newer (where the policy
    lets the sm80 family serve); otherwise the CUDA-core one, staged through shared memory where a
    K/V head has one query row (multi-head attention, one new token: 1.06-2.3x the per-lane
    kernel's bandwidth while that read K from global memory, a key per lane; with 4 and 16 rows it
    was the slower, docs/performance.md)."""
    p = d.attention
    if info.compute_capability < TENSOR_CORE_MIN_CC:  # both kernels stream the cache through cp.async
        raise ValueError(f"attention_decode needs sm_80 or newer (its kernels read the cache with cp.async); "
                         f"{info.name} is sm_{info.compute_capability}. attention() with the cached keys serves there.")
    tensor_cores = (p.dtype_name in TENSOR_CORE_DTYPES and info.compute_capability >= TENSOR_CORE_MIN_CC
                    and "sm80" in policy.families)
    rows = p.seqlen_q * p.kv_group
    return catalog_decode_kernel(p.dtype_name, p.head_dim, tensor_cores, p.score_mod, rows == 1, rows)


def device_slots(info: devices.DeviceInfo, kernel) -> int:
    """Blocks of a decode kernel worth running at once on the device (one wave): one per SM for the
    tensor-core kernel, whose cp.async ring keeps an SM's share of the bandwidth busy by itself (a
    second block adds only its fixed costs: one sequence, 8 K/V heads, 8192 keys took 14.3 us in 16
    splits, one block per SM, and 15.8 in 32, two); for the CUDA-core kernel, whose warps wait on
    their own loads, as many as shared memory allows, up to 4."""
    if kernel.family == "sm80":
        return info.sm_count
    per_sm = info.smem_per_sm // max(kernel.smem_bytes + 1024, 1)
    return info.sm_count * max(1, min(per_sm, 4))


def choose_splits(blocks: int, key_tiles: int, slots: int, policy: policies.Policy | None = None) -> int:
    """Splits of the key sequence for `blocks` (row block, K/V head, sequence) triples of
    `key_tiles` tiles each on a GPU running `slots` blocks at once: no split when the blocks already
    fill most of a wave; otherwise the fewest splits whose critical path, waves of blocks times the
    tiles of the longest split, is within 5% of the shortest (each split costs a block's fixed work,
    which the path leaves out: 49 splits of 1024 tiles in 3 waves of 132 give 63 tile-times, 16 in
    one wave 64), each split keeping at least 4 tiles. (Flash-attn's heuristic, the fewest splits
    whose last wave is within 5% as full as the best count's, took 31 splits of 128 tiles, some of
    5 tiles, where 32 give 4, and ran 19.8 us against 23.1 for one sequence with 8 K/V heads and
    8192 keys.)"""
    policy = policy or policies.current()
    if not blocks or blocks >= policy.decode_full_wave * slots or key_tiles < policy.decode_min_key_tiles:
        return 1  # (no blocks: an empty batch, or no heads)
    limit = min(DECODE_MAX_SPLITS, key_tiles // policy.decode_min_tiles_per_split, math.ceil(4 * slots / blocks))

    def critical_path(splits):
        return math.ceil(blocks * splits / slots) * math.ceil(key_tiles / splits)

    paths = {s: critical_path(s) for s in range(1, limit + 1)}
    shortest = min(paths.values())
    return min(s for s, path in paths.items() if path <= policy.decode_path_slack * shortest)


@functools.cache
def _shape(kernel, batch: int, heads_kv: int, rows: int, cache_len: int, num_splits, device_id: int,
           policy: policies.Policy) -> tuple:
    """(row blocks, splits) of a launch, memoised: decoding calls the same shapes step after step."""
    row_blocks = math.ceil(rows / kernel.rows)
    if num_splits is None:  # device lengths are not read back: the cache's capacity bounds the keys
        slots = device_slots(devices.info(device_id), kernel)
        num_splits = choose_splits(batch * heads_kv * row_blocks, math.ceil(cache_len / kernel.block_n), slots, policy)
    return row_blocks, num_splits


def plan_decode(d: DecodeProblem, q, k, v, k_new, v_new, lengths, out, lse, policy: policies.Policy | None = None,
                kernel=None, stream: workspace.Stream | None = None) -> Plan:
    """The launches of a decoding step on these (validated) arrays, its workspaces allocated on
    `stream` (default: CuPy's current stream); `kernel` overrides the decode kernel (for tests and
    tuning)."""
    bind = prepare_decode(d, q, k, v, k_new, v_new, lengths, out, lse, policy or policies.current(), kernel)
    return bind(decode_pointers(q, k, v, k_new, v_new, lengths, out, lse), stream or workspace.cupy_stream())


DECODE_POINTERS = ("q", "k", "v", "k_new", "v_new", "o", "lse", "cache_seqlens")  # as bind takes them


def decode_pointers(q, k, v, k_new, v_new, lengths, out, lse) -> dict:
    """The addresses of a step's arrays (0 for those it has not), by DECODE_POINTERS' names."""
    return {name: 0 if x is None else x.data.ptr
            for name, x in zip(DECODE_POINTERS, (q, k, v, k_new, v_new, out, lse, lengths))}


def prepare_decode(d: DecodeProblem, q, k, v, k_new, v_new, lengths, out, lse, policy: policies.Policy, kernel=None):
    """A decoding step of arrays laid out as these made ready, as dispatch/plan.py's prepare_forward
    makes the forward: bind(pointers, stream) -> Plan allocates the splits' workspace on the stream
    and writes the addresses; the kernel, the split, the struct's other fields and the grids are
    decided here once."""
    p = d.attention
    device_id = q.device.id
    kernel = kernel or decode_kernel(d, devices.info(device_id), policy)
    heads_kv = p.heads // p.kv_group
    rows = p.seqlen_q * p.kv_group
    row_blocks, splits = _shape(kernel, p.batch, heads_kv, rows, p.seqlen_k, d.num_splits, device_id, policy)

    fields = {"lse": lse.data.ptr, "cache_seqlens": 0 if lengths is None else lengths.data.ptr}
    for name, x in (("q", q), ("k", k), ("v", v), ("k_new", k_new), ("v_new", v_new), ("o", out)):
        if x is None:
            params.no_array(fields, name)
        else:
            params.pointer_and_strides(fields, name, x)
    fields["o_partial"] = fields["lse_partial"] = fields["split_counters"] = 0
    left, right = p.band
    fields.update(
        batch=p.batch, heads=p.heads, kv_group=p.kv_group, seqlen_q=p.seqlen_q, cache_len=p.seqlen_k,
        seqlen_new=d.seqlen_new, head_dim=p.head_dim, num_splits=splits, rows=rows,
        # Unbounded sides clamped to widths that hide nothing (the kernels' int arithmetic stays small).
        window_left=p.seqlen_k if left is None else min(left, p.seqlen_k),
        window_right=p.seqlen_q if right is None else min(right, p.seqlen_q),
        scale_log2=p.scale * params.LOG2E,
        softcap_log2=0.0 if p.softcap is None else p.softcap * params.LOG2E,
    )
    slopes = params.slopes_fields(fields, p)  # (alive as long as this bind)
    record = params.LaunchRecord(structs.DECODE_PARAMS_DTYPE, fields,
                                 (*DECODE_POINTERS, "o_partial", "lse_partial", "split_counters"))
    split = splits > 1 and out.size
    # o_partial [splits, batch, heads, seqlen_q, padded head_dim], then lse_partial: one allocation
    partial_rows = splits * p.batch * p.heads * p.seqlen_q
    accum = lse_dtype(p.dtype_name)
    launches = []
    if d.seqlen_new and p.batch and heads_kv:
        launches.append((DecodeAppendKernel(p.dtype_name), (d.seqlen_new, heads_kv, p.batch)))
    if out.size:
        launches.append((kernel, (row_blocks * splits * heads_kv, p.batch, 1)))

    def bind(pointers: dict, stream: workspace.Stream) -> Plan:
        partial = None
        pointers["o_partial"] = pointers["lse_partial"] = pointers["split_counters"] = 0
        if split:
            partial, pointers["o_partial"] = stream.empty(partial_rows * (kernel.head_dim + 1), accum)
            pointers["lse_partial"] = pointers["o_partial"] + partial_rows * kernel.head_dim * accum.itemsize
            # Counters of the splits done per row group (decode_combine_splits), left zeroed.
            pointers["split_counters"] = workspace.zeroed_counters(p.batch * heads_kv * row_blocks, stream)
            workspace.keep_if_captured(stream, partial)
        image = record.params(pointers)
        return Plan(None, device_id, [Launch(k_, grid, (image,)) for k_, grid in launches], (slopes, partial))

    return bind
