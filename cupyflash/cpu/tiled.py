"""FlashAttention-2's forward and backward in NumPy, tile by tile as the kernels schedule them
(float64): the CPU fallback of cupyflash's functions, and the mirror the tests check the kernels'
tile walks (causal and window bands, block masks) against."""

from __future__ import annotations

import bisect
import math

import numpy

from cupyflash.catalog import tiles
from cupyflash.cpu import philox, reference


@reference.propagating
def tiled_attention(
    q, k, v, *, causal=False, scale=None, return_lse=False, block_m=None, block_n=None, block_mask=None, window=None,
    softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0, compute=numpy.float64,
):
    """FlashAttention-2's forward, block by block, as the GPU kernel schedules it.

    block_m, block_n default to the kernel's tile for this dtype and head dim (with a block mask,
    cut to divide its block size). With block_mask (block-sparse FlashAttention, Algorithm 5), a
    query block visits only the key blocks its mask row lists, in the kernels' order. With causal or
    a window, only the key blocks in its band. softcap and alibi_slopes modify each tile's scores;
    dropout regenerates each tile's keep mask from its coordinates, as the kernels do (arguments as
    `attention`). Each tile's products are matrix products over all its heads at once (BLAS), in
    the `compute` dtype (float64 unless asked; the CPU fallback takes float32 for 32- and 16-bit
    inputs, as the kernels accumulate); out and lse come back in it.
    """
    p, q, k, v = reference.prepare(q, k, v, causal, scale, return_lse, block_mask, window, softcap, alibi_slopes,
                                   dropout=(dropout_p, seed, offset), dtype=compute)
    tile = tiles.tile_shape(p.dtype_name, tiles.padded_head_dim(p.head_dim))
    block_m, block_n = _tiles(p, block_m or tile.block_m, block_n or tile.block_n)
    sq, sk = p.seqlen_q, p.seqlen_k
    qh, kh, vh = _heads_major(q, k, v)
    del q, k, v  # (the fallback's memory: one copy of the inputs at a time)
    out = numpy.empty((p.batch, sq, p.heads, p.head_dim), compute)
    lse = numpy.empty((p.batch, p.heads, sq), compute)
    scale_log2 = compute(p.scale * reference.LOG2E)  # scores in log2 units, so the kernel needs only exp2

    for slab, bs, hs in _mask_slabs(p):  # batch entries and heads that share one mask slab
        for row0 in range(0, sq, block_m):  # one thread block per query block i (and head, batch)
            rows = min(block_m, sq - row0)
            q_i = qh[bs, hs, row0 : row0 + rows] * scale_log2  # Q_i, prescaled, on chip for the whole loop
            o_i = numpy.zeros(q_i.shape, compute)
            m_i = numpy.full(q_i.shape[:3] + (1,), -numpy.inf, compute)
            l_i = numpy.zeros_like(m_i)
            for n_block in key_tiles(p, slab, row0, rows, block_n):
                col0 = n_block * block_n
                cols = min(block_n, sk - col0)
                s_ij = q_i @ kh[bs, hs, col0 : col0 + cols].swapaxes(-1, -2)
                s_ij, _ = reference.modify_scores(s_ij, p, compute, row0, col0, bs, hs, reference.LOG2E)
                # Like the kernel, mask only tiles an edge of the band cuts through (a slice needs
                # no seqlen_k mask: it holds no key past the end).
                if p.local and reference.band_cuts(p, row0, rows, col0, cols):
                    s_ij[..., reference.tile_hidden(p, row0, rows, col0, cols)] = -numpy.inf
                m_new = numpy.maximum(m_i, s_ij.max(axis=-1, keepdims=True))
                m_safe = numpy.where(numpy.isneginf(m_new), compute(0), m_new)  # no -inf - -inf = NaN
                s_ij -= m_safe
                p_ij = numpy.exp2(s_ij, out=s_ij)
                rescale = numpy.exp2(m_i - m_safe)
                l_i = l_i * rescale + p_ij.sum(axis=-1, keepdims=True)
                if p.dropout:  # P_ij ∘ Z_ij, after l_i took every probability in
                    p_ij *= _tile_keep(p, dropout_batch_start, bs, hs, row0, rows, col0, cols)
                o_i = o_i * rescale + p_ij @ vh[bs, hs, col0 : col0 + cols]
                m_i = m_new
            # Epilogue: one final rescale of O_i (and dropout's 1 / (1 - p)), lse written once; rows
            # that saw no key (l_i = 0) get 0 / -inf, rows that saw a NaN score (l_i NaN) NaN.
            seen = l_i != 0
            o_i = numpy.divide(o_i * compute(philox.rescale(p.dropout_p)), l_i, out=numpy.zeros_like(o_i),
                               where=seen)
            out[bs, row0 : row0 + rows, hs] = o_i.transpose(0, 2, 1, 3)
            lse[bs, hs, row0 : row0 + rows] = numpy.where(seen, m_i / compute(reference.LOG2E) + numpy.log(l_i),
                                                          -numpy.inf)[..., 0]
    return (out, lse) if p.return_lse else out


def _heads_major(*arrays) -> tuple:
    """(batch, seq, heads, head_dim) arrays as (batch, heads, seq, head_dim) copies, whose tiles'
    rows are contiguous: each head's product is then one BLAS call."""
    return tuple(numpy.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in arrays)


def _tile_keep(p, batch_start, bs, hs, row0, rows, col0, cols):
    """Dropout's keep mask for one tile: the batch entries bs and heads hs (slices), queries
    [row0, row0 + rows), keys [col0, col0 + cols)."""
    batches = numpy.arange(p.batch)[bs] + batch_start
    return philox.keep_tile(p.dropout_p, p.seed, p.offset, p.heads, batches, numpy.arange(p.heads)[hs],
                              range(row0, row0 + rows), range(col0, col0 + cols))


def _visible_key_tiles(p, row0: int, rows: int, block_n: int) -> tuple[int, int]:
    """The kernels' visible_key_tiles: key tiles [lo, hi) a query tile can see; with causal or a
    window, those in the band from its first row's first key to its last row's last key."""
    n_blocks = -(-p.seqlen_k // block_n)
    if not p.local:
        return 0, n_blocks
    first, last = p.kernel_band()
    last_key = row0 + rows - 1 + last
    lo = max(row0 + first, 0) // block_n
    hi = min(n_blocks, 0 if last_key < 0 else last_key // block_n + 1)
    return lo, max(lo, hi)


def _tiles(p, block_m: int, block_n: int) -> tuple[int, int]:
    """Tile sizes that divide the block mask's blocks (the kernels require it; here they are cut)."""
    if p.block_mask is None:
        return block_m, block_n
    bq, bk = p.block_mask.block_size
    return math.gcd(block_m, bq), math.gcd(block_n, bk)


def _mask_slabs(p):
    """(mask slab, batch index, head index): the groups of (batch, head) pairs one slab of the block
    mask covers (all of them without a mask), as indices that keep q's axes."""
    everything = slice(None)
    if p.block_mask is None:
        yield None, everything, everything
        return
    mb, mh = p.block_mask.mask_batch, p.block_mask.mask_heads
    for b in range(mb):
        for h in range(mh):
            yield (b, h), (everything if mb == 1 else slice(b, b + 1)), (everything if mh == 1 else slice(h, h + 1))


def sparse_tiles(blocks, count: int, row_blocks: int, per_block: int, lo: int, hi: int) -> list[int]:
    """The kernels' tile walk over one mask row of row_blocks blocks (kernels/common/tile_sequence.cuh,
    sparse_tiles and TileSequence): the tiles, per_block to a block, of the ascending nonzero
    `blocks[:count]` that fall in [lo, hi), in order, found with the same shortcut, binary
    searches and cuts."""
    if lo >= hi:
        return []
    if lo == 0 and hi >= row_blocks * per_block:  # every block whole: no index read for the range
        return [int(blocks[t // per_block]) * per_block + t % per_block for t in range(count * per_block)]
    blocks = [int(x) for x in blocks[:count]]
    first = 0 if lo == 0 else bisect.bisect_left(blocks, lo // per_block)
    last = bisect.bisect_left(blocks, -(-hi // per_block))
    if first >= last:
        return []
    begin = first * per_block + max(0, lo - blocks[first] * per_block)
    end = (last - 1) * per_block + min(per_block, hi - blocks[last - 1] * per_block)
    return [blocks[t // per_block] * per_block + t % per_block for t in range(begin, end)]


def key_tiles(p, slab, row0: int, rows: int, block_n: int) -> list[int]:
    """The key tiles (of block_n) the query tile [row0, row0 + rows) visits, as the kernels'
    key_tiles: those in its band (causal, window), and with a block mask only its row's nonzero blocks."""
    lo, hi = _visible_key_tiles(p, row0, rows, block_n)
    if p.block_mask is None:
        return list(range(lo, hi))
    bq, bk = p.block_mask.block_size
    count, index = p.block_mask.kv_count[slab], p.block_mask.kv_index[slab]
    r = row0 // bq
    return sparse_tiles(index[r], int(count[r]), index.shape[-1], bk // block_n, lo, hi)


def query_tiles(p, slab, col0: int, cols: int, block_m: int) -> list[int]:
    """The query tiles (of block_m) that see the key tile [col0, col0 + cols), as the kernels'
    query_tiles: those in its band, and with a block mask those of its mask column."""
    lo, hi = 0, -(-p.seqlen_q // block_m)
    if p.local:
        first, last = p.kernel_band()
        last_query = col0 + cols - 1 - first
        lo = max(0, col0 - last) // block_m
        hi = max(lo, min(hi, 0 if last_query < 0 else last_query // block_m + 1))
    if p.block_mask is None:
        return list(range(lo, hi))
    bq, bk = p.block_mask.block_size
    count, index = p.block_mask.q_count[slab], p.block_mask.q_index[slab]
    c = col0 // bk
    return sparse_tiles(index[c], int(count[c]), index.shape[-1], bq // block_m, lo, hi)


@reference.propagating
def tiled_attention_backward(
    dout, q, k, v, out, lse, *, causal=False, scale=None, block_m=None, block_n=None, block_mask=None, window=None,
    softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, dropout_batch_start=0, compute=numpy.float64,
):
    """FlashAttention-2's backward (Algorithm 2), block by block as the dK/dV kernel schedules it:
    an outer loop over key blocks holding dK_j, dV_j, an inner loop over the query blocks that can
    see them (in the band; with block_mask, those its mask column lists), P_ij recomputed from the
    saved lse, dQ summed across key blocks; GQA/MQA: dK, dV summed over each group of query heads.
    Dropout as the kernels do it (kernels/scalar/bwd_steps.cuh): D_i' = (1 - p) D_i,
    dS = P ∘ (Z ? dP - D' : -D'), and 1 / (1 - p) on dV, dK, dQ.

    Arguments as `cupyflash.attention_backward`: `out` and `lse` are the forward's. block_m
    (query rows per step) and block_n (keys per block) default to the kernel's tile; `compute` as
    in `tiled_attention`. Returns (dq, dk, dv) in it.
    """
    p, dout, q, k, v = reference.prepare_backward(dout, q, k, v, causal, scale, block_mask, window, softcap,
                                                  alibi_slopes, dropout=(dropout_p, seed, offset), dtype=compute)
    out, lse = reference.as_array(out, compute), reference.as_array(lse, compute)
    tile = tiles.dkdv_tile_shape(p.dtype_name, tiles.padded_head_dim(p.head_dim))
    block_m, block_n = _tiles(p, block_m or tile.block_m, block_n or tile.block_n)
    sq, sk = p.seqlen_q, p.seqlen_k
    # Preprocessing: D_i = rowsum(dO_i * O_i); lse in log2 units, +inf where no key was seen so
    # that P = exp2(s - lse) is exactly 0 there (as -inf would give NaN on masked scores).
    rescale = compute(philox.rescale(p.dropout_p))
    d = ((dout * out).sum(axis=-1).transpose(0, 2, 1) / rescale)[..., None]
    lse_log2 = numpy.where(numpy.isneginf(lse), numpy.inf, lse * compute(reference.LOG2E))[..., None]
    scale_log2 = compute(p.scale * reference.LOG2E)
    grad_scale = compute(p.scale) * rescale
    qh, kh, vh, doh = _heads_major(q, k, v, dout)
    del q, k, v, dout
    dq = numpy.zeros(qh.shape, compute)
    dk = numpy.zeros(kh.shape, compute)
    dv = numpy.zeros(vh.shape, compute)

    for slab, bs, hs in _mask_slabs(p):
        for col0 in range(0, sk, block_n):  # one thread block per key block j (and head, batch)
            cols = min(block_n, sk - col0)
            k_j, v_j = kh[bs, hs, col0 : col0 + cols], vh[bs, hs, col0 : col0 + cols]
            dk_j = numpy.zeros(k_j.shape, compute)
            dv_j = numpy.zeros(k_j.shape, compute)
            # Query blocks outside the band (causal: before key col0's diagonal) are skipped.
            for m_block in query_tiles(p, slab, col0, cols, block_m):
                row0 = m_block * block_m
                rows = min(block_m, sq - row0)
                q_i, do_i = qh[bs, hs, row0 : row0 + rows], doh[bs, hs, row0 : row0 + rows]
                s_ij = (q_i * scale_log2) @ k_j.swapaxes(-1, -2)  # Q_i prescaled, as in the forward
                s_ij, derivative = reference.modify_scores(s_ij, p, compute, row0, col0, bs, hs, reference.LOG2E)
                if p.local and reference.band_cuts(p, row0, rows, col0, cols):
                    s_ij[..., reference.tile_hidden(p, row0, rows, col0, cols)] = -numpy.inf
                s_ij -= lse_log2[bs, hs, row0 : row0 + rows]
                p_ij = numpy.exp2(s_ij, out=s_ij)
                dp_ij = do_i @ v_j.swapaxes(-1, -2)
                d_i = d[bs, hs, row0 : row0 + rows]
                if p.dropout:
                    keep = _tile_keep(p, dropout_batch_start, bs, hs, row0, rows, col0, cols)
                    ds_ij = p_ij * numpy.where(keep, dp_ij - d_i, -d_i)
                    p_ij = p_ij * keep
                else:
                    dp_ij -= d_i
                    ds_ij = numpy.multiply(p_ij, dp_ij, out=dp_ij)
                dv_j += p_ij.swapaxes(-1, -2) @ do_i
                if derivative is not None:
                    ds_ij *= derivative
                dk_j += ds_ij.swapaxes(-1, -2) @ q_i
                dq[bs, hs, row0 : row0 + rows] += grad_scale * (ds_ij @ k_j)
            dk[bs, hs, col0 : col0 + cols] = grad_scale * dk_j
            dv[bs, hs, col0 : col0 + cols] = rescale * dv_j
    dq, dk, dv = (x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    return dq, reference.sum_groups(dk, p.kv_group), reference.sum_groups(dv, p.kv_group)
