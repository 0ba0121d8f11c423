"""Memory ledger: where each point's memory went against the device's capacity, the measured OOM frontier beside
the planner's, and the KV bytes of the analytic formula and of the planner beside those the cache really held."""

import psutil
import streamlit as st

from dashboard import data
from dashboard.charts.common import workload_label
from dashboard.charts.memory import PLANNER_COLUMN, frontier, memory_ledger
from dashboard.sidebar import current, page_rows, plot

GiB = 2**30

st.title("Memory ledger")
rows = page_rows()  # kv_bytes_planner: the planner's KV bytes, as the run wrote them into the row


def default_capacity_gib(rows) -> float | None:
    """The cap the rows ran under; else, for CPU rows, this machine's RAM; for CUDA rows nothing is known here."""
    caps = rows["max_memory_gb"].dropna()
    if len(caps):
        return float(caps.max())
    if (rows["device"] == "cuda").any():
        return None
    return round(psutil.virtual_memory().total / GiB, 2)


capacity_gib = st.number_input(
    "device memory (GiB)",
    min_value=0.0,
    value=default_capacity_gib(rows),
    step=1.0,
    placeholder="type the GPU's memory, e.g. 141",
    help="Drawn as the capacity line. Default: the rows' max_memory_gb cap; else this machine's RAM for CPU rows.",
)
plot(
    "memory ledger",
    memory_ledger,
    rows,
    capacity_bytes=capacity_gib * GiB if capacity_gib else None,
)

st.subheader("OOM frontier: measured beside the planner")
frontiers = data.load_frontiers(current().sources)
if frontiers.empty:
    st.info(
        "No capacity frontier tables found (`<results_dir>/capacity/frontier-*.parquet`). Measure one with "
        "`python -m experiments.capacity`"
    )
else:
    plot("OOM frontier", frontier, frontiers)

st.subheader("KV bytes: analytic formula, planner and measured")
columns = ["model", "cache", "kv_dtype", "batch_size", "prompt_len", "gen_len", "kv_bytes_predicted"]
columns += [PLANNER_COLUMN, "kv_bytes_allocated"]
ok = rows[(rows["status"] == "ok") & rows["kv_bytes_predicted"].notna()]
kv = ok[columns].assign(
    workload=workload_label(ok),  # the fields that vary among the rows: a row is read against its own workload
    predicted_mib=ok["kv_bytes_predicted"] / 2**20,
    planner_mib=ok[PLANNER_COLUMN] / 2**20,
    allocated_mib=ok["kv_bytes_allocated"] / 2**20,
    allocated_over_predicted=ok["kv_bytes_allocated"] / ok["kv_bytes_predicted"],
    allocated_over_planner=ok["kv_bytes_allocated"] / ok[PLANNER_COLUMN],
)
st.dataframe(kv, hide_index=True)
st.caption(
    "kv_bytes_predicted is the seed notes' analytic formula, 2 × layers × tokens × kv_heads × head_dim × bytes × "
    "batch (MLA: layers × tokens × (kv_lora_rank + qk_rope_head_dim) × bytes × batch, its one latent row): no "
    "scales, no block rounding, no prefix sharing. kv_bytes_planner is the planner's figure for the row's "
    "workload, as the run recorded it (harness.analytic: scales, whole blocks, a window, shared prefix blocks, int4's "
    "tail; `none` keeps nothing); it is empty where the planner refused the workload (mixed lengths), and not "
    "recorded in a row written before the column existed (scripts/backfill_kv_bytes_planner.py fills those in)."
)
