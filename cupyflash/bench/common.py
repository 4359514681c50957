"""What the benchmarks share: where results go, CUDA-event timing, the peers (PyTorch SDPA's
backends, FlexAttention), device names and result files (CSV, PNG, the table last), and the source
trees a result was measured on, so that a figure quoted from an older tree shows as stale."""

from __future__ import annotations

import csv
import datetime
import hashlib
import math
import os
import pathlib
import re

import numpy

TORCH_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def results_dir() -> pathlib.Path:
    """benchmarks/results of a source checkout, else the current folder."""
    tree = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    return tree if tree.parent.is_dir() else pathlib.Path.cwd()


RESULTS = results_dir()


# --------------------------------------------------------------------------- what a result was measured on

# The source trees results depend on: the kernels (every GPU benchmark) and the NumPy fallback
# (bench --cpu). A result file records each tree it ran on by its git tree id.
_PACKAGE = pathlib.Path(__file__).resolve().parents[1]
MEASURED_TREES = {"kernels": lambda: _kernels_dir(), "cupyflash/cpu": lambda: _PACKAGE / "cpu"}
_RECORD = re.compile(r"\b(kernels|cupyflash/cpu) tree ([0-9a-f]{40})\b")


def _kernels_dir() -> pathlib.Path:
    from cupyflash.runtime.compiler import kernels_dir

    return kernels_dir()


def git_tree_id(folder: pathlib.Path) -> str:
    """The git tree id of the folder's files: what `git rev-parse HEAD:<folder>` prints in a clean
    checkout, computed from the files themselves, so that an installed package names it too.
    Python's caches (__pycache__, .pyc), which git ignores, are left out."""
    entries = []
    for child in folder.iterdir():
        if child.name == "__pycache__" or child.suffix == ".pyc":
            continue
        name = child.name.encode()
        if child.is_dir():
            entries.append((name + b"/", b"40000 " + name + b"\0" + bytes.fromhex(git_tree_id(child))))
        else:
            data = child.read_bytes()
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).digest()
            mode = b"100755" if os.access(child, os.X_OK) else b"100644"
            entries.append((name, mode + b" " + name + b"\0" + blob))
    body = b"".join(entry for _, entry in sorted(entries))  # (git orders a folder as its name + "/")
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


def measured_on(*trees: str) -> str:
    """'kernels tree <id>' for each named tree (MEASURED_TREES), as result files record them."""
    return "; ".join(f"{name} tree {git_tree_id(MEASURED_TREES[name]())}" for name in trees)


def recorded_trees(path: pathlib.Path) -> dict:
    """The trees a result file says it was measured on ({name: tree id}): a CSV's measured_on
    column, a text file's '# measured on ...' line; a PNG's from the CSV or text file of its stem."""
    path = pathlib.Path(path)
    if path.suffix == ".png":
        siblings = [path.with_suffix(ext) for ext in (".csv", ".txt") if path.with_suffix(ext).is_file()]
        return recorded_trees(siblings[0]) if siblings else {}
    if path.suffix == ".csv":
        with open(path, newline="") as fh:
            text = " ".join(row.get("measured_on") or "" for row in csv.DictReader(fh))
    else:
        text = " ".join(line for line in path.read_text().splitlines() if line.startswith("# measured on"))
    return dict(_RECORD.findall(text))


def staleness(path: pathlib.Path) -> str | None:
    """Why a result file does not describe today's trees (None: it does)."""
    recorded = recorded_trees(path)
    if not recorded:
        return f"{path.name} records no source tree ('measured on kernels tree ...')"
    for name, tree in recorded.items():
        today = git_tree_id(MEASURED_TREES[name]())
        if tree != today:
            return f"{path.name} was measured on {name} tree {tree[:12]}; today's is {today[:12]}"
    return None


# --------------------------------------------------------------------------- timing


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
    print(f"# measured on {measured_on('kernels')}", flush=True)
    return matplotlib, tqdm, device, date, f"{device.replace('NVIDIA ', '').replace(' ', '-')}-{date}-{kind}"


def finish(rows, failures, n_problems, stem, device, plot_fn, table_fn, matplotlib) -> int:
    """Writes <stem>.csv and .png, prints the table last, then the correctness verdict; the exit
    status is 1 if any problem failed its check."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = (stem.parent / f"{stem.name}.{ext}" for ext in ("csv", "png"))
    tree = measured_on("kernels")
    rows = [{**row, "measured_on": tree} for row in rows]
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
