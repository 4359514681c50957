"""Host cost of the pieces of one kernel launch (a development tool): CuPy's Function call with
ready arguments, numpy's .ctypes.data, CPointer, cupy.empty, a Device context, and the launch of a
tiny forward kernel through `_attention._launch`, and one TMA descriptor's encoding, in microseconds
per call.

    python benchmarks/launch_micro.py
"""

import sys
import time

import numpy


def per_call(fn, n=20000) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> int:
    import cupy
    from cupy.cuda.function import CPointer

    import cupyflash
    from cupyflash import _attention, _tma
    from cupyflash._validation import BFLOAT16

    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    rs = cupy.random.default_rng(0)
    q = rs.standard_normal((1, 128, 2, 128), dtype=numpy.float32).astype(BFLOAT16)
    launches = []
    real = _attention._launch
    _attention._launch = lambda *a: launches.append(a) or real(*a)
    try:
        cupyflash.attention(q, q, q)
    finally:
        _attention._launch = real
    kernel, device_id, grid, params, *more = launches[-1]
    from cupyflash import _compile

    function = _compile.get_function(kernel, device_id)
    args = tuple(CPointer(x.ctypes.data) for x in (params, *more))
    small = numpy.zeros(1, numpy.int32)
    device = cupy.cuda.Device(0)

    def enter_and_leave_device():
        with device:
            pass

    rows = {
        "Function call, ready arguments": lambda: function(grid, (kernel.num_threads,), args,
                                                           shared_mem=kernel.smem_bytes),
        "_attention._launch (same struct)": lambda: real(kernel, device_id, grid, params, *more),
        "get_function (cached)": lambda: _compile.get_function(kernel, device_id),
        "kernel.num_threads + smem_bytes": lambda: (kernel.num_threads, kernel.smem_bytes),
        "numpy .ctypes.data": lambda: small.ctypes.data,
        "_attention._address (ctypes view)": lambda: _attention._address(small),
        "CPointer(int)": lambda: CPointer(12345),
        "cupy.empty((1, 128, 2, 128))": lambda: cupy.empty((1, 128, 2, 128), BFLOAT16),
        "with cupy.cuda.Device(0)": enter_and_leave_device,
        "get_current_stream().ptr": lambda: cupy.cuda.get_current_stream().ptr,
        "numpy.array(int, int32)": lambda: numpy.array(5, numpy.int32),
        "attention() whole call": lambda: cupyflash.attention(q, q, q),
        # One TMA descriptor made afresh (the driver's encode through ctypes), as each call whose
        # arrays sit at new addresses needs one per array.
        "_tma._tensor_map (uncached)": lambda: _tma._tensor_map(q.data.ptr, "bfloat16", 128, (32768, 256, 128),
                                                                (1, 128, 2), (64, 128)),
    }
    for label, fn in rows.items():
        cupy.cuda.Device().synchronize()
        launching = "ready" in label or "launch" in label or "whole" in label
        print(f"{label:36} {per_call(fn, 1000 if launching else 20000):7.2f} us")
    cupy.cuda.Device().synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
