"""Renders the planner's decisions as text: which kernel family, instantiation, tile and grid a call
takes, and why every other family was not taken (PyTorch's SDPA reports its backends likewise)."""

from __future__ import annotations

import dataclasses

from cupyflash.catalog.tiles import padded_head_dim
from cupyflash.cpu import fallback
from cupyflash.problem import AttentionProblem, lse_dtype
from cupyflash.runtime.device import DeviceInfo


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What `cupyflash.explain` returns: the problem, the device, and the forward's and backward's
    decisions (dispatch/plan.py's Decision; None where the CPU fallback runs). Printed, it reads as
    a report."""

    problem: AttentionProblem
    device: DeviceInfo | None
    forward: object
    backward: object
    ring: int = 0  # the backward's dQ ring slots where its warp-specialised kernel takes one

    def __str__(self) -> str:
        return render(self)

    def __repr__(self) -> str:
        return render(self)


def _problem_line(p: AttentionProblem) -> str:
    parts = [p.dtype_name, f"batch {p.batch}", f"seqlen_q {p.seqlen_q}", f"seqlen_k {p.seqlen_k}",
             f"heads {p.heads}" + (f" (K/V heads {p.heads // p.kv_group})" if p.kv_group > 1 else ""),
             f"head_dim {p.head_dim} (kernels padded to {padded_head_dim(p.head_dim)})"]
    if p.causal:
        parts.append("causal")
    if p.window is not None:
        parts.append(f"window {p.window}")
    if p.block_mask is not None:
        parts.append(f"block mask of density {p.block_mask.density:.3g}")
    if p.softcap is not None:
        parts.append(f"softcap {p.softcap:g}")
    if p.alibi_slopes is not None:
        parts.append("ALiBi")
    if p.dropout:
        parts.append(f"dropout {p.dropout_p:g}")
    if p.varlen:
        parts.append("variable lengths")
    return ", ".join(parts)


def _kernel_line(kernel) -> str:
    tile = ", ".join(f"{f.name}={getattr(kernel.tile, f.name)}" for f in dataclasses.fields(kernel.tile))
    return (f"{kernel.name_expression}\n      tile ({tile}); {kernel.num_threads} threads; "
            f"{kernel.smem_bytes} bytes of shared memory; kernels/{kernel.source_file}")


def _decision_lines(title: str, decision) -> list[str]:
    taken = next(c for c in decision.choices if c.taken)
    lines = [f"{title}: {taken.family}", f"      {_kernel_line(taken.kernel)}"]
    for c in decision.choices:
        mark = "taken" if c.taken else c.reason
        lines.append(f"    {c.family:9} {mark}")
    return lines


def render(e: Explanation) -> str:
    lines = [f"cupyflash.explain: {_problem_line(e.problem)}"]
    if e.device is None:
        lines.append(f"no GPU: {fallback.SUMMARY} (compute_capability=... explains a GPU's kernels)")
        return "\n".join(lines)
    lines.append(f"device: {e.device.name} (sm_{e.device.compute_capability}, {e.device.sm_count} SMs, "
                 f"{e.device.smem_per_block} bytes of shared memory a block)")
    lines += _decision_lines("forward", e.forward)
    lines += _decision_lines("backward dK/dV", e.backward)
    dq = e.backward.dq
    if e.problem.deterministic:
        lines.append(f"backward dQ: the deterministic kernel {dq.name_expression} (fixed summation order)")
    elif e.ring:
        lines.append(f"backward dQ: added into a ring of {e.ring} (K/V head, batch) slabs that the dK/dV kernel "
                     f"rounds into dq itself")
    else:
        accum = lse_dtype(e.problem.dtype_name).name  # the kernels' accumulator type
        lines.append(f"backward dQ: {accum} atomic adds into a workspace, rounded by {dq.name_expression}")
    return "\n".join(lines)
