"""The strategies page's accuracy charts: what the lossy caches cost in accuracy (KL from the exact cache's next-token
distribution, the perplexity delta) for what they save in KV memory, one model at a time.

A real checkpoint's rows and dummy-weight rows are never on one curve: each model (model, weights, prompt_source)
has its own curves, in a legend group of its own, with its own workload (WORKLOAD_COLUMNS, which hold those three).
KL on dummy (random) weights bounds a format's rounding, not a model's loss, and says so; perplexity is drawn for
real checkpoints only (random weights have no language to lose).
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.charts.common import (
    colour,
    message_figure,
    numbers,
    ok_rows,
    require,
    strategy_layouts,
    texts,
    treatment_label,
    workload_groups,
    workload_label,
)
from harness.formats import DTYPE_BYTES
from harness.store.schema import KV_COLUMNS, WORKLOAD_COLUMNS

SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross")
DUMMY = "dummy"  # the weights column of a row on random weights (harness.config.RunConfig.weights)
DUMMY_NOTE = "dummy weights: bounds the format's rounding, not a model's loss"
PROMPT_SOURCES = {"random": "random prompts", "sharegpt": "ShareGPT prompts", "text": "text prompts"}
MODEL_KEYS = ("model", "weights", "prompt_source")  # what one model's curves share (all three in WORKLOAD_COLUMNS)
# What the charts read: the exact KV bytes (2 x layers x KV heads x head_dim x compute-dtype bytes per token, times
# the batch's tokens), what the row allocated, the accuracy, how the row kept its KV and whose model it ran.
COMPRESSION_COLUMNS = (
    "kl_mean",
    "ppl_delta",
    "ppl_source",
    "prompt_text",
    "kv_bytes_allocated",
    "n_layers",
    "n_kv_heads",
    "head_dim",
    "top1_agreement",
    *KV_COLUMNS,
)
X_TITLE = "KV compression ratio (exact KV bytes at the compute dtype / kv_bytes_allocated)"
KL_TITLE, KL_Y_TITLE = "Accuracy lost against KV memory saved", "KL(exact || lossy) per step, mean (nats)"
PPL_TITLE, PPL_Y_TITLE = "Perplexity lost against KV memory saved", "perplexity delta (lossy - exact cache's)"
NO_PPL = "no real-model rows with ppl_delta: perplexity needs a checkpoint (weights=<path>) and its text"


def compression_ratio(rows: pd.DataFrame) -> pd.Series:
    """Exact KV bytes at the compute dtype for the row's tokens (batch x (prompt + gen)) over kv_bytes_allocated:
    2 for fp8 beside bf16, budget-fold for an eviction budget (prompt + gen) / budget; NaN where a figure is null."""
    tokens = numbers(rows, "batch_size") * (numbers(rows, "prompt_len") + numbers(rows, "gen_len"))
    per_token = 2 * numbers(rows, "n_layers") * numbers(rows, "n_kv_heads") * numbers(rows, "head_dim")
    dtype_bytes = texts(rows, "dtype").map(DTYPE_BYTES).astype("float64")
    return tokens * per_token * dtype_bytes / numbers(rows, "kv_bytes_allocated")


def lossy_family(rows: pd.DataFrame) -> pd.Series:
    """A trace per way of losing accuracy: the strategy's own name for it (its Layout's lossy_family, formatted with
    the row's columns: "evict h2o", one per eviction policy; "sliding window"), else "quantized" (a layout that
    declares none, at a narrow kv_dtype); a narrow kv_dtype under a lossy family is named too."""
    cache, kv_dtype = texts(rows, "cache"), texts(rows, "kv_dtype")
    narrow = (" " + kv_dtype).where(kv_dtype != texts(rows, "dtype"), "")
    family = pd.Series("quantized " + kv_dtype, index=rows.index, dtype=object)
    for name, layout in strategy_layouts(cache).items():
        if layout.lossy_family is None:
            continue
        mine = (cache == name).to_numpy()
        fields = [field for _, field, _, _ in string.Formatter().parse(layout.lossy_family) if field]
        values = pd.DataFrame({field: texts(rows, field)[mine] for field in fields}, index=rows.index[mine])
        named = [layout.lossy_family.format_map(row) for row in values.to_dict("records")]
        family[mine] = [label + suffix for label, suffix in zip(named, narrow[mine], strict=True)]
    return family


def lossy_curve(rows: pd.DataFrame) -> pd.Series:
    """Whether the row's strategy declares its family one curve through an option (Layout.lossy_curve: evict's
    budgets), drawn joined; False for a strategy that declares nothing or is not known here."""
    cache = texts(rows, "cache")
    return cache.isin([name for name, layout in strategy_layouts(cache).items() if layout.lossy_curve])


def dummy_weights(rows: pd.DataFrame) -> pd.Series:
    """True where the row ran on random weights: weights "dummy", or not recorded (the harness's default)."""
    return texts(rows, "weights").isin([DUMMY, "-"])


def model_label(rows: pd.DataFrame) -> pd.Series:
    """Per row, whose model its accuracy is: "SmolLM2-135M-Instruct.Q4_1, ShareGPT prompts" for a checkpoint (its
    prompt source named; text: the file's name), "tiny, dummy weights" for random weights."""
    source = texts(rows, "prompt_source").replace("-", "random")  # a row before prompt_source: seeded ids
    prompts = source.map(PROMPT_SOURCES).fillna(source + " prompts")
    text_file = texts(rows, "prompt_text").map(lambda path: Path(path).name if path != "-" else "")
    prompts = prompts.where((source != "text") | (text_file == ""), "text prompts (" + text_file + ")")
    return (texts(rows, "model") + ", " + prompts.where(~dummy_weights(rows), "dummy weights")).astype(str)


def _models(ok: pd.DataFrame, keys: tuple[str, ...]) -> list[tuple[str, bool, pd.DataFrame, int]]:
    """Per model (keys), its label, whether it is dummy, the rows of its workload with the most treatments and how
    many workloads it had; the real checkpoints first, then by label. Two checkpoints of one name are told apart
    by their weights' path."""
    present = [key for key in keys if key in ok.columns]
    parts = [part for _, part in ok.groupby(present, dropna=False, sort=True)] if present else [ok]
    found = []
    for part in parts:
        groups = workload_groups(part)
        found.append([model_label(part).iloc[0], bool(dummy_weights(part).iloc[0]), groups[0], len(groups)])
    names = pd.Series([label for label, *_ in found])
    for entry, repeated in zip(found, names.duplicated(keep=False), strict=True):
        if repeated and not entry[1]:
            entry[0] += f" ({texts(entry[2], 'weights').iloc[0]})"
    return sorted((tuple(entry) for entry in found), key=lambda entry: (entry[1], entry[0]))


def _against_compression(
    rows: pd.DataFrame, *, metric: str, title: str, y_title: str, real_only: bool, empty: str
) -> go.Figure:
    """`metric` against the compression ratio per ok lossy row, one line per lossy family (its colour) within each
    model's workload (its legend group; dummy weights dotted, open markers), up and to the left worse."""
    require(rows, ["kv_bytes_allocated", "cache", "kv_dtype"])  # no metric anywhere: the empty figure
    ok = ok_rows(rows, [*COMPRESSION_COLUMNS, *WORKLOAD_COLUMNS])
    keep = numbers(ok, metric).notna() & compression_ratio(ok).notna()
    if real_only:
        keep &= ~dummy_weights(ok)
    ok = ok[keep.to_numpy()]
    if ok.empty:
        return message_figure(title=title, x_title=X_TITLE, y_title=y_title, message=empty)
    models = _models(ok, (*MODEL_KEYS, "ppl_source") if metric == "ppl_delta" else MODEL_KEYS)
    families = sorted(set(lossy_family(ok)))
    fig = go.Figure()
    for j, (label, dummy, chosen, n_workloads) in enumerate(models):
        group = label + (f" ({DUMMY_NOTE})" if dummy else "")
        if metric == "ppl_delta":
            group += f", ppl on {texts(chosen, 'ppl_source').iloc[0]}"
        points = pd.DataFrame(
            {
                "x": compression_ratio(chosen),
                "y": numbers(chosen, metric),
                "family": lossy_family(chosen),
                "curve": lossy_curve(chosen),
                "treatment": treatment_label(chosen),
                "top1": numbers(chosen, "top1_agreement"),
            }
        ).sort_values(["family", "x"], kind="stable")
        for k, (family, part) in enumerate(points.groupby("family", sort=True)):
            i = families.index(family)
            curve = bool(part["curve"].any())  # a curve through an option (evict's budgets), as the strategy declares
            symbol = ("circle" if curve else SYMBOLS[1 + i % 4]) + ("-open" if dummy else "")
            fig.add_trace(
                go.Scatter(
                    x=part["x"].to_numpy(np.float64),
                    y=part["y"].to_numpy(np.float64),
                    mode="lines+markers" if curve else "markers",  # a policy's budgets: a curve; others: points
                    name=family,
                    legendgroup=group,
                    legendgrouptitle_text=group if k == 0 else None,
                    line=dict(color=colour(i), dash="dot" if dummy else "solid"),
                    marker=dict(color=colour(i), size=10, symbol=symbol),
                    text=part["treatment"].to_numpy(),
                    customdata=part["top1"].to_numpy(np.float64),
                    hovertemplate=f"{label}<br>%{{text}}<br>compression %{{x:.3g}}x, {metric} %{{y:.3g}}, "
                    "top-1 %{customdata:.3g}<extra></extra>",
                )
            )
        if n_workloads > 1:  # the label only then: workload_label reads every row of the model
            rows_of_model = ok[(model_label(ok) == model_label(chosen).iloc[0]).to_numpy()]
            note = f"{label}: one workload of {n_workloads}: {workload_label(rows_of_model).loc[chosen.index[0]]}"
            fig.add_annotation(
                text=note, x=0, y=1 + 0.06 * j, xref="paper", yref="paper", xanchor="left", yanchor="bottom",
                showarrow=False,
            )  # fmt: skip
    real = [label for label, dummy, *_ in models if not dummy]
    named = ", ".join(real) if real else f"{', '.join(label for label, *_ in models)} ({DUMMY_NOTE})"
    fig.update_layout(title_text=f"{title}: {named}", xaxis_title_text=X_TITLE, yaxis_title_text=y_title)
    fig.update_layout(legend=dict(groupclick="toggleitem"))
    fig.update_xaxes(type="log")
    return fig


def kl_against_compression(rows: pd.DataFrame) -> go.Figure:
    """KL(exact || lossy) per step against the KV compression ratio, per ok lossy row: one line per eviction policy
    through its budgets, beside the sliding window and the quantized formats, for each model in the rows (a
    checkpoint's curves apart from dummy weights', which are dotted and say what they bound); the title names the
    real models, or the dummy one. A model with rows of several workloads: the one with the most treatments, named
    in a note."""
    return _against_compression(
        rows,
        metric="kl_mean",
        title=KL_TITLE,
        y_title=KL_Y_TITLE,
        real_only=False,
        empty="no ok lossy rows: nothing with accuracy columns",
    )


def ppl_delta_against_compression(rows: pd.DataFrame) -> go.Figure:
    """The perplexity delta (lossy minus the exact cache's, on the same text: ppl_source) against the compression
    ratio, for real checkpoints only, one model's curves apart from another's as kl_against_compression draws them."""
    return _against_compression(
        rows, metric="ppl_delta", title=PPL_TITLE, y_title=PPL_Y_TITLE, real_only=True, empty=NO_PPL
    )
