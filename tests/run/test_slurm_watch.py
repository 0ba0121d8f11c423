"""SLURM without a cluster: job states from squeue when sacct has none, a job's memory read from its environment,
the worker's cap under it, and the cgroup a job's OOM kills are counted in. tests/run/test_slurm.py runs them for real."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from harness.config import RunConfig
from harness.run import runner, slurm

slurm_watch = pytest.importorskip("harness.run.slurm_watch", reason="hydra-submitit-launcher is not installed")
SlurmJob = pytest.importorskip("submitit.slurm.slurm").SlurmJob

NO_ACCOUNTING = subprocess.CompletedProcess([], 1, "", "Slurm accounting storage is disabled\n")


def answering(squeue: subprocess.CompletedProcess, calls: list):
    """A subprocess.run whose sacct fails as on a cluster without accounting and whose squeue answers `squeue`."""

    def run(command, **kwargs):
        calls.append(command[0])
        return NO_ACCOUNTING if command[0] == "sacct" else squeue

    return run


def test_without_accounting_the_states_come_from_squeue(monkeypatch):
    queue = "5_0|COMPLETED|vm\n5_1|CANCELLED|vm\n5_[2-3%1]|PENDING|\n"
    calls: list = []
    monkeypatch.setattr(slurm_watch.subprocess, "run", answering(subprocess.CompletedProcess([], 0, queue, ""), calls))
    watcher = slurm_watch.QueueWatcher(delay_s=600)
    for job in ("5_0", "5_1", "5_2", "5_3"):
        watcher.register_job(job)
    watcher.update()
    assert calls == ["sacct", "squeue"]
    states = {job: watcher.get_state(job, mode="cache") for job in ("5_0", "5_1", "5_2", "5_3")}
    assert states == {"5_0": "COMPLETED", "5_1": "CANCELLED", "5_2": "PENDING", "5_3": "PENDING"}
    # A cancelled task is done, so the sweep process stops waiting on it; submitit's own watcher, reading sacct
    # alone, would keep it UNKNOWN (not done) for ever.
    assert watcher.is_done("5_1", mode="cache") and not watcher.is_done("5_2", mode="cache")


@pytest.mark.parametrize("forgotten", ["among others", "alone"])
def test_a_job_squeue_forgot_counts_as_ended(monkeypatch, forgotten):
    # slurmctld forgets a job MinJobAge after it ended: squeue leaves it out, or fails when it was the only one.
    if forgotten == "alone":
        squeue = subprocess.CompletedProcess([], 1, "", "slurm_load_jobs error: Invalid job id specified\n")
    else:
        squeue = subprocess.CompletedProcess([], 0, "8|RUNNING|vm\n", "")
    monkeypatch.setattr(slurm_watch.subprocess, "run", answering(squeue, []))
    watcher = slurm_watch.QueueWatcher(delay_s=600)
    watcher.register_job("7")
    if forgotten == "among others":
        watcher.register_job("8")
    watcher.update()
    assert watcher.get_state("7", mode="cache") == slurm_watch.GONE and watcher.is_done("7", mode="cache")
    if forgotten == "among others":
        assert watcher.get_state("8", mode="cache") == "RUNNING"


def test_with_accounting_sacct_alone_is_read(monkeypatch):
    calls: list = []

    def run(command, **kwargs):
        calls.append(command[0])
        return subprocess.CompletedProcess([], 0, "JobID|State|NodeList\n9|COMPLETED|vm\n9.0|COMPLETED|vm\n", "")

    monkeypatch.setattr(slurm_watch.subprocess, "run", run)
    watcher = slurm_watch.QueueWatcher(delay_s=600)
    watcher.register_job("9")
    watcher.update()
    assert calls == ["sacct"] and watcher.get_state("9", mode="cache") == "COMPLETED"


def test_install_swaps_submitits_watcher_once_and_its_job_class(monkeypatch):
    submitit_slurm = pytest.importorskip("submitit.slurm.slurm")
    monkeypatch.setattr(SlurmJob, "watcher", SlurmJob.watcher)  # each restored after the test
    monkeypatch.setattr(submitit_slurm, "SlurmJob", SlurmJob)
    monkeypatch.setattr(submitit_slurm.SlurmExecutor, "job_class", SlurmJob)
    slurm_watch.install()
    installed = SlurmJob.watcher
    slurm_watch.install()
    assert isinstance(installed, slurm_watch.QueueWatcher) and SlurmJob.watcher is installed
    # single jobs (job_class) and a job array's tasks (made by the module's name) both record memory kills
    assert submitit_slurm.SlurmExecutor.job_class is slurm_watch.RecordingSlurmJob
    assert submitit_slurm.SlurmJob is slurm_watch.RecordingSlurmJob
    assert slurm_watch.RecordingSlurmJob.watcher is installed


@pytest.mark.parametrize(
    ("state", "log", "says"),
    [
        # jobacct_gather's poll (OverMemoryKill), as slurmstepd 22.05 words it: the step's RSS past --mem
        ("FAILED", "slurmstepd-vm: error: StepId=7.0 exceeded memory limit (1206263808 > 1073741824), being killed",
         "1.12 GiB, past the job's 1.00 GiB (state FAILED)"),
        ("OUT_OF_MEMORY", "", "cgroup ran out of memory (state OUT_OF_MEMORY)"),  # the cgroup's own kill
        ("FAILED", "slurmstepd: error: Detected 1 oom_kill event in StepId=3.batch", "cgroup ran out of memory"),
        ("FAILED", "Traceback ...\nRuntimeError: boom", None),  # a job that failed otherwise: not a memory kill
        ("CANCELLED", "", None),
    ],
)  # fmt: skip
def test_a_memory_kill_is_told_from_the_jobs_state_and_log(state, log, says):
    killed = slurm_watch.memory_kill(state, log)
    assert (killed is None) if says is None else (says in killed)


@pytest.mark.parametrize(
    ("env", "job", "memory"),
    [
        ({}, None, None),
        ({"SLURM_JOB_ID": "12", "SLURM_MEM_PER_NODE": "1024"}, "12", 2**30),
        ({"SLURM_JOB_ID": "13", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "1"}, "12_1", None),
        ({"SLURM_JOB_ID": "12", "SLURM_MEM_PER_CPU": "512", "SLURM_CPUS_ON_NODE": "4"}, "12", 2 * 2**30),
        ({"SLURM_MEM_PER_NODE": "1024"}, None, None),  # a leftover variable outside any job
        ({"SLURM_JOB_ID": "12", "SLURM_MEM_PER_NODE": "1G"}, "12", None),  # unreadable: not capped
    ],
)
def test_the_job_and_its_memory_come_from_slurms_environment(env, job, memory):
    assert slurm.job_id(env) == job
    assert slurm.job_memory_bytes(env) == memory


def test_the_workers_cap_is_the_jobs_memory_less_its_job_process(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "21")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "4096")
    cap, why = runner.job_cap_bytes(os.getppid())
    parent_rss, own_rss = runner._status_bytes(os.getppid(), "VmRSS"), runner._status_bytes("self", "VmRSS")
    room = cap - runner._status_bytes("self", "VmData")  # what the worker may still grow by
    # The two processes' RSS move by a few pages between the reads: 16 MiB of slack.
    assert parent_rss > 0 and abs(room - (4 * 2**30 - parent_rss - own_rss)) < 16 * 2**20
    assert "SLURM job 21's 4.00 GiB" in why
    monkeypatch.delenv("SLURM_JOB_ID")
    assert runner.job_cap_bytes(os.getppid()) is None


@pytest.mark.slow
def test_a_point_past_its_slurm_jobs_memory_is_an_oom_row_without_slurm(monkeypatch):
    # What a SLURM job's worker sees (tests/run/test_slurm.py runs it under sbatch). This process plays the job
    # process, whatever it holds; 0.7 GiB more, less the worker's own resident memory (about 0.3 GiB), cannot hold
    # the small model's 0.8 GB of fp32 weights.
    job_mib = (runner._status_bytes(os.getpid(), "VmRSS") + int(0.7 * 2**30)) // 2**20
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", str(job_mib))
    cfg = RunConfig(model={"name": "small"}, dtype="fp32", batch_size=1, prompt_len=8, gen_len=4, warmup=0,
                    min_repeats=1, max_repeats=1, profile=False, roofline=False)  # fmt: skip
    row = runner.run_point(cfg).row
    assert row["status"] == "oom", row.get("error")
    assert "worker capped at" in row["error"] and "SLURM job 31" in row["error"]
    assert "before any model" not in row["error"]  # the model's weights ran into the cap, not the worker itself
    assert row["slurm_job_id"] == "31"


@pytest.mark.slow
def test_a_slurm_job_too_small_for_the_worker_itself_is_an_oom_row_saying_so(monkeypatch):
    # 64 MiB for the job: less than this process alone holds, so nothing can run; the row says why, from a worker
    # that never set a cap under which it could not even reply.
    monkeypatch.setenv("SLURM_JOB_ID", "32")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "64")
    cfg = RunConfig(model={"name": "tiny"}, dtype="fp32", batch_size=1, prompt_len=8, gen_len=4, warmup=0,
                    min_repeats=1, max_repeats=1, profile=False, roofline=False)  # fmt: skip
    row = runner.run_point(cfg).row
    assert row["status"] == "oom", row.get("error")
    assert "before any model" in row["error"] and "SLURM job 32" in row["error"]


@pytest.mark.parametrize(
    ("proc_cgroup", "own"),
    [
        ("0::/system.slice/slurmstepd.scope/job_7/step_0/task_0\n",
         "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/step_0/task_0/memory.events"),
        ("4:memory:/slurm/uid_0/job_7/step_0\n0::/\n", "/sys/fs/cgroup/memory/slurm/uid_0/job_7/step_0/memory.oom_control"),
        ("0::/\n", None),  # a container's own cgroup is its mount's root
    ],
)  # fmt: skip
def test_oom_kills_are_read_in_the_processs_own_cgroup_first(proc_cgroup, own):
    files = runner.cgroup_event_files(proc_cgroup)
    assert files[-2:] == list(runner._CGROUP_EVENTS)
    assert files[:-2] == ([Path(own)] if own else [])
