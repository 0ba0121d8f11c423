"""The Compare page's table and chart: the verdicts of harness.store.compare, coloured, and each pair's ratio B/A
with its confidence interval against its band [1 - t, 1 + t]."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from pandas.io.formats.style import Styler

from dashboard.charts.common import message_figure
from harness.store.compare import AMBIGUOUS, FAST, SAME, SLOW, Comparison

# Green faster, red slower, grey same, amber undecided: the colours nvbench's compare prints its verdicts in.
VERDICT_COLOURS = {FAST: "#2ca02c", SLOW: "#d62728", SAME: "#7f7f7f", AMBIGUOUS: "#ff9f1c"}
NO_PAIRS = "no pairs"


def verdict_table(comparison: Comparison) -> pd.DataFrame:
    """One line per pair: the workload, A's and B's medians, the ratio B/A, its interval, the band's half-width t
    (a fraction), the verdict, why a flagged pair is AMBIGUOUS (empty otherwise) and the note."""
    lines = comparison.verdicts
    return pd.DataFrame(
        {
            "workload": lines["workload"].astype(str),
            "A": lines["a_median"].astype("float64"),
            "B": lines["b_median"].astype("float64"),
            "B/A": lines["ratio"].astype("float64"),
            "CI low": lines["ci_low"].astype("float64"),
            "CI high": lines["ci_high"].astype("float64"),
            "threshold": lines["threshold"].astype("float64"),
            "verdict": lines["verdict"].astype(str),
            "reason": lines["reason"].astype(str),
            "note": lines["note"].astype(str),
        }
    )


def styled_verdicts(table: pd.DataFrame) -> Styler:
    """verdict_table's frame with each verdict cell in its colour, ratios to 3 decimals and the band in %."""
    return table.style.map(
        lambda v: f"color: {VERDICT_COLOURS.get(v, 'inherit')}; font-weight: bold", subset=["verdict"]
    ).format(
        {
            "A": "{:.4g}",
            "B": "{:.4g}",
            "B/A": "{:.3f}",
            "CI low": "{:.3f}",
            "CI high": "{:.3f}",
            "threshold": "±{:.1%}",
        },
        na_rep="-",
    )


def ratio_chart(comparison: Comparison) -> go.Figure:
    """Each pair's ratio B/A (a marker in its verdict's colour) with its interval as error bars, and its band's
    edges as grey ticks; one trace per verdict, so the legend names them."""
    title, x_title, y_title = f"{comparison.metric}: B / A", "ratio B / A (1: unchanged)", "workload"
    lines = comparison.verdicts
    if lines.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title, message=NO_PAIRS)
    fig = go.Figure()
    band = pd.concat([1 - lines["threshold"], 1 + lines["threshold"]], ignore_index=True)
    fig.add_trace(
        go.Scatter(
            x=band.to_numpy(np.float64),
            y=pd.concat([lines["workload"], lines["workload"]], ignore_index=True).to_numpy(),
            mode="markers",
            name="band 1 ± t",
            marker=dict(symbol="line-ns-open", size=14, color="grey"),
            hoverinfo="skip",
        )
    )
    for verdict, colour in VERDICT_COLOURS.items():
        part = lines[lines["verdict"] == verdict]
        if part.empty:
            continue
        fig.add_trace(
            go.Scatter(
                x=part["ratio"].to_numpy(np.float64),
                y=part["workload"].to_numpy(),
                mode="markers",
                name=verdict,
                marker=dict(color=colour, size=10),
                error_x=dict(
                    type="data",
                    symmetric=False,
                    array=(part["ci_high"] - part["ratio"]).to_numpy(np.float64),
                    arrayminus=(part["ratio"] - part["ci_low"]).to_numpy(np.float64),
                ),
                hovertemplate="%{y}<br>B/A %{x:.3f}<extra>" + verdict + "</extra>",
            )
        )
    fig.add_vline(x=1.0, line_dash="dot", line_color="black")
    fig.update_layout(title_text=title, xaxis_title_text=x_title, yaxis_title_text=y_title)
    return fig
