"""conf/experiment/mla.yaml: every point of the MLA sweep validates before the first runs, and it sweeps what it says.

The sweep needs the MLA model's config field `mla_path` and the `mla-small` preset; until both are on this branch
the validation is skipped with that reason (the expansion is checked whatever).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import experiments.decode  # noqa: F401  (registers run_config in Hydra's ConfigStore)
from experiments.callbacks import sweep_jobs, validate_points
from harness.config import RunConfig
from harness.modeling.presets import PRESETS

CONF = Path(__file__).resolve().parents[2] / "conf"


def sweep(*overrides: str) -> list[list[str]]:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        config = compose(config_name="config", overrides=["experiment=mla", *overrides], return_hydra_config=True)
        return sweep_jobs(config)


@pytest.fixture()
def jobs() -> list[list[str]]:
    return sweep()


def test_the_mla_sweep_crosses_model_and_context(jobs):
    assert len(jobs) == 2 * 3
    keys = {override.partition("=")[0] for job in jobs for override in job}
    assert {"model.name", "prompt_len"} <= keys


def test_the_naive_path_command_sweeps_the_mla_model_alone_and_validates():
    jobs = sweep("model.name=mla-small", "mla_path=naive")
    assert len(jobs) == 3 and all("model.name=mla-small" in job for job in jobs)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        validate_points([[*job, "mla_path=naive"] for job in jobs])


def test_every_point_of_the_mla_sweep_validates(jobs):
    if "mla_path" not in {f.name for f in dataclasses.fields(RunConfig)} or "mla-small" not in PRESETS:
        pytest.skip("needs RunConfig.mla_path and the mla-small preset (the MLA model's branch, h-mla)")
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        validate_points(jobs)
