"""The result files the README quotes describe today's code: each records the source trees it was
measured on (`bench.common.measured_on`), and a file measured on another kernels tree (or another
fallback) fails here, so that a stale figure cannot stay quoted."""

import pathlib
import re
import shutil
import subprocess

import pytest

from cupyflash.bench import common

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = re.compile(r"\(((?:\.\./)?benchmarks/results/[^)\s]+)\)")


def quoted_results(document: pathlib.Path) -> list[pathlib.Path]:
    return sorted({(document.parent / link).resolve() for link in RESULTS.findall(document.read_text())})


def test_readme_quotes_only_results_of_todays_trees():
    quoted = quoted_results(ROOT / "README.md")
    missing = [path.name for path in quoted if not path.is_file()]
    assert not missing, f"README quotes result files that are not in the tree: {missing}"
    stale = [common.staleness(path) for path in quoted]
    assert not any(stale), "README quotes stale results: " + "; ".join(filter(None, stale))


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
@pytest.mark.parametrize("tree", list(common.MEASURED_TREES))
def test_tree_ids_are_gits(tree):
    folder = common.MEASURED_TREES[tree]()
    changed = subprocess.run(["git", "status", "--porcelain", "--", str(folder)], capture_output=True, text=True,
                             cwd=ROOT).stdout
    if changed.strip():
        pytest.skip(f"{tree} has uncommitted changes")
    head = subprocess.run(["git", "rev-parse", f"HEAD:{folder.relative_to(ROOT)}"], capture_output=True, text=True,
                          cwd=ROOT, check=True).stdout.strip()
    assert common.git_tree_id(folder) == head


def test_a_result_from_another_tree_is_stale(tmp_path):
    today = common.measured_on("kernels")
    older = "kernels tree " + "0" * 40
    (tmp_path / "now.csv").write_text(f"seqlen,ms,measured_on\n4096,1.0,{today}\n")
    (tmp_path / "old.csv").write_text(f"seqlen,ms,measured_on\n4096,1.0,{older}\n")
    (tmp_path / "old.png").write_bytes(b"")
    (tmp_path / "log.txt").write_text(f"# measured on {common.measured_on('kernels', 'cupyflash/cpu')}\nrows\n")
    (tmp_path / "bare.txt").write_text("a table with no record\n")
    assert common.staleness(tmp_path / "now.csv") is None and common.staleness(tmp_path / "log.txt") is None
    assert "measured on kernels tree 000000000000" in common.staleness(tmp_path / "old.csv")
    assert "measured on kernels tree" in common.staleness(tmp_path / "old.png")  # (its CSV's record)
    assert "records no source tree" in common.staleness(tmp_path / "bare.txt")
