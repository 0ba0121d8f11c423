"""Run a point in a spawned worker process, so that one OOM or crash cannot poison the next point.

Whatever happens in the worker becomes a row: `ok` with its measurements, `oom` when memory ran out (torch's
allocator, the KV pool, or the kernel's OOM killer), `error` with the message otherwise, and `error` naming the
signal when the worker dies (a segfault, a kill). The parent never raises for a point's failure; a sweep goes on.

Isolation without its price: starting Python and importing torch costs seconds, so a worker whose point ended ok
or unsupported stays warm for the next point of the sweep (optimum-benchmark spawns per run; we spawn again only
after a failure). Each point still gets its own peak RSS (probes.reset_peak_rss), and a worker is replaced after an
OOM, an error, a death, or a point capped by max_memory_gb (reusable()). A Runner owns that warm worker: the entry
point creates one for its process and closes it at exit; run_point() alone measures one point with a fresh one.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import resource
import signal
import sys
import traceback
from pathlib import Path

import torch

from harness.config import RunConfig
from harness.device import ceilings
from harness.errors import Unsupported
from harness.measure import environment, probes
from harness.run import point, slurm
from harness.run.point_result import PointResult

log = logging.getLogger(__name__)

WORKER_HEADROOM_BYTES = 64 * 2**20  # the least a capped worker needs beyond what it holds: a reply, a small model
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
        target=_ceilings_main, args=(device.type, directory, cfg.ceilings_quick, os.getpid()), daemon=True
    )
    child.start()
    child.join()
    if child.exitcode != 0:
        log.warning("measuring the ceilings failed (exit code %s): roofline columns will lack peaks", child.exitcode)


class Runner:
    """Measures points one after another, keeping the worker of a point that ended ok or unsupported warm for the
    next (no interpreter start, no torch import). Its owner closes it: `with Runner() as points:`, or close()."""

    def __init__(self) -> None:
        self.warm: Worker | None = None  # the worker kept between points, None when there is none to reuse

    def run_point(self, cfg: RunConfig) -> PointResult:
        """The point's result: measured in a spawned worker when cfg.isolate, else in this process."""
        ensure_ceilings(cfg)
        if not cfg.isolate:
            if cfg.max_memory_gb is not None:
                log.warning("max_memory_gb is applied only to isolated points; isolate=false ignores it")
            return _guarded(cfg)
        worker, self.warm = self.warm, None
        if worker is None or not worker.alive():
            if worker is not None:
                worker.close()
            worker = Worker()
        oom_kills = cgroup_oom_kills()
        result = worker.run(cfg)
        if result is None:  # the worker died inside the point: a segfault, a kill, the kernel's OOM killer
            result = PointResult(row=death_row(cfg, worker.exitcode(), oom_killed=cgroup_oom_kills() > oom_kills))
            worker.close()
        elif reusable(cfg, result.row) and worker.peak_resettable:
            self.warm = worker
        else:
            worker.close()
        return result

    def close(self) -> None:
        if self.warm is not None:
            self.warm.close()
            self.warm = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_point(cfg: RunConfig) -> PointResult:
    """One point on its own, in a worker started for it and closed after it (a sweep keeps a Runner instead)."""
    with Runner() as points:
        return points.run_point(cfg)


def reusable(cfg: RunConfig, row: dict) -> bool:
    """Whether the worker that measured `row` may measure the next point. Not after an OOM or an error (the
    allocator, the heap or the CUDA context may be left in a bad state), nor after a max_memory_gb cap or a SLURM
    job's (RLIMIT_DATA counts heap the process keeps), nor when reuse_worker is off."""
    capped = cfg.max_memory_gb is not None or slurm.job_memory_bytes() is not None
    return cfg.reuse_worker and not capped and row.get("status") in ("ok", "unsupported")


class Worker:
    """A spawned measuring process that serves points one at a time over a pipe (spawn: never fork a process that
    may hold a CUDA context). Its first message says whether it can reset its peak RSS between points."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main, args=(child_end, os.getpid()), name="kvbench-worker", daemon=True
        )
        self.process.start()
        child_end.close()  # the child holds the only other end: EOF below means it died
        try:
            self.peak_resettable = bool(self.conn.recv())
        except EOFError:
            self.peak_resettable = False

    def alive(self) -> bool:
        return self.process.is_alive()

    def run(self, cfg: RunConfig) -> PointResult | None:
        """The point's result, or None when the worker died before answering."""
        try:
            self.conn.send(cfg)
            return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return None

    def exitcode(self) -> int | None:
        self.process.join(timeout=10)
        return self.process.exitcode

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)  # asks the loop to end
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def _ceilings_main(device: str, directory: str | Path, quick: bool, parent_pid: int) -> None:
    """The ceilings' own process: it dies with the sweep, as a worker does (a full measurement streams buffers of
    several times the last-level cache, which can take minutes where that cache is large)."""
    die_with_parent(parent_pid)
    ceilings.load_or_measure(device, directory, quick=quick)


def _worker_main(conn, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    conn.send(probes.reset_peak_rss())
    while True:
        try:
            cfg = conn.recv()
        except EOFError:
            return
        if cfg is None:
            return
        probes.reset_peak_rss()  # this point's peak, not the last one's
        point_columns(cfg)  # its lookups are cached (git, package metadata): a capped point's failure row needs none
        try:
            capped_by_job = limit_memory(cfg, parent_pid)
        except MemoryError as exc:  # the job's memory cannot hold even this worker as it stands
            conn.send(PointResult(row=failure_row(cfg, "oom", str(exc))))
            continue
        result = _guarded(cfg)
        if capped_by_job and result.row.get("status") == "oom":
            result.row["error"] = f"{result.row['error']} ({capped_by_job})"
        conn.send(result)


def death_row(cfg: RunConfig, exitcode: int | None, *, oom_killed: bool) -> dict:
    """The row of a point whose measuring process died without a word: `oom` when the kernel's OOM killer took it
    (this cgroup's oom_kill count rose meanwhile), else `error` naming the signal or exit code."""
    if exitcode is not None and exitcode < 0:
        try:
            how = f"killed by signal {signal.Signals(-exitcode).name} ({-exitcode})"
        except ValueError:
            how = f"killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    if oom_killed:
        return failure_row(cfg, "oom", f"measuring process {how}: the kernel's OOM killer (cgroup oom_kill rose)")
    return failure_row(cfg, "error", f"measuring process {how}")


_CGROUP_EVENTS = (
    Path("/sys/fs/cgroup/memory.events"),  # cgroup v2, as a container sees its own cgroup
    Path("/sys/fs/cgroup/memory/memory.oom_control"),  # cgroup v1
)


def cgroup_event_files(proc_cgroup: str | None = None) -> list[Path]:
    """Where this process's cgroup counts OOM kills: its own cgroup first (/proc/self/cgroup: a SLURM job's
    job_<id>/step_<n>/task_<n> under task/cgroup, where the root of /sys/fs/cgroup counts nothing), then the mount's
    root, which is the process's own cgroup inside a container."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = ""
    own = []
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if path in ("", "/"):
            continue
        if hierarchy == "0" and controllers == "":  # cgroup v2's unified hierarchy
            own.append(Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):  # cgroup v1's memory controller
            own.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control")
    return [*own, *_CGROUP_EVENTS]


def cgroup_oom_kills() -> int:
    """How many processes the kernel's OOM killer has killed in this cgroup so far (0 when it cannot be read)."""
    for path in cgroup_event_files():
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return 0


def _guarded(cfg: RunConfig) -> PointResult:
    """The point measured in this process; a failure is its row (unsupported, oom or error), never an exception."""
    try:
        return point.run_point(cfg)
    except Unsupported as exc:
        return PointResult(row=failure_row(cfg, "unsupported", str(exc)))
    except Exception as exc:
        status = "oom" if is_oom(exc) else "error"
        if status == "error":
            log.error("point %s failed:\n%s", cfg.point_id(), traceback.format_exc())
        return PointResult(row=failure_row(cfg, status, f"{type(exc).__name__}: {exc}"))
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


def limit_memory(cfg: RunConfig, parent_pid: int | None = None) -> str | None:
    """Make OOM reproducible: cap this process at max_memory_gb, and on the CPU below its SLURM job's memory.

    CPU: RLIMIT_DATA bounds the private writable memory (heap and anonymous maps) the process may hold, so a
    tensor allocation past it fails cleanly instead of inviting the kernel's OOM killer. CUDA: the allocator's
    per-process memory fraction, set to the cap less what the process already holds on the device outside the
    allocator (the CUDA context, about 0.5 GB, as NVML sees this process, else all memory in use on the device).
    The allocator reserves cuBLAS's workspaces itself, so they count; device memory the driver takes later outside
    the allocator (kernels loaded lazily on first use) does not. Only meant for the spawned child: the limit lasts
    as long as the process.

    In a SLURM job that asked for memory (hydra.launcher.mem_gb), a CPU point's worker is also capped below it
    (job_cap_bytes): SLURM kills the whole job once its processes pass it, which records nothing, where a cap
    makes the point an `oom` row. Returns what set that cap, for the row's error, when the job's memory did. A CUDA
    point's host memory is left to the cluster (RLIMIT_DATA would also bound the driver's pinned host buffers).
    """
    device = cfg.torch_device()
    job_cap = job_cap_bytes(parent_pid) if device.type == "cpu" else None
    if cfg.max_memory_gb is None and job_cap is None:
        return None
    limit_bytes = int(cfg.max_memory_gb * 2**30) if cfg.max_memory_gb is not None else None
    capped_by_job = None
    if job_cap is not None and (limit_bytes is None or job_cap[0] < limit_bytes):
        limit_bytes, capped_by_job = job_cap
        log.info("the SLURM job's memory caps this worker: %s", capped_by_job)
    if device.type == "cuda":
        total_bytes = torch.cuda.get_device_properties(device).total_memory
        held_bytes, counted_by = probes.cuda_bytes_held(device)
        outside_bytes = max(0, held_bytes - torch.cuda.memory_reserved(device))  # the context, chiefly
        allocator_bytes = max(0, limit_bytes - outside_bytes)  # 0: the context alone exceeds the cap, all OOMs
        torch.cuda.set_per_process_memory_fraction(min(1.0, allocator_bytes / total_bytes), device)
        log.info(
            "max_memory_gb=%g: %.2f GiB held outside the allocator (%s), so the allocator may reserve %.2f GiB",
            cfg.max_memory_gb,
            outside_bytes / 2**30,
            counted_by,
            allocator_bytes / 2**30,
        )
    else:
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            limit_bytes = min(limit_bytes, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, hard))
    return capped_by_job


def job_cap_bytes(parent_pid: int | None) -> tuple[int, str] | None:
    """(RLIMIT_DATA bytes, why): what this worker may still grow by within its SLURM job's memory, added to the
    private data it holds now. SLURM checks the job's memory against the summed RSS of its processes, so the room
    left is the job's memory less the resident memory of the job process that started this worker (parent_pid) and
    of this worker (its shared libraries included). RLIMIT_DATA counts virtual private data, which already exceeds
    the resident part (thread stacks, malloc arenas reserved), so the limit is the data held now plus that room: new
    tensors are written, hence resident, as they grow. None outside a SLURM job with a memory request.

    Raises MemoryError when the room is under WORKER_HEADROOM_BYTES: under such a cap nothing could run, not even
    the reply saying so."""
    job_bytes = slurm.job_memory_bytes()
    if job_bytes is None:
        return None
    parent_bytes = _status_bytes(parent_pid, "VmRSS") if parent_pid is not None else 0
    own_bytes = _status_bytes("self", "VmRSS")
    room_bytes = job_bytes - parent_bytes - own_bytes
    why = (
        f"worker capped at {max(0, room_bytes) / 2**30:.2f} GiB more than it held: SLURM job {slurm.job_id()}'s "
        f"{job_bytes / 2**30:.2f} GiB (hydra.launcher.mem_gb) less its job process's {parent_bytes / 2**30:.2f} GiB "
        f"and the worker's own {own_bytes / 2**30:.2f} GiB"
    )
    if room_bytes < WORKER_HEADROOM_BYTES:
        raise MemoryError(f"{why}: no room left before any model")
    return _status_bytes("self", "VmData") + room_bytes, why


def _status_bytes(pid: int | str, field: str) -> int:
    """A `kB` field of /proc/<pid>/status in bytes (VmRSS, RssFile); 0 when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == field:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def point_columns(cfg: RunConfig) -> dict:
    """What a point's row holds before anything is measured: its identity, its config and this environment."""
    return point.config_columns(cfg) | environment.environment_columns(cfg.torch_device())


def failure_row(cfg: RunConfig, status: str, error: str) -> dict:
    """The row of a point that did not measure: its point columns, why (status) and what happened (error)."""
    return point_columns(cfg) | {"status": status, "error": error}
