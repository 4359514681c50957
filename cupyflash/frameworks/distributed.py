"""Context parallelism for torch: attention over a sequence sharded across the ranks of a
torch.distributed group (NCCL on GPUs, gloo on CPUs), differentiable.

    import cupyflash.distributed as cfd
    q, k, v = (cfd.shard(x, causal=True) for x in (q_full, k_full, v_full))   # this rank's tokens
    out = cfd.ring_attention(q, k, v, causal=True)                            # this rank's rows
    out_full = cfd.gather(out, causal=True)

Ring attention: each rank keeps its queries while the key/value shards travel round the ring
(each rank sends to the next and receives from the previous, the next transfer under way while
the current shard is attended to); each step's partial output is merged into the running one by
the log-sum-exp, in float32 (float64 for float64). The backward sends the key/value shards round
again with their dK/dV accumulators, which end with the shard's owner; each step's gradients come
from `cupyflash.torch.attention_backward` given the merged out and lse, so they are that key
block's exact share.

Sharding (dimension 1, the sequence, of (batch, seq, heads, head_dim) tensors): "contiguous" gives
rank r the r-th of world equal parts; "zigzag" (the default with causal=True) splits the sequence
into 2 x world parts and gives rank r parts r and 2 world - 1 - r, so that under a causal mask every
rank has the same work at every step (ring-flash-attention's and Megatron's load balancing).

`allgather_attention` gives the same result from K/V gathered once on every rank, for short
sequences or few K/V heads. `context_parallel()` makes torch's SDPA ring attention for the block, so that a model written
with SDPA runs on inputs sharded along the sequence.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from cupyflash.frameworks import torch as adapter

__all__ = ["ring_attention", "allgather_attention", "shard", "gather", "context_parallel", "ShardedAttention"]

LAYOUTS = ("zigzag", "contiguous")


def _layout(layout, causal) -> str:
    layout = layout or ("zigzag" if causal else "contiguous")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_divisible(seqlen: int, world: int, layout: str, name: str) -> None:
    pieces = world * (2 if layout == "zigzag" else 1)
    if seqlen % pieces:
        raise ValueError(f"{name}'s sequence length {seqlen} must divide into {pieces} equal parts ({layout} over "
                         f"{world} ranks)")


def shard(x, group=None, *, causal=False, layout=None):
    """This rank's part of x's sequence (dimension 1) under `layout` (see the module docstring)."""
    layout = _layout(layout, causal)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _check_divisible(x.shape[1], world, layout, "x")
    return _own_rows(x, rank, world, layout).contiguous()


def gather(x, group=None, *, causal=False, layout=None):
    """The whole sequence from every rank's part (all_gather), the inverse of `shard`."""
    return _gathered(x, group, _layout(layout, causal), dist.get_world_size(group))


class _Ring:
    """A group's ring: this rank, the world, the global ranks before and after it."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        whole = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(whole, (self.rank + 1) % self.world)
        self.previous = dist.get_global_rank(whole, (self.rank - 1) % self.world)

    def shift(self, x):
        """Starts sending x to the next rank and receiving the previous rank's into a new buffer;
        returns wait(), which gives the buffer once both are done. The pair goes as one batch
        (batch_isend_irecv): NCCL queues a lone send and a lone receive in order on one stream,
        where every rank's send would wait for a receive queued behind it."""
        buffer = torch.empty_like(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, self.next, self.group),
                                        dist.P2POp(dist.irecv, buffer, self.previous, self.group)])

        def wait():
            for work in works:
                work.wait()
            return buffer

        return wait


def _blocks(step: int, source: int, rank: int, causal: bool, layout: str, seqlen_q: int, seqlen_k: int) -> list:
    """(query rows, key rows, causal) of the attention between this rank's queries and the key
    shard of rank `source` at ring step `step`: nothing where the causal mask hides the shard."""
    every_q, every_k = slice(0, seqlen_q), slice(0, seqlen_k)
    if not causal:
        return [(every_q, every_k, False)]
    if step == 0:  # its own keys: the causal mask within the shard (zigzag: both halves in order)
        return [(every_q, every_k, True)]
    if layout == "contiguous":
        return [(every_q, every_k, False)] if source < rank else []
    if source < rank:  # the shard's first half lies before both of this rank's halves; its second, after
        return [(every_q, slice(0, seqlen_k // 2), False)]
    return [(slice(seqlen_q // 2, seqlen_q), every_k, False)]  # our second half follows all of it


def _accumulator_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _merge(out, lse, part, part_lse, rows):
    """out[:, rows], lse[..., rows] merged with a partial result by the log-sum-exp (in place)."""
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, part_lse)
    unseen = torch.isneginf(new_lse)  # no key yet on either side: weights 0, not NaN
    keep = torch.where(unseen, 0.0, torch.exp(old_lse - new_lse)).transpose(1, 2).unsqueeze(-1)
    take = torch.where(unseen, 0.0, torch.exp(part_lse - new_lse)).transpose(1, 2).unsqueeze(-1)
    out[:, rows] = out[:, rows] * keep + part.to(out.dtype) * take
    lse[:, :, rows] = new_lse


def _ring_forward(q, k, v, causal, scale, layout, group):
    ring = _Ring(group)
    batch, seqlen_q, heads, _ = q.shape
    accum = _accumulator_dtype(q)
    out = torch.zeros(q.shape, dtype=accum, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), -torch.inf, dtype=accum, device=q.device)
    kv = torch.stack((k, v))
    for step in range(ring.world):
        arriving = ring.shift(kv) if step + 1 < ring.world else None
        source = (ring.rank - step) % ring.world
        for rows, keys, block_causal in _blocks(step, source, ring.rank, causal, layout, seqlen_q, k.shape[1]):
            part, part_lse = adapter.attention(q[:, rows], kv[0][:, keys], kv[1][:, keys], causal=block_causal,
                                               scale=scale, return_lse=True)
            _merge(out, lse, part, part_lse.to(accum), rows)
        if arriving is not None:
            kv = arriving()
    return out.to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def _ring_backward(dout, q, k, v, out, lse, causal, scale, layout, group):
    ring = _Ring(group)
    seqlen_q = q.shape[1]
    accum = _accumulator_dtype(q)
    dq = torch.zeros(q.shape, dtype=accum, device=q.device)
    kv = torch.stack((k, v))
    dkv = torch.zeros(kv.shape, dtype=accum, device=q.device)
    for step in range(ring.world):
        arriving = ring.shift(kv) if step + 1 < ring.world else None
        source = (ring.rank - step) % ring.world
        for rows, keys, block_causal in _blocks(step, source, ring.rank, causal, layout, seqlen_q, k.shape[1]):
            dq_part, dk_part, dv_part = adapter.attention_backward(
                dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows], lse[:, :, rows],
                causal=block_causal, scale=scale)
            dq[:, rows] += dq_part
            dkv[0][:, keys] += dk_part
            dkv[1][:, keys] += dv_part
        if ring.world > 1:  # the shard's accumulators travel with it; the last hop reaches its owner
            dkv = ring.shift(dkv)()
        if arriving is not None:
            kv = arriving()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def ring_attention(q, k, v, group=None, *, causal=False, scale=None, layout=None, return_lse=False):
    """Attention over a sequence sharded across `group`'s ranks (default: the whole world): q, k,
    v this rank's (batch, seq, heads, head_dim) shards as `shard` gives them, k and v with fewer
    heads for GQA/MQA; the same on every rank. Returns this rank's rows of the output (and of lse
    with return_lse), equal to `cupyflash.torch.attention` on the whole sequence sharded alike;
    differentiable. causal is over the whole sequence (seqlen_q = seqlen_k); layout: "zigzag"
    (the default with causal) or "contiguous", as `shard`."""
    layout = _checked(q, k, v, causal, layout)
    out, lse = ShardedAttention.apply(q, k, v, bool(causal), scale, layout, group, "ring")
    return (out, lse) if return_lse else out


def _checked(q, k, v, causal, layout) -> str:
    """The layout, after the shards' checks (what the ranks' exchanges cannot catch)."""
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        raise TypeError("q, k and v must be torch tensors (this rank's shards)")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"q, k, v must be (batch, seq, heads, head_dim) shards with k and v alike, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    layout = _layout(layout, causal)
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal ring attention needs equal query and key shards, got {q.shape[1]} and {k.shape[1]}")
    if layout == "zigzag" and causal and q.shape[1] % 2:
        raise ValueError(f"a zigzag shard holds two equal parts: its length must be even, got {q.shape[1]}")
    return layout


def _key_spans(rank: int, world: int, causal: bool, layout: str, seqlen_q: int, seqlen_k: int) -> list:
    """(query rows of this rank's shard, keys of the whole gathered sequence, causal) for the
    all-gather variant: under a causal mask each query part sees the keys up to its own end."""
    if not causal:
        return [(slice(0, seqlen_q), slice(0, seqlen_k * world), False)]
    if layout == "contiguous":
        return [(slice(0, seqlen_q), slice(0, (rank + 1) * seqlen_k), True)]
    half_q, half_k = seqlen_q // 2, seqlen_k // 2
    return [(slice(0, half_q), slice(0, (rank + 1) * half_k), True),
            (slice(half_q, seqlen_q), slice(0, (2 * world - rank) * half_k), True)]


def _gathered(x, group, layout, world):
    """The whole sequence of every rank's x in order (`gather`'s layout undone)."""
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if layout == "contiguous":
        return torch.cat(parts, dim=1)
    halves = [p.chunk(2, dim=1) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=1)


def _own_rows(x, rank, world, layout):
    """This rank's shard of a whole sequence (`shard`'s layout)."""
    chunks = x.chunk(world * (2 if layout == "zigzag" else 1), dim=1)
    if layout == "contiguous":
        return chunks[rank]
    return torch.cat((chunks[rank], chunks[2 * world - 1 - rank]), dim=1)


def _allgather_forward(q, k, v, causal, scale, layout, group):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    keys, values = (_gathered(x, group, layout, world) for x in (k, v))
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_accumulator_dtype(q), device=q.device)
    for rows, span, block_causal in _key_spans(rank, world, causal, layout, q.shape[1], k.shape[1]):
        out[:, rows], lse[:, :, rows] = adapter.attention(q[:, rows], keys[:, span], values[:, span],
                                                          causal=block_causal, scale=scale, return_lse=True)
    return out, lse


def _allgather_backward(dout, q, k, v, out, lse, causal, scale, layout, group):
    """The gathered K/V are gathered again rather than kept from the forward."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    keys, values = (_gathered(x, group, layout, world) for x in (k, v))
    accum = _accumulator_dtype(q)
    dq = torch.zeros(q.shape, dtype=accum, device=q.device)
    dkv = torch.zeros((2, *keys.shape), dtype=accum, device=q.device)
    for rows, span, block_causal in _key_spans(rank, world, causal, layout, q.shape[1], k.shape[1]):
        dq_part, dk_part, dv_part = adapter.attention_backward(
            dout[:, rows], q[:, rows], keys[:, span], values[:, span], out[:, rows], lse[:, :, rows],
            causal=block_causal, scale=scale)
        dq[:, rows] += dq_part
        dkv[0][:, span] += dk_part
        dkv[1][:, span] += dv_part
    # every rank's share of every key's gradient, summed; each keeps its own rows
    dist.all_reduce(dkv, group=group)
    dk, dv = (_own_rows(g, rank, world, layout) for g in dkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# method -> (forward(q, k, v, causal, scale, layout, group) -> (out, lse), backward(dout, q, k, v, out, lse, ...))
METHODS = {"ring": (_ring_forward, _ring_backward), "allgather": (_allgather_forward, _allgather_backward)}


class ShardedAttention(torch.autograd.Function):
    """`ring_attention` and `allgather_attention` as an autograd function: saves this rank's q, k,
    v, out and lse; `method` names the pair of passes (METHODS)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, group, method):
        out, lse = METHODS[method][0](q, k, v, causal, scale, layout, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (causal, scale, layout, group, method)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        causal, scale, layout, group, method = ctx.options
        grads = METHODS[method][1](dout.contiguous(), *ctx.saved_tensors, causal, scale, layout, group)
        return (*grads, None, None, None, None, None)


def allgather_attention(q, k, v, group=None, *, causal=False, scale=None, layout=None, return_lse=False):
    """`ring_attention`'s result by another route: every rank gathers the whole K/V once
    (all_gather) and attends its queries to the keys they see; the backward sums the K/V
    gradients over the ranks (all_reduce). Less latency than the ring for short sequences or
    small K/V (few KV heads), more memory: the whole K/V on every rank."""
    layout = _checked(q, k, v, causal, layout)
    out, lse = ShardedAttention.apply(q, k, v, bool(causal), scale, layout, group, "allgather")
    return (out, lse) if return_lse else out


@contextlib.contextmanager
def context_parallel(group=None, *, layout="zigzag"):
    """Within the block, `torch.nn.functional.scaled_dot_product_attention` is ring attention over
    `group`, for a model whose inputs each rank holds sharded along the sequence (`shard(x,
    layout=layout)`; PyTorch's `context_parallel` in spirit): its query, key and value are this
    rank's (batch, heads, seq, head_dim) shards, is_causal is over the whole sequence, enable_gqa
    and scale as SDPA's. What the ring cannot compute from shards (an attn_mask, dropout, other
    ranks of tensors) raises NotImplementedError. Positions (rotary embeddings, position ids) are
    the model's to take from the sharded layout."""
    layout = _layout(layout, True)
    torch_sdpa = torch.nn.functional.scaled_dot_product_attention

    def ring_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p or query.dim() != 4:
            raise NotImplementedError("cupyflash.distributed.context_parallel: ring attention takes 4-D query, key "
                                      "and value shards without attn_mask or dropout")
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise ValueError(f"key has {key.shape[1]} heads and query {query.shape[1]}: pass enable_gqa=True, as SDPA "
                             "needs")
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        return ring_attention(q, k, v, group, causal=is_causal, scale=scale, layout=layout).transpose(1, 2)

    torch.nn.functional.scaled_dot_product_attention = ring_sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = torch_sdpa
