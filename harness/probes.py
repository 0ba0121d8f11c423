"""Memory probes: the torch allocator's peaks, NVML device and process usage sampled by a thread, and RSS; on CUDA
also the energy, clocks and throttle reasons of the timed generations, through NVML.

A probe that cannot apply on this device reports None (a null column), never 0. Two seams keep all of it testable
on a CPU: NVML comes from load_nvml() and every torch.cuda call goes through MemoryProbe's `cuda` argument, so a test
hands in a fake pynvml and a fake torch.cuda.
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
from collections.abc import Callable

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


# Seconds between NVML samples: 100 Hz gives a decode generation of tens of milliseconds a few clock samples,
# while the thread stays asleep nearly all the time.
NVML_INTERVAL_S = 0.01


def load_nvml():
    """nvidia-ml-py's pynvml, imported only here (CPU-only runs never need a driver): the seam where tests put a
    fake module."""
    import pynvml

    return pynvml


def nvml_errors(nvml) -> tuple[type[BaseException], ...]:
    """What an NVML call raises: NVMLError (and its subclass per error code), and NVMLLibraryMismatchError, which
    nvidia-ml-py derives from Exception, not from NVMLError; its unversioned process queries raise it when the
    driver's library lacks the function the bindings expect."""
    return (nvml.NVMLError, getattr(nvml, "NVMLLibraryMismatchError", nvml.NVMLError))


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def nvml_uuid(properties) -> str | None:
    """The UUID of torch's device as NVML spells it: torch prints it bare ("58f2e7a4-1c2b-..."), NVML prefixed
    ("GPU-58f2e7a4-1c2b-..."). None where torch's properties carry no UUID."""
    uuid = getattr(properties, "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def nvml_pci_bus_id(properties) -> str | None:
    """The PCI address of torch's device as nvmlDeviceGetHandleByPciBusId reads it, "domain:bus:device.function"
    in hex ("00000000:1b:00.0"); None where this torch's properties lack pci_domain_id, pci_bus_id or pci_device_id."""
    parts = [getattr(properties, f"pci_{name}_id", None) for name in ("domain", "bus", "device")]
    if any(part is None for part in parts):
        return None
    domain, bus, device = parts
    return f"{domain:08x}:{bus:02x}:{device:02x}.0"


def device_handle(nvml, properties):
    """The NVML handle of the GPU torch runs on: by UUID, else by PCI bus id, never by index. NVML numbers every GPU
    of the machine; torch numbers only those CUDA_VISIBLE_DEVICES lets it see (SLURM sets it), so torch's cuda:0
    may well be NVML's GPU 3."""
    tried = []
    uuid = nvml_uuid(properties)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        except nvml_errors(nvml) as exc:
            tried.append(f"by UUID {uuid}: {describe(exc)}")
    bus_id = nvml_pci_bus_id(properties)
    if bus_id is not None:
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        except nvml_errors(nvml) as exc:
            tried.append(f"by PCI bus id {bus_id}: {describe(exc)}")
    raise LookupError(
        "NVML finds no GPU matching torch's device ("
        + ("; ".join(tried) or "torch's device properties carry neither a UUID nor a PCI bus id")
        + ")"
    )


class NvmlSampler:
    """One GPU through NVML, sampled on a background thread every `interval_s`: device-used and this process's
    memory for the whole point; SM and memory clocks and throttle reasons only while the timed window is open
    (open_window() to close_window()), whose two ends also read the energy counter.

    NVML sees what the torch allocator cannot: the CUDA context, cuBLAS workspaces, other processes. An NVML error
    never ends the sampling: the query that failed is skipped for that sample, the rest go on, and the first error
    is kept in `error` and logged once.
    """

    def __init__(
        self,
        properties,
        *,
        nvml,
        interval_s: float = NVML_INTERVAL_S,
        clock: Callable[[], float] = time.perf_counter,
        pid: int | None = None,
    ) -> None:
        self.nvml = nvml
        self.errors = nvml_errors(nvml)
        nvml.nvmlInit()
        try:
            self.handle = device_handle(nvml, properties)
        except Exception:
            nvml.nvmlShutdown()
            raise
        self.interval_s = interval_s
        self.clock = clock
        self.pid = os.getpid() if pid is None else pid
        self.error: str | None = None
        self.peak_used_bytes: int | None = None
        self.peak_process_bytes: int | None = None
        # The timed window: (seconds, millijoules or None) at each end, and what the samples inside it read.
        self.window_open = False
        self.window_start: tuple[float, int | None] | None = None
        self.window_end: tuple[float, int | None] | None = None
        self.timed_samples = 0
        self.sm_clock_mhz: tuple[int, int] | None = None  # (min, max)
        self.mem_clock_mhz: tuple[int, int] | None = None
        self.throttle_reasons: int | None = None  # OR of every bitmask read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)

    def _call(self, fn: Callable, *args: object):
        """fn(*args), or None when NVML raises (the first error is recorded)."""
        try:
            return fn(*args)
        except self.errors as exc:
            self._record(getattr(fn, "__name__", "NVML"), exc)
            return None

    def _record(self, what: str, exc: BaseException) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = f"{what}: {describe(exc)}"
        log.warning("NVML: %s failed (%s); sampling goes on without it", what, describe(exc))

    def used_bytes(self) -> int | None:
        info = self._call(self.nvml.nvmlDeviceGetMemoryInfo, self.handle)
        return None if info is None else int(info.used)

    def process_view(self) -> tuple[int | None, str | None]:
        """(this process's device memory as NVML lists it, None) or (None, why NVML shows no figure for it)."""
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except self.errors as exc:  # not permitted in some containers; NVMLLibraryMismatchError with an old driver
            self._record("nvmlDeviceGetComputeRunningProcesses", exc)
            return None, f"NVML's process query failed ({describe(exc)})"
        mine = [p for p in procs if p.pid == self.pid]
        if not mine:
            return None, (
                f"NVML lists no process with this PID ({self.pid}) on the device: NVML reports the host's PIDs, so a "
                "process in a PID namespace (a container) does not match"
            )
        used = [p.usedGpuMemory for p in mine if p.usedGpuMemory is not None]
        if not used:
            return None, "NVML lists this process but not its memory (usedGpuMemory is not available)"
        return int(sum(used)), None

    def energy_mj(self) -> int | None:
        """Millijoules since the driver loaded (Volta and newer)."""
        energy = self._call(self.nvml.nvmlDeviceGetTotalEnergyConsumption, self.handle)
        return None if energy is None else int(energy)

    def _reasons(self) -> int | None:
        nvml = self.nvml
        query = (
            getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons  # its name before nvidia-ml-py 12.535
        )
        reasons = self._call(query, self.handle)
        return None if reasons is None else int(reasons)

    def sample(self) -> None:
        """One sample: memory always; clocks and throttle reasons when the timed window is open."""
        used = self.used_bytes()
        process, _ = self.process_view()
        timed = self.window_open
        if timed:
            nvml = self.nvml
            sm = self._call(nvml.nvmlDeviceGetClockInfo, self.handle, nvml.NVML_CLOCK_SM)
            mem = self._call(nvml.nvmlDeviceGetClockInfo, self.handle, nvml.NVML_CLOCK_MEM)
            reasons = self._reasons()
        with self._lock:
            if used is not None:
                self.peak_used_bytes = max(self.peak_used_bytes or 0, used)
            if process is not None:
                self.peak_process_bytes = max(self.peak_process_bytes or 0, process)
            if not timed:
                return
            self.timed_samples += 1
            self.sm_clock_mhz = _widen(self.sm_clock_mhz, sm)
            self.mem_clock_mhz = _widen(self.mem_clock_mhz, mem)
            if reasons is not None:
                self.throttle_reasons = (self.throttle_reasons or 0) | reasons

    def open_window(self) -> None:
        """The timed generations start now: read the clock and the energy counter, and let samples read clocks."""
        start = (self.clock(), self.energy_mj())
        with self._lock:
            self.window_start, self.window_end = start, None
            self.timed_samples = 0
            self.sm_clock_mhz = self.mem_clock_mhz = self.throttle_reasons = None
            self.window_open = True

    def close_window(self) -> None:
        """The timed generations are over: no more clock samples; read the clock and the energy counter."""
        with self._lock:
            self.window_open = False
        self.window_end = (self.clock(), self.energy_mj())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as exc:  # not NVML's (sample() handles those): still no silent end of the thread
                self._record("sampler", exc)

    def __enter__(self) -> NvmlSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        self.close()

    def close(self) -> None:
        self._call(self.nvml.nvmlShutdown)


def cuda_bytes_held(device: torch.device, *, cuda=torch.cuda) -> tuple[int, str]:
    """What this process holds on the device now, CUDA context included, and by whose count: NVML's view of this
    process ("nvml_process"), or where NVML cannot see it, all memory in use on the device as cudaMemGetInfo reports
    it ("device_used": other processes count too, so a cap based on it errs on the small side)."""
    cuda.synchronize(device)  # the CUDA context exists from here on
    try:
        sampler = NvmlSampler(cuda.get_device_properties(device), nvml=load_nvml())
    except Exception as exc:  # no NVML library, no driver access, no matching GPU
        why_not = f"NVML unavailable ({describe(exc)})"
    else:
        process, why_not = sampler.process_view()
        sampler.close()
        if process is not None:
            return process, "nvml_process"
    free_bytes, total_bytes = cuda.mem_get_info(device)
    log.warning("this process's device memory: %s; counting all memory in use on the device instead", why_not)
    return total_bytes - free_bytes, "device_used"


def _widen(bounds: tuple[int, int] | None, value: int | None) -> tuple[int, int] | None:
    """(min, max) so far, widened by one reading (None: a failed read, which leaves them as they were)."""
    if value is None:
        return bounds
    value = int(value)
    return (value, value) if bounds is None else (min(bounds[0], value), max(bounds[1], value))


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
        nvml_interval_s: float = NVML_INTERVAL_S,
    ) -> None:
        self.device = device
        self.cuda = cuda
        self.clock = clock
        self.nvml_interval_s = nvml_interval_s
        self.sampler: NvmlSampler | None = None
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
            self.sampler = NvmlSampler(
                self.cuda.get_device_properties(self.device),
                nvml=load_nvml(),
                interval_s=self.nvml_interval_s,
                clock=self.clock,
            )
        except Exception as exc:  # no NVML library, no driver access (some containers), no matching GPU
            self.nvml_error = f"NVML unavailable: {describe(exc)}"
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
