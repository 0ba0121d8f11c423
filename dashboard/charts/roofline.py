"""The roofline page's first chart: each decode and prefill step against the device's measured and datasheet
roofs (the batch sweep and the crossover caption beside it: dashboard/charts/crossover.py)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import sequential

from dashboard.charts.common import (
    MARKS,
    format_number,
    hover_groups,
    message_figure,
    numbers,
    ok_rows,
    require,
    row_marks,
    scatter_class,
    texts,
)
from harness.device.spec import spec_for

ROOFLINE_HOVER_TEXT = ("model", "cache", "dtype", "kv_dtype", "bound", "device_name", "marks")  # once per trace
ROOFLINE_HOVER_NUMBERS = ("batch_size", "prompt_len", "tpot_ms")  # per point, through customdata
ROOFLINE_COLUMNS = (
    "arithmetic_intensity",
    "achieved_tflops",
    "prefill_arithmetic_intensity",
    "prefill_achieved_tflops",
    "peak_bw_gbps",
    "peak_tflops",
    "bw_roof",
    *(column for column, _, _ in MARKS),
    *ROOFLINE_HOVER_TEXT,
    *ROOFLINE_HOVER_NUMBERS,
)

# A colour family per compute dtype, batch within it (light: batch 1, dark: the largest), so that bf16 points are
# never read against the fp32 roofs; each dtype's roofs take the family's dark end. The light end of a sequential
# scale is near white on a white page: it is cut off.
DTYPE_FAMILIES = {"bf16": sequential.Blues, "fp16": sequential.Greens, "fp32": sequential.Oranges}
OTHER_FAMILIES = (sequential.Purples, sequential.Greys, sequential.Reds)
FAMILY_LIGHTEST = 3  # of the 9 colours of each plotly sequential scale, the first kept


def _families(dtypes: list[str]) -> dict[str, list[str]]:
    """The colour family of each dtype: DTYPE_FAMILIES, then OTHER_FAMILIES in turn for any other name."""
    others = iter(OTHER_FAMILIES * (1 + len(dtypes)))
    return {dtype: list(DTYPE_FAMILIES.get(dtype) or next(others))[FAMILY_LIGHTEST:] for dtype in dtypes}


def _positive_points(rows: pd.DataFrame, *, x: str, y: str) -> pd.DataFrame:
    """Rows whose x and y are finite and positive (a log-log chart has no place for the rest), with _x and _y."""
    xs, ys = numbers(rows, x), numbers(rows, y)
    keep = np.isfinite(xs) & np.isfinite(ys) & (xs > 0) & (ys > 0)
    return rows[keep].assign(_x=xs[keep], _y=ys[keep])


def _roofs(ok: pd.DataFrame) -> list[dict]:
    """Measured roofs per (device_name, dtype, bw_roof) from the rows' ceilings, and the datasheet's per (device_name,
    dtype) where spec_for knows the device: [{label, dtype, bw_gbps, tflops, spec}]. A label names the bandwidth the
    memory roof is (read or copy) where the rows record it."""
    peaks = pd.DataFrame(
        {
            "device_name": texts(ok, "device_name"),
            "dtype": texts(ok, "dtype"),
            "bw_gbps": numbers(ok, "peak_bw_gbps"),
            "tflops": numbers(ok, "peak_tflops"),
            "bw_roof": texts(ok, "bw_roof"),  # "-": not recorded (rows before schema 3 used the copy bandwidth)
        }
    )
    peaks = peaks[(peaks["bw_gbps"] > 0) & (peaks["tflops"] > 0)]
    roofs = []
    for (device_name, dtype), device_peaks in peaks.groupby(["device_name", "dtype"], sort=True):
        for bw_roof, group in device_peaks.groupby("bw_roof", sort=True):
            # One ceilings file per device fingerprint; the median settles rows measured against two of them.
            which = "" if bw_roof == "-" else f" ({bw_roof} bandwidth)"
            roofs.append(
                dict(
                    label=f"measured roof: {device_name} {dtype}{which}",
                    dtype=dtype,
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
                dtype=dtype,
                bw_gbps=float(line["peak_bw_gbps"].iloc[0]),
                tflops=float(line["peak_tflops_dense"].iloc[0]),
                spec=True,
            )
        )
    return roofs


def _roofline_points(
    points: pd.DataFrame, *, phase: str, symbol: str, trace: type, axes: dict[str, str]
) -> list[go.Scatter]:
    """One trace per distinct config (ROOFLINE_HOVER_TEXT), in one legend group per phase and dtype, coloured on its
    dtype's colour axis (`axes`: dtype -> coloraxis); a marked row (not converged, host busy) draws an open marker.
    The hover names the config once per trace and the point's numbers from customdata, so 100k points stay a few MB
    for the browser."""
    traces = []
    shown: set[str] = set()
    parts = hover_groups(points, text_fields=ROOFLINE_HOVER_TEXT, number_fields=ROOFLINE_HOVER_NUMBERS)
    for part, template, customdata in parts:
        first = part.iloc[:1]  # a part shares its text fields: read them off one row
        dtype = texts(first, "dtype").iloc[0]
        name = phase if len(axes) == 1 else f"{phase} {dtype}"
        marked = texts(first, "marks").iloc[0] != "none"
        batch = numbers(part, "batch_size")
        colour_value = np.log2(batch.where(batch > 0)).fillna(0.0)  # the colour scale is log2(batch)
        traces.append(
            trace(
                x=part["_x"].to_numpy(np.float32),  # half the bytes of float64, and more digits than a hover shows
                y=part["_y"].to_numpy(np.float32),
                mode="markers",
                name=name,
                legendgroup=name,
                showlegend=name not in shown,
                marker=dict(
                    symbol=f"{symbol}-open" if marked else symbol,
                    size=9,
                    color=colour_value.to_numpy(np.float32),
                    coloraxis=axes[dtype],
                    line_width=0 if trace is go.Scattergl else 0.5,  # outlines double the fill work of WebGL
                ),
                customdata=customdata,
                hovertemplate=f"{template}<br>%{{x:.3g}} FLOP/B, %{{y:.3g}} TFLOP/s<extra>{name}</extra>",
            )
        )
        shown.add(name)
    return traces


def roofline(rows: pd.DataFrame) -> go.Figure:
    """Log-log roofline: decode (circles) and prefill (diamonds) points of the ok rows, in a colour family per
    compute dtype (DTYPE_FAMILIES) and within it by log2(batch), each dtype with its own batch colorbar; open markers
    for rows not to trust (row_marks). Under each (device, dtype)'s measured roof (solid, in its dtype's colour, its
    ridge dotted, its compute roof labelled; the memory roof named read or copy where bw_roof says) and the
    datasheet's (dashed) when known."""
    require(rows, ["arithmetic_intensity", "achieved_tflops", "peak_bw_gbps", "peak_tflops"])
    title = "Roofline: achieved throughput against arithmetic intensity"
    x_title, y_title = "arithmetic intensity (FLOP/byte)", "achieved throughput (TFLOP/s)"
    ok = ok_rows(rows, ROOFLINE_COLUMNS)
    ok = ok.assign(marks=row_marks(ok).replace("", "none"))
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
    dtypes = sorted(set(texts(decode, "dtype")) | set(texts(prefill, "dtype")) | {roof["dtype"] for roof in roofs})
    families = _families(dtypes)
    axes = {dtype: "coloraxis" if i == 0 else f"coloraxis{i + 1}" for i, dtype in enumerate(dtypes)}
    fig = go.Figure()
    for roof, ridge in zip(roofs, ridges, strict=True):
        roof_x = np.array([x_low, ridge, x_high])
        roof_y = np.minimum(roof["tflops"], roof_x * roof["bw_gbps"] / 1000)
        color = families[roof["dtype"]][-2]  # the family's dark end: the points' darkest is the largest batch
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
        fig.add_annotation(  # the flat part: this dtype's compute roof, named so two dtypes' roofs are told apart
            x=math.log10(x_high),
            y=math.log10(roof["tflops"]),
            text=f"{roof['dtype']} compute roof {format_number(roof['tflops'])} TFLOP/s",
            showarrow=False,
            xanchor="right",
            yanchor="bottom",
            font_color=color,
        )
    trace = scatter_class(len(decode) + len(prefill))
    if not decode.empty:
        fig.add_traces(_roofline_points(decode, phase="decode", symbol="circle", trace=trace, axes=axes))
    if not prefill.empty:
        fig.add_traces(_roofline_points(prefill, phase="prefill", symbol="diamond", trace=trace, axes=axes))

    batch = np.concatenate([numbers(decode, "batch_size").to_numpy(), numbers(prefill, "batch_size").to_numpy()])
    exponents = np.log2(batch[batch > 0]) if (batch > 0).any() else np.zeros(1)
    low, high = math.floor(exponents.min()), math.ceil(exponents.max())
    high = max(high, low + 1)  # a scale needs two ends
    ticks = list(range(low, high + 1))
    colour_axes = {
        axis: dict(
            colorscale=families[dtype],
            cmin=low,
            cmax=high,
            colorbar=dict(
                title_text="batch" if len(axes) == 1 else f"batch, {dtype}",
                tickvals=ticks,
                ticktext=[str(2**k) for k in ticks],
                x=1.02 + 0.12 * i,  # side by side, one per dtype
            ),
        )
        for i, (dtype, axis) in enumerate(axes.items())
    }
    fig.update_layout(
        title_text=title,
        xaxis=dict(type="log", title_text=x_title),
        yaxis=dict(type="log", title_text=y_title),
        legend=dict(orientation="h", yanchor="top", y=-0.15),
        **colour_axes,
    )
    return fig
