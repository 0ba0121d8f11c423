"""Host noise: the shares of stolen and other processes' CPU time over a window, from fixed counter readings."""

from __future__ import annotations

import pytest

from harness.measure import host_noise
from harness.measure.host_noise import HostNoiseWindow


class FakeHost:
    """The counters host_noise reads, set by the test between open() and columns()."""

    def __init__(self, monkeypatch, *, n_cpus: int = 4, proc_stat: bool = True) -> None:
        self.wall_s, self.busy_s, self.own_s = 100.0, 5000.0, 20.0
        self.steal_jiffies, self.total_jiffies = 300, 900_000
        self.proc_stat = proc_stat
        monkeypatch.setattr(host_noise, "wall_s", lambda: self.wall_s)
        monkeypatch.setattr(host_noise, "system_busy_s", lambda: self.busy_s)
        monkeypatch.setattr(host_noise, "own_cpu_s", lambda: self.own_s)
        monkeypatch.setattr(host_noise, "cpu_count", lambda: n_cpus)
        monkeypatch.setattr(
            host_noise, "read_proc_stat", lambda: (self.steal_jiffies, self.total_jiffies) if self.proc_stat else None
        )

    def advance(self, *, wall_s: float, busy_s: float, own_s: float, steal_jiffies: int, total_jiffies: int) -> None:
        self.wall_s += wall_s
        self.busy_s += busy_s
        self.own_s += own_s
        self.steal_jiffies += steal_jiffies
        self.total_jiffies += total_jiffies


def window_over(host: FakeHost, **deltas) -> dict:
    window = HostNoiseWindow()
    window.open()
    host.advance(**deltas)
    return window.columns()


def test_a_quiet_host_shows_no_steal_no_other_cpu_and_is_not_busy(monkeypatch):
    host = FakeHost(monkeypatch)
    # 2 s on 4 cores (800 jiffies): this process kept one core busy, nothing else ran.
    columns = window_over(host, wall_s=2.0, busy_s=2.0, own_s=2.0, steal_jiffies=0, total_jiffies=800)
    assert columns == {"host_steal_frac": 0.0, "host_other_cpu_frac": 0.0, "host_busy": False}


def test_other_processes_cpu_time_is_the_machines_busy_time_less_our_own_over_all_cores(monkeypatch):
    host = FakeHost(monkeypatch)
    # 2 s on 4 cores = 8 core-seconds; the machine was busy 5 s of them, 2 s ours: others took 3/8.
    columns = window_over(host, wall_s=2.0, busy_s=5.0, own_s=2.0, steal_jiffies=0, total_jiffies=800)
    assert columns["host_other_cpu_frac"] == pytest.approx(3 / 8)
    assert columns["host_busy"] is True


def test_steal_is_the_steal_jiffies_share_of_all_jiffies(monkeypatch):
    host = FakeHost(monkeypatch)
    columns = window_over(host, wall_s=2.0, busy_s=2.0, own_s=2.0, steal_jiffies=200, total_jiffies=800)
    assert columns["host_steal_frac"] == pytest.approx(0.25)
    assert columns["host_other_cpu_frac"] == 0.0 and columns["host_busy"] is True


def test_shares_under_a_tenth_of_the_machine_are_not_busy(monkeypatch):
    host = FakeHost(monkeypatch)
    # others 0.6 of 8 core-seconds, steal 60 of 800 jiffies: 7.5% each, under BUSY_SHARE
    columns = window_over(host, wall_s=2.0, busy_s=2.6, own_s=2.0, steal_jiffies=60, total_jiffies=800)
    assert columns["host_other_cpu_frac"] == pytest.approx(0.075) and columns["host_steal_frac"] == 0.075
    assert host_noise.BUSY_SHARE == 0.1 and columns["host_busy"] is False


def test_a_share_within_the_counters_tick_of_a_short_window_is_not_busy(monkeypatch):
    host = FakeHost(monkeypatch, n_cpus=1)
    # 0.1 s on one core, 0.015 s "other": 15%, but under 2 ticks (0.02 s) of counter rounding: not a finding.
    columns = window_over(host, wall_s=0.1, busy_s=0.1, own_s=0.085, steal_jiffies=0, total_jiffies=10)
    assert columns["host_other_cpu_frac"] == pytest.approx(0.15)
    assert columns["host_busy"] is False


def test_other_cpu_share_is_clipped_to_the_unit_interval(monkeypatch):
    host = FakeHost(monkeypatch)
    # Counter rounding can make our own time exceed the machine's over a short window: that is 0, never negative.
    assert (
        window_over(host, wall_s=1.0, busy_s=1.0, own_s=1.5, steal_jiffies=0, total_jiffies=400)["host_other_cpu_frac"]
        == 0.0
    )
    assert (
        window_over(host, wall_s=1.0, busy_s=9.0, own_s=0.0, steal_jiffies=0, total_jiffies=400)["host_other_cpu_frac"]
        == 1.0
    )


def test_without_proc_stat_steal_is_null_and_busy_rests_on_the_other_processes(monkeypatch):
    host = FakeHost(monkeypatch, proc_stat=False)
    columns = window_over(host, wall_s=2.0, busy_s=6.0, own_s=2.0, steal_jiffies=0, total_jiffies=0)
    assert columns["host_steal_frac"] is None
    assert columns["host_other_cpu_frac"] == pytest.approx(0.5) and columns["host_busy"] is True


def test_an_unreadable_proc_stat_reads_as_none(monkeypatch, tmp_path):
    monkeypatch.setattr(host_noise, "PROC_STAT", tmp_path / "absent")
    assert host_noise.read_proc_stat() is None
    garbled = tmp_path / "stat"
    garbled.write_text("intr 1 2 3\n")
    monkeypatch.setattr(host_noise, "PROC_STAT", garbled)
    assert host_noise.read_proc_stat() is None


def test_proc_stat_steal_and_total_come_from_the_aggregate_cpu_line(monkeypatch, tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice: guest is inside user, not added again
    stat.write_text("cpu  100 2 30 800 10 0 5 53 40 0\ncpu0 50 1 15 400 5 0 2 27 20 0\n")
    monkeypatch.setattr(host_noise, "PROC_STAT", stat)
    assert host_noise.read_proc_stat() == (53, 100 + 2 + 30 + 800 + 10 + 0 + 5 + 53)


def test_the_real_counters_read_on_this_host():
    window = HostNoiseWindow()
    window.open()
    columns = window.columns()
    assert set(columns) == {"host_steal_frac", "host_other_cpu_frac", "host_busy"}
    assert columns["host_other_cpu_frac"] is None or 0.0 <= columns["host_other_cpu_frac"] <= 1.0
