"""NVML, the NVIDIA driver's management library: the GPU torch runs on, found by UUID or PCI bus id, and a thread
that samples its memory, this process's share of it, and, inside the timed window, its clocks, throttle reasons and
energy counter.

pynvml comes from load_nvml() alone, the seam where a test hands in a fake module (harness.measure.probes and
harness.measure.environment look it up here, as nvml.load_nvml, so that patching this module reaches them); CPU-only runs
never import it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


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


def _uninitialised_handle(device):
    """NVML's handle of a CUDA device while this process has not initialised CUDA, else None (then torch answers).

    A sweep's own process (a SLURM job's, or the basic launcher's) validates each point and writes its environment
    columns before the point's worker starts: torch.cuda.get_device_name / get_device_capability would initialise
    CUDA there (the driver's and runtime's host memory, a context), in a process that never computes on the GPU, and
    a SLURM job counts that memory against the point's limit. NVML answers without it; torch's
    _get_nvml_device_index maps torch's index to NVML's through CUDA_VISIBLE_DEVICES (indices or UUIDs). Once this
    process has initialised CUDA (the worker), or where NVML cannot answer, torch's own answer."""
    import torch

    if torch.cuda.is_initialized():
        return None, None
    try:
        nvml = load_nvml()
        nvml.nvmlInit()
        return nvml, nvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
    except (ImportError, RuntimeError, *_nvml_errors_or_none()) as exc:
        log.info("NVML cannot name the device (%s): torch's answer, which initialises CUDA", describe(exc))
        return None, None


def _nvml_errors_or_none() -> tuple[type[BaseException], ...]:
    try:
        return nvml_errors(load_nvml())
    except ImportError:
        return ()


def device_name(device) -> str:
    """A CUDA device's name ("NVIDIA H200"), initialising no CUDA where NVML answers (_uninitialised_handle)."""
    import torch

    nvml, handle = _uninitialised_handle(device)
    if handle is None:
        return torch.cuda.get_device_name(device)
    name = nvml.nvmlDeviceGetName(handle)
    return name.decode() if isinstance(name, bytes) else name


def device_capability(device) -> tuple[int, int]:
    """A CUDA device's compute capability ((9, 0) for Hopper), initialising no CUDA where NVML answers."""
    import torch

    nvml, handle = _uninitialised_handle(device)
    if handle is None:
        return torch.cuda.get_device_capability(device)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    return int(major), int(minor)


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


def _widen(bounds: tuple[int, int] | None, value: int | None) -> tuple[int, int] | None:
    """(min, max) so far, widened by one reading (None: a failed read, which leaves them as they were)."""
    if value is None:
        return bounds
    value = int(value)
    return (value, value) if bounds is None else (min(bounds[0], value), max(bounds[1], value))
