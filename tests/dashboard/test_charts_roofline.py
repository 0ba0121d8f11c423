"""The roofline chart (dashboard/charts/roofline.py), read as a plotly spec: roofs, ridges, points, hovers."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from dashboard.charts.roofline import roofline
from tests.dashboard.charts_rows import annotation_texts, sweep, trace, trace_names

# ------------------------------------------------------------------------------------------------------- roofline


def test_roofline_axes_are_log_log_with_units():
    fig = roofline(sweep({1: 10.0, 2: 10.0}))
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert "FLOP/byte" in fig.layout.xaxis.title.text and "TFLOP/s" in fig.layout.yaxis.title.text


def test_roofline_ridge_sits_at_peak_tflops_times_1000_over_peak_bw_gbps():
    fig = roofline(sweep({1: 10.0, 2: 10.0}, peak_tflops=700.0, peak_bw_gbps=3500.0))
    ridge = trace(fig, "ridge: NVIDIA H200 bf16")
    assert list(ridge.x) == [700.0 * 1000 / 3500.0] * 2
    assert ridge.line.dash == "dot"
    assert "ridge 200 FLOP/B" in annotation_texts(fig)


def test_roofline_measured_roof_is_the_lower_of_bandwidth_and_compute():
    fig = roofline(sweep({1: 10.0, 2: 10.0}, peak_tflops=800.0, peak_bw_gbps=4000.0))
    roof = trace(fig, "measured roof: NVIDIA H200 bf16")
    assert roof.line.dash in (None, "solid")
    for x, y in zip(roof.x, roof.y, strict=True):
        assert y == pytest.approx(min(800.0, x * 4000.0 / 1000))
    assert min(roof.x) < 1.0 and max(roof.x) > 200.0  # covers the points (intensity 1, 2) and the ridge (200)


def test_roofline_draws_the_datasheet_roof_dashed_for_a_known_device():
    fig = roofline(sweep({1: 10.0, 2: 10.0}))
    spec = trace(fig, "spec roof: NVIDIA H200 SXM bf16")  # harness/device/spec_peaks.csv: 989.5 TFLOP/s, 4800 GB/s
    assert spec.line.dash == "dash"
    assert max(spec.y) == pytest.approx(989.5)
    assert spec.y[0] == pytest.approx(spec.x[0] * 4800 / 1000)


def test_roofline_has_no_datasheet_roof_for_a_device_without_one():
    fig = roofline(sweep({1: 10.0, 2: 10.0}, device_name="AMD EPYC 7B13"))
    assert not [name for name in trace_names(fig) if name.startswith("spec roof")]
    assert "measured roof: AMD EPYC 7B13 bf16" in trace_names(fig)


def test_roofline_draws_one_measured_roof_per_device_and_dtype():
    rows = pd.concat([sweep({1: 10.0}), sweep({1: 10.0}, dtype="fp32", peak_tflops=60.0)], ignore_index=True)
    roofs = [name for name in trace_names(roofline(rows)) if name.startswith("measured roof")]
    assert roofs == ["measured roof: NVIDIA H200 bf16", "measured roof: NVIDIA H200 fp32"]


def test_roofline_plots_decode_as_circles_and_prefill_as_diamonds():
    rows = sweep({1: 10.0, 2: 10.0}, prefill_arithmetic_intensity=300.0, prefill_achieved_tflops=400.0)
    fig = roofline(rows)
    assert trace(fig, "decode").marker.symbol == "circle" and trace(fig, "prefill").marker.symbol == "diamond"
    assert list(trace(fig, "prefill").x) == [300.0, 300.0]


def test_roofline_without_prefill_columns_draws_decode_only():
    names = trace_names(roofline(sweep({1: 10.0, 2: 10.0})))
    assert "decode" in names and "prefill" not in names


def test_roofline_plots_only_ok_rows():
    rows = sweep({1: 10.0, 2: 10.0, 4: 10.0})
    rows.loc[2, "status"] = "oom"
    assert list(trace(roofline(rows), "decode").x) == [1.0, 2.0]


def test_roofline_colours_points_by_log2_batch_with_a_batch_colorbar():
    fig = roofline(sweep({1: 10.0, 4: 10.0, 16: 10.0}))
    assert list(trace(fig, "decode").marker.color) == [0.0, 2.0, 4.0]
    assert fig.layout.coloraxis.colorbar.title.text == "batch"
    assert list(fig.layout.coloraxis.colorbar.ticktext) == ["1", "2", "4", "8", "16"]


def test_roofline_hover_shows_the_point_config():
    (decode,) = [t for t in roofline(sweep({1: 10.0})).data if t.name == "decode"]
    for field in ("model", "cache", "dtype", "kv_dtype", "bound", "device_name"):
        assert f"{field}: " in decode.hovertemplate  # named once per trace
    assert "batch_size: %{customdata[0]:.4g}<br>prompt_len: %{customdata[1]:.4g}" in decode.hovertemplate
    assert decode.customdata[0][:2].tolist() == [1.0, 512.0]  # and the numbers per point


def test_roofline_splits_points_by_config_in_one_legend_group_per_phase():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}), sweep({1: 10.0}, cache="paged")], ignore_index=True)
    decode = [t for t in roofline(rows).data if t.name == "decode"]
    assert [len(t.x) for t in decode] == [2, 1]
    assert ["cache: contiguous" in t.hovertemplate for t in decode] == [True, False]
    assert {t.legendgroup for t in decode} == {"decode"} and [t.showlegend for t in decode] == [True, False]


def test_roofline_of_100k_rows_uses_webgl_and_stays_fast():
    rows = sweep({1: 10.0, 2: 10.0, 4: 10.0, 8: 12.0})
    rows = rows.loc[np.resize(rows.index, 100_000)].reset_index(drop=True)
    started = time.perf_counter()
    fig = roofline(rows)
    assert time.perf_counter() - started < 5.0
    assert isinstance(trace(fig, "decode"), go.Scattergl) and len(trace(fig, "decode").x) == 100_000


def test_a_small_roofline_uses_svg_markers():
    assert isinstance(trace(roofline(sweep({1: 10.0})), "decode"), go.Scatter)


def bf16_and_fp32() -> pd.DataFrame:
    return pd.concat(
        [sweep({1: 10.0, 4: 10.0}), sweep({1: 10.0, 4: 10.0}, dtype="fp32", kv_dtype="fp32", peak_tflops=60.0)],
        ignore_index=True,
    )


def test_roofline_draws_each_compute_dtype_in_its_own_colour_family_and_colorbar():
    fig = roofline(bf16_and_fp32())
    bf16, fp32 = trace(fig, "decode bf16"), trace(fig, "decode fp32")
    assert bf16.marker.coloraxis != fp32.marker.coloraxis
    axes = {axis: fig.layout[axis] for axis in (bf16.marker.coloraxis, fp32.marker.coloraxis)}
    assert axes[bf16.marker.coloraxis].colorbar.title.text == "batch, bf16"
    assert axes[fp32.marker.coloraxis].colorbar.title.text == "batch, fp32"
    assert axes[bf16.marker.coloraxis].colorscale != axes[fp32.marker.coloraxis].colorscale


def test_roofline_labels_each_dtypes_compute_roof_in_the_colour_of_its_points():
    fig = roofline(bf16_and_fp32())
    notes = {a.text: a.font.color for a in fig.layout.annotations}
    assert "bf16 compute roof 800 TFLOP/s" in notes and "fp32 compute roof 60 TFLOP/s" in notes
    assert trace(fig, "measured roof: NVIDIA H200 fp32").line.color == notes["fp32 compute roof 60 TFLOP/s"]
    scale = fig.layout[trace(fig, "decode fp32").marker.coloraxis].colorscale
    assert notes["fp32 compute roof 60 TFLOP/s"] in [colour for _, colour in scale]


def test_roofline_names_the_memory_roof_read_or_copy_where_the_rows_record_it():
    names = trace_names(roofline(sweep({1: 10.0}, bw_roof="read")))
    assert "measured roof: NVIDIA H200 bf16 (read bandwidth)" in names
    assert "measured roof: NVIDIA H200 bf16" in trace_names(roofline(sweep({1: 10.0}, bw_roof=None)))


def test_roofline_draws_rows_not_to_trust_with_open_markers_and_says_why_in_the_hover():
    rows = pd.concat(
        [sweep({1: 10.0}, converged=False), sweep({2: 10.0}, host_busy=None, converged=None)], ignore_index=True
    )
    decode = [t for t in roofline(rows).data if t.name == "decode"]
    assert sorted(t.marker.symbol for t in decode) == ["circle", "circle-open"]
    (marked,) = [t for t in decode if t.marker.symbol == "circle-open"]
    assert "marks: not converged" in marked.hovertemplate
