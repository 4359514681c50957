"""The GPU tests' judge (tests/rule.py), on the CPU: one rule, over the whole result."""

import numpy
import pytest

from cupyflash import reference
from rule import Judge, assert_within_rule


def test_a_result_within_the_rule_passes_and_one_over_it_fails(rng):
    exact = rng.standard_normal(1000)
    baseline = exact + rng.uniform(-1e-3, 1e-3, exact.shape)
    bound = reference.error_bound(exact, baseline, "float16")
    assert_within_rule("out", exact + 0.99 * bound, exact, baseline, "float16")
    with pytest.raises(AssertionError, match=r"out: max \|error\|"):
        assert_within_rule("out", exact + 1.01 * bound, exact, baseline, "float16")


def test_pieces_are_judged_over_the_whole_result(rng):
    """A sequence whose baseline happens to round exactly allows its piece no more than the floor
    alone; judged with the rest of the batch, the batch's baseline error sets the bound."""
    exact = [rng.uniform(-1, 1, 50), numpy.array([0.5, -0.25, 0.75])]  # |result| < 1: a floor of 2 ulp of 1
    baseline = [exact[0] + 4e-3, exact[1]]
    got = [exact[0], exact[1] + 4e-3]
    with pytest.raises(AssertionError):
        assert_within_rule("dk", got[1], exact[1], baseline[1], "float16")
    judge = Judge()
    for piece in zip(got, exact, baseline):
        judge.add("dk", *piece, "float16")
    judge.check()


def test_an_unwritten_element_fails(rng):
    exact = rng.standard_normal(10)
    got = exact.copy()
    got[3] = numpy.nan
    with pytest.raises(AssertionError, match="NaN in dq"):
        assert_within_rule("dq", got, exact, exact, "float32")
