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
    sources = sorted(str(p.relative_to(ROOT / "kernels")) for p in (ROOT / "kernels").rglob("*.cu*"))
    assert sources, "no kernel sources in the tree"
    for name in sources:
        assert f"cupyflash/kernels/{name}" in names, f"{name} missing from {wheel.name}"
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "cupyflash").rglob("__init__.py")}
    for package in packages:
        assert f"{package}/__init__.py" in names, f"{package} missing from {wheel.name}"
    assert "cupyflash/reference.py" in names and any(n.endswith("LICENSE") for n in names)


def test_installed_wheel_compiles_its_kernels_from_package_data(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    script = (
        "import pathlib, numpy, cupyflash\n"
        "from cupyflash.runtime import compiler\n"
        f"assert pathlib.Path(cupyflash.__file__).is_relative_to({str(target)!r}), cupyflash.__file__\n"
        f"assert compiler.kernels_dir().is_relative_to({str(target)!r}), compiler.kernels_dir()\n"
        "assert 'flash_fwd_kernel' in compiler.kernel_source()\n"
        "q = numpy.random.default_rng().standard_normal((1, 9, 2, 8)).astype(numpy.float32)\n"
        "assert cupyflash.attention(q, q, q).shape == q.shape\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
