"""SLURM job states that need no accounting database, for the sweep process that waits on its jobs.

hydra-submitit-launcher waits on each job through submitit, which reads job states from `sacct` alone. On a cluster
that keeps no accounting (a small lab cluster, our CI's one-node cluster) sacct fails, every state stays UNKNOWN, and
a job that ends without a result (scancel, a node failure, the cluster's memory kill) is waited on forever.
QueueWatcher asks sacct first and falls back on `squeue --states=all`, whose rows have sacct's columns. install()
puts it in place; experiments.callbacks calls it when a multirun's launcher is a SLURM one.

A job SLURM kills for memory (its processes past hydra.launcher.mem_gb: the cgroup's OUT_OF_MEMORY, or the
step's "exceeded memory limit" from jobacct_gather's poll) writes nothing: the kill takes every process of the job,
the sweep process inside it as well as the point's worker. Which process passed the limit depends on the torch build:
the CPU build's job process holds ~0.4 GB, the CUDA build's ~0.7 GB before any work (its CUDA libraries, mapped;
measured in the README's SLURM section), so a 1 GB job can die before the worker's own cap (harness.run.runner's
limit_memory) turns its allocation into an `oom` row. RecordingSlurmJob is the submitting side's answer: when a job
ends in that kill, it writes the point's `oom` row itself, from the job's state and log (the job's id, the limit),
through the entry point's `record_killed_job`, and the sweep goes on with its other points.

What a job knows of SLURM inside (its id, its memory) is harness.run.slurm, which imports neither Hydra nor submitit.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time

from submitit.core import utils as submitit_utils
from submitit.slurm import slurm as submitit_slurm

log = logging.getLogger(__name__)

QUEUE_COLUMNS = "JobID|State|NodeList"  # sacct --parsable2's header for `-o JobID,State,NodeList`
GONE = "NOT_IN_QUEUE"  # a job neither sacct nor squeue knows any more: ended (submitit then looks for its result)
# slurmstepd's words when jobacct_gather's poll finds the step's processes past --mem (OverMemoryKill), and the
# cgroup's OOM kill as the step reports it; the state SLURM gives a job its cgroup killed
STEP_OVER_MEMORY = re.compile(r"exceeded memory limit \((?P<used>\d+) > (?P<limit>\d+)\)")
CGROUP_OOM = re.compile(r"oom[_-]kill|out of memory", re.IGNORECASE)
OOM_STATE = "OUT_OF_MEMORY"


class QueueWatcher(submitit_slurm.SlurmInfoWatcher):
    """submitit's SLURM job watcher, reading squeue when sacct has nothing to say (no accounting storage)."""

    def update(self) -> None:
        command = self._make_command()  # sacct for the jobs still registered and not finished; None when none
        if command is None:
            return
        self._num_calls += 1
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode == 0:
            self._info_dict.update(self.read_info(proc.stdout))
        else:
            self._info_dict.update(self.queue_info(command))
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def queue_info(self, sacct_command: list[str]) -> dict[str, dict[str, str]]:
        """The same {job id: {JobID, State, NodeList}} as read_info, from squeue; GONE for a registered job that
        squeue no longer lists (slurmctld forgets a job MinJobAge after it ended)."""
        ids = [sacct_command[i + 1] for i, arg in enumerate(sacct_command) if arg == "-j"]
        proc = subprocess.run(
            ["squeue", "--noheader", "--states=all", "--format=%i|%T|%N", "--jobs=" + ",".join(ids)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 and "invalid job id" not in proc.stderr.lower():
            log.warning("neither sacct nor squeue answered (%s): job states unknown", proc.stderr.strip())
            return {}
        listed = proc.stdout if proc.returncode == 0 else ""  # one id alone that slurmctld forgot: an error
        info = self.read_info(f"{QUEUE_COLUMNS}\n{listed}")
        for job_id in self._registered - self._finished:
            if job_id.split("_")[0] in ids and job_id not in info:
                info[job_id] = {"JobID": job_id, "State": GONE, "NodeList": ""}
        return info


def memory_kill(state: str, log: str) -> str | None:
    """What a job that ended without a result says of SLURM's memory kill, as one clause; None when it was not one."""
    over = STEP_OVER_MEMORY.search(log)
    if over is not None:
        used, limit = int(over["used"]) / 2**30, int(over["limit"]) / 2**30
        return f"its processes held {used:.2f} GiB, past the job's {limit:.2f} GiB (state {state})"
    if state.startswith(OOM_STATE) or CGROUP_OOM.search(log):
        return f"the job's cgroup ran out of memory (state {state})"
    return None


SUBMITIT_SLURM_JOB = submitit_slurm.SlurmJob  # submitit's own class, before install() rebinds its name


class RecordingSlurmJob(SUBMITIT_SLURM_JOB):
    """A SlurmJob whose memory kill becomes its point's row, written here, instead of an UncompletedJobError that
    ends the sweep with nothing recorded (hydra-submitit-launcher's launch reads every job's results() in turn)."""

    def results(self):
        try:
            return super().results()
        except submitit_utils.UncompletedJobError:
            killed = memory_kill(str(self.state), self.stderr() or "")
            if killed is None:
                raise
            return [self._record_killed(killed)]

    def _record_killed(self, killed: str):
        """The JobReturn of a point its job never reported: the entry point's record_killed_job writes its row."""
        from hydra.core.utils import JobReturn, JobStatus
        from omegaconf import open_dict

        submission = self.submission()  # the pickled call: the launcher (its Hydra context) and the job's overrides
        launcher, overrides = submission.function, list(submission.args[0])
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
        with open_dict(config.hydra.job) as job:  # as the launcher's own call sets them inside the job
            job.id, job.num = self.job_id, submission.args[2]
        record = getattr(sys.modules.get(launcher.task_function.__module__), "record_killed_job", None)
        if record is None:  # an entry point with no row to write for it: the error stands, as submitit raised it
            raise submitit_utils.UncompletedJobError(f"SLURM job {self.job_id} was killed for memory: {killed}")
        node = (self.get_info() or {}).get("NodeList") or None
        mem_gb = config.hydra.launcher.get("mem_gb")
        error = (f"SLURM job {self.job_id} was killed for memory before its point reported: {killed}; recorded by "
                 f"the submitting process from the job's state and log; hydra.launcher.mem_gb={mem_gb} is the "
                 "limit: raise it, or shrink the point")  # fmt: skip
        log.warning("%s", error)
        value = record(config, job_id=self.job_id, node=node, error=error)
        return JobReturn(overrides=overrides, cfg=config, hydra_cfg=config.hydra, status=JobStatus.COMPLETED,
                         _return_value=value)  # fmt: skip


def install() -> None:
    """Have every SLURM job submitit watches in this process read its state through QueueWatcher (submitit keeps
    one watcher for all its SlurmJobs, a class attribute), and every SLURM job it submits be a RecordingSlurmJob
    (the executor's job_class). experiments.callbacks does so when a multirun's launcher is a SLURM one, before the
    launcher submits."""
    if not isinstance(SUBMITIT_SLURM_JOB.watcher, QueueWatcher):
        SUBMITIT_SLURM_JOB.watcher = QueueWatcher(delay_s=600)  # submitit's own refresh bound
    # A single job is the executor's job_class; a job array's tasks are made by name in submitit's module
    # (SlurmExecutor._internal_process_submissions), so the name is rebound there too.
    submitit_slurm.SlurmExecutor.job_class = RecordingSlurmJob
    submitit_slurm.SlurmJob = RecordingSlurmJob
