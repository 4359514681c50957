"""Block-sparse attention on the CPU: BlockMask's constructors and compressed form, the kernels'
tile walk (mirrored in NumPy), the float64 reference against brute force, the tiled mirror
against the reference, validation, and the no-GPU fallback."""

import math

import numpy
import pytest
import scipy.special

import cupyflash
from cupyflash import BlockMask, catalog, reference
from cupyflash.catalog import tiles
from shapes import random_qkv


def random_mask(rng, shape, density):
    return rng.random(shape) < density


# --------------------------------------------------------------------------- BlockMask


@pytest.mark.parametrize("shape", [(1, 5, 7), (3, 4, 4), (2, 3, 6, 5), (1, 1, 1, 1), (2, 0, 3)])
def test_compressed_form_lists_each_rows_and_columns_nonzero_blocks(rng, shape):
    dense = random_mask(rng, shape, 0.4)
    mask = BlockMask.from_dense(dense)
    full = dense if dense.ndim == 4 else dense[None]
    for b, h in numpy.ndindex(full.shape[:2]):
        for r in range(full.shape[2]):
            nonzero = numpy.flatnonzero(full[b, h, r])
            assert mask.kv_count[b, h, r] == nonzero.size
            numpy.testing.assert_array_equal(mask.kv_index[b, h, r, : nonzero.size], nonzero)
            assert (mask.kv_index[b, h, r, nonzero.size :] == -1).all()
        for c in range(full.shape[3]):
            nonzero = numpy.flatnonzero(full[b, h, :, c])
            assert mask.q_count[b, h, c] == nonzero.size
            numpy.testing.assert_array_equal(mask.q_index[b, h, c, : nonzero.size], nonzero)
        # The dK/dV pass's start order: every key block once, most query blocks first, ties in
        # index order.
        order = mask.key_order[b, h]
        numpy.testing.assert_array_equal(numpy.sort(order), numpy.arange(full.shape[3]))
        want = sorted(range(full.shape[3]), key=lambda c: (-int(full[b, h, :, c].sum()), c))
        numpy.testing.assert_array_equal(order, want)
    for x in (mask.kv_count, mask.kv_index, mask.q_count, mask.q_index, mask.key_order):
        assert x.dtype == numpy.int32 and x.flags.c_contiguous and not x.flags.writeable
    numpy.testing.assert_array_equal(mask.to_dense(), dense)
    assert mask.shape == dense.shape
    assert mask.nonzero == dense.sum()
    assert mask.density == (dense.mean() if dense.size else 0.0)
    dense[...] = True  # the mask keeps its own copy
    assert mask.nonzero == int(mask.kv_count.sum()) and mask.to_dense().sum() == mask.nonzero


def test_query_tiles_of_the_longest_rows_start_first(rng):
    """The warp-specialised forward's tile order (BlockMask.query_tile_order): tiles by class of
    their key-block count (floor(log2(count / median) + 0.5)), the highest first, index order
    within a class, empty rows last; None where no tile's class is above the median's."""
    from cupyflash.block_mask import longest_rows_first

    # A BigBird-like row of 30 blocks first, then the one at 1.5x the median (class 1), the rest
    # in index order, the empty row last.
    numpy.testing.assert_array_equal(longest_rows_first(numpy.array([2, 30, 2, 3, 0, 2])), [1, 3, 0, 2, 5, 4])
    # No row in a class above the median's: index order (the sparse benchmark's random masks,
    # 3 or 4 blocks a row; a band's shorter first and last rows), and so for all-empty launches.
    assert longest_rows_first(numpy.array([3, 4, 3, 3, 4, 3])) is None
    assert longest_rows_first(numpy.array([2, 3, 3, 3, 3, 2])) is None
    assert longest_rows_first(numpy.zeros(5, numpy.int32)) is None
    counts = rng.integers(0, 40, 500)
    order = longest_rows_first(counts)
    assert order.dtype == numpy.int32
    numpy.testing.assert_array_equal(numpy.sort(order), numpy.arange(500))
    median = numpy.median(counts[counts > 0])
    with numpy.errstate(divide="ignore"):
        classes = numpy.floor(numpy.log2(counts / median) + 0.5)
    want = sorted(range(500), key=lambda t: (-classes[t], t))
    numpy.testing.assert_array_equal(order, want)

    # A launch's tiles: query tile fastest, then head, then batch; tiles of 64 rows halve a mask
    # row of 128, and a mask with one head serves every head.
    dense = numpy.zeros((2, 1, 3, 4), bool)
    dense[0, 0, 0] = True  # batch 0's first row sees every key block
    dense[:, 0, 1, :1] = True
    dense[1, 0, 2, :2] = True
    mask = BlockMask(dense)
    counts = mask.tile_key_blocks(2, 3, 300, 64)  # 5 tiles of 64 rows (the last cut short)
    numpy.testing.assert_array_equal(counts.reshape(2, 3, 5), [[[4, 4, 1, 1, 0]] * 3, [[0, 0, 1, 1, 2]] * 3])
    order = longest_rows_first(counts)
    # The median row has 1 block: batch 0's rows of 4 (class 2), batch 1's of 2 (class 1), those of
    # 1, then the empty ones.
    assert list(order[:6]) == [0, 1, 5, 6, 10, 11]
    assert list(order[6:9]) == [19, 24, 29]


@pytest.mark.parametrize(
    "mask_shape, batch, heads, kv_group, tiles, steps",
    [
        ((4, 6, 7), 3, 4, 1, 1, 2),  # a mask per head, 2 steps a query block (d128's 64-row tiles)
        ((1, 6, 7), 2, 4, 2, 2, 1),  # one mask for every head, GQA groups of 2, 2 tiles a key block
        ((2, 3, 5, 9), 2, 3, 3, 1, 1),  # a mask per batch entry and head, one group of 3
    ],
)
def test_dkdv_items_of_columns_far_longer_than_the_rest_start_first(rng, mask_shape, batch, heads, kv_group, tiles,
                                                                   steps):
    """The warp-specialised dK/dV kernel's claim order (BlockMask.dkdv_item_order): item_steps
    against brute force (an item is a key tile of one K/V head and batch entry, numbered as the
    kernel's launch: each key block's tiles in the group's first head's key_order, fastest, then
    K/V heads, then batch; its steps are its key block's query blocks over every head of its
    group), and outliers_first: the items of class 3 and above first, by class, then the rest in
    launch order; None where there is no such item."""
    from cupyflash.block_mask import outliers_first

    dense = random_mask(rng, mask_shape, 0.3)
    mask = BlockMask(dense)
    full = numpy.broadcast_to(dense if dense.ndim == 4 else dense[None], (batch, heads) + dense.shape[-2:])
    key_order = numpy.broadcast_to(mask.key_order, (batch, heads, full.shape[3]))
    want = []
    for b in range(batch):
        for kv in range(heads // kv_group):
            for position in range(full.shape[3] * tiles):
                key_block = key_order[b, kv * kv_group, position // tiles]
                group = range(kv * kv_group, (kv + 1) * kv_group)
                want.append(steps * sum(int(full[b, h, :, key_block].sum()) for h in group))
    numpy.testing.assert_array_equal(mask.item_steps(batch, heads, kv_group, tiles, steps), want)

    # Class 3 is 2**2.5 (5.66) x the median or more: 6 x the median of 4 is; 5 x is not (class 2),
    # nor is the sparse benchmark's random masks' longest column, 3 x the median.
    numpy.testing.assert_array_equal(outliers_first(numpy.array([4, 4, 24, 5, 0, 96, 3, 4])), [5, 2, 0, 1, 3, 4, 6, 7])
    assert outliers_first(numpy.array([4, 4, 20, 5, 0, 12, 3, 4])) is None
    assert outliers_first(numpy.zeros(4, numpy.int32)) is None
    counts = rng.integers(0, 12, 300)
    counts[rng.choice(300, 5, replace=False)] = rng.integers(60, 200, 5)
    order = outliers_first(counts)
    assert order.dtype == numpy.int32
    median = numpy.median(counts[counts > 0])
    classes = numpy.floor(numpy.log2(numpy.maximum(counts, 1) / median) + 0.5)
    outliers = [i for i in range(300) if counts[i] and classes[i] >= 3]
    assert 5 <= len(outliers) and list(order) == sorted(outliers, key=lambda i: (-classes[i], i)) + [
        i for i in range(300) if i not in outliers]


def test_repr_and_block_size():
    mask = BlockMask.from_dense(numpy.array([[[True, False], [True, True]]]), block_size=(64, 256))
    assert mask.block_size == (64, 256)
    assert repr(mask) == "BlockMask(shape=(1, 2, 2), block_size=(64, 256), nonzero=3 of 4 blocks, density=0.75)"
    assert BlockMask(numpy.ones((1, 2, 2), bool)).block_size == (128, 128)


def _element_blocks(visible, bq, bk):
    """Block (i, j) is nonzero when any element of the element mask in it is True."""
    sq, sk = visible.shape[-2:]
    nq, nk = math.ceil(sq / bq), math.ceil(sk / bk)
    padded = numpy.zeros(visible.shape[:-2] + (nq * bq, nk * bk), bool)
    padded[..., :sq, :sk] = visible
    return padded.reshape(visible.shape[:-2] + (nq, bq, nk, bk)).any(axis=(-3, -1))


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 300), (1, 517), (517, 130), (128, 256), (0, 5)])
def test_causal_and_local_constructors_match_their_element_masks(seqlen_q, seqlen_k):
    i = numpy.arange(seqlen_q)[:, None]
    j = numpy.arange(seqlen_k)[None, :]
    diag = i + seqlen_k - seqlen_q
    for block_size in (128, (64, 32)):
        bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
        causal = BlockMask.causal(seqlen_q, seqlen_k, block_size)
        numpy.testing.assert_array_equal(causal.to_dense()[0], _element_blocks(j <= diag, bq, bk))
        for window in (0, 50, 1000):
            local = BlockMask.local(seqlen_q, seqlen_k, window, block_size)
            numpy.testing.assert_array_equal(local.to_dense()[0], _element_blocks(numpy.abs(j - diag) <= window, bq, bk))


def test_partial_marks_the_blocks_the_causal_diagonal_cuts():
    for seqlen_q, seqlen_k in ((300, 300), (200, 517), (517, 200), (1, 1)):
        mask = BlockMask.from_dense(numpy.ones((1, math.ceil(seqlen_q / 64), math.ceil(seqlen_k / 32)), bool), (64, 32))
        i = numpy.arange(seqlen_q)[:, None]
        j = numpy.arange(seqlen_k)[None, :]
        visible = j <= i + seqlen_k - seqlen_q
        some_visible = _element_blocks(visible, 64, 32)
        some_hidden = _element_blocks(~visible, 64, 32)
        numpy.testing.assert_array_equal(mask.partial(seqlen_q, seqlen_k)[0], some_visible & some_hidden)


def test_strided_and_from_mask_fn():
    strided = BlockMask.strided(2048, 2048, 4).to_dense()[0]
    i, j = numpy.indices(strided.shape)
    numpy.testing.assert_array_equal(strided, (abs(i - j) < 4) | ((i - j) % 4 == 0))
    band = BlockMask.from_mask_fn(lambda i, j: abs(i - j) <= 1, 4096, 4000)
    assert band.shape == (1, 32, 32) and band.nonzero == 32 + 2 * 31
    per_head = BlockMask.from_mask_fn(lambda i, j: numpy.stack([i >= j, i <= j]), 300, 300, 128)
    assert per_head.shape == (2, 3, 3) and per_head.nonzero == 12
    with pytest.raises(TypeError, match="boolean"):
        BlockMask.from_mask_fn(lambda i, j: i + j, 300, 300)
    with pytest.raises(ValueError, match="broadcast"):
        BlockMask.from_mask_fn(lambda i, j: numpy.ones((5, 5), bool), 300, 300)


def test_bigbird_pattern():
    m = BlockMask.bigbird(4096, 4096, window=1, n_global=2, n_random=3, seed=7, heads=2)
    assert m.shape == (2, 32, 32)
    dense = m.to_dense()
    i, j = numpy.indices((32, 32))
    fixed = (abs(i - j) <= 1) | (j < 2) | (i < 2)
    assert dense[:, fixed].all()
    extra = (dense & ~fixed).sum(axis=-1)
    assert (extra[:, 2:] == 3).all()  # n_random more per query block, outside the fixed pattern
    assert not (dense[0] == dense[1]).all()  # drawn per head
    numpy.testing.assert_array_equal(BlockMask.bigbird(4096, 4096, 1, 2, 3, seed=7, heads=2).to_dense(), dense)


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((numpy.ones((2, 2), bool),), ValueError, "shape"),
        ((numpy.ones((1, 2, 2)),), TypeError, "dtype bool"),
        (([[[True]]],), TypeError, "boolean NumPy or CuPy array"),
        ((numpy.ones((1, 2, 2), bool), 100), ValueError, "multiples of 16"),
        ((numpy.ones((1, 2, 2), bool), (128,)), TypeError, "pair"),
        ((numpy.ones((1, 2, 2), bool), 0), ValueError, "positive"),
        ((numpy.ones((1, 2, 2), bool), True), TypeError, "int"),
    ],
)
def test_bad_masks_are_rejected(args, exc, match):
    with pytest.raises(exc, match=match):
        BlockMask(*args)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="window"):
        BlockMask.local(100, 100, -1)
    with pytest.raises(TypeError, match="stride"):
        BlockMask.strided(100, 100, 2.5)
    with pytest.raises(ValueError, match="stride"):
        BlockMask.strided(100, 100, 0)
    with pytest.raises(ValueError, match="seqlen_q"):
        BlockMask.causal(-1, 100)


# --------------------------------------------------------------------------- the tile walk


def test_sparse_tiles_visits_the_tiles_of_nonzero_blocks_in_range(rng):
    """reference.sparse_tiles mirrors the kernels' sparse_tiles/TileSequence line for line; here
    it is checked against its definition."""
    whole_rows = 0
    for _ in range(2000):
        n_blocks = int(rng.integers(1, 12))
        blocks = numpy.flatnonzero(rng.random(n_blocks) < rng.random())
        per_block = int(rng.choice([1, 2, 4]))
        # Ranges that cut the row, and (a third) ranges from 0 to its end or past it, the shortcut's.
        lo, hi = sorted(int(x) for x in rng.integers(0, n_blocks * per_block + 1, 2))
        if rng.random() < 1 / 3:
            lo, hi = 0, n_blocks * per_block + int(rng.integers(-per_block, per_block + 1))
        whole_rows += lo == 0 and hi >= n_blocks * per_block
        expected = [b * per_block + s for b in blocks for s in range(per_block) if lo <= b * per_block + s < hi]
        padded = numpy.concatenate([blocks, -numpy.ones(n_blocks - blocks.size, int)])
        assert reference.sparse_tiles(padded, blocks.size, n_blocks, per_block, lo, hi) == expected
    assert whole_rows > 300


# --------------------------------------------------------------------------- reference


def brute_force_block_sparse(q, k, v, dense, block_size, causal, scale):
    """Loops over (batch, head, query) with scipy's softmax over the visible keys."""
    q, k, v = (numpy.asarray(x, numpy.float64) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk = k.shape[1]
    bq, bk = block_size
    full = dense if dense.ndim == 4 else dense[None]
    out = numpy.zeros(q.shape)
    lse = numpy.full((b, h, sq), -numpy.inf)
    for bi, hi, i in numpy.ndindex(b, h, sq):
        row = full[min(bi, full.shape[0] - 1), min(hi, full.shape[1] - 1), i // bq]
        keys = [j for j in range(sk) if row[j // bk] and not (causal and j > i + sk - sq)]
        if keys:
            s = scale * k[bi, keys, hi] @ q[bi, i, hi]
            out[bi, i, hi] = scipy.special.softmax(s) @ v[bi, keys, hi]
            lse[bi, hi, i] = scipy.special.logsumexp(s)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_shape", ["shared", "per_head", "per_batch_and_head"])
def test_reference_against_brute_force(rng, causal, mask_shape):
    q, k, v = random_qkv(rng, "float64", 2, 150, 97, 3, 8)
    block = (32, 16)
    grid = (math.ceil(150 / 32), math.ceil(97 / 16))
    shape = {"shared": (1, *grid), "per_head": (3, *grid), "per_batch_and_head": (2, 1, *grid)}[mask_shape]
    dense = random_mask(rng, shape, 0.5)
    dense[..., 1, :] = False  # a query block with no key block: out 0, lse -inf
    mask = BlockMask(dense, block)
    out, lse = reference.block_sparse_attention(q, k, v, mask, causal=causal, scale=0.4, return_lse=True)
    want, want_lse = brute_force_block_sparse(q, k, v, dense, block, causal, 0.4)
    numpy.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    # An absolute floor too: a row's lse can fall near 0, where float64 rounding of the scores'
    # sum (~1e-16 absolute) is no longer small against it (CI seed 3381448616: lse 3.6e-5, off by 6e-17).
    numpy.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert (out[:, 32:64] == 0).all() and numpy.isneginf(lse[:, :, 32:64]).all()


def test_full_mask_is_dense_attention(rng):
    q, k, v = random_qkv(rng, "float32", 2, 130, 257, 2, 16)
    mask = BlockMask(numpy.ones((1, 2, 3), bool))
    for causal in (False, True):
        numpy.testing.assert_array_equal(
            reference.block_sparse_attention(q, k, v, mask, causal=causal),
            reference.attention(q, k, v, causal=causal),
        )
        numpy.testing.assert_array_equal(
            reference.tiled_attention(q, k, v, causal=causal, block_mask=mask),
            reference.tiled_attention(q, k, v, causal=causal, block_m=64, block_n=32),
        )


def test_backward_reference_against_finite_differences(rng):
    q, k, v = random_qkv(rng, "float64", 1, 40, 50, 2, 4)
    dout = rng.standard_normal(q.shape)
    mask = BlockMask(random_mask(rng, (2, 3, 4), 0.6) | numpy.eye(3, 4, dtype=bool), (16, 16))
    grads = reference.block_sparse_attention_backward(dout, q, k, v, mask, causal=True)

    def loss(q, k, v):
        return float((reference.block_sparse_attention(q, k, v, mask, causal=True) * dout).sum())

    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        for idx in [tuple(rng.integers(0, n) for n in x.shape) for _ in range(6)]:
            saved = x[idx]
            x[idx] = saved + eps
            up = loss(q, k, v)
            x[idx] = saved - eps
            down = loss(q, k, v)
            x[idx] = saved
            assert abs((up - down) / (2 * eps) - g[idx]) <= 1e-6 * max(1.0, abs(g[idx]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tiles", [(None, None), (16, 16), (32, 64), (64, 32)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 17), (200, 113), (113, 300), (256, 256)])
def test_tiled_mirror_skips_blocks_and_matches_the_reference(rng, causal, tiles, seqlen_q, seqlen_k):
    q, k, v = random_qkv(rng, "float32", 2, seqlen_q, seqlen_k, 3, 8)
    dout = rng.standard_normal(q.shape).astype(numpy.float32)
    block = (64, 64)
    mask = BlockMask(random_mask(rng, (3, math.ceil(seqlen_q / 64), math.ceil(seqlen_k / 64)), 0.5), block)
    out, lse = reference.tiled_attention(
        q, k, v, causal=causal, return_lse=True, block_m=tiles[0], block_n=tiles[1], block_mask=mask
    )
    want, want_lse = reference.block_sparse_attention(q, k, v, mask, causal=causal, return_lse=True)
    numpy.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
    numpy.testing.assert_allclose(lse, want_lse, rtol=1e-10, atol=1e-12)
    grads = reference.tiled_attention_backward(
        dout, q, k, v, out, lse, causal=causal, block_m=tiles[0], block_n=tiles[1], block_mask=mask
    )
    for g, w in zip(grads, reference.block_sparse_attention_backward(dout, q, k, v, mask, causal=causal)):
        numpy.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11)


def test_tiled_mirror_never_touches_a_zero_block(rng):
    """The mirror's walk (as the kernels') only reaches key tiles of nonzero blocks: NaN keys and
    values in the zero block leave the result finite and equal to the reference's."""
    q, k, v = random_qkv(rng, "float64", 1, 128, 256, 1, 8)
    mask = BlockMask(numpy.array([[[True, False]]]), 128)
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[:, 128:] = numpy.nan  # keys and values of the zero block (0, 1)
    v_nan[:, 128:] = numpy.nan
    out = reference.tiled_attention(q, k_nan, v_nan, block_mask=mask)
    numpy.testing.assert_allclose(out, reference.attention(q, k[:, :128], v[:, :128]), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- the public functions


@pytest.mark.cpu_only
def test_cpu_fallback(rng):
    q, k, v = random_qkv(rng, "float32", 2, 300, 200, 2, 24)
    dout = rng.standard_normal(q.shape).astype(numpy.float32)
    mask = BlockMask.bigbird(300, 200, window=0, n_global=0, n_random=1, seed=1, heads=2)
    out, lse = cupyflash.block_sparse_attention(q, k, v, mask, causal=True, return_lse=True)
    assert isinstance(out, numpy.ndarray) and out.dtype == numpy.float32 and lse.dtype == numpy.float32
    want = reference.block_sparse_attention(q, k, v, mask, causal=True)
    numpy.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    grads = cupyflash.block_sparse_attention_backward(dout, q, k, v, out, lse, mask, causal=True)
    for g, w in zip(grads, reference.block_sparse_attention_backward(dout, q, k, v, mask, causal=True)):
        assert g.dtype == numpy.float32
        numpy.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_granularity_is_every_kernels_largest_tile():
    for dtype_name in tiles.DTYPE_NAMES:
        for d in (1, 64, 100, 256):
            tile_q, tile_k = catalog.block_mask_granularity(dtype_name, d)
            assert 128 % tile_q == 0 and 128 % tile_k == 0  # the default block size always works
            v = catalog.Variant(local=True, block_sparse=True)
            kernels = [catalog.forward_kernel("scalar", dtype_name, d, v), catalog.dkdv_kernel("scalar", dtype_name, d, v),
                       catalog.dq_kernel(False, dtype_name, d, v)]
            if dtype_name in tiles.TENSOR_CORE_DTYPES:
                kernels += [catalog.forward_kernel("sm80", dtype_name, d, v), catalog.dq_kernel(True, dtype_name, d, v),
                            catalog.dkdv_kernel("sm80", dtype_name, d, v, large_smem=True)]
            assert all(tile_q % k.tile.block_m == 0 and tile_k % k.tile.block_n == 0 for k in kernels)
