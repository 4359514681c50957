"""Dropout's keep mask: the kernels' Philox4x32-10 generator (kernels/common/philox.cuh) mirrored in NumPy,
bit for bit, and `dropout_mask`, which materialises the mask the kernels apply.

Element (query i, key j) of (batch b, head h) is dropped when a 32-bit word W < round(p·2^32), W
being word 2·((i // 8) % 2) + (j // 8) % 2 of Philox4x32-10 with key (seed mod 2^32, seed // 2^32)
and counter (group(j), group(i), b·heads + h, offset), group(x) = 8·(x // 16) + x % 8. Positions
are a sequence's own (a variable-length batch: b is the sequence's index).
"""

from __future__ import annotations

import numpy

_MASK32 = numpy.uint64(0xFFFFFFFF)
_M0, _M1 = numpy.uint64(0xD2511F53), numpy.uint64(0xCD9E8D57)  # Philox4x32's multipliers
_W0, _W1 = numpy.uint64(0x9E3779B9), numpy.uint64(0xBB67AE85)  # its key schedule's Weyl constants


def philox4x32_10(counter, key) -> tuple:
    """Philox4x32-10 of 4 counter words and 2 key words (ints or broadcastable integer arrays),
    elementwise: 4 uint64 arrays holding the output words (each < 2^32)."""
    c0, c1, c2, c3 = (numpy.asarray(c, dtype=numpy.uint64) & _MASK32 for c in counter)
    k0, k1 = (numpy.asarray(k, dtype=numpy.uint64) & _MASK32 for k in key)
    with numpy.errstate(over="ignore"):
        for round_ in range(10):
            if round_:
                k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
            p0, p1 = _M0 * c0, _M1 * c2  # < 2^64: exact in uint64
            c0, c1, c2, c3 = (p1 >> numpy.uint64(32)) ^ c1 ^ k0, p1 & _MASK32, (p0 >> numpy.uint64(32)) ^ c3 ^ k1, p0 & _MASK32
    return c0, c1, c2, c3


def threshold(dropout_p: float) -> int:
    """The kernels' drop threshold round(p·2^32) (at most 2^32 - 1): p is applied at 2^-32 resolution."""
    return min(int(round(dropout_p * 2.0**32)), 2**32 - 1)


def rescale(dropout_p: float) -> float:
    """1 / (1 - p) for the p the threshold applies, the factor on kept probabilities (1 for p = 0)."""
    return 1.0 / (1.0 - threshold(dropout_p) / 2.0**32)


def _group(x):
    return (x >> 4) * 8 + (x & 7)


def keep_tile(dropout_p: float, seed: int, offset: int, heads: int, batches, head_indices, rows, cols):
    """Boolean keep mask, (len(batches), len(head_indices), len(rows), len(cols)), for the given
    batch indices, head indices, query positions and key positions (integer sequences)."""
    b = numpy.asarray(batches, dtype=numpy.uint64)[:, None, None, None]
    h = numpy.asarray(head_indices, dtype=numpy.uint64)[None, :, None, None]
    i = numpy.asarray(rows, dtype=numpy.int64)[None, None, :, None]
    j = numpy.asarray(cols, dtype=numpy.int64)[None, None, None, :]
    words = philox4x32_10(
        (_group(j), _group(i), b * numpy.uint64(heads) + h, offset), (seed & 0xFFFFFFFF, seed >> 32)
    )
    upper = numpy.where((j & 8) != 0, words[1], words[0])
    lower = numpy.where((j & 8) != 0, words[3], words[2])
    word = numpy.where((i & 8) != 0, lower, upper)
    return word >= numpy.uint64(threshold(dropout_p))


def keep_mask_numpy(batch: int, heads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, seed: int, offset: int = 0,
                    batch_start: int = 0) -> numpy.ndarray:
    """The whole keep mask (batch, heads, seqlen_q, seqlen_k) in NumPy, of batch entries
    batch_start .. batch_start + batch - 1."""
    return keep_tile(dropout_p, seed, offset, heads, range(batch_start, batch_start + batch), range(heads),
                     range(seqlen_q), range(seqlen_k))
