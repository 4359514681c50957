import os
import secrets

import numpy
import pytest

# JAX takes 75% of the GPU's memory when it first touches the device; with the suite spread over
# several workers (pytest -n) that starved the others (out of memory in 42 tests on an H100).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.is_available())


GPU = _gpu_available()


def pytest_configure(config):
    if GPU and os.environ.get("CUPYFLASH_NO_MEMORY_POOL"):
        import cupy  # under compute-sanitizer: every allocation its own, so overruns are seen

        cupy.cuda.set_allocator(None)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU: cupy.cuda.is_available() is False")
    skip_cpu = pytest.mark.skip(reason="a GPU is present: the no-GPU fallback is not taken")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip_gpu)
        if "cpu_only" in item.keywords and GPU:
            item.add_marker(skip_cpu)


@pytest.fixture
def rng(request):
    """Fresh random data every run; the seed is printed with any failure, and
    CUPYFLASH_TEST_SEED=<seed> replays it."""
    replay = os.environ.get("CUPYFLASH_TEST_SEED")
    seed = int(replay) if replay else secrets.randbits(32)
    print(f"random seed for {request.node.name}: {seed}")
    try:
        import torch
    except ImportError:
        pass
    else:
        torch.manual_seed(seed)  # the torch tests' own draws (torch.randn) replay with the seed too
    return numpy.random.default_rng(seed)


@pytest.fixture
def nan_outputs(monkeypatch):
    """Every output cupyflash allocates (out, lse, dq, dk, dv) starts as NaN, so an element a
    kernel fails to write fails the comparison."""
    import cupy

    from cupyflash.api import common

    def nan_empty(shape, dtype):
        return cupy.full(shape, numpy.nan, dtype=numpy.float32).astype(dtype)

    monkeypatch.setattr(common, "empty", nan_empty)


@pytest.fixture
def nan_torch_outputs(monkeypatch):
    """As nan_outputs, for the results the torch adapter allocates with torch."""
    torch = pytest.importorskip("torch")
    from cupyflash.frameworks import torch_calls as adapter

    monkeypatch.setattr(adapter, "empty", lambda shape, dtype, device: torch.full(shape, torch.nan, dtype=dtype,
                                                                                  device=device))
    monkeypatch.setattr(adapter, "empty_like", lambda x: torch.full_like(x, torch.nan))


@pytest.fixture
def poisoned_empty(monkeypatch):
    """`cupy.empty` returns memory with every byte 0xFF (NaN in every float type, -1 in the
    integer ones), as a memory pool's reused block might hold: a kernel that reads a workspace
    it was meant to clear or write first (the backward's float32 dQ accumulator) then fails the
    comparison. Returns the shapes and dtypes allocated, so a test can check that the workspace
    it means went through here."""
    import cupy

    allocated = []
    empty = cupy.empty

    def poisoned(shape, dtype=float, order="C"):
        x = empty(shape, dtype, order)
        allocated.append((x.shape, x.dtype))
        if x.nbytes:
            cupy.ndarray((x.nbytes,), cupy.uint8, x.data).fill(0xFF)
        return x

    monkeypatch.setattr(cupy, "empty", poisoned)
    return allocated


@pytest.fixture
def jax_gpu():
    """The jax module, when JAX is installed with a GPU backend; otherwise the test is skipped."""
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    return jax


@pytest.fixture
def policy():
    """`policy(tma=False, ...)` replaces fields of the planner's policy (dispatch/policy.py) for the
    rest of the test; calls nest."""
    import contextlib

    from cupyflash.dispatch.policy import override

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(override(**changes))


@pytest.fixture
def scalar_kernels(policy):
    """The CUDA-core kernels for every dtype (the tensor-core families left out)."""
    policy(families=("scalar",))


@pytest.fixture
def launches(monkeypatch):
    """`launches(each)`: each(kernel, (device_id, grid, *arguments)) is called for every launch that
    runtime/launch.py queues from here on, in order, before it is queued."""
    from cupyflash.runtime import launch

    def watch(each):
        real = launch.run

        def run(plan, stream=None):
            for made in plan.launches:
                each(made.kernel, (plan.device_id, made.grid, *made.args))
            return real(plan, stream)

        monkeypatch.setattr(launch, "run", run)

    return watch
