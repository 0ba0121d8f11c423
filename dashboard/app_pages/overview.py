"""Overview: the sweeps found, the headline figures, and every filtered row (sortable, downloadable)."""

import pandas as pd
import streamlit as st

from dashboard import data
from dashboard.charts.common import marks_warning, row_marks
from dashboard.charts.overview import status_counts
from dashboard.sidebar import current, page_rows, plot
from harness.store.schema import COLUMNS

LIST_COLUMNS = tuple(column.name for column in COLUMNS if column.type.startswith("list<"))  # itl_ms, samples
STATUSES = ("ok", "oom", "skipped_oom", "error", "unsupported")
TABLE_COLUMNS = (  # the rows table's columns unless more are picked: identity, workload, outcome, headline figures
    "source",
    "sweep_id",
    "status",
    "marks",  # not a stored column: row_marks, why a row's figures may not be trusted
    "model",
    "device_name",
    "dtype",
    "kv_dtype",
    "cache",
    "batch_size",
    "prompt_len",
    "gen_len",
    "ttft_ms",
    "tpot_ms",
    "tpot_rse",
    "decode_tok_s",
    "kv_bytes_allocated",
    "peak_mem_bytes",
    "bw_util",
    "bound",
    "top1_agreement",
    "error",
    "started_at",
)

st.title("kvbench")
st.caption("What the KV cache costs and buys during decoding: one row per measured sweep point.")
rows = page_rows()


def sweep_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per sweep and source: how many rows, by status, and when they were measured."""
    groups = rows.groupby(["sweep_id", "source"], dropna=False)
    by_status = rows.groupby(["sweep_id", "source", "status"], dropna=False).size().unstack(fill_value=0)
    table = pd.concat(
        [
            groups.size().rename("rows"),
            by_status.reindex(columns=list(STATUSES), fill_value=0),
            groups["started_at"].min().rename("first_started_at"),
            groups["started_at"].max().rename("last_started_at"),
        ],
        axis="columns",
    )
    return table.reset_index().sort_values("first_started_at", ascending=False, na_position="last")


st.subheader("Sweeps found")
st.dataframe(sweep_table(current().all_rows), hide_index=True)
plot("Rows per sweep", status_counts, current().all_rows)

ok = rows[rows["status"] == "ok"]
best, fastest, longest = st.columns(3)
if ok["decode_tok_s"].notna().any():
    top = ok.loc[ok["decode_tok_s"].idxmax()]
    best.metric(
        "best decode throughput",
        f"{top['decode_tok_s']:,.1f} tok/s",
        help=f"{top['model']} · {top['cache']} · kv {top['kv_dtype']} · batch {top['batch_size']}",
    )
else:
    best.metric("best decode throughput", "–")
if ok["tpot_ms"].notna().any():
    top = ok.loc[ok["tpot_ms"].idxmin()]
    fastest.metric(
        "lowest TPOT",
        f"{top['tpot_ms']:,.2f} ms",
        help=f"{top['model']} · {top['cache']} · kv {top['kv_dtype']} · batch {top['batch_size']}",
    )
else:
    fastest.metric("lowest TPOT", "–")
context = ok["prompt_len"] + ok["gen_len"]  # tokens per sequence
if context.notna().any():
    top = ok.loc[context.idxmax()]
    longest.metric(
        "largest context that ran (status ok)",
        f"{int(context.max()):,} tokens",
        help=f"{top['model']} · {top['cache']} · kv {top['kv_dtype']} · batch {top['batch_size']}",
    )
else:
    longest.metric("largest context that ran (status ok)", "–")

st.subheader(f"Rows ({len(rows)})")
if warning := marks_warning(rows):
    st.warning(warning)  # the marks column says which
shown = rows.assign(marks=row_marks(rows))  # the table's; the downloads keep the stored columns alone
# A table of every column of 100k rows is over 100 MB for the browser: the usual columns first, the rest on demand.
# The downloads below always carry every column.
usual = [c for c in TABLE_COLUMNS if c in shown.columns]
others = [c for c in rows.columns if c not in TABLE_COLUMNS and c not in LIST_COLUMNS]  # a list per row: heavy
extra = st.multiselect("more columns", others, help="every column is in the CSV and parquet downloads")
st.dataframe(shown[usual + extra], hide_index=True)
csv_column, parquet_column = st.columns(2)
csv_column.download_button(
    "download CSV", data=lambda: data.csv_bytes(rows), file_name="kvbench.csv", mime="text/csv", on_click="ignore"
)
parquet_column.download_button(
    "download parquet",
    data=lambda: data.parquet_bytes(rows),
    file_name="kvbench.parquet",
    mime="application/octet-stream",
    on_click="ignore",
)
