"""What a process holds before the model loads, and how much memory the device has: measured where it can be.

CPU: the private writable memory (VmData, what RLIMIT_DATA caps) of a spawned child that has imported what a
measuring child imports, generated with the tiny model and run one GEMM of the model's width (thread pools,
kernels, BLAS buffers). CUDA: what the device holds outside this process's allocator (the context, library
workspaces, other processes), measured when a device is present, else CUDA_RUNTIME_DEFAULT_BYTES, an assumption.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing as mp
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from harness.config import DTYPES
from harness.errors import ConfigError
from harness.formats import EXACT_REFERENCE
from harness.modeling.model_args import ModelArgs

if TYPE_CHECKING:
    from harness.config import Workload

GiB = 2**30
# CUDA context plus cuBLAS/cuDNN workspaces when no device is here to measure them: an assumption, not a figure
# measured here (the context alone is some hundreds of MiB, more without CUDA's lazy module loading).
CUDA_RUNTIME_DEFAULT_BYTES = 1 * GiB
# The module a measuring child runs (harness.run.runner spawns it): the child below imports it by name, so it pays the
# same imports without the planner importing the run layer above it.
MEASURING_CHILD_MODULE = "harness.run.runner"


def _child_runtime_bytes(sender, dtype: str, dim: int, ffn: int) -> None:
    """In a spawned child: import what a measuring child imports, generate a few tokens with the tiny model at the
    compute dtype (thread pools, kernels), run one GEMM of the workload's widest shape (BLAS's own buffers grow with
    it), free everything, and report the private writable memory."""
    importlib.import_module(MEASURING_CHILD_MODULE)  # the measuring child's imports
    from harness import kv
    from harness.kv.base import CacheSpec
    from harness.measure.timing import StepTimer
    from harness.modeling.decode import generate
    from harness.modeling.model import build_model

    cpu, torch_dtype = torch.device("cpu"), DTYPES[dtype]
    args = ModelArgs.from_name("tiny")
    model = build_model(args, dtype=torch_dtype, device=cpu, seed=0, n_positions=64)
    spec = CacheSpec.for_model(args, batch_size=2, max_tokens=48, kv_dtype=dtype, device=cpu)
    cache = kv.build(EXACT_REFERENCE, spec, {})
    generate(model, cache, torch.zeros((2, 40), dtype=torch.long), 8, StepTimer(cpu, 8))
    with torch.inference_mode():  # w13's shape: [256, dim] x [dim, 2F]
        torch.nn.functional.linear(torch.ones(256, dim, dtype=torch_dtype), torch.empty(ffn, dim, dtype=torch_dtype))
    sender.send(private_memory_bytes())
    sender.close()


def private_memory_bytes() -> int:
    """This process's private writable memory: VmData on Linux (what RLIMIT_DATA caps), else the RSS."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    import psutil

    return psutil.Process().memory_info().rss


@functools.cache
def measured_cpu_runtime_bytes(dtype: str = "fp32", dim: int = 64, ffn: int = 256) -> int:
    """VmData of a freshly spawned child after the harness's imports, a tiny generation and a dim x ffn GEMM at
    `dtype`: the CPU runtime overhead, for a model of that width.

    Spawned from this process, as harness.run.runner spawns its measuring children, so it pays the same imports (the
    parent's __main__ module included) under the same environment (MALLOC_* variables). Once per process and shape;
    a few seconds.
    """
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_runtime_bytes, args=(sender, dtype, dim, ffn), daemon=True)
    child.start()
    sender.close()
    try:
        measured = receiver.recv()
    except EOFError:
        raise RuntimeError(f"runtime overhead: the measuring child died (exit code {child.exitcode})") from None
    finally:
        child.join()
    return int(measured)


def default_runtime_overhead_bytes(device: str, workload: Workload) -> int:
    """CPU: measured_cpu_runtime_bytes() for the workload's dtype and width. CUDA: the device memory a process holds
    before any tensor (context, workspaces), measured when a device is here, else CUDA_RUNTIME_DEFAULT_BYTES."""
    if device == "cpu":
        args = workload.model_args()
        return measured_cpu_runtime_bytes(workload.dtype, args.dim, 2 * args.intermediate_size)
    if torch.cuda.is_available():
        return measured_cuda_runtime_bytes()
    return CUDA_RUNTIME_DEFAULT_BYTES


@functools.cache
def measured_cuda_runtime_bytes() -> int:
    """Device memory in use after CUDA initializes and runs a bf16 GEMM, minus what the allocator holds."""
    torch.cuda.init()
    x = torch.ones(512, 1024, device="cuda", dtype=torch.bfloat16)
    (x @ x.T).sum().item()
    free, total = torch.cuda.mem_get_info()
    return max(0, total - free - torch.cuda.memory_reserved())  # the context and workspaces: what no allocator counts


def detected_memory_bytes(device: str) -> int:
    """CUDA: the device's total memory; CPU: the machine's total RAM (psutil)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("memory_gb: no CUDA device here to detect its memory; allowed: a number of GiB")
        return torch.cuda.get_device_properties(0).total_memory
    import psutil

    return psutil.virtual_memory().total


def free_memory_bytes(device: str) -> int:
    """What one more allocation may take now. CUDA: the device's free memory (cudaMemGetInfo, other processes' use
    subtracted); CPU: the host's available memory (psutil's `available`: free plus what the kernel can reclaim
    without swapping), so that a pool larger than it is refused in one line, never grown into the OOM killer."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device: cuda is not available here; allowed: cpu, or auto")
        return torch.cuda.mem_get_info()[0]
    import psutil

    return psutil.virtual_memory().available
