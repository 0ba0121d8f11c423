"""Compare: did sweep B make each point faster or slower than sweep A? The verdicts of `kvbench-results compare`
(harness/store/compare.py), over the rows the sidebar selected."""

import pandas as pd
import streamlit as st

from dashboard.charts.compare import ratio_chart, styled_verdicts, verdict_table
from dashboard.sidebar import page_rows, plot
from harness.store import compare, pairing
from harness.store.disk import MEASUREMENT_KEY

st.title("Compare")
st.caption(
    "Points of two sweeps paired by their workload key; B/A with a bootstrap interval from the repeats. "
    "SAME: the ratio lies within 1 ± t; SLOW or FAST: its whole interval lies beyond; AMBIGUOUS: past the band, "
    "its interval reaching back into it, or a side flagged host_busy or not converged (unless its rows are trusted). "
    "t is the larger of the threshold and twice the noisier side's relative standard error."
)
rows = page_rows()
sweeps = sorted(rows["sweep_id"].dropna().astype(str).unique())
if len(sweeps) < 2:
    st.info(
        f"Compare needs two sweeps among the selected rows; they hold {len(sweeps)}. Select more sweeps in the "
        "sidebar, or compare two folders with `kvbench-results compare A B`."
    )
    st.stop()

sizes = rows["sweep_id"].astype(str).value_counts()
# Open on the two sweeps that share the most points (else the two latest), so that the page starts with verdicts.
default_a, default_b = pairing.best_pair(rows) or (sweeps[-2], sweeps[-1])
left, right, metric_column, threshold_column = st.columns(4)
a_sweep = left.selectbox(
    "A (baseline) sweep", sweeps, index=sweeps.index(default_a), format_func=lambda s: f"{s} ({sizes[s]} rows)"
)
b_sweep = right.selectbox(
    "B sweep", sweeps, index=sweeps.index(default_b), format_func=lambda s: f"{s} ({sizes[s]} rows)"
)
metric = metric_column.selectbox("metric", list(compare.METRICS))
threshold_pct = threshold_column.number_input(
    "threshold (%)", min_value=0.0, max_value=100.0, value=100 * compare.DEFAULT_THRESHOLD, step=0.5
)
trust_noisy = st.checkbox(
    "trust noisy rows",
    value=False,
    help="Give a pair with a host_busy or not converged side its plain verdict; by default it is AMBIGUOUS, and "
    "its reason says which side. `kvbench-results compare --trust-noisy` does the same.",
)


@st.cache_data(show_spinner="Bootstrapping the ratios…")
def verdicts(
    measurements: tuple,
    _a_rows: pd.DataFrame,
    _b_rows: pd.DataFrame,
    metric: str,
    threshold: float,
    trust_noisy: bool,
) -> compare.Comparison:
    """compare.compare, cached on the measurements compared (~10 ms a pair: four seeded bootstraps of 2000
    resamples), so that a rerun for another widget is free. Keyed on `measurements`, not on the rows: their list
    columns defeat Streamlit's DataFrame hash."""
    return compare.compare(_a_rows, _b_rows, metric=metric, threshold=threshold, trust_noisy=trust_noisy)


def measurement_keys(part: pd.DataFrame) -> tuple:
    return tuple(part[list(MEASUREMENT_KEY)].astype(str).itertuples(index=False, name=None))


a_rows, b_rows = (rows[rows["sweep_id"].astype(str) == sweep] for sweep in (a_sweep, b_sweep))
result = verdicts(
    (measurement_keys(a_rows), measurement_keys(b_rows)), a_rows, b_rows, metric, threshold_pct / 100, trust_noisy
)
st.markdown(compare.summary_line(result, a_name=f"`{a_sweep}`", b_name=f"`{b_sweep}`"))
if result.verdicts.empty:
    st.info(
        "Nothing to pair: no ok row of sweep A has the workload key (model, formats, strategy, lengths) of an ok "
        "row of sweep B."
    )
else:
    st.dataframe(styled_verdicts(verdict_table(result)), hide_index=True)
    plot("ratio B/A", ratio_chart, result)
for side, unpaired in (("A", result.only_a), ("B", result.only_b)):
    if len(unpaired):
        st.caption(f"Only in {side}: " + "; ".join(unpaired["workload"]))
for note in result.notes:
    st.caption(note)
