"""Where and with what a point ran: the host, the device, the software and the harness's own commit.

Every row carries these columns (harness.store.schema), so that two rows' environments can be told apart
(`results diff`). Each figure that cannot change under a running process is read once (functools.cache).
"""

from __future__ import annotations

import datetime as dt
import functools
import importlib.metadata
import platform
import socket
import subprocess
from pathlib import Path

import torch

from harness.measure import nvml
from harness.run import slurm
from harness.store.schema import SCHEMA_VERSION


def environment_columns(device: torch.device) -> dict:
    """Where and with what the point ran: enough to tell two rows' environments apart (results diff)."""
    cuda = device.type == "cuda"
    return {
        "git_sha": git_sha(),
        "git_dirty": git_dirty(),
        "host": socket.gethostname(),
        "slurm_job_id": slurm.job_id(),
        "cpu_model": cpu_model(),
        "cpu_capability": cpu_capability(),
        "device_name": device_name(device),
        "device_count": torch.cuda.device_count() if cuda else 1,
        "driver_version": nvidia_driver_version() if cuda else None,
        "cuda_version": torch.version.cuda if cuda else None,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "kvbench_version": kvbench_version(),
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "schema_version": SCHEMA_VERSION,
    }


def device_name(device: torch.device) -> str:
    """The marketing name: torch's for CUDA ("NVIDIA H200"), the CPU's model name otherwise."""
    if device.type == "cuda":
        return nvml.device_name(device)  # not torch's: the sweep's own process keeps CUDA uninitialised
    return cpu_model()


@functools.cache
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_capability() -> str:
    """The widest vector ISA torch's CPU kernels dispatch to here: "DEFAULT", "AVX2", "AVX512" (ATen's
    CPU_CAPABILITY). Machines sold under one model name ("AMD EPYC" in a VM) differ in it, and the CPU figures with
    it: bf16 matmuls without AVX512-BF16 run about a hundred times slower (0.0014 against 0.42 TFLOP/s, measured)."""
    return torch.backends.cpu.get_cpu_capability()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:  # not a git checkout (an installed copy, a tarball)
        return None
    return out.stdout


@functools.cache
def git_sha() -> str | None:
    out = _git("rev-parse", "HEAD")
    return out.strip() or None if out is not None else None


@functools.cache
def git_dirty() -> bool | None:
    """Uncommitted changes to tracked files (untracked files, such as results, do not count)."""
    # --no-optional-locks: status must not take index.lock to refresh the index, or a commit made meanwhile fails.
    out = _git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no")
    return None if out is None else bool(out.strip())


@functools.cache
def kvbench_version() -> str | None:
    try:
        return importlib.metadata.version("kvbench")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def nvidia_driver_version() -> str | None:
    """The NVIDIA driver's version through NVML (nvml.load_nvml), or None without it: cached, since the driver
    cannot change under a running process."""
    try:
        pynvml = nvml.load_nvml()  # the seam where tests hand in a fake pynvml
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver access: the column stays null
        return None
    return version.decode() if isinstance(version, bytes) else version
