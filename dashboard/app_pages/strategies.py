"""Cache strategies: every strategy and storage format side by side (memory, speed, accuracy), and their Pareto
front, within one workload at a time: rows of different workloads (WORKLOAD_COLUMNS) are never combined."""

import streamlit as st

from dashboard.charts.accuracy import dummy_weights, kl_against_compression, ppl_delta_against_compression
from dashboard.charts.common import MARKS, MissingColumns, marks_warning, numbers, ok_rows, workload_label
from dashboard.charts.strategies import PARETO_COLUMNS, strategy_pareto, strategy_table
from dashboard.sidebar import page_rows, plot
from harness.formats import EXACT_REFERENCE
from harness.store.schema import WORKLOAD_COLUMNS

WORKLOAD_KEY = "strategies_workload"  # the selectbox's key: a test can read or set the workload shown

st.title("Cache strategies")
rows = page_rows()

try:
    # Every workload's lines, the one with the most treatments first; the bootstrap intervals only for the one shown.
    table = strategy_table(rows, intervals=False)
except MissingColumns as exc:
    st.warning(f"strategy table: {exc}")
    st.stop()
options = list(dict.fromkeys(table["workload"]))
choice = options[0] if options else None
if len(options) > 1:
    st.warning(
        f"The selected rows hold {len(options)} different workloads (model, dtype, batch, prompt, ...): strategies "
        "compare only within one. Choose it below, or narrow the filters in the sidebar."
    )
    choice = st.selectbox("workload", options, index=0, key=WORKLOAD_KEY)
# The chosen workload's rows, narrowed to what the chart and the marks read; labelled as strategy_table does.
ok = ok_rows(rows, [*PARETO_COLUMNS, *WORKLOAD_COLUMNS, *(column for column, _, _ in MARKS)])
chosen = ok[(workload_label(ok) == choice).to_numpy()] if len(options) > 1 else ok
if warning := marks_warning(chosen):
    st.warning(warning)

shown = rows[(workload_label(rows) == choice).to_numpy()] if len(options) > 1 else rows
shown_table = strategy_table(shown)
if len(options) > 1:
    shown_table["workload"] = choice  # labelled among every workload, as the choice was, not within its own rows
st.dataframe(shown_table, hide_index=True)
st.caption(
    f"One line per KV treatment (cache, kv_dtype, options); several rows of one treatment (repeats from different "
    f"sweeps) are combined by their median, n_points says how many, and the TPOT ratio's 95% interval resamples "
    f"those rows' TPOTs (a single row's: its repeats). "
    f"Ratios are against this workload's {EXACT_REFERENCE} at kv_dtype = dtype. marks: rows that did not converge "
    "or ran on a busy host."
)
plot("strategy Pareto front", strategy_pareto, chosen)
st.caption("Every strategy against every format on one workload: `python -m experiments.decode experiment=strategies`")
plot("accuracy against compression", kl_against_compression, shown)
st.caption(
    "The lossy rows only: KL of the lossy cache's next-token distribution from the exact cache's, against how many "
    "times less KV it allocates, per model: a checkpoint's curves (solid) apart from dummy weights' (dotted), whose KL "
    "bounds the format's rounding, not a model's loss. Eviction budgets: `python -m experiments.decode "
    "experiment=eviction`; on a real model, add `model=smollm2-135m`"
)
if (numbers(shown, "ppl_delta").notna() & ~dummy_weights(shown)).any():  # perplexity: real checkpoints' rows only
    plot("perplexity against compression", ppl_delta_against_compression, shown)
    st.caption(
        "The lossy rows of a real checkpoint: perplexity through the lossy cache minus the exact cache's, on the same "
        "text (ppl_source: the prompts' own continuation, or eval_text), against the compression ratio."
    )
