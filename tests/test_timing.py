"""Adaptive repeats and the latency statistics."""

from __future__ import annotations

import math

import pytest
import torch

from harness import timing
from harness.timing import RepeatPolicy, Sample, StepTimer, measure, median_rse, summarize


def counting(samples):
    calls = []

    def run_once():
        calls.append(1)
        return samples[min(len(calls) - 1, len(samples) - 1)]

    return run_once, calls


def test_warmup_runs_are_excluded_from_the_samples():
    run_once, calls = counting([Sample(ttft_ms=99.0, step_ms=[99.0])] * 2 + [Sample(ttft_ms=1.0, step_ms=[1.0])] * 10)
    samples = measure(run_once, RepeatPolicy(warmup=2, min_repeats=3, max_repeats=10, target_rse=0.02))
    assert len(calls) == 2 + len(samples)
    assert all(s.ttft_ms == 1.0 for s in samples)


def test_on_measure_start_runs_once_between_the_last_warmup_and_the_first_measured_run():
    events = []

    def run_once():
        events.append("run")
        return Sample(ttft_ms=1.0, step_ms=[1.0])

    policy = RepeatPolicy(warmup=2, min_repeats=2, max_repeats=2)
    measure(run_once, policy, on_measure_start=lambda: events.append("start"))
    assert events == ["run", "run", "start", "run", "run"]


class FakeEvent:
    """A CUDA event that records at the next millisecond of a fake device clock shared by its timer's events."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.at_ms = log, None

    def record(self):
        self.log.append("record")
        self.at_ms = float(self.log.count("record"))

    def synchronize(self):
        self.log.append("synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at_ms - self.at_ms


def test_on_cuda_the_step_timer_records_events_and_the_host_waits_once_per_generation(monkeypatch):
    log = []
    monkeypatch.setattr(timing, "cuda_event", lambda: FakeEvent(log))
    timer = StepTimer(torch.device("cuda"), n_marks=3)
    timer.start()
    for _ in range(3):
        timer.mark()
    assert timer.intervals_ms() == [1.0, 1.0, 1.0]
    assert log == ["record"] * 4 + ["synchronize"]  # no host wait between marks


def test_stable_timings_stop_at_min_repeats():
    run_once, _ = counting([Sample(ttft_ms=1.0, step_ms=[2.0, 2.0])])
    samples = measure(run_once, RepeatPolicy(warmup=0, min_repeats=4, max_repeats=50))
    assert len(samples) == 4


def test_noisy_timings_repeat_until_the_cap():
    noisy = [Sample(ttft_ms=1.0, step_ms=[1.0 + (i % 2) * 5]) for i in range(100)]
    run_once, _ = counting(noisy)
    samples = measure(run_once, RepeatPolicy(warmup=0, min_repeats=3, max_repeats=7, max_time_s=100))
    assert len(samples) == 7


def test_time_budget_stops_repeating():
    noisy = [Sample(ttft_ms=1.0, step_ms=[1.0 + (i % 2) * 5]) for i in range(100)]
    run_once, _ = counting(noisy)
    samples = measure(run_once, RepeatPolicy(warmup=0, min_repeats=3, max_repeats=100, max_time_s=1e-9))
    assert len(samples) == 3


def test_median_rse():
    assert median_rse([5.0]) == math.inf
    assert median_rse([2.0, 2.0, 2.0]) == 0.0
    assert median_rse([1.0, 2.0, 3.0]) == pytest.approx(1.2533 * 1.0 / math.sqrt(3) / 2.0)


def test_summary_excludes_the_first_token_from_tpot_and_counts_throughput_per_sequence():
    samples = [
        Sample(ttft_ms=100.0, step_ms=[10.0, 10.0, 10.0, 10.0]),
        Sample(ttft_ms=120.0, step_ms=[10.0, 12.0, 14.0, 12.0]),
    ]
    row = summarize(samples, batch_size=8, prompt_len=64)
    assert row["tpot_ms"] == pytest.approx((10.0 + 12.0) / 2)
    assert row["ttft_ms"] == pytest.approx(110.0)
    assert row["itl_ms"] == [10.0, 11.0, 12.0, 11.0]
    assert row["decode_tok_s"] == pytest.approx(8 * 4 / (((40.0 + 48.0) / 2) / 1e3))
    assert row["prefill_tok_s"] == pytest.approx(8 * 64 / 0.110)
    assert row["e2e_ms"] == pytest.approx((140.0 + 168.0) / 2)
    assert row["repeats"] == 2
    assert row["tpot_cv"] > 0
    assert row["itl_p50_ms"] <= row["itl_p90_ms"] <= row["itl_p99_ms"] <= 14.0
