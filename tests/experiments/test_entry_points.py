"""Every entry point reports bad input the one way (harness.errors.exit_on_config_error): one line on stderr naming
the field, exit status 2, before any heavy work. And the runs a newcomer starts first (make run, make serve-quick)
end with the next step: where their rows went and how to look at them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import ConfigError
from harness.store import summary

ROOT = Path(__file__).resolve().parents[2]


def stopped_with_one_line(capsys, main, *args) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(*args)
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ("1,x", "--points: '1,x' is not a comma-separated list of integers; allowed: e.g. 1,2,4,8"),
        ("4", "--points: needs at least two positive sizes, got '4'"),
        ("0,2", "--points: needs at least two positive sizes, got '0,2'"),
    ],
)
def test_sweep_cost_refuses_bad_points_with_one_line_before_any_sweep(capsys, points, message):
    from experiments import sweep_cost

    line = stopped_with_one_line(capsys, sweep_cost.main, ["--points", points])
    assert line.startswith("kvbench: bad config: ") and message in line


def test_gpu_check_plan_reports_a_bad_preset_with_one_line(capsys, monkeypatch):
    from experiments import gpu_check

    def bad_preset(**kwargs):
        raise ConfigError("batch_size: must be positive, got 0")

    monkeypatch.setattr(gpu_check, "plan_table", bad_preset)
    line = stopped_with_one_line(capsys, gpu_check.main, ["plan"])
    assert line == "kvbench: bad config: batch_size: must be positive, got 0"


@pytest.mark.parametrize("module", ["experiments.decode", "experiments.ceilings"])
def test_the_hydra_entry_points_run_their_job_through_the_wrapper(module):
    """Hydra's own wrapper calls the job it was given: that job is exit_on_config_error's, around the function."""
    import importlib

    main = importlib.import_module(module).main
    job = main.__wrapped__  # what @hydra.main wraps
    assert job.__code__.co_name == "wrapper" and job.__wrapped__.__name__ == "main"


def run_module(module: str, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", module, *overrides]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_sweep_ends_by_printing_the_next_step_with_its_folder(tmp_path):
    """make run is a multirun of experiments.decode: its last line names the dashboard and the sweep's folder."""
    tiny = ["model=tiny", "prompt_len=8", "gen_len=4", "warmup=0", "min_repeats=2", "max_repeats=2", "isolate=false"]
    done = run_module("experiments.decode", "-m", *tiny, "cache=contiguous", "ceilings_quick=true",
                      f"ceilings_dir={tmp_path / 'ceilings'}", f"results_dir={tmp_path}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    (sweep_dir,) = [path for path in tmp_path.iterdir() if path.name != "ceilings"]
    assert done.stdout.splitlines()[-1] == (
        f"next: KVBENCH_RESULTS={tmp_path} make dashboard  (or: {summary.results_command()} show {sweep_dir})"
    )


@pytest.mark.slow
def test_a_serving_run_ends_by_printing_the_next_step_with_its_folder(tmp_path):
    """make serve-quick: the Serving page draws the run (kvbench-results reads point rows, not serving runs)."""
    done = run_module("experiments.serve", "model=tiny", "max_model_len=256", "dtype=fp32", "kv_memory_gb=0.002",
                      "num_prompts=4", "qps=inf", "prompt_len=16", "output_len=4", "run_id=one",
                      f"results_dir={tmp_path}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == (
        f"next: KVBENCH_RESULTS={tmp_path} make dashboard, its Serving page  (this run: {tmp_path / 'serve' / 'one'})"
    )


def test_the_next_step_under_the_default_results_folder_is_plain_make_dashboard(monkeypatch):
    monkeypatch.setattr(summary, "results_command", lambda: "kvbench-results")
    line = summary.next_step(Path("results/20261204-010000"), results_dir="results")
    assert line == "next: make dashboard  (or: kvbench-results show results/20261204-010000)"


def test_kvbench_results_off_path_is_named_beside_the_interpreter(monkeypatch, tmp_path):
    """Under make the venv is not activated: the line names .venv/bin/kvbench-results, which runs as printed."""
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "kvbench-results").touch()
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    assert summary.results_command() == ".venv/bin/kvbench-results"
