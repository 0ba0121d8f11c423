"""A real SLURM cluster: sweeps through `hydra/launcher=slurm` go through sbatch, slurmctld and slurmd.

The cluster is scripts/slurm_local.sh's one node on loopback: the one .ci/run brought up (KVBENCH_SLURM_DIR), else
one this module brings up and tears down. Skipped, saying why, where SLURM's binaries are absent or not as root.
The jobs run this checkout's Python on this machine, as on a cluster whose nodes share the filesystem.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

from harness.store import disk
from tests.run.test_sweep import ROOT, TINY

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher is not installed")
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = ROOT / "scripts" / "slurm_local.sh"
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")
POINTS = [*TINY, "dtype=fp32", "prompt_len=8", "profile=false"]
# The preset asks for a GPU, 8 CPUs and 64 GB per job; this node has 2 CPUs and no GPU. One job takes both CPUs, so
# SLURM runs the points one at a time, as the preset's array_parallelism does on a GPU partition.
ON_THIS_NODE = ["hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=2", "hydra.launcher.mem_gb=4"]
SAME = ["model", "batch_size", "prompt_len", "gen_len", "cache", "dtype", "kv_dtype", "status", "output_digest"]
JOB_STARTED = re.compile(r"Starting with JobEnvironment\(job_id=(?P<job>[\d_]+), hostname=(?P<host>[^,]+),")


def _missing() -> list[str]:
    return [name for name in BINARIES if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


@pytest.fixture(scope="module")
def slurm_env():
    """The environment under which sbatch, squeue and scancel reach a running one-node cluster."""
    if missing := _missing():
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root (slurmd starts each job as its user): run as root, as CI does")
    env = os.environ | {"PATH": os.environ.get("PATH", "") + ":/usr/sbin"}
    ci_dir = Path(os.environ.get("KVBENCH_SLURM_DIR", "/tmp/kvbench-slurm"))
    if _answers(env | {"SLURM_CONF": str(ci_dir / "slurm.conf")}):
        yield env | {"SLURM_CONF": str(ci_dir / "slurm.conf")}
        return
    own = env | {"KVBENCH_SLURM_DIR": tempfile.mkdtemp(prefix="kvbench-slurm-")}
    up = subprocess.run(["bash", str(SCRIPT), "up"], env=own, capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr  # SLURM is installed: a cluster that does not come up is a failure
    try:
        yield own | {"SLURM_CONF": str(Path(own["KVBENCH_SLURM_DIR"]) / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(SCRIPT), "down"], env=own, capture_output=True, timeout=120)


def _answers(env: dict) -> bool:
    if not Path(env["SLURM_CONF"]).is_file():
        return False
    proc = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=30)
    return proc.returncode == 0 and "idle" in proc.stdout


def decode(*overrides: str, env: dict | None = None, wait: bool = True, python: str = sys.executable):
    command = [python, "-m", "experiments.decode", "-m", *overrides]
    if not wait:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def sweep_folders(results_dir: Path) -> list[Path]:
    return sorted(p for p in results_dir.iterdir() if p.is_dir())


def scontrol_job(job_id: str, env: dict) -> dict[str, str]:
    """`scontrol show job` of one job (an array task by its own id: 12_3), as {key: value}."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return dict(field.split("=", 1) for field in proc.stdout.split() if "=" in field)


@pytest.fixture(scope="module")
def swept(slurm_env, tmp_path_factory):
    """launcher -> results_dir of the batch 1,2 sweep under it (the basic launcher, or SLURM)."""
    done: dict[str, Path] = {}

    def results_dir(launcher: str) -> Path:
        if launcher not in done:
            directory = tmp_path_factory.mktemp(launcher)
            extra = ["hydra/launcher=slurm", *ON_THIS_NODE] if launcher == "slurm" else []
            proc = decode(*POINTS, "batch_size=1,2", f"results_dir={directory}", *extra, env=slurm_env)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            done[launcher] = directory
        return done[launcher]

    return results_dir


def test_a_slurm_multirun_yields_the_rows_of_the_basic_launcher(swept):
    expected = disk.load(swept("basic")).set_index("point_id").sort_index()
    got = disk.load(swept("slurm")).set_index("point_id").sort_index()
    assert len(expected) == 2 and list(got.index) == list(expected.index)  # the same points, each once
    assert (got["status"] == "ok").all()
    assert got[SAME].equals(expected[SAME])  # same config, same greedy tokens (fp32 on the CPU)
    assert expected["slurm_job_id"].isna().all()  # the basic launcher's points ran in no SLURM job


def test_each_point_ran_as_its_own_slurm_job(swept, slurm_env):
    (sweep_folder,) = sweep_folders(swept("slurm"))
    rows = disk.load(sweep_folder)
    jobs = set(rows["slurm_job_id"])
    assert len(jobs) == 2 and None not in jobs  # two jobs, one row each
    for job in jobs:
        info = scontrol_job(job, slurm_env)
        assert info["JobState"] == "COMPLETED" and info["BatchFlag"] == "1", info  # an sbatch job that ended well
        (log,) = sweep_folder.glob(f".submitit/{job}/{job}_0_log.out")  # submitit's log of that job, beside the rows
        started = JOB_STARTED.search(log.read_text())
        assert started and started["job"] == job and started["host"] == info["BatchHost"]


def _array_job(sweep_folder: Path) -> str | None:
    """The job array a submitit sweep submitted: its folder under .submitit/ is named by the bare array id."""
    ids = [p.name for p in sweep_folder.glob(".submitit/*") if p.name.isdigit()]
    return ids[0] if ids else None


def test_a_cancelled_array_reruns_only_its_missing_points(slurm_env, tmp_path):
    # One task at a time, so that cancelling the array after its first row leaves points never started.
    sweep = [*POINTS, "batch_size=1,2", f"results_dir={tmp_path}", "hydra/launcher=slurm", *ON_THIS_NODE,
             "hydra.launcher.array_parallelism=1"]  # fmt: skip
    first = decode(*sweep, env=slurm_env, wait=False)
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("*/*.parquet")) and time.monotonic() < deadline:
            assert first.poll() is None, first.stdout.read()
            time.sleep(0.5)
        (sweep_folder,) = sweep_folders(tmp_path)
        array = _array_job(sweep_folder)
        assert array is not None
        subprocess.run(["scancel", array], env=slurm_env, check=True)
        # The sweep process learns the jobs ended without results (squeue: no accounting here) and fails.
        output, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0, output
    cancelled = disk.load(sweep_folder)
    assert len(cancelled) == 1 and (cancelled["status"] == "ok").all()  # the second was cancelled, queued or running

    rerun = decode(*sweep, env=slurm_env)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    (rerun_folder,) = [p for p in sweep_folders(tmp_path) if p != sweep_folder]
    measured = disk.load(rerun_folder)
    # Only the missing points were measured; the rows recorded before the cancel are intact and counted.
    assert set(measured["point_id"]).isdisjoint(cancelled["point_id"])
    assert len(measured) == 1 and (measured["status"] == "ok").all()
    assert set(disk.load(tmp_path)["batch_size"]) == {1, 2}
    assert disk.load(sweep_folder).equals(cancelled)


def torch_build(name: str) -> str:
    """The Python of a torch build's environment beside this one: the CPU build is the suite's own (.venv), the
    CUDA build make test-cuda-trace's (.venv-cuda), which is what `pip install torch` gives every GPU cluster."""
    if name == "cpu":
        return sys.executable
    python = Path(sys.prefix).parent / ".venv-cuda" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{python} is absent (make .venv-cuda/.installed brings the CUDA build of torch)")
    return str(python)


@pytest.mark.parametrize("build", ["cpu", "cuda"])
def test_a_point_past_its_jobs_memory_becomes_an_oom_row(slurm_env, tmp_path, build):
    # The small model's fp32 weights alone (0.8 GB) pass a 1 GB job less its job process. Which process passes the
    # limit first depends on the build: with the CPU one, the worker's cap (taken from the job's memory) makes its
    # allocation fail, an `oom` row the job writes; with the CUDA one, the job process and the worker hold ~0.7 GB
    # each before any work (torch's CUDA libraries; the README's SLURM section), so SLURM's poll kills the step
    # first (OverMemoryKill) and the submitting process writes the row from the job's state and log. There two
    # points: the sweep goes on past the first (the backstop off, so the second is measured), each naming its job.
    batches = "1" if build == "cpu" else "1,2"  # the CPU build's job writes its own row: one point shows it
    proc = decode(*POINTS, "model=small", f"batch_size={batches}", "oom_backstop=false", f"results_dir={tmp_path}",
                  "hydra/launcher=slurm", *ON_THIS_NODE, "hydra.launcher.mem_gb=1", env=slurm_env,
                  python=torch_build(build))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = disk.load(tmp_path).sort_values("batch_size").to_dict("records")
    assert [str(row["batch_size"]) for row in rows] == batches.split(",")
    for row in rows:
        assert row["status"] == "oom", row["error"]
        assert "SLURM job" in row["error"] and "hydra.launcher.mem_gb" in row["error"], row["error"]
        state = scontrol_job(row["slurm_job_id"], slurm_env)["JobState"]
        if "before its point reported" in row["error"]:  # written by the submitting side: SLURM killed the job
            assert state in ("FAILED", "OUT_OF_MEMORY", "CANCELLED"), state
            assert pd.isna(row["device_name"]) and row["host"]  # the node's columns: unknown, its name from SLURM
        else:  # written by the job: the worker's cap came first and the job itself ended well
            assert state == "COMPLETED", state
    assert len({row["slurm_job_id"] for row in rows}) == len(rows)


def test_make_slurm_check_submits_one_point_and_reads_its_row(slurm_env, tmp_path):
    # What the README tells a user to run against their own cluster, here against this one (with this Python, and
    # without make's set-up step: the suite already runs inside it).
    make = ["make", "--no-print-directory", "-o", ".venv/.installed", f"BIN={Path(sys.executable).parent}"]
    proc = subprocess.run(
        [*make, "slurm-check", "PARTITION=debug", f"SLURM_RESULTS={tmp_path}", "SLURM_ARGS=" + " ".join(ON_THIS_NODE)],
        cwd=ROOT,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = disk.load(tmp_path).to_dict("records")
    assert row["status"] == "ok" and row["slurm_job_id"]
    assert f"slurm-check: ok, measured in SLURM job {row['slurm_job_id']}" in proc.stdout


def _carrying(text: str) -> list[int]:
    """The pids of the processes whose environment holds the line `text`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "environ").read_bytes().decode(errors="replace").split("\0"):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_down_leaves_no_process_of_the_cluster_behind(slurm_env, tmp_path):
    # A second cluster of its own (its own folder and ports), with a job still running when it is brought down.
    if missing := _missing():
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing)")
    own = slurm_env | {"KVBENCH_SLURM_DIR": str(tmp_path / "cluster"), "KVBENCH_SLURM_CTLD_PORT": "16827",
                       "KVBENCH_SLURM_SLURMD_PORT": "16828"}  # fmt: skip
    own.pop("SLURM_CONF", None)
    up = subprocess.run(["bash", str(SCRIPT), "up"], env=own, capture_output=True, text=True, timeout=120)
    conf = f"SLURM_CONF={tmp_path / 'cluster' / 'slurm.conf'}"
    try:
        assert up.returncode == 0, up.stderr
        job = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 300"],
                             env=own | {"SLURM_CONF": conf.split("=", 1)[1]}, capture_output=True, text=True)  # fmt: skip
        assert job.returncode == 0, job.stderr
        deadline = time.monotonic() + 60
        while not [p for p in _carrying(conf) if "sleep" in _cmdline(p)]:
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.5)
        assert _carrying(f"KVBENCH_SLURM_CLUSTER={tmp_path / 'cluster'}")  # the daemons, marked
    finally:
        down = subprocess.run(["bash", str(SCRIPT), "down"], env=own, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not _carrying(f"KVBENCH_SLURM_CLUSTER={tmp_path / 'cluster'}")  # munged, slurmctld, slurmd, slurmstepd
    assert not [p for p in _carrying(conf) if p != os.getpid()]  # nor the job's own processes
    assert not (tmp_path / "cluster").exists()
    assert _answers(slurm_env | {"SLURM_CONF": slurm_env["SLURM_CONF"]})  # the suite's own cluster is untouched


def test_a_node_that_never_becomes_idle_fails_up_in_one_line_and_leaves_nothing(slurm_env, tmp_path):
    own = slurm_env | {"KVBENCH_SLURM_DIR": str(tmp_path / "cluster"), "KVBENCH_SLURM_CTLD_PORT": "16837",
                       "KVBENCH_SLURM_SLURMD_PORT": "16838", "KVBENCH_SLURM_WAIT_S": "0"}  # fmt: skip
    own.pop("SLURM_CONF", None)
    up = subprocess.run(["bash", str(SCRIPT), "up"], env=own, capture_output=True, text=True, timeout=120)
    assert up.returncode != 0
    assert up.stderr.strip().count("\n") == 0 and "did not become idle within 0s" in up.stderr, up.stderr
    assert not _carrying(f"KVBENCH_SLURM_CLUSTER={tmp_path / 'cluster'}") and not (tmp_path / "cluster").exists()
