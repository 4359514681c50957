"""What the benchmarks share: where results go, CUDA-event timing, the peers (PyTorch SDPA's
backends, FlexAttention), device names and result files (CSV, PNG, the table last)."""

from __future__ import annotations

import csv
import datetime
import math
import pathlib

import numpy

TORCH_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def results_dir() -> pathlib.Path:
    """benchmarks/results of a source checkout, else the current folder."""
    tree = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    return tree if tree.parent.is_dir() else pathlib.Path.cwd()


RESULTS = results_dir()


def median_ms(fn, max_seconds: float) -> float:
    """Median time of one call in ms, from CUDA events around batches of back-to-back calls.

    The host queues each call while the GPU runs the one before, as in a training loop, so the
    figure is the GPU's time per call for every method alike, not the Python launch overhead
    (which `python -m cupyflash bench --host` measures). Each batch starts with an untimed call: the
    start event is queued behind it, so the first timed call finds the GPU busy, as every later
    one does. (Without it, the host time of the batch's first call, 0.1-0.4 ms, fell inside the
    timed span on an idle GPU: half of it per call when a batch held two calls.) Where the host
    is slower than the GPU the figure is the host's time per call, as in a loop. Batches last
    about 2 ms or more; at least 5 are timed, more while the budget lasts. One untimed call
    first compiles and autotunes."""
    import time

    import cupy

    fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def batch(n: int) -> float:
        fn()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / n

    n = max(1, min(100, math.ceil(2.0 / batch(3))))
    times, deadline = [], time.perf_counter() + max_seconds
    while len(times) < 5 or (len(times) < 100 and time.perf_counter() < deadline):
        times.append(batch(n))
    return float(numpy.median(times))


def within_bounds(results, dtype_name: str) -> tuple[bool, str]:
    """(passed, "name err/bound, ...") for rows (name, got, exact, baseline): the float64 reference
    `exact` and the same computation in the input precision `baseline`, under the tolerance rule
    (`reference.error_bound`). Arrays may be NumPy or CuPy, of any dtype. A NaN where the
    reference has none fails."""
    from cupyflash.cpu import reference

    passed, parts = True, []
    for name, got, exact, baseline in results:
        exact64, got64 = reference.as_float64(exact), reference.as_float64(got)
        err = float(numpy.abs(got64 - exact64).max(initial=0.0))
        bound = reference.error_bound(exact64, reference.as_float64(baseline), dtype_name)
        passed &= err <= bound  # (False for a NaN error)
        parts.append(f"{name} {err:.1e}/{bound:.1e}")
    return passed, ", ".join(parts)


class Peers:
    """What can be timed here: names -> None (available) or the reason it is skipped."""

    def __init__(self, flex: bool):
        self.skipped: dict[str, str] = {}
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError as e:
            self.torch = None
            for name in TORCH_BACKENDS:
                self.skipped[f"torch-{name}"] = f"torch not installed ({e})"
        else:
            self.torch = torch
        self.flex = None
        if not flex:
            self.skipped["flex"] = "FlexAttention not requested (pass --flex)"
        elif self.torch is not None:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            self.flex = (self.torch.compile(flex_attention, dynamic=False), create_block_mask)
        else:
            self.skipped["flex"] = "torch not installed"


def torch_view(x):
    """A CuPy (batch, seq, heads, d) array as a torch (batch, heads, seq, d) view, no copy."""
    import torch

    return torch.from_dlpack(x).transpose(1, 2)


def start_run(kind: str):
    """(matplotlib, tqdm, device name, date, file stem "<device>-<date>-<kind>") for a run."""
    try:
        import matplotlib
        from tqdm import tqdm
    except ImportError as e:
        raise SystemExit(f"bench needs tqdm and matplotlib: pip install 'cupyflash[bench]' ({e})")
    import cupy

    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    date = datetime.date.today().isoformat()
    return matplotlib, tqdm, device, date, f"{device.replace('NVIDIA ', '').replace(' ', '-')}-{date}-{kind}"


def finish(rows, failures, n_problems, stem, device, plot_fn, table_fn, matplotlib) -> int:
    """Writes <stem>.csv and .png, prints the table last, then the correctness verdict; the exit
    status is 1 if any problem failed its check."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = (stem.parent / f"{stem.name}.{ext}" for ext in ("csv", "png"))
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_fn(rows, png_path, device, matplotlib)
    table_fn(rows, device)
    print(f"# wrote {csv_path} and {png_path}")
    if failures:
        print("# CORRECTNESS FAILURES:\n" + "\n".join(failures))
        return 1
    print(f"# correctness: all {n_problems} problems PASS")
    return 0
