"""The dashboard's charts, read as plotly specs: traces, axes, the numbers they draw, and how they fail."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from dashboard import charts
from harness.store import disk

REFERENCE = Path(__file__).resolve().parents[1] / "results" / "reference"
GIB = 2**30


def point(**overrides) -> dict:
    """One ok decode row with every column some chart reads: small bf16 on an H200, batch 1, prompt 512."""
    batch = overrides.get("batch_size", 1)
    row = dict(
        status="ok",
        model="small",
        device="cuda",
        device_name="NVIDIA H200",
        dtype="bf16",
        kv_dtype="bf16",
        cache="contiguous",
        batch_size=batch,
        prompt_len=512,
        gen_len=32,
        tpot_ms=10.0,
        tpot_p90_ms=11.0,
        tpot_p99_ms=12.0,
        ttft_ms=50.0,
        decode_tok_s=batch * 100.0,
        itl_ms=[10.0, 10.5, 11.0],
        weights_bytes=2 * GIB,
        kv_bytes_allocated=GIB // 2,
        kv_bytes_predicted=GIB // 2,
        peak_mem_bytes=4 * GIB,
        mem_baseline_bytes=GIB // 4,
        kv_waste_fraction=0.1,
        top1_agreement=1.0,
        kl_mean=0.0,
        flops_per_step=2e9 * batch,
        arithmetic_intensity=1.0 * batch,
        achieved_tflops=0.1 * batch,
        predicted_tpot_ms=8.0,
        peak_bw_gbps=4000.0,
        peak_tflops=800.0,
        critical_batch=8.0,
        critical_context=5000.0,
        bound="memory",
        **{f"prof_{category}_frac": 1 / 6 for category in charts.PROFILE_CATEGORIES},
    )
    return row | overrides


def frame(*points: dict) -> pd.DataFrame:
    return pd.DataFrame(list(points))


def sweep(tpots: dict[int, float], **overrides) -> pd.DataFrame:
    """A batch sweep: one point per batch with the given TPOT (ms)."""
    return frame(*(point(batch_size=b, tpot_ms=t, decode_tok_s=b * 1000 / t, **overrides) for b, t in tpots.items()))


def trace_names(fig: go.Figure) -> list[str]:
    return [trace.name for trace in fig.data]


def trace(fig: go.Figure, name: str):
    (found,) = [t for t in fig.data if t.name == name]
    return found


def annotation_texts(fig: go.Figure) -> list[str]:
    return [annotation.text for annotation in fig.layout.annotations]


# Each chart with the smallest call that draws it; frontier takes a frontier table, top_ops a top-ops table.
FIGURES = {
    "roofline": charts.roofline,
    "batch_sweep": charts.batch_sweep,
    "memory_ledger": charts.memory_ledger,
    "strategy_pareto": charts.strategy_pareto,
    "ttft_vs_prompt": charts.ttft_vs_prompt,
    "itl_curves": charts.itl_curves,
    "tpot_percentiles": charts.tpot_percentiles,
    "profile_shares": charts.profile_shares,
}
EVERY_CHART = {
    **FIGURES,
    "frontier": charts.frontier,
    "strategy_table": charts.strategy_table,
    "top_ops": charts.top_ops,
}


# --------------------------------------------------------------------------------------------------- common rules


def test_missing_columns_names_exactly_the_missing_ones():
    rows = frame(point()).drop(columns=["peak_tflops", "peak_bw_gbps"])
    with pytest.raises(charts.MissingColumns) as exc:
        charts.roofline(rows)
    assert str(exc.value) == "needs columns: peak_bw_gbps, peak_tflops"


def test_a_column_that_is_null_in_every_row_counts_as_missing():
    rows = frame(point(achieved_tflops=None), point(achieved_tflops=None, batch_size=2))
    with pytest.raises(charts.MissingColumns, match="^needs columns: achieved_tflops$"):
        charts.roofline(rows)


def test_missing_columns_is_a_value_error():
    assert issubclass(charts.MissingColumns, ValueError)


@pytest.mark.parametrize("name", sorted(EVERY_CHART))
def test_every_chart_raises_missing_columns_on_rows_without_its_columns(name):
    with pytest.raises(charts.MissingColumns, match="^needs columns: "):
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
    assert charts.strategy_table(disk.load(tmp_path)).empty


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_every_figure_has_a_title_and_axis_titles_with_units_or_names(name):
    fig = FIGURES[name](sweep({1: 10.0, 2: 10.0}))
    assert fig.layout.title.text and fig.layout.xaxis.title.text and fig.layout.yaxis.title.text


@pytest.fixture(scope="module")
def reference() -> pd.DataFrame:
    """The committed reference runs (results/reference), loaded once; no chart modifies its rows."""
    return disk.load(REFERENCE)


@pytest.mark.parametrize("name", sorted(EVERY_CHART))
def test_every_chart_draws_the_reference_results_or_names_what_they_lack(name, reference):
    try:
        out = EVERY_CHART[name](reference)
    except charts.MissingColumns as exc:
        assert str(exc).startswith("needs columns: ")
        return
    if isinstance(out, go.Figure):
        out.to_json()  # what st.plotly_chart sends to the browser
    else:
        assert isinstance(out, pd.DataFrame) and len(out) > 0


def test_the_crossover_caption_of_the_reference_results_is_a_sentence(reference):
    caption = charts.crossover_caption(reference)
    assert isinstance(caption, str) and caption.endswith(".")


def test_nullable_integer_and_boolean_columns_and_null_cells_draw():
    rows = sweep({1: 10.0, 2: 10.0, 4: 14.0})
    rows.loc[len(rows)] = point(batch_size=8, tpot_ms=None, itl_ms=None, critical_batch=None)
    rows = rows.astype({"batch_size": "Int64", "prompt_len": "Int64", "gen_len": "Int64", "weights_bytes": "Int64"})
    rows["prefix_hit"] = pd.array([True, None, False, None], dtype="boolean")
    rows.loc[3, "batch_size"] = pd.NA
    for build in FIGURES.values():
        build(rows).to_json()
    assert "knee" in charts.crossover_caption(rows)


# ------------------------------------------------------------------------------------------------------- roofline


def test_roofline_axes_are_log_log_with_units():
    fig = charts.roofline(sweep({1: 10.0, 2: 10.0}))
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert "FLOP/byte" in fig.layout.xaxis.title.text and "TFLOP/s" in fig.layout.yaxis.title.text


def test_roofline_ridge_sits_at_peak_tflops_times_1000_over_peak_bw_gbps():
    fig = charts.roofline(sweep({1: 10.0, 2: 10.0}, peak_tflops=700.0, peak_bw_gbps=3500.0))
    ridge = trace(fig, "ridge: NVIDIA H200 bf16")
    assert list(ridge.x) == [700.0 * 1000 / 3500.0] * 2
    assert ridge.line.dash == "dot"
    assert "ridge 200 FLOP/B" in annotation_texts(fig)


def test_roofline_measured_roof_is_the_lower_of_bandwidth_and_compute():
    fig = charts.roofline(sweep({1: 10.0, 2: 10.0}, peak_tflops=800.0, peak_bw_gbps=4000.0))
    roof = trace(fig, "measured roof: NVIDIA H200 bf16")
    assert roof.line.dash in (None, "solid")
    for x, y in zip(roof.x, roof.y, strict=True):
        assert y == pytest.approx(min(800.0, x * 4000.0 / 1000))
    assert min(roof.x) < 1.0 and max(roof.x) > 200.0  # covers the points (intensity 1, 2) and the ridge (200)


def test_roofline_draws_the_datasheet_roof_dashed_for_a_known_device():
    fig = charts.roofline(sweep({1: 10.0, 2: 10.0}))
    spec = trace(fig, "spec roof: NVIDIA H200 SXM bf16")  # harness/spec_peaks.csv: 989.5 TFLOP/s, 4800 GB/s
    assert spec.line.dash == "dash"
    assert max(spec.y) == pytest.approx(989.5)
    assert spec.y[0] == pytest.approx(spec.x[0] * 4800 / 1000)


def test_roofline_has_no_datasheet_roof_for_a_device_without_one():
    fig = charts.roofline(sweep({1: 10.0, 2: 10.0}, device_name="AMD EPYC 7B13"))
    assert not [name for name in trace_names(fig) if name.startswith("spec roof")]
    assert "measured roof: AMD EPYC 7B13 bf16" in trace_names(fig)


def test_roofline_draws_one_measured_roof_per_device_and_dtype():
    rows = pd.concat([sweep({1: 10.0}), sweep({1: 10.0}, dtype="fp32", peak_tflops=60.0)], ignore_index=True)
    roofs = [name for name in trace_names(charts.roofline(rows)) if name.startswith("measured roof")]
    assert roofs == ["measured roof: NVIDIA H200 bf16", "measured roof: NVIDIA H200 fp32"]


def test_roofline_plots_decode_as_circles_and_prefill_as_diamonds():
    rows = sweep({1: 10.0, 2: 10.0}, prefill_arithmetic_intensity=300.0, prefill_achieved_tflops=400.0)
    fig = charts.roofline(rows)
    assert trace(fig, "decode").marker.symbol == "circle" and trace(fig, "prefill").marker.symbol == "diamond"
    assert list(trace(fig, "prefill").x) == [300.0, 300.0]


def test_roofline_without_prefill_columns_draws_decode_only():
    names = trace_names(charts.roofline(sweep({1: 10.0, 2: 10.0})))
    assert "decode" in names and "prefill" not in names


def test_roofline_plots_only_ok_rows():
    rows = sweep({1: 10.0, 2: 10.0, 4: 10.0})
    rows.loc[2, "status"] = "oom"
    assert list(trace(charts.roofline(rows), "decode").x) == [1.0, 2.0]


def test_roofline_colours_points_by_log2_batch_with_a_batch_colorbar():
    fig = charts.roofline(sweep({1: 10.0, 4: 10.0, 16: 10.0}))
    assert list(trace(fig, "decode").marker.color) == [0.0, 2.0, 4.0]
    assert fig.layout.coloraxis.colorbar.title.text == "batch"
    assert list(fig.layout.coloraxis.colorbar.ticktext) == ["1", "2", "4", "8", "16"]


def test_roofline_hover_shows_the_point_config():
    (decode,) = [t for t in charts.roofline(sweep({1: 10.0})).data if t.name == "decode"]
    for field in ("model", "cache", "dtype", "kv_dtype", "bound", "device_name"):
        assert f"{field}: " in decode.hovertemplate  # named once per trace
    assert "batch_size: %{customdata[0]:.4g}<br>prompt_len: %{customdata[1]:.4g}" in decode.hovertemplate
    assert decode.customdata[0][:2].tolist() == [1.0, 512.0]  # and the numbers per point


def test_roofline_splits_points_by_config_in_one_legend_group_per_phase():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}), sweep({1: 10.0}, cache="paged")], ignore_index=True)
    decode = [t for t in charts.roofline(rows).data if t.name == "decode"]
    assert [len(t.x) for t in decode] == [2, 1]
    assert ["cache: contiguous" in t.hovertemplate for t in decode] == [True, False]
    assert {t.legendgroup for t in decode} == {"decode"} and [t.showlegend for t in decode] == [True, False]


def test_roofline_of_100k_rows_uses_webgl_and_stays_fast():
    rows = sweep({1: 10.0, 2: 10.0, 4: 10.0, 8: 12.0})
    rows = rows.loc[np.resize(rows.index, 100_000)].reset_index(drop=True)
    started = time.perf_counter()
    fig = charts.roofline(rows)
    assert time.perf_counter() - started < 5.0
    assert isinstance(trace(fig, "decode"), go.Scattergl) and len(trace(fig, "decode").x) == 100_000


def test_a_small_roofline_uses_svg_markers():
    assert isinstance(trace(charts.roofline(sweep({1: 10.0})), "decode"), go.Scatter)


# ---------------------------------------------------------------------------------------------------- batch sweep


def test_batch_sweep_leaves_out_configs_measured_at_one_batch():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}), sweep({2: 10.0}, cache="paged")], ignore_index=True)
    assert [name for name in trace_names(charts.batch_sweep(rows)) if "paged" in name] == []
    fig = charts.batch_sweep(sweep({2: 10.0}, cache="paged"))
    assert not fig.data and charts.NO_BATCH_SWEEP in annotation_texts(fig)


def test_batch_sweep_rejects_an_unknown_metric_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="decode_tok_s, tpot_ms"):
        charts.batch_sweep(sweep({1: 10.0}), metric="ttft_ms")


def test_batch_sweep_draws_one_line_per_prompt_len_on_a_log2_batch_axis():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}, prompt_len=32), sweep({1: 10.0, 2: 10.0})], ignore_index=True)
    fig = charts.batch_sweep(rows)
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == ["prompt 32", "prompt 512"]
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis.dtick == pytest.approx(math.log10(2))
    assert list(lines[0].x) == [1.0, 2.0]


def test_batch_sweep_names_the_config_when_several_are_present():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}), sweep({1: 10.0, 2: 10.0}, cache="paged")], ignore_index=True)
    names = trace_names(charts.batch_sweep(rows))
    assert "contiguous, prompt 512" in names and "paged, prompt 512" in names


def test_batch_sweep_throughput_and_tpot_axes_say_their_units():
    assert "tok/s" in charts.batch_sweep(sweep({1: 10.0}), metric="decode_tok_s").layout.yaxis.title.text
    assert "(ms)" in charts.batch_sweep(sweep({1: 10.0}), metric="tpot_ms").layout.yaxis.title.text


def test_batch_sweep_predicted_throughput_is_batch_times_1000_over_predicted_tpot():
    fig = charts.batch_sweep(sweep({1: 10.0, 4: 10.0}, predicted_tpot_ms=8.0))
    predicted = trace(fig, "predicted (roofline)")
    assert predicted.line.dash == "dot"
    assert list(predicted.y) == pytest.approx([1 * 1000 / 8.0, 4 * 1000 / 8.0])


def test_batch_sweep_compute_ceiling_is_peak_flops_over_flops_per_sequence():
    fig = charts.batch_sweep(sweep({1: 10.0, 4: 10.0}, peak_tflops=800.0))  # flops_per_step = 2e9 × batch
    ceiling = trace(fig, "compute ceiling")
    assert ceiling.line.dash == "dash"
    assert list(ceiling.y) == pytest.approx([800e12 / 2e9] * 2)


def test_batch_sweep_tpot_compute_ceiling_is_the_compute_only_step_time():
    fig = charts.batch_sweep(sweep({1: 10.0, 4: 10.0}, peak_tflops=800.0), metric="tpot_ms")
    assert list(trace(fig, "compute ceiling").y) == pytest.approx([2e9 / 800e12 * 1e3, 8e9 / 800e12 * 1e3])


def test_batch_sweep_marks_b_star_and_the_observed_knee():
    fig = charts.batch_sweep(sweep({1: 10.0, 2: 10.0, 4: 13.0, 8: 20.0}, critical_batch=8.0))
    assert "B* = 8" in annotation_texts(fig) and "knee = 4" in annotation_texts(fig)
    shapes = {shape.name: shape.x0 for shape in fig.layout.shapes}
    assert shapes == {"B*: prompt 512": 8.0, "knee: prompt 512": 4.0}


def test_batch_sweep_skips_a_marker_that_is_null():
    fig = charts.batch_sweep(sweep({1: 10.0, 2: 10.0}, critical_batch=None))  # no B*, and TPOT never rises
    assert not fig.layout.shapes
    assert not [text for text in annotation_texts(fig) if text.startswith(("B*", "knee"))]


def test_batch_sweep_draws_one_b_star_line_where_lines_agree():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}, prompt_len=32), sweep({1: 10.0, 2: 10.0})], ignore_index=True)
    assert annotation_texts(charts.batch_sweep(rows)).count("B* = 8") == 1


def test_batch_sweep_notes_s_star_in_tokens():
    fig = charts.batch_sweep(sweep({1: 10.0, 2: 10.0}, critical_context=12345.6))
    assert "S* ≈ 12,346 tokens" in annotation_texts(fig)


def test_batch_sweep_says_when_s_star_never_binds():
    fig = charts.batch_sweep(sweep({1: 10.0, 2: 10.0}, critical_context=math.inf))
    assert "S*: never binds" in annotation_texts(fig)


def test_batch_sweep_takes_the_median_of_repeated_points():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}), sweep({1: 20.0, 2: 10.0}), sweep({1: 30.0})], ignore_index=True)
    line = trace(charts.batch_sweep(rows, metric="tpot_ms"), "prompt 512")
    assert list(line.y) == [20.0, 10.0]


# -------------------------------------------------------------------------------------------------------- caption


def test_caption_states_the_knee_b_star_and_context():
    caption = charts.crossover_caption(sweep({1: 10.0, 2: 10.0, 4: 13.0, 8: 20.0}, critical_batch=8.0))
    assert caption.startswith("small bf16 on NVIDIA H200: decode stays memory-bound up to batch ≈ 2")
    assert "at 544-token context" in caption and "observed knee 4" in caption and "predicted B* 8" in caption


def test_caption_covers_each_prompt_length_longest_first():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}, prompt_len=32), sweep({1: 10.0, 2: 20.0})], ignore_index=True)
    caption = charts.crossover_caption(rows)
    assert caption.index("544-token context") < caption.index("at 64 tokens through batch 2")


def test_caption_needs_only_status_batch_prompt_and_tpot():
    rows = pd.DataFrame({"status": "ok", "batch_size": [1, 2], "prompt_len": 8, "tpot_ms": [1.0, 2.0]})
    assert charts.crossover_caption(rows).startswith("Decode stays memory-bound up to batch ≈ 1 at 8-token context")


def test_caption_reports_the_roofline_verdict():
    rows = sweep({1: 10.0, 2: 10.0})
    rows.loc[1, "bound"] = "compute"
    assert "roofline verdict compute from batch 2" in charts.crossover_caption(rows)


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        (frame(point()).drop(columns=["tpot_ms"]), "tpot_ms"),
        (frame(point(status="oom")), "no ok rows"),
        (frame(point()), "no batch sweep"),
        (pd.DataFrame(), "no rows"),
    ],
    ids=["no tpot column", "no ok rows", "no sweep", "empty"],
)
def test_caption_says_what_is_missing(rows, says):
    caption = charts.crossover_caption(rows)
    assert caption.startswith("No crossover to describe") and says in caption


# --------------------------------------------------------------------------------------------------------- memory


def ledger_rows(**oom) -> pd.DataFrame:
    # A failed point records only its config (harness.runner.failure_row): no weights, KV or peak figures.
    unknown = dict.fromkeys(["weights_bytes", "kv_bytes_allocated", "kv_bytes_predicted", "peak_mem_bytes"])
    return frame(
        point(prompt_len=992, batch_size=4),  # 1024 × 4: after 96 × 8 on the axis
        point(prompt_len=64, batch_size=8, peak_mem_bytes=GIB),  # peak below weights + KV: other clips at 0
        point(prompt_len=4064, batch_size=64, status="oom", **(unknown | oom)),
        point(prompt_len=4064, batch_size=1, status="error"),
    )


def test_memory_ledger_stacks_weights_kv_and_other_in_gib_sorted_by_context_times_batch():
    fig = charts.memory_ledger(ledger_rows())
    assert fig.layout.barmode == "stack" and fig.layout.yaxis.title.text == "memory (GiB)"
    assert list(fig.layout.xaxis.categoryarray) == ["96×8", "1024×4", "4096×64"]
    assert list(trace(fig, "weights").y[:2]) == [2.0, 2.0]
    assert list(trace(fig, "KV allocated").y[:2]) == [0.5, 0.5]
    assert list(trace(fig, "other (peak - baseline)").y[:2]) == [0.0, 4 - 0.25 - 2 - 0.5]


def test_memory_ledger_marks_predicted_weights_plus_kv():
    predicted = trace(charts.memory_ledger(ledger_rows()), "predicted (weights + KV)")
    assert list(predicted.y[:2]) == [2.5, 2.5]


def test_memory_ledger_draws_the_capacity_and_puts_ooms_on_it():
    fig = charts.memory_ledger(ledger_rows(), capacity_bytes=80 * GIB)
    (capacity,) = [shape for shape in fig.layout.shapes if shape.name == "device capacity"]
    assert capacity.y0 == capacity.y1 == 80.0
    oom = trace(fig, "OOM")
    assert list(oom.x) == ["4096×64"] and list(oom.y) == [80.0]
    assert oom.marker.symbol == "x" and oom.marker.color == "red"


def test_memory_ledger_without_a_capacity_puts_an_oom_at_the_cap_its_process_ran_under():
    fig = charts.memory_ledger(ledger_rows(max_memory_gb=6.0))
    assert not fig.layout.shapes
    assert list(trace(fig, "OOM").y) == [6.0]


def test_memory_ledger_without_any_cap_puts_an_oom_at_its_prediction():
    fig = charts.memory_ledger(ledger_rows(weights_bytes=2 * GIB, kv_bytes_predicted=GIB))
    assert list(trace(fig, "OOM").y) == [3.0]


def test_memory_ledger_puts_an_oom_that_recorded_nothing_at_the_tallest_bar():
    assert list(trace(charts.memory_ledger(ledger_rows()), "OOM").y) == [4 - 0.25]


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
    fig = charts.frontier(frontier_table())
    measured, predicted = trace(fig, "measured"), trace(fig, "predicted (planner)")
    assert list(measured.y) == [40, 10, 2] and list(measured.error_y.array) == [2, 1, 1] and measured.error_y.symmetric
    assert list(predicted.y) == [42, 11, 2] and predicted.line.dash == "dash"
    assert fig.layout.xaxis.type == "log" and "tokens" in fig.layout.xaxis.title.text


def test_frontier_skips_a_context_whose_search_failed():
    table = frontier_table()
    table.loc[1, "measured_max_batch"] = None
    assert list(trace(charts.frontier(table), "measured").x) == [512, 8192]


# ----------------------------------------------------------------------------------------------------- strategies


def test_strategy_table_has_one_line_per_cache_and_kv_dtype_with_medians():
    rows = frame(
        point(tpot_ms=10.0),
        point(tpot_ms=30.0),
        point(tpot_ms=20.0),
        point(kv_dtype="int8", kv_bytes_allocated=2**20, tpot_ms=5.0),
        point(kv_dtype="int8", tpot_ms=1.0, status="oom"),
    )
    table = charts.strategy_table(rows).set_index(["cache", "kv_dtype"])
    assert table.loc[("contiguous", "bf16"), "tpot_ms"] == 20.0 and table.loc[("contiguous", "bf16"), "n_points"] == 3
    assert table.loc[("contiguous", "int8"), "kv_allocated_mib"] == 1.0
    assert table.loc[("contiguous", "int8"), "n_points"] == 1


def test_strategy_table_columns_the_rows_lack_are_nan():
    table = charts.strategy_table(frame(point()).drop(columns=["kl_mean", "top1_agreement"]))
    assert list(table.columns) == ["cache", "kv_dtype", *charts.STRATEGY_MEDIANS, "n_points"]
    assert table[["kl_mean", "top1_agreement"]].isna().all().all()


def test_pareto_front_holds_exactly_the_non_dominated_points():
    x = pd.Series([1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 1.0, 5.0])
    y = pd.Series([9.0, 5.0, 5.0, 5.0, 1.0, 2.0, 9.0, 1.0])
    # (1, 9) twice, (2, 5) twice and (4, 1) are non-dominated; (3, 5) by (2, 5); (4, 2) and (5, 1) by (4, 1).
    assert charts.pareto_front(x, y).tolist() == [True, True, True, False, True, False, True, False]


def test_pareto_front_agrees_with_the_definition_on_random_points():
    rng = np.random.default_rng(0)
    x, y = pd.Series(rng.integers(0, 8, 200).astype(float)), pd.Series(rng.integers(0, 8, 200).astype(float))
    dominated = [bool(((x <= x[i]) & (y <= y[i]) & ((x < x[i]) | (y < y[i]))).any()) for i in range(len(x))]
    assert charts.pareto_front(x, y).tolist() == [not d for d in dominated]


def test_strategy_pareto_draws_the_front_through_the_non_dominated_rows():
    rows = frame(
        point(kv_bytes_allocated=1 * 2**20, tpot_ms=30.0, kv_dtype="int4"),
        point(kv_bytes_allocated=2 * 2**20, tpot_ms=20.0, kv_dtype="int8"),
        point(kv_bytes_allocated=3 * 2**20, tpot_ms=25.0, cache="paged"),  # dominated by the int8 row
        point(kv_bytes_allocated=4 * 2**20, tpot_ms=10.0),
    )
    fig = charts.strategy_pareto(rows)
    front = trace(fig, "Pareto front")
    assert list(front.x) == [1.0, 2.0, 4.0] and list(front.y) == [30.0, 20.0, 10.0]
    assert front.line.shape == "hv" and front.marker.symbol == "circle-open"
    assert fig.layout.xaxis.title.text == "KV allocated (MiB)"


def test_strategy_pareto_colours_by_cache_and_shapes_by_kv_dtype():
    rows = frame(point(kv_dtype="int4"), point(kv_dtype="int8"), point(cache="paged"))
    fig = charts.strategy_pareto(rows)
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


# -------------------------------------------------------------------------------------------------------- latency


def test_ttft_vs_prompt_draws_one_line_per_cache_and_batch():
    rows = frame(
        point(prompt_len=32, ttft_ms=5.0),
        point(prompt_len=512, ttft_ms=50.0),
        point(prompt_len=32, ttft_ms=9.0, batch_size=4),
        point(prompt_len=32, ttft_ms=7.0, cache="none"),
    )
    fig = charts.ttft_vs_prompt(rows)
    assert trace_names(fig) == ["contiguous, batch 1", "contiguous, batch 4", "none, batch 1"]
    assert list(trace(fig, "contiguous, batch 1").y) == [5.0, 50.0]
    assert fig.layout.xaxis.title.text == "prompt length (tokens)" and fig.layout.yaxis.title.text.endswith("(ms)")


def test_itl_curves_draw_each_step_of_each_row_from_step_1():
    fig = charts.itl_curves(frame(point(itl_ms=[1.0, 2.0, 3.0], cache="none"), point(itl_ms=None)))
    assert trace_names(fig) == ["none, prompt 512, batch 1"]
    assert list(fig.data[0].x) == [1, 2, 3] and list(fig.data[0].y) == [1.0, 2.0, 3.0]


def test_itl_curves_keep_at_most_max_lines_longest_prompts_first():
    rows = frame(*(point(prompt_len=p) for p in (32, 2048, 128, 512)))
    fig = charts.itl_curves(rows, max_lines=2)
    assert trace_names(fig) == ["contiguous, prompt 2048, batch 1", "contiguous, prompt 512, batch 1"]


def test_itl_curves_name_the_kv_dtype_when_it_varies():
    fig = charts.itl_curves(frame(point(kv_dtype="int8"), point()))
    assert trace_names(fig) == ["int8 contiguous, prompt 512, batch 1", "bf16 contiguous, prompt 512, batch 1"]


def test_itl_curves_read_numpy_arrays_as_lists():
    assert list(charts.itl_curves(frame(point(itl_ms=np.array([4.0, 5.0])))).data[0].y) == [4.0, 5.0]


def test_tpot_percentiles_are_grouped_bars_of_median_p90_and_p99_per_point():
    fig = charts.tpot_percentiles(frame(point(), point(cache="paged", tpot_ms=20.0)))
    assert trace_names(fig) == ["median", "p90", "p99"] and fig.layout.barmode == "group"
    assert list(trace(fig, "median").x) == ["contiguous", "paged"] and list(trace(fig, "median").y) == [10.0, 20.0]


# -------------------------------------------------------------------------------------------------------- profile


def test_profile_categories_are_the_profilers():
    from harness.profile import CATEGORIES

    assert charts.PROFILE_CATEGORIES == CATEGORIES


def test_profile_shares_stack_the_six_shares_median_per_prompt_len():
    shares = dict.fromkeys((f"prof_{c}_frac" for c in charts.PROFILE_CATEGORIES), 0.0)
    rows = frame(
        point(prompt_len=32, **(shares | {"prof_gemm_frac": 0.8, "prof_attention_frac": 0.2})),
        point(prompt_len=32, **(shares | {"prof_gemm_frac": 0.6, "prof_attention_frac": 0.4})),
        point(prompt_len=4096, **(shares | {"prof_gemm_frac": 0.2, "prof_attention_frac": 0.8})),
    )
    fig = charts.profile_shares(rows)
    assert trace_names(fig) == list(charts.PROFILE_CATEGORIES) and fig.layout.barmode == "stack"
    assert list(trace(fig, "gemm").x) == ["32", "4096"] and list(trace(fig, "gemm").y) == pytest.approx([0.7, 0.2])
    assert fig.layout.yaxis.title.text == "share of step time" and list(fig.layout.yaxis.range) == [0, 1]


def test_profile_shares_rejects_an_unknown_by():
    with pytest.raises(ValueError, match="prompt_len, batch_size"):
        charts.profile_shares(frame(point()), by="cache")


def test_profile_shares_by_batch_size_titles_its_axis():
    assert charts.profile_shares(frame(point()), by="batch_size").layout.xaxis.title.text == "batch size (sequences)"


def top_ops_table() -> pd.DataFrame:
    return pd.DataFrame(
        dict(
            op=["aten::mm", "aten::bmm", "aten::add", "aten::softmax", "aten::argmax"],
            category=["gemm", "attention", "norm_elementwise", "attention", "sampling"],
            self_time_ms=[5.0, 3.0, 1.0, 2.0, 0.5],
            calls=[10, 10, 10, 10, 1],
            share=[0.4, 0.25, 0.1, 0.15, 0.05],
        )
    )


def test_top_ops_draws_the_n_biggest_coloured_by_category_biggest_on_top():
    fig = charts.top_ops(top_ops_table(), n=3)
    assert sorted(trace_names(fig)) == ["attention", "gemm"]
    assert list(trace(fig, "attention").y) == ["aten::bmm", "aten::softmax"]
    assert list(fig.layout.yaxis.categoryarray) == ["aten::softmax", "aten::bmm", "aten::mm"]
    assert all(t.orientation == "h" for t in fig.data)


def test_top_ops_and_profile_shares_colour_a_category_alike():
    bars = trace(charts.top_ops(top_ops_table()), "attention")
    assert bars.marker.color == trace(charts.profile_shares(frame(point())), "attention").marker.color


def test_top_ops_refuses_a_table_of_several_points():
    table = top_ops_table().assign(point_id=["a", "a", "b", "b", "b"])
    with pytest.raises(ValueError, match="one point"):
        charts.top_ops(table)


def test_status_counts_stacks_each_sweeps_rows_by_status():
    rows = pd.DataFrame(
        {
            "sweep_id": ["a", "a", "a", "b"],
            "status": ["ok", "oom", "ok", "error"],
            "started_at": ["2026-01-01", "2026-01-01", "2026-01-01", "2026-01-02"],
        }
    )
    fig = charts.status_counts(rows)
    bars = {trace.name: dict(zip(trace.y, trace.x, strict=True)) for trace in fig.data}
    assert bars["ok"] == {"a": 2, "b": 0}
    assert bars["oom"] == {"a": 1, "b": 0}
    assert bars["error"] == {"a": 0, "b": 1}
    assert fig.layout.barmode == "stack" and fig.layout.xaxis.title.text == "rows"


def test_status_counts_needs_a_status_column():
    with pytest.raises(charts.MissingColumns, match="status"):
        charts.status_counts(pd.DataFrame({"sweep_id": ["a"]}))
