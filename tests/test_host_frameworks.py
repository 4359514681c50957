"""Host arrays of other frameworks through the NumPy entry points: JAX's CPU arrays in and out in
every dtype, bfloat16 included (NumPy's DLPack import knows no bfloat16), with no GPU needed."""

import numpy
import pytest

import cupyflash
from cupyflash import reference


@pytest.fixture
def jax64():
    """jax with 64-bit types on (float64 arrays stay float64) for the test, as it was after."""
    jax = pytest.importorskip("jax")
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield jax
    jax.config.update("jax_enable_x64", before)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_jax_host_arrays_in_every_dtype(rng, jax64, dtype):
    jax, jnp = jax64, jax64.numpy
    cpu = jax.devices("cpu")[0]
    q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal((1, 37, 2, 24)), dtype=dtype), cpu) for _ in range(3))
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, jax.Array) and out.dtype == q.dtype and out.shape == q.shape
    host = [numpy.asarray(x) for x in (q, k, v)]
    exact, lowp = reference.attention(*host, causal=True), reference.attention_in_precision(*host, host[0].dtype,
                                                                                           causal=True)
    assert numpy.abs(numpy.asarray(out).astype(numpy.float64) - exact).max() <= reference.error_bound(exact, lowp, dtype)
    grads = cupyflash.attention_backward(out, q, k, v, out, lse, causal=True)
    assert all(isinstance(g, jax.Array) and g.dtype == q.dtype for g in grads)
