"""The benchmarks: cupyflash beside PyTorch's SDPA backends, FlexAttention and standard attention,
each problem checked against the float64 reference first, then timed in the same run (medians of
CUDA-event-timed calls). Results go to benchmarks/results (or the current folder) as a CSV and a
PNG named by device and date, with a table printed last.

    (no grid)     forward and backward at 16k tokens, hidden 2048: the FlashAttention grid
    --sparse      block-sparse attention beside dense attention and FlexAttention on the same masks
    --decode      KV-cache decoding beside a device-to-device copy and SDPA
    --varlen      packed variable-length batches beside the same sequences padded
    --variants    GQA, windows, softcap, ALiBi and dropout beside dense causal attention
    --host        the host's time per call, beside SDPA's and the torch adapter's
    --models      training steps of transformers and timm models with each attention
    --accuracy    16-bit errors against float64 beside FlashAttention-2's, on random problems
    --cpu         the NumPy fallback beside plain NumPy attention (needs no GPU)

Every grid but --cpu needs an NVIDIA GPU and PyTorch. `python -m cupyflash bench [--GRID] --help`
lists a grid's options.
"""

from __future__ import annotations

import importlib

from cupyflash import arguments

PROG = "python -m cupyflash bench"
GRIDS = ("sparse", "decode", "varlen", "variants", "host", "models", "accuracy", "cpu")
# What runs without a GPU: help, the CPU grid, and re-scoring a recorded CSV (--table).
OFFLINE = ("-h", "--help", "--cpu", "--table")


def main(argv) -> int:
    chosen = [a[2:] for a in argv if a.startswith("--") and a[2:] in GRIDS]
    if len(chosen) > 1:
        arguments.fail(PROG, f"one grid at a time, got --{' and --'.join(chosen)}")
    grid = chosen[0] if chosen else None
    rest = [a for a in argv if a != f"--{grid}"]
    if grid is None and any(a in ("-h", "--help") for a in rest):
        print(f"usage: {PROG} [--GRID] [OPTIONS]\n\n{__doc__.strip()}\n\nThe FlashAttention grid's options:\n")
    module = importlib.import_module(f"cupyflash.bench.{grid or 'dense'}")
    parser = module.parser()
    args = parser.parse_args(rest)  # (--help prints and exits here, before any GPU is needed)
    if not any(a in OFFLINE for a in argv):
        from cupyflash.runtime.device import gpu_available

        if not gpu_available():
            arguments.fail(parser.prog, "needs an NVIDIA GPU with a CUDA driver and CuPy (cupy.cuda.is_available() is "
                                        "False here, or CuPy is not installed); `bench --cpu`, `explain "
                                        "--compute-capability` and `check-kernels` run without one")
    return module.main(args)
