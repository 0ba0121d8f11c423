"""KV tiers & transfer (issue #18): each tier's GB/s against the block size beside the ceilings, TTFT by where a
prefix came from (device, host, disk, recompute) with the disk-beats-recompute context, and the prefill -> decode
KV transfer over measured transports beside extrapolated links.

The tier and transfer tables are not point rows (<results folder>/tiers/, /pd/; dashboard/data.py reads them), so
their sections ignore the sidebar's row filters; the TTFT section draws the filtered prefix-reuse rows.
"""

import streamlit as st

from dashboard import data
from dashboard.charts.common import MissingColumns
from dashboard.charts.tiers import (
    prefix_caption,
    prefix_reuse_rows,
    prefix_workloads,
    tier_bandwidth,
    tier_caption,
    tier_run_labels,
    ttft_by_prefix_source,
)
from dashboard.charts.transfer import pd_caption, pd_step_crossings, pd_transfer, pd_ttft, pd_workloads
from dashboard.sidebar import current, plot

NO_TIERS_HELP = (
    "No tier-bandwidth tables yet (`<results folder>/tiers/`). Measure them with `python -m experiments.tiers`."
)
NO_PREFIX_HELP = (
    "No prefix-reuse rows among the selected rows (cache=prefix with a prefix_len). Measure them with "
    "`python -m experiments.decode experiment=prefix-reuse`."
)
NO_PD_HELP = "No PD-transfer tables yet (`<results folder>/pd/`). Measure them with `python -m experiments.pd`."


def choose(label: str, names, *, key: str) -> str | None:
    """A selectbox over the distinct `names` (the most frequent first) when there are several; the one otherwise."""
    counts = names.value_counts().sort_index().sort_values(ascending=False, kind="stable")
    options = counts.index.tolist()
    return st.selectbox(label, options, key=key) if len(options) > 1 else (options[0] if options else None)


def caption(build, *args, **kwargs) -> None:
    try:
        st.caption(build(*args, **kwargs))
    except MissingColumns as exc:
        st.warning(f"caption: {exc}")


st.title("KV tiers & transfer")
selection = current()

st.subheader("Tier bandwidth")
tiers = data.load_tier_tables(selection.sources)
if tiers.empty:
    st.info(NO_TIERS_HELP)
else:
    runs = tier_run_labels(tiers)
    run = choose("tiers run", runs, key="tiers_run")
    one_run = tiers[(runs == run).to_numpy()]
    plot("tier bandwidth", tier_bandwidth, one_run)
    caption(tier_caption, one_run)

st.subheader("TTFT by where the prefix came from")
prefix_rows = prefix_reuse_rows(selection.rows)
if prefix_rows.empty:
    st.info(NO_PREFIX_HELP)
else:
    workload = choose("prefix workload", prefix_workloads(prefix_rows), key="tiers_prefix_workload")
    plot("TTFT by prefix source", ttft_by_prefix_source, prefix_rows, workload=workload)
    caption(prefix_caption, prefix_rows, workload=workload)

st.subheader("Prefill → decode transfer")
transfers = data.load_pd_tables(selection.sources)
if transfers.empty:
    st.info(NO_PD_HELP)
else:
    workload = choose("transfer workload (kv_dtype)", pd_workloads(transfers), key="tiers_pd_workload")
    plot("PD transfer", pd_transfer, transfers, workload=workload)
    plot("PD TTFT", pd_ttft, transfers, workload=workload)
    caption(pd_caption, transfers)
    try:
        st.dataframe(pd_step_crossings(transfers, workload=workload), hide_index=True)
    except KeyError as exc:  # a table without a column the crossing needs
        st.warning(f"transfer-over-step table: needs columns: {exc.args[0]}")
    st.caption("outlasts_step_from: the context above which sending the KV takes longer than one decode step.")
