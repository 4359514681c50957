import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.cpu_only
def test_main_command_without_gpu_runs_the_numpy_fallback():
    done = subprocess.run([sys.executable, "-m", "cupyflash", "--causal"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    first, *rest = done.stdout.splitlines()
    assert first.startswith("No CUDA GPU available") and "tiled NumPy attention" in rest[0]
    assert "causal=True" in rest[0] and "max |error| vs reference" in rest[0]
    assert "backward" in rest[0]


def test_bad_option_is_an_argparse_error():
    done = subprocess.run([sys.executable, "-m", "cupyflash", "--dtype", "int8"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "invalid choice: 'int8'" in done.stderr


@pytest.mark.gpu
def test_main_command_on_the_gpu_checks_and_times_forward_and_backward():
    cmd = [sys.executable, "-m", "cupyflash", "--batch", "1", "--seqlen", "300", "--heads", "2", "--head-dim", "40",
           "--dtype", "bfloat16", "--causal", "--repeat", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("out", "dq", "dk", "dv"):
        assert f"check {name:3} vs float64 reference" in done.stdout
    assert "FAIL" not in done.stdout
    assert done.stdout.count("forward + backward") >= 3  # cupyflash, deterministic, standard


def test_importing_cupyflash_imports_neither_torch_nor_jax():
    code = "import sys, cupyflash; print(sorted(m for m in ('torch', 'jax') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
