"""The timing discipline behind every measured ceiling: warm-up by count and by time, then the median of repeats.

nanoGPT's bench.py in a few functions: untimed calls first (allocator, first touch, cuBLAS heuristics, clocks ramping
up from idle), the device synchronized at both ends, and a median with its spread, never one sample. The copy and
read bandwidths (harness/device/bandwidth.py) and the matmul throughputs (harness/device/ceilings.py) are all timed here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from harness.measure.stats import median_rse
from harness.measure.timing import StepTimer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(
    fn: Callable[[], object],
    device: torch.device,
    *,
    min_calls: int,
    min_seconds: float,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """Untimed calls of fn() until at least min_calls have run and at least min_seconds have passed; returns how
    many ran. Each call is synchronized: on CUDA the host would otherwise queue calls far ahead of the device and
    the seconds would count launches, not work."""
    started = clock()
    calls = 0
    while calls < min_calls or clock() - started < min_seconds:
        fn()
        synchronize(device)
        calls += 1
    return calls


def median_seconds(
    fn: Callable[[], object], device: torch.device, *, warmup: int, warmup_s: float, repeats: int
) -> tuple[float, float]:
    """Median seconds of one fn() over `repeats` calls after the warm-up (warm_up(): at least `warmup` calls and
    `warmup_s` seconds), and that median's relative standard error (harness.measure.stats.median_rse, a bootstrap). On CUDA
    each timed call sits between two events and the host synchronizes only before the first (warm-up done) and
    after the last; on the CPU, perf_counter around each call."""
    warm_up(fn, device, min_calls=warmup, min_seconds=warmup_s)
    timer = StepTimer(device, n_marks=repeats)
    timer.start()
    for _ in range(repeats):
        fn()
        timer.mark()
    seconds = [ms / 1e3 for ms in timer.intervals_ms()]  # the closing synchronize happens here
    return statistics.median(seconds), median_rse(seconds)


def one_call_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """One untimed call, then one timed: a probe for the CPU size search, not a figure."""
    fn()
    synchronize(device)
    timer = StepTimer(device, n_marks=1)
    timer.start()
    fn()
    timer.mark()
    return timer.intervals_ms()[0] / 1e3
