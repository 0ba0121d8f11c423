"""The sweep callbacks' expansion of a multirun into jobs, and their validation of every point before the first runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

import experiments.decode  # noqa: F401  (registers run_config in Hydra's ConfigStore)
from experiments.callbacks import sweep_jobs, validate_points

CONF = Path(__file__).resolve().parents[2] / "conf"
# The decode app's presets; serve-* presets belong to experiments.serve (tests/serve/test_serve_experiment.py).
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml") if not p.stem.startswith("serve-"))


@pytest.fixture()
def hydra_context():
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        yield


def multirun_config(*overrides: str):
    return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def command_line(params: dict[str, str], *task: str):
    """What sweep_jobs reads of a multirun's config: the sweeper's params and the command line's overrides (compose
    refuses sweep overrides outside a multirun, so they are set here as Hydra sets them)."""
    return OmegaConf.create({"hydra": {"sweeper": {"params": params}, "overrides": {"task": list(task)}}})


def basic_sweeper_jobs(config) -> list[list[str]]:
    """The oracle: Hydra's own basic sweeper (private API, imported by this test only) on the same overrides."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
    overrides = OverridesParser.create().parse_overrides(params + list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_expands_into_the_jobs_the_basic_sweeper_runs(hydra_context, experiment):
    config = multirun_config(f"experiment={experiment}")
    assert sweep_jobs(config) == basic_sweeper_jobs(config)


def test_a_sweep_is_every_combination_the_last_key_fastest_with_plain_overrides_in_each_job():
    preset = {"cache": "none,contiguous,paged", "prompt_len": "32,128,512"}
    config = command_line(preset, "experiment=quickstart", "dtype=bf16", "batch_size=1,4")
    jobs = sweep_jobs(config)
    assert len(jobs) == 3 * 3 * 2  # cache x prompt_len from the preset, batch_size from the command line
    assert jobs[:3] == [
        ["cache=none", "prompt_len=32", "experiment=quickstart", "dtype=bf16", "batch_size=1"],
        ["cache=none", "prompt_len=32", "experiment=quickstart", "dtype=bf16", "batch_size=4"],
        ["cache=none", "prompt_len=128", "experiment=quickstart", "dtype=bf16", "batch_size=1"],
    ]
    assert jobs == basic_sweeper_jobs(config)


def test_a_command_line_override_replaces_the_presets_values_of_that_key_in_place():
    config = command_line({"cache": "none,paged", "prompt_len": "32,128"}, "cache=contiguous,paged")
    assert sweep_jobs(config) == [
        [f"cache={cache}", f"prompt_len={n}"] for cache in ("contiguous", "paged") for n in (32, 128)
    ]
    assert sweep_jobs(config) == basic_sweeper_jobs(config)


def test_range_sweeps_expand_and_interval_sweeps_are_refused():
    assert sweep_jobs(command_line({}, "seed=range(0,3)")) == [["seed=0"], ["seed=1"], ["seed=2"]]
    with pytest.raises(HydraException, match="does not support sweep type INTERVAL_SWEEP"):
        sweep_jobs(command_line({}, "max_time_s=interval(1,2)"))


def test_a_bad_point_stops_the_sweep_with_one_line_naming_it(hydra_context, capsys):
    with pytest.raises(SystemExit) as stopped:
        validate_points([["model=tiny", "batch_size=1"], ["model=tiny", "batch_size=0"]])
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvbench: bad config: sweep point [model=tiny batch_size=0]: ")
    assert "batch_size: must be positive, got 0" in line


def test_valid_points_pass_without_a_word(hydra_context, capsys):
    validate_points([["model=tiny", "batch_size=1"], ["model=tiny", "cache=paged"]])
    assert capsys.readouterr().err == ""


def test_the_serve_sweep_summary_puts_the_running_peak_beside_the_prediction_and_the_in_flight_one_after(
    tmp_path, capsys
):
    from experiments.callbacks import ServeSweepSummary
    from harness.serve import fleet
    from tests.serve.serve_runs import SWEEP, write_run

    write_run(tmp_path, strategy="paged", qps=256.0)  # a queue: more requests in flight than running
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / SWEEP)}}, "results_dir": str(tmp_path)})
    ServeSweepSummary().on_multirun_end(config)
    header, line = capsys.readouterr().out.splitlines()[1:3]
    assert header.index("max running (measured)") < header.index("(predicted)") < header.index("max in flight")
    (row,) = fleet.load_run_rows(tmp_path).to_dict("records")
    assert row["max_concurrent_requests"] > row["max_running_requests"]
    expected = [row["max_running_requests"], row["predicted_max_running"], row["max_concurrent_requests"]]
    assert line.split()[3:6] == [str(value) for value in expected]  # after strategy, kv_dtype and qps
