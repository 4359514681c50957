"""Whether cupyflash.torch's outputs are freed when the caller drops them, a development tool.

    python benchmarks/adapter_lifetimes.py

Calls the adapter 100 times on a tiny problem, dropping each result, and prints how many distinct
output addresses it saw, how much of CuPy's pool stayed in use, and what Python's cyclic garbage
collector then found (a reference cycle keeps each call's out and lse until a collection).
"""

import gc
import sys


def main() -> int:
    import cupy
    import torch

    import cupyflash.torch

    q = torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
    pool = cupy.get_default_memory_pool()
    for label, grad in (("inputs without grad", False), ("inputs with requires_grad", True)):
        x = q.clone().requires_grad_(grad)
        cupyflash.torch.attention(x, x, x)
        torch.cuda.synchronize()
        gc.collect()
        used = pool.used_bytes()
        addresses = set()
        gc.disable()
        for _ in range(100):
            out = cupyflash.torch.attention(x, x, x)
            addresses.add(out.data_ptr())
            del out
        held = pool.used_bytes() - used
        found = gc.collect()
        gc.enable()
        print(f"{label}: {len(addresses)} distinct out addresses in 100 calls; pool bytes still in use "
              f"{held}; the collector found {found} objects; after it {pool.used_bytes() - used} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
