"""The KV tiers & transfer page's second module of charts (issue #18): the prefill -> decode KV transfer against the
context, measured transports beside extrapolated links, the disaggregated TTFT beside the colocated one, and the
context from which sending the KV outlasts a decode step.

Frames in the contract of harness.store.tables (PD_COLUMNS). Pure functions to plotly figures, tables and caption
strings, as dashboard/charts/common.py describes; the crossings are dashboard/charts/tiers.py's.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import LOG2_DTICK, colour, labels, message_figure, numbers, ok_rows, require, texts
from dashboard.charts.tiers import REFERENCE_COLOUR, crossing, crossing_note

EXTRAPOLATED = "(extrapolated)"  # the legend's word for a datasheet link's line
EXTRAPOLATED_DASH, STEP_DASH = "dash", "dot"

PD_GROUP = ("model", "weights", "device", "device_name", "dtype", "kv_dtype", "batch_size")


def pd_workloads(table: pd.DataFrame) -> pd.Series:
    """A label per PD row naming its workload (PD_GROUP) where it varies, kv_dtype always; a chart draws one."""
    return labels(table, PD_GROUP, always=("kv_dtype",) if "kv_dtype" in table.columns else ()).astype(str)


def is_extrapolated(table: pd.DataFrame) -> pd.Series:
    return texts(table, "source").str.startswith("extrapolated")


def _pd_points(table: pd.DataFrame, workload: str | None) -> pd.DataFrame:
    ok = ok_rows(table).reset_index(drop=True)
    names = pd_workloads(ok)
    if workload is None and len(names):
        workload = names.value_counts().sort_index().sort_values(ascending=False, kind="stable").index[0]
    ok = ok[(names == workload).to_numpy()]
    extrapolated = is_extrapolated(ok)
    return ok.assign(
        x=numbers(ok, "context"),
        extrapolated=extrapolated.to_numpy(),
        line=(texts(ok, "transport") + pd.Series(np.where(extrapolated, f" {EXTRAPOLATED}", ""), index=ok.index)),
    ).loc[lambda frame: frame["x"] > 0]


def _per_transport(fig: go.Figure, points: pd.DataFrame, column: str, *, unit_hover: str) -> None:
    """One line per transport of `column`'s median against the context; extrapolated ones dashed."""
    for i, (line, group) in enumerate(points.groupby("line", sort=True)):
        medians = group.assign(y=numbers(group, column)).groupby("x")["y"].median().dropna().sort_index()
        if medians.empty:
            continue
        dashed = bool(group["extrapolated"].iloc[0])
        fig.add_trace(
            go.Scatter(
                x=medians.index,
                y=medians,
                mode="lines+markers",
                name=line,
                line=dict(color=colour(i), dash=EXTRAPOLATED_DASH if dashed else None),
                marker=dict(symbol="circle-open" if dashed else "circle"),
                hovertemplate=f"context %{{x}}: {unit_hover}<extra>{line}</extra>",
            )
        )


def _measured_reference(fig: go.Figure, points: pd.DataFrame, column: str, name: str) -> None:
    """A per-context median of `column` over the measured rows (all rows where none is) as a dotted black line."""
    measured = points[~points["extrapolated"]] if (~points["extrapolated"]).any() else points
    medians = measured.assign(y=numbers(measured, column)).groupby("x")["y"].median().dropna().sort_index()
    if len(medians):
        fig.add_trace(
            go.Scatter(
                x=medians.index,
                y=medians,
                mode="lines",
                name=name,
                line=dict(color=REFERENCE_COLOUR, dash=STEP_DASH),
                hovertemplate=f"context %{{x}}: %{{y:.4g}} ms<extra>{column}</extra>",
            )
        )


def pd_transfer(table: pd.DataFrame, *, workload: str | None = None) -> go.Figure:
    """KV transfer time against the context (log2 x, log y) of one workload (pd_workloads; None: the one with the
    most rows), a line per transport, extrapolated links dashed and "(extrapolated)" in their names, and the
    measured decode step (tpot_ms) as a dotted line: where a transport rises above it, sending outlasts a step."""
    require(table, ["transport", "context", "transfer_ms"])
    title = "Prefill → decode KV transfer against context"
    x_title, y_title = "context (tokens)", "transfer time (ms)"
    points = _pd_points(table, workload)
    if points.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)
    fig = go.Figure()
    _per_transport(fig, points, "transfer_ms", unit_hover="%{y:.4g} ms")
    _measured_reference(fig, points, "tpot_ms", "one decode step (tpot_ms, measured)")
    fig.update_layout(
        title_text=title,
        xaxis=dict(type="log", dtick=LOG2_DTICK, title_text=x_title),
        yaxis=dict(type="log", title_text=y_title),
    )
    return fig


def pd_ttft(table: pd.DataFrame, *, workload: str | None = None) -> go.Figure:
    """TTFT disaggregated (prefill + transfer + first step, ttft_pd_ms) per transport against TTFT colocated
    (ttft_colocated_ms, measured) against the context; extrapolated links dashed."""
    require(table, ["transport", "context", "ttft_pd_ms"])
    title = "Time to first token: disaggregated against colocated"
    x_title, y_title = "context (tokens)", "time to first token (ms)"
    points = _pd_points(table, workload)
    if points.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)
    fig = go.Figure()
    _per_transport(fig, points, "ttft_pd_ms", unit_hover="%{y:.4g} ms")
    _measured_reference(fig, points, "ttft_colocated_ms", "colocated (ttft_colocated_ms, measured)")
    fig.update_layout(
        title_text=title, xaxis=dict(type="log", dtick=LOG2_DTICK, title_text=x_title), yaxis_title_text=y_title
    )
    return fig


def pd_step_crossings(table: pd.DataFrame, *, workload: str | None = None) -> pd.DataFrame:
    """Per transport, the context from which sending the KV outlasts one decode step (transfer_over_step rises
    through 1, interpolated between adjacent contexts), or why none was found; and where the figure comes from."""
    points = _pd_points(table, workload)
    found = []
    for line, group in points.groupby("line", sort=True):
        ratio = numbers(group, "transfer_over_step").fillna(numbers(group, "transfer_ms") / numbers(group, "tpot_ms"))
        per_context = group.assign(ratio=ratio).groupby("x")["ratio"].median().sort_index()
        x = per_context.index.to_series()
        note = crossing_note(
            x,
            pd.Series(1.0, index=x.index),
            per_context,
            event="the transfer outlasts a decode step",
            otherwise="a decode step outlasts the transfer",
        )
        at = crossing(x, pd.Series(1.0, index=x.index), per_context)
        found.append(dict(transport=line, source=group["source"].iloc[0], outlasts_step_from=at, note=note))
    return pd.DataFrame(found, columns=["transport", "source", "outlasts_step_from", "note"])


def pd_caption(table: pd.DataFrame) -> str:
    """Which PD lines are measured and which extrapolated, with each extrapolated link's datasheet."""
    ok = ok_rows(table)
    measured = sorted(set(texts(ok, "transport")[~is_extrapolated(ok)]))
    links = ok[is_extrapolated(ok).to_numpy()].drop_duplicates("transport")
    said = "; ".join(f"{t}: {s}" for t, s in zip(texts(links, "transport"), texts(links, "source"), strict=True))
    return (
        f"Measured (solid): {', '.join(measured) or 'none'}, each a median over `repeats` transfers between two "
        "processes on this machine, as are the decode step (tpot_ms) and colocated TTFT. Extrapolated (dashed, "
        f"open markers): kv_bytes over a datasheet link's GB/s, not measured here: {said or 'none'}."
    )
