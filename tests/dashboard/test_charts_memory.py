"""The memory ledger and the OOM frontier (dashboard/charts/memory.py), read as plotly specs."""

from __future__ import annotations

import pandas as pd

from dashboard.charts.memory import PLANNER_COLUMN, frontier, memory_ledger
from tests.dashboard.charts_rows import GIB, annotation_texts, frame, point, trace, trace_names

# --------------------------------------------------------------------------------------------------------- memory


def ledger_rows(**oom) -> pd.DataFrame:
    # A failed point records only its config (harness.run.runner.failure_row): no weights, KV or peak figures.
    unknown = dict.fromkeys(["weights_bytes", "kv_bytes_allocated", "kv_bytes_predicted", "peak_mem_bytes"])
    return frame(
        point(prompt_len=992, batch_size=4),  # 1024 × 4: after 96 × 8 on the axis
        point(prompt_len=64, batch_size=8, peak_mem_bytes=GIB),  # peak below weights + KV: other clips at 0
        point(prompt_len=4064, batch_size=64, status="oom", **(unknown | oom)),
        point(prompt_len=4064, batch_size=1, status="error"),
    )


def test_memory_ledger_stacks_weights_kv_and_other_in_gib_sorted_by_context_times_batch():
    fig = memory_ledger(ledger_rows())
    assert fig.layout.barmode == "stack" and fig.layout.yaxis.title.text == "memory (GiB)"
    assert list(fig.layout.xaxis.categoryarray) == ["96×8", "1024×4", "4096×64"]
    assert list(trace(fig, "weights").y[:2]) == [2.0, 2.0]
    assert list(trace(fig, "KV allocated").y[:2]) == [0.5, 0.5]
    assert list(trace(fig, "other (peak - baseline)").y[:2]) == [0.0, 4 - 0.25 - 2 - 0.5]


def test_memory_ledger_marks_the_analytic_formulas_weights_plus_kv_under_that_name():
    # kv_bytes_predicted is B × S × bytes per token (harness/run/point.py), not the planner: it says so in the legend.
    predicted = trace(memory_ledger(ledger_rows()), "analytic formula (weights + KV)")
    assert list(predicted.y[:2]) == [2.5, 2.5]
    assert not [name for name in trace_names(memory_ledger(ledger_rows())) if "planner" in name]  # none given


def test_memory_ledger_marks_the_planners_weights_plus_kv_beside_the_formulas():
    rows = ledger_rows().assign(**{PLANNER_COLUMN: [GIB, GIB, None, None]})  # as runs record kv_bytes_planner
    fig = memory_ledger(rows)
    assert list(trace(fig, "planner (weights + KV)").y[:2]) == [3.0, 3.0]
    assert list(trace(fig, "analytic formula (weights + KV)").y[:2]) == [2.5, 2.5]


def test_memory_ledger_without_any_cap_puts_an_oom_at_the_planners_prediction_before_the_formulas():
    rows = ledger_rows(weights_bytes=2 * GIB, kv_bytes_predicted=GIB).assign(**{PLANNER_COLUMN: 2 * GIB})
    assert list(trace(memory_ledger(rows), "OOM").y) == [4.0]


def test_memory_ledger_draws_the_capacity_and_puts_ooms_on_it():
    fig = memory_ledger(ledger_rows(), capacity_bytes=80 * GIB)
    (capacity,) = [shape for shape in fig.layout.shapes if shape.name == "device capacity"]
    assert capacity.y0 == capacity.y1 == 80.0
    oom = trace(fig, "OOM")
    assert list(oom.x) == ["4096×64"] and list(oom.y) == [80.0]
    assert oom.marker.symbol == "x" and oom.marker.color == "red"


def test_memory_ledger_without_a_capacity_puts_an_oom_at_the_cap_its_process_ran_under():
    fig = memory_ledger(ledger_rows(max_memory_gb=6.0))
    assert not fig.layout.shapes
    assert list(trace(fig, "OOM").y) == [6.0]


def test_memory_ledger_without_any_cap_puts_an_oom_at_its_prediction():
    fig = memory_ledger(ledger_rows(weights_bytes=2 * GIB, kv_bytes_predicted=GIB))
    assert list(trace(fig, "OOM").y) == [3.0]


def test_memory_ledger_puts_an_oom_that_recorded_nothing_at_the_tallest_bar():
    assert list(trace(memory_ledger(ledger_rows()), "OOM").y) == [4 - 0.25]


# ------------------------------------------------------------------------------------------------------- frontier


def frontier_table() -> pd.DataFrame:
    return pd.DataFrame(
        dict(
            model="small",
            dtype="bf16",
            cache="contiguous",
            context=[512, 2048, 8192],
            measured_max_batch=[40, 10, 2],
            predicted_max_batch=[42, 11, 2],
            bisection_step=[2, 1, 1],
        )
    )


def test_frontier_draws_measured_solid_with_one_bisection_step_each_way_and_predicted_dashed():
    fig = frontier(frontier_table())
    measured, predicted = trace(fig, "measured"), trace(fig, "predicted (planner)")
    assert list(measured.y) == [40, 10, 2] and list(measured.error_y.array) == [2, 1, 1] and measured.error_y.symmetric
    assert list(predicted.y) == [42, 11, 2] and predicted.line.dash == "dash"
    assert fig.layout.xaxis.type == "log" and "tokens" in fig.layout.xaxis.title.text


def test_frontier_skips_a_context_whose_search_failed():
    table = frontier_table()
    table.loc[1, "measured_max_batch"] = None
    assert list(trace(frontier(table), "measured").x) == [512, 8192]


def test_memory_ledger_of_a_cpu_sized_point_reads_in_mib():
    small = dict(weights_bytes=80 * 2**20, kv_bytes_allocated=8 * 2**20, kv_bytes_predicted=8 * 2**20)
    fig = memory_ledger(frame(point(**small, peak_mem_bytes=120 * 2**20, mem_baseline_bytes=10 * 2**20)))
    assert fig.layout.yaxis.title.text == "memory (MiB)"
    assert list(trace(fig, "weights").y) == [80.0] and list(trace(fig, "KV allocated").y) == [8.0]
    assert "MiB" in trace(fig, "weights").hovertemplate


def test_memory_ledger_of_a_gpu_sized_point_reads_in_gib():
    big = dict(weights_bytes=40 * GIB, kv_bytes_allocated=10 * GIB, kv_bytes_predicted=10 * GIB)
    fig = memory_ledger(frame(point(**big, peak_mem_bytes=52 * GIB, mem_baseline_bytes=GIB)), capacity_bytes=141 * GIB)
    assert fig.layout.yaxis.title.text == "memory (GiB)"
    assert list(trace(fig, "weights").y) == [40.0] and "GiB" in trace(fig, "KV allocated").hovertemplate
    assert "device capacity 141 GiB" in annotation_texts(fig)


def test_memory_ledger_never_combines_two_workloads_into_one_bar():
    fig = memory_ledger(frame(point(kv_bytes_allocated=GIB), point(kv_bytes_allocated=3 * GIB, prefix_len=256)))
    assert len(trace(fig, "KV allocated").y) == 2 and sorted(trace(fig, "KV allocated").y) == [1.0, 3.0]
