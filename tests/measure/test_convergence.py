"""Issue #14's first acceptance point: a point measured under a deliberate CPU hog is marked noisy and not
converged, retried with twice the budget, and marked in the summary; a converged point on a quiet host is not.

The hog is real: one `while True: pass` process per core, killed when the test ends. The point is real too: the
tiny model on the CPU through harness.run.point.run_point, its target_rse set so small that only the caps can end
its repeats. The control's quiet host is the seam of harness.measure.host_noise (fixed counter readings) and its steady
repeats the stopping rule's estimator, since the machine running the tests may be shared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pandas as pd
import pytest

from harness.config import RunConfig
from harness.measure import host_noise, timing
from harness.run.point import run_point
from harness.store import disk
from harness.store.summary import format_summary, noise_mark

# The tiny model, long enough a generation (15 decode steps) that the measured window spans many counter ticks.
POINT = dict(model={"name": "tiny"}, device="cpu", dtype="fp32", prompt_len=16, gen_len=16, warmup=1,
             profile=False, roofline=False, isolate=False)  # fmt: skip


@pytest.fixture
def cpu_hog():
    """One busy-looping process per core for the duration of the test."""
    hogs = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        time.sleep(0.5)  # their interpreters start and begin to spin before the point's first measured repeat
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def summary_line(row: dict, tmp_path) -> tuple[str, str]:
    """The header and the row's line of format_summary, through the store as `kvbench-results show` reads it."""
    disk.write_point(row | {"sweep_id": "convergence-test"}, tmp_path)
    header, line = format_summary(disk.load(tmp_path)).splitlines()
    return header, line


@pytest.mark.slow
def test_a_point_under_a_cpu_hog_is_marked_busy_and_unconverged_retried_and_flagged_in_the_summary(cpu_hog, tmp_path):
    # target_rse 1e-6: no repeats of a real generation are that steady, so both attempts end on max_repeats.
    cfg = RunConfig(**POINT, min_repeats=3, max_repeats=3, max_time_s=60, target_rse=1e-6, results_dir=str(tmp_path))
    row = run_point(cfg).row
    assert all(hog.poll() is None for hog in cpu_hog)  # the hogs ran through the whole point
    # One spinning process per core wants the whole machine; against the point's own threads the scheduler still
    # gives them about half of it or more, so 0.3 leaves room for the counters' rounding.
    assert row["host_busy"] is True and row["host_other_cpu_frac"] > 0.3
    assert row["converged"] is False and row["stop_reason"] == "max_repeats"
    assert row["retries"] == 1
    # The retry's repeats alone are kept: twice max_repeats of them, every figure of the row from those.
    assert row["repeats"] == 2 * cfg.max_repeats == len(row["tpot_samples_ms"]) == len(row["ttft_samples_ms"])
    assert row["tpot_ms"] == pytest.approx(pd.Series(row["tpot_samples_ms"]).median())
    header, line = summary_line(row, tmp_path)
    assert line[header.index("noise") :].startswith("unconverged, busy host")


def quiet_host(monkeypatch) -> None:
    """Counters that say nothing else ran: the clock's ticks pass without steal, and the machine's busy CPU time
    grows exactly as this process's own does (here not at all)."""
    jiffies = iter(range(0, 10**9, 100))
    monkeypatch.setattr(host_noise, "read_proc_stat", lambda: (0, next(jiffies)))
    monkeypatch.setattr(host_noise, "system_busy_s", lambda: 5.0)
    monkeypatch.setattr(host_noise, "own_cpu_s", lambda: 5.0)


def steady_repeats(monkeypatch) -> None:
    """Repeats whose median is exact: the stopping rule's estimator (timing.median_rse) says 0. The machine running
    the tests is shared, so a real point's repeats can be 8x apart there (seen: 16 ms against 2 ms TPOT)."""
    monkeypatch.setattr(timing, "median_rse", lambda values: 0.0)


def test_a_converged_point_on_a_quiet_host_is_not_retried_nor_marked(monkeypatch, tmp_path):
    quiet_host(monkeypatch)
    steady_repeats(monkeypatch)
    cfg = RunConfig(**POINT, min_repeats=3, max_repeats=5, max_time_s=60, results_dir=str(tmp_path))
    row = run_point(cfg).row
    assert row["converged"] is True and row["stop_reason"] == "target" and row["tpot_rse"] == 0.0
    assert row["retries"] == 0 and row["repeats"] == 3 == len(row["tpot_samples_ms"])
    assert row["host_busy"] is False and row["host_steal_frac"] == 0.0 and row["host_other_cpu_frac"] == 0.0
    header, line = summary_line(row, tmp_path)
    assert len(line) <= header.index("noise")  # nothing under noise (the line's trailing blanks are trimmed)


def test_retry_noisy_off_keeps_the_first_attempt_unretried(tmp_path):
    cfg = RunConfig(**POINT, min_repeats=2, max_repeats=2, target_rse=1e-6, retry_noisy=False)
    row = run_point(cfg).row
    assert row["converged"] is False and row["retries"] == 0 and row["repeats"] == 2


@pytest.mark.parametrize(
    ("converged", "host_busy", "mark"),
    [
        (True, False, ""),
        (False, False, "unconverged"),
        (True, True, "busy host"),
        (False, True, "unconverged, busy host"),
        (None, None, ""),  # a row from before these columns: not recorded, never flagged
        (pd.NA, pd.NA, ""),
    ],
)
def test_the_summary_marks_unconverged_rows_and_busy_hosts_and_never_a_null(converged, host_busy, mark):
    assert noise_mark(converged=converged, host_busy=host_busy) == mark
