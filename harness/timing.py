"""Timing: a step timer that never syncs the host mid-generation, adaptive repeats, and percentile stats.

On CUDA every mark records an event on the stream and the host reads them all after one synchronize at the end,
so timing adds no bubbles between decode steps. On the CPU work is synchronous and `perf_counter` is exact.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


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


def median_rse(values: list[float]) -> float:
    """Relative standard error of the median: 1.2533 * sd / sqrt(n) / median (asymptotic, normal data)."""
    if len(values) < 2:
        return math.inf
    med = statistics.median(values)
    return 1.2533 * statistics.stdev(values) / math.sqrt(len(values)) / med if med > 0 else math.inf


def measure(
    run_once: Callable[[], Sample], policy: RepeatPolicy, *, on_measure_start: Callable[[], None] | None = None
) -> list[Sample]:
    """Warm up, then repeat whole generations until the median TPOT is stable, the budget is spent, or the cap.

    on_measure_start runs once between the last warm-up generation and the first measured one: where a probe of
    the measured generations alone (energy, clocks) opens its window.
    """
    for _ in range(policy.warmup):
        run_once()
    if on_measure_start is not None:
        on_measure_start()
    samples: list[Sample] = []
    started = time.perf_counter()
    while len(samples) < policy.max_repeats:
        samples.append(run_once())
        if len(samples) < policy.min_repeats:
            continue
        if median_rse([s.tpot_ms for s in samples]) < policy.target_rse:
            break
        if time.perf_counter() - started > policy.max_time_s:
            break
    return samples


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def summarize(samples: list[Sample], *, batch_size: int, prompt_len: int) -> dict:
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
    }
