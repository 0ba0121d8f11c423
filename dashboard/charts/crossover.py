"""The roofline page's crossover charts: throughput and TPOT against the batch (with the roofline's prediction,
B* and the observed knee), and the caption saying where decode stops being memory-bound."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import (
    LOG2_DTICK,
    NO_OK_ROWS,
    colour,
    format_number,
    labels,
    message_figure,
    numbers,
    ok_rows,
    require,
    texts,
)
from harness.analytic.crossover import GROUP as KNEE_GROUP
from harness.analytic.crossover import knee_batch, knee_table
from harness.store.schema import KV_COLUMNS, POINT_KEY_COLUMNS

NO_BATCH_SWEEP = "no batch sweep: every config here was measured at one batch size"
# Config columns that tell sweeps apart: the point key but the batch (the x) and the prompt (one line each), so that
# a line never takes a median across two workloads or KV treatments. A label names only those that vary.
IDENTITY_KEYS = ("model", "device_name", "dtype", "kv_dtype", "cache") + tuple(
    key for key in POINT_KEY_COLUMNS if key not in ("model", "dtype", "kv_dtype", "cache", "batch_size", "prompt_len")
)
SWEEP_COLUMNS = (  # what batch_sweep reads besides its metric and IDENTITY_KEYS
    "batch_size",
    "prompt_len",
    "tpot_ms",
    "predicted_tpot_ms",
    "flops_per_step",
    "peak_tflops",
    "critical_batch",
    "critical_context",
)
KV_OPTIONS = KV_COLUMNS[2:]  # kept raw in the points: labels() names an option only where a row has one
SWEEP_METRICS = {  # metric -> (y-axis title, figure title)
    "decode_tok_s": ("decode throughput (tok/s)", "Decode throughput against batch size"),
    "tpot_ms": ("time per output token (ms)", "Time per output token against batch size"),
}


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


def _first(values: pd.Series) -> float | None:
    values = values.dropna()
    return float(values.iloc[0]) if len(values) else None


def _knee(per_batch: pd.DataFrame) -> float | None:
    """The observed knee (harness.analytic.crossover.knee_batch) of one line: per_batch is indexed by batch, ascending."""
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
    ok = ok_rows(rows, [*SWEEP_COLUMNS, metric, *IDENTITY_KEYS])  # narrowed first: 100k rows of 130 columns
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
            **{key: ok[key] if key in KV_OPTIONS and key in ok else texts(ok, key) for key in IDENTITY_KEYS},
        }
    )
    points["identity"] = labels(points, IDENTITY_KEYS)
    points["label"] = labels(points, (*IDENTITY_KEYS, "prompt_len"), always=("prompt_len",))
    order = points[[*IDENTITY_KEYS, "prompt_len"]].astype(str).assign(prompt_len=points["prompt_len"])
    points = points.loc[order.sort_values([*IDENTITY_KEYS, "prompt_len"], kind="stable").index]  # the legend's order
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
