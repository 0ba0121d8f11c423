"""Scale-out through hydra-submitit-launcher: a submitit_local multirun yields the same rows as the basic launcher.

The same code path a SLURM sweep takes (submitit pickles the job, runs it in another process, which writes its own
row into the shared results_dir), with real subprocesses and no cluster.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness import results
from tests.test_sweep import ROOT, TINY

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher is not installed")
pytestmark = pytest.mark.slow

POINTS = [*TINY, "dtype=fp32", "prompt_len=8", "profile=false", "batch_size=1,2", "cache=contiguous,paged"]
SAME = ["model", "batch_size", "prompt_len", "gen_len", "cache", "dtype", "kv_dtype", "status", "output_digest"]


def sweep(results_dir, *launcher: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "experiments.decode", "-m", *POINTS, *launcher, f"results_dir={results_dir}"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("launcher", ["submitit_local", "local"])  # the plugin's own config, and kvbench's preset
def test_a_submitit_local_multirun_yields_the_rows_of_the_basic_launcher(tmp_path, launcher):
    basic = sweep(tmp_path / "basic")
    submitit = sweep(tmp_path / "submitit", f"hydra/launcher={launcher}")
    assert basic.returncode == 0, basic.stderr
    assert submitit.returncode == 0, submitit.stderr
    expected = results.load(tmp_path / "basic").set_index("point_id").sort_index()
    got = results.load(tmp_path / "submitit").set_index("point_id").sort_index()
    assert len(expected) == 4 and list(got.index) == list(expected.index)  # the same points, each once
    assert (got["status"] == "ok").all()
    assert got[SAME].equals(expected[SAME])  # same config, same greedy tokens
    assert got["sweep_id"].nunique() == 1  # every job wrote into the one sweep folder
    assert list((tmp_path / "submitit").glob("*/.submitit"))  # and it really went through submitit


def test_the_slurm_preset_composes_with_one_gpu_per_job_and_its_overrides():
    command = [sys.executable, "-m", "experiments.decode", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
               "hydra.launcher.timeout_min=120", "--cfg", "hydra", "--package", "hydra.launcher"]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for line in ("gpus_per_node: 1", "partition: gpu", "timeout_min: 120", "array_parallelism: 16", "SlurmLauncher"):
        assert line in proc.stdout
