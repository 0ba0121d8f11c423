"""The rules every chart keeps (dashboard/charts/common.py): missing columns, no ok rows, titles, the reference
results, nullable columns; and that the chart modules import without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest

from dashboard.charts.common import MissingColumns
from dashboard.charts.crossover import batch_sweep, crossover_caption
from dashboard.charts.latency import itl_curves, peak_memory_vs_prompt, tpot_percentiles, ttft_vs_prompt
from dashboard.charts.memory import frontier, memory_ledger
from dashboard.charts.profile import profile_shares, top_ops
from dashboard.charts.roofline import roofline
from dashboard.charts.strategies import strategy_pareto, strategy_table
from harness.store import disk
from tests.dashboard.charts_rows import annotation_texts, frame, point, sweep

ROOT = Path(__file__).resolve().parents[2]

# Each chart with the smallest call that draws it; frontier takes a frontier table, top_ops a top-ops table.
FIGURES = {
    "roofline": roofline,
    "batch_sweep": batch_sweep,
    "memory_ledger": memory_ledger,
    "strategy_pareto": strategy_pareto,
    "ttft_vs_prompt": ttft_vs_prompt,
    "peak_memory_vs_prompt": peak_memory_vs_prompt,
    "itl_curves": itl_curves,
    "tpot_percentiles": tpot_percentiles,
    "profile_shares": profile_shares,
}
EVERY_CHART = {
    **FIGURES,
    "frontier": frontier,
    "strategy_table": strategy_table,
    "top_ops": top_ops,
}


# --------------------------------------------------------------------------------------------------- common rules


def test_missing_columns_names_exactly_the_missing_ones():
    rows = frame(point()).drop(columns=["peak_tflops", "peak_bw_gbps"])
    with pytest.raises(MissingColumns) as exc:
        roofline(rows)
    assert str(exc.value) == "needs columns: peak_bw_gbps, peak_tflops"


def test_a_column_that_is_null_in_every_row_counts_as_missing():
    rows = frame(point(achieved_tflops=None), point(achieved_tflops=None, batch_size=2))
    with pytest.raises(MissingColumns, match="^needs columns: achieved_tflops$"):
        roofline(rows)


def test_missing_columns_is_a_value_error():
    assert issubclass(MissingColumns, ValueError)


@pytest.mark.parametrize("name", sorted(EVERY_CHART))
def test_every_chart_raises_missing_columns_on_rows_without_its_columns(name):
    with pytest.raises(MissingColumns, match="^needs columns: "):
        EVERY_CHART[name](pd.DataFrame({"status": ["ok"], "unrelated": [1]}))


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_rows_none_of_which_is_ok_draw_a_figure_that_says_so(name):
    rows = frame(point(status="error"), point(status="unsupported", batch_size=2))
    fig = FIGURES[name](rows)
    assert isinstance(fig, go.Figure)
    assert "no ok rows" in annotation_texts(fig)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_an_empty_results_folder_draws_a_figure_that_says_so(name, tmp_path):
    assert "no ok rows" in annotation_texts(FIGURES[name](disk.load(tmp_path)))


def test_an_empty_results_folder_gives_an_empty_strategy_table(tmp_path):
    assert strategy_table(disk.load(tmp_path)).empty


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_every_figure_has_a_title_and_axis_titles_with_units_or_names(name):
    fig = FIGURES[name](sweep({1: 10.0, 2: 10.0}))
    assert fig.layout.title.text and fig.layout.xaxis.title.text and fig.layout.yaxis.title.text


@pytest.mark.parametrize("name", sorted(EVERY_CHART))
def test_every_chart_draws_the_reference_results_or_names_what_they_lack(name, reference):
    try:
        out = EVERY_CHART[name](reference)
    except MissingColumns as exc:
        assert str(exc).startswith("needs columns: ")
        return
    if isinstance(out, go.Figure):
        out.to_json()  # what st.plotly_chart sends to the browser
    else:
        assert isinstance(out, pd.DataFrame) and len(out) > 0


def test_the_crossover_caption_of_the_reference_results_is_a_sentence(reference):
    caption = crossover_caption(reference)
    assert isinstance(caption, str) and caption.endswith(".")


def test_nullable_integer_and_boolean_columns_and_null_cells_draw():
    rows = sweep({1: 10.0, 2: 10.0, 4: 14.0})
    rows.loc[len(rows)] = point(batch_size=8, tpot_ms=None, itl_ms=None, critical_batch=None)
    rows = rows.astype({"batch_size": "Int64", "prompt_len": "Int64", "gen_len": "Int64", "weights_bytes": "Int64"})
    rows["prefix_hit"] = pd.array([True, None, False, None], dtype="boolean")
    rows.loc[3, "batch_size"] = pd.NA
    for build in FIGURES.values():
        build(rows).to_json()
    assert "knee" in crossover_caption(rows)


CHART_MODULES = ("common", "overview", "roofline", "crossover", "memory", "strategies", "latency", "profile")


@pytest.mark.parametrize("module", CHART_MODULES)
def test_a_chart_module_imports_without_torch(module):
    # A fresh interpreter: this one has torch already (tests/conftest.py). torch costs the dashboard seconds at
    # start-up and none of its charts needs it (the planner's figure is a column of the row, kv_bytes_planner).
    probe = f"import sys, dashboard.charts.{module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------- like with like, marks


def test_workload_groups_split_rows_by_every_workload_column_nulls_included():
    from dashboard.charts import common

    rows = frame(point(), point(kv_dtype="int8"), point(batch_size=2), point(compile="none"), point(compile=None))
    groups = common.workload_groups(rows)
    # batch 1 (compile absent in three rows: null), batch 2, compile "none": the null rows are a workload of their own
    assert sorted(len(group) for group in groups) == [1, 1, 3]
    assert len(groups[0]) == 3  # the workload with the most treatments comes first


def test_workload_label_names_the_fields_that_vary():
    from dashboard.charts import common

    rows = frame(point(), point(dtype="fp32", batch_size=2))
    assert common.workload_label(rows).tolist() == ["bf16, batch 1", "fp32, batch 2"]
    assert common.workload_label(frame(point())).tolist() == ["all rows"]


def test_the_baseline_is_the_exact_strategy_at_the_compute_dtype():
    from dashboard.charts import common

    rows = frame(point(), point(kv_dtype="fp32"), point(cache="paged"))
    assert common.is_baseline(rows).tolist() == [True, False, False]


def test_rows_are_marked_when_not_converged_or_the_host_was_busy_and_never_for_nulls():
    from dashboard.charts import common

    rows = pd.DataFrame(
        {
            "status": "ok",
            "converged": pd.array([False, True, None, None], dtype="boolean"),
            "host_busy": pd.array([True, None, None, True], dtype="boolean"),
        }
    )
    assert common.row_marks(rows).tolist() == ["not converged, host busy", "", "", "host busy"]
    assert common.marks_warning(rows).startswith("1 not converged and 2 host busy (of 4 ok rows)")
    assert common.marks_warning(rows.assign(converged=None, host_busy=None)) is None


def test_the_batch_sweep_never_draws_one_line_through_two_workloads():
    # The same cache, format and prompt, but two generation lengths: two sweeps, not one median per batch.
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}), sweep({1: 30.0, 2: 30.0}, gen_len=256)], ignore_index=True)
    lines = [t for t in batch_sweep(rows, metric="tpot_ms").data if t.mode == "lines+markers"]
    assert sorted(list(t.y) for t in lines) == [[10.0, 10.0], [30.0, 30.0]]
