"""The command line's conventions, shared by `python -m cupyflash` (cli.py) and the benchmarks
(bench/): a mistake is one line on stderr that names the option and what it expects, with exit
status 2 and no traceback; `--help` gives each option a description and its default."""

from __future__ import annotations

import argparse
import inspect
import sys

from cupyflash.catalog import tiles


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (their lists keep their lines), and each option's default after its
    help where it has one that its help does not already state."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, `PROG: error: MESSAGE (PROG --help lists the
    options)`, exit status 2. `doc`: the module docstring, whose first paragraph is the
    description and whose rest, if `epilog`, follows the options."""

    def __init__(self, prog: str, doc: str, epilog: bool = False, **kwargs):
        first, _, rest = inspect.cleandoc(doc).partition("\n\n")
        super().__init__(prog=prog, description=first, epilog=rest if epilog else None, formatter_class=Formatter,
                         **kwargs)

    def error(self, message: str):
        fail(self.prog, f"{message} ({self.prog} --help lists the options)")


def fail(prog: str, message: str):
    """Ends the command with one line on stderr and exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _integer(text: str, minimum: int, maximum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        wanted = f"an integer from {minimum} to {maximum}" if maximum is not None else f"an integer >= {minimum}"
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An option's value that must be an integer >= 1 (sizes, counts of runs)."""
    return _integer(text, 1)


def count(text: str) -> int:
    """An option's value that must be an integer >= 0."""
    return _integer(text, 0)


def head_dim(text: str) -> int:
    """A head dimension, 1 to the kernels' largest."""
    return _integer(text, 1, tiles.MAX_HEAD_DIM)


def positive_float(text: str) -> float:
    """An option's value that must be a finite number > 0 (a time budget, a density)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """An option's value in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value
