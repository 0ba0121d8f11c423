"""Roofline & crossover: where each decode step sits against this device's measured ceilings, and the batch at
which decode stops being memory-bound (the observed knee beside the predicted B*)."""

import streamlit as st

from dashboard.charts.common import MissingColumns, marks_warning, ok_rows
from dashboard.charts.crossover import batch_sweep, crossover_caption
from dashboard.charts.roofline import roofline
from dashboard.sidebar import page_rows, plot
from harness.analytic import crossover

st.title("Roofline & crossover")
rows = page_rows()

stale = ok_rows(rows, ["ceilings_stale"])
n_stale = int(stale["ceilings_stale"].eq(True).sum()) if "ceilings_stale" in stale.columns else 0  # null: unknown
if n_stale:
    st.warning(
        f"{n_stale} ok row(s) beat their ceilings (bw_util or flops_util over 1): the ceilings are stale. "
        "Re-measure them with `kvbench-ceilings --force`."
    )
if warning := marks_warning(rows):
    st.warning(warning)
plot("roofline", roofline, rows)
st.caption(
    "One colour family per compute dtype (its batch colorbar beside), its roofs in the family's dark colour; open "
    "markers: rows that did not converge or ran on a busy host."
)

st.subheader("Batch sweep")
metrics = st.segmented_control(
    "metric",
    ["decode_tok_s", "tpot_ms"],
    selection_mode="multi",
    default=["decode_tok_s", "tpot_ms"],
    help="decode throughput grows with the batch while decode is memory-bound; TPOT rises once it is compute-bound",
)
for metric in metrics or []:
    plot(f"batch sweep ({metric})", batch_sweep, rows, metric=metric)
try:
    st.info(crossover_caption(rows))
except MissingColumns as exc:
    st.warning(f"crossover caption: {exc}")

st.subheader("Observed knee beside the predicted B*")
try:
    knees = crossover.knee_table(rows)
except KeyError as exc:  # an older schema without a column the knee needs
    st.warning(f"knee table: needs columns: {exc.args[0]}")
else:
    if knees.empty:
        st.info(
            "No batch sweep from batch 1 among the selected rows. One sweeps the batch on the CPU: "
            "`python -m experiments.decode experiment=crossover`"
        )
    else:
        # Every point key column but the batch tells sweeps apart; the ones that do not vary here are left out.
        named = ("model", "dtype", "kv_dtype", "cache", "prompt_len")
        constant = [c for c in crossover.GROUP if c not in named and knees[c].astype(str).nunique() <= 1]
        st.dataframe(knees.drop(columns=constant), hide_index=True)
        st.caption(
            f"knee_batch: the first batch whose TPOT is {crossover.KNEE_RISE:g}× its batch-1 value; "
            "critical_batch: B*, the analytic model's smallest batch that reaches the ridge (harness/analytic/crossover.py)."
        )
