"""The memory page's charts: where each point's memory went against the capacity, and the OOM frontier."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import LOG2_DTICK, colour, labels, message_figure, numbers, require, texts

GIB_BYTES = 2**30
# Not a stored column: the memory page adds the real planner's figure (dashboard.data.planner_kv_bytes) under it.
PLANNER_COLUMN = "kv_bytes_planner"
# kv_bytes_predicted is the seed notes' formula B × S × bytes per token (harness/run/bench.py): no scales, no block
# rounding, no prefix sharing. The planner (harness.plan) is what each strategy really allocates.
ANALYTIC_NAME = "analytic formula (weights + KV)"
PLANNER_NAME = "planner (weights + KV)"


def memory_ledger(rows: pd.DataFrame, *, capacity_bytes: float | None = None) -> go.Figure:
    """Stacked GiB per ok/oom point (weights, KV allocated, everything else at the peak), the analytic formula's
    KV (kv_bytes_predicted) and, where the rows carry PLANNER_COLUMN, the planner's as markers, the device capacity
    as a line, OOM points as red crosses; x sorted by context × batch."""
    require(rows, ["prompt_len", "gen_len", "batch_size", "weights_bytes", "kv_bytes_allocated"])
    title = "Memory ledger per point"
    x_title, y_title = "context × batch (tokens × sequences)", "memory (GiB)"
    rows = rows.reset_index(drop=True)  # a repeated index label would select two rows where one is meant
    status = texts(rows, "status") if "status" in rows.columns else pd.Series("ok", index=rows.index)
    kept = rows[status.isin(["ok", "oom"]).to_numpy()]
    kept = kept[(numbers(kept, "prompt_len") + numbers(kept, "gen_len") + numbers(kept, "batch_size")).notna()]
    if kept.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)

    weights, kv = numbers(kept, "weights_bytes"), numbers(kept, "kv_bytes_allocated")
    # Whatever the peak holds beyond the baseline, the weights and the KV: activations, allocator slack, runtime.
    other = (numbers(kept, "peak_mem_bytes") - numbers(kept, "mem_baseline_bytes") - weights - kv).clip(lower=0)
    points = pd.DataFrame(
        {
            "context": numbers(kept, "prompt_len") + numbers(kept, "gen_len"),
            "batch": numbers(kept, "batch_size"),
            "weights": weights / GIB_BYTES,
            "kv": kv / GIB_BYTES,
            "other": other / GIB_BYTES,
            "analytic": (weights + numbers(kept, "kv_bytes_predicted")) / GIB_BYTES,
            "planner": (weights + numbers(kept, PLANNER_COLUMN)) / GIB_BYTES,
            "cap": numbers(kept, "max_memory_gb"),  # GiB: the cap the point's process ran under, if any
            "oom": status.loc[kept.index] == "oom",
            "error": texts(kept, "error"),
        }
    )
    points["label"] = texts(points, "context") + "×" + texts(points, "batch")
    variant = labels(kept, ("model", "dtype", "kv_dtype", "cache"))
    points["label"] = points["label"].where(variant == "", points["label"] + " " + variant)
    points["order"] = points["context"] * points["batch"]
    ledger = points.groupby("label", sort=False).agg(
        order=("order", "min"),
        context=("context", "min"),
        weights=("weights", "median"),
        kv=("kv", "median"),
        other=("other", "median"),
        analytic=("analytic", "median"),
        planner=("planner", "median"),
        cap=("cap", "median"),
        oom=("oom", "any"),
        error=("error", "first"),
    )
    ledger = ledger.sort_values(["order", "context"], kind="stable")
    x = ledger.index.to_list()

    fig = go.Figure()
    for column, name in (("weights", "weights"), ("kv", "KV allocated"), ("other", "other (peak - baseline)")):
        fig.add_trace(
            go.Bar(x=x, y=ledger[column], name=name, hovertemplate=f"%{{x}}: %{{y:.3f}} GiB<extra>{name}</extra>")
        )
    for column, name, symbol in (("analytic", ANALYTIC_NAME, "diamond-open"), ("planner", PLANNER_NAME, "diamond")):
        if ledger[column].notna().any():
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=ledger[column],
                    mode="markers",
                    name=name,
                    marker=dict(symbol=symbol, size=10, color="black"),
                    hovertemplate=f"%{{x}}: %{{y:.3f}} GiB<extra>{name}</extra>",
                )
            )
    capacity_gib = None if capacity_bytes is None else capacity_bytes / GIB_BYTES
    if capacity_gib is not None:
        fig.add_shape(
            type="line",
            name="device capacity",
            x0=0,
            x1=1,
            xref="paper",
            y0=capacity_gib,
            y1=capacity_gib,
            yref="y",
            line=dict(color="red", dash="dash"),
        )
        fig.add_annotation(
            text=f"device capacity {capacity_gib:.3g} GiB",
            x=1,
            xref="paper",
            y=capacity_gib,
            yref="y",
            xanchor="right",
            yanchor="bottom",
            showarrow=False,
            font_color="red",
        )
    oom = ledger[ledger["oom"]]
    if not oom.empty:
        # At the capacity it ran into: the device's when given, else the cap its process ran under. Failing both, at
        # what it was predicted to need (the planner's figure, else the formula's), or held; a failed row rarely
        # records either, so else at the tallest bar.
        held = ledger[["weights", "kv", "other"]].sum(axis=1, min_count=1)
        if capacity_gib is not None:
            y = pd.Series(capacity_gib, index=oom.index)
        else:
            y = oom["cap"].fillna(oom["planner"]).fillna(oom["analytic"]).fillna(held.loc[oom.index]).fillna(held.max())
        fig.add_trace(
            go.Scatter(
                x=oom.index.to_list(),
                y=y.fillna(0.0),
                mode="markers",
                name="OOM",
                marker=dict(symbol="x", size=14, color="red"),
                hovertext=oom["error"].str.slice(0, 120),
                hovertemplate="%{x}: out of memory<br>%{hovertext}<extra>OOM</extra>",
            )
        )
    fig.update_layout(
        title_text=title,
        barmode="stack",
        xaxis=dict(type="category", categoryorder="array", categoryarray=x, title_text=x_title),
        yaxis_title_text=y_title,
    )
    return fig


def frontier(table: pd.DataFrame) -> go.Figure:
    """The capacity OOM frontier (experiments/capacity.py frontier_rows): the largest batch that ran at each context,
    measured (solid, ± one bisection step) against the planner's prediction (dashed)."""
    require(table, ["context", "measured_max_batch", "predicted_max_batch"])
    title = "OOM frontier: the largest batch that fits, measured against predicted"
    x_title, y_title = "context (tokens per sequence)", "max batch (sequences)"
    table = table.reset_index(drop=True)  # the columns below are aligned on it
    points = pd.DataFrame(
        {
            "context": numbers(table, "context"),
            "measured": numbers(table, "measured_max_batch"),
            "predicted": numbers(table, "predicted_max_batch"),
            "step": numbers(table, "bisection_step").fillna(0.0),
        }
    )
    points["config"] = labels(table, ("model", "device", "dtype", "kv_dtype", "cache", "max_memory_gb"))
    points = points[(points["context"] > 0) & (points["measured"].notna() | points["predicted"].notna())]
    if points.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title, message="no frontier rows")

    fig = go.Figure()
    for i, (config, line) in enumerate(points.groupby("config", sort=False)):
        line = line.sort_values("context")
        prefix = f"{config}: " if config else ""
        measured = line[line["measured"].notna()]
        fig.add_trace(
            go.Scatter(
                x=measured["context"],
                y=measured["measured"],
                mode="lines+markers",
                name=f"{prefix}measured",
                line=dict(color=colour(i)),
                # ± one bisection step: the planner passes (within_step) when its prediction falls inside the bar.
                error_y=dict(type="data", array=measured["step"], symmetric=True, visible=True),
            )
        )
        predicted = line[line["predicted"].notna()]
        fig.add_trace(
            go.Scatter(
                x=predicted["context"],
                y=predicted["predicted"],
                mode="lines+markers",
                name=f"{prefix}predicted (planner)",
                line=dict(color=colour(i), dash="dash"),
                marker_symbol="circle-open",
            )
        )
    fig.update_layout(
        title_text=title,
        xaxis=dict(type="log", dtick=LOG2_DTICK, title_text=x_title),
        yaxis=dict(title_text=y_title, rangemode="tozero"),
    )
    return fig
