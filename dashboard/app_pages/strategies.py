"""Cache strategies: every strategy and storage format side by side (memory, speed, accuracy), and their Pareto
front."""

import streamlit as st

from dashboard.charts.common import MissingColumns
from dashboard.charts.strategies import strategy_pareto, strategy_table
from dashboard.sidebar import page_rows, plot

st.title("Cache strategies")
rows = page_rows()

try:
    st.dataframe(strategy_table(rows), hide_index=True)
except MissingColumns as exc:
    st.warning(f"strategy table: {exc}")
plot("strategy Pareto front", strategy_pareto, rows)
st.caption("Every strategy against every format on one workload: `python -m experiments.decode experiment=strategies`")
