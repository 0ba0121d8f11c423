"""The CUDA probes on a CPU: a fake pynvml (the few functions harness.measure.nvml calls) and a fake torch.cuda stand in.

What they check is NVML's part of a row: which GPU is watched, which window the energy and clocks cover, where
peak_mem_bytes comes from, and that an NVML error costs a column, never the point or the sampler thread.
"""

from __future__ import annotations

import logging
import os
import threading
import types
from dataclasses import dataclass, field

import pytest
import torch

from harness.config import RunConfig
from harness.measure import probes
from harness.measure.nvml import NvmlSampler
from harness.measure.probes import MemoryProbe
from harness.measure.timing import RepeatPolicy, Sample, measure
from harness.run import runner

CUDA0 = torch.device("cuda", 0)
GiB = 2**30
NEVER_S = 3600.0  # a sampler interval no test lives to see: only the samples a test takes itself happen
IDLE_SM_MHZ, IDLE_MEM_MHZ, GPU_IDLE = 345, 1593, 0x1  # what a GPU reads right after a synchronize (H200-like)


# --- the fakes ------------------------------------------------------------------------------------------------------


class NVMLError(Exception):  # as nvidia-ml-py's: a base class with one subclass per error code
    pass


class NVMLError_NotFound(NVMLError):  # noqa: N801 (nvidia-ml-py's names)
    pass


class NVMLError_Unknown(NVMLError):  # noqa: N801
    pass


class NVMLError_NoPermission(NVMLError):  # noqa: N801
    pass


class NVMLLibraryMismatchError(Exception):  # nvidia-ml-py derives it from Exception, not from NVMLError
    pass


@dataclass
class FakeGpu:
    uuid: str  # as NVML spells it: "GPU-..."
    pci: tuple[int, int, int]  # domain, bus, device
    used_bytes: int = 1 * GiB
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, usedGpuMemory)
    energy_mj: int = 0
    sm_mhz: int = IDLE_SM_MHZ
    mem_mhz: int = IDLE_MEM_MHZ
    reasons: int = GPU_IDLE


class FakeNvml:
    """The pynvml functions harness.measure.nvml calls, over a machine of `n_gpus` GPUs. `faults[name]` is a queue, one entry per
    call of that function: an exception to raise, or None to answer; an empty queue answers."""

    NVMLError = NVMLError
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2  # nvidia-ml-py's values

    def __init__(self, n_gpus: int = 1) -> None:
        self.gpus = [
            FakeGpu(uuid=f"GPU-{i:08x}-1111-2222-3333-444444444444", pci=(0, 0x1B + i, 0)) for i in range(n_gpus)
        ]
        self.faults: dict[str, list[BaseException | None]] = {}
        self.calls: dict[str, int] = {}
        self.on_call = None  # called with each function's name, after it answers

    def _enter(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        queue = self.faults.get(name)
        if queue:
            fault = queue.pop(0)
            if fault is not None:
                raise fault

    def _answer(self, name: str, value):
        if self.on_call is not None:
            self.on_call(name)
        return value

    def nvmlInit(self):
        self._enter("nvmlInit")

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex")
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self._enter("nvmlDeviceGetHandleByUUID")
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise NVMLError_NotFound("Not Found")

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        self._enter("nvmlDeviceGetHandleByPciBusId")
        domain, bus, rest = bus_id.split(":")
        wanted = (int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16))
        for gpu in self.gpus:
            if gpu.pci == wanted:
                return gpu
        raise NVMLError_NotFound("Not Found")

    def nvmlDeviceGetMemoryInfo(self, gpu):
        self._enter("nvmlDeviceGetMemoryInfo")
        return self._answer("nvmlDeviceGetMemoryInfo", types.SimpleNamespace(used=gpu.used_bytes))

    def nvmlDeviceGetComputeRunningProcesses(self, gpu):
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in gpu.processes]

    def nvmlDeviceGetTotalEnergyConsumption(self, gpu):
        self._enter("nvmlDeviceGetTotalEnergyConsumption")
        return gpu.energy_mj

    def nvmlDeviceGetClockInfo(self, gpu, kind):
        self._enter("nvmlDeviceGetClockInfo")
        return self._answer("nvmlDeviceGetClockInfo", gpu.sm_mhz if kind == self.NVML_CLOCK_SM else gpu.mem_mhz)

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu):
        self._enter("nvmlDeviceGetCurrentClocksEventReasons")
        return gpu.reasons


class FakeCuda:
    """The torch.cuda functions MemoryProbe calls; torch's device 0 is the machine's GPU `physical`."""

    def __init__(self, nvml: FakeNvml, physical: int = 0, *, uuid: str | None = None, pci: bool = True) -> None:
        gpu = nvml.gpus[physical]
        self.properties = types.SimpleNamespace(
            uuid=gpu.uuid.removeprefix("GPU-") if uuid is None else uuid,  # torch prints it without NVML's prefix
            total_memory=80 * GiB,
        )
        if pci:
            self.properties.pci_domain_id, self.properties.pci_bus_id, self.properties.pci_device_id = gpu.pci
        self.synchronized = 0
        self.reserved_peak_bytes = 3 * GiB

    def synchronize(self, device):
        self.synchronized += 1

    def get_device_properties(self, device):
        return self.properties

    def reset_peak_memory_stats(self, device):
        pass

    def max_memory_allocated(self, device):
        return 2 * GiB

    def max_memory_reserved(self, device):
        return self.reserved_peak_bytes

    def mem_get_info(self, device):
        return 60 * GiB, 80 * GiB  # (free, total)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def nvml(monkeypatch) -> FakeNvml:
    fake = FakeNvml()
    fake.gpus[0].processes = [(os.getpid(), 5 * GiB)]
    monkeypatch.setattr("harness.measure.nvml.load_nvml", lambda: fake)
    return fake


def probe_on(nvml: FakeNvml, physical: int = 0, **kwargs) -> MemoryProbe:
    return MemoryProbe(CUDA0, cuda=FakeCuda(nvml, physical), nvml_interval_s=NEVER_S, **kwargs)


# --- which GPU ------------------------------------------------------------------------------------------------------


def test_nvml_watches_the_gpu_torch_runs_on_by_uuid_not_by_index(monkeypatch):
    fake = FakeNvml(n_gpus=4)
    monkeypatch.setattr("harness.measure.nvml.load_nvml", lambda: fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # SLURM's doing: torch's cuda:0 is the machine's GPU 3
    fake.gpus[3].used_bytes = 7 * GiB
    probe = probe_on(fake, physical=3)
    probe.baseline()
    assert probe.sampler.handle is fake.gpus[3]
    assert probe.baseline_bytes == 7 * GiB
    assert fake.calls.get("nvmlDeviceGetHandleByIndex", 0) == 0


def test_where_the_uuid_finds_no_gpu_the_pci_bus_id_does():
    fake = FakeNvml(n_gpus=2)
    cuda = FakeCuda(fake, physical=1, uuid="00000000-0000-0000-0000-000000000000")  # a UUID NVML does not know
    sampler = NvmlSampler(cuda.properties, nvml=fake)
    assert sampler.handle is fake.gpus[1]


def test_no_uuid_match_and_no_pci_id_is_an_error_naming_both_tries():
    fake = FakeNvml(n_gpus=2)
    cuda = FakeCuda(fake, uuid="00000000-0000-0000-0000-000000000000", pci=False)
    with pytest.raises(LookupError, match="by UUID GPU-00000000"):
        NvmlSampler(cuda.properties, nvml=fake)
    assert fake.calls["nvmlShutdown"] == 1  # the init that succeeded is undone


# --- the timed window -----------------------------------------------------------------------------------------------


def test_clocks_are_sampled_only_inside_the_timed_window_their_min_max_and_the_or_of_reasons(nvml):
    gpu = nvml.gpus[0]
    probe = probe_on(nvml)
    probe.baseline()
    with probe:  # the sample on entering reads the idle GPU: outside the window, it must not count
        probe.sampler.sample()
        probe.begin_timed()
        for sm_mhz, mem_mhz, reasons in ((1980, 2619, 0x0), (1755, 2619, 0x4), (1830, 2619, 0x20)):
            gpu.sm_mhz, gpu.mem_mhz, gpu.reasons = sm_mhz, mem_mhz, reasons
            probe.sampler.sample()
        probe.end_timed(n_tokens=12)
        gpu.sm_mhz, gpu.mem_mhz, gpu.reasons = IDLE_SM_MHZ, IDLE_MEM_MHZ, GPU_IDLE
        probe.sampler.sample()
    columns = probe.validity_columns()
    assert (columns["sm_clock_mhz_min"], columns["sm_clock_mhz_max"]) == (1755, 1980)
    assert (columns["mem_clock_mhz_min"], columns["mem_clock_mhz_max"]) == (2619, 2619)
    assert columns["throttle_reasons"] == 0x4 | 0x20
    assert columns["nvml_timed_samples"] == 3


def test_a_window_too_short_for_a_sample_leaves_the_clocks_null_and_says_zero_samples(nvml):
    probe = probe_on(nvml)
    probe.baseline()
    with probe:
        probe.begin_timed()
        probe.end_timed(n_tokens=4)
    columns = probe.validity_columns()
    assert columns["nvml_timed_samples"] == 0
    assert columns["sm_clock_mhz_min"] is None and columns["throttle_reasons"] is None


def test_energy_and_power_cover_the_measured_generations_alone(nvml):
    gpu, clock = nvml.gpus[0], FakeClock()
    probe = probe_on(nvml, clock=clock)
    batch_size, gen_len = 2, 3

    def run_once() -> Sample:  # one generation: 5 J in 0.5 s
        gpu.energy_mj += 5000
        clock.now_s += 0.5
        return Sample(ttft_ms=1.0, step_ms=[1.0] * (gen_len - 1))

    probe.baseline()
    with probe:
        gpu.energy_mj += 40_000  # loading the model, compiling: before the window too
        policy = RepeatPolicy(warmup=2, min_repeats=3, max_repeats=3, max_time_s=1e9)
        samples = measure(run_once, policy, on_measure_start=probe.begin_timed)
        probe.end_timed(n_tokens=len(samples) * batch_size * gen_len)
    columns = probe.validity_columns()
    assert columns["energy_j_per_token"] == pytest.approx(3 * 5.0 / (3 * batch_size * gen_len))
    assert columns["mean_power_w"] == pytest.approx(3 * 5.0 / (3 * 0.5))


def test_the_window_opens_and_closes_on_a_synchronized_device(nvml):
    probe = probe_on(nvml)
    probe.baseline()
    with probe:
        before = probe.cuda.synchronized
        probe.begin_timed()  # the warm-up's queued work must not land inside the window
        assert probe.cuda.synchronized == before + 1
        probe.end_timed(n_tokens=1)  # nor the timed work outside it
        assert probe.cuda.synchronized == before + 2


# --- NVML errors ----------------------------------------------------------------------------------------------------


def test_the_sampler_thread_survives_an_nvml_error_records_the_first_and_logs_it_once(nvml, caplog):
    # Memory queries: one by the baseline's thread-less sampler below, one on entering; the thread's first fails.
    nvml.faults["nvmlDeviceGetMemoryInfo"] = [
        None,
        None,
        NVMLError_Unknown("Unknown Error"),
        None,
        NVMLError_Unknown("again"),
    ]
    enough = threading.Event()
    nvml.on_call = lambda name: nvml.calls["nvmlDeviceGetMemoryInfo"] >= 8 and enough.set()
    sampler = NvmlSampler(FakeCuda(nvml).properties, nvml=nvml, interval_s=0.001)
    assert sampler.used_bytes() == nvml.gpus[0].used_bytes
    with caplog.at_level(logging.WARNING, logger="harness.measure.nvml"), sampler:
        assert enough.wait(timeout=60), "the sampler thread stopped sampling after the NVML error"
    assert sampler.error == "nvmlDeviceGetMemoryInfo: NVMLError_Unknown: Unknown Error"
    assert sum("nvmlDeviceGetMemoryInfo" in record.getMessage() for record in caplog.records) == 1
    assert sampler.peak_used_bytes == nvml.gpus[0].used_bytes


def test_a_query_that_always_fails_leaves_the_others_sampling_and_names_itself(nvml):
    nvml.faults["nvmlDeviceGetComputeRunningProcesses"] = [NVMLError_NoPermission("Insufficient Permissions")] * 100
    probe = probe_on(nvml)
    probe.baseline()
    with probe:
        probe.begin_timed()
        nvml.gpus[0].sm_mhz, nvml.gpus[0].reasons = 1980, 0
        probe.sampler.sample()
        probe.end_timed(n_tokens=1)
    columns = probe.columns() | probe.validity_columns()
    assert columns["nvml_error"].startswith("nvmlDeviceGetComputeRunningProcesses: NVMLError_NoPermission")
    assert columns["nvml_peak_used_bytes"] == nvml.gpus[0].used_bytes and columns["sm_clock_mhz_max"] == 1980
    assert columns["peak_mem_source"] == "torch_reserved" and columns["nvml_process_peak_bytes"] is None


def test_a_library_mismatch_from_the_process_query_costs_the_point_nothing_but_that_figure(nvml):
    # nvidia-ml-py's unversioned nvmlDeviceGetComputeRunningProcesses raises it when the driver's NVML is older
    nvml.faults["nvmlDeviceGetComputeRunningProcesses"] = [NVMLLibraryMismatchError("use a versioned function")] * 100
    probe = probe_on(nvml)
    probe.baseline()
    with probe:
        probe.begin_timed()
        probe.end_timed(n_tokens=1)
    columns = probe.columns()
    assert "NVMLLibraryMismatchError" in columns["nvml_error"]
    assert columns["peak_mem_source"] == "torch_reserved" and columns["peak_mem_bytes"] == 3 * GiB


def test_a_library_mismatch_at_init_leaves_the_nvml_columns_null_and_says_why(nvml):
    nvml.faults["nvmlInit"] = [NVMLLibraryMismatchError("pyNVML version does not match the NVML lib version")]
    probe = probe_on(nvml)
    probe.baseline()
    with probe:
        probe.begin_timed()
        probe.end_timed(n_tokens=1)
    columns = probe.columns()
    assert columns["nvml_error"].startswith("NVML unavailable: NVMLLibraryMismatchError")
    assert columns["nvml_peak_used_bytes"] is None and columns["mem_baseline_bytes"] is None
    assert columns["peak_mem_source"] == "torch_reserved" and columns["peak_mem_bytes"] == 3 * GiB
    assert all(value is None for value in probe.validity_columns().values())


# --- where peak_mem_bytes comes from --------------------------------------------------------------------------------


def test_peak_mem_bytes_is_nvml_s_view_of_this_process_where_nvml_lists_its_pid(nvml):
    probe = probe_on(nvml)
    probe.baseline()
    with probe:
        nvml.gpus[0].processes = [(os.getpid(), 9 * GiB), (4242, 20 * GiB)]  # another process's memory is not ours
        probe.sampler.sample()
        nvml.gpus[0].processes = [(os.getpid(), 6 * GiB)]
    columns = probe.columns()
    assert columns["peak_mem_source"] == "nvml_process"
    assert columns["peak_mem_bytes"] == columns["nvml_process_peak_bytes"] == 9 * GiB
    assert columns["nvml_error"] is None


def test_in_a_pid_namespace_peak_mem_bytes_is_the_reserved_peak_and_a_warning_says_why(nvml, caplog):
    nvml.gpus[0].processes = [(4242, 5 * GiB)]  # the host's PID of this very process: it does not match os.getpid()
    probe = probe_on(nvml)
    with caplog.at_level(logging.WARNING, logger="harness.measure.probes"):
        probe.baseline()
    with probe:
        pass
    columns = probe.columns()
    assert columns["peak_mem_source"] == "torch_reserved" and columns["peak_mem_bytes"] == 3 * GiB
    assert any("PID namespace" in record.getMessage() for record in caplog.records)
    assert columns["nvml_error"] is None  # an unlisted PID is a fact of the host, not an NVML failure


def test_on_the_cpu_peak_mem_source_is_rss_and_the_nvml_columns_are_null():
    probe = MemoryProbe(torch.device("cpu"))
    probe.baseline()
    with probe:
        probe.begin_timed()
        probe.end_timed(n_tokens=1)
    columns = probe.columns()
    assert columns["peak_mem_source"] == "rss" and columns["peak_mem_bytes"] > 0
    assert columns["nvml_error"] is None and columns["nvml_process_peak_bytes"] is None
    assert all(value is None for value in probe.validity_columns().values())


# --- max_memory_gb on CUDA caps the whole process -------------------------------------------------------------------


def test_the_bytes_held_are_nvml_s_view_of_this_process(nvml):
    assert probes.cuda_bytes_held(CUDA0, cuda=FakeCuda(nvml)) == (5 * GiB, "nvml_process")


def test_where_nvml_does_not_list_this_process_the_bytes_held_are_all_in_use_on_the_device(nvml):
    nvml.gpus[0].processes = [(4242, 5 * GiB)]
    assert probes.cuda_bytes_held(CUDA0, cuda=FakeCuda(nvml)) == (80 * GiB - 60 * GiB, "device_used")


@pytest.mark.parametrize(
    ("held_gib", "reserved_gib", "allocator_gib"),
    [
        (0.5, 0.0, 1.5),  # a fresh worker: the context alone, outside the allocator
        (1.5, 1.0, 1.5),  # a warm one: of what it holds, what the allocator reserves is inside the cap already
        (3.0, 0.0, 0.0),  # the context alone is over the cap: every allocation fails, an oom row
    ],
)
def test_max_memory_gb_on_cuda_caps_the_process_not_just_the_allocator(
    monkeypatch, held_gib, reserved_gib, allocator_gib
):
    fractions = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device: types.SimpleNamespace(total_memory=80 * GiB, major=9, minor=0),
    )
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: int(reserved_gib * GiB))
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda fraction, device: fractions.append(fraction)
    )
    monkeypatch.setattr(probes, "cuda_bytes_held", lambda device: (int(held_gib * GiB), "nvml_process"))
    runner.limit_memory(RunConfig(model={"name": "tiny"}, device="cuda", max_memory_gb=2))
    assert fractions == [pytest.approx(allocator_gib / 80)]
    assert isinstance(fractions[0], float)  # torch.cuda.set_per_process_memory_fraction rejects an int
