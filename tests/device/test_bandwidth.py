"""The two bandwidth roofs: what each counts, the buffer they stream, and measuring again while the spread is wide."""

from __future__ import annotations

import math

import pytest
import torch

from harness.device import bandwidth, ceilings
from harness.device.bandwidth import Bandwidth

CPU = torch.device("cpu")


class Measurements:
    """measure_once() for tightest(): hands out the given spreads in turn, each with its own GB/s."""

    def __init__(self, *spreads: float) -> None:
        self.spreads, self.calls = list(spreads), 0

    def __call__(self) -> Bandwidth:
        rse = self.spreads[self.calls]
        self.calls += 1
        return Bandwidth(gbps=float(self.calls), rse=rse, n_bytes=2**20, repeats=3)


def test_the_read_counts_bytes_read_and_the_copy_bytes_read_plus_written(monkeypatch):
    def one_second_per_call(fn, device, **plan):
        fn()
        return 1.0, 0.01  # (median seconds, rse)

    monkeypatch.setattr(bandwidth, "median_seconds", one_second_per_call)
    read = bandwidth.read_once(CPU, ceilings.QUICK)
    copy = bandwidth.copy_once(CPU, ceilings.QUICK)
    assert read.n_bytes == copy.n_bytes  # the same buffer size: the two roofs differ in what they count, not in size
    assert read.gbps == pytest.approx(read.n_bytes / 1e9)  # one second per call
    assert copy.gbps == pytest.approx(2 * copy.n_bytes / 1e9)


def test_both_stream_a_buffer_several_times_the_last_level_cache():
    n_bytes = bandwidth.buffer_bytes_for(CPU, ceilings.QUICK)
    assert n_bytes > bandwidth.last_level_cache_bytes(CPU) and n_bytes % 4 == 0  # whole float32s


def test_quick_cpu_read_and_copy_are_positive_with_their_spread():
    for measured in (bandwidth.read_bandwidth(CPU, ceilings.QUICK), bandwidth.copy_bandwidth(CPU, ceilings.QUICK)):
        assert math.isfinite(measured.gbps) and measured.gbps > 0  # sanity, not a performance target
        assert 0 <= measured.rse < math.inf and measured.repeats == ceilings.QUICK.repeats
        assert 1 <= measured.tries <= bandwidth.MAX_TRIES


def test_a_tight_first_measurement_is_kept_without_measuring_again():
    once = Measurements(bandwidth.MAX_RSE / 2)
    kept = bandwidth.tightest(once)
    assert once.calls == kept.tries == 1 and kept.gbps == 1.0


def test_a_wide_spread_is_measured_again_and_the_tight_one_kept():
    once = Measurements(10 * bandwidth.MAX_RSE, bandwidth.MAX_RSE / 2)
    kept = bandwidth.tightest(once)
    assert once.calls == kept.tries == 2
    assert kept.gbps == 2.0 and kept.rse == bandwidth.MAX_RSE / 2


def test_a_spread_that_stays_wide_stops_at_max_tries_and_keeps_the_tightest():
    once = Measurements(0.5, 0.1, 0.3, 0.01)
    kept = bandwidth.tightest(once, max_tries=3)
    assert once.calls == kept.tries == 3  # the fourth, tight one is never taken
    assert kept.gbps == 2.0 and kept.rse == 0.1


def test_the_read_roof_is_measured_again_when_its_first_spread_is_wide(monkeypatch):
    once = Measurements(0.5, 0.001)
    monkeypatch.setattr(bandwidth, "read_once", lambda device, plan: once())
    kept = bandwidth.read_bandwidth(CPU, ceilings.QUICK)
    assert kept.tries == 2 and kept.rse == 0.001


def test_the_ceilings_record_how_many_tries_each_roof_took(monkeypatch):
    reads, copies = Measurements(0.5, 0.001), Measurements(0.001)
    monkeypatch.setattr(bandwidth, "read_once", lambda device, plan: reads())
    monkeypatch.setattr(bandwidth, "copy_once", lambda device, plan: copies())
    monkeypatch.setattr(ceilings, "MATMUL_DTYPES", {})  # the roofs only: no matmuls to time
    measured = ceilings.measure(CPU, quick=True)
    assert measured.tries == {"read": 2, "copy": 1}
    assert measured.median_rse == {"read": 0.001, "copy": 0.001} and measured.read_bw_gbps == 2.0
