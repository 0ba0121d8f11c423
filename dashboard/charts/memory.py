"""The memory page's charts: where each point's memory went against the capacity, and the OOM frontier."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import LOG2_DTICK, colour, labels, message_figure, numbers, point_keys, require, texts
from harness.store.schema import KV_COLUMNS, WORKLOAD_COLUMNS

GIB_BYTES = 2**30
MIB_BYTES = 2**20
# The ledger's unit, by the magnitude of what it draws: below 2 GiB (a CPU-sized ledger, small models, tens to
# hundreds of MiB) in MiB, which reads as 50 or 800 where GiB would read 0.05 or 0.8; from 2 GiB (a GPU-sized one,
# weights of GiB, up to the 141 GiB of an H200) in GiB, which reads as 2 to 141 where MiB would read 144,384. By
# magnitude, not device: a CPU host with 1 TB can hold a GPU-sized ledger, and a GPU point of a tiny model is small.
# The capacity line does not choose: it marks where the device ends, whatever the unit.
GIB_FROM_BYTES = 2 * GIB_BYTES
# The label names the workload and KV fields that vary beyond context × batch (the ledger's x), so a bar never
# combines two workloads or two treatments; prompt_len and gen_len only where one context × batch has several.
VARIANT_KEYS = ("model", "dtype", "kv_dtype", "cache") + tuple(
    key
    for key in (*WORKLOAD_COLUMNS, *KV_COLUMNS)
    if key not in ("model", "dtype", "kv_dtype", "cache", "batch_size", "prompt_len", "gen_len")
)
# The planner's figure for the row's workload, as the run wrote it (harness.run.point.planner_kv_bytes); null in a
# row written before the column existed (scripts/backfill_kv_bytes_planner.py fills such rows in).
PLANNER_COLUMN = "kv_bytes_planner"
# kv_bytes_predicted is the seed notes' formula B × S × bytes per token (harness/run/point.py): no scales, no block
# rounding, no prefix sharing. The planner (harness.analytic) is what each strategy really allocates.
ANALYTIC_NAME = "analytic formula (weights + KV)"
PLANNER_NAME = "planner (weights + KV)"


def ledger_unit(largest_bytes: float) -> tuple[str, int]:
    """The ledger's unit for its largest figure (bytes): ("MiB", 2**20) below GIB_FROM_BYTES, else ("GiB", 2**30)."""
    if largest_bytes >= GIB_FROM_BYTES:
        return "GiB", GIB_BYTES
    return "MiB", MIB_BYTES


def memory_ledger(rows: pd.DataFrame, *, capacity_bytes: float | None = None) -> go.Figure:
    """Stacked memory per ok/oom point, in MiB or GiB by its size (ledger_unit): weights, KV allocated, everything
    else at the peak; the analytic formula's KV (kv_bytes_predicted) and, where the rows carry PLANNER_COLUMN, the
    planner's as markers, the device capacity as a line, OOM points as red crosses; x sorted by context × batch, one
    bar per point (VARIANT_KEYS label what varies)."""
    require(rows, ["prompt_len", "gen_len", "batch_size", "weights_bytes", "kv_bytes_allocated"])
    title = "Memory ledger per point"
    x_title = "context × batch (tokens × sequences)"
    rows = rows.reset_index(drop=True)  # a repeated index label would select two rows where one is meant
    status = texts(rows, "status") if "status" in rows.columns else pd.Series("ok", index=rows.index)
    kept = rows[status.isin(["ok", "oom"]).to_numpy()]
    kept = kept[(numbers(kept, "prompt_len") + numbers(kept, "gen_len") + numbers(kept, "batch_size")).notna()]
    if kept.empty:
        return message_figure(title=title, x_title=x_title, y_title="memory (MiB)")

    weights, kv = numbers(kept, "weights_bytes"), numbers(kept, "kv_bytes_allocated")
    # Whatever the peak holds beyond the baseline, the weights and the KV: activations, allocator slack, runtime.
    other = (numbers(kept, "peak_mem_bytes") - numbers(kept, "mem_baseline_bytes") - weights - kv).clip(lower=0)
    analytic = weights + numbers(kept, "kv_bytes_predicted")
    planner = weights + numbers(kept, PLANNER_COLUMN)
    cap = numbers(kept, "max_memory_gb") * GIB_BYTES  # max_memory_gb is GiB: the cap the point's process ran under
    largest = pd.concat([weights.fillna(0) + kv.fillna(0) + other.fillna(0), analytic, planner]).max()
    unit, unit_bytes = ledger_unit(0.0 if pd.isna(largest) else float(largest))
    y_title = f"memory ({unit})"
    points = pd.DataFrame(
        {
            "context": numbers(kept, "prompt_len") + numbers(kept, "gen_len"),
            "batch": numbers(kept, "batch_size"),
            "weights": weights / unit_bytes,
            "kv": kv / unit_bytes,
            "other": other / unit_bytes,
            "analytic": analytic / unit_bytes,
            "planner": planner / unit_bytes,
            "cap": cap / unit_bytes,
            "oom": status.loc[kept.index] == "oom",
            "error": texts(kept, "error"),
        }
    )
    points["label"] = texts(points, "context") + "×" + texts(points, "batch")
    variant = labels(kept, VARIANT_KEYS)
    points["label"] = points["label"].where(variant == "", points["label"] + " " + variant)
    # Rows of one label but different points (e.g. prompt 992 + gen 32 beside 1000 + 24) are told apart by their
    # prompt and gen; rows of the same point (repeats from several sweeps) share a bar: its median.
    keys = point_keys(kept)
    clash = keys.groupby(points["label"]).transform("nunique") > 1
    split = points["label"] + ", prompt " + texts(kept, "prompt_len") + ", gen " + texts(kept, "gen_len")
    points["label"] = points["label"].where(~clash, split)
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
            go.Bar(x=x, y=ledger[column], name=name, hovertemplate=f"%{{x}}: %{{y:.4g}} {unit}<extra>{name}</extra>")
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
                    hovertemplate=f"%{{x}}: %{{y:.4g}} {unit}<extra>{name}</extra>",
                )
            )
    capacity = None if capacity_bytes is None else capacity_bytes / unit_bytes  # in the ledger's unit
    if capacity is not None:
        fig.add_shape(
            type="line",
            name="device capacity",
            x0=0,
            x1=1,
            xref="paper",
            y0=capacity,
            y1=capacity,
            yref="y",
            line=dict(color="red", dash="dash"),
        )
        fig.add_annotation(
            text=f"device capacity {capacity:.4g} {unit}",
            x=1,
            xref="paper",
            y=capacity,
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
        if capacity is not None:
            y = pd.Series(capacity, index=oom.index)
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
