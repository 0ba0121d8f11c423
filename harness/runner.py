"""Run a point in its own spawned process, so that one OOM or crash cannot poison the next point.

Whatever happens in the child becomes a row: `ok` with its measurements, `oom` when memory ran out (torch's
allocator, the KV pool, or the kernel's OOM killer), `error` with the message otherwise. The parent never raises
for a point's failure; a sweep goes on.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import resource
import signal
import sys
import traceback

import torch

from harness import bench, ceilings
from harness.config import RunConfig
from harness.kv.base import Unsupported

log = logging.getLogger(__name__)

_OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory")


def ensure_ceilings(cfg: RunConfig) -> None:
    """Measure this device's ceilings once (then they are reused), in a process of their own: their large copy
    buffers must not count in any point's memory."""
    if not cfg.roofline or cfg.lengths == "mixed":
        return
    directory = cfg.ceilings_dir or cfg.results_dir
    device = cfg.torch_device()
    stored = ceilings.read_stored(ceilings.ceilings_path(device, directory))
    if stored is not None and (cfg.ceilings_quick or not stored.quick):
        return
    if not cfg.isolate:
        ceilings.load_or_measure(device, directory, quick=cfg.ceilings_quick)
        return
    child = mp.get_context("spawn").Process(
        target=ceilings.load_or_measure, args=(device.type, directory, cfg.ceilings_quick), daemon=True
    )
    child.start()
    child.join()
    if child.exitcode != 0:
        log.warning("measuring the ceilings failed (exit code %s): roofline columns will lack peaks", child.exitcode)


def run_point(cfg: RunConfig) -> dict:
    """The row for one point: measured in a spawned child when cfg.isolate, else in this process."""
    ensure_ceilings(cfg)
    if not cfg.isolate:
        if cfg.max_memory_gb is not None:
            log.warning("max_memory_gb is applied only to isolated points; isolate=false ignores it")
        return _guarded(cfg)
    ctx = mp.get_context("spawn")  # never fork a process that may hold a CUDA context
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(
        target=_child_main, args=(cfg, sender, os.getpid()), name=f"kvbench-{cfg.point_id()}", daemon=True
    )
    child.start()
    sender.close()  # the child holds the only write end: EOF below means it died without a word
    try:
        row = receiver.recv()
    except EOFError:
        row = None
    child.join()
    if row is not None:
        return row
    if child.exitcode == -signal.SIGKILL:
        return failure_row(cfg, "oom", "measuring process killed by SIGKILL (the host ran out of memory?)")
    return failure_row(cfg, "error", f"measuring process died with exit code {child.exitcode}")


def _child_main(cfg: RunConfig, sender, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    limit_memory(cfg)
    sender.send(_guarded(cfg))
    sender.close()


def _guarded(cfg: RunConfig) -> dict:
    try:
        return bench.run_point(cfg)
    except Unsupported as exc:
        return failure_row(cfg, "unsupported", str(exc))
    except Exception as exc:
        status = "oom" if is_oom(exc) else "error"
        if status == "error":
            log.error("point %s failed:\n%s", cfg.point_id(), traceback.format_exc())
        return failure_row(cfg, status, f"{type(exc).__name__}: {exc}")
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel kill this child when the sweep process dies (Ctrl-C, scancel, a kill), so that no
    orphaned measurement keeps a CPU or GPU busy under the next point."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died while this child was still starting up
        os._exit(1)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):  # KVPoolExhausted is a MemoryError
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MESSAGES)


def limit_memory(cfg: RunConfig) -> None:
    """Make OOM reproducible: cap this process at max_memory_gb.

    CPU: RLIMIT_DATA bounds the private writable memory (heap and anonymous maps) the process may hold, so a
    tensor allocation past it fails cleanly instead of inviting the kernel's OOM killer. CUDA: the allocator's
    per-process memory fraction. Only meant for the spawned child: the limit lasts as long as the process.
    """
    if cfg.max_memory_gb is None:
        return
    limit_bytes = int(cfg.max_memory_gb * 2**30)
    device = cfg.torch_device()
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total), device)
    else:
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            limit_bytes = min(limit_bytes, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, hard))


def failure_row(cfg: RunConfig, status: str, error: str) -> dict:
    device = cfg.torch_device()
    return bench.config_columns(cfg) | bench.environment_columns(device) | {"status": status, "error": error}
