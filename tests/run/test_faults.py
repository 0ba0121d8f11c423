"""Sweeps that survive: every fault the harness promises to survive, injected for real.

A sweep killed with SIGKILL mid-point, a measuring process that segfaults or is killed, two sweeps writing into one
results_dir at once, a full disk, corrupt files in the results tree; then resume, force, and the OOM backstop that
keeps a sweep from running point after point into the same wall. Each test fails if its guarantee breaks.
"""

from __future__ import annotations

import ctypes
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from harness.config import RunConfig
from harness.run import runner
from harness.store import disk, maintain
from tests.run.test_sweep import ROOT, TINY, broken_checkpoint, kvbench

pytestmark = pytest.mark.slow

QUICK = [*TINY, "profile=false"]  # these tests are about rows surviving, not about what is in them: no profiler pass
# ... and where the point's own process is not what a test is about, the point runs in the sweep's (isolate=false):
# a spawned worker costs seconds of interpreter and torch import per invocation.
IN_PROCESS = [*QUICK, "isolate=false"]

# One repeat, never retried for noise (retry_noisy=false): these points are about their process, not their figures.
FAST_POINT = dict(model={"name": "tiny"}, device="cpu", dtype="fp32", prompt_len=8, gen_len=4, warmup=0,
                  min_repeats=1, max_repeats=1, retry_noisy=False, profile=False, roofline=False,
                  accuracy=False)  # fmt: skip


def sweep_command(results_dir: Path, *overrides: str, base: list[str] = QUICK) -> list[str]:
    return [sys.executable, "-m", "experiments.decode", "-m", *base, "dtype=fp32", *overrides,
            f"results_dir={results_dir}"]  # fmt: skip


def point_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.parquet") if not p.name.endswith(disk.OPS_SUFFIX))


@pytest.fixture(scope="module")
def points():
    """One Runner for the module's tests of the measuring process: each test's first point takes the worker the
    previous test left warm, if any, instead of spawning its own (seconds of interpreter and torch import each). A
    test that kills its worker or closes it needs none: the Runner spawns a fresh one for the next point."""
    with runner.Runner() as shared:
        yield shared


@pytest.fixture(scope="module")
def two_points(tmp_path_factory) -> Path:
    """A results folder holding a finished two-point sweep (batch 1, 2), swept once for the module: a test that
    writes into it works on its own copy (`copy_of`)."""
    directory = tmp_path_factory.mktemp("two-points")
    proc = kvbench(*IN_PROCESS, "batch_size=1,2", f"results_dir={directory}", multirun=True)
    assert proc.returncode == 0, proc.stderr
    return directory


def copy_of(results: Path, directory: Path) -> Path:
    shutil.copytree(results, directory)
    return directory


# ------------------------------------------------------------------------------------------------ killed mid-sweep


def test_a_sweep_killed_mid_point_keeps_every_finished_row_and_resume_completes_exactly_the_rest(tmp_path):
    batches = [1, 2, 3, 4]  # killed once two rows are written: the third is being measured, the fourth never was
    command = sweep_command(
        tmp_path,
        f"batch_size={','.join(map(str, batches))}",
        "prompt_len=64",
        "min_repeats=3",
        "max_repeats=3",
        base=TINY,
    )  # fmt: skip: with the profiler pass, each point takes seconds
    sweep = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while len(point_files(tmp_path)) < 2 and time.monotonic() < deadline and sweep.poll() is None:
            time.sleep(0.05)
        assert sweep.poll() is None, "the sweep finished before it could be killed: make its points slower"
        sweep.send_signal(signal.SIGKILL)  # mid-sweep: the third point is being measured or about to be
        sweep.wait()
    finally:
        sweep.kill()
    time.sleep(1)  # its worker dies with it (PR_SET_PDEATHSIG)
    # A write cut short leaves only a hidden temp file; one is planted here too, half a row long.
    finished = point_files(tmp_path)
    (finished[0].parent / f".{finished[0].name}.tmp-999999").write_bytes(finished[0].read_bytes()[:200])

    before = disk.load(tmp_path)
    assert 2 <= len(before) < len(batches)
    assert (before["status"] == "ok").all() and before["tpot_ms"].notna().all()  # whole rows, nothing partial

    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    after = disk.load(tmp_path)
    assert sorted(after["batch_size"]) == batches  # every point exactly once
    assert after["point_id"].is_unique
    # The earlier rows are untouched and the rerun measured only what was missing.
    kept = after[after["point_id"].isin(before["point_id"])]
    assert kept.set_index("point_id")["started_at"].to_dict() == before.set_index("point_id")["started_at"].to_dict()
    assert f"resumed: {len(before)} of them already recorded" in proc.stdout
    assert after["sweep_id"].nunique() == 2


# ------------------------------------------------------------------------------------- a measuring process dies


class SegfaultingConfig(RunConfig):
    """A point whose measuring process segfaults as it receives it (unpickling reads address 0)."""

    def __reduce__(self):
        return ctypes.string_at, (0,)


class KilledConfig(RunConfig):
    """A point whose measuring process is killed (SIGKILL) as it receives it."""

    def __reduce__(self):
        return signal.raise_signal, (signal.SIGKILL,)


@pytest.mark.parametrize(("config", "signal_name"), [(SegfaultingConfig, "SIGSEGV"), (KilledConfig, "SIGKILL")])
def test_a_measuring_process_that_dies_is_an_error_row_with_its_signal_and_the_next_point_runs(
    points, config, signal_name
):
    row = points.run_point(config(**FAST_POINT)).row
    assert row["status"] == "error"
    assert f"killed by signal {signal_name}" in row["error"]
    assert row["point_id"] == RunConfig(**FAST_POINT).point_id() and row["model"] == "tiny"
    assert points.warm is None  # the dead worker is not kept
    assert points.run_point(RunConfig(**FAST_POINT)).row["status"] == "ok"  # a fresh worker took over


def test_a_warm_worker_serves_the_next_point_and_reports_that_points_own_peak(points):
    points.run_point(RunConfig(**FAST_POINT))
    worker = points.warm
    assert worker is not None and worker.alive()
    # ~1 GB of KV (4096 x 68 tokens at 3.4 KB each) over the runtime's ~0.5 GB: a peak far above the small point's
    big = points.run_point(RunConfig(**FAST_POINT | dict(batch_size=4096, prompt_len=64)))
    assert points.warm is worker  # the same process measured the second point
    small_warm = points.run_point(RunConfig(**FAST_POINT)).row
    small_fresh = points.run_point(RunConfig(**FAST_POINT, reuse_worker=False)).row
    assert points.warm is None  # reuse_worker=false: that worker was closed
    # The big point's peak must not leak into the small one measured after it in the same process.
    assert big.row["peak_mem_bytes"] > 2 * small_fresh["peak_mem_bytes"]
    assert small_warm["peak_mem_bytes"] < 1.25 * small_fresh["peak_mem_bytes"]


def test_a_worker_is_not_reused_after_a_capped_point(points):
    assert points.run_point(RunConfig(**FAST_POINT, max_memory_gb=4.0)).row["status"] == "ok"
    assert points.warm is None


# ------------------------------------------------------------------------------------------- concurrent sweeps


def test_two_sweeps_writing_into_one_results_dir_at_once_lose_no_row(tmp_path):
    first = subprocess.Popen(sweep_command(tmp_path, "batch_size=1,2,3", base=IN_PROCESS), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    second = subprocess.Popen(sweep_command(tmp_path, "batch_size=4,5,6", base=IN_PROCESS), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    for proc in (first, second):
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr
    table = disk.load(tmp_path)
    assert sorted(table["batch_size"]) == [1, 2, 3, 4, 5, 6]
    assert (table["status"] == "ok").all() and table["point_id"].is_unique


# ------------------------------------------------------------------------------------------------- a full disk


def test_a_full_disk_stops_the_sweep_with_one_line_and_damages_nothing_written(two_points, tmp_path):
    results = copy_of(two_points, tmp_path / "results")
    before = disk.load(results)
    files = {path: path.read_bytes() for path in point_files(results)}

    def full_disk() -> None:  # no file may grow past 6 KiB: a row (~30 KiB) cannot be written
        resource.setrlimit(resource.RLIMIT_FSIZE, (6 * 1024, 6 * 1024))

    proc = subprocess.run(sweep_command(results, "batch_size=3,4", base=IN_PROCESS), cwd=ROOT, capture_output=True, text=True,
                          timeout=600, preexec_fn=full_disk)  # fmt: skip
    assert proc.returncode != 0
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("kvbench: cannot write results")]
    assert "File too large" in line and "not recorded" in line
    assert {path: path.read_bytes() for path in point_files(results)} == files  # nothing damaged, nothing added
    pd.testing.assert_frame_equal(disk.load(results), before)
    assert not [p for p in results.rglob(".*.tmp-*")]  # the cut-short write cleaned up after itself


def test_a_read_only_results_dir_raises_a_clear_error_and_keeps_the_row_there(tmp_path, monkeypatch):
    row = {"point_id": "abc", "sweep_id": "s", "status": "ok", "model": "tiny", "batch_size": 1}
    path = disk.write_point(row, tmp_path)
    original = path.read_bytes()

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")  # EROFS: what root sees on a read-only mount

    monkeypatch.setattr(disk.pq, "write_table", read_only)
    with pytest.raises(OSError, match="Read-only file system"):
        disk.write_point(row | {"batch_size": 2}, tmp_path)
    assert path.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == ["abc.parquet"]


# ------------------------------------------------------------------------------------------------------ corrupt files


def test_corrupt_files_are_skipped_by_load_export_and_the_dashboard_with_every_other_row(tmp_path, caplog):
    from dashboard import data

    for batch in (1, 2, 3):
        disk.write_point({"point_id": f"p{batch}", "sweep_id": "s", "status": "ok", "batch_size": batch}, tmp_path)
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet at all" * 20)
    (tmp_path / "truncated.parquet").write_bytes((tmp_path / "p1.parquet").read_bytes()[:300])
    skipped: list[str] = []
    assert sorted(disk.load(tmp_path, skipped=skipped)["batch_size"]) == [1, 2, 3]
    assert sorted(Path(line.split(": ")[0]).name for line in skipped) == ["garbage.parquet", "truncated.parquet"]
    assert "garbage.parquet" in caplog.text and "truncated.parquet" in caplog.text
    out = maintain.export(tmp_path, tmp_path / "all.csv")
    assert len(pd.read_csv(out)) == 3
    rows, dashboard_skipped = data.load_rows((str(tmp_path),))
    assert len(rows) == 3 and len(dashboard_skipped) == 2


# --------------------------------------------------------------------------------------- resume, force, backstop


def test_a_rerun_skips_recorded_points_and_force_measures_them_again(two_points, tmp_path):
    results = copy_of(two_points, tmp_path / "results")  # batch 1 and 2, swept (IN_PROCESS) by the fixture
    again = kvbench(*IN_PROCESS, "batch_size=1,2,3", f"results_dir={results}", multirun=True)
    assert again.returncode == 0, again.stderr
    assert "resumed: 2 of them already recorded" in again.stdout and "3 points" in again.stdout
    assert sorted(disk.load(results)["batch_size"]) == [1, 2, 3]
    forced = kvbench(*IN_PROCESS, "batch_size=1,2", "force=true", f"results_dir={results}", multirun=True)
    assert forced.returncode == 0, forced.stderr
    assert "resumed" not in forced.stdout
    assert sorted(disk.load(results)["batch_size"]) == [1, 1, 2, 2, 3]


def test_error_points_are_retried_and_committed_references_never_count(tmp_path):
    checkpoint = broken_checkpoint(tmp_path / "broken")
    out = tmp_path / "results"
    for _ in range(2):
        assert kvbench(*IN_PROCESS, "prompt_len=8", f"weights={checkpoint}", f"results_dir={out}").returncode == 0
    assert list(disk.load(out)["status"]) == ["error", "error"]  # measured twice: an error is retried
    # An ok row under <results_dir>/reference is a committed reference, not this user's run: measured anyway.
    ok = kvbench(*IN_PROCESS, "prompt_len=8", f"results_dir={out / 'reference'}")
    assert ok.returncode == 0, ok.stderr
    rerun = kvbench(*IN_PROCESS, "prompt_len=8", f"results_dir={out}")
    assert "already recorded" not in rerun.stdout
    assert (disk.load(out)["status"] == "ok").sum() == 2


def test_the_oom_backstop_skips_points_that_need_more_than_an_oom_and_names_it(tmp_path):
    # A 1 GiB cap: batch 2048 at 1k tokens needs ~1.1 GB of KV and runs out; 4096 needs more (skipped, never run);
    # batch 1 needs less (measured).
    overrides = [*QUICK, "prompt_len=1024", "cache=contiguous", "max_memory_gb=1.0", f"results_dir={tmp_path}"]
    proc = kvbench(*overrides, "batch_size=2048,4096,1", multirun=True)
    assert proc.returncode == 0, proc.stderr
    table = disk.load(tmp_path).set_index("batch_size")
    assert table.loc[2048, "status"] == "oom"
    assert table.loc[4096, "status"] == "skipped_oom"
    assert table.loc[2048, "point_id"] in table.loc[4096, "error"] and "batch 2048" in table.loc[4096, "error"]
    assert table.loc[1, "status"] == "ok"
    # Points added to the same sweep later are held to its OOMs too, unless the backstop is off.
    sweep_dir = f"hydra.sweep.dir={tmp_path / table['sweep_id'].iloc[0]}"
    assert kvbench(*overrides, "batch_size=8192", sweep_dir, multirun=True).returncode == 0
    off = kvbench(*overrides, "batch_size=16384", "oom_backstop=false", sweep_dir, multirun=True)
    assert off.returncode == 0, off.stderr
    table = disk.load(tmp_path).set_index("batch_size")
    assert table.loc[8192, "status"] == "skipped_oom"
    assert table.loc[16384, "status"] == "oom"  # measured, into the wall


def test_a_sweep_folder_outside_results_dir_is_refused_before_anything_runs(tmp_path):
    proc = kvbench(*QUICK, f"results_dir={tmp_path / 'results'}", f"hydra.run.dir={tmp_path / 'elsewhere'}")
    assert proc.returncode == 2
    assert "is not a folder inside results_dir" in proc.stderr
    assert not list(tmp_path.rglob("*.parquet"))


def test_point_ids_ignore_how_a_point_runs():
    base = RunConfig(**FAST_POINT)
    for change in (dict(force=True), dict(oom_backstop=False), dict(reuse_worker=False), dict(results_dir="x")):
        assert RunConfig(**FAST_POINT, **change).point_id() == base.point_id()


def test_no_config_value_is_ever_evaluated_as_code():
    # Configs are data: Hydra/OmegaConf interpolate ${...} with registered resolvers only, and nothing here evals.
    sources = [
        *(ROOT / "harness").rglob("*.py"),
        *(ROOT / "experiments").glob("*.py"),
        *(ROOT / "dashboard").rglob("*.py"),
    ]
    call = re.compile(r"(?<![.\w])(eval|exec)\(|pickle\.loads?\(|torch\.load\(")  # model.eval() is no eval
    offenders = [str(p) for p in sources if call.search(p.read_text())]
    assert offenders == []


def test_a_pickled_checkpoint_is_refused_with_one_line(tmp_path):
    from harness.errors import ConfigError

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"a pickle could run anything on load")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors files \(pickled \.bin checkpoints are not read\)"):
        RunConfig(**FAST_POINT | {"weights": str(tmp_path)})
