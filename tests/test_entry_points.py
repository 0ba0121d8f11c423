"""Every entry point reports bad input the one way (harness.errors.exit_on_config_error): one line on stderr naming
the field, exit status 2, before any heavy work."""

from __future__ import annotations

import pytest

from harness.errors import ConfigError


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
