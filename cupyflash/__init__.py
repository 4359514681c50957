"""cupyflash: exact FlashAttention for NumPy, CuPy, PyTorch and JAX arrays.

`attention` and `attention_backward` take arrays of any of these frameworks (and
`block_sparse_attention` / `block_sparse_attention_backward` with a `BlockMask`, and
`attention_decode` for KV-cache decoding, `attention_varlen` / `attention_varlen_backward` for
packed variable-length batches; `dropout_mask` for the keep mask of their dropout); `cupyflash.torch`
and `cupyflash.jax` wrap them as differentiable functions (torch.autograd / jax.custom_vjp).

Tiled CUDA kernels (kernels/*.cu, compiled at run time through CuPy's NVRTC) compute exact
softmax attention without materialising the score matrix; `cupyflash.reference` holds the NumPy
float64 definition they are validated against and the tiled CPU fallback.
"""

from cupyflash import reference
from cupyflash._attention import (
    attention,
    attention_backward,
    attention_varlen,
    attention_varlen_backward,
    block_sparse_attention,
    block_sparse_attention_backward,
    dropout_mask,
    gpu_available,
)
from cupyflash._block_mask import BlockMask
from cupyflash._decode import attention_decode

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
    "gpu_available",
    "reference",
]
__version__ = "0.1.0"
