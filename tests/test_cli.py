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


def test_bad_option_is_an_argparse_error():
    done = subprocess.run([sys.executable, "-m", "cupyflash", "--dtype", "int8"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "invalid choice: 'int8'" in done.stderr
