"""What every chart shares: its contract with the rows, the reading of their columns, labels, hovers, colours.

Every chart (dashboard/charts/<page>.py) is a pure function from result rows (harness.store.disk.load) to a plotly
figure, in the column contract of harness.store.schema.COLUMNS (strategy_table: a DataFrame; crossover_caption: a
string). Nothing here imports Streamlit, nor torch at import time, so each chart is unit-tested on synthetic frames;
a chart that asks a strategy's declaration (strategy_layouts, strategy_servings) imports harness.kv, and with it
torch, only then, and only for the rows it draws.

Rows come from many schema versions and many outcomes, so every chart:
  - raises MissingColumns, before any work, when a column it cannot do without is absent or entirely null;
  - plots only status == "ok" rows (memory_ledger: ok and oom), and with none left returns a figure that says
    "no ok rows" instead of failing;
  - reads numbers through `numbers()`, so nullable Int64/boolean columns and None cells become float NaN;
  - never aggregates across workloads: a view that compares strategies or formats groups by workload_keys
    (WORKLOAD_COLUMNS, a null a value of its own) or labels what varies (labels, workload_label), and takes ratios
    against is_baseline in the same workload;
  - marks rows not to trust (row_marks: converged False, host_busy True; a null, "not recorded", never).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from harness.formats import EXACT_REFERENCE
from harness.store.schema import KV_COLUMNS, POINT_KEY_COLUMNS, WORKLOAD_COLUMNS

if TYPE_CHECKING:
    from harness.kv import Layout, Serving

SCATTERGL_MIN_POINTS = 5000  # above this an SVG scatter makes the browser crawl; WebGL draws 100k points smoothly
LOG2_DTICK = math.log10(2)  # a log axis with this dtick ticks at 1, 2, 4, 8, ...
PALETTE = qualitative.Plotly
NO_OK_ROWS = "no ok rows"
LABEL_FORMATS = {
    "batch_size": "batch {}",
    "prompt_len": "prompt {}",
    "gen_len": "gen {}",
    "max_memory_gb": "{} GiB",
    # the rest of the workload key and the KV options: a bare "none" or "16" would not say what it is
    "prefix_len": "prefix {}",
    "lengths": "{} lengths",
    "weights": "weights {}",
    "compile": "compile {}",
    "runner": "runner {}",
    "loop": "loop {}",
    "block_size": "block {}",
    "pool_tokens": "pool {}",
    "window": "window {}",
    "sinks": "sinks {}",
    "policy": "{} policy",
    "budget": "budget {}",
    "obs_window": "obs window {}",
    "host_gb": "host tier {} GB",
    "disk_dir": "disk tier {}",
    "disk_gb": "disk tier {} GB",
    "kv_group_size": "group {}",
    "kv_residual": "residual {}",
}
# The marks a row earns when its figures may not be trusted (issue #14): the column, the value that marks, the word.
# A null is "not recorded" (rows that predate the column): never marked.
MARKS = (("converged", False, "not converged"), ("host_busy", True, "host busy"))


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


def _strategies(cache: pd.Series) -> list[str]:
    """The distinct names in a cache column that name a strategy here; an old row's strategy, or a plug-in's not
    registered in this process, has no declaration to ask. harness.kv imports torch (seconds at start-up), so it is
    imported here, when a chart asks, and not at all for no rows."""
    names = set(cache.dropna().astype(str))
    if not names:
        return []
    from harness import kv

    return sorted(names & set(kv.strategy_names()))


def strategy_layouts(cache: pd.Series) -> dict[str, Layout]:
    """Each strategy named in a cache column -> its Layout at its default options (harness.kv.layout): what it
    declares of itself (lossy_family, lossy_curve), never a figure that depends on its options."""
    from harness import kv

    return {name: kv.layout(name, {}) for name in _strategies(cache)}


def strategy_servings(cache: pd.Series) -> dict[str, Serving]:
    """Each strategy named in a cache column -> its Serving declaration (harness.kv.serving: shares_prefix, ...)."""
    from harness import kv

    return {name: kv.serving(name) for name in _strategies(cache)}


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
    text ones as words, then the quantities, e.g. "small bf16 contiguous, prompt 512". A KV option (block_size,
    window, ...) is named only where the row has one: its null means the strategy has no such option.

    Each distinct combination of the keys is labelled once and mapped back (100k rows hold a few hundred)."""
    present = [key for key in dict.fromkeys(keys) if key in rows.columns]
    # the distinct combinations hold the same values, so the same keys vary among them as among all the rows
    return per_distinct(rows, present, lambda part: _labels(part, keys, always=always)).astype(str)


def _labels(rows: pd.DataFrame, keys: tuple[str, ...], *, always: tuple[str, ...]) -> pd.Series:
    words, quantities = [], []
    for key in keys:
        if key not in rows.columns or (key not in always and rows[key].nunique(dropna=False) <= 1):
            continue
        text = texts(rows, key)
        if key in LABEL_FORMATS:
            prefix, suffix = LABEL_FORMATS[key].split("{}")
            part = prefix + text + suffix
            quantities.append(part.where(rows[key].notna(), "") if key in KV_COLUMNS[2:] else part)
        else:
            words.append(text)
    label = pd.Series("", index=rows.index, dtype=object)
    for i, part in enumerate(words):
        label = part if i == 0 else label + " " + part
    for part in quantities:
        joined = label.where(label == "", label + ", ") + part
        label = joined.where(part != "", label)
    return label.astype(str)


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


# ------------------------------------------------------------------------------------- like with like (workloads)


KEY_SEPARATOR = "\x1f"  # the unit separator: no display text holds it


def per_distinct(rows: pd.DataFrame, columns: list[str], build) -> pd.Series:
    """build(part) -> a Series per row of `part`, computed on one row per distinct combination of `columns` (nulls a
    value of their own) and mapped back to every row: 100k rows hold a few hundred combinations, and build's
    texts() and string joins then cost hundredths of a second instead of a second."""
    if rows.empty or not columns:
        return build(rows)
    codes = rows.groupby(columns, dropna=False, sort=False).ngroup()
    distinct = rows.loc[codes.drop_duplicates().index, columns]
    by_code = pd.Series(build(distinct).to_numpy(), index=codes.loc[distinct.index].to_numpy())
    return pd.Series(by_code.reindex(codes.to_numpy()).to_numpy(), index=rows.index, dtype=object)


def _keys(rows: pd.DataFrame, columns: tuple[str, ...]) -> pd.Series:
    """One string per row joining `columns` as display text (texts: a null is "-"), absent columns left out.
    Strings compare across frames (a table against the rows behind it)."""
    present = [column for column in columns if column in rows.columns]

    def join(part: pd.DataFrame) -> pd.Series:
        key = pd.Series("", index=part.index, dtype=object)
        for column in present:
            key = key + KEY_SEPARATOR + texts(part, column).astype(object)
        return key

    return per_distinct(rows, present, join)


def workload_keys(rows: pd.DataFrame) -> pd.Series:
    """A key per row: its WORKLOAD_COLUMNS as display text, a null as "-" (a value of its own, so rows that predate
    a column form their own workloads). Rows with equal keys compare strategies and formats like with like."""
    return _keys(rows, WORKLOAD_COLUMNS)


def treatment_keys(rows: pd.DataFrame) -> pd.Series:
    """A key per row: how it kept its KV (KV_COLUMNS as display text, nulls as "-")."""
    return _keys(rows, KV_COLUMNS)


def point_keys(rows: pd.DataFrame) -> pd.Series:
    """A key per row: the whole point key (POINT_KEY_COLUMNS: the workload and the KV treatment), nulls as "-"."""
    return _keys(rows, POINT_KEY_COLUMNS)


def workload_label(rows: pd.DataFrame) -> pd.Series:
    """A label per row naming the workload fields that vary among `rows`, e.g. "fp32, batch 2, prompt 160"; "all
    rows" when they are one workload."""
    return labels(rows, WORKLOAD_COLUMNS).replace("", "all rows")


def treatment_label(rows: pd.DataFrame) -> pd.Series:
    """A label per row for its KV treatment: cache and kv_dtype, then each option it has, e.g. "paged int4, block
    16, group 64, residual 0"."""

    def label(part: pd.DataFrame) -> pd.Series:
        text = texts(part, "cache") + " " + texts(part, "kv_dtype")
        for column in KV_COLUMNS[2:]:
            if column in part.columns:
                prefix, suffix = LABEL_FORMATS[column].split("{}")
                text = text + (", " + prefix + texts(part, column) + suffix).where(part[column].notna(), "")
        return text

    return per_distinct(rows, [column for column in KV_COLUMNS if column in rows.columns], label).astype(str)


def workload_groups(rows: pd.DataFrame) -> list[pd.DataFrame]:
    """`rows` split by workload (workload_keys), the one with the most KV treatments first (then the most rows):
    the parts a view may aggregate within, never across."""
    if rows.empty:
        return []
    keys, treatments = workload_keys(rows), treatment_keys(rows)
    groups = []
    for _, positions in keys.groupby(keys, sort=True).indices.items():
        part = rows.iloc[positions]
        groups.append((-treatments.iloc[positions].nunique(), -len(part), part))
    return [part for *_, part in sorted(groups, key=lambda group: group[:2])]


def is_baseline(rows: pd.DataFrame) -> pd.Series:
    """True where a row is its workload's baseline: the exact strategy with K/V stored at the compute dtype."""
    return (texts(rows, "cache") == EXACT_REFERENCE) & (texts(rows, "kv_dtype") == texts(rows, "dtype"))


def row_marks(rows: pd.DataFrame) -> pd.Series:
    """Per row, why its figures may not be trusted ("not converged, host busy"), "" when nothing says so."""
    marks = pd.Series("", index=rows.index, dtype=object)
    for column, value, word in MARKS:
        if column not in rows.columns:
            continue
        values = rows[column]
        hit = (values.notna() & (values.astype(object) == value)).to_numpy(dtype=bool)  # a null never marks
        marks = marks.where(~hit, marks.where(marks == "", marks + ", ") + word)
    return marks.astype(str)


def marks_warning(rows: pd.DataFrame) -> str | None:
    """One line counting the ok rows that carry a mark (row_marks), or None when none does."""
    marks = row_marks(ok_rows(rows, [column for column, _, _ in MARKS]))
    counts = {word: int(marks.str.contains(word, regex=False).sum()) for _, _, word in MARKS}
    counts = {word: count for word, count in counts.items() if count}
    if not counts:
        return None
    said = " and ".join(f"{count} {word}" for word, count in counts.items())
    return f"{said} (of {len(marks)} ok rows): their figures are marked; rerun them on a quiet host to trust them."
