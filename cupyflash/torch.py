"""cupyflash attention as differentiable PyTorch functions (torch.autograd); the adapter itself is
cupyflash/frameworks/torch.py. Importing this module imports torch."""

from cupyflash.frameworks.torch import (  # noqa: F401
    FlashAttentionFunction, FlashAttentionVarlenFunction, attention, attention_varlen, scaled_dot_product_attention,
)

__all__ = ["attention", "attention_varlen", "scaled_dot_product_attention", "FlashAttentionFunction",
           "FlashAttentionVarlenFunction"]
