"""The CUDA probes on a CPU (harness.measure.probes, nvml), with tests/measure/test_probes.py's fakes: an NVML error
costs a column, never the point or the sampler thread; where peak_mem_bytes comes from; max_memory_gb on CUDA caps
the whole process."""

from __future__ import annotations

import logging
import os
import threading
import types

import pytest
import torch

from harness.config import RunConfig
from harness.measure import probes
from harness.measure.nvml import NvmlSampler
from harness.measure.probes import MemoryProbe
from harness.run import runner
from tests.measure.test_probes import (
    CUDA0,
    FakeCuda,
    GiB,
    NVMLError_NoPermission,
    NVMLError_Unknown,
    NVMLLibraryMismatchError,
    probe_on,
)

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
