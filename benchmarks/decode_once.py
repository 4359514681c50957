"""One-sequence GQA decoding steps (32/8 heads, d128, bf16) for a profiler: python benchmarks/decode_once.py CACHE_LEN [CALLS]"""
import sys

import cupy
import numpy

import cupyflash
from cupyflash._validation import BFLOAT16

n, calls = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3
rs = cupy.random.default_rng(0)
q = rs.standard_normal((1, 1, 32, 128), dtype=numpy.float32).astype(BFLOAT16)
k, v = (rs.standard_normal((1, n, 8, 128), dtype=numpy.float32).astype(BFLOAT16) for _ in range(2))
for _ in range(calls):
    cupyflash.attention_decode(q, k, v)
cupy.cuda.Device().synchronize()
