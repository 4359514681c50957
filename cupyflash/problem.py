"""The checked problem a call describes (`AttentionProblem`, `DecodeProblem`), and the options a
call passes through the layers as one typed structure (`Options`)."""

from __future__ import annotations

import dataclasses

import numpy

from cupyflash.cpu import philox


def lse_dtype(dtype_name: str) -> numpy.dtype:
    """lse's dtype, the kernels' accumulator type: float32, or float64 for float64 inputs (the
    backward recomputes P from it)."""
    return numpy.dtype(numpy.float64 if dtype_name == "float64" else numpy.float32)


@dataclasses.dataclass(frozen=True)
class Options:
    """A call's options as the caller gave them, unchecked: what the public functions and the
    framework adapters pass down (validation checks them into an AttentionProblem). The fields
    mean what `cupyflash.attention`'s and `attention_backward`'s arguments of those names mean."""

    causal: object = False
    scale: object = None
    window: object = None
    softcap: object = None
    alibi_slopes: object = None
    seqlens_k: object = None
    block_mask: object = None
    dropout_p: object = 0.0
    seed: object = None
    offset: object = 0
    deterministic: object = False
    return_lse: object = False

    @property
    def dropout(self) -> tuple:
        return self.dropout_p, self.seed, self.offset


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    head_dim: int
    dtype_name: str
    causal: bool
    scale: float
    return_lse: bool
    deterministic: bool = False
    block_mask: object = None  # a BlockMask for block-sparse attention (BlockMask.checked_for)
    heads_kv: int = 0  # K/V heads (GQA/MQA: a divisor of heads); 0 is read as heads
    window: tuple | None = None  # (left, right), each an int >= 0 or None (unbounded); None: no window
    softcap: float | None = None  # scores -> softcap·tanh(scores / softcap); None: no softcap
    # ALiBi slopes, (batch or 1, heads), NumPy or CuPy as given (checked by check_alibi_slopes); None:
    # none. Left out of == (arrays do not compare to a bool); no cache keys on problems' values.
    alibi_slopes: object = dataclasses.field(default=None, compare=False, repr=False)
    # Variable-length batches (check_varlen_args): (cu_seqlens_q, cu_seqlens_k) as checked host int32
    # arrays; batch is their number of sequences, seqlen_q/seqlen_k the longest (max_seqlen_*), and
    # the arrays are packed (total, heads, head_dim). None: a fixed-length batch.
    cu_seqlens: tuple | None = dataclasses.field(default=None, compare=False, repr=False)
    # Padded batches: the keys each batch entry uses, int32 (batch,), NumPy or CuPy
    # (check_seqlens_k). None: all seqlen_k.
    seqlens_k: object = dataclasses.field(default=None, compare=False, repr=False)
    # Dropout on the probabilities (check_dropout): probability, Philox seed and offset; 0: none.
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    # What the planner and the launches derive from this problem object alone (decisions,
    # parameter images, tensor maps), kept for the next call that gets the same object back from
    # the cache of checked problems (api/common.py). Not an init field: dataclasses.replace gives
    # the new problem an empty one.
    memo: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def varlen(self) -> bool:
        """Whether sequences have their own lengths (packed, or padded keys): the kernels' varlen
        instantiation, whose band is relative to each sequence's diagonal."""
        return self.cu_seqlens is not None or self.seqlens_k is not None

    @property
    def total_q(self) -> int:
        """Query rows: packed, the sum of the sequences' lengths; else batch·seqlen_q."""
        return int(self.cu_seqlens[0][-1]) if self.cu_seqlens is not None else self.batch * self.seqlen_q

    @property
    def score_mod(self) -> bool:
        """Whether the scores are modified (softcap, ALiBi); see `modified` for the kernels."""
        return self.softcap is not None or self.alibi_slopes is not None

    @property
    def dropout(self) -> bool:
        """Whether probabilities are dropped (p at the kernels' 2^-32 resolution is above 0)."""
        return philox.threshold(self.dropout_p) > 0

    @property
    def modified(self) -> bool:
        """Whether the kernels' score_mod instantiation serves the problem: softcap, ALiBi or dropout."""
        return self.score_mod or self.dropout

    @property
    def kv_group(self) -> int:
        """Query heads per K/V head: 1 for multi-head attention."""
        return self.heads // self.heads_kv if self.heads_kv else 1

    @property
    def local(self) -> bool:
        """Whether keys outside a band are hidden (causal, a window, or both): the kernels' local
        instantiation."""
        return self.causal or self.window is not None

    @property
    def band(self) -> tuple[int | None, int | None]:
        """(left, right) of the visible band: query i sees keys j with
        i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (None: unbounded);
        causal is right = 0."""
        left, right = self.window or (None, None)
        return left, (0 if self.causal else right)

    def kernel_window(self) -> tuple[int, int]:
        """The band as the kernels take it (window_left, window_right): unbounded sides, and sides
        wider than the score matrix, clamped to seqlen_k and seqlen_q, which hide nothing."""
        left, right = self.band
        left = self.seqlen_k if left is None else min(left, self.seqlen_k)
        right = self.seqlen_q if right is None else min(right, self.seqlen_q)
        return left, right

    def kernel_band(self) -> tuple[int, int]:
        """(band_first, band_last): the first and last key query 0 sees, as the kernels take the
        band (query i sees keys i + band_first .. i + band_last). Variable-length: relative to each
        sequence's diagonal, which the kernels add (with seqlen_q, seqlen_k the longest sequence's,
        the clamped sides still hide nothing in any sequence)."""
        left, right = self.kernel_window()
        diagonal = 0 if self.varlen else self.seqlen_k - self.seqlen_q
        return diagonal - left, diagonal + right


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    """attention_decode's arguments, checked: the attention problem over the whole cache (seqlen_k
    is its capacity), the append and the per-sequence key counts."""

    attention: AttentionProblem
    seqlen_new: int  # keys appended per sequence (0: none)
    cache_seqlens: object  # int32 array (batch,) on the arrays' side, or None: every cache full
    num_splits: int | None  # None: chosen by the heuristic
