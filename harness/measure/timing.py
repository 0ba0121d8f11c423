"""Timing: a step timer that never syncs the host mid-generation, adaptive repeats, and percentile stats.

On CUDA every mark records an event on the stream and the host reads them all after one synchronize at the end,
so timing adds no bubbles between decode steps. On the CPU work is synchronous and `perf_counter` is exact.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from harness.measure.stats import median_rse


def cuda_event() -> torch.cuda.Event:
    """One timing event: the seam where a test without a GPU puts a fake."""
    return torch.cuda.Event(enable_timing=True)


class StepTimer:
    """Marks phase boundaries: start(), then mark() after prefill and after each decode step."""

    def __init__(self, device: torch.device, n_marks: int) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.events = [cuda_event() for _ in range(n_marks + 1)]
        self.stamps: list[float] = []
        self.n = 0

    def start(self) -> None:
        self.n = 0
        self.stamps = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            self.events[self.n].record()
        else:
            self.stamps.append(time.perf_counter())
        self.n += 1

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive marks; on CUDA the one host sync of the generation happens here."""
        if self.cuda:
            self.events[self.n - 1].synchronize()
            return [self.events[i].elapsed_time(self.events[i + 1]) for i in range(self.n - 1)]
        return [(b - a) * 1e3 for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


@dataclass(frozen=True)
class Sample:
    """One timed generation: TTFT is prefill plus the first token; steps are the decode steps after it."""

    ttft_ms: float
    step_ms: list[float]  # gen_len - 1 entries

    @property
    def decode_ms(self) -> float:
        return sum(self.step_ms)

    @property
    def tpot_ms(self) -> float:
        return self.decode_ms / len(self.step_ms)

    @property
    def e2e_ms(self) -> float:
        return self.ttft_ms + self.decode_ms


@dataclass(frozen=True)
class RepeatPolicy:
    warmup: int = 1  # runs excluded from every figure (allocator, caches, lazy init)
    min_repeats: int = 3
    max_repeats: int = 20
    max_time_s: float = 60.0  # wall budget for the measured repeats of one point
    target_rse: float = 0.02  # stop once the relative standard error of the median TPOT is below this

    def retry(self) -> RepeatPolicy:
        """The budget of a second attempt at a point that did not converge: twice the repeats and twice the time,
        and no warm-up (the model, its kernels and the allocator are warm from the first attempt)."""
        return dataclasses.replace(self, warmup=0, max_repeats=2 * self.max_repeats, max_time_s=2 * self.max_time_s)


STOP_REASONS = ("target", "max_repeats", "max_time_s")  # the schema's stop_reason values, in the order checked


@dataclass(frozen=True)
class Measurement:
    """The measured repeats of one attempt at a point, in order, and what ended them (one of STOP_REASONS)."""

    samples: tuple[Sample, ...]
    stop_reason: str

    @property
    def converged(self) -> bool:
        """target_rse was met before a cap stopped the repeats."""
        return self.stop_reason == "target"

    def __len__(self) -> int:  # the number of measured repeats
        return len(self.samples)


def measure(
    run_once: Callable[[], Sample],
    policy: RepeatPolicy,
    *,
    on_measure_start: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Measurement:
    """Warm up, then repeat whole generations until the median TPOT is stable, the budget is spent, or the cap.

    From min_repeats on, after every repeat, in this order: the median TPOT's relative standard error
    (harness.measure.stats.median_rse, the bootstrap the row's tpot_rse reports) below target_rse stops with "target";
    else max_repeats reached stops with "max_repeats"; else more than max_time_s seconds (by `clock`) since the
    first measured repeat began stops with "max_time_s". The target is checked first, so a point with min_repeats
    == max_repeats whose repeats are already stable converges; one whose are not stops on max_repeats.

    on_measure_start runs once between the last warm-up generation and the first measured one: where a probe of
    the measured generations alone (energy, clocks, host noise) opens its window.
    """
    for _ in range(policy.warmup):
        run_once()
    if on_measure_start is not None:
        on_measure_start()
    samples: list[Sample] = []
    started = clock()
    while True:
        samples.append(run_once())
        if len(samples) < policy.min_repeats:
            continue
        if median_rse([s.tpot_ms for s in samples]) < policy.target_rse:
            return Measurement(samples=tuple(samples), stop_reason="target")
        if len(samples) >= policy.max_repeats:
            return Measurement(samples=tuple(samples), stop_reason="max_repeats")
        if clock() - started > policy.max_time_s:
            return Measurement(samples=tuple(samples), stop_reason="max_time_s")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def summarize(samples: Sequence[Sample], *, batch_size: int, prompt_len: int) -> dict:
    """The latency columns of a row, from the measured samples (see harness.store.schema for their meaning)."""
    ttft = [s.ttft_ms for s in samples]
    tpot = [s.tpot_ms for s in samples]
    steps = [ms for s in samples for ms in s.step_ms]
    n_steps = len(samples[0].step_ms)
    decode_ms = statistics.median(s.decode_ms for s in samples)
    ttft_ms = statistics.median(ttft)
    return {
        "ttft_ms": ttft_ms,
        "ttft_p90_ms": percentile(ttft, 90),
        "ttft_p99_ms": percentile(ttft, 99),
        "tpot_ms": statistics.median(tpot),
        "tpot_p90_ms": percentile(tpot, 90),
        "tpot_p99_ms": percentile(tpot, 99),
        "tpot_cv": statistics.stdev(tpot) / statistics.mean(tpot) if len(tpot) > 1 else None,
        "itl_ms": np.median(np.array([s.step_ms for s in samples]), axis=0).tolist(),
        "itl_p50_ms": percentile(steps, 50),
        "itl_p90_ms": percentile(steps, 90),
        "itl_p99_ms": percentile(steps, 99),
        "decode_tok_s": batch_size * n_steps / (decode_ms / 1e3),
        "prefill_tok_s": batch_size * prompt_len / (ttft_ms / 1e3),
        "e2e_ms": statistics.median(s.e2e_ms for s in samples),
        "repeats": len(samples),
        "tpot_samples_ms": tpot,
        "ttft_samples_ms": ttft,
        "tpot_rse": finite_or_none(median_rse(tpot)),
    }


def convergence_columns(measurement: Measurement) -> dict:
    """Whether the stopping rule was met, and what stopped the repeats (the latency columns are summarize's)."""
    return {"converged": measurement.converged, "stop_reason": measurement.stop_reason}


def finite_or_none(value: float) -> float | None:
    """A relative standard error, or None where it is not defined (fewer than 2 repeats: median_rse's inf)."""
    return value if math.isfinite(value) else None
