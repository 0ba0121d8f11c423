"""Host noise over a point's measured repeats: CPU time the hypervisor stole, and CPU time other processes took.

A window opens just before the measured repeats (timing.measure's on_measure_start) and closes after them; its
columns say whether the figures were measured on a quiet host. Both matter on a GPU too: a decode step of a small
model is launch-bound, and the launches run on the host's cores.

- host_steal_frac: the steal field's share of all CPU time in /proc/stat's aggregate `cpu` line (Linux, jiffies);
  null where /proc/stat cannot be read.
- host_other_cpu_frac: the whole machine's busy CPU time (psutil.cpu_times) less this process's own (its threads
  included, and the children it waited for), over wall time x the logical cores; clipped to [0, 1].
- host_busy: either share above BUSY_SHARE (and above what the counters' tick can resolve in so short a window).

The readers (read_proc_stat, system_busy_s, own_cpu_s, cpu_count, wall_s) are module functions, the seam where a
test puts fixed readings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import psutil

PROC_STAT = Path("/proc/stat")
# /proc/stat's `cpu` fields, in order (proc(5)): guest and guest_nice follow, already counted in user and nice.
PROC_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
# psutil.cpu_times()'s fields of CPU time spent running something (idle and iowait are not; steal is the
# hypervisor's, counted apart; guest is already in user). Fields a platform lacks are skipped.
BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq")
# A tenth of the machine: one core of a 10-core host fully taken by another process, or a hypervisor stealing
# 10%. Below that the launch-bound steps of a small model still show it as jitter; above it, the tail repeats of a
# CPU point run on a core shared with the other process (the 304 ms against 54-69 ms TPOT).
BUSY_SHARE = 0.1
# The counters' resolution: /proc/stat and psutil count CPU time in USER_HZ = 100 ticks per second (proc(5)), so
# each reading of a core is up to a tick behind; two readings bound a share's error by 2 ticks over the window.
TICK_S = 0.01


@dataclass(frozen=True)
class HostReading:
    """The counters at one instant: wall clock, /proc/stat's (steal, total) jiffies or None, busy and own CPU time."""

    wall_s: float
    steal_and_total_jiffies: tuple[int, int] | None
    system_busy_s: float
    own_cpu_s: float


def read_proc_stat() -> tuple[int, int] | None:
    """(steal, total) jiffies of the aggregate `cpu` line, or None where /proc/stat is absent or unreadable."""
    try:
        line = PROC_STAT.read_text().splitlines()[0].split()
        fields = [int(value) for value in line[1 : 1 + len(PROC_STAT_FIELDS)]]
    except (OSError, IndexError, ValueError):
        return None
    if line[0] != "cpu" or len(fields) < len(PROC_STAT_FIELDS):
        return None  # an old kernel without the steal field: nothing to report
    return fields[PROC_STAT_FIELDS.index("steal")], sum(fields)


def system_busy_s() -> float:
    """Seconds of CPU time every core of the machine has spent busy since boot."""
    times = psutil.cpu_times()
    return sum(getattr(times, name, 0.0) for name in BUSY_FIELDS)


def own_cpu_s() -> float:
    """Seconds of CPU time this process has used, all its threads, plus its children that it waited for."""
    times = psutil.Process().cpu_times()
    return times.user + times.system + getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0)


def cpu_count() -> int:
    return psutil.cpu_count() or 1


def wall_s() -> float:
    return time.monotonic()


def read() -> HostReading:
    return HostReading(
        wall_s=wall_s(), steal_and_total_jiffies=read_proc_stat(), system_busy_s=system_busy_s(), own_cpu_s=own_cpu_s()
    )


def noise_columns(start: HostReading, end: HostReading) -> dict:
    """host_steal_frac, host_other_cpu_frac and host_busy between two readings (harness.store.schema)."""
    steal = None
    if start.steal_and_total_jiffies is not None and end.steal_and_total_jiffies is not None:
        steal_jiffies = end.steal_and_total_jiffies[0] - start.steal_and_total_jiffies[0]
        total_jiffies = end.steal_and_total_jiffies[1] - start.steal_and_total_jiffies[1]
        steal = min(max(steal_jiffies / total_jiffies, 0.0), 1.0) if total_jiffies > 0 else None
    elapsed_s = end.wall_s - start.wall_s
    other = None
    if elapsed_s > 0:
        other_cpu_s = (end.system_busy_s - start.system_busy_s) - (end.own_cpu_s - start.own_cpu_s)
        other = min(max(other_cpu_s / (elapsed_s * cpu_count()), 0.0), 1.0)
    busy = None
    if steal is not None or other is not None:
        threshold = max(BUSY_SHARE, 2 * TICK_S / elapsed_s) if elapsed_s > 0 else BUSY_SHARE
        busy = any(share is not None and share > threshold for share in (steal, other))
    return {"host_steal_frac": steal, "host_other_cpu_frac": other, "host_busy": busy}


class HostNoiseWindow:
    """open() just before the measured repeats, columns() just after them; open() again starts a new window."""

    def __init__(self) -> None:
        self.start: HostReading | None = None

    def open(self) -> None:
        self.start = read()

    def columns(self) -> dict:
        if self.start is None:
            raise RuntimeError("HostNoiseWindow.columns(): the window was never opened")
        return noise_columns(self.start, read())
