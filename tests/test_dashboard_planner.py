"""The dashboard's planner figure (dashboard.data.planner_kv_bytes): the real planner, harness.plan, for each
row's workload, held to what the caches allocated in the committed reference rows.

The memory page shows it beside kv_bytes_predicted, the seed notes' formula B × S × bytes per token (no scales, no
block rounding, no prefix sharing); tests/test_dashboard.py holds the page to that.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dashboard import data
from harness.store import disk

REPO = Path(__file__).resolve().parents[1]
STRATEGIES_SWEEP = "20261201-173322"  # results/reference/cpu-strategies: every cache × kv_dtype, prompt 160


@pytest.fixture(scope="module")
def reference() -> pd.DataFrame:
    """The committed reference rows, loaded once (seconds); no test modifies them."""
    return disk.load(data.REFERENCE_DIR)


def strategy_row(rows: pd.DataFrame, cache: str, kv_dtype: str) -> pd.DataFrame:
    chosen = rows[(rows["sweep_id"] == STRATEGIES_SWEEP) & (rows["cache"] == cache) & (rows["kv_dtype"] == kv_dtype)]
    assert len(chosen) == 1 and chosen["status"].iloc[0] == "ok"
    return chosen


def test_the_planners_kv_bytes_are_what_each_cache_allocated_in_every_fixed_length_reference_row(reference):
    rows = reference
    fixed = rows[(rows["status"] == "ok") & (rows["lengths"] == "fixed")]
    assert set(fixed["cache"]) == {"none", "contiguous", "paged", "sliding", "prefix", "evict"}
    assert data.planner_kv_bytes(fixed).tolist() == fixed["kv_bytes_allocated"].tolist()


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
    planned = data.planner_kv_bytes(row).iloc[0]
    assert planned == row["kv_bytes_allocated"].iloc[0]
    assert planned != row["kv_bytes_predicted"].iloc[0], why


def test_the_planner_agrees_with_the_analytic_formula_for_plain_contiguous_storage(reference):
    row = strategy_row(reference, "contiguous", "fp32")
    assert data.planner_kv_bytes(row).iloc[0] == row["kv_bytes_predicted"].iloc[0] == row["kv_bytes_allocated"].iloc[0]


def test_the_planner_reads_the_rows_n_kv_heads(reference):
    row = strategy_row(reference, "contiguous", "fp32")
    assert row["n_kv_heads"].iloc[0] == 4
    assert data.planner_kv_bytes(row.assign(n_kv_heads=2)).iloc[0] == row["kv_bytes_allocated"].iloc[0] // 2


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
def test_a_row_the_planner_cannot_stand_for_gets_no_figure_not_a_guess(reference, change):
    row = strategy_row(reference, "paged", "fp32")
    assert data.planner_kv_bytes(row.assign(**change)).isna().all()


def test_the_planner_figure_of_a_mixed_length_reference_row_is_missing(reference):
    rows = reference
    mixed = rows[rows["lengths"] == "mixed"]
    assert len(mixed) == 2 and data.planner_kv_bytes(mixed).isna().all()


def test_the_planner_plans_each_distinct_workload_of_many_rows_and_keeps_their_order(reference):
    rows = reference
    fixed = rows[(rows["status"] == "ok") & (rows["lengths"] == "fixed")]
    many = fixed.iloc[::-1].loc[fixed.index.repeat(3)[::-1]]  # repeated labels, reversed
    assert data.planner_kv_bytes(many).tolist() == many["kv_bytes_allocated"].tolist()
    assert data.planner_kv_bytes(many).index.equals(many.index)


def test_the_dashboards_loaders_import_without_torch():
    # A fresh interpreter (this one has torch: tests/conftest.py). harness.plan imports torch, so
    # planner_kv_bytes imports it only when called: every page but the memory page starts without it.
    probe = "import sys, dashboard.data, dashboard.sidebar; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
