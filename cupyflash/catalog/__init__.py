"""The kernel catalogue: what is built, apart from when it is used.

- tiles.py: the traits tables (tile shapes by dtype and padded head dim) and the builds' limits;
- specs.py, tensor_cores.py, decode.py: one descriptor per kernel instantiation (source file,
  name expression, shared memory, grid, compile-time checks);
- params.py: the kernels' argument structs as NumPy dtypes, and their size checks;
- families.py: the instantiation list, and which instantiation of a family serves a problem.

Pure Python: it imports neither CuPy nor the planner.
"""

from cupyflash.catalog.families import (
    FAMILIES, Unavailable, Variant, all_kernels, block_mask_granularity, bwd_row_kernel, decode_kernel, dkdv_kernel,
    dq_kernel, forward_kernel, runs_on,
)

__all__ = ["FAMILIES", "Unavailable", "Variant", "all_kernels", "block_mask_granularity", "bwd_row_kernel",
           "decode_kernel", "dkdv_kernel", "dq_kernel", "forward_kernel", "runs_on"]
