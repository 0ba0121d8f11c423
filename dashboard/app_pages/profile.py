"""Profile: where a decode step's time goes (the torch.profiler pass), by context and by batch, and one point's
top ops."""

import streamlit as st

from dashboard import data
from dashboard.charts.profile import profile_shares, top_ops
from dashboard.sidebar import current, page_rows, plot

st.title("Profile")
rows = page_rows()

plot("time shares by prompt length", profile_shares, rows, by="prompt_len")
plot("time shares by batch size", profile_shares, rows, by="batch_size")

st.subheader("Top ops of one point")
sources = current().sources
have_ops = set(data.points_with_ops(sources))
profiled = rows[(rows["status"] == "ok") & rows["point_id"].isin(have_ops)].drop_duplicates(["sweep_id", "point_id"])
if profiled.empty:
    st.info(
        "None of the selected ok rows has a top-ops table. The profiler pass (`profile=true`, the default) writes "
        "`<point_id>.ops.parquet` beside each row; rerun a sweep without `profile=false` to get them."
    )
else:
    labels = {
        (point.sweep_id, point.point_id): f"{point.cache} · {point.kv_dtype} · batch {point.batch_size} · "
        f"prompt {point.prompt_len} ({point.sweep_id}/{point.point_id})"
        for point in profiled.itertuples()
    }
    sweep_id, point_id = st.selectbox("point", list(labels), format_func=labels.get)
    ops = data.load_point_ops(sources, point_id, sweep_id=sweep_id)
    if ops is None:
        st.warning(f"top ops: the table of {point_id} could not be read")
    else:
        plot("top ops", top_ops, ops)
