"""Latency: time to first token against the prompt, every decode step's latency, and TPOT's spread over repeats."""

import streamlit as st

from dashboard import charts
from dashboard.sidebar import page_rows, plot

st.title("Latency")
rows = page_rows()

plot("TTFT vs prompt length", charts.ttft_vs_prompt, rows)
max_lines = st.slider("inter-token latency: most curves shown", min_value=1, max_value=50, value=12)
plot("inter-token latency", charts.itl_curves, rows, max_lines=max_lines)
plot("TPOT percentiles", charts.tpot_percentiles, rows)
