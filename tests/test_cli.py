import pathlib
import re
import subprocess
import sys

import pytest

from cupyflash import bench, cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.cpu_only
def test_main_command_without_gpu_runs_the_numpy_fallback():
    done = subprocess.run([sys.executable, "-m", "cupyflash", "--causal"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    first, *rest = done.stdout.splitlines()
    assert first.startswith("No CUDA GPU available") and "NumPy fallback (float32 inputs)" in rest[0]
    assert "causal=True" in rest[0] and "max |error| vs reference" in rest[0]
    assert "backward" in rest[0]


def test_cpu_benchmark_times_the_fallback_beside_plain_numpy():
    cmd = [sys.executable, "-m", "cupyflash", "bench", "--cpu", "--seqlen", "130", "--heads", "2", "--head-dim", "24",
           "--repeat", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("True", "False"))]
    errors = {(row[0], row[1]): float(row[-1]) for row in rows if "fwd" not in row}
    assert len(rows) == 6 and len(errors) == 4  # plain and fallback forward, fallback fwd + bwd; causal and not
    assert max(errors.values()) < 1e-5  # float32 against the float64 reference


MISTAKES = [  # (arguments, what the one line must say)
    ("--dtype int8", "run: error: argument --dtype: invalid choice: 'int8'"),
    ("--seqlen -5", "run: error: argument --seqlen: expected an integer >= 1, got '-5'"),
    ("--batch -1", "argument --batch: expected an integer >= 1, got '-1'"),
    ("--seqlen 0", "argument --seqlen: expected an integer >= 1, got '0'"),
    ("--head-dim 0", "argument --head-dim: expected an integer from 1 to 256, got '0'"),
    ("--head-dim 300", "argument --head-dim: expected an integer from 1 to 256, got '300'"),
    ("--repeat -3", "argument --repeat: expected an integer >= 1"),
    ("--seqlen x", "argument --seqlen: expected an integer >= 1, got 'x'"),
    ("frobnicate", "unknown command 'frobnicate'; the commands are run, bench, explain, check-kernels"),
    ("run --unknown-flag", "python -m cupyflash run: error: unrecognized arguments: --unknown-flag"),
    ("explain --compute-capability 0", "argument --compute-capability: invalid choice: 0 (choose from 70, 72, 75"),
    ("explain --heads 16 --heads-kv 5 --compute-capability 90", "with heads_kv dividing q's 16 heads"),
    ("explain --dtype bfloat16 --compute-capability 75", "bfloat16's conversions need sm_80 or newer"),
    ("bench --sparse --decode", "bench: error: one grid at a time, got --sparse and --decode"),
    ("bench --seqlen 0", "bench: error: argument --seqlen: expected an integer >= 1"),
    ("bench --cpu --head-dim 999", "bench --cpu: error: argument --head-dim: expected an integer from 1 to 256"),
    ("bench --sparse --density 2", "argument --density: expected a number in (0, 1]"),
    ("bench --decode --max-seconds -1", "argument --max-seconds: expected a number > 0"),
    ("check-kernels --arch sm80", "argument --arch: expected an architecture such as sm_80 or sm_90a, got 'sm80'"),
    ("check-kernels --jobs 0", "argument --jobs/-j: expected an integer >= 1"),
]


@pytest.mark.parametrize("argv,message", MISTAKES)
def test_each_mistake_is_one_line_naming_what_is_expected(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        cli.main(argv.split())
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


def test_mistakes_from_the_shell_exit_2_without_a_traceback():
    done = subprocess.run([sys.executable, "-m", "cupyflash", "--seqlen", "-5"], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr


def _parsers():
    import importlib

    yield from (cli._run_parser(), cli._explain_parser(), cli._check_kernels_parser())
    for grid in ("dense", *bench.GRIDS):
        yield importlib.import_module(f"cupyflash.bench.{grid}").parser()


def test_every_option_has_a_description():
    bare = [f"{parser.prog} {action.option_strings[0]}" for parser in _parsers() for action in parser._actions
            if action.option_strings and not action.help]
    assert not bare, f"options without a description: {bare}"


@pytest.mark.parametrize("argv", ["--help", "run --help", "explain --help", "check-kernels --help", "bench --help",
                                  *(f"bench --{grid} --help" for grid in bench.GRIDS)])
def test_every_help_reads_whole_and_needs_no_gpu(capsys, argv):
    """Help needs neither a GPU nor CuPy, its description ends a sentence, and it names no
    implementation file."""
    with pytest.raises(SystemExit) as exit:
        raise SystemExit(cli.main(argv.split()))
    out = capsys.readouterr().out
    assert exit.value.code in (0, None) and out.startswith("usage: python -m cupyflash")
    assert not re.search(r"\b\w+\.py\b", out), "help names an implementation file"
    description = re.split(r"\n\n", out)[1]
    assert description.rstrip().endswith((".", ")")), f"description stops mid-sentence: {description!r}"


@pytest.mark.cpu_only
@pytest.mark.parametrize("argv", ["bench", "bench --host", "bench --decode --dtype float32"])
def test_a_gpu_benchmark_without_a_gpu_says_so_in_one_line(capsys, argv):
    with pytest.raises(SystemExit) as exit:
        cli.main(argv.split())
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and "needs an NVIDIA GPU" in err


def test_check_kernels_without_nvrtc_says_which_extra_brings_it(capsys, monkeypatch):
    from cupyflash.runtime import compiler

    monkeypatch.setattr(compiler, "offline_unavailable", lambda: "it needs CuPy and NVRTC, which come with the CUDA "
                                                                 "extra")
    with pytest.raises(SystemExit) as exit:
        cli.main(["check-kernels"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and "the CUDA extra" in err


@pytest.mark.cpu_only
def test_without_a_gpu_run_honours_dtype_and_repeat(capsys):
    assert cli.main(["--dtype", "bfloat16", "--repeat", "2", "--seqlen", "40", "--head-dim", "24"]) == 0
    out = capsys.readouterr().out
    assert "NumPy fallback (bfloat16 inputs)" in out and "median of 2" in out and "seqlen_q 40" in out


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


def _sparse_row(nominal, density, ratio, ours_tflops=300.0, flex_tflops=250.0):
    return {"device": "test GPU", "seqlen": "4096", "head_dim": "64", "pattern": "random",
            "target_density": str(nominal), "density": f"{density:.4f}", "direction": "fwd",
            "sparse_ms": f"{ratio:.4f}", "time_vs_dense": f"{ratio:.3f}", "effective_tflops": str(ours_tflops),
            "flex_ms": "1.0", "flex_effective_tflops": str(flex_tflops), "flex_note": ""}


def test_sparse_benchmark_scores_rows_by_their_nominal_density(tmp_path):
    """`bench --sparse --table` re-scores a recorded CSV without a GPU. A mask of whole blocks only
    comes near its nominal density (102 of 32 x 32 blocks is 0.0996): that row is still held to
    1.2 x its density, where the 0.05 row has no density target."""
    import csv

    rows = [
        _sparse_row(0.1, 0.0996, 0.155),  # over 1.2 x 0.0996
        _sparse_row(0.1, 0.0996, 0.119),
        _sparse_row(0.05, 0.0498, 0.2),  # no density target below 0.1
        _sparse_row(1.0, 1.0, 1.11),  # over 1.1x dense
        _sparse_row(0.5, 0.5, 0.55, ours_tflops=240.0),  # slower than flex
    ]
    path = tmp_path / "sparse.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    done = subprocess.run([sys.executable, "-m", "cupyflash", "bench", "--sparse", "--table", str(path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = [line.split("  ")[-1] for line in done.stdout.splitlines() if line.startswith("  4096")]
    assert verdicts == ["MISS: > 1.2 x density (0.120)", "ok", "ok", "MISS: density 1 > 1.1x dense",
                        "MISS: slower than flex"], done.stdout
    assert "rows meeting every target: 2 of 5" in done.stdout
