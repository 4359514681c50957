"""flash-attn's functions (`flash_attn_func`, their packed and varlen forms,
`flash_attn_with_kvcache`) computed by cupyflash, for PyTorch programs that switch with one import;
the module itself is cupyflash/frameworks/flash_attn.py. Importing this module imports torch."""

from cupyflash.frameworks.flash_attn import (  # noqa: F401
    flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache,
)
from cupyflash.frameworks.flash_attn import __all__  # noqa: F401
