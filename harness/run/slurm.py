"""What a process learns from SLURM's environment: the job it runs in and the memory that job was given.

job_memory_bytes() is the memory SLURM allotted the job on this node (sbatch --mem or --mem-per-cpu, which
hydra.launcher.mem_gb sets). A point's worker caps itself below it (harness.run.runner.limit_memory), so that a point
outgrowing its job becomes an `oom` row instead of a job the cluster kills with nothing recorded. Imports nothing
heavy: the measuring worker reads it. How the sweep process watches its jobs is harness.run.slurm_watch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)


def job_id(env: Mapping[str, str] = os.environ) -> str | None:
    """This process's SLURM job as submitit names it: <array job>_<task> for a job array's task, else the job id;
    None outside SLURM."""
    array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return env.get("SLURM_JOB_ID") or None


def job_memory_bytes(env: Mapping[str, str] = os.environ) -> int | None:
    """The memory SLURM allotted this job on this node, in bytes: SLURM_MEM_PER_NODE (sbatch --mem), else
    SLURM_MEM_PER_CPU x the job's CPUs on the node (--mem-per-cpu). Both are in MiB. None outside SLURM, or when
    the job asked for no memory (SLURM then gives it the whole node, which it does not cap)."""
    if job_id(env) is None:
        return None
    try:
        per_node = env.get("SLURM_MEM_PER_NODE")
        if per_node:
            return int(per_node) * 2**20
        per_cpu, cpus = env.get("SLURM_MEM_PER_CPU"), env.get("SLURM_CPUS_ON_NODE")
        if per_cpu and cpus:
            return int(per_cpu) * int(cpus) * 2**20
    except ValueError:
        log.warning("SLURM_MEM_PER_NODE / SLURM_MEM_PER_CPU unreadable: the job's memory is not capped")
    return None
