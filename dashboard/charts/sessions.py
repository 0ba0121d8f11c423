"""The Serving page's multi-turn charts (dataset=sharegpt-multiturn, harness/serve/multiturn.py): TTFT by turn
number, and the prefix hit rate by turn, stacked by where the hit tokens came from.

A chat session's later turns resend its history, which a prefix cache serves instead of prefilling it again: these
two figures show whether it did (the hit rate climbs with the turn) and what that bought (TTFT stays flat). Pure
functions of the serving tables, as dashboard/charts/serving.py's; a run without sessions has none to draw.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import colour, message_figure, numbers, require, texts
from dashboard.charts.serving import run_labels

MULTITURN = "sharegpt-multiturn"  # the run row's dataset for chat sessions (harness.serve.columns)
TTFT_PERCENTILES = (50, 99)  # what the run row's ttft_ms_by_turn holds (harness.serve.multiturn.TTFT_PERCENTILES)
# Where a hit token's KV came from. The tiers' per-source columns, when a run has them; a run without them has
# only prefix_hit_tokens, all of it from the device's prefix cache.
HIT_SOURCES = ("device", "host", "disk")
TURN_TITLE = "turn in the session (from 1)"
NO_TURNS = "no session turns: not a multi-turn run (dataset=sharegpt-multiturn)"


def session_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The finished runs whose requests are chat sessions' turns: dataset sharegpt-multiturn, or a TTFT by turn."""
    sessions = texts(runs, "dataset").eq(MULTITURN)
    if "ttft_ms_by_turn" in runs.columns:
        sessions |= runs["ttft_ms_by_turn"].notna()
    return runs[sessions.to_numpy()]


def turn_ttft(run: pd.Series, requests: pd.DataFrame) -> pd.DataFrame:
    """One run's TTFT by turn: turn, count, p50, p99 (ms). The run row's own figures (ttft_ms_by_turn) where it has
    them, else recomputed from its request rows' turn and ttft_ms (numpy's linear percentiles, as the run row's)."""
    recorded = run.get("ttft_ms_by_turn")
    if isinstance(recorded, str) and recorded:
        by_turn = json.loads(recorded)
        recorded_figures = [{"turn": int(turn), **figures} for turn, figures in by_turn.items()]
        return pd.DataFrame(recorded_figures, columns=["turn", "count", "p50", "p99"]).sort_values(
            "turn", ignore_index=True
        )
    mine = requests[texts(requests, "run_id").eq(str(run.get("run_id"))).to_numpy()]
    turns = pd.DataFrame({"turn": numbers(mine, "turn"), "ttft_ms": numbers(mine, "ttft_ms")}).dropna()
    figures = [
        {"turn": int(turn), "count": len(part)}
        | {f"p{p}": float(np.percentile(part["ttft_ms"].to_numpy(), p)) for p in TTFT_PERCENTILES}
        for turn, part in turns.groupby("turn", sort=True)
    ]
    return pd.DataFrame(figures, columns=["turn", "count", "p50", "p99"])


def ttft_by_turn(runs: pd.DataFrame, requests: pd.DataFrame) -> go.Figure:
    """TTFT p50 (solid) and p99 (dashed) against the turn number, one colour per run (run_labels): with a prefix
    cache a later turn's long history is mostly served, so its TTFT stays near the first turn's."""
    require(runs, ["run_id"])
    title, y_title = "TTFT by turn", "time to first token (ms)"
    names = dict(zip(runs.index, run_labels(runs), strict=True))
    fig = go.Figure()
    for i, (index, run) in enumerate(runs.iterrows()):
        figures = turn_ttft(run, requests)
        if figures.empty:
            continue
        for p, dash in zip(TTFT_PERCENTILES, ("solid", "dash"), strict=True):
            fig.add_trace(
                go.Scatter(
                    x=figures["turn"],
                    y=figures[f"p{p}"],
                    mode="lines+markers",
                    name=f"p{p}, {names[index]}",
                    legendgroup=names[index],
                    line=dict(color=colour(i), dash=dash),
                    customdata=figures["count"],
                    hovertemplate=f"turn %{{x}}: p{p} %{{y:.4g}} ms over %{{customdata}} requests"
                    f"<extra>{names[index]}</extra>",
                )
            )
    if not fig.data:
        return message_figure(title=title, x_title=TURN_TITLE, y_title=y_title, message=NO_TURNS)
    fig.update_layout(title_text=title, xaxis=dict(title_text=TURN_TITLE, dtick=1))
    fig.update_yaxes(title_text=y_title, rangemode="tozero")
    return fig


def hit_tokens_by_source(requests: pd.DataFrame) -> pd.DataFrame:
    """Per request, its prompt tokens served from each source (HIT_SOURCES, columns prefix_hit_tokens_<source>),
    those of them the rows have; rows without any: prefix_hit_tokens, as the device's. With host or disk columns
    but no device one, the device's are prefix_hit_tokens less theirs (prefix_hit_tokens counts every hit)."""
    present = [s for s in HIT_SOURCES if numbers(requests, f"prefix_hit_tokens_{s}").notna().any()]
    total = numbers(requests, "prefix_hit_tokens").fillna(0.0)
    by_source = {source: numbers(requests, f"prefix_hit_tokens_{source}").fillna(0.0) for source in present}
    if "device" not in by_source:
        by_source["device"] = (total - sum(by_source.values(), 0.0)).clip(lower=0.0)
    return pd.DataFrame({source: by_source[source] for source in HIT_SOURCES if source in by_source})


def hit_rate_by_turn(requests: pd.DataFrame, *, run: str = "") -> go.Figure:
    """One run's prefix hit rate by turn: its turn's hit tokens over its turn's prompt tokens, stacked by source
    (device, host, disk where the rows say; else all the device's). Turn 1 has no history to hit."""
    require(requests, ["prompt_len", "prefix_hit_tokens"])
    title = "Prefix hit rate by turn" + (f": {run}" if run else "")
    y_title = "prefix hit rate (hit tokens / prompt tokens)"
    turn = numbers(requests, "turn")
    sessions = requests[turn.notna().to_numpy()]
    if sessions.empty:
        return message_figure(title=title, x_title=TURN_TITLE, y_title=y_title, message=NO_TURNS)
    hits = hit_tokens_by_source(sessions)
    by_turn = hits.assign(prompt_tokens=numbers(sessions, "prompt_len"), turn=turn[turn.notna()].astype(int))
    by_turn = by_turn.groupby("turn", sort=True).sum()
    fig = go.Figure()
    for i, source in enumerate(hits.columns):
        fig.add_trace(
            go.Bar(
                x=by_turn.index,
                y=by_turn[source] / by_turn["prompt_tokens"],
                name=source,
                marker_color=colour(i),
                customdata=np.stack([by_turn[source], by_turn["prompt_tokens"]], axis=-1),
                hovertemplate=f"turn %{{x}}: {source} %{{y:.1%}} (%{{customdata[0]:.0f}} of %{{customdata[1]:.0f}} "
                "prompt tokens)<extra></extra>",
            )
        )
    fig.update_layout(title_text=title, barmode="stack", xaxis=dict(title_text=TURN_TITLE, dtick=1))
    fig.update_yaxes(title_text=y_title, range=[0, 1.02], tickformat=".0%")
    return fig
