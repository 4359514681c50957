"""The benchmarks a user runs: `python -m cupyflash bench [GRID] ...`, cupyflash beside PyTorch's
SDPA backends, FlexAttention and standard attention, timed in the same run (common.py holds the
timing, the peers and the result files).

    (no flag)     the FlashAttention grid: forward and backward, 16k tokens, hidden 2048 (dense.py)
    --sparse      block-sparse attention against dense and FlexAttention (sparse.py)
    --decode      KV-cache decoding against a device-to-device copy and SDPA (decode.py)
    --varlen      packed variable-length batches against padding and FlashAttention-2's varlen (varlen.py)
    --variants    GQA, windows, softcap, ALiBi, dropout against dense causal attention (variants.py)
    --host        the host's time per call, beside SDPA's and the torch adapter's (host.py)
    --accuracy    16-bit errors against float64 beside FlashAttention-2's, on random problems (accuracy.py)
    --cpu         the CPU fallback beside plain NumPy attention; needs no GPU (cpu.py)
"""

from __future__ import annotations

import argparse
import importlib

GRIDS = {"sparse": "sparse", "decode": "decode", "varlen": "varlen", "variants": "variants", "host": "host", "accuracy": "accuracy",
         "cpu": "cpu"}


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash bench", description=__doc__.split("\n\n")[0],
                                     add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    for grid in GRIDS:
        group.add_argument(f"--{grid}", action="store_true", help=f"the {grid} benchmark ({grid}.py)")
    chosen, rest = parser.parse_known_args(argv)
    grid = next((g for g in GRIDS if getattr(chosen, g)), None)
    if grid is None and any(a in ("-h", "--help") for a in rest):
        print(__doc__)
        print("Each grid's own options: python -m cupyflash bench [--GRID] --help")
        importlib.import_module("cupyflash.bench.dense").parse_args(["--help"])
    module = importlib.import_module(f"cupyflash.bench.{GRIDS[grid] if grid else 'dense'}")
    return module.main(rest)
