"""The latency page's charts: time to first token and peak memory against the prompt, each decode step, and TPOT's
spread."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import (
    LOG2_DTICK,
    MARKS,
    colour,
    labels,
    message_figure,
    numbers,
    ok_rows,
    require,
    row_marks,
)
from harness.store.schema import POINT_KEY_COLUMNS

MARK_COLUMNS = tuple(column for column, _, _ in MARKS)

# Every field of the point key, the usual ones first: a label names those that vary among the rows drawn, so a line
# or a bar never takes a median across two workloads or two KV treatments.
POINT_KEYS = ("model", "dtype", "kv_dtype", "cache", "batch_size", "prompt_len", "gen_len") + tuple(
    key
    for key in POINT_KEY_COLUMNS
    if key not in ("model", "dtype", "kv_dtype", "cache", "batch_size", "prompt_len", "gen_len")
)


def ttft_vs_prompt(rows: pd.DataFrame) -> go.Figure:
    """TTFT against prompt length (log2 x), one line per cache and batch_size and whatever else of the point key
    varies (a line is one workload and treatment but the prompt), the median where points repeat; an open marker
    where a point's row did not converge or ran on a busy host."""
    return _against_prompt(
        rows,
        "ttft_ms",
        title="Time to first token against prompt length",
        y_title="time to first token (ms)",
        hover="%{y:.4g} ms",
    )


def peak_memory_vs_prompt(rows: pd.DataFrame) -> go.Figure:
    """Peak memory of the measuring process (peak_mem_bytes, MiB) against prompt length, lines as ttft_vs_prompt's:
    where eager attention's [B, H, T, S] scores grow with the square of the prompt and SDPA's fused kernels do not
    (attn_impl, experiment=fused-attention), and how a cache's bytes grow with the context."""
    return _against_prompt(
        rows,
        "peak_mem_bytes",
        title="Peak memory against prompt length",
        y_title="peak memory (MiB)",
        hover="%{y:.4g} MiB",
        scale=2**-20,
    )


def _against_prompt(
    rows: pd.DataFrame, column: str, *, title: str, y_title: str, hover: str, scale: float = 1.0
) -> go.Figure:
    require(rows, ["prompt_len", column])
    x_title = "prompt length (tokens)"
    ok = ok_rows(rows, ["prompt_len", column, *POINT_KEYS, *MARK_COLUMNS])  # narrowed first: 100k rows
    points = pd.DataFrame({"prompt_len": numbers(ok, "prompt_len"), "value": numbers(ok, column) * scale})
    line_keys = ("cache", *(key for key in POINT_KEYS if key not in ("cache", "prompt_len")))
    points["line"] = labels(ok, line_keys, always=tuple(key for key in ("cache", "batch_size") if key in ok))
    points["marks"] = row_marks(ok)
    points = points[(points["prompt_len"] > 0) & points["value"].notna()]
    if points.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)
    fig = go.Figure()
    for i, (line, group) in enumerate(points.groupby("line", sort=True)):
        per_prompt = group.groupby("prompt_len").agg(
            value=("value", "median"), marks=("marks", lambda marks: ", ".join(sorted(set(marks) - {""})))
        )
        per_prompt = per_prompt.sort_index()
        fig.add_trace(
            go.Scatter(
                x=per_prompt.index,
                y=per_prompt["value"],
                mode="lines+markers",
                name=line,
                line=dict(color=colour(i)),
                marker=dict(symbol=["circle-open" if m else "circle" for m in per_prompt["marks"]], size=8),
                hovertext=per_prompt["marks"].replace("", "-").to_numpy(),
                hovertemplate=f"prompt %{{x}}: {hover}<br>marks: %{{hovertext}}<extra>{line}</extra>",
            )
        )
    fig.update_layout(
        title_text=title,
        xaxis=dict(type="log", dtick=LOG2_DTICK, title_text=x_title),
        yaxis_title_text=y_title,
    )
    return fig


def _steps(value: object) -> list[float] | None:
    """An itl_ms cell as a list of floats; None for a null or empty cell."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    steps = [float(v) for v in value]
    return steps or None


def itl_curves(rows: pd.DataFrame, *, max_lines: int = 12) -> go.Figure:
    """Each decode step's latency against its index, one line per ok row (at most max_lines, the longest prompts
    first): flat-ish with a cache, growing with the step under cache "none" (it recomputes the whole prefix)."""
    require(rows, ["itl_ms"])
    title = "Inter-token latency per decode step"
    x_title, y_title = "decode step", "inter-token latency (ms)"
    ok = ok_rows(rows)
    has_steps = ok["itl_ms"].map(lambda value: _steps(value) is not None).astype(bool)
    ok = ok[has_steps.to_numpy()]
    if ok.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)
    order = pd.DataFrame({"prompt_len": numbers(ok, "prompt_len"), "batch_size": numbers(ok, "batch_size")})
    chosen = ok.loc[order.sort_values(["prompt_len", "batch_size"], ascending=False, kind="stable").index[:max_lines]]
    keys = ("model", "dtype", "kv_dtype", "cache", "prompt_len", "batch_size", *POINT_KEYS[7:])
    names = labels(chosen, keys, always=tuple(key for key in ("cache", "prompt_len", "batch_size") if key in chosen))
    marks = row_marks(chosen)
    names = names.where(marks == "", names + " (" + marks + ")")  # a curve not to trust says so in the legend
    fig = go.Figure()
    for i, (name, value) in enumerate(zip(names, chosen["itl_ms"], strict=True)):
        steps = _steps(value)
        fig.add_trace(
            go.Scatter(
                x=np.arange(1, len(steps) + 1),
                y=steps,
                mode="lines",
                name=name,
                line=dict(color=colour(i)),
            )
        )
    fig.update_layout(title_text=title, xaxis_title_text=x_title, yaxis_title_text=y_title)
    return fig


def tpot_percentiles(rows: pd.DataFrame) -> go.Figure:
    """Median, p90 and p99 TPOT over repeats as grouped bars, one group per point (the point key, POINT_KEYS): the
    median where a point repeats (several sweeps); a point not to trust says why in its label."""
    require(rows, ["tpot_ms"])
    title = "Time per output token: median, p90 and p99 over repeats"
    x_title, y_title = "point", "time per output token (ms)"
    ok = ok_rows(rows, ["tpot_ms", "tpot_p90_ms", "tpot_p99_ms", *POINT_KEYS, *MARK_COLUMNS])
    ok = ok[numbers(ok, "tpot_ms").notna().to_numpy()]
    if ok.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)
    keys = POINT_KEYS
    ok = ok.sort_values([key for key in keys if key in ok.columns], kind="stable")
    points = pd.DataFrame({c: numbers(ok, c) for c in ("tpot_ms", "tpot_p90_ms", "tpot_p99_ms")})
    points["label"] = labels(ok, keys, always=("cache",) if "cache" in ok.columns else ()).replace("", "all rows")
    marks = row_marks(ok)
    points["label"] = points["label"].where(marks == "", points["label"] + " (" + marks + ")")
    per_point = points.groupby("label", sort=False).median()
    fig = go.Figure()
    for column, name in (("tpot_ms", "median"), ("tpot_p90_ms", "p90"), ("tpot_p99_ms", "p99")):
        if per_point[column].notna().any():
            fig.add_trace(go.Bar(x=per_point.index.to_list(), y=per_point[column], name=name))
    fig.update_layout(title_text=title, barmode="group", xaxis_title_text=x_title, yaxis_title_text=y_title)
    return fig
