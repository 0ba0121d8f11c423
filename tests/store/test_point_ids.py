"""point_id is the resume key: a sweep run again finds its recorded points by it. Refactors must leave it alone.

Each committed reference folder was written by a preset sweep; composing that preset again with today's code must
give exactly the point_ids its rows carry. (results/reference/cpu-fragmentation/ is left out: its rows predate the
`runner` and `compile` columns and were recorded by an older config schema.)
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments.decode  # noqa: F401  (registers run_config in Hydra's ConfigStore)
from harness.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
REFERENCE = ROOT / "results" / "reference"
SWEEPS = {
    "strategies": "cpu-strategies",
    "quickstart": "cpu-quickstart",
    "quickstart-real": "cpu-quickstart-real",
    "crossover": "cpu-crossover",
}


def sweep_point_ids(experiment: str) -> dict[str, tuple[str, ...]]:
    """point_id -> the sweep's override values, for every point of `experiment`'s multirun on the CPU."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        hydra_cfg = compose(config_name="config", overrides=[f"experiment={experiment}"], return_hydra_config=True)
        params = OmegaConf.to_container(hydra_cfg.hydra.sweeper.params)
        ids = {}
        for values in itertools.product(*(str(choices).split(",") for choices in params.values())):
            overrides = [f"experiment={experiment}", "device=cpu", *map("=".join, zip(params, values, strict=True))]
            cfg = compose(config_name="config", overrides=overrides)
            ids[RunConfig(**OmegaConf.to_container(cfg, resolve=True)).point_id()] = values
    return ids


def reference_point_ids(folder: str) -> set[str]:
    rows = [
        pd.read_parquet(path, columns=["point_id"])
        for path in (REFERENCE / folder).glob("*.parquet")
        if not path.name.endswith(".ops.parquet")
    ]
    return set(pd.concat(rows)["point_id"])


@pytest.mark.parametrize("experiment", sorted(SWEEPS))
def test_a_preset_sweep_composes_to_the_point_ids_of_its_committed_reference_rows(experiment):
    reference = reference_point_ids(SWEEPS[experiment])
    composed = sweep_point_ids(experiment)
    assert len(composed) == len(reference)  # no two points of the sweep collide
    assert set(composed) == reference


def test_the_point_id_changes_with_what_is_measured_and_not_with_where_it_is_written():
    base = RunConfig(device="cpu", model={"name": "tiny"})
    assert RunConfig(device="cpu", model={"name": "tiny"}, results_dir="elsewhere", force=True).point_id() == (
        base.point_id()
    )
    assert RunConfig(device="cpu", model={"name": "tiny"}, batch_size=2).point_id() != base.point_id()
    assert RunConfig(device="cpu", model={"name": "tiny"}, cache={"name": "paged", "block_size": 32}).point_id() != (
        RunConfig(device="cpu", model={"name": "tiny"}, cache={"name": "paged"}).point_id()
    )
