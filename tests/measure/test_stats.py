"""The bootstrap estimators behind tpot_rse and `kvbench-results compare`."""

import math

import numpy as np
import pytest

from harness.measure import stats


def test_median_rse_is_zero_for_equal_values_and_inf_for_one():
    assert stats.median_rse([5.0, 5.0, 5.0]) == 0.0
    assert stats.median_rse([5.0]) == math.inf


def test_median_rse_grows_with_the_spread():
    rng = np.random.default_rng(1)
    tight = 100 + rng.normal(0, 1, size=10)
    wide = 100 + rng.normal(0, 10, size=10)
    assert stats.median_rse(wide) > 5 * stats.median_rse(tight)


def test_median_rse_is_seeded():
    values = [1.0, 1.2, 0.9, 1.5, 1.1]
    assert stats.median_rse(values) == stats.median_rse(values)


def test_median_rse_is_near_the_normal_approximation_for_many_normal_samples():
    # For normal data the median's standard error tends to 1.2533·sd/√n. The bootstrap's estimate of a median's
    # error converges slowly (relative error ~ n^(-1/4), Hall & Martin 1988: about 22% at n = 400), so it is held
    # to within 50% of the normal figure: a wrong estimator (sd of the values, or a mean's error) is off by far more.
    rng = np.random.default_rng(2)
    values = 100 + rng.normal(0, 5, size=400)
    normal = 1.2533 * np.std(values, ddof=1) / math.sqrt(len(values)) / np.median(values)
    assert stats.median_rse(values) == pytest.approx(normal, rel=0.5)


def test_ratio_ci_brackets_a_known_ratio():
    rng = np.random.default_rng(3)
    base = 10 + rng.normal(0, 0.1, size=20)
    other = 1.5 * (10 + rng.normal(0, 0.1, size=20))
    ratio, low, high = stats.ratio_ci(base, other)
    assert low < ratio < high
    assert low < 1.5 < high
    assert high - low < 0.05


def test_ratio_ci_rejects_a_bad_confidence():
    with pytest.raises(ValueError, match="confidence"):
        stats.ratio_ci([1.0, 2.0], [1.0, 2.0], confidence=95)
