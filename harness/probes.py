"""Memory probes: the torch allocator's peaks, NVML device and process usage sampled by a thread, and RSS.

A probe that cannot apply on this device reports None (a null column), never 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import sys
import threading
import time

import psutil
import torch

log = logging.getLogger(__name__)


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident set since the last reset_peak_rss(): VmHWM on Linux (which that
    reset lowers), else ru_maxrss (KiB on Linux, bytes on macOS; never reset: the process's lifetime peak)."""
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Hand freed heap back to the OS, then lower the resident high-water mark to the present resident set, so that
    a process measuring one point after another reports each point's own peak. False where that is not possible
    (not Linux, no /proc): then a peak is the process's lifetime peak and the process must not be reused."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):  # another libc has no malloc_trim: nothing to trim
        ctypes.CDLL(None).malloc_trim(0)  # glibc keeps freed blocks in its heap; RSS would carry them over
    try:
        with open(_CLEAR_REFS, "w") as clear_refs:
            clear_refs.write("5")  # proc(5): "reset the peak resident set size to the current resident set size"
    except OSError:
        return False
    return True


class NvmlSampler:
    """Samples device-used and this process's used GPU memory every `interval_s` on a background thread.

    NVML sees what the torch allocator cannot: the CUDA context, cuBLAS workspaces, other processes.
    """

    def __init__(self, device_index: int, interval_s: float = 0.01) -> None:
        import pynvml  # nvidia-ml-py; imported here so CPU-only runs never need a driver

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self.interval_s = interval_s
        self.pid = os.getpid()
        self.peak_used_bytes = 0
        self.peak_process_bytes: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)

    def used_bytes(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def process_bytes(self) -> int | None:
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except self.nvml.NVMLError:
            return None  # not permitted in some containers
        used = [p.usedGpuMemory for p in procs if p.pid == self.pid and p.usedGpuMemory is not None]
        return int(sum(used)) if used else None

    def snapshot(self) -> dict:
        """Clocks, throttle reasons and the energy counter now: read at both ends of the timed region, so that a
        throttled or down-clocked run is visible in its row."""
        nvml = self.nvml
        reasons = (
            getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        return {
            "sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(self.handle, nvml.NVML_CLOCK_SM),
            "mem_clock_mhz": nvml.nvmlDeviceGetClockInfo(self.handle, nvml.NVML_CLOCK_MEM),
            "throttle_reasons": int(reasons(self.handle)),
            "energy_mj": self._energy_mj(),
            "time_s": time.perf_counter(),
        }

    def _energy_mj(self) -> int | None:
        try:  # Volta and newer; millijoules since the driver loaded
            return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except self.nvml.NVMLError:
            return None

    def _sample(self) -> None:
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes())
        process = self.process_bytes()
        if process is not None:
            self.peak_process_bytes = max(self.peak_process_bytes or 0, process)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> NvmlSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.nvml.nvmlShutdown()


VALIDITY_COLUMNS = (
    "energy_j_per_token",
    "mean_power_w",
    "sm_clock_mhz_start",
    "sm_clock_mhz_end",
    "mem_clock_mhz_start",
    "mem_clock_mhz_end",
    "throttle_reasons_start",
    "throttle_reasons_end",
)


class MemoryProbe:
    """Everything a point records about memory, read around its measured region.

    Use: probe = MemoryProbe(device); probe.baseline() before the model loads; `with probe:` around the work;
    then probe.columns().
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sampler: NvmlSampler | None = None
        self.baseline_bytes: int | None = None
        self.timed_start: dict | None = None
        self.timed_end: dict | None = None
        self.timed_tokens = 0

    def baseline(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            try:
                self.sampler = NvmlSampler(self.device.index or 0)
                self.baseline_bytes = self.sampler.used_bytes()
            except Exception as exc:  # no driver access (some containers): NVML columns stay null
                log.warning("NVML unavailable, its columns will be null: %s", exc)
                self.sampler = None
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.baseline_bytes = rss_bytes()

    def __enter__(self) -> MemoryProbe:
        if self.sampler is not None:
            self.sampler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.sampler is not None:
            self.sampler.__exit__(*exc)

    def begin_timed(self) -> None:
        """Mark the start of the timed generations (CUDA: clocks, throttle reasons, energy counter)."""
        self.timed_start = self._snapshot()

    def end_timed(self, n_tokens: int) -> None:
        """Mark their end; n_tokens is every token they generated (all sequences, prefill's first token included)."""
        self.timed_end = self._snapshot()
        self.timed_tokens = n_tokens

    def _snapshot(self) -> dict | None:
        if self.sampler is None:
            return None
        torch.cuda.synchronize(self.device)
        try:
            return self.sampler.snapshot()
        except self.sampler.nvml.NVMLError as exc:
            log.warning("NVML clocks/energy unavailable, their columns will be null: %s", exc)
            return None

    def validity_columns(self) -> dict:
        """Energy per token, mean power, and clocks and throttle reasons at both ends of the timed region; null on
        CPU or wherever NVML cannot read them."""
        start, end = self.timed_start, self.timed_end
        columns = dict.fromkeys(VALIDITY_COLUMNS)
        if start is None or end is None:
            return columns
        for key in ("sm_clock_mhz", "mem_clock_mhz", "throttle_reasons"):
            columns[f"{key}_start"], columns[f"{key}_end"] = start[key], end[key]
        if start["energy_mj"] is not None and end["energy_mj"] is not None:
            energy_j = (end["energy_mj"] - start["energy_mj"]) / 1e3
            columns["energy_j_per_token"] = energy_j / self.timed_tokens
            columns["mean_power_w"] = energy_j / (end["time_s"] - start["time_s"])
        return columns

    def columns(self) -> dict:
        if self.device.type != "cuda":
            return {
                "peak_mem_bytes": peak_rss_bytes(),
                "mem_baseline_bytes": self.baseline_bytes,
                "torch_peak_allocated_bytes": None,
                "torch_peak_reserved_bytes": None,
                "nvml_peak_used_bytes": None,
                "nvml_process_peak_bytes": None,
            }
        sampler = self.sampler
        allocated = torch.cuda.max_memory_allocated(self.device)
        process = sampler.peak_process_bytes if sampler else None
        return {
            # NVML's view of this process when the driver exposes it; else the allocator's reserved peak.
            "peak_mem_bytes": process if process is not None else torch.cuda.max_memory_reserved(self.device),
            "mem_baseline_bytes": self.baseline_bytes,
            "torch_peak_allocated_bytes": allocated,
            "torch_peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
            "nvml_peak_used_bytes": sampler.peak_used_bytes if sampler else None,
            "nvml_process_peak_bytes": process,
        }
