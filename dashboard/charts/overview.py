"""The overview page's chart: how many rows each sweep has, by status."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import require

STATUS_COLOURS = {
    "ok": "#2ca02c",
    "oom": "#d62728",
    "skipped_oom": "#f4a6a6",  # not run: the OOM backstop (harness/run/sweep.py) judged it past an OOM
    "error": "#7f7f7f",
    "unsupported": "#ff7f0e",
}


def status_counts(rows: pd.DataFrame) -> go.Figure:
    """Rows per sweep, stacked by status (ok, oom, error, unsupported, then any other), newest sweep on top."""
    require(rows, ["sweep_id", "status"])
    counts = rows.groupby(["sweep_id", "status"], dropna=False).size().unstack(fill_value=0)
    order = rows.groupby("sweep_id")["started_at"].min().sort_values() if "started_at" in rows else None
    if order is not None:
        counts = counts.reindex(order.index)
    statuses = [s for s in STATUS_COLOURS if s in counts.columns] + [
        s for s in counts.columns if s not in STATUS_COLOURS
    ]
    fig = go.Figure(
        [
            go.Bar(
                y=counts.index.astype(str),
                x=counts[status],
                name=str(status),
                orientation="h",
                marker_color=STATUS_COLOURS.get(status),
            )
            for status in statuses
        ]
    )
    fig.update_layout(
        title="Rows per sweep, by status",
        barmode="stack",
        xaxis_title="rows",
        yaxis_title="sweep",
        height=max(250, 40 + 28 * len(counts)),
    )
    return fig
