"""The KV tiers & transfer page's charts (issue #18): GB/s of each tier against the block size beside the device's
ceilings; TTFT by where a prefix came from, with the context above which loading it from disk beats recomputing it;
and the crossings both find (also the transfer charts', dashboard/charts/transfer.py: the prefill -> decode KV
transfer against the context).

Frames in the contracts of harness.store.tables (TIER_COLUMNS) and of the decode rows
(harness.store.schema.COLUMNS, of a strategy whose Serving declares shares_prefix). Pure functions to plotly
figures and caption strings, as dashboard/charts/common.py describes.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import (
    LOG2_DTICK,
    colour,
    format_number,
    labels,
    message_figure,
    numbers,
    ok_rows,
    require,
    strategy_servings,
    texts,
)
from harness.store.schema import POINT_KEY_COLUMNS
from harness.store.tables import MEASURED

ANALYTIC = "analytic"
CEILING_DASH, ANALYTIC_DASH = "dot", "dash"
REFERENCE_COLOUR = "black"

# ----------------------------------------------------------------------------------------------------- crossings


def crossing(x: pd.Series, above: pd.Series, below: pd.Series) -> float | None:
    """The first x at which `above` drops to or under `below`, interpolated linearly between the two adjacent points
    (sorted by x, both values present) that straddle it; None when it never does from above (so also when `above`
    starts at or under `below`: that is no crossing seen, see crossing_note)."""
    found = _bracket(x, above, below)
    return found[0] if found else None


def _bracket(x: pd.Series, above: pd.Series, below: pd.Series) -> tuple[float, float, float] | None:
    """(crossing, the x before it, the x after it), or None: crossing's work."""
    points = pd.DataFrame({"x": x.to_numpy(), "gap": (above - below).to_numpy()}).dropna().sort_values("x")
    xs, gaps = points["x"].to_numpy(), points["gap"].to_numpy()
    for i in range(1, len(xs)):
        if gaps[i - 1] > 0 >= gaps[i]:
            at = xs[i - 1] + (xs[i] - xs[i - 1]) * gaps[i - 1] / (gaps[i - 1] - gaps[i])
            return float(at), float(xs[i - 1]), float(xs[i])
    return None


def crossing_note(x: pd.Series, above: pd.Series, below: pd.Series, *, event: str, otherwise: str) -> str:
    """One phrase saying where `above` drops under `below` (crossing): "<event> from ≈ N tokens (between a and b)";
    else why none was found: already under at the shortest context, never under (`otherwise` up to the longest), or
    too few contexts where both were measured."""
    both = pd.DataFrame({"x": x.to_numpy(), "gap": (above - below).to_numpy()}).dropna().sort_values("x")
    if len(both) < 2:
        return f"no crossover: fewer than two contexts have both figures ({event})"
    found = _bracket(both["x"], both["gap"], pd.Series(0.0, index=both.index))
    if found:
        at, before, after = (format_number(value) for value in (round(found[0]), found[1], found[2]))
        return f"{event} from ≈ {at} tokens (between {before} and {after})"
    if both["gap"].iloc[0] <= 0:
        shortest = format_number(both["x"].iloc[0])
        return f"no crossover found: {event} already at the shortest context measured ({shortest})"
    longest = format_number(both["x"].iloc[-1])
    return f"no crossover found: {otherwise} up to the longest context measured ({longest})"


# -------------------------------------------------------------------------------------------------- tier bandwidth

TIER_HOVER = ("block_tokens", "repeats", "gbps_rse", "direct_io", "cold_read")  # per block size, in the hover


def tier_run_labels(tiers: pd.DataFrame) -> pd.Series:
    """A label per row for the run it belongs to: "<device_name> <started_at> (<run_id>)"."""
    return texts(tiers, "device_name") + " " + texts(tiers, "started_at") + " (" + texts(tiers, "run_id") + ")"


def _flag(tiers: pd.DataFrame, column: str, value: bool = True) -> pd.Series:
    """True where `column` holds `value` (a null, or no such column: never)."""
    if column not in tiers.columns:
        return pd.Series(False, index=tiers.index)
    return (tiers[column].notna() & (tiers[column].astype(object) == value)).astype(bool)


def tier_line_names(tiers: pd.DataFrame) -> pd.Series:
    """The legend name per row: "<tier> <direction>", a disk row with its I/O ("O_DIRECT" or "page cache"), a
    same-memory host row "(RAM copy)"; prefixed with the run where several are drawn."""
    tier = texts(tiers, "tier")
    name = tier + " " + texts(tiers, "direction")
    name = name.where(~((tier == "disk") & _flag(tiers, "direct_io")), name + " (O_DIRECT)")
    name = name.where(~((tier == "disk") & _flag(tiers, "direct_io", False)), name + " (page cache)")
    name = name.where(~((tier == "host") & _flag(tiers, "same_memory")), name + " (RAM copy)")
    if "run_id" in tiers.columns and tiers["run_id"].nunique() > 1:
        name = tier_run_labels(tiers) + ": " + name
    return name.astype(str)


def same_memory(tiers: pd.DataFrame) -> bool:
    return bool(_flag(tiers, "same_memory").any())


def tier_bandwidth(tiers: pd.DataFrame) -> go.Figure:
    """GB/s against block size (bytes, log2 x), one line per tier and direction (the median where a point repeats),
    and the device's measured read and copy ceilings (peak_read_bw_gbps, peak_copy_bw_gbps of the same rows) as
    horizontal dotted lines. On the CPU (same_memory) the title says d2h and h2d are RAM copies."""
    require(tiers, ["tier", "direction", "block_bytes", "gbps"])
    title = "Tier bandwidth against block size"
    if same_memory(tiers):
        title += " (CPU: device and host tier are the same RAM, so d2h and h2d are memory copies)"
    x_title, y_title = "block size (bytes)", "bandwidth (GB/s, GB = 1e9)"
    points = tiers.assign(line=tier_line_names(tiers), x=numbers(tiers, "block_bytes"), y=numbers(tiers, "gbps"))
    points = points[(points["x"] > 0) & points["y"].notna()]
    if points.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title, message="no tier rows with a GB/s")
    fig = go.Figure()
    for i, (line, group) in enumerate(points.groupby("line", sort=True)):
        medians = group.groupby("x")["y"].median().sort_index()
        firsts = group.groupby("x").first().reindex(medians.index)  # the hover's per-size details
        custom = np.column_stack([texts(firsts, column) for column in TIER_HOVER])
        fig.add_trace(
            go.Scatter(
                x=medians.index,
                y=medians,
                mode="lines+markers",
                name=line,
                line=dict(color=colour(i)),
                customdata=custom,
                hovertemplate="%{x:,} bytes: %{y:.4g} GB/s<br>block_tokens: %{customdata[0]}"
                "<br>repeats: %{customdata[1]}, rse %{customdata[2]}<br>direct_io: %{customdata[3]}"
                f"<br>cold_read: %{{customdata[4]}}<extra>{line}</extra>",
            )
        )
    span = [points["x"].min(), points["x"].max()]
    for column, name in (("peak_read_bw_gbps", "read ceiling"), ("peak_copy_bw_gbps", "copy ceiling")):
        ceiling = numbers(points, column).median()
        if np.isfinite(ceiling):
            fig.add_trace(
                go.Scatter(
                    x=span,
                    y=[ceiling, ceiling],
                    mode="lines",
                    name=f"device {name} (measured, {column})",
                    line=dict(color=REFERENCE_COLOUR, dash=CEILING_DASH if "read" in column else "dashdot"),
                    hovertemplate=f"{name}: %{{y:.4g}} GB/s<extra></extra>",
                )
            )
    fig.update_layout(
        title_text=title, xaxis=dict(type="log", dtick=LOG2_DTICK, title_text=x_title), yaxis_title_text=y_title
    )
    return fig


def tier_caption(tiers: pd.DataFrame) -> str:
    """What the tier chart's figures are: all measured (their `source` says so), and what d2h/h2d and disk mean."""
    sources = sorted(set(texts(tiers, "source")))
    said = "every figure is measured" if sources == [MEASURED] else f"sources: {', '.join(sources)}"
    text = (
        f"Measured ({said}): the median GB/s of `repeats` timed repeats, each moving `n_blocks` blocks, warm-up "
        "excluded; the ceilings are the device's measured streaming-read and copy bandwidth, from the same rows."
    )
    if same_memory(tiers):
        text += " On this CPU device and host tier are the same RAM: d2h and h2d are memory copies, not a bus."
    if _flag(tiers, "direct_io").any():
        text += " Disk lines marked O_DIRECT bypass the page cache; page-cache reads were cold where cold_read says so."
    return text


# ------------------------------------------------------------------------------------------ TTFT by prefix source

PREFIX_SOURCES = (  # (legend name, the row's column): where the prefix's KV came from
    ("device hit (ttft_ms)", "ttft_ms"),
    ("host tier (ttft_host_ms)", "ttft_host_ms"),
    ("disk tier (ttft_disk_ms)", "ttft_disk_ms"),
    ("recompute (ttft_miss_ms)", "ttft_miss_ms"),
)
PREFIX_ANALYTIC = (
    (f"{ANALYTIC}: load the prefix from disk", "predicted_prefix_load_ms"),
    (f"{ANALYTIC}: compute the prefix", "predicted_prefix_compute_ms"),
)
# A line is one workload and KV treatment but the prefix (and so the prompt) length.
PREFIX_GROUP = tuple(c for c in POINT_KEY_COLUMNS if c not in ("prompt_len", "prefix_len"))


def prefix_reuse_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The ok rows of a strategy that shares a prompt prefix (its Serving declares shares_prefix: prefix), with a
    prefix and a TTFT from at least one of its sources."""
    measured = [column for _, column in PREFIX_SOURCES]
    if "cache" not in rows.columns or "prefix_len" not in rows.columns:
        return rows.iloc[0:0]
    ok = ok_rows(rows)
    keep = (numbers(ok, "prefix_len") > 0) & pd.concat([numbers(ok, c).notna() for c in measured], axis=1).any(axis=1)
    ok = ok[keep.to_numpy()]  # first: only rows with a prefix's TTFT ask the strategies (harness.kv imports torch)
    sharing = [name for name, serving in strategy_servings(ok["cache"]).items() if serving.shares_prefix]
    return ok[ok["cache"].isin(sharing).to_numpy()].reset_index(drop=True)


def prefix_workloads(rows: pd.DataFrame) -> pd.Series:
    """A label per row naming its workload (PREFIX_GROUP where it varies among rows; "all rows" when it does not).
    Rows with one label are one line of the chart. A sweep holds either the prompt fixed (the prefix grows into it,
    experiment=prefix-reuse) or the tokens after the prefix (the prompt grows with it): either is one line. Only
    rows that vary in both are told apart by the tokens after the prefix."""
    label = labels(rows, PREFIX_GROUP)
    suffix = pd.DataFrame({"suffix": numbers(rows, "prompt_len") - numbers(rows, "prefix_len")}, index=rows.index)
    prompt_varies = numbers(rows, "prompt_len").nunique(dropna=False) > 1
    if prompt_varies and suffix["suffix"].nunique(dropna=False) > 1:
        label = label.where(label == "", label + ", ") + "suffix " + texts(suffix, "suffix")
    return label.replace("", "all rows").astype(str)


def _one_workload(rows: pd.DataFrame, workload: str | None) -> pd.DataFrame:
    """The rows of `workload` (a prefix_workloads label); None: the workload with the most rows."""
    names = prefix_workloads(rows)
    if workload is None and len(names):
        workload = names.value_counts().sort_index().sort_values(ascending=False, kind="stable").index[0]
    return rows[(names == workload).to_numpy()]


def prefix_medians(rows: pd.DataFrame, workload: str | None = None) -> pd.DataFrame:
    """Per prefix length of one workload, the median of each source's TTFT and of the analytic figures."""
    points = _one_workload(prefix_reuse_rows(rows), workload)
    columns = [column for _, column in PREFIX_SOURCES + PREFIX_ANALYTIC]
    frame = pd.DataFrame({c: numbers(points, c) for c in columns}).assign(prefix_len=numbers(points, "prefix_len"))
    return frame.groupby("prefix_len")[columns].median().sort_index()  # repeats: several runs or sweeps


def prefix_crossovers(medians: pd.DataFrame) -> tuple[float | None, str, str]:
    """(measured crossover context or None, the measured note, the analytic note): where loading the prefix from
    disk drops under recomputing it, in the measured TTFTs and in the analytic load and compute times."""
    x = medians.index.to_series()
    measured_at = crossing(x, medians["ttft_disk_ms"], medians["ttft_miss_ms"])
    measured = crossing_note(
        x, medians["ttft_disk_ms"], medians["ttft_miss_ms"], event="disk beats recompute", otherwise="recompute wins"
    )
    analytic = crossing_note(
        x,
        medians["predicted_prefix_load_ms"],
        medians["predicted_prefix_compute_ms"],
        event="loading beats computing",
        otherwise="computing wins",
    )
    return measured_at, measured, analytic


def ttft_by_prefix_source(rows: pd.DataFrame, *, workload: str | None = None) -> go.Figure:
    """TTFT against the prefix length (log2 x) of one workload (prefix_workloads; None: the one with the most rows),
    a solid line per source the prefix came from (device, host, disk, recompute), the analytic load and compute
    times dashed, and the measured context above which the disk beats recompute as a dotted vertical line."""
    require(rows, ["cache", "prefix_len", "ttft_ms"])
    title = "Time to first token by where the prefix came from"
    x_title, y_title = "prefix length (tokens)", "time to first token (ms)"
    medians = prefix_medians(rows, workload)
    if medians.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title, message="no prefix-reuse rows")
    fig = go.Figure()
    for i, (name, column) in enumerate(PREFIX_SOURCES + PREFIX_ANALYTIC):
        values = medians[column].dropna()
        if values.empty:
            continue
        analytic = column.startswith("predicted_")
        fig.add_trace(
            go.Scatter(
                x=values.index,
                y=values,
                mode="lines" if analytic else "lines+markers",
                name=name,
                line=dict(color=colour(i), dash=ANALYTIC_DASH if analytic else None),
                hovertemplate=f"prefix %{{x}}: %{{y:.4g}} ms<extra>{column}</extra>",
            )
        )
    measured_at, note, _ = prefix_crossovers(medians)
    if measured_at is not None:
        fig.add_vline(x=measured_at, line=dict(color=REFERENCE_COLOUR, dash="dot"))
        fig.add_annotation(x=np.log10(measured_at), y=1, yref="paper", text=f"measured: {note}", showarrow=False)
    else:
        fig.add_annotation(x=0, y=1, xref="paper", yref="paper", xanchor="left", text=note, showarrow=False)
    fig.update_layout(
        title_text=title, xaxis=dict(type="log", dtick=LOG2_DTICK, title_text=x_title), yaxis_title_text=y_title
    )
    return fig


def prefix_caption(rows: pd.DataFrame, *, workload: str | None = None) -> str:
    """What the TTFT chart's lines are (measured or analytic) and both crossovers side by side."""
    _, measured, analytic = prefix_crossovers(prefix_medians(rows, workload))
    return (
        "Measured (solid): TTFT with the prefix found in device memory (ttft_ms), fetched from the host tier "
        "(ttft_host_ms), read from the disk tier's files (ttft_disk_ms) and recomputed (ttft_miss_ms), medians over "
        "repeats. Analytic (dashed): the prefix's stored bytes over the disk tier's read GB/s "
        "(predicted_prefix_load_ms) and its prefill FLOPs over the matmul peak (predicted_prefix_compute_ms): the "
        f"prefix's part of TTFT only. Measured crossover: {measured}. Analytic crossover: {analytic}."
    )
