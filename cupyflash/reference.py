"""NumPy float64 references for cupyflash (no GPU needed).

- `attention`, `attention_backward`, `block_sparse_attention`, `attention_decode`,
  `attention_varlen` and their backwards: the definitions, materialising the score matrix; every
  kernel is validated against them, and they against scipy.special.softmax and brute force.
- `attention_in_precision`, `attention_backward_in_precision`: the same computation in the input
  precision, from which `error_bound` makes the tests' tolerance (flash-attn's rule: at most twice
  that computation's error, plus a rounding-noise floor).
- `tiled_attention`, `tiled_attention_backward`: FlashAttention-2's Algorithms 1 and 2 in NumPy
  with the kernels' own tile schedule; the CPU fallback of `cupyflash.attention` and its backward.

All take the arguments of the cupyflash function of the same name (NumPy or CuPy arrays, any
supported dtype) and compute in float64.
"""

from cupyflash.cpu.reference import (
    LOG2E, attention, attention_backward, attention_backward_in_precision, attention_decode, attention_in_precision,
    attention_varlen, attention_varlen_backward, band_mask, block_sparse_attention, block_sparse_attention_backward,
    causal_mask, error_bound, gradient_exponent_size, gradient_term_magnitudes, lse_term_magnitude, noise_floor,
    output_term_magnitude,
)
from cupyflash.cpu.tiled import key_tiles, query_tiles, sparse_tiles, tiled_attention, tiled_attention_backward

__all__ = [
    "LOG2E", "attention", "attention_backward", "attention_backward_in_precision", "attention_decode",
    "attention_in_precision", "attention_varlen", "attention_varlen_backward", "band_mask", "block_sparse_attention",
    "block_sparse_attention_backward", "causal_mask", "error_bound", "gradient_exponent_size",
    "gradient_term_magnitudes", "key_tiles", "lse_term_magnitude", "noise_floor", "output_term_magnitude",
    "query_tiles", "sparse_tiles", "tiled_attention", "tiled_attention_backward",
]
