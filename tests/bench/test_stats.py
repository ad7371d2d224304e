"""stackwise.bench.stats: paired ratios and their distribution-free intervals."""

import math

import numpy as np
import pytest

from stackwise.bench import Result, paired_interval, paired_ratio
from stackwise.bench.stats import median_interval


def _result(compile_samples=(), step_samples=(), compile_s=math.nan, step_s=math.nan):
    return Result("mlp", 4, "jax", "v", "off", compile_s=compile_s, step_s=step_s,
                  compile_samples=tuple(compile_samples), step_samples=tuple(step_samples))


def test_paired_ratio_interval():
    def result(samples):
        return _result(compile_samples=samples, compile_s=min(samples))

    ref = result([2.0] * 9)
    # ratios 0.5, 1.0, ..., 4.5: the median and a ~95% interval from order statistics 2 and 8
    assert paired_interval(result(range(1, 10)), ref, "compile") == (2.5, 1.0, 4.0)
    median, low, high = paired_interval(result(range(1, 6)), result([2.0] * 5), "compile")
    assert median == 1.5 and np.isnan(low) and np.isnan(high)  # too few samples for one


def test_ratios_are_paired_by_round_not_ratios_of_medians():
    # Round 3 was slow for both (the machine drifted): pairing cancels it.
    row, ref = _result(step_samples=[1, 1, 10]), _result(step_samples=[2, 2, 20])
    assert paired_ratio(row, ref, "step") == 0.5


def test_without_samples_the_summaries_ratio_is_used():
    row, ref = _result(step_s=3.0), _result(step_s=2.0)
    median, low, high = paired_interval(row, ref, "step")
    assert median == 1.5 and math.isnan(low) and math.isnan(high)


@pytest.mark.parametrize("k", [6, 9, 17, 40])
def test_interval_holds_the_median_and_has_at_most_the_nominal_tail(k):
    values = np.random.default_rng(k).lognormal(size=k)
    median, low, high = median_interval(values)
    assert low <= median <= high
    # the interval's bounds are order statistics m+1 and k-m with P(Bin(k, 1/2) <= m) <= 2.5%
    m = int(np.sum(np.sort(values) < low))
    assert sum(math.comb(k, i) for i in range(m + 1)) / 2**k <= 0.025


def test_unknown_timing_is_named():
    with pytest.raises(ValueError, match="'compile' or 'step'"):
        paired_interval(_result(), _result(), "memory")
