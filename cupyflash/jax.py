"""cupyflash attention as differentiable JAX functions (jax.custom_vjp, under jax.jit too); the
adapter itself is cupyflash/frameworks/jax.py. Importing this module imports jax."""

from cupyflash.frameworks.jax import attention, attention_varlen  # noqa: F401

__all__ = ["attention", "attention_varlen"]
