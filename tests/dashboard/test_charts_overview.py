"""The overview page's chart (dashboard/charts/overview.py), read as a plotly spec."""

from __future__ import annotations

import pandas as pd
import pytest

from dashboard.charts.common import MissingColumns
from dashboard.charts.overview import status_counts


def test_status_counts_stacks_each_sweeps_rows_by_status():
    rows = pd.DataFrame(
        {
            "sweep_id": ["a", "a", "a", "b"],
            "status": ["ok", "oom", "ok", "error"],
            "started_at": ["2026-01-01", "2026-01-01", "2026-01-01", "2026-01-02"],
        }
    )
    fig = status_counts(rows)
    bars = {trace.name: dict(zip(trace.y, trace.x, strict=True)) for trace in fig.data}
    assert bars["ok"] == {"a": 2, "b": 0}
    assert bars["oom"] == {"a": 1, "b": 0}
    assert bars["error"] == {"a": 0, "b": 1}
    assert fig.layout.barmode == "stack" and fig.layout.xaxis.title.text == "rows"


def test_status_counts_needs_a_status_column():
    with pytest.raises(MissingColumns, match="status"):
        status_counts(pd.DataFrame({"sweep_id": ["a"]}))
