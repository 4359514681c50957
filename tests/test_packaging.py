"""An installed, non-editable wheel carries the kernel sources and works from outside the tree."""

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = out.glob("cupyflash-*.whl")
    return path


def test_wheel_contains_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources, "no kernel sources in the tree"
    for name in sources:
        assert f"cupyflash/kernels/{name}" in names, f"{name} missing from {wheel.name}"
    assert "cupyflash/__init__.py" in names and "cupyflash/reference.py" in names


def test_installed_wheel_compiles_its_kernels_from_package_data(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    script = (
        "import pathlib, numpy, cupyflash\n"
        "from cupyflash import _compile\n"
        f"assert pathlib.Path(cupyflash.__file__).is_relative_to({str(target)!r}), cupyflash.__file__\n"
        f"assert _compile.kernels_dir().is_relative_to({str(target)!r}), _compile.kernels_dir()\n"
        "assert 'flash_fwd_kernel' in _compile.kernel_source()\n"
        "q = numpy.random.default_rng().standard_normal((1, 9, 2, 8)).astype(numpy.float32)\n"
        "assert cupyflash.attention(q, q, q).shape == q.shape\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
