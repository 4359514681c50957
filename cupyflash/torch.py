"""cupyflash attention as differentiable PyTorch functions (torch.library operators with
autograd); the adapter itself is cupyflash/frameworks/torch.py. Importing this module imports
torch."""

from cupyflash.frameworks.torch import (  # noqa: F401
    FlashAttentionFunction, FlashAttentionVarlenFunction, attention, attention_backward, attention_decode,
    attention_varlen, scaled_dot_product_attention,
)

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_decode", "scaled_dot_product_attention",
           "FlashAttentionFunction", "FlashAttentionVarlenFunction"]
