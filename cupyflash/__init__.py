"""cupyflash: exact FlashAttention for NumPy, CuPy, PyTorch and JAX arrays.

`attention` and `attention_backward` take arrays of any of these frameworks (and
`block_sparse_attention` / `block_sparse_attention_backward` with a `BlockMask`, `attention_decode`
for KV-cache decoding, `attention_varlen` / `attention_varlen_backward` for packed variable-length
batches; `dropout_mask` for the keep mask of their dropout). `explain` says which kernels a call
takes and why; `set_float32_precision` and `float32_precision` choose float32's precision.
`cupyflash.torch` and `cupyflash.jax` wrap them as differentiable functions
(torch.autograd / jax.custom_vjp).

Tiled CUDA kernels (kernels/, compiled at run time through CuPy's NVRTC) compute exact softmax
attention without materialising the score matrix; `cupyflash.reference` holds the NumPy float64
definitions they are validated against and the tiled CPU fallback.
"""

from cupyflash import reference
from cupyflash.api.attention import (
    attention, attention_backward, block_sparse_attention, block_sparse_attention_backward,
)
from cupyflash.api.decode import attention_decode
from cupyflash.api.dropout import dropout_mask
from cupyflash.api.explain import explain
from cupyflash.api.precision import float32_precision, get_float32_precision, set_float32_precision
from cupyflash.api.varlen import attention_varlen, attention_varlen_backward
from cupyflash.block_mask import BlockMask
from cupyflash.runtime.device import gpu_available

__all__ = [
    "BlockMask",
    "attention",
    "attention_backward",
    "attention_decode",
    "attention_varlen",
    "attention_varlen_backward",
    "block_sparse_attention",
    "block_sparse_attention_backward",
    "dropout_mask",
    "explain",
    "float32_precision",
    "get_float32_precision",
    "gpu_available",
    "reference",
    "set_float32_precision",
]
__version__ = "0.1.0"
