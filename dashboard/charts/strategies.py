"""The strategies page's table and charts: every cache and storage format side by side, their Pareto front, and
what the lossy ones cost in accuracy for what they save in memory."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import (
    MARKS,
    colour,
    hover_groups,
    is_baseline,
    message_figure,
    numbers,
    ok_rows,
    require,
    row_marks,
    scatter_class,
    texts,
    treatment_keys,
    treatment_label,
    workload_groups,
    workload_keys,
    workload_label,
)
from harness.formats import EXACT_REFERENCE
from harness.measure.stats import ratio_ci
from harness.store.schema import KV_COLUMNS, WORKLOAD_COLUMNS

MIB_BYTES = 2**20
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "star", "hexagon", "triangle-down", "pentagon")
PARETO_HOVER_NUMBERS = ("batch_size", "prompt_len", "top1_agreement")
PARETO_COLUMNS = ("kv_bytes_allocated", "tpot_ms", *PARETO_HOVER_NUMBERS, *KV_COLUMNS)  # besides the workload's
STRATEGY_MEDIANS = ("tpot_ms", "ttft_ms", "kv_allocated_mib", "kv_waste_fraction", "top1_agreement", "kl_mean")
# figure -> its ratio column: treatment / the baseline of the same workload (1.0 on the baseline's own line)
STRATEGY_RATIOS = {"tpot_ms": "tpot_ratio", "ttft_ms": "ttft_ratio", "kv_allocated_mib": "kv_allocated_ratio"}
# tpot_ratio's 95% interval, by bootstrap (harness.measure.stats.ratio_ci) over what each line's TPOT is the median of: its
# row's per-repeat samples, or the TPOTs of its rows when several (reruns of one point); null where a single-row line
# has no samples recorded (rows before tpot_samples_ms). A bootstrap of 2000 resamples costs O(values) a line, so the
# page asks for it on the workload it shows only.
TPOT_RATIO_CI = ("tpot_ratio_low", "tpot_ratio_high")
NO_BASELINE = f"no baseline in this workload ({EXACT_REFERENCE} at kv_dtype = dtype): ratios left empty"


def _joined_marks(marks: pd.Series) -> str:
    return ", ".join(sorted({word for cell in set(marks) for word in cell.split(", ") if word}))


def _interval_values(samples: pd.Series, tpot_ms: pd.Series) -> list[float] | None:
    """What a line's TPOT is the median of: its one row's tpot_samples_ms, or its rows' own TPOTs when there are
    several (each row's figure already a median over its repeats); None when neither gives two values."""
    if len(tpot_ms) > 1:
        values = [float(v) for v in tpot_ms.dropna()]
    else:
        cell = samples.iloc[0] if len(samples) else None
        values = [float(v) for v in cell] if isinstance(cell, list | tuple | np.ndarray) else []
    return values if len(values) > 1 else None


def strategy_table(rows: pd.DataFrame, *, intervals: bool = True) -> pd.DataFrame:
    """Per workload (WORKLOAD_COLUMNS; the one with the most treatments first, as workload_groups), one line per KV
    treatment (cache, kv_dtype and options) of its ok rows: the workload's columns and label, the medians of
    STRATEGY_MEDIANS over the rows of that workload and treatment (repeats of one point, e.g. from two sweeps),
    n_points, the ratios against the baseline of the same workload (STRATEGY_RATIOS, 1.0 on the baseline's line;
    null, with a note, where the workload has none; TPOT_RATIO_CI where samples allow, and only with `intervals`) and
    the marks of rows not to trust. Never a median across two workloads. A column the rows lack is NaN."""
    require(rows, ["cache", "kv_dtype"])
    ok = ok_rows(rows)
    columns = ["workload", *WORKLOAD_COLUMNS, *KV_COLUMNS[:2], "treatment", *STRATEGY_MEDIANS, "n_points"]
    columns += [*STRATEGY_RATIOS.values(), *TPOT_RATIO_CI, "marks", "note"]
    if ok.empty:
        return pd.DataFrame(columns=[c for c in columns if c not in WORKLOAD_COLUMNS or c in ok.columns])
    # Every per-row figure once over all the rows, then one groupby: 100k rows of 23 workloads in well under 1 s.
    frame = pd.DataFrame(
        {
            "_workload": workload_keys(ok),
            "_treatment": treatment_keys(ok),
            "workload": workload_label(ok),
            **{column: ok[column] for column in WORKLOAD_COLUMNS if column in ok.columns},
            **{column: texts(ok, column) for column in KV_COLUMNS[:2]},
            "treatment": treatment_label(ok),
            "baseline": is_baseline(ok),
            "marks": row_marks(ok),
            "tpot_ms": numbers(ok, "tpot_ms"),
            "ttft_ms": numbers(ok, "ttft_ms"),
            "kv_allocated_mib": numbers(ok, "kv_bytes_allocated") / MIB_BYTES,
            "kv_waste_fraction": numbers(ok, "kv_waste_fraction"),
            "top1_agreement": numbers(ok, "top1_agreement"),
            "kl_mean": numbers(ok, "kl_mean"),
            "samples": ok.get("tpot_samples_ms"),  # a list per row, or null
        },
        index=ok.index,
    )
    firsts = ["workload", *[c for c in WORKLOAD_COLUMNS if c in ok.columns], *KV_COLUMNS[:2], "treatment", "baseline"]
    # "first" of a workload column: its rows agree on it (the key), null in every one or in none
    table = frame.groupby(["_workload", "_treatment"], sort=False).agg(
        **{column: (column, "first") for column in firsts},
        **{column: (column, "median") for column in STRATEGY_MEDIANS},
        n_points=("tpot_ms", "size"),
        marks=("marks", _joined_marks),
    )
    workload = table.index.get_level_values("_workload")
    baseline = table[table["baseline"]].reset_index("_treatment").groupby(level="_workload").first()
    for figure, ratio in STRATEGY_RATIOS.items():
        table[ratio] = table[figure].to_numpy() / baseline[figure].reindex(workload).to_numpy()
    table[list(TPOT_RATIO_CI)] = np.nan
    if intervals:
        grouped = frame.groupby(["_workload", "_treatment"], sort=False)
        by_key = {key: _interval_values(part["samples"], part["tpot_ms"]) for key, part in grouped}
        values = pd.Series([by_key[key] for key in table.index], index=table.index, dtype=object)
        base_values = values[table["baseline"].to_numpy()].droplevel("_treatment")
        base_values = base_values[~base_values.index.duplicated()].reindex(workload).to_numpy()
        table[list(TPOT_RATIO_CI)] = [
            # base is NaN (reindexed) where the workload has no baseline: no ratio, so no interval
            ratio_ci(base, line)[1:] if isinstance(base, list) and isinstance(line, list) else (np.nan, np.nan)
            for base, line in zip(base_values, values, strict=True)
        ]
    table["note"] = np.where(workload.isin(baseline.index), "", NO_BASELINE)
    # The workloads in workload_groups' order: the most treatments, then the most rows, then by key; the baseline
    # first within each.
    n_treatments = pd.Series(workload).groupby(workload).transform("size").to_numpy()
    n_rows = table["n_points"].groupby(level="_workload").transform("sum").to_numpy()
    table = table.assign(_n_treatments=-n_treatments, _n_rows=-n_rows, _key=workload).sort_values(
        ["_n_treatments", "_n_rows", "_key", "baseline", "cache", "kv_dtype", "treatment"],
        ascending=[True, True, True, False, True, True, True],
        kind="stable",
    )
    return table.reset_index(drop=True)[[c for c in columns if c in table.columns]]


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
    """KV memory against TPOT per ok row of one workload, colour by cache and symbol by kv_dtype (open where the row
    is marked: not converged, host busy), with the Pareto front (less memory and less time both better) as a step
    line through outlined points. Rows of several workloads: the one with the most treatments (workload_groups),
    named in a note; a page passes the workload its reader chose."""
    require(rows, ["kv_bytes_allocated", "tpot_ms", "cache", "kv_dtype"])
    title = "KV memory against time per output token"
    x_title, y_title = "KV allocated (MiB)", "time per output token (ms)"
    ok = ok_rows(rows, [*PARETO_COLUMNS, *WORKLOAD_COLUMNS, *(column for column, _, _ in MARKS)])
    ok = ok[(numbers(ok, "kv_bytes_allocated").notna() & numbers(ok, "tpot_ms").notna()).to_numpy()]
    groups = workload_groups(ok)
    if not groups:
        return message_figure(title=title, x_title=x_title, y_title=y_title)
    chosen = groups[0]
    points = pd.DataFrame(
        {
            "x": numbers(chosen, "kv_bytes_allocated") / MIB_BYTES,
            "y": numbers(chosen, "tpot_ms"),
            "cache": texts(chosen, "cache"),
            "kv_dtype": texts(chosen, "kv_dtype"),
            "marks": row_marks(chosen).replace("", "none"),
            **{field: numbers(chosen, field) for field in PARETO_HOVER_NUMBERS},
        }
    )

    kv_dtypes = sorted(points["kv_dtype"].unique())
    symbol_of = {kv_dtype: SYMBOLS[i % len(SYMBOLS)] for i, kv_dtype in enumerate(kv_dtypes)}
    colour_of = {cache: colour(i) for i, cache in enumerate(sorted(points["cache"].unique()))}
    trace = scatter_class(len(points))
    fig = go.Figure()
    # One trace per (cache, kv_dtype): colour and symbol per trace, the numbers per point (hover_groups).
    parts = hover_groups(points, text_fields=("cache", "kv_dtype", "marks"), number_fields=PARETO_HOVER_NUMBERS)
    shown: set[str] = set()
    for part, template, customdata in parts:
        cache, kv_dtype = part["cache"].iloc[0], part["kv_dtype"].iloc[0]
        symbol = symbol_of[kv_dtype] + ("-open" if part["marks"].iloc[0] != "none" else "")
        fig.add_trace(
            trace(
                x=part["x"].to_numpy(np.float32),
                y=part["y"].to_numpy(np.float32),
                mode="markers",
                name=cache,
                legendgroup=cache,
                showlegend=cache not in shown,
                marker=dict(color=colour_of[cache], size=10, symbol=symbol),
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
    if len(groups) > 1:  # the label only then: workload_label reads every row
        _name_the_workload(fig, f"one workload of {len(groups)}: {workload_label(ok).loc[chosen.index[0]]}")
    fig.update_layout(title_text=title, xaxis_title_text=x_title, yaxis_title_text=y_title)
    return fig


def _name_the_workload(fig: go.Figure, text: str) -> None:
    """Above the plot, which of several workloads it draws."""
    fig.add_annotation(
        text=text, x=0, y=1, xref="paper", yref="paper", xanchor="left", yanchor="bottom", showarrow=False
    )
