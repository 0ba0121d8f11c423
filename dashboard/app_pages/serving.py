"""Serving: the KV cache as a serving resource (issue #16). The runs found, the KV pool of one run against time,
latency CDFs, throughput and p99 TTFT against qps with the sustained knee (hollow: a rate not sustained, issue
#30), goodput, the planner's concurrency beside the measured one, and for chat sessions (dataset=sharegpt-multiturn)
TTFT and the prefix hit rate by turn.

Serving runs are not point rows: they live in <results folder>/serve/<run_id>/ (dashboard/serve_data.py), so this
page ignores the sidebar's row filters and reads the same folders.
"""

import streamlit as st

from dashboard import serve_data
from dashboard.charts.serving import (
    concurrency_check,
    default_ttft_slo_ms,
    goodput_vs_qps,
    kv_timeline,
    latency_cdf,
    qps_curves,
    run_labels,
)
from dashboard.charts.sessions import hit_rate_by_turn, session_runs, ttft_by_turn
from dashboard.sidebar import current, plot, skipped_item

NO_RUNS_HELP = (
    "No serving runs yet (they live in `<results folder>/serve/<run_id>/`). Make one with `make serve-quick`, or "
    "`python -m experiments.serve experiment=serve-quick`, then rerun this page."
)
MAX_CDF_RUNS = 12  # default curves per CDF: a qps sweep of 5 strategies × 8 rates would draw 40
TABLE_COLUMNS = [
    "run_id", "sweep_id", "engine", "strategy", "kv_dtype", "model", "device", "qps", serve_data.FINISHED,
    serve_data.STATUS, serve_data.STARTED_AT, serve_data.REQUESTS_WRITTEN, "completed", "duration_s",
    "request_throughput", "output_throughput", "request_goodput", "ttft_slo_ms", "p99_ttft_ms", "p99_tpot_ms",
    "window_offered_qps", "achieved_qps", "slo_attainment", "sustained", "not_sustained_reason",
    "max_running_requests", "predicted_max_running", "max_concurrent_requests", "total_preemptions",
    "peak_kv_utilization", "policy", "budget", "obs_window", "accuracy_kl_mean", "accuracy_top1_agreement",
    "accuracy_reference", serve_data.SOURCE,
]  # fmt: skip

st.title("Serving")
runs, skipped = serve_data.load_runs(current().sources)
if skipped:
    # A bad part leaves the rest of its run shown; a bad run.parquet (named by its folder) leaves the run out.
    st.warning(f"Skipped {len(skipped)} unreadable serving file(s):\n" + "\n".join(map(skipped_item, skipped)))
if runs.empty:
    st.info(NO_RUNS_HELP)
    st.stop()

runs = runs.assign(label=run_labels(runs))
labels = dict(zip(runs[serve_data.RUN_DIR], runs["label"], strict=True))
st.dataframe(runs[[column for column in TABLE_COLUMNS if column in runs.columns]], hide_index=True)
unfinished = runs[~runs[serve_data.FINISHED].astype(bool)]
if len(unfinished):
    named = (unfinished["run_id"] + " (" + unfinished[serve_data.STATUS].astype(str) + ")").tolist()
    st.caption(
        f"{len(unfinished)} unfinished run(s), with no run.parquet (running: still running, or killed; failed: its "
        f"manifest says why): {', '.join(named)}. Their finished requests are in the CDFs; they have no run figures."
    )

finished = runs[runs[serve_data.FINISHED].astype(bool)]
if finished.empty:
    in_sweep = finished
else:
    counts = finished["sweep_id"].value_counts()
    sweeps = sorted(counts.index)
    busiest = max(sweeps, key=lambda sweep: (counts[sweep], sweep))  # the most runs; the latest of equals
    sweep = st.selectbox("sweep", sweeps, index=sweeps.index(busiest), key="serving_sweep")
    in_sweep = finished[finished["sweep_id"] == sweep]

st.subheader("The KV pool against time")
# Default: the selected sweep's run that filled the pool most (the one where preemption and queueing show).
peaks = in_sweep.get("peak_kv_utilization")  # absent when no run finished
fullest = peaks.idxmax() if peaks is not None and peaks.notna().any() else None
run_dir = st.selectbox(
    "run",
    list(labels),
    index=0 if fullest is None else list(labels).index(in_sweep.loc[fullest, serve_data.RUN_DIR]),
    format_func=labels.get,
    key="serving_run",
)
num_blocks = runs.loc[runs[serve_data.RUN_DIR] == run_dir].get("num_blocks")  # absent: no run finished
plot(
    "KV blocks against time",
    kv_timeline,
    serve_data.load_iterations(run_dir),
    num_blocks=None if num_blocks is None or num_blocks.isna().all() else float(num_blocks.iloc[0]),
    run=labels[run_dir],
)

st.subheader("Latency CDFs")
default_runs = list((in_sweep if len(in_sweep) else runs)[serve_data.RUN_DIR])[:MAX_CDF_RUNS]
shown = st.multiselect("runs", list(labels), default=default_runs, format_func=labels.get, key="serving_cdf_runs")
shown_runs = runs[runs[serve_data.RUN_DIR].isin(shown)]
requests = serve_data.load_requests(shown)
for metric in ("ttft_ms", "tpot_ms", "e2el_ms"):
    plot(f"{metric} CDF", latency_cdf, shown_runs, requests, metric=metric)

if in_sweep.empty:
    st.info("No finished run (with a run.parquet) yet: the figures against qps and the planner check need one.")
    st.stop()

st.subheader("Saturation: throughput and p99 TTFT against qps")
slo_ms = st.number_input(
    "TTFT SLO (ms)",
    min_value=0.0,
    value=default_ttft_slo_ms(in_sweep),
    step=10.0,
    placeholder="no SLO recorded: type one, e.g. 200",
    help="Marks each line's knee: the highest qps whose p99 TTFT stays at or under it, every point up to it "
    "sustained (harness.serve.metrics.knee). Default: the runs' ttft_slo_ms.",
    key="serving_slo_ms",
)
plot("throughput and p99 TTFT against qps", qps_curves, in_sweep, slo_ms=slo_ms or None)
st.caption(
    "A run sustained its qps when, over its measured window (the arrivals with the first and last 10% of requests "
    "cut: warm-up and drain), it finished requests within 5% of the rate they arrived and at least slo_attainment "
    "(0.9) of them met every SLO it set (harness.serve.sustained; DistServe's attainment, vLLM's goodput rule). A "
    "finite stream lets a saturated server finish inside a loose SLO: such a point is hollow, its reason in the "
    "hover and the table's not_sustained_reason, and the knee stands on solid points only. A run recorded before "
    "the verdict has it recomputed from its request rows."
)
plot("goodput against qps", goodput_vs_qps, in_sweep)

st.subheader("The planner, checked")
plot("predicted and measured concurrency", concurrency_check, in_sweep)
st.caption(
    "predicted_max_running is the planner's figure (harness.serve.concurrency.predict_concurrency) for the run's KV "
    "budget and length mix with every request waiting at once (qps=inf); max_running_requests is measured, the "
    "most requests the run held running at one instant (queueing left out; max_concurrent_requests, in the table, "
    "counts queueing too, as vLLM's does, and is blank for a run recorded before it did). Below saturation fewer "
    "requests overlap, so a measured bar under the predicted one there is expected; at qps=inf the two should agree."
)

sessions = session_runs(finished)
if len(sessions):  # chat sessions only: every other run has no turns to draw
    st.subheader("Multi-turn sessions: TTFT and prefix hits by turn")
    session_dir = st.selectbox(
        "session run", list(sessions[serve_data.RUN_DIR]), format_func=labels.get, key="serving_session_run"
    )
    session = sessions[sessions[serve_data.RUN_DIR] == session_dir]
    session_requests = serve_data.load_requests([session_dir])
    plot("TTFT by turn", ttft_by_turn, session, session_requests)
    plot("prefix hit rate by turn", hit_rate_by_turn, session_requests, run=labels[session_dir])
    st.caption(
        "A session's turn n resends its n - 1 turns of history: a prefix cache serves that history instead of "
        "prefilling it again, so the hit rate climbs with the turn and TTFT stays near the first turn's. Hit tokens "
        "are stacked by where their KV came from (device, host, disk) where the run recorded it. "
        "`python -m experiments.serve model=smollm2-135m dataset=sharegpt-multiturn strategy=prefix`"
    )
