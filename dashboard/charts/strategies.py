"""The strategies page's table and chart: every cache and storage format side by side, and their Pareto front."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import (
    colour,
    hover_groups,
    message_figure,
    numbers,
    ok_rows,
    require,
    scatter_class,
    texts,
)

MIB_BYTES = 2**20
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "star", "hexagon", "triangle-down", "pentagon")
PARETO_HOVER_NUMBERS = ("batch_size", "prompt_len", "top1_agreement")
STRATEGY_MEDIANS = ("tpot_ms", "ttft_ms", "kv_allocated_mib", "kv_waste_fraction", "top1_agreement", "kl_mean")


def strategy_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (cache, kv_dtype) over the ok rows: the medians of STRATEGY_MEDIANS and n_points. A column the
    rows lack is NaN."""
    require(rows, ["cache", "kv_dtype"])
    ok = ok_rows(rows)
    frame = pd.DataFrame(
        {
            "cache": texts(ok, "cache"),
            "kv_dtype": texts(ok, "kv_dtype"),
            "tpot_ms": numbers(ok, "tpot_ms"),
            "ttft_ms": numbers(ok, "ttft_ms"),
            "kv_allocated_mib": numbers(ok, "kv_bytes_allocated") / MIB_BYTES,
            "kv_waste_fraction": numbers(ok, "kv_waste_fraction"),
            "top1_agreement": numbers(ok, "top1_agreement"),
            "kl_mean": numbers(ok, "kl_mean"),
        }
    )
    table = frame.groupby(["cache", "kv_dtype"], sort=True).agg(
        **{column: (column, "median") for column in STRATEGY_MEDIANS}, n_points=("cache", "size")
    )
    return table.reset_index()


def pareto_front(x: pd.Series, y: pd.Series) -> pd.Series:
    """True where no other point is at least as good in both (lower x, lower y) and better in one.

    Sorted by x then y, a point is on the front when its y is below every y before it; exact duplicates of a
    front point are on it too (neither dominates the other)."""
    order = pd.DataFrame({"x": x, "y": y}).sort_values(["x", "y"], kind="stable")
    best_before = np.minimum.accumulate(np.concatenate([[np.inf], order["y"].to_numpy()[:-1]]))
    first = pd.Series(order["y"].to_numpy() < best_before, index=order.index)
    on_front = first.groupby([order["x"], order["y"]]).transform("max")
    return on_front.reindex(x.index)


def strategy_pareto(rows: pd.DataFrame) -> go.Figure:
    """KV memory against TPOT per ok row, colour by cache and symbol by kv_dtype, with the Pareto front (less
    memory and less time both better) as a step line through outlined points."""
    require(rows, ["kv_bytes_allocated", "tpot_ms", "cache", "kv_dtype"])
    title = "KV memory against time per output token"
    x_title, y_title = "KV allocated (MiB)", "time per output token (ms)"
    ok = ok_rows(rows, ["kv_bytes_allocated", "tpot_ms", "cache", "kv_dtype", *PARETO_HOVER_NUMBERS])
    points = pd.DataFrame(
        {
            "x": numbers(ok, "kv_bytes_allocated") / MIB_BYTES,
            "y": numbers(ok, "tpot_ms"),
            "cache": texts(ok, "cache"),
            "kv_dtype": texts(ok, "kv_dtype"),
            **{field: numbers(ok, field) for field in PARETO_HOVER_NUMBERS},
        }
    ).dropna(subset=["x", "y"])
    if points.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)

    kv_dtypes = sorted(points["kv_dtype"].unique())
    symbol_of = {kv_dtype: SYMBOLS[i % len(SYMBOLS)] for i, kv_dtype in enumerate(kv_dtypes)}
    colour_of = {cache: colour(i) for i, cache in enumerate(sorted(points["cache"].unique()))}
    trace = scatter_class(len(points))
    fig = go.Figure()
    # One trace per (cache, kv_dtype): colour and symbol per trace, the numbers per point (hover_groups).
    parts = hover_groups(points, text_fields=("cache", "kv_dtype"), number_fields=PARETO_HOVER_NUMBERS)
    shown: set[str] = set()
    for part, template, customdata in parts:
        cache, kv_dtype = part["cache"].iloc[0], part["kv_dtype"].iloc[0]
        fig.add_trace(
            trace(
                x=part["x"].to_numpy(np.float32),
                y=part["y"].to_numpy(np.float32),
                mode="markers",
                name=cache,
                legendgroup=cache,
                showlegend=cache not in shown,
                marker=dict(color=colour_of[cache], size=10, symbol=symbol_of[kv_dtype]),
                customdata=customdata,
                hovertemplate=f"{template}<br>%{{x:.4g}} MiB, %{{y:.4g}} ms<extra></extra>",
            )
        )
        shown.add(cache)
    for kv_dtype in kv_dtypes:  # a legend key for the symbols, no points of its own
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=f"kv_dtype {kv_dtype}",
                marker=dict(color="grey", size=10, symbol=symbol_of[kv_dtype]),
            )
        )
    front = points[pareto_front(points["x"], points["y"])].sort_values(["x", "y"])
    (_, front_template, front_data), *more = hover_groups(front, text_fields=(), number_fields=PARETO_HOVER_NUMBERS)
    fig.add_trace(
        go.Scatter(
            x=front["x"],
            y=front["y"],
            mode="lines+markers",
            name="Pareto front",
            line=dict(shape="hv", color="black", width=1),  # right, then down: the best TPOT for that much memory
            marker=dict(symbol="circle-open", size=18, color="black", line_width=2),
            text=(front["cache"] + " " + front["kv_dtype"]).to_numpy(),  # the front is short: a string per point
            customdata=front_data,
            hovertemplate=f"%{{text}}{front_template}<br>%{{x:.4g}} MiB, %{{y:.4g}} ms<extra></extra>",
        )
    )
    fig.update_layout(title_text=title, xaxis_title_text=x_title, yaxis_title_text=y_title)
    return fig
