"""The benchmarks' correctness gate (cupyflash/bench/common.py), on the host: a result passes the
tolerance rule when its error is within twice the in-precision baseline's plus the noise floor,
and fails above it."""

import numpy

from cupyflash.bench import common
from cupyflash.cpu import reference


def test_within_bounds_scores_each_result_against_the_rule(rng):
    exact = rng.standard_normal((64, 8))
    baseline = exact + 1e-3 * rng.standard_normal(exact.shape)
    bound = reference.error_bound(exact, baseline, "bfloat16")
    good = exact + 0.9 * bound
    bad = exact.copy()
    bad[3, 5] += 1.1 * bound
    ok, message = common.within_bounds([("out", good, exact, baseline), ("dq", exact, exact, baseline)], "bfloat16")
    assert ok and message.startswith("out ") and ", dq 0.0e+00/" in message
    ok, message = common.within_bounds([("out", exact, exact, baseline), ("dk", bad, exact, baseline)], "bfloat16")
    assert not ok and f"dk {1.1 * bound:.1e}/{bound:.1e}" in message


def test_within_bounds_fails_a_nan_the_reference_does_not_have(rng):
    exact = rng.standard_normal((16, 8))
    got = exact.copy()
    got[2, 3] = numpy.nan
    ok, message = common.within_bounds([("out", got, exact, exact)], "float32")
    assert not ok and message.startswith("out nan/")


def test_within_bounds_takes_16_bit_results():
    import ml_dtypes

    exact = numpy.linspace(-1, 1, 33)
    rounded = exact.astype(ml_dtypes.bfloat16)
    ok, _ = common.within_bounds([("out", rounded, exact, rounded)], "bfloat16")
    assert ok


def test_accuracy_problems_stay_where_flash_attention_2_runs(rng):
    from cupyflash.bench import accuracy

    problems = [accuracy.draw(rng, 2100) for _ in range(2000)]
    assert {p["dtype"] for p in problems} == {"float16", "bfloat16"}
    assert all(p["head_dim"] % 8 == 0 and 8 <= p["head_dim"] <= 256 for p in problems)
    seqlens = [p[k] for p in problems for k in ("seqlen_q", "seqlen_k")]
    assert min(seqlens) == 1 and max(seqlens) <= 2100
    # log-uniform: the short problems, where 16-bit gradients are hardest to get within the rule, are common
    assert sum(s <= 16 for s in seqlens) > len(seqlens) / 5
