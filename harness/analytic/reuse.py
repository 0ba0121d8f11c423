"""When fetching a stored prefix beats computing it: measured from a sweep's rows, and analytic from the ceilings.

A prefix of n tokens costs, loaded from the disk tier, n x (its bytes per token) / (the disk's read GB/s); computed,
its prefill FLOPs / the peak TFLOP/s by the roofline's prefill model (harness.analytic.roofline.prefill_cost; the weights are
read by the suffix's prefill either way, so they cost the prefix nothing). Loading grows linearly in n; a prefill's attention grows with n^2, so above some
context loading wins: that context is the crossover. The analytic one uses the ceilings stored for this device
(the `tiers` experiment's disk read, harness/movement/tier_bandwidth.py; the matmul and read peaks). The measured one is where
a sweep's ttft_disk_ms drops under its ttft_miss_ms, interpolated linearly between the two points either side.

Both are figures of this device: a faster disk or a slower GPU moves them. Labelled as what they are: `measured`
from TTFTs, `analytic` from ceilings.
"""

from __future__ import annotations

import math

import pandas as pd

from harness.analytic.roofline import prefill_cost
from harness.device import ceilings as ceilings_module
from harness.kv.shape import KVShape
from harness.modeling.model_args import ModelArgs

# The rows of one workload: the crossover is searched along the prefix length with everything else fixed.
WORKLOAD = ("model", "weights", "device", "dtype", "kv_dtype", "batch_size", "gen_len", "block_size", "disk_dir")
MAX_CONTEXT = 2**22  # tokens: the analytic search stops here (beyond every model's context)


def predicted_compute_ms(args: ModelArgs, *, n_tokens: int, dtype: str, kv_dtype: str, peak_tflops: float) -> float:
    """Analytic: what computing an n_tokens prefix adds to a prefill, at the device's matmul peak, in ms.

    Its FLOPs alone: the prefix's tokens ride in the prefill of the request's suffix, which reads the weights
    anyway, so the weights' bytes are no cost of the prefix (else a one-token "prefix" would cost a whole weight
    read, and loading would always win below some length). The FLOPs are the difference between prefilling one
    token after the prefix computed and after it cached (harness.analytic.roofline.prefill_cost): its tokens' matmuls and
    the attention over them, never the LM head."""
    shape = KVShape(model=args, dtype=dtype, kv_dtype=kv_dtype, batch_size=1, prompt_len=n_tokens + 1)
    flops = prefill_cost(shape).flops - prefill_cost(shape, prefix_cached=n_tokens).flops
    return flops / (peak_tflops * 1e12) * 1e3


def predicted_columns(
    args: ModelArgs,
    *,
    n_tokens: int,
    prefix_bytes: int | None,
    dtype: str,
    kv_dtype: str,
    peaks: dict,
    disk_read_gbps: float | None,
) -> dict:
    """predicted_prefix_load_ms and predicted_prefix_compute_ms of a row (None where a ceiling is missing)."""
    columns = {"predicted_prefix_load_ms": None, "predicted_prefix_compute_ms": None}
    if n_tokens <= 0:
        return columns
    if prefix_bytes and disk_read_gbps:
        columns["predicted_prefix_load_ms"] = prefix_bytes / (disk_read_gbps * 1e9) * 1e3
    if peaks.get("peak_tflops"):
        columns["predicted_prefix_compute_ms"] = predicted_compute_ms(
            args, n_tokens=n_tokens, dtype=dtype, kv_dtype=kv_dtype, peak_tflops=peaks["peak_tflops"]
        )
    return columns


def analytic_crossover(
    args: ModelArgs,
    *,
    bytes_per_token: float,
    dtype: str,
    kv_dtype: str,
    peak_tflops: float,
    disk_read_gbps: float,
) -> int | None:
    """The smallest context (tokens) at which loading from disk takes less time than computing, by the models
    above: 1 if loading always wins, None if it never does below MAX_CONTEXT. Bisection: compute minus load is
    increasing in n (its attention term is quadratic, the rest linear)."""

    def load_wins(n: int) -> bool:
        load_ms = n * bytes_per_token / (disk_read_gbps * 1e9) * 1e3
        compute_ms = predicted_compute_ms(args, n_tokens=n, dtype=dtype, kv_dtype=kv_dtype, peak_tflops=peak_tflops)
        return load_ms < compute_ms

    if load_wins(1):
        return 1
    if not load_wins(MAX_CONTEXT):
        return None
    low, high = 1, MAX_CONTEXT  # load_wins(low) is False, load_wins(high) True
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if load_wins(middle) else (middle, high)
    return high


def measured_crossover(rows: pd.DataFrame) -> tuple[float | None, str]:
    """rows of one workload (ttft_disk_ms, ttft_miss_ms, prefix_len) -> (the interpolated context where the disk
    load becomes faster than recomputing, or None; a note: "measured", "below N" (it always won), "above N")."""
    rows = rows.dropna(subset=["ttft_disk_ms", "ttft_miss_ms"]).sort_values("prefix_len")
    if rows.empty:
        return None, "not measured"
    gain = (rows["ttft_miss_ms"] - rows["ttft_disk_ms"]).to_numpy()  # > 0: loading won
    contexts = rows["prefix_len"].to_numpy(dtype=float)
    if gain[0] > 0:
        return None, f"loading won at every measured context (from {contexts[0]:.0f})"
    for i in range(1, len(gain)):
        if gain[i] > 0 >= gain[i - 1]:
            fraction = -gain[i - 1] / (gain[i] - gain[i - 1])
            return contexts[i - 1] + fraction * (contexts[i] - contexts[i - 1]), "measured"
    return None, f"recompute won at every measured context (up to {contexts[-1]:.0f})"


def crossover_table(table: pd.DataFrame, *, ceilings=None) -> pd.DataFrame:
    """Per workload of a sweep with a disk tier: the measured crossover beside the analytic one."""
    rows = table[(table["status"] == "ok") & table.get("ttft_disk_ms", pd.Series(dtype=float)).notna()]
    if rows.empty:
        return pd.DataFrame()
    lines = []
    for _, group in rows.groupby([c for c in WORKLOAD if c in rows.columns], dropna=False):
        for part in _one_line_each(group):
            lines.append(_crossover_line(part, ceilings))
    return pd.DataFrame(lines)


def _one_line_each(group: pd.DataFrame) -> list[pd.DataFrame]:
    """A sweep holds the prompt fixed (the prefix grows into it) or the tokens after the prefix (the prompt grows
    with it): either is one curve. Rows that vary in both are split by the tokens after the prefix."""
    suffix = group["prompt_len"] - group["prefix_len"]
    if group["prompt_len"].nunique() > 1 and suffix.nunique() > 1:
        return [part for _, part in group.groupby(suffix)]
    return [group]


def _crossover_line(group: pd.DataFrame, ceilings) -> dict:
    """One row of crossover_table: the measured crossover of these rows beside the analytic one."""
    measured, note = measured_crossover(group)
    first = group.iloc[0]
    analytic = _analytic_for(first, group, ceilings)
    return {
        "model": first["model"],
        "kv_dtype": first["kv_dtype"],
        "batch": int(first["batch_size"]),
        "contexts": f"{group['prefix_len'].min():.0f}-{group['prefix_len'].max():.0f}",
        "measured crossover (tokens)": round(measured) if measured is not None else note,
        "analytic crossover (tokens)": analytic,
    }


def _analytic_for(first: pd.Series, group: pd.DataFrame, ceilings) -> int | str:
    disk = ceilings_module.tier_gbps(ceilings, "disk_read") if ceilings is not None else None
    if disk is None:
        return "no stored disk GB/s (python -m experiments.tiers)"
    peak_tflops = first.get("peak_tflops")
    if not peak_tflops or math.isnan(peak_tflops):
        return "no stored ceilings"
    sized = group.dropna(subset=["prefix_bytes_stored", "block_size"])
    stored_tokens = sized["prefix_len"] // sized["block_size"] * sized["block_size"]  # whole blocks are stored
    sized, stored_tokens = sized[stored_tokens > 0], stored_tokens[stored_tokens > 0]
    if sized.empty:
        return "no prefix bytes"
    bytes_per_token = float((sized["prefix_bytes_stored"] / stored_tokens).median())
    try:
        args = ModelArgs.from_name(first["model"])
    except ValueError:
        return f"model {first['model']} is not a preset"
    crossing = analytic_crossover(
        args,
        bytes_per_token=bytes_per_token,
        dtype=first["dtype"],
        kv_dtype=first["kv_dtype"],
        peak_tflops=peak_tflops,
        disk_read_gbps=disk,
    )
    return crossing if crossing is not None else f"never below {MAX_CONTEXT}"
