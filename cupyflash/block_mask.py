"""BlockMask: which (query block, key block) tiles of the attention matrix block-sparse attention
computes (FlashAttention, §3.3 and Algorithm 5), and the compressed form its kernels read."""

from __future__ import annotations

import dataclasses
import math

import numpy

from cupyflash import validation
from cupyflash.problem import AttentionProblem

DEFAULT_BLOCK_SIZE = 128


class BlockMask:
    """A block mask for `cupyflash.block_sparse_attention`.

    The seqlen_q x seqlen_k attention matrix is cut into blocks of ``block_size = (block_q,
    block_k)`` queries x keys; the mask says which blocks are computed. A zero block's keys are
    hidden from its queries, and the kernels never load its K_j, V_j tiles, so the run time falls
    with the fraction of nonzero blocks (`density`). The last block of each axis may be cut short
    by the sequence's end.

    Parameters
    ----------
    mask : boolean array, shape (heads or 1, n_q_blocks, n_k_blocks) or (batch or 1, heads or 1,
        n_q_blocks, n_k_blocks), NumPy or CuPy (copied to the host once)
        True where a block is computed. A size-1 batch or head axis applies to every batch entry
        or head. For a call with seqlen_q, seqlen_k: n_q_blocks = ceil(seqlen_q / block_q),
        n_k_blocks = ceil(seqlen_k / block_k).
    block_size : int or (int, int)
        Queries and keys per block, default 128 x 128. Each must be a multiple of 16, and for a
        call a multiple of the kernels' tiles for its dtype and head_dim (128 always is; checked
        on every path, the CPU fallback included, so a mask works the same everywhere).

    Stored, besides the boolean mask: per query block, the count and the left-packed ascending
    indices of its nonzero key blocks (``kv_count``, ``kv_index``; the forward and the
    deterministic dQ pass walk these), and the transpose, per key block, the query blocks that see
    it (``q_count``, ``q_index``; the dK/dV pass), with the order the dK/dV pass starts the key
    blocks in (``key_order``: most query blocks first). Blocks that a causal diagonal cuts through
    are partial (`partial`): only they get per-element masking; every other nonzero block is full.

    Example: queries 0-255 see keys 0-127, queries 256-299 see keys 128-299::

        >>> m = BlockMask.from_dense(numpy.array([[[1, 0, 0], [0, 1, 1], [0, 1, 1]]], bool))
        >>> m
        BlockMask(shape=(1, 3, 3), block_size=(128, 128), nonzero=5 of 9 blocks, density=0.556)
    """

    def __init__(self, mask, block_size=DEFAULT_BLOCK_SIZE):
        dense = validation.check_block_mask_array(mask)
        self._block_size = validation.check_block_size(block_size)
        self._dense = dense
        self._dense.setflags(write=False)
        full = dense if dense.ndim == 4 else dense[None]
        self._mask4 = full
        self.kv_count, self.kv_index = _compress(full)
        self.q_count, self.q_index = _compress(full.transpose(0, 1, 3, 2))
        # The dK/dV pass's thread blocks (one per key block) run in launch order, as many at a time
        # as the GPU holds. Started longest first, the short ones fill the launch's tail, where
        # the default order can leave one long block running alone (longest-processing-time
        # first, Graham 1969).
        self.key_order = numpy.ascontiguousarray(numpy.argsort(-self.q_count, axis=-1, kind="stable"), numpy.int32)
        for array in (self.kv_count, self.kv_index, self.q_count, self.q_index, self.key_order):
            array.setflags(write=False)
        self._nonzero = int(self.kv_count.sum())
        self._on_device = {}
        self._tile_orders = {}  # query_tile_order's and dkdv_item_order's, per launch shape and device (_kept_order)
        # Calls' checked problems with this mask (api/common.py's cache of checked problems), kept
        # here rather than in a global cache so that they go when the mask goes. They hold no
        # reference to it.
        self.checked_problems = {}

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dense(cls, mask, block_size=DEFAULT_BLOCK_SIZE) -> BlockMask:
        """The mask of a boolean block array (see the class)."""
        return cls(mask, block_size)

    @classmethod
    def from_mask_fn(cls, fn, seqlen_q: int, seqlen_k: int, block_size=DEFAULT_BLOCK_SIZE) -> BlockMask:
        """The mask whose block (i, j) is ``fn(i, j)``, called once on broadcasting integer arrays
        of query-block indices (shape (n_q_blocks, 1)) and key-block indices (shape
        (1, n_k_blocks)); it returns a boolean array broadcastable to (n_q_blocks, n_k_blocks), or
        (heads, n_q_blocks, n_k_blocks) for a mask per head. Nothing of size seqlen_q x seqlen_k
        is built. Example, a band of 3 blocks: ``from_mask_fn(lambda i, j: abs(i - j) <= 1, 4096,
        4096)``."""
        bq, bk = validation.check_block_size(block_size)
        nq, nk = _block_counts(seqlen_q, seqlen_k, bq, bk)
        i = numpy.arange(nq)[:, None]
        j = numpy.arange(nk)[None, :]
        result = numpy.asarray(fn(i, j))
        if result.dtype != numpy.bool_:
            raise TypeError(f"fn must return a boolean array, got dtype {result.dtype}")
        if result.ndim > 3:
            raise ValueError(f"fn must return at most 3 dimensions (heads, n_q_blocks, n_k_blocks), got {result.shape}")
        try:
            result = numpy.broadcast_to(result, result.shape[:-2] + (nq, nk) if result.ndim == 3 else (nq, nk))
        except ValueError:
            raise ValueError(f"fn's result of shape {result.shape} does not broadcast to ({nq}, {nk})") from None
        return cls(result.reshape((result.shape[0] if result.ndim == 3 else 1, nq, nk)).copy(), (bq, bk))

    @classmethod
    def causal(cls, seqlen_q: int, seqlen_k: int, block_size=DEFAULT_BLOCK_SIZE) -> BlockMask:
        """The blocks causal attention sees (bottom-right aligned, as `attention`'s causal): block
        (i, j) is nonzero when some query of block i sees some key of block j. The diagonal
        blocks are partial; pass causal=True to the call for their per-element mask."""
        bq, bk = validation.check_block_size(block_size)

        def visible(i, j):
            return j * bk <= _last_diagonal_key(i, bq, seqlen_q, seqlen_k)

        return cls.from_mask_fn(visible, seqlen_q, seqlen_k, (bq, bk))

    @classmethod
    def local(cls, seqlen_q: int, seqlen_k: int, window: int, block_size=DEFAULT_BLOCK_SIZE) -> BlockMask:
        """Sliding-window blocks: the blocks holding some key within `window` positions of a
        query's diagonal position (query i's diagonal is key i + seqlen_k - seqlen_q), on both
        sides; with causal=True in the call, only the keys before it."""
        window = validation.check_count(window, "window")
        bq, bk = validation.check_block_size(block_size)

        def near(i, j):
            first_diag = i * bq + seqlen_k - seqlen_q
            last_diag = _last_diagonal_key(i, bq, seqlen_q, seqlen_k)
            first_key, last_key = j * bk, numpy.minimum((j + 1) * bk, seqlen_k) - 1
            return (first_key <= last_diag + window) & (last_key >= first_diag - window)

        return cls.from_mask_fn(near, seqlen_q, seqlen_k, (bq, bk))

    @classmethod
    def strided(cls, seqlen_q: int, seqlen_k: int, stride: int, block_size=DEFAULT_BLOCK_SIZE) -> BlockMask:
        """The Sparse Transformer's strided pattern (Child et al., 2019) on blocks, `stride` in
        blocks: block (i, j) is nonzero when key block j is within stride - 1 blocks of query
        block i's diagonal block d(i) (the "local" head) or |d(i) - j| is a multiple of stride (the
        "strided" head). With causal=True in the call, only the blocks left of the diagonal."""
        stride = validation.check_count(stride, "stride", minimum=1)
        bq, bk = validation.check_block_size(block_size)

        def pattern(i, j):
            distance = numpy.abs(_diagonal_block(i, bq, bk, seqlen_q, seqlen_k) - j)
            return (distance < stride) | (distance % stride == 0)

        return cls.from_mask_fn(pattern, seqlen_q, seqlen_k, (bq, bk))

    @classmethod
    def bigbird(
        cls, seqlen_q: int, seqlen_k: int, window: int, n_global: int, n_random: int, seed=0,
        block_size=DEFAULT_BLOCK_SIZE, heads: int = 1,
    ) -> BlockMask:
        """BigBird's pattern (Zaheer et al., 2020) on blocks: each query block i sees the key
        blocks within `window` blocks of its diagonal block, the first `n_global` key blocks,
        and `n_random` other key blocks drawn per query block and head from
        ``numpy.random.default_rng(seed)``; the first `n_global` query blocks see every key
        block. Shape (heads, n_q_blocks, n_k_blocks)."""
        window = validation.check_count(window, "window")
        n_global = validation.check_count(n_global, "n_global")
        n_random = validation.check_count(n_random, "n_random")
        heads = validation.check_count(heads, "heads", minimum=1)
        bq, bk = validation.check_block_size(block_size)
        nq, nk = _block_counts(seqlen_q, seqlen_k, bq, bk)
        i = numpy.arange(nq)[:, None]
        j = numpy.arange(nk)[None, :]
        fixed = (numpy.abs(_diagonal_block(i, bq, bk, seqlen_q, seqlen_k) - j) <= window) | (j < n_global) | (i < n_global)
        mask = numpy.broadcast_to(fixed, (heads, nq, nk)).copy()
        rng = numpy.random.default_rng(seed)
        for h in range(heads):
            for row in range(nq):
                free = numpy.flatnonzero(~mask[h, row])
                if n_random and free.size:
                    mask[h, row, rng.choice(free, size=min(n_random, free.size), replace=False)] = True
        return cls(mask, (bq, bk))

    # ------------------------------------------------------------------ views

    @property
    def shape(self) -> tuple:
        """The boolean mask's shape, as given: (heads, n_q_blocks, n_k_blocks) or with batch first."""
        return self._dense.shape

    @property
    def block_size(self) -> tuple[int, int]:
        return self._block_size

    @property
    def nonzero(self) -> int:
        """Number of nonzero blocks."""
        return self._nonzero

    @property
    def density(self) -> float:
        """Fraction of nonzero blocks (0 for an empty mask)."""
        return self.nonzero / self._dense.size if self._dense.size else 0.0

    def to_dense(self) -> numpy.ndarray:
        """The boolean block mask (a NumPy copy), in the shape it was given."""
        return self._dense.copy()

    def partial(self, seqlen_q: int, seqlen_k: int) -> numpy.ndarray:
        """Boolean, the mask's shape: the nonzero blocks that causal attention's diagonal
        (bottom-right aligned) cuts through, which get a per-element mask under causal=True. The
        rest of the nonzero blocks are full, or wholly hidden by causal and skipped."""
        bq, bk = self._block_size
        nq, nk = self._dense.shape[-2:]
        i = numpy.arange(nq)[:, None]
        j = numpy.arange(nk)[None, :]
        first_row_last_key = i * bq + seqlen_k - seqlen_q
        last_row_last_key = _last_diagonal_key(i, bq, seqlen_q, seqlen_k)
        last_key = numpy.minimum((j + 1) * bk, seqlen_k) - 1
        cut = (last_key > first_row_last_key) & (j * bk <= last_row_last_key)
        return self._dense & cut

    def element_mask(self, seqlen_q: int, seqlen_k: int) -> numpy.ndarray:
        """The mask expanded to elements: boolean (batch or 1, heads or 1, seqlen_q, seqlen_k),
        True where key j is visible to query i. For references and tests (it is O(seqlen^2))."""
        bq, bk = self._block_size
        expanded = numpy.repeat(numpy.repeat(self._mask4, bq, axis=-2), bk, axis=-1)
        return expanded[..., :seqlen_q, :seqlen_k]

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, block_size={self._block_size}, "
            f"nonzero={self.nonzero} of {self._dense.size} blocks, density={self.density:.3g})"
        )

    # ------------------------------------------------------------------ for the kernels

    @property
    def mask_batch(self) -> int:
        return self._mask4.shape[0]

    @property
    def mask_heads(self) -> int:
        return self._mask4.shape[1]

    @property
    def blocks(self) -> tuple[int, int]:
        """(n_q_blocks, n_k_blocks)."""
        return self._mask4.shape[2], self._mask4.shape[3]

    def device_arrays(self, device_id: int) -> tuple:
        """kv_count, kv_index, q_count, q_index, key_order as CuPy int32 arrays on the device
        (copied once; where two threads copy at once, both take the copy kept, whose addresses
        the problems' launch records hold)."""
        if device_id not in self._on_device:
            import cupy

            with cupy.cuda.Device(device_id):
                arrays = (self.kv_count, self.kv_index, self.q_count, self.q_index, self.key_order)
                self._on_device.setdefault(device_id, tuple(cupy.asarray(x) for x in arrays))
        return self._on_device[device_id]

    def query_tile_order(self, batch: int, heads: int, seqlen_q: int, tile_rows: int, device_id: int):
        """The order in which the block-sparse warp-specialised forward claims a launch's query
        tiles of `tile_rows` rows: int32 tile indices (query tile fastest, then head, then batch,
        as the launch numbers them) on the device, or None for the launch's own order.

        Claimed in index order, a launch ends on the tiles claimed last: on a mask whose rows
        differ in length (BigBird's global rows see every key block, a block-causal mask's last
        row sees them all), a long tile claimed late runs on alone at the end (an H100, d128:
        BigBird at 16384 tokens took 1.5x density x the dense time). So the longest go first
        (Graham's longest-processing-time rule), by class: a tile's class is its row's key
        blocks against the median row's in powers of two, rounded to the nearest. Within a class
        the tiles keep index order, in which a head's tiles run together and share its K and V in
        L2. Where no tile is in a class above the median's (the sparse benchmark's random and
        local masks), the launch's own order. Rows with no block go last (longest_rows_first)."""
        return self._kept_order(("forward", batch, heads, seqlen_q, tile_rows), device_id,
                                lambda: longest_rows_first(self.tile_key_blocks(batch, heads, seqlen_q, tile_rows)))

    def dkdv_item_order(self, batch: int, heads: int, kv_group: int, tiles_per_key_block: int,
                        steps_per_query_block: int, device_id: int):
        """The order in which the block-sparse warp-specialised dK/dV kernel claims its items
        (int32 item indices on the device), or None for the launch's own order. Items as the
        kernel numbers them: each key block's `tiles_per_key_block` key tiles in the mask's
        key_order, fastest; then K/V heads; then batch (item_steps counts their steps).

        The launch takes its items a (K/V head, batch) slab after another, each slab's longest
        first, so a column far longer than the rest still starts only when its slab comes: on a
        BigBird mask at 16384 tokens each head's global column walks all 128 query blocks, against
        about 10 for the others, and the last heads' global columns run on alone at the launch's
        end (modelled at 1.6x the launch's work / SMs, d128). So the
        items of class 3 and above (outliers_first) go first, and everything else keeps launch
        order, where a few slabs at a time are in flight and their Q_i, dO_i and dQ rows stay in
        L2 (a whole-launch sort lost more in L2 than it gained in the tail at 16384 tokens). The
        sparse benchmark's masks have no such column."""
        return self._kept_order(
            ("dkdv", batch, heads, kv_group, tiles_per_key_block, steps_per_query_block), device_id,
            lambda: outliers_first(self.item_steps(batch, heads, kv_group, tiles_per_key_block, steps_per_query_block)))

    def _kept_order(self, launch: tuple, device_id: int, make):
        """The order `make()` gives (a host int32 array or None) for this launch shape, copied to
        the device once. Kept as long as the mask (one small array per launch shape): a call
        captured in a CUDA graph goes on reading it. Where two threads made it at once, both take
        the one kept, so that neither launch reads an array already given back to the pool."""
        key = (*launch, device_id)
        if key in self._tile_orders:
            return self._tile_orders[key]
        order = make()
        if order is not None:
            import cupy

            with cupy.cuda.Device(device_id):
                order = cupy.asarray(order)
        return self._tile_orders.setdefault(key, order)

    def item_steps(self, batch: int, heads: int, kv_group: int, tiles_per_key_block: int,
                   steps_per_query_block: int) -> numpy.ndarray:
        """The steps of each item of a block-sparse dK/dV launch (dkdv_item_order's numbering): its
        key block's query blocks over the heads of its K/V group, `steps_per_query_block` each.
        Its key block is the one the kernel's key_tile gives: the group's first head's key_order."""
        n_k = self.blocks[1]
        count = numpy.broadcast_to(self.q_count, (batch, heads, n_k))
        steps = count.reshape(batch, heads // kv_group, kv_group, n_k).sum(axis=2, dtype=numpy.int64)
        order = numpy.broadcast_to(self.key_order, (batch, heads, n_k))[:, ::kv_group]
        steps = numpy.take_along_axis(steps, order, axis=-1) * steps_per_query_block
        return numpy.repeat(steps, tiles_per_key_block, axis=-1).reshape(-1)

    def tile_key_blocks(self, batch: int, heads: int, seqlen_q: int, tile_rows: int) -> numpy.ndarray:
        """The key blocks of each query tile of `tile_rows` rows (a divisor of block_q) of a
        launch, in its numbering: query tile fastest, then head, then batch."""
        rows = numpy.arange(math.ceil(seqlen_q / tile_rows)) * tile_rows // self._block_size[0]
        return numpy.broadcast_to(self.kv_count, (batch, heads, self.kv_count.shape[-1]))[..., rows].reshape(-1)


def checked_for(block_mask, p: AttentionProblem, granularity: tuple[int, int] | None = None) -> AttentionProblem:
    """The problem with its block_mask: a BlockMask whose blocks cover the problem's seqlen_q x
    seqlen_k and whose batch and head axes are 1 or the problem's, and whose block size is a
    multiple of `granularity` (queries, keys), the largest kernel tile that may run the problem
    (catalog.block_mask_granularity; None for the NumPy references, which take any block size)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cupyflash.BlockMask, got {type(block_mask).__name__}")
    bq, bk = block_mask.block_size
    want = (math.ceil(p.seqlen_q / bq), math.ceil(p.seqlen_k / bk))
    if block_mask.blocks != want:
        raise ValueError(
            f"block_mask has {block_mask.blocks[0]} x {block_mask.blocks[1]} blocks of {bq} x {bk}, but seqlen_q="
            f"{p.seqlen_q}, seqlen_k={p.seqlen_k} need ceil({p.seqlen_q}/{bq}) x ceil({p.seqlen_k}/{bk}) = "
            f"{want[0]} x {want[1]}"
        )
    if block_mask.mask_batch not in (1, p.batch) or block_mask.mask_heads not in (1, p.heads):
        raise ValueError(
            f"block_mask's batch and head axes must be 1 or the inputs' (batch={p.batch}, heads={p.heads}), "
            f"got shape {block_mask.shape}"
        )
    if granularity is not None and (bq % granularity[0] or bk % granularity[1]):
        tile_q, tile_k = granularity
        # Each kernel tile must lie in one mask block, so that it is computed whole or skipped.
        raise ValueError(
            f"block_mask's block_size ({bq}, {bk}) must be a multiple of ({tile_q}, {tile_k}), the kernels' tiles "
            f"for {p.dtype_name} with head_dim {p.head_dim}; block_size=128 or a multiple of it always is"
        )
    return dataclasses.replace(p, block_mask=block_mask)


def length_classes(counts: numpy.ndarray):
    """Each entry's class, floor(log2(count / median count) + 0.5): its length against the median
    nonzero one's in powers of two, rounded to the nearest; -inf for a count of 0. None where
    every count is 0."""
    if not counts.any():
        return None
    median = numpy.median(counts[counts > 0])
    with numpy.errstate(divide="ignore"):
        return numpy.floor(numpy.log2(counts / median) + 0.5)


def longest_rows_first(counts: numpy.ndarray):
    """The order of BlockMask.query_tile_order for tiles of these key-block counts, as int32: by
    class (length_classes), the highest first and index order within a class, tiles with no
    block last. None (index order) where no tile is in a class above the median's: no tile is
    long enough to leave a tail, and the local masks' shorter first and last rows stay among
    their heads' tiles."""
    classes = length_classes(counts)
    if classes is None or classes.max() < 1:
        return None
    return numpy.argsort(-classes, kind="stable").astype(numpy.int32)


def outliers_first(counts: numpy.ndarray, min_class: int = 3):
    """The order of BlockMask.dkdv_item_order for items of these step counts, as int32: the items
    of class `min_class` and above (length_classes; 3: about 6x the median or more) first, the
    highest class first, and every other item after them in index order. None where there is
    none. The random masks' columns, at up to 3x their mean, are class 2 at most."""
    classes = length_classes(counts)
    if classes is None or classes.max() < min_class:
        return None
    return numpy.argsort(-numpy.where(classes >= min_class, classes, 0), kind="stable").astype(numpy.int32)


def _last_diagonal_key(i, block_q: int, seqlen_q: int, seqlen_k: int):
    """The diagonal key (bottom-right aligned) of the last query of query block i: the last key
    causal lets that block see."""
    return numpy.minimum((i + 1) * block_q, seqlen_q) - 1 + seqlen_k - seqlen_q


def _diagonal_block(i, block_q: int, block_k: int, seqlen_q: int, seqlen_k: int):
    """The key block holding query block i's last diagonal key (0 where that key is negative)."""
    return numpy.clip(_last_diagonal_key(i, block_q, seqlen_q, seqlen_k) // block_k, 0, None)


def _compress(mask4: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Per row of the last two axes: the count of True entries and their ascending indices,
    left-packed (the rest -1). int32, C-contiguous."""
    cols = mask4.shape[-1]
    count = mask4.sum(axis=-1, dtype=numpy.int32)
    order = numpy.argsort(~mask4, axis=-1, kind="stable").astype(numpy.int32)
    index = numpy.where(numpy.arange(cols, dtype=numpy.int32) < count[..., None], order, numpy.int32(-1))
    return numpy.ascontiguousarray(count), numpy.ascontiguousarray(index, dtype=numpy.int32)


def _block_counts(seqlen_q: int, seqlen_k: int, block_q: int, block_k: int) -> tuple[int, int]:
    seqlen_q = validation.check_count(seqlen_q, "seqlen_q")
    seqlen_k = validation.check_count(seqlen_k, "seqlen_k")
    return math.ceil(seqlen_q / block_q), math.ceil(seqlen_k / block_k)
