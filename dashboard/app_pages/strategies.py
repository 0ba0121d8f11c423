"""Cache strategies: every strategy and storage format side by side (memory, speed, accuracy), and their Pareto
front, within one workload at a time: rows of different workloads (WORKLOAD_COLUMNS) are never combined."""

import streamlit as st

from dashboard.charts.common import MissingColumns, marks_warning, ok_rows, workload_groups, workload_label
from dashboard.charts.strategies import strategy_pareto, strategy_table
from dashboard.sidebar import page_rows, plot
from harness.formats import EXACT_REFERENCE

WORKLOAD_KEY = "strategies_workload"  # the selectbox's key: a test can read or set the workload shown

st.title("Cache strategies")
rows = page_rows()

ok = ok_rows(rows)
groups = workload_groups(ok)  # the one with the most treatments first: the default
names = workload_label(ok)  # strategy_table labels each line's workload the same way
choice = None
if len(groups) > 1:
    options = [names.loc[group.index[0]] for group in groups]
    st.warning(
        f"The selected rows hold {len(groups)} different workloads (model, dtype, batch, prompt, ...): strategies "
        "compare only within one. Choose it below, or narrow the filters in the sidebar."
    )
    choice = st.selectbox("workload", options, index=0, key=WORKLOAD_KEY)
    chosen = groups[options.index(choice)]
else:
    chosen = ok
if warning := marks_warning(chosen):
    st.warning(warning)

try:
    table = strategy_table(rows)
except MissingColumns as exc:
    st.warning(f"strategy table: {exc}")
else:
    st.dataframe(table if choice is None else table[table["workload"] == choice], hide_index=True)
    st.caption(
        f"One line per KV treatment (cache, kv_dtype, options); several rows of one treatment (repeats from different "
        f"sweeps) are combined by their median, n_points says how many. Ratios are against this workload's "
        f"{EXACT_REFERENCE} at kv_dtype = dtype. marks: rows that did not converge or ran on a busy host."
    )
plot("strategy Pareto front", strategy_pareto, chosen)
st.caption("Every strategy against every format on one workload: `python -m experiments.decode experiment=strategies`")
