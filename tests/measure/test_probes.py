"""The CUDA probes on a CPU (harness.measure.probes, nvml): which GPU NVML watches and which window the energy and
clocks cover, with a fake pynvml (the few functions harness.measure.nvml calls) and a fake torch.cuda standing in.

The fakes live here; tests/measure/test_probes_errors.py uses them, and the folder's conftest.py holds the nvml
fixture that installs the fake pynvml.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import pytest
import torch

from harness.measure.nvml import NvmlSampler
from harness.measure.probes import MemoryProbe
from harness.measure.timing import RepeatPolicy, Sample, measure

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
