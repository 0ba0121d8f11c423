"""The dashboard's charts: pure functions from result rows (harness.results.load) to plotly figures.

Every function takes a DataFrame of rows, one per measured point, in the column contract of harness.results.COLUMNS,
and returns a `go.Figure` (strategy_table: a DataFrame; crossover_caption: a string). Nothing here imports Streamlit,
so each chart is unit-tested on synthetic frames.

Rows come from many schema versions and many outcomes, so every chart:
  - raises MissingColumns, before any work, when a column it cannot do without is absent or entirely null;
  - plots only status == "ok" rows (memory_ledger: ok and oom), and with none left returns a figure that says
    "no ok rows" instead of failing;
  - reads numbers through `numbers()`, so nullable Int64/boolean columns and None cells become float NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from harness.crossover import GROUP as KNEE_GROUP
from harness.crossover import knee_batch, knee_table
from harness.spec import spec_for

GIB_BYTES = 2**30
MIB_BYTES = 2**20
SCATTERGL_MIN_POINTS = 5000  # above this an SVG scatter makes the browser crawl; WebGL draws 100k points smoothly
LOG2_DTICK = math.log10(2)  # a log axis with this dtick ticks at 1, 2, 4, 8, ...
PALETTE = qualitative.Plotly
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "star", "hexagon", "triangle-down", "pentagon")
NO_OK_ROWS = "no ok rows"
NO_BATCH_SWEEP = "no batch sweep: every config here was measured at one batch size"
# The six shares of harness.profile.CATEGORIES, as prof_<category>_frac. Not imported from there: harness.profile
# pulls in torch (seconds at start-up) and the dashboard needs none of it; a test keeps the two in step.
PROFILE_CATEGORIES = ("attention", "gemm", "norm_elementwise", "kv", "sampling", "other")
# Config columns that tell sweeps apart; a label names only those that vary among the rows drawn.
IDENTITY_KEYS = ("model", "device_name", "dtype", "kv_dtype", "cache")
ROOFLINE_HOVER_TEXT = ("model", "cache", "dtype", "kv_dtype", "bound", "device_name")  # once per trace
ROOFLINE_HOVER_NUMBERS = ("batch_size", "prompt_len", "tpot_ms")  # per point, through customdata
ROOFLINE_COLUMNS = (
    "arithmetic_intensity",
    "achieved_tflops",
    "prefill_arithmetic_intensity",
    "prefill_achieved_tflops",
    "peak_bw_gbps",
    "peak_tflops",
    *ROOFLINE_HOVER_TEXT,
    *ROOFLINE_HOVER_NUMBERS,
)
PARETO_HOVER_NUMBERS = ("batch_size", "prompt_len", "top1_agreement")
SWEEP_METRICS = {  # metric -> (y-axis title, figure title)
    "decode_tok_s": ("decode throughput (tok/s)", "Decode throughput against batch size"),
    "tpot_ms": ("time per output token (ms)", "Time per output token against batch size"),
}
PROFILE_BY = {"prompt_len": "prompt length (tokens)", "batch_size": "batch size (sequences)"}
LABEL_FORMATS = {"batch_size": "batch {}", "prompt_len": "prompt {}", "gen_len": "gen {}", "max_memory_gb": "{} GiB"}
STRATEGY_MEDIANS = ("tpot_ms", "ttft_ms", "kv_allocated_mib", "kv_waste_fraction", "top1_agreement", "kl_mean")


class MissingColumns(ValueError):
    """A chart's required columns are absent or entirely null in the rows given; str(exc) is one line:
    'needs columns: a, b' (the missing ones)."""


# --------------------------------------------------------------------------------------------------------- helpers


def require(rows: pd.DataFrame, columns: list[str] | tuple[str, ...]) -> None:
    """Raise MissingColumns naming each of `columns` that is absent, or null in every row (an empty frame that has
    the columns passes: it draws as "no ok rows")."""
    missing = [c for c in columns if c not in rows.columns or (len(rows) > 0 and rows[c].isna().all())]
    if missing:
        raise MissingColumns(f"needs columns: {', '.join(missing)}")


def ok_rows(rows: pd.DataFrame, columns: tuple[str, ...] | list[str] | None = None) -> pd.DataFrame:
    """The rows whose status is ok (every row when there is no status column); with `columns`, only those of them
    that exist: a chart narrows first, so it never copies a hundred columns of 100k rows it does not draw."""
    if columns is not None:
        rows = rows[[c for c in dict.fromkeys(["status", *columns]) if c in rows.columns]]
    if "status" not in rows.columns:
        return rows
    # A fresh index: frames concatenated without ignore_index repeat labels, and the charts select by label.
    return rows[rows["status"].eq("ok").fillna(False).astype(bool).to_numpy()].reset_index(drop=True)


def numbers(rows: pd.DataFrame, column: str) -> pd.Series:
    """`column` as float64 with NaN for nulls (Int64, boolean, None, text); all NaN when the column is absent."""
    if column not in rows.columns:
        return pd.Series(np.nan, index=rows.index, dtype="float64")
    return pd.to_numeric(rows[column], errors="coerce").astype("float64")


def format_number(value: float) -> str:
    """Integers as they are (thousands separated from 10,000), other values to 3 significant digits."""
    if not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if float(value).is_integer():
        return f"{int(value):,}" if abs(value) >= 10_000 else str(int(value))
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def texts(rows: pd.DataFrame, column: str) -> pd.Series:
    """`column` as display strings, "-" for nulls; numbers through format_number. Formats each distinct value
    once, so it stays fast on 100k rows."""
    if column not in rows.columns:
        return pd.Series("-", index=rows.index, dtype=object)
    values = rows[column]
    if pd.api.types.is_bool_dtype(values.dtype) or not pd.api.types.is_numeric_dtype(values.dtype):
        return values.astype(object).where(values.notna(), "-").astype(str)
    as_float = values.astype("float64")
    mapping = {value: format_number(value) for value in as_float.dropna().unique()}
    formatted = as_float.map(mapping).astype(object)  # object first: an all-null column maps to float NaN
    return formatted.where(formatted.notna(), "-").astype(str)


def labels(rows: pd.DataFrame, keys: tuple[str, ...], *, always: tuple[str, ...] = ()) -> pd.Series:
    """A short label per row naming the `keys` that take more than one value among `rows` (plus `always`): the
    text ones as words, then the quantities, e.g. "small bf16 contiguous, prompt 512"."""
    words, quantities = [], []
    for key in keys:
        if key not in rows.columns or (key not in always and rows[key].nunique(dropna=False) <= 1):
            continue
        text = texts(rows, key)
        if key in LABEL_FORMATS:
            prefix, suffix = LABEL_FORMATS[key].split("{}")
            quantities.append(prefix + text + suffix)
        else:
            words.append(text)
    label = pd.Series("", index=rows.index, dtype=object)
    for i, part in enumerate(words):
        label = part if i == 0 else label + " " + part
    for part in quantities:
        label = label.where(label == "", label + ", ") + part
    return label.astype(str)


def hover_texts(rows: pd.DataFrame, fields: tuple[str, ...]) -> pd.Series:
    """One "field: value<br>..." string per row. One string rather than a customdata column per field: plotly
    deep-copies each trace it adds, element by element for object arrays (100k points × 9 fields: about a second)."""
    text = pd.Series("", index=rows.index, dtype=object)
    for i, field in enumerate(fields):
        text = text + ("<br>" if i else "") + f"{field}: " + texts(rows, field)
    return text


def hover_groups(
    points: pd.DataFrame, *, text_fields: tuple[str, ...], number_fields: tuple[str, ...]
) -> list[tuple[pd.DataFrame, str, np.ndarray | None]]:
    """The points split by the values of their text fields, each part with a hovertemplate that names those values
    once and shows the number fields per point from customdata: [(part, hovertemplate, customdata)].

    For charts of many points: plotly sends a numeric array as packed binary, but a string per point as JSON text
    (100k points × 9 fields: over 50 MB for the browser to parse). Parts come in sorted order of their text values."""
    numbers_template = "".join(f"<br>{field}: %{{customdata[{i}]:.4g}}" for i, field in enumerate(number_fields))
    if not text_fields:
        groups = [((), np.arange(len(points)))]
    else:
        keys = pd.DataFrame({field: texts(points, field) for field in text_fields}, index=points.index)
        groups = sorted(keys.groupby(list(text_fields), sort=False).indices.items())
    parts = []
    for values, positions in groups:
        values = values if isinstance(values, tuple) else (values,)
        part = points.iloc[positions]
        header = "<br>".join(f"{field}: {value}" for field, value in zip(text_fields, values, strict=True))
        customdata = (
            np.column_stack([numbers(part, field).to_numpy(np.float32) for field in number_fields])
            if number_fields
            else None
        )
        parts.append((part, header + numbers_template, customdata))
    return parts


def message_figure(*, title: str, x_title: str, y_title: str, message: str = NO_OK_ROWS) -> go.Figure:
    """An empty chart that says why it is empty; still a valid figure for st.plotly_chart."""
    fig = go.Figure()
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font_size=16)
    fig.update_layout(title_text=title, xaxis_title_text=x_title, yaxis_title_text=y_title)
    return fig


def scatter_class(n_points: int) -> type[go.Scatter] | type[go.Scattergl]:
    return go.Scattergl if n_points > SCATTERGL_MIN_POINTS else go.Scatter


def colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def category_colour(category: str) -> str:
    """One colour per profiler category, the same in profile_shares and top_ops."""
    return colour(PROFILE_CATEGORIES.index(category)) if category in PROFILE_CATEGORIES else "grey"


def vertical_marker(fig: go.Figure, *, x: float, text: str, name: str, color: str, dash: str, slot: int) -> None:
    """A full-height vertical line at data x on a log x axis, its label stacked at the top by `slot`.

    Shapes on a log axis take data values, annotations take log10 of them (plotly's layout.annotations.x)."""
    fig.add_shape(
        type="line", name=name, x0=x, x1=x, xref="x", y0=0, y1=1, yref="paper", line=dict(color=color, dash=dash)
    )
    fig.add_annotation(
        text=text,
        x=math.log10(x),
        y=1 - 0.06 * slot,
        xref="x",
        yref="paper",
        xanchor="left",
        yanchor="top",
        showarrow=False,
        font_color=color,
    )


# -------------------------------------------------------------------------------------------------------- roofline


def _positive_points(rows: pd.DataFrame, *, x: str, y: str) -> pd.DataFrame:
    """Rows whose x and y are finite and positive (a log-log chart has no place for the rest), with _x and _y."""
    xs, ys = numbers(rows, x), numbers(rows, y)
    keep = np.isfinite(xs) & np.isfinite(ys) & (xs > 0) & (ys > 0)
    return rows[keep].assign(_x=xs[keep], _y=ys[keep])


def _roofs(ok: pd.DataFrame) -> list[dict]:
    """Measured roofs per (device_name, dtype) from the rows' ceilings, and the datasheet's where spec_for knows the
    device: [{label, bw_gbps, tflops, spec}]."""
    peaks = pd.DataFrame(
        {
            "device_name": texts(ok, "device_name"),
            "dtype": texts(ok, "dtype"),
            "bw_gbps": numbers(ok, "peak_bw_gbps"),
            "tflops": numbers(ok, "peak_tflops"),
        }
    )
    peaks = peaks[(peaks["bw_gbps"] > 0) & (peaks["tflops"] > 0)]
    roofs = []
    for (device_name, dtype), group in peaks.groupby(["device_name", "dtype"], sort=True):
        # One ceilings file per device fingerprint; the median settles rows measured against two of them.
        roofs.append(
            dict(
                label=f"measured roof: {device_name} {dtype}",
                bw_gbps=float(group["bw_gbps"].median()),
                tflops=float(group["tflops"].median()),
                spec=False,
            )
        )
        spec = spec_for(device_name) if device_name != "-" else None
        if spec is None:
            continue
        line = spec[spec["dtype"] == dtype]
        if line.empty or pd.isna(line["peak_tflops_dense"].iloc[0]) or pd.isna(line["peak_bw_gbps"].iloc[0]):
            continue
        roofs.append(
            dict(
                label=f"spec roof: {line['device_name'].iloc[0]} {dtype}",
                bw_gbps=float(line["peak_bw_gbps"].iloc[0]),
                tflops=float(line["peak_tflops_dense"].iloc[0]),
                spec=True,
            )
        )
    return roofs


def _roofline_points(points: pd.DataFrame, *, name: str, symbol: str, trace: type) -> list[go.Scatter]:
    """One trace per distinct config (ROOFLINE_HOVER_TEXT) in one legend group `name`: the hover names the config
    once per trace and the point's numbers from customdata, so 100k points stay a few MB for the browser."""
    traces = []
    parts = hover_groups(points, text_fields=ROOFLINE_HOVER_TEXT, number_fields=ROOFLINE_HOVER_NUMBERS)
    for i, (part, template, customdata) in enumerate(parts):
        batch = numbers(part, "batch_size")
        colour_value = np.log2(batch.where(batch > 0)).fillna(0.0)  # the colour scale is log2(batch)
        traces.append(
            trace(
                x=part["_x"].to_numpy(np.float32),  # half the bytes of float64, and more digits than a hover shows
                y=part["_y"].to_numpy(np.float32),
                mode="markers",
                name=name,
                legendgroup=name,
                showlegend=i == 0,
                marker=dict(
                    symbol=symbol,
                    size=9,
                    color=colour_value.to_numpy(np.float32),
                    coloraxis="coloraxis",
                    line_width=0 if trace is go.Scattergl else 0.5,  # outlines double the fill work of WebGL
                ),
                customdata=customdata,
                hovertemplate=f"{template}<br>%{{x:.3g}} FLOP/B, %{{y:.3g}} TFLOP/s<extra>{name}</extra>",
            )
        )
    return traces


STATUS_COLOURS = {
    "ok": "#2ca02c",
    "oom": "#d62728",
    "skipped_oom": "#f4a6a6",  # not run: the OOM backstop (harness/sweep.py) judged it past an OOM
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


def roofline(rows: pd.DataFrame) -> go.Figure:
    """Log-log roofline: decode (circles) and prefill (diamonds) points of the ok rows, coloured by log2(batch),
    under each (device, dtype)'s measured roof (solid, its ridge dotted) and the datasheet's (dashed) when known."""
    require(rows, ["arithmetic_intensity", "achieved_tflops", "peak_bw_gbps", "peak_tflops"])
    title = "Roofline: achieved throughput against arithmetic intensity"
    x_title, y_title = "arithmetic intensity (FLOP/byte)", "achieved throughput (TFLOP/s)"
    ok = ok_rows(rows, ROOFLINE_COLUMNS)
    decode = _positive_points(ok, x="arithmetic_intensity", y="achieved_tflops")
    # Older rows have no prefill figures: then the chart is decode only.
    prefill = _positive_points(ok, x="prefill_arithmetic_intensity", y="prefill_achieved_tflops")
    if decode.empty and prefill.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)

    roofs = _roofs(ok)
    ridges = [roof["tflops"] * 1000 / roof["bw_gbps"] for roof in roofs]  # FLOP/byte: TFLOP/s over GB/s, 1e12/1e9
    xs = np.concatenate([decode["_x"].to_numpy(), prefill["_x"].to_numpy(), ridges])
    ys = np.concatenate([decode["_y"].to_numpy(), prefill["_y"].to_numpy()])
    x_low, x_high = xs.min() / 2, xs.max() * 2  # a factor of 2 of margin on a log axis
    fig = go.Figure()
    n_measured = 0
    for roof, ridge in zip(roofs, ridges, strict=True):
        roof_x = np.array([x_low, ridge, x_high])
        roof_y = np.minimum(roof["tflops"], roof_x * roof["bw_gbps"] / 1000)
        color = colour(n_measured)
        n_measured += not roof["spec"]
        fig.add_trace(
            go.Scatter(
                x=roof_x,
                y=roof_y,
                mode="lines",
                name=roof["label"],
                line=dict(color="grey" if roof["spec"] else color, width=2, dash="dash" if roof["spec"] else "solid"),
                hovertemplate=f"{roof['bw_gbps']:.4g} GB/s, {roof['tflops']:.4g} TFLOP/s<extra>{roof['label']}</extra>",
            )
        )
        if roof["spec"]:
            continue
        y_floor = min(ys.min(), roof_y.min()) / 2
        fig.add_trace(
            go.Scatter(
                x=[ridge, ridge],
                y=[y_floor, roof["tflops"]],
                mode="lines",
                name=f"ridge: {roof['label'].removeprefix('measured roof: ')}",
                showlegend=False,
                line=dict(color=color, width=1, dash="dot"),
                hovertemplate=f"ridge {format_number(ridge)} FLOP/B<extra></extra>",
            )
        )
        fig.add_annotation(  # on log axes an annotation takes log10 of its position
            x=math.log10(ridge),
            y=math.log10(roof["tflops"]),
            text=f"ridge {format_number(ridge)} FLOP/B",
            showarrow=True,
            arrowhead=0,
            ax=30,
            ay=-25,
            font_color=color,
        )
    trace = scatter_class(len(decode) + len(prefill))
    if not decode.empty:
        fig.add_traces(_roofline_points(decode, name="decode", symbol="circle", trace=trace))
    if not prefill.empty:
        fig.add_traces(_roofline_points(prefill, name="prefill", symbol="diamond", trace=trace))

    batch = np.concatenate([numbers(decode, "batch_size").to_numpy(), numbers(prefill, "batch_size").to_numpy()])
    exponents = np.log2(batch[batch > 0]) if (batch > 0).any() else np.zeros(1)
    low, high = math.floor(exponents.min()), math.ceil(exponents.max())
    high = max(high, low + 1)  # a scale needs two ends
    ticks = list(range(low, high + 1))
    fig.update_layout(
        title_text=title,
        xaxis=dict(type="log", title_text=x_title),
        yaxis=dict(type="log", title_text=y_title),
        coloraxis=dict(
            colorscale="Viridis",
            cmin=low,
            cmax=high,
            colorbar=dict(title_text="batch", tickvals=ticks, ticktext=[str(2**k) for k in ticks]),
        ),
        legend=dict(orientation="h", yanchor="top", y=-0.15),
    )
    return fig


# ----------------------------------------------------------------------------------------------------- batch sweep


def _first(values: pd.Series) -> float | None:
    values = values.dropna()
    return float(values.iloc[0]) if len(values) else None


def _knee(per_batch: pd.DataFrame) -> float | None:
    """The observed knee (harness.crossover.knee_batch) of one line: per_batch is indexed by batch, ascending."""
    tpot = per_batch["tpot_ms"]
    known = tpot.notna()
    return knee_batch(per_batch.index[known].tolist(), tpot[known].tolist())


def _critical_context_text(value: float) -> str:
    return "S*: never binds" if math.isinf(value) else f"S* ≈ {format_number(round(value))} tokens"


def batch_sweep(rows: pd.DataFrame, *, metric: str = "decode_tok_s") -> go.Figure:
    """Decode throughput or TPOT against the batch (log2 x), one line per prompt length and config, with the
    roofline's prediction (dotted), the compute ceiling (dashed), B* and the observed knee as vertical lines, and
    S* in a note. Throughput is on a log y axis: it spans decades and the compute ceiling sits far above it."""
    if metric not in SWEEP_METRICS:
        raise ValueError(f"metric must be one of {', '.join(SWEEP_METRICS)}, got {metric!r}")
    require(rows, ["batch_size", "prompt_len", metric])
    y_title, title = SWEEP_METRICS[metric]
    x_title = "batch size (sequences)"
    ok = ok_rows(rows)
    ok = ok[numbers(ok, metric).notna() & (numbers(ok, "batch_size") > 0) & numbers(ok, "prompt_len").notna()]
    if ok.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)

    points = pd.DataFrame(
        {
            "batch_size": numbers(ok, "batch_size"),
            "prompt_len": numbers(ok, "prompt_len"),
            "value": numbers(ok, metric),
            "tpot_ms": numbers(ok, "tpot_ms") if "tpot_ms" in ok else np.nan,
            "predicted_tpot_ms": numbers(ok, "predicted_tpot_ms"),
            "flops_per_step": numbers(ok, "flops_per_step"),
            "peak_tflops": numbers(ok, "peak_tflops"),
            "critical_batch": numbers(ok, "critical_batch"),
            "critical_context": numbers(ok, "critical_context"),
            **{key: texts(ok, key) for key in IDENTITY_KEYS},
        }
    )
    points["identity"] = labels(points, IDENTITY_KEYS)
    points["label"] = labels(points, (*IDENTITY_KEYS, "prompt_len"), always=("prompt_len",))
    points = points.sort_values([*IDENTITY_KEYS, "prompt_len"], kind="stable")  # the legend's order
    # A line needs two batch sizes: a config measured at one batch (a strategies sweep) is no batch sweep.
    points = points[points.groupby("label")["batch_size"].transform("nunique") >= 2]
    if points.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title, message=NO_BATCH_SWEEP)

    fig = go.Figure()
    legend_shown: set[str] = set()
    drawn: set[tuple[str, float]] = set()  # vertical markers: (kind, batch)
    for i, (label, line) in enumerate(points.groupby("label", sort=False)):
        color = colour(i)
        per_batch = line.groupby("batch_size").median(numeric_only=True).sort_index()
        batch = per_batch.index.to_numpy(dtype=float)
        fig.add_trace(
            go.Scatter(x=batch, y=per_batch["value"], mode="lines+markers", name=label, line=dict(color=color))
        )
        predicted = per_batch["predicted_tpot_ms"]
        if metric == "decode_tok_s":
            predicted = batch * 1000 / predicted  # tok/s = sequences per step / seconds per step
            # Every sequence's FLOPs at the peak: the throughput no batch can exceed.
            ceiling = per_batch["peak_tflops"] * 1e12 / (per_batch["flops_per_step"] / batch)
        else:
            ceiling = per_batch["flops_per_step"] / (per_batch["peak_tflops"] * 1e12) * 1e3  # ms of pure compute
        for name, values, dash in (("predicted (roofline)", predicted, "dot"), ("compute ceiling", ceiling, "dash")):
            known = values.notna().to_numpy()
            if not known.any():
                continue
            fig.add_trace(
                go.Scatter(
                    x=batch[known],
                    y=values[known],
                    mode="lines",
                    name=name,
                    legendgroup=name,  # one legend entry toggles this overlay on every line
                    showlegend=name not in legend_shown,
                    line=dict(color=color, dash=dash, width=1.5),
                    hovertemplate=f"{label}<br>batch %{{x}}: %{{y:.4g}}<extra>{name}</extra>",
                )
            )
            legend_shown.add(name)
        markers = (("B*", _first(line["critical_batch"]), "dashdot"), ("knee", _knee(per_batch), "longdash"))
        for kind, x, dash in markers:
            if x is None or x <= 0 or (kind, x) in drawn:  # null: nothing to mark; drawn: lines that agree share one
                continue
            text = f"{kind} = {format_number(x)}"
            vertical_marker(fig, x=x, text=text, name=f"{kind}: {label}", color=color, dash=dash, slot=len(drawn))
            drawn.add((kind, x))

    notes = []
    for identity, group in points.groupby("identity", sort=False):
        critical_context = _first(group["critical_context"])
        if critical_context is not None:
            notes.append(f"{identity}: " * bool(identity) + _critical_context_text(critical_context))
    if notes:
        fig.add_annotation(
            text="<br>".join(notes),
            x=1,
            y=1,
            xref="paper",
            yref="paper",
            xanchor="right",
            yanchor="bottom",
            align="right",
            showarrow=False,
        )
    fig.update_layout(
        title_text=title,
        xaxis=dict(type="log", dtick=LOG2_DTICK, title_text=x_title),
        yaxis=dict(type="log" if metric == "decode_tok_s" else "linear", title_text=y_title),
    )
    return fig


# ------------------------------------------------------------------------------------------------- crossover caption


def _sweep_clause(sweep: pd.DataFrame, knee: object, critical_batch: object, *, first: bool) -> str:
    """What one batch sweep (one prompt length) shows, as a clause; the first of a sentence names the subject."""
    batches = sorted(numbers(sweep, "batch_size").dropna().unique())
    prompt_len = numbers(sweep, "prompt_len").median()
    gen_len = numbers(sweep, "gen_len").median()
    context = prompt_len + (0 if math.isnan(gen_len) else gen_len)  # the context the last decode step sees
    notes = []
    if knee is not None and not pd.isna(knee):
        below = max([b for b in batches if b < knee], default=batches[0])
        reach = f"up to batch ≈ {format_number(below)}"
        notes.append(f"observed knee {format_number(float(knee))}")
    else:
        reach = f"through batch {format_number(batches[-1])}"
        notes.append("no knee within the sweep")
    if critical_batch is not None and not pd.isna(critical_batch):
        notes.append(f"predicted B* {format_number(float(critical_batch))}")
    elif numbers(sweep, "peak_tflops").notna().any():
        notes.append("predicted: no batch reaches the ridge")
    else:
        notes.append("no B* prediction: the rows carry no ceilings")
    bound = sweep.loc[sweep["bound"].notna(), ["batch_size", "bound"]] if "bound" in sweep.columns else None
    if bound is not None and not bound.empty:
        compute = numbers(bound[bound["bound"] == "compute"], "batch_size")
        notes.append(
            f"roofline verdict compute from batch {format_number(compute.min())}"
            if compute.notna().any()
            else "roofline verdict memory at every batch"
        )
    if first:
        return f"decode stays memory-bound {reach} at {format_number(context)}-token context ({', '.join(notes)})"
    return f"at {format_number(context)} tokens {reach} ({', '.join(notes)})"


def crossover_caption(rows: pd.DataFrame) -> str:
    """One or two sentences on where decode stops being memory-bound, from knee_table and the bound column; when
    the rows cannot say, a sentence saying what is missing. Never raises on missing data."""
    needed = ["status", "batch_size", "prompt_len", "tpot_ms"]
    missing = [c for c in needed if c not in rows.columns or rows[c].isna().all()]
    if rows.empty:
        return "No crossover to describe: there are no rows."
    if missing:
        return f"No crossover to describe: the rows have no {', '.join(missing)}."
    ok = ok_rows(rows)
    if ok.empty:
        return f"No crossover to describe: {NO_OK_ROWS}."
    # The grouping keys as plain text and floats, so knee_table's groups and the sweeps below match exactly.
    caption_columns = ("status", "batch_size", "gen_len", "tpot_ms", "critical_batch", "peak_tflops", "bound")
    frame = ok.reindex(columns=list(dict.fromkeys([*KNEE_GROUP, "device_name", *caption_columns])))  # narrow: fast
    frame = frame.assign(
        **{key: texts(frame, key) for key in KNEE_GROUP if key != "prompt_len"},
        prompt_len=numbers(frame, "prompt_len"),
    )
    frame = frame[frame["prompt_len"].notna()]
    knees = knee_table(frame)
    if knees.empty:
        return (
            "No crossover to describe: no batch sweep from batch 1 among the ok rows "
            "(one needs batch 1 and at least one larger batch at the same prompt length)."
        )
    sweeps = dict(iter(frame.groupby(KNEE_GROUP, sort=False)))
    config_keys = [key for key in KNEE_GROUP if key != "prompt_len"]
    caches_vary = knees["cache"].nunique() > 1
    sentences = []
    configs = list(knees.groupby(config_keys, sort=False))
    for config, lines in configs[:2]:
        values = dict(zip(config_keys, config, strict=True))
        lines = lines.sort_values("prompt_len", ascending=False)  # the longest context first: it binds soonest
        clauses = [
            _sweep_clause(sweeps[tuple(line[KNEE_GROUP])], line["knee_batch"], line["critical_batch"], first=j == 0)
            for j, (_, line) in enumerate(lines.iterrows())
        ]
        sweep = sweeps[tuple(lines.iloc[0][KNEE_GROUP])]
        device = next((name for name in texts(sweep, "device_name") if name != "-"), values["device"])
        words = [values["model"], values["dtype"]]
        words += [f"(KV {values['kv_dtype']})"] if values["kv_dtype"] not in (values["dtype"], "-") else []
        words += [values["cache"]] if caches_vary else []
        subject = " ".join(word for word in words if word != "-") + (f" on {device}" if device != "-" else "")
        text = "; ".join(clauses)
        sentences.append(f"{subject.strip()}: {text}." if subject.strip() else f"{text[0].upper()}{text[1:]}.")
    if len(configs) > 2:
        sentences[-1] = f"{len(configs) - 1} more configurations have batch sweeps: filter to one to read it."
    return " ".join(sentences)


# ---------------------------------------------------------------------------------------------------------- memory


def memory_ledger(rows: pd.DataFrame, *, capacity_bytes: float | None = None) -> go.Figure:
    """Stacked GiB per ok/oom point (weights, KV allocated, everything else at the peak), the analytic prediction as
    markers, the device capacity as a line, OOM points as red crosses; x sorted by context × batch."""
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
            "predicted": (weights + numbers(kept, "kv_bytes_predicted")) / GIB_BYTES,
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
        predicted=("predicted", "median"),
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
    if ledger["predicted"].notna().any():
        fig.add_trace(
            go.Scatter(
                x=x,
                y=ledger["predicted"],
                mode="markers",
                name="predicted (weights + KV)",
                marker=dict(symbol="diamond", size=10, color="black"),
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
        # what it was predicted to need, or held; a failed row rarely records either, so else at the tallest bar.
        held = ledger[["weights", "kv", "other"]].sum(axis=1, min_count=1)
        if capacity_gib is not None:
            y = pd.Series(capacity_gib, index=oom.index)
        else:
            y = oom["cap"].fillna(oom["predicted"]).fillna(held.loc[oom.index]).fillna(held.max())
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


# ------------------------------------------------------------------------------------------------------ strategies


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


# --------------------------------------------------------------------------------------------------------- latency


def ttft_vs_prompt(rows: pd.DataFrame) -> go.Figure:
    """TTFT against prompt length (log2 x), one line per (cache, batch_size), the median where points repeat."""
    require(rows, ["prompt_len", "ttft_ms"])
    title = "Time to first token against prompt length"
    x_title, y_title = "prompt length (tokens)", "time to first token (ms)"
    ok = ok_rows(rows)
    points = pd.DataFrame({"prompt_len": numbers(ok, "prompt_len"), "ttft_ms": numbers(ok, "ttft_ms")})
    points["line"] = texts(ok, "cache") + ", batch " + texts(ok, "batch_size")
    points = points[(points["prompt_len"] > 0) & points["ttft_ms"].notna()]
    if points.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)
    fig = go.Figure()
    for i, (line, group) in enumerate(points.groupby("line", sort=True)):
        per_prompt = group.groupby("prompt_len")["ttft_ms"].median().sort_index()
        fig.add_trace(
            go.Scatter(x=per_prompt.index, y=per_prompt, mode="lines+markers", name=line, line=dict(color=colour(i)))
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
    keys = ("model", "dtype", "kv_dtype", "cache", "prompt_len", "batch_size")
    names = labels(chosen, keys, always=tuple(key for key in ("cache", "prompt_len", "batch_size") if key in chosen))
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
    """Median, p90 and p99 TPOT over repeats as grouped bars, one group per point."""
    require(rows, ["tpot_ms"])
    title = "Time per output token: median, p90 and p99 over repeats"
    x_title, y_title = "point", "time per output token (ms)"
    ok = ok_rows(rows)
    ok = ok[numbers(ok, "tpot_ms").notna().to_numpy()]
    if ok.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)
    keys = ("model", "dtype", "kv_dtype", "cache", "batch_size", "prompt_len", "gen_len")
    ok = ok.sort_values([key for key in keys if key in ok.columns], kind="stable")
    points = pd.DataFrame({c: numbers(ok, c) for c in ("tpot_ms", "tpot_p90_ms", "tpot_p99_ms")})
    points["label"] = labels(ok, keys, always=("cache",) if "cache" in ok.columns else ()).replace("", "all rows")
    per_point = points.groupby("label", sort=False).median()
    fig = go.Figure()
    for column, name in (("tpot_ms", "median"), ("tpot_p90_ms", "p90"), ("tpot_p99_ms", "p99")):
        if per_point[column].notna().any():
            fig.add_trace(go.Bar(x=per_point.index.to_list(), y=per_point[column], name=name))
    fig.update_layout(title_text=title, barmode="group", xaxis_title_text=x_title, yaxis_title_text=y_title)
    return fig


# --------------------------------------------------------------------------------------------------------- profile


def profile_shares(rows: pd.DataFrame, *, by: str = "prompt_len") -> go.Figure:
    """The profiler's six shares of a decode step's time (prof_*_frac), stacked, the median per value of `by`."""
    if by not in PROFILE_BY:
        raise ValueError(f"by must be one of {', '.join(PROFILE_BY)}, got {by!r}")
    shares = [f"prof_{category}_frac" for category in PROFILE_CATEGORIES]
    require(rows, [by, *shares])
    title = f"Where a decode step's time goes, by {PROFILE_BY[by].split(' (')[0]}"
    x_title, y_title = PROFILE_BY[by], "share of step time"
    ok = ok_rows(rows)
    points = pd.DataFrame({column: numbers(ok, column) for column in [by, *shares]}).dropna()
    if points.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title)
    per_value = points.groupby(by).median().sort_index()
    x = [format_number(value) for value in per_value.index]
    fig = go.Figure()
    for category, column in zip(PROFILE_CATEGORIES, shares, strict=True):
        fig.add_trace(go.Bar(x=x, y=per_value[column], name=category, marker_color=category_colour(category)))
    fig.update_layout(
        title_text=title,
        barmode="stack",
        xaxis=dict(type="category", title_text=x_title),
        yaxis=dict(range=[0, 1], title_text=y_title),
    )
    return fig


def top_ops(ops: pd.DataFrame, *, n: int = 15) -> go.Figure:
    """The n ops with the most self time in one point's top-ops table (harness.profile: op, category,
    self_time_ms, ...), as horizontal bars coloured by category, the biggest on top."""
    time_column = "us" if "self_time_ms" not in ops.columns and "us" in ops.columns else "self_time_ms"
    require(ops, ["op", "category", time_column])
    if "point_id" in ops.columns and ops["point_id"].nunique() > 1:
        raise ValueError(f"top_ops draws one point's table; got {ops['point_id'].nunique()} point_ids")
    ops = ops.reset_index(drop=True)  # the columns below are aligned on it
    title = "Top ops by self time"
    x_title = "self time (µs)" if time_column == "us" else "self time (ms, over the profiled steps)"
    y_title = "op"
    table = pd.DataFrame(
        {"op": texts(ops, "op"), "category": texts(ops, "category"), "time": numbers(ops, time_column)}
    )
    table = table.dropna(subset=["time"]).sort_values("time", ascending=False, kind="stable").head(n)
    if table.empty:
        return message_figure(title=title, x_title=x_title, y_title=y_title, message="no ops")
    # Kernel names run to hundreds of characters: shorten for the axis, keep the whole name in the hover.
    short = table["op"].where(table["op"].str.len() <= 60, table["op"].str.slice(0, 59) + "…")
    rank = pd.Series(np.arange(1, len(table) + 1), index=table.index).astype(str)
    table["label"] = short.where(~short.duplicated(keep=False), short + " [" + rank + "]")  # one bar per op
    fig = go.Figure()
    for category, group in table.groupby("category", sort=True):
        fig.add_trace(
            go.Bar(
                x=group["time"],
                y=group["label"],
                orientation="h",
                name=category,
                marker_color=category_colour(category),
                hovertext=group["op"],
                hovertemplate="%{hovertext}<br>%{x:.4g}<extra>" + category + "</extra>",
            )
        )
    fig.update_layout(
        title_text=f"Top {len(table)} ops by self time",
        xaxis_title_text=x_title,
        # Ascending from the bottom, so the biggest op is on top.
        yaxis=dict(
            type="category", categoryorder="array", categoryarray=table["label"].to_list()[::-1], title_text=y_title
        ),
    )
    return fig
