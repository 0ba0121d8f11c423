"""Adaptive repeats and the latency statistics."""

from __future__ import annotations

import pytest
import torch

from harness.measure import stats, timing
from harness.measure.timing import RepeatPolicy, Sample, StepTimer, convergence_columns, measure, summarize


def counting(samples):
    calls = []

    def run_once():
        calls.append(1)
        return samples[min(len(calls) - 1, len(samples) - 1)]

    return run_once, calls


def test_warmup_runs_are_excluded_from_the_samples():
    run_once, calls = counting([Sample(ttft_ms=99.0, step_ms=[99.0])] * 2 + [Sample(ttft_ms=1.0, step_ms=[1.0])] * 10)
    samples = measure(run_once, RepeatPolicy(warmup=2, min_repeats=3, max_repeats=10, target_rse=0.02)).samples
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


def tpot(ms: float) -> Sample:
    return Sample(ttft_ms=1.0, step_ms=[ms, ms])


NOISY = [tpot(1.0 + (i % 2) * 5) for i in range(100)]  # alternating 1 and 6 ms: never near a 2% rse


class FakeClock:
    """perf_counter for measure, advanced by the generations alone: each takes `generation_s`."""

    def __init__(self, samples: list[Sample], *, generation_s: float) -> None:
        self.now_s, self.samples, self.generation_s = 0.0, samples, generation_s

    def __call__(self) -> float:
        return self.now_s

    def run_once(self) -> Sample:
        self.now_s += self.generation_s
        return self.samples[round(self.now_s / self.generation_s) - 1]


def test_stable_timings_stop_at_min_repeats_on_the_target():
    run_once, _ = counting([tpot(2.0)])
    measurement = measure(run_once, RepeatPolicy(warmup=0, min_repeats=4, max_repeats=50))
    assert len(measurement.samples) == 4
    assert measurement.stop_reason == "target" and measurement.converged


def test_timings_that_settle_stop_on_the_target_as_soon_as_the_bootstrap_rse_is_below_it():
    # Two disturbed repeats, then steady ones: the rule stops at the first repeat whose samples' rse is below 2%.
    times = [9.0, 5.0] + [2.0] * 40
    run_once, calls = counting([tpot(ms) for ms in times])
    measurement = measure(run_once, RepeatPolicy(warmup=0, min_repeats=3, max_repeats=40, max_time_s=1e9))
    n = len(measurement.samples)
    assert measurement.stop_reason == "target" and 3 < n < 40
    assert stats.median_rse(times[:n]) < 0.02 <= stats.median_rse(times[: n - 1])


def test_noisy_timings_repeat_until_the_cap_and_say_so():
    run_once, _ = counting(NOISY)
    measurement = measure(run_once, RepeatPolicy(warmup=0, min_repeats=3, max_repeats=7, max_time_s=100))
    assert len(measurement.samples) == 7
    assert measurement.stop_reason == "max_repeats" and not measurement.converged


def test_min_repeats_equal_to_max_repeats_converges_only_if_the_last_repeat_meets_the_target():
    stable, _ = counting([tpot(2.0)])
    noisy, _ = counting(NOISY)
    policy = RepeatPolicy(warmup=0, min_repeats=3, max_repeats=3)
    assert measure(stable, policy).stop_reason == "target"
    assert measure(noisy, policy).stop_reason == "max_repeats"


def test_time_budget_stops_repeating_by_the_clock():
    clock = FakeClock(NOISY, generation_s=1.0)
    policy = RepeatPolicy(warmup=0, min_repeats=3, max_repeats=100, max_time_s=4.5)
    measurement = measure(clock.run_once, policy, clock=clock)
    assert measurement.stop_reason == "max_time_s" and not measurement.converged
    assert len(measurement.samples) == 5  # 5 s > 4.5 s after the 5th generation; 4 s was not


def test_a_retry_doubles_the_repeats_and_the_time_and_skips_the_warmup():
    policy = RepeatPolicy(warmup=2, min_repeats=3, max_repeats=5, max_time_s=10.0, target_rse=0.01)
    assert policy.retry() == RepeatPolicy(warmup=0, min_repeats=3, max_repeats=10, max_time_s=20.0, target_rse=0.01)


def test_the_stopping_rule_and_the_row_use_the_bootstrap_estimator_of_harness_stats():
    times = [2.0, 2.1, 2.05, 2.02, 1.98, 2.3]
    run_once, _ = counting([tpot(ms) for ms in times])
    measurement = measure(run_once, RepeatPolicy(warmup=0, min_repeats=6, max_repeats=6, target_rse=1e-9))
    row = summarize(measurement.samples, batch_size=1, prompt_len=4) | convergence_columns(measurement)
    assert row["tpot_rse"] == stats.median_rse(times)  # same samples, same seed: the same number
    assert row["tpot_samples_ms"] == pytest.approx(times) and row["ttft_samples_ms"] == [1.0] * 6
    assert row == row | {"converged": False, "stop_reason": "max_repeats", "repeats": 6}
    assert timing.median_rse is stats.median_rse  # the one estimator: harness.device.ceilings imports it from here too


def test_one_repeat_has_no_rse():
    row = summarize([tpot(2.0)], batch_size=1, prompt_len=4)
    assert row["tpot_rse"] is None and row["tpot_samples_ms"] == [2.0]


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
