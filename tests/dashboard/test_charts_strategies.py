"""The strategy table and Pareto chart (dashboard/charts/strategies.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dashboard.charts import strategies
from dashboard.charts.strategies import STRATEGY_MEDIANS, pareto_front, strategy_pareto, strategy_table
from harness.store.schema import WORKLOAD_COLUMNS
from tests.dashboard.charts_rows import annotation_texts, frame, point, trace

# ----------------------------------------------------------------------------------------------------- strategies


def test_strategy_table_has_one_line_per_cache_and_kv_dtype_with_medians():
    rows = frame(
        point(tpot_ms=10.0),
        point(tpot_ms=30.0),
        point(tpot_ms=20.0),
        point(kv_dtype="int8", kv_bytes_allocated=2**20, tpot_ms=5.0),
        point(kv_dtype="int8", tpot_ms=1.0, status="oom"),
    )
    table = strategy_table(rows).set_index(["cache", "kv_dtype"])
    assert table.loc[("contiguous", "bf16"), "tpot_ms"] == 20.0 and table.loc[("contiguous", "bf16"), "n_points"] == 3
    assert table.loc[("contiguous", "int8"), "kv_allocated_mib"] == 1.0
    assert table.loc[("contiguous", "int8"), "n_points"] == 1


def test_strategy_table_columns_the_rows_lack_are_nan():
    table = strategy_table(frame(point()).drop(columns=["kl_mean", "top1_agreement"]))
    assert {"cache", "kv_dtype", *STRATEGY_MEDIANS, "n_points"} <= set(table.columns)
    assert table[["kl_mean", "top1_agreement"]].isna().all().all()


def two_workloads() -> pd.DataFrame:
    """A bf16 workload at batch 1 and an fp32 one at batch 2, each with its baseline and an int8 KV line."""
    return frame(
        point(tpot_ms=10.0, kv_bytes_allocated=4 * 2**20),
        point(kv_dtype="int8", tpot_ms=12.0, kv_bytes_allocated=2 * 2**20),
        point(dtype="fp32", kv_dtype="fp32", batch_size=2, tpot_ms=40.0, kv_bytes_allocated=16 * 2**20),
        point(dtype="fp32", kv_dtype="int8", batch_size=2, tpot_ms=20.0, kv_bytes_allocated=4 * 2**20),
    )


def test_strategy_table_never_combines_two_workloads():
    table = strategy_table(two_workloads())
    assert len(table) == 4  # (workload, treatment) lines: the two int8 lines stay apart
    int8 = table[table["kv_dtype"] == "int8"].set_index("dtype")
    assert int8.loc["bf16", "tpot_ms"] == 12.0 and int8.loc["fp32", "tpot_ms"] == 20.0
    present = [column for column in WORKLOAD_COLUMNS if column in table.columns]
    assert (table.groupby("workload")[present].nunique(dropna=False) == 1).all().all()


def test_strategy_table_ratios_are_against_the_baseline_of_the_same_workload():
    table = strategy_table(two_workloads()).set_index(["dtype", "kv_dtype"])
    assert table.loc[("bf16", "bf16"), "tpot_ratio"] == 1.0 and table.loc[("fp32", "fp32"), "tpot_ratio"] == 1.0
    assert table.loc[("bf16", "int8"), "tpot_ratio"] == 1.2  # 12 / 10, not against the fp32 baseline's 40
    assert table.loc[("fp32", "int8"), "tpot_ratio"] == 0.5
    assert table.loc[("fp32", "int8"), "kv_allocated_ratio"] == 0.25


def test_strategy_table_without_a_baseline_leaves_the_ratios_null_with_a_note():
    table = strategy_table(frame(point(kv_dtype="int8"), point(cache="paged", kv_dtype="fp8_e4m3")))
    assert table[["tpot_ratio", "ttft_ratio", "kv_allocated_ratio"]].isna().all().all()
    assert set(table["note"]) == {strategies.NO_BASELINE}


def test_strategy_table_without_a_baseline_has_no_interval_even_with_samples():
    rows = frame(
        point(kv_dtype="int8", tpot_samples_ms=[9.0, 10.0, 11.0]),
        point(cache="evict", kv_dtype="int8", tpot_samples_ms=[8.0, 9.0, 10.0]),
    )
    table = strategy_table(rows)  # the baseline's samples reindexed to NaN: no ratio, so no interval
    assert table[list(strategies.TPOT_RATIO_CI)].isna().all().all()


def test_strategy_table_marks_treatments_with_a_row_that_did_not_converge_or_ran_on_a_busy_host():
    rows = frame(
        point(converged=False),
        point(converged=True, kv_dtype="int8", host_busy=True),
        point(converged=None, cache="paged", host_busy=None),  # null: not recorded, never marked
    )
    marks = strategy_table(rows).set_index("treatment")["marks"]
    assert marks["contiguous bf16"] == "not converged" and marks["contiguous int8"] == "host busy"
    assert marks["paged bf16"] == ""


def test_strategy_pareto_draws_one_workload_and_names_it():
    fig = strategy_pareto(two_workloads())
    assert sorted(y for t in fig.data if t.name == "contiguous" for y in t.y) in ([10.0, 12.0], [20.0, 40.0])
    assert any(text.startswith("one workload of 2: ") for text in annotation_texts(fig))


def test_strategy_pareto_draws_a_marked_row_with_an_open_marker():
    fig = strategy_pareto(frame(point(converged=False), point(kv_dtype="int8", converged=None)))
    symbols = {t.marker.symbol for t in fig.data if t.name == "contiguous"}
    assert symbols == {"circle-open", "square"}


def test_pareto_front_holds_exactly_the_non_dominated_points():
    x = pd.Series([1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 1.0, 5.0])
    y = pd.Series([9.0, 5.0, 5.0, 5.0, 1.0, 2.0, 9.0, 1.0])
    # (1, 9) twice, (2, 5) twice and (4, 1) are non-dominated; (3, 5) by (2, 5); (4, 2) and (5, 1) by (4, 1).
    assert pareto_front(x, y).tolist() == [True, True, True, False, True, False, True, False]


def test_pareto_front_agrees_with_the_definition_on_random_points():
    rng = np.random.default_rng(0)
    x, y = pd.Series(rng.integers(0, 8, 200).astype(float)), pd.Series(rng.integers(0, 8, 200).astype(float))
    dominated = [bool(((x <= x[i]) & (y <= y[i]) & ((x < x[i]) | (y < y[i]))).any()) for i in range(len(x))]
    assert pareto_front(x, y).tolist() == [not d for d in dominated]


def test_strategy_pareto_draws_the_front_through_the_non_dominated_rows():
    rows = frame(
        point(kv_bytes_allocated=1 * 2**20, tpot_ms=30.0, kv_dtype="int4"),
        point(kv_bytes_allocated=2 * 2**20, tpot_ms=20.0, kv_dtype="int8"),
        point(kv_bytes_allocated=3 * 2**20, tpot_ms=25.0, cache="paged"),  # dominated by the int8 row
        point(kv_bytes_allocated=4 * 2**20, tpot_ms=10.0),
    )
    fig = strategy_pareto(rows)
    front = trace(fig, "Pareto front")
    assert list(front.x) == [1.0, 2.0, 4.0] and list(front.y) == [30.0, 20.0, 10.0]
    assert front.line.shape == "hv" and front.marker.symbol == "circle-open"
    assert fig.layout.xaxis.title.text == "KV allocated (MiB)"


def test_strategy_pareto_colours_by_cache_and_shapes_by_kv_dtype():
    rows = frame(point(kv_dtype="int4"), point(kv_dtype="int8"), point(cache="paged"))
    fig = strategy_pareto(rows)
    contiguous = [t for t in fig.data if t.name == "contiguous"]
    paged = trace(fig, "paged")
    assert {t.marker.color for t in contiguous} != {paged.marker.color} and len(
        {t.marker.color for t in contiguous}
    ) == 1
    assert [t.marker.symbol for t in contiguous] == [
        trace(fig, "kv_dtype int4").marker.symbol,
        trace(fig, "kv_dtype int8").marker.symbol,
    ]
    assert [t.showlegend for t in contiguous] == [True, False]  # one legend entry per cache
    assert "kv_dtype: int4" in contiguous[0].hovertemplate and contiguous[0].customdata.shape == (1, 3)


def test_strategy_table_gives_the_tpot_ratio_an_interval_from_the_samples_where_both_lines_have_them():
    rows = frame(
        point(tpot_ms=10.0, tpot_samples_ms=[9.0, 10.0, 11.0, 10.0, 10.5]),
        point(kv_dtype="int8", tpot_ms=20.0, tpot_samples_ms=[19.0, 20.0, 21.0, 20.0, 20.5]),
        point(cache="paged", tpot_ms=12.0, tpot_samples_ms=None),  # not recorded: no interval
    )
    table = strategy_table(rows).set_index("treatment")
    low, high = table.loc["contiguous int8", ["tpot_ratio_low", "tpot_ratio_high"]]
    assert low < 2.0 < high and high < 3.0  # around 20 / 10, its spread from the samples' own
    assert table.loc[["paged bf16"], ["tpot_ratio_low", "tpot_ratio_high"]].isna().all().all()


def test_a_line_of_several_rows_takes_its_interval_from_their_tpots_and_intervals_can_be_left_out():
    # Reruns of one point: the line's TPOT is the median of its rows' TPOTs, so its interval resamples those, not
    # the pooled repeats (which would be as wide as one run's noise however far the reruns drift apart).
    rows = frame(
        point(tpot_ms=10.0, tpot_samples_ms=[10.0, 10.0, 10.0]),
        point(tpot_ms=10.0, tpot_samples_ms=[10.0, 10.0, 10.0]),
        point(kv_dtype="int8", tpot_ms=18.0, tpot_samples_ms=[18.0, 18.0, 18.0]),
        point(kv_dtype="int8", tpot_ms=22.0, tpot_samples_ms=[22.0, 22.0, 22.0]),
    )
    table = strategy_table(rows).set_index("treatment")
    low, high = table.loc["contiguous int8", ["tpot_ratio_low", "tpot_ratio_high"]]
    assert low == pytest.approx(1.8) and high == pytest.approx(2.2)  # the reruns' spread, 18 to 22 over 10
    assert strategy_table(rows, intervals=False)[["tpot_ratio_low", "tpot_ratio_high"]].isna().all().all()
