"""The Serving page's charts: the KV pool against time, latency CDFs, throughput and p99 TTFT against qps with the
knee, goodput, and the planner's predicted concurrency beside the measured one.

Pure functions of the serving tables (harness.serve.rows): `runs`, one row per run (run.parquet's columns:
run_metrics' figures and RUN_CONTEXT, null for a run that never finished), `requests` (request rows, run_id says
whose) and one run's `iterations`. Every figure drawn is measured, except the planner's predicted_max_running,
which is named "predicted" wherever it appears. A qps curve never joins two treatments, models, devices or sweeps:
those that vary among the runs name the line.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard.charts.common import colour, message_figure, numbers, require, texts
from harness.errors import ConfigError
from harness.serve.metrics import SLO_COLUMNS, knee

# What names a line, in this order: the fields that vary among the runs drawn, and always strategy and kv_dtype.
LINE_KEYS = ("engine", "model", "device", "sweep_id", "strategy", "kv_dtype")
ALWAYS = ("strategy", "kv_dtype")
LATENCIES = {  # request-row column: (its name in a title, the axis title)
    "ttft_ms": ("TTFT", "time to first token (ms)"),
    "tpot_ms": ("TPOT", "time per output token (ms)"),
    "e2el_ms": ("E2E latency", "end-to-end latency (ms)"),
}
QPS_TITLE = "offered load (requests/s)"
# A point that did not sustain its rate (harness.serve.sustained) is drawn hollow: the knee never stands on one.
SUSTAINED_SYMBOL, NOT_SUSTAINED_SYMBOL = "circle", "circle-open"
NOT_SUSTAINED_NOTE = "hollow: the run did not sustain its rate (hover for why); the knee stands on solid points only"
PREDICTED, MEASURED = "predicted (planner)", "measured"


# --------------------------------------------------------------------------------------------------------- labels


def line_labels(runs: pd.DataFrame) -> pd.Series:
    """Per run, what its qps curve is: strategy / kv_dtype, after the LINE_KEYS that vary among the runs
    (engine, model, device, sweep), e.g. "paged / fp8" or "transformers / paged / bf16"."""
    present = [key for key in LINE_KEYS if key in runs.columns]
    described = _described(runs)  # an unfinished run has no context to vary by
    varying = [key for key in present if key in ALWAYS or described[key].nunique(dropna=False) > 1]
    if not varying:
        return pd.Series("all runs", index=runs.index, dtype=object)
    parts = [texts(runs, key) for key in varying]
    label = parts[0]
    for part in parts[1:]:
        label = label + " / " + part
    return label.astype(str)


def run_labels(runs: pd.DataFrame) -> pd.Series:
    """Per run, its line label and qps ("paged / fp8 / qps 16"); a run without a run row is "<run_id>
    (unfinished)"; two runs that would read alike get their run_id after the label."""
    label = line_labels(runs) + " / qps " + texts(runs, "qps")
    if "run_id" not in runs.columns:
        return label
    run_ids = runs["run_id"].astype(str)
    unfinished = numbers(runs, "qps").isna()
    label = label.where(~unfinished, run_ids + " (unfinished)")
    repeated = label.duplicated(keep=False)
    return label.where(~repeated, label + " · " + run_ids).astype(str)


def slo_text(runs: pd.DataFrame) -> str:
    """The SLOs the runs' goodput counted, e.g. "TTFT ≤ 60 ms, TPOT ≤ 20 ms"; "no SLO" (goodput is then the request
    throughput); "SLOs differ among the runs" when they do."""
    per_run = pd.Series("", index=runs.index, dtype=object)
    for column, name in SLO_COLUMNS.items():
        value = texts(runs, column)
        part = (name + " ≤ " + value + " ms").where(numbers(runs, column).notna(), "")
        per_run = per_run.where(part == "", per_run.where(per_run == "", per_run + ", ") + part)
    distinct = set(per_run.replace("", "no SLO"))
    return distinct.pop() if len(distinct) == 1 else "SLOs differ among the runs"


def default_ttft_slo_ms(runs: pd.DataFrame) -> float | None:
    """The TTFT SLO the runs were measured against (their ttft_slo_ms; the most common where they differ), None
    when none had one."""
    values = numbers(runs, "ttft_slo_ms").dropna()
    return float(values.mode().iloc[0]) if len(values) else None


def _described(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs with a run row (their qps is known); an unfinished run has only its run_id and requests."""
    return runs[numbers(runs, "qps").notna().to_numpy()]


def _require_finished(runs: pd.DataFrame, columns: list[str]) -> None:
    """MissingColumns when a column is absent, or null in every finished run (an older run row, a percentile the
    runs did not ask for); no finished run at all is not missing columns: the chart says "no finished runs"."""
    require(_described(runs) if "qps" in runs.columns else runs, columns)


def _finished(runs: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """The runs with every one of `columns` (a finished run's), sorted by line then qps."""
    keep = pd.Series(True, index=runs.index)
    for column in columns:
        keep &= numbers(runs, column).notna()
    kept = runs[keep.to_numpy()]
    return kept.assign(_line=line_labels(kept), _qps=numbers(kept, "qps")).sort_values(["_line", "_qps"])


# ---------------------------------------------------------------------------------------------------- the KV pool


def kv_timeline(iterations: pd.DataFrame, *, num_blocks: float | None = None, run: str = "") -> go.Figure:
    """One run's KV blocks used at each iteration against time, with the pool's num_blocks as a dashed line (top
    panel), and the requests running and waiting (bottom panel): where the pool fills, the queue grows."""
    require(iterations, ["time_s", "kv_used_blocks", "num_running", "num_waiting"])
    title = "KV blocks used against time" + (f": {run}" if run else "")
    if iterations.empty:
        return message_figure(title=title, x_title="time (s)", y_title="KV blocks", message="no iterations recorded")
    steps = iterations.sort_values("time_s")
    time_s = numbers(steps, "time_s")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.6, 0.4], vertical_spacing=0.08)
    fig.add_trace(
        go.Scatter(
            x=time_s,
            y=numbers(steps, "kv_used_blocks"),
            mode="lines",
            line_shape="hv",  # the pool holds its count until the next iteration
            name="KV blocks used",
            line=dict(color=colour(0)),
        ),
        row=1,
        col=1,
    )
    if num_blocks is not None and math.isfinite(num_blocks):
        fig.add_trace(
            go.Scatter(
                x=[time_s.min(), time_s.max()],
                y=[float(num_blocks)] * 2,
                mode="lines",
                name=f"pool: {int(num_blocks)} blocks",
                line=dict(color="black", dash="dash"),
            ),
            row=1,
            col=1,
        )
    for i, (column, name) in enumerate((("num_running", "running requests"), ("num_waiting", "waiting requests"))):
        fig.add_trace(
            go.Scatter(
                x=time_s,
                y=numbers(steps, column),
                mode="lines",
                line_shape="hv",
                name=name,
                line=dict(color=colour(i + 1)),
            ),
            row=2,
            col=1,
        )
    fig.update_layout(title_text=title, hovermode="x unified")
    fig.update_yaxes(title_text="KV blocks", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="time (s)", row=2, col=1)
    return fig


# ------------------------------------------------------------------------------------------------------ latencies


def latency_cdf(runs: pd.DataFrame, requests: pd.DataFrame, *, metric: str = "ttft_ms") -> go.Figure:
    """The empirical CDF of one request latency (ttft_ms, tpot_ms or e2el_ms), one step line per run, labelled as
    run_labels does. A one-token output has no TPOT and is left out of the TPOT curve, as the run row's TPOT
    statistics leave it out."""
    if metric not in LATENCIES:
        raise ConfigError(f"metric: must be one of {', '.join(LATENCIES)}, got {metric!r}")
    require(runs, ["run_id"])
    require(requests, ["run_id", metric])
    name, x_title = LATENCIES[metric]
    title, y_title = f"{name}: cumulative distribution over requests", "fraction of requests"
    names = dict(zip(runs["run_id"].astype(str), run_labels(runs), strict=True))
    fig = go.Figure()
    for i, (run_id, label) in enumerate(names.items()):
        values = np.sort(numbers(requests[requests["run_id"].astype(str) == run_id], metric).dropna().to_numpy())
        if values.size == 0:
            continue
        fig.add_trace(
            go.Scatter(
                x=values,
                y=np.arange(1, values.size + 1) / values.size,
                mode="lines",
                line_shape="hv",  # an empirical CDF steps up at each request
                name=label,
                line=dict(color=colour(i)),
                hovertemplate=f"%{{x:.4g}} ms: %{{y:.0%}} of requests<extra>{label}</extra>",
            )
        )
    if not fig.data:
        return message_figure(title=title, x_title=x_title, y_title=y_title, message="no requests")
    fig.update_layout(title_text=title, xaxis_title_text=x_title, yaxis=dict(title_text=y_title, range=[0, 1.02]))
    return fig


# ----------------------------------------------------------------------------------------------------- against qps


def _not_drawn_note(fig: go.Figure, runs: pd.DataFrame) -> None:
    """Say how many runs sit at qps=inf (every request at t = 0): a qps axis has no place for them."""
    at_once = int(np.isinf(numbers(runs, "qps")).sum())
    if at_once:
        fig.add_annotation(
            text=f"{at_once} run(s) at qps=inf (all requests at once) not drawn",
            x=1,
            y=-0.18,
            xref="paper",
            yref="paper",
            showarrow=False,
            xanchor="right",
        )


def _sustained(group: pd.DataFrame) -> tuple[np.ndarray, list[str]]:
    """Per point, whether it sustained its rate (the run row's `sustained`; null or absent: unknown, which is not)
    and its hover line: the achieved rate beside the offered one, or why it is not sustained."""
    held = (numbers(group, "sustained") == 1.0).to_numpy()
    achieved, offered = numbers(group, "achieved_qps"), numbers(group, "window_offered_qps")
    reasons = texts(group, "not_sustained_reason")
    lines = []
    for ok, got, asked, why in zip(held, achieved, offered, reasons, strict=True):
        rate = f"achieved {got:.3g} of {asked:.3g} req/s offered in the window" if math.isfinite(got) else ""
        if ok:
            lines.append(f"sustained: {rate}")
        else:
            lines.append("not sustained: " + (why if why != "-" else "unknown (no verdict recorded)"))
    return held, lines


def _point_style(group: pd.DataFrame, i: int) -> dict:
    """A line's markers, solid where the run sustained its rate and hollow where not, with the reason in the hover."""
    held, lines = _sustained(group)
    symbols = [SUSTAINED_SYMBOL if ok else NOT_SUSTAINED_SYMBOL for ok in held]
    return dict(
        mode="lines+markers",
        line=dict(color=colour(i)),
        marker=dict(symbol=symbols, size=9, color=colour(i)),
        customdata=lines,
        hovertemplate="qps %{x:g}: %{y:.4g}<br>%{customdata}",
    )


def _hollow_note(fig: go.Figure, drawn: pd.DataFrame) -> None:
    """Say what a hollow marker means, when any point drawn is one (a note, not a legend entry with no point)."""
    if (numbers(drawn, "sustained") == 1.0).all():
        return
    fig.add_annotation(
        text=NOT_SUSTAINED_NOTE, x=0, y=-0.26, xref="paper", yref="paper", showarrow=False, xanchor="left"
    )


def qps_curves(runs: pd.DataFrame, *, slo_ms: float | None = None) -> go.Figure:
    """Output throughput (tok/s, top) and p99 TTFT (ms, bottom) against the offered qps, one line per treatment
    (line_labels), with the TTFT SLO as a dashed line and each line's knee marked: the highest qps whose p99 TTFT
    stays at or under slo_ms, every point up to it sustained (harness.serve.metrics.knee over the finite qps drawn;
    harness.serve.sustained). A point that did not sustain its rate is hollow, its reason in the hover. No slo_ms:
    no knee."""
    _require_finished(runs, ["qps", "output_throughput", "p99_ttft_ms"])
    title = "Throughput and p99 TTFT against offered load"
    points = _finished(runs, ["qps", "output_throughput"])
    drawn = points[np.isfinite(points["_qps"].to_numpy())]
    if drawn.empty:
        fig = message_figure(title=title, x_title=QPS_TITLE, y_title="output tokens/s", message="no finished runs")
        _not_drawn_note(fig, points)
        return fig
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    unmet = []
    for i, (line, group) in enumerate(drawn.groupby("_line", sort=True)):
        style = _point_style(group, i) | dict(legendgroup=line)
        throughput = go.Scatter(x=group["_qps"], y=numbers(group, "output_throughput"), name=line, **style)
        fig.add_trace(throughput, row=1, col=1)
        p99 = numbers(group, "p99_ttft_ms")
        fig.add_trace(go.Scatter(x=group["_qps"], y=p99, name=line, showlegend=False, **style), row=2, col=1)
        if slo_ms is None:
            continue
        held, _ = _sustained(group)
        knee_qps = knee(pd.DataFrame({"qps": group["_qps"], "p99_ttft_ms": p99, "sustained": held}), slo_ms)
        if knee_qps is None:
            unmet.append(line)
            continue
        at = (group["_qps"] == knee_qps).to_numpy()
        marker = dict(symbol="star", size=16, color=colour(i), line=dict(color="black", width=1))
        for row, column in ((1, "output_throughput"), (2, "p99_ttft_ms")):
            fig.add_trace(
                go.Scatter(
                    x=[knee_qps],
                    y=numbers(group[at], column).to_numpy()[:1],
                    mode="markers",
                    marker=marker,
                    name=f"knee, {line}: qps {knee_qps:g}",
                    legendgroup=line,
                    showlegend=row == 2,
                ),
                row=row,
                col=1,
            )
    if slo_ms is not None:
        fig.add_trace(
            go.Scatter(
                x=[drawn["_qps"].min(), drawn["_qps"].max()],
                y=[float(slo_ms)] * 2,
                mode="lines",
                name=f"TTFT SLO: {slo_ms:g} ms",
                line=dict(color="black", dash="dash"),
            ),
            row=2,
            col=1,
        )
        for j, line in enumerate(unmet):
            fig.add_annotation(
                text=f"{line}: the lowest qps already over the SLO or not sustained (no knee)",
                x=0,
                y=1.06 + 0.05 * j,
                xref="paper",
                yref="paper",
                showarrow=False,
                xanchor="left",
            )
    _hollow_note(fig, drawn)
    _not_drawn_note(fig, points)
    fig.update_layout(title_text=title)
    fig.update_xaxes(type="log", row=1, col=1)
    fig.update_xaxes(type="log", title_text=QPS_TITLE, row=2, col=1)
    fig.update_yaxes(title_text="output throughput (tokens/s)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="p99 TTFT (ms)", rangemode="tozero", row=2, col=1)
    return fig


def goodput_vs_qps(runs: pd.DataFrame) -> go.Figure:
    """Goodput (requests/s that met every SLO of the run) against the offered qps, one line per treatment; the SLOs
    it counted are in the title. A point that did not sustain its rate is hollow, as in qps_curves."""
    _require_finished(runs, ["qps", "request_goodput"])
    points = _finished(runs, ["qps", "request_goodput"])
    drawn = points[np.isfinite(points["_qps"].to_numpy())]
    title = f"Goodput against offered load ({slo_text(drawn) if len(drawn) else 'no SLO'})"
    y_title = "goodput (requests/s within the SLO)"
    if drawn.empty:
        fig = message_figure(title=title, x_title=QPS_TITLE, y_title=y_title, message="no finished runs")
        _not_drawn_note(fig, points)
        return fig
    fig = go.Figure()
    for i, (line, group) in enumerate(drawn.groupby("_line", sort=True)):
        fig.add_trace(
            go.Scatter(
                x=group["_qps"],
                y=numbers(group, "request_goodput"),
                name=line,
                **_point_style(group, i),
            )
        )
    _hollow_note(fig, drawn)
    _not_drawn_note(fig, points)
    fig.update_layout(
        title_text=title,
        xaxis=dict(type="log", title_text=QPS_TITLE),
        yaxis=dict(title_text=y_title, rangemode="tozero"),
    )
    return fig


# ------------------------------------------------------------------------------------------------ the planner


def concurrency_check(runs: pd.DataFrame) -> go.Figure:
    """Per finished run, the planner's predicted_max_running (hatched: a prediction) beside the measured
    max_running_requests (queueing left out, as the planner counts), as grouped bars; a run the planner made no
    prediction for has its measured bar alone."""
    _require_finished(runs, ["max_running_requests"])
    title = "Running requests: the planner's prediction beside the measured maximum"
    x_title, y_title = "run", "running requests"
    points = _finished(runs, ["max_running_requests"])
    if points.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title, message="no finished runs")
    names = run_labels(points).to_list()
    predicted = numbers(points, "predicted_max_running")
    fig = go.Figure()
    if predicted.notna().any():
        fig.add_trace(go.Bar(x=names, y=predicted, name=PREDICTED, marker=dict(color=colour(0), pattern_shape="/")))
    fig.add_trace(go.Bar(x=names, y=numbers(points, "max_running_requests"), name=MEASURED, marker_color=colour(1)))
    fig.update_layout(title_text=title, barmode="group", xaxis_title_text=x_title, yaxis_title_text=y_title)
    return fig
