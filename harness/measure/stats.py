"""Bootstrap statistics over a point's repeats: the spread of a median, and the ratio of two medians.

Torch-free (numpy only), so that the store's `compare` and the dashboard use the very estimator the timing loop
stops on. The bootstrap (Efron & Tibshirani 1993, "An Introduction to the Bootstrap") makes no assumption about the
shape of the distribution: latency samples are skewed (a preempted repeat is slow, never fast), where the normal
approximation of the median's standard error (1.2533·sd/√n) is not to be trusted at the 3 to 20 repeats a point has.

Every resampling is seeded, so that a row's tpot_rse and a compare verdict are reproducible from its samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

N_RESAMPLES = 2000  # the CI's 2.5th and 97.5th percentiles rest on 50 resamples each at 2000
SEED = 0


def bootstrap_medians(values: Sequence[float], *, n_resamples: int = N_RESAMPLES, seed: int = SEED) -> np.ndarray:
    """The medians of n_resamples resamples of `values`, each drawn with replacement at the same size."""
    data = np.asarray(values, dtype=np.float64)
    if data.ndim != 1 or data.size == 0:
        raise ValueError(f"values: need a non-empty list of numbers, got shape {data.shape}")
    generator = np.random.default_rng(seed)
    picks = generator.integers(0, data.size, size=(n_resamples, data.size))
    return np.median(data[picks], axis=1)


def median_rse(values: Sequence[float], *, n_resamples: int = N_RESAMPLES, seed: int = SEED) -> float:
    """Relative standard error of the median: the standard deviation of the bootstrap medians over the median.

    inf for fewer than 2 values (nothing to resample) or a median that is not positive; 0 when every value is equal.
    """
    if len(values) < 2:
        return math.inf
    median = float(np.median(np.asarray(values, dtype=np.float64)))
    if not median > 0:
        return math.inf
    return float(np.std(bootstrap_medians(values, n_resamples=n_resamples, seed=seed), ddof=1) / median)


def ratio_ci(
    base: Sequence[float],
    other: Sequence[float],
    *,
    confidence: float = 0.95,
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float, float]:
    """median(other) / median(base), and its percentile-bootstrap confidence interval: (ratio, low, high).

    Each side is resampled on its own (the two runs are independent), and the interval is the central `confidence`
    share of the resampled ratios.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    ratio = float(np.median(np.asarray(other, dtype=np.float64)) / np.median(np.asarray(base, dtype=np.float64)))
    ratios = bootstrap_medians(other, n_resamples=n_resamples, seed=seed + 1) / bootstrap_medians(
        base, n_resamples=n_resamples, seed=seed
    )
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return ratio, float(low), float(high)
