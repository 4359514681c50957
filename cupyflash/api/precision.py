"""float32's precision, in PyTorch's words (`torch.set_float32_matmul_precision`):

    "highest"  (the default, as PyTorch's) every product in float32 on CUDA cores, as NumPy
               computes it;
    "high"     each product from three TF32 products on the tensor cores ("3xTF32": each operand
               split into a TF32 part and a TF32 remainder, hi·hi + hi·lo + lo·hi): out and lse
               within float32's error (the 2x rule of docs/performance.md), but gradients computed
               from them (the backward rebuilds the scores in float32) passed that rule on 3 of
               120 random problems, by up to 1.29x;
    "medium"   one TF32 product (10-bit mantissas: TF32's error, not float32's; 1e-4 to 1e-3
               on unit-normal inputs at 4096 keys, README.md).

It applies to float32's forward on sm_80 and newer GPUs at head dims up to 128; the backward, the
decode kernels, other dtypes and the CPU fallback compute as at "highest".
"""

from __future__ import annotations

import contextlib

from cupyflash.dispatch import policy as policies


def set_float32_precision(precision: str) -> None:
    """Sets float32's precision for the process ("highest", "high" or "medium"); a
    `float32_precision` block in force keeps its own. Default: "highest", or the environment's
    CUPYFLASH_FLOAT32_PRECISION."""
    policies.set_process_policy(float32_precision=policies.check_float32_precision(precision))


def get_float32_precision() -> str:
    """float32's precision in force here: a `float32_precision` block's, else the process's."""
    return policies.current().float32_precision


@contextlib.contextmanager
def float32_precision(precision: str):
    """``with cupyflash.float32_precision("highest"): ...`` computes float32 calls inside the block
    (this thread, and the tasks it starts) at that precision."""
    with policies.override(float32_precision=policies.check_float32_precision(precision)):
        yield
