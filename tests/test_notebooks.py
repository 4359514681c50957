"""The notebooks in notebooks/: stored without outputs (`nbstripout --verify`, from the test
extras, and a JSON check of the same where nbstripout is not installed, as on the GPU machine),
and every code cell runs, in order, in one namespace, as a fresh kernel would run them. On a
CPU-only machine they take the NumPy fallback at small sizes and their GPU cells say they are
skipped; on a GPU they run in full. No Jupyter is needed: the cells are read from the .ipynb JSON."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def code_cells(path):
    notebook = json.loads(path.read_text())
    assert notebook["nbformat"] == 4
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def test_the_five_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == ["01-quickstart.ipynb", "02-how-flashattention-works.ipynb",
                                           "03-performance.ipynb", "04-block-sparse.ipynb", "05-training.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name}: strip the outputs"
        assert set(cell["metadata"]) <= {"tags"}, f"{path.name}: cell metadata {cell['metadata']}"


def test_nbstripout_verify_passes():
    if importlib.util.find_spec("nbstripout") is None:
        pytest.skip("nbstripout is not installed (pip install -e .[test] brings it)")
    result = subprocess.run([sys.executable, "-m", "nbstripout", "--verify", *map(str, NOTEBOOKS)],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"run `nbstripout notebooks/*.ipynb`:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(path.parent)
    namespace = {"__name__": "__main__"}
    for number, cell in enumerate(code_cells(path)):
        source = "".join(cell["source"])
        assert not any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()), "no IPython magics"
        exec(compile(source, f"{path.name}, code cell {number}", "exec"), namespace)
    if "plt" in namespace:
        namespace["plt"].close("all")
