"""The planner's KV bytes in the row (kv_bytes_planner): the real planner, harness.analytic, for the point's workload,
written by the run (harness.run.point.planner_kv_bytes) and held to what the caches allocated, in real runs and in
the committed reference rows (whose figures scripts/backfill_kv_bytes_planner.py filled in from their columns).

The memory page shows it beside kv_bytes_predicted, the seed notes' formula B × S × bytes per token (no scales, no
block rounding, no prefix sharing); tests/dashboard/test_dashboard_pages.py holds the page to that.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from dashboard import data
from harness.config import RunConfig
from harness.modeling.model_args import PRESETS
from harness.run.point import config_columns, run_point

REPO = Path(__file__).resolve().parents[2]
STRATEGIES_SWEEP = "20261201-173322"  # results/reference/cpu-strategies: every cache × kv_dtype, prompt 160
FAST = dict(warmup=0, min_repeats=1, max_repeats=1, isolate=False, roofline=False, profile=False, accuracy=False)


def strategy_row(rows: pd.DataFrame, cache: str, kv_dtype: str) -> pd.DataFrame:
    chosen = rows[(rows["sweep_id"] == STRATEGIES_SWEEP) & (rows["cache"] == cache) & (rows["kv_dtype"] == kv_dtype)]
    assert len(chosen) == 1 and chosen["status"].iloc[0] == "ok"
    return chosen


@pytest.mark.parametrize(
    "cache",
    [
        {"name": "contiguous"},
        {"name": "paged", "block_size": 16},
        {"name": "sliding", "window": 32, "sinks": 4},
        {"name": "evict", "policy": "h2o", "budget": 16, "window": 4},
    ],
    ids=lambda cache: cache["name"],
)
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_a_runs_planner_figure_is_what_its_cache_allocated(cache, kv_dtype):
    cfg = RunConfig(model={"name": "tiny"}, dtype="fp32", kv_dtype=kv_dtype, cache=cache, batch_size=2,
                    prompt_len=40, gen_len=6, **FAST)  # fmt: skip
    row = run_point(cfg).row
    assert row["status"] == "ok", row.get("error")
    assert row["kv_bytes_planner"] == row["kv_bytes_allocated"]


def test_the_planners_kv_bytes_are_what_each_cache_allocated_in_every_fixed_length_reference_row(reference):
    rows = reference
    fixed = rows[(rows["status"] == "ok") & (rows["lengths"] == "fixed")]
    assert set(fixed.loc[fixed["cache"].isna(), "runner"]) <= {"llama.cpp", "transformers"}  # other engines' caches
    fixed = fixed[fixed["cache"].notna()]
    assert set(fixed["cache"]) == {"none", "contiguous", "paged", "sliding", "prefix", "evict"}
    assert fixed["kv_bytes_planner"].tolist() == fixed["kv_bytes_allocated"].tolist()


@pytest.mark.parametrize(
    ("cache", "kv_dtype", "why"),
    [
        ("paged", "fp32", "whole blocks: 168 tokens take 11 blocks of 16"),
        ("contiguous", "int8", "an fp32 scale per token and head"),
        ("prefix", "bf16", "the 128-token prefix held once for the batch"),
        ("paged", "int4", "packed nibbles, per-group scales and zero points, and the full-precision tail"),
        ("sliding", "fp32", "a window of 128 tokens, not prompt + gen"),
    ],
)
def test_the_planner_differs_from_the_analytic_formula_where_the_layout_does(reference, cache, kv_dtype, why):
    row = strategy_row(reference, cache, kv_dtype)
    planned = row["kv_bytes_planner"].iloc[0]
    assert planned == row["kv_bytes_allocated"].iloc[0]
    assert planned != row["kv_bytes_predicted"].iloc[0], why


def test_the_planner_agrees_with_the_analytic_formula_for_plain_contiguous_storage(reference):
    row = strategy_row(reference, "contiguous", "fp32")
    assert row["kv_bytes_planner"].iloc[0] == row["kv_bytes_predicted"].iloc[0] == row["kv_bytes_allocated"].iloc[0]


def test_the_planner_plans_the_points_n_kv_heads(reference):
    row = strategy_row(reference, "contiguous", "fp32").iloc[0]
    assert row["n_kv_heads"] == 4
    workload = dict(dtype="fp32", cache="contiguous", batch_size=2, prompt_len=160, gen_len=8, **FAST)
    same = config_columns(RunConfig(model={"name": row["model"]}, **workload))
    halved = config_columns(RunConfig(model={"name": row["model"], "n_kv_heads": 2}, **workload))
    assert same["kv_bytes_planner"] == row["kv_bytes_allocated"]
    assert halved["kv_bytes_planner"] == row["kv_bytes_allocated"] // 2


def test_a_mixed_length_point_gets_no_planner_figure_not_a_guess():
    # the pool holds the drawn lengths, which the fixed-length planner does not stand for
    cfg = RunConfig(model={"name": "tiny"}, cache="paged", lengths="mixed", batch_size=4, prompt_len=32, gen_len=8)
    assert config_columns(cfg)["kv_bytes_planner"] is None


def test_the_planner_figure_of_a_mixed_length_reference_row_is_missing(reference):
    rows = reference
    mixed = rows[rows["lengths"] == "mixed"]
    assert len(mixed) == 2 and mixed["kv_bytes_planner"].isna().all()


# ------------------------------------------------------------------ the backfill of rows written before the column


def backfill_module():
    spec = importlib.util.spec_from_file_location("backfill", REPO / "scripts" / "backfill_kv_bytes_planner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "change",
    [
        dict(model="my-finetune"),  # a checkpoint's name: its config.json is not here to read
        dict(n_layers=24),  # a checkpoint named like a preset but shaped otherwise
        dict(lengths="mixed"),  # the pool held the drawn lengths, which the row does not record
        dict(cache=None),  # a row of a schema without the column
    ],
    ids=["not a preset", "other shapes", "mixed lengths", "no cache"],
)
def test_the_backfill_gives_a_row_the_planner_cannot_stand_for_no_figure_not_a_guess(reference, change):
    row = strategy_row(reference, "paged", "fp32")
    assert backfill_module().planner_figures(row.assign(**change)) == [None]


def test_the_backfill_plans_an_eviction_row_from_its_obs_window_column():
    row = dict(model="tiny", dtype="fp32", kv_dtype="fp32", cache="evict", batch_size=1, prompt_len=64, gen_len=8,
               policy="h2o", budget=16, obs_window=4, window=None, prefix_len=0)  # fmt: skip
    cfg = RunConfig(model={"name": "tiny"}, dtype="fp32", kv_dtype="fp32", batch_size=1, prompt_len=64, gen_len=8,
                    cache={"name": "evict", "policy": "h2o", "budget": 16, "window": 4})  # fmt: skip
    # the sliding column `window` is null: read as the evict option, its default 32 would exceed the budget
    assert backfill_module().planner_figures(pd.DataFrame([row])) == [config_columns(cfg)["kv_bytes_planner"]]


def test_the_backfill_plans_each_reference_row_as_its_column_holds(reference):
    # The backfill's domain is the presets (a checkpoint's shapes are in its config.json, which the rows lack); the
    # real model's rows, written since the column exists, carry the run's own figure.
    presets = reference[reference["model"].isin(PRESETS)].reset_index(drop=True)
    figures = backfill_module().planner_figures(presets)
    assert pd.Series(figures, dtype="Int64").equals(presets["kv_bytes_planner"])
    checkpoints = reference[~reference["model"].isin(PRESETS)]
    assert len(checkpoints) and set(backfill_module().planner_figures(checkpoints)) == {None}


def test_the_backfill_inserts_the_column_and_leaves_every_other_cell_and_field(tmp_path, reference):
    row = strategy_row(reference, "paged", "fp32")
    (stored,) = data.REFERENCE_DIR.rglob(f"{row['point_id'].iloc[0]}.parquet")
    old = pq.read_table(stored).drop_columns(["kv_bytes_planner"])  # as a writer before the column wrote it
    path = tmp_path / stored.name
    pq.write_table(old, path)
    new = backfill_module().backfilled(path)
    at = new.column_names.index("kv_bytes_planner")
    assert new.column_names[at - 1] == "kv_bytes_predicted"
    assert new.remove_column(at).equals(old, check_metadata=True)
    assert new.schema.remove(at).equals(old.schema, check_metadata=True)
    assert new["kv_bytes_planner"].to_pylist() == [row["kv_bytes_allocated"].iloc[0]]
    assert backfill_module().backfilled(stored) is None  # a file that has the column is left alone


def test_the_dashboards_loaders_import_without_torch():
    # A fresh interpreter (this one has torch: tests/conftest.py). The planner's figure is a column of the row: the
    # dashboard never imports harness.analytic, which imports torch.
    probe = "import sys, dashboard.data, dashboard.sidebar; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
