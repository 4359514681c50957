"""cupyflash: exact FlashAttention for NumPy, CuPy, PyTorch and JAX arrays.

Tiled CUDA kernels (kernels/*.cu, compiled at run time through CuPy's NVRTC) compute exact
softmax attention without materialising the score matrix; `cupyflash.reference` holds the NumPy
float64 definition they are validated against and the tiled CPU fallback.
"""

from cupyflash import reference
from cupyflash._attention import attention, gpu_available

__all__ = ["attention", "gpu_available", "reference"]
__version__ = "0.1.0"
