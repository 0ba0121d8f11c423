"""The profile page's charts: where a decode step's time goes (the profiler's shares) and one point's top ops."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import colour, format_number, message_figure, numbers, ok_rows, require, texts
from harness.store.schema import PROFILE_CATEGORIES  # torch-free: harness.measure.profile itself imports torch

PROFILE_BY = {"prompt_len": "prompt length (tokens)", "batch_size": "batch size (sequences)"}


def category_colour(category: str) -> str:
    """One colour per profiler category, the same in profile_shares and top_ops."""
    return colour(PROFILE_CATEGORIES.index(category)) if category in PROFILE_CATEGORIES else "grey"


def profile_shares(rows: pd.DataFrame, *, by: str = "prompt_len") -> go.Figure:
    """The profiler's six shares of a decode step's time (prof_*_frac), stacked, the median per value of `by`."""
    if by not in PROFILE_BY:
        raise ValueError(f"by must be one of {', '.join(PROFILE_BY)}, got {by!r}")
    shares = [f"prof_{category}_frac" for category in PROFILE_CATEGORIES]
    require(rows, [by, *shares])
    title = f"Where a decode step's time goes, by {PROFILE_BY[by].split(' (')[0]}"
    x_title, y_title = PROFILE_BY[by], "share of step time"
    ok = ok_rows(rows)
    points = pd.DataFrame({column: numbers(ok, column) for column in [by, *shares]}).dropna()
    if points.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)
    per_value = points.groupby(by).median().sort_index()
    x = [format_number(value) for value in per_value.index]
    fig = go.Figure()
    for category, column in zip(PROFILE_CATEGORIES, shares, strict=True):
        fig.add_trace(go.Bar(x=x, y=per_value[column], name=category, marker_color=category_colour(category)))
    fig.update_layout(
        title_text=title,
        barmode="stack",
        xaxis=dict(type="category", title_text=x_title),
        yaxis=dict(range=[0, 1], title_text=y_title),
    )
    return fig


def top_ops(ops: pd.DataFrame, *, n: int = 15) -> go.Figure:
    """The n ops with the most self time in one point's top-ops table (harness.measure.profile: op, category,
    self_time_ms, ...), as horizontal bars coloured by category, the biggest on top."""
    time_column = "us" if "self_time_ms" not in ops.columns and "us" in ops.columns else "self_time_ms"
    require(ops, ["op", "category", time_column])
    if "point_id" in ops.columns and ops["point_id"].nunique() > 1:
        raise ValueError(f"top_ops draws one point's table; got {ops['point_id'].nunique()} point_ids")
    ops = ops.reset_index(drop=True)  # the columns below are aligned on it
    title = "Top ops by self time"
    x_title = "self time (µs)" if time_column == "us" else "self time (ms, over the profiled steps)"
    y_title = "op"
    table = pd.DataFrame(
        {"op": texts(ops, "op"), "category": texts(ops, "category"), "time": numbers(ops, time_column)}
    )
    table = table.dropna(subset=["time"]).sort_values("time", ascending=False, kind="stable").head(n)
    if table.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title, message="no ops")
    # Kernel names run to hundreds of characters: shorten for the axis, keep the whole name in the hover.
    short = table["op"].where(table["op"].str.len() <= 60, table["op"].str.slice(0, 59) + "…")
    rank = pd.Series(np.arange(1, len(table) + 1), index=table.index).astype(str)
    table["label"] = short.where(~short.duplicated(keep=False), short + " [" + rank + "]")  # one bar per op
    fig = go.Figure()
    for category, group in table.groupby("category", sort=True):
        fig.add_trace(
            go.Bar(
                x=group["time"],
                y=group["label"],
                orientation="h",
                name=category,
                marker_color=category_colour(category),
                hovertext=group["op"],
                hovertemplate="%{hovertext}<br>%{x:.4g}<extra>" + category + "</extra>",
            )
        )
    fig.update_layout(
        title_text=f"Top {len(table)} ops by self time",
        xaxis_title_text=x_title,
        # Ascending from the bottom, so the biggest op is on top.
        yaxis=dict(
            type="category", categoryorder="array", categoryarray=table["label"].to_list()[::-1], title_text=y_title
        ),
    )
    return fig
