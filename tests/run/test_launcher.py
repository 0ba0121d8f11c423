"""Scale-out through hydra-submitit-launcher: a submitit_local multirun yields the same rows as the basic launcher.

The same code path a SLURM sweep takes (submitit pickles the job, runs it in another process, which writes its own
row into the shared results_dir), with real subprocesses and no cluster. Each launcher sweeps once per module.
"""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest

from harness.store import disk
from tests.run.test_sweep import ROOT, TINY

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher is not installed")
pytestmark = pytest.mark.slow

# Two points: enough to pair with the basic launcher and to see that one waits for the other.
POINTS = [*TINY, "dtype=fp32", "prompt_len=8", "profile=false", "batch_size=1,2"]
SAME = ["model", "batch_size", "prompt_len", "gen_len", "cache", "dtype", "kv_dtype", "status", "output_digest"]
# kvbench's preset (conf/hydra/launcher/local.yaml). The plugin's own submitit_local runs the same LocalLauncher
# without the lock; tests/run/test_slurm.py runs the SLURM one against a real cluster.
SUBMITIT = ["local"]
# submitit's job log: "submitit INFO (2026-12-01 01:40:34,531) - Starting with JobEnvironment(...)"
LOG_LINE = re.compile(r"^submitit INFO \((?P<at>[\d-]+ [\d:,]+)\) - (?P<event>Starting|Job completed)", re.MULTILINE)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """launcher -> the results_dir of the POINTS sweep run under it (run on first use)."""
    done: dict[str, Path] = {}

    def results_dir(launcher: str) -> Path:
        if launcher not in done:
            directory = tmp_path_factory.mktemp(launcher)
            command = [sys.executable, "-m", "experiments.decode", "-m", *POINTS, f"hydra/launcher={launcher}",
                       f"results_dir={directory}"]  # fmt: skip
            proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr
            done[launcher] = directory
        return done[launcher]

    return results_dir


def job_spans(sweep_folder: Path) -> list[tuple[dt.datetime, dt.datetime]]:
    """(start, end) of every submitit job of a sweep, from its log in <sweep folder>/.submitit/<job id>/."""
    spans = []
    for log in sweep_folder.glob(".submitit/*/*_log.out"):
        at = {
            m["event"]: dt.datetime.strptime(m["at"], "%Y-%m-%d %H:%M:%S,%f")
            for m in LOG_LINE.finditer(log.read_text())
        }
        spans.append((at["Starting"], at["Job completed"]))
    return sorted(spans)


@pytest.mark.parametrize("launcher", SUBMITIT)
def test_a_submitit_multirun_yields_the_rows_of_the_basic_launcher(swept, launcher):
    expected = disk.load(swept("basic")).set_index("point_id").sort_index()
    got = disk.load(swept(launcher)).set_index("point_id").sort_index()
    assert len(expected) == 2 and list(got.index) == list(expected.index)  # the same points, each once
    assert (got["status"] == "ok").all()
    assert got[SAME].equals(expected[SAME])  # same config, same greedy tokens (fp32 on the CPU)


@pytest.mark.parametrize("launcher", SUBMITIT)
def test_every_submitit_job_writes_into_the_one_sweep_folder(swept, launcher):
    # hydra.sweep.dir is ${results_dir}/${now:...}: the parent resolves it, and each job, though it composes its
    # config in its own process seconds later, gets that same value (the pickled config carries the resolver cache).
    (sweep_folder,) = [p for p in swept(launcher).iterdir() if p.is_dir()]
    assert (disk.load(sweep_folder)["sweep_id"] == sweep_folder.name).all()
    assert len(job_spans(sweep_folder)) == 2  # and each point really ran as a submitit job


def test_the_local_preset_measures_one_point_at_a_time(swept):
    # submitit's local executor starts every job at once; the preset's lock makes each wait for the one before.
    (sweep_folder,) = [p for p in swept("local").iterdir() if p.is_dir()]
    spans = job_spans(sweep_folder)
    assert len(spans) == 2
    for (_, end), (next_start, _) in pairwise(spans):
        assert next_start >= end, spans
    # So the last job started seconds after the sweep folder was named, and still wrote into it.
    assert spans[-1][0] > dt.datetime.strptime(sweep_folder.name, "%Y%m%d-%H%M%S") + dt.timedelta(seconds=1)


def test_the_slurm_preset_composes_with_one_gpu_per_job_and_its_overrides():
    command = [sys.executable, "-m", "experiments.decode", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
               "hydra.launcher.timeout_min=120", "--cfg", "hydra", "--package", "hydra.launcher"]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for line in ("gpus_per_node: 1", "partition: gpu", "timeout_min: 120", "array_parallelism: 16", "SlurmLauncher"):
        assert line in proc.stdout
