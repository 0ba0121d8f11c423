"""The strategy table and Pareto chart (dashboard/charts/strategies.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dashboard.charts.strategies import STRATEGY_MEDIANS, pareto_front, strategy_pareto, strategy_table
from tests.charts_rows import frame, point, trace

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
    assert list(table.columns) == ["cache", "kv_dtype", *STRATEGY_MEDIANS, "n_points"]
    assert table[["kl_mean", "top1_agreement"]].isna().all().all()


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
