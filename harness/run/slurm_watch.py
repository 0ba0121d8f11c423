"""SLURM job states that need no accounting database, for the sweep process that waits on its jobs.

hydra-submitit-launcher waits on each job through submitit, which reads job states from `sacct` alone. On a cluster
that keeps no accounting (a small lab cluster, our CI's one-node cluster) sacct fails, every state stays UNKNOWN, and
a job that ends without a result (scancel, a node failure, the cluster's memory kill) is waited on forever.
QueueWatcher asks sacct first and falls back on `squeue --states=all`, whose rows have sacct's columns. install()
puts it in place; experiments.callbacks calls it when a multirun's launcher is a SLURM one.

What a job knows of SLURM inside (its id, its memory) is harness.run.slurm, which imports neither Hydra nor submitit.
"""

from __future__ import annotations

import logging
import subprocess
import time

from submitit.slurm import slurm as submitit_slurm

log = logging.getLogger(__name__)

QUEUE_COLUMNS = "JobID|State|NodeList"  # sacct --parsable2's header for `-o JobID,State,NodeList`
GONE = "NOT_IN_QUEUE"  # a job neither sacct nor squeue knows any more: ended (submitit then looks for its result)


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


def install() -> None:
    """Have every SLURM job submitit watches in this process read its state through QueueWatcher (submitit keeps
    one watcher for all its SlurmJobs, a class attribute). experiments.callbacks does so when a multirun's launcher
    is a SLURM one, before the launcher submits."""
    if not isinstance(submitit_slurm.SlurmJob.watcher, QueueWatcher):
        submitit_slurm.SlurmJob.watcher = QueueWatcher(delay_s=600)  # submitit's own refresh bound
