"""A sweep's own process (a SLURM job's, or the basic launcher's) validates each point and writes its environment
columns before the point's worker starts, and never initialises CUDA meanwhile: on a GPU node that would cost the
job host memory (the driver's, the runtime's) and a context on the device, in a process that computes nothing there
(harness.measure.nvml._uninitialised_handle). Here a GPU is pretended: torch.cuda says one is present, NVML is a fake that
names it, and CUDA's initialisation raises."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.decode import CONF_DIR
from harness.config import RunConfig
from harness.run import runner


class NamingNvml:
    """The NVML calls device_name and device_capability make, for one H200."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        assert index == 3  # torch's cuda:0 is NVML's GPU 3 under CUDA_VISIBLE_DEVICES=3 (SLURM's gres)
        return "gpu3"

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H200"

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return 9, 0


@pytest.fixture
def pretend_gpu(monkeypatch):
    def no_cuda_here():
        raise AssertionError("CUDA was initialised in the sweep's own process")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda_here)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda device: 3)
    monkeypatch.setattr("harness.measure.nvml.load_nvml", NamingNvml)


def test_validating_a_cuda_point_and_its_environment_columns_initialise_no_cuda(pretend_gpu):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["model=tiny", "device=cuda", "dtype=bf16", "kv_dtype=fp8_e4m3"])
    run_cfg = RunConfig(**OmegaConf.to_container(cfg, resolve=True))  # fp8 checked against sm_90, from NVML
    columns = runner.point_columns(run_cfg)
    assert columns["device_name"] == "NVIDIA H200"
    assert not torch.cuda.is_initialized()
