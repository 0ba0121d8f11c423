"""Latency: time to first token and peak memory against the prompt, every decode step's latency, and TPOT's spread
over repeats."""

import streamlit as st

from dashboard.charts.common import marks_warning
from dashboard.charts.latency import itl_curves, peak_memory_vs_prompt, tpot_percentiles, ttft_vs_prompt
from dashboard.sidebar import page_rows, plot

st.title("Latency")
rows = page_rows()
if warning := marks_warning(rows):
    st.warning(warning)  # and each chart marks them: open markers, "(not converged)" in the names

plot("TTFT vs prompt length", ttft_vs_prompt, rows)
plot("peak memory vs prompt length", peak_memory_vs_prompt, rows)
max_lines = st.slider("inter-token latency: most curves shown", min_value=1, max_value=50, value=12)
plot("inter-token latency", itl_curves, rows, max_lines=max_lines)
plot("TPOT percentiles", tpot_percentiles, rows)
