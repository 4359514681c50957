"""`explain`: which kernels a call would take, and why the others would not."""

from __future__ import annotations

import dataclasses

import numpy

from cupyflash import validation
from cupyflash.api import common
from cupyflash.dispatch import plan as planner
from cupyflash.dispatch import policy as policies
from cupyflash.dispatch.explain import Explanation
from cupyflash.problem import Options
from cupyflash.runtime import device as devices


def explain(
    q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, seqlens_k=None, block_mask=None,
    dropout_p=0.0, seed=None, offset=0, deterministic=False, compute_capability=None,
) -> Explanation:
    """The plan of ``attention(q, k, v, ...)`` and of its ``attention_backward``: for each, the
    kernel family taken (its instantiation, tile, threads, shared memory and source file) and, for
    every other family, why it was not taken; and how the backward sums dQ. Nothing is launched or
    allocated. Print the result to read it::

        >>> print(cupyflash.explain(q, k, v, causal=True))   # doctest: +SKIP
        cupyflash.explain: bfloat16, batch 2, seqlen_q 4096, ...
        forward: sm90-tma
              cupyflash::flash_fwd_sm90_kernel<...>
            sm90-ws   no causal or windowed build
            sm90-tma  taken
            ...

    Arguments as `attention` (with `block_mask`, `block_sparse_attention`; `deterministic` as
    `attention_backward`), checked the same way. The device is q's GPU, or the current one for
    NumPy inputs, or ``compute_capability`` (e.g. 80, 90) for a device of that kind, which also
    works without a GPU. NumPy inputs are taken as the contiguous copies the call would make."""
    arrays, origins = common.ingest({"q": q, "k": k, "v": v})
    options = Options(causal=causal, scale=scale, return_lse=True, window=window, softcap=softcap,
                      alibi_slopes=alibi_slopes, seqlens_k=seqlens_k, block_mask=block_mask, dropout_p=dropout_p,
                      seed=seed, offset=offset)
    p = common.checked_problem("forward", arrays, origins, options)
    if validation.check_flag(deterministic, "deterministic"):
        p = dataclasses.replace(p, deterministic=True)
    if compute_capability is not None:
        info = devices.described(validation.check_count(compute_capability, "compute_capability"))
    elif origins["q"].on_gpu:
        info = devices.info(origins["q"].device_id)
    elif devices.gpu_available():
        import cupy

        info = devices.info(cupy.cuda.Device().id)
    else:
        return Explanation(p, None, None, None)
    policy = policies.current()
    lay = {name: (name, *_layout_of(x, origins[name].on_gpu)) for name, x in arrays.items()}
    out_layout = ("o", _contiguous_strides(p.batch, p.seqlen_q, p.heads, p.head_dim, arrays["q"].dtype), True)
    forward = planner.decide_forward(p, info, policy, (lay["q"], lay["k"], lay["v"], out_layout))
    dout_layout = ("dout",) + out_layout[1:]
    backward = planner.decide_backward(p, info, policy, (lay["q"], dout_layout, lay["k"], lay["v"]))
    ring = 0
    dkdv = backward.kernel
    if getattr(dkdv, "ws", False):
        seqlen_k = planner.launch_seqlen_k(p, dkdv)
        grid = dkdv.grid(p.batch, p.heads // p.kv_group, p.seqlen_q, seqlen_k, sm_count=info.sm_count)
        ring = planner.ring_slots(p, dkdv, policy, dkdv.positions(seqlen_k), grid[0])
    return Explanation(p, info, forward, backward, ring)


def _contiguous_strides(batch: int, seqlen: int, heads: int, head_dim: int, dtype) -> tuple:
    item = numpy.dtype(dtype).itemsize
    return (seqlen * heads * head_dim * item, heads * head_dim * item, head_dim * item, item)


def _layout_of(x, on_gpu: bool) -> tuple:
    """(strides, aligned) of an array as plan.layout reads them; a host array's as its contiguous
    GPU copy's."""
    if on_gpu:
        return x.strides, x.data.ptr % 16 == 0
    return _contiguous_strides(*x.shape, x.dtype), True
