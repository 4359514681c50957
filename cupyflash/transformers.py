"""cupyflash as transformers' attn_implementation "cupy_attention" (registered on import); the adapter
itself is cupyflash/frameworks/transformers.py. Importing this module imports torch and
transformers."""

from cupyflash.frameworks.transformers import NAME, attention  # noqa: F401

__all__ = ["NAME", "attention"]
