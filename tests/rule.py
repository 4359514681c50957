"""The tolerance rule every GPU test judges by (`reference.error_bound`): a result's max |error|
against the float64 reference at most 2x that of the same computation in the input precision,
plus the dtype's noise floor. No test carries a tolerance of its own."""

import numpy

from cupyflash import reference
from cupyflash.cpu.reference import as_float64


def host(x):
    """x as a float64 NumPy copy: torch tensors (on any device) through torch, the rest through
    `as_float64` (NumPy, CuPy, DLPack)."""
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().double().cpu().numpy()
    return as_float64(x)


class Judge:
    """Collects a result's pieces (a packed batch's sequences, a decode batch's rows, each with its
    own float64 reference and baseline) and judges each named result once, over all its pieces,
    as flash-attn's tests judge a whole batch: the rule's maxima then come from the whole tensor
    the caller receives, not from a sequence of one query whose baseline may round luckily."""

    def __init__(self):
        self.pieces = {}

    def add(self, name, got, exact, baseline, dtype_name, magnitude=None):
        got = host(got)
        exact, baseline = (host(x) for x in (exact, baseline))
        assert got.shape == exact.shape, f"{name}: shape {got.shape}, expected {exact.shape}"
        assert not numpy.isnan(got).any(), f"NaN in {name}: an element was not written"
        entry = self.pieces.setdefault(name, {"dtype": dtype_name, "parts": [], "magnitude": None})
        entry["parts"].append((got.ravel(), exact.ravel(), baseline.ravel()))
        if magnitude is not None:
            entry["magnitude"] = max(entry["magnitude"] or 0.0, float(magnitude))

    def check(self):
        for name, entry in self.pieces.items():
            got, exact, baseline = (numpy.concatenate(part) for part in zip(*entry["parts"]))
            err = float(numpy.abs(got - exact).max(initial=0.0))
            bound = reference.error_bound(exact, baseline, entry["dtype"], magnitude=entry["magnitude"])
            assert err <= bound, f"{name}: max |error| {err:.3e} > bound {bound:.3e} ({entry['dtype']})"
        self.pieces.clear()


def assert_within_rule(name, got, exact, baseline, dtype_name, magnitude=None):
    """One result judged by the rule on its own."""
    judge = Judge()
    judge.add(name, got, exact, baseline, dtype_name, magnitude)
    judge.check()
