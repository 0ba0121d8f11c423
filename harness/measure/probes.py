"""Memory probes: the torch allocator's peaks and RSS, and on CUDA, through harness.measure.nvml's sampler thread, NVML's
device and process usage and the energy, clocks and throttle reasons of the timed generations.

A probe that cannot apply on this device reports None (a null column), never 0. Two seams keep all of it testable
on a CPU: NVML comes from nvml.load_nvml() and every torch.cuda call goes through MemoryProbe's `cuda` argument, so a
test hands in a fake pynvml and a fake torch.cuda.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import resource
import sys
import time
from collections.abc import Callable

import psutil
import torch

from harness.measure import nvml

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


def cuda_bytes_held(device: torch.device, *, cuda=torch.cuda) -> tuple[int, str]:
    """What this process holds on the device now, CUDA context included, and by whose count: NVML's view of this
    process ("nvml_process"), or where NVML cannot see it, all memory in use on the device as cudaMemGetInfo reports
    it ("device_used": other processes count too, so a cap based on it errs on the small side)."""
    cuda.synchronize(device)  # the CUDA context exists from here on
    try:
        sampler = nvml.NvmlSampler(cuda.get_device_properties(device), nvml=nvml.load_nvml())
    except Exception as exc:  # no NVML library, no driver access, no matching GPU
        why_not = f"NVML unavailable ({nvml.describe(exc)})"
    else:
        process, why_not = sampler.process_view()
        sampler.close()
        if process is not None:
            return process, "nvml_process"
    free_bytes, total_bytes = cuda.mem_get_info(device)
    log.warning("this process's device memory: %s; counting all memory in use on the device instead", why_not)
    return total_bytes - free_bytes, "device_used"


VALIDITY_COLUMNS = (
    "energy_j_per_token",
    "mean_power_w",
    "sm_clock_mhz_min",
    "sm_clock_mhz_max",
    "mem_clock_mhz_min",
    "mem_clock_mhz_max",
    "throttle_reasons",
    "nvml_timed_samples",
)


class MemoryProbe:
    """Everything a point records about memory, and on CUDA about the energy and clocks of its timed generations.

    Use: probe = MemoryProbe(device); probe.baseline() before the model loads; `with probe:` around the work, and
    inside it probe.begin_timed() after the warm-up and probe.end_timed(n_tokens) after the last timed generation;
    then probe.columns() and probe.validity_columns().

    `cuda` is torch.cuda, or a fake with the same few functions in tests; `clock` times the window (seconds).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        cuda=torch.cuda,
        clock: Callable[[], float] = time.perf_counter,
        nvml_interval_s: float = nvml.NVML_INTERVAL_S,
    ) -> None:
        self.device = device
        self.cuda = cuda
        self.clock = clock
        self.nvml_interval_s = nvml_interval_s
        self.sampler: nvml.NvmlSampler | None = None
        self.baseline_bytes: int | None = None
        # Where peak_mem_bytes comes from, fixed at the baseline (see baseline()).
        self.peak_mem_source = "torch_reserved" if device.type == "cuda" else "rss"
        self.nvml_error: str | None = None  # why NVML could not start; the sampler keeps its own errors
        self.timed_tokens = 0

    def baseline(self) -> None:
        """Before the model loads: the memory in use now, and on CUDA the NVML sampler and the peak_mem_bytes rule:
        NVML's view of this process where NVML lists it, else the allocator's reserved peak, with a warning why."""
        if self.device.type != "cuda":
            self.baseline_bytes = rss_bytes()
            return
        self.cuda.synchronize(self.device)  # creates the CUDA context, so that NVML lists this process below
        try:
            self.sampler = nvml.NvmlSampler(
                self.cuda.get_device_properties(self.device),
                nvml=nvml.load_nvml(),
                interval_s=self.nvml_interval_s,
                clock=self.clock,
            )
        except Exception as exc:  # no NVML library, no driver access (some containers), no matching GPU
            self.nvml_error = f"NVML unavailable: {nvml.describe(exc)}"
            log.warning(
                "NVML unavailable, its columns will be null and peak_mem_bytes is torch's reserved peak: %s", exc
            )
        else:
            self.baseline_bytes = self.sampler.used_bytes()
            process, why_not = self.sampler.process_view()
            if process is not None:
                self.peak_mem_source = "nvml_process"
            else:
                log.warning(
                    "peak_mem_bytes is the allocator's reserved peak (peak_mem_source=torch_reserved): %s", why_not
                )
        self.cuda.reset_peak_memory_stats(self.device)

    def __enter__(self) -> MemoryProbe:
        if self.sampler is not None:
            self.sampler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.cuda.synchronize(self.device)
        if self.sampler is not None:
            self.sampler.__exit__(*exc)

    def begin_timed(self) -> None:
        """The timed generations start (call it after the last warm-up generation): the energy and clock window
        opens once the device has finished the warm-up's work."""
        if self.sampler is None:
            return
        self.cuda.synchronize(self.device)
        self.sampler.open_window()

    def end_timed(self, n_tokens: int) -> None:
        """They are over; n_tokens is every token they generated (all sequences, prefill's first token included),
        warm-up excluded."""
        self.timed_tokens = n_tokens
        if self.sampler is None:
            return
        self.cuda.synchronize(self.device)
        self.sampler.close_window()

    def validity_columns(self) -> dict:
        """Energy per token and mean power over the timed window; the range of the SM and memory clocks and the OR
        of the throttle reasons sampled inside it. Null on the CPU or wherever NVML cannot read them."""
        columns = dict.fromkeys(VALIDITY_COLUMNS)
        sampler = self.sampler
        if sampler is None or sampler.window_start is None or sampler.window_end is None:
            return columns
        columns["nvml_timed_samples"] = sampler.timed_samples
        for key, bounds in (("sm_clock_mhz", sampler.sm_clock_mhz), ("mem_clock_mhz", sampler.mem_clock_mhz)):
            if bounds is not None:
                columns[f"{key}_min"], columns[f"{key}_max"] = bounds
        columns["throttle_reasons"] = sampler.throttle_reasons
        (start_s, start_mj), (end_s, end_mj) = sampler.window_start, sampler.window_end
        if start_mj is not None and end_mj is not None:
            energy_j = (end_mj - start_mj) / 1e3
            if self.timed_tokens > 0:
                columns["energy_j_per_token"] = energy_j / self.timed_tokens
            if end_s > start_s:
                columns["mean_power_w"] = energy_j / (end_s - start_s)
        return columns

    def columns(self) -> dict:
        if self.device.type != "cuda":
            return {
                "peak_mem_bytes": peak_rss_bytes(),
                "peak_mem_source": "rss",
                "mem_baseline_bytes": self.baseline_bytes,
                "torch_peak_allocated_bytes": None,
                "torch_peak_reserved_bytes": None,
                "nvml_peak_used_bytes": None,
                "nvml_process_peak_bytes": None,
                "nvml_error": None,
            }
        sampler = self.sampler
        reserved = self.cuda.max_memory_reserved(self.device)
        process = sampler.peak_process_bytes if sampler else None
        source = self.peak_mem_source
        if source == "nvml_process" and process is None:  # listed at the baseline, never sampled since
            log.warning(
                "NVML's view of this process was lost after the baseline: peak_mem_bytes is torch's reserved peak"
            )
            source = "torch_reserved"
        return {
            "peak_mem_bytes": process if source == "nvml_process" else reserved,
            "peak_mem_source": source,
            "mem_baseline_bytes": self.baseline_bytes,
            "torch_peak_allocated_bytes": self.cuda.max_memory_allocated(self.device),
            "torch_peak_reserved_bytes": reserved,
            "nvml_peak_used_bytes": sampler.peak_used_bytes if sampler else None,
            "nvml_process_peak_bytes": process,
            "nvml_error": self.nvml_error or (sampler.error if sampler else None),
        }
