"""The sidebar (where results come from, which rows to show) and what every page takes from it.

app.py calls sidebar() on every rerun, before the page runs; it stores a Selection in st.session_state[STATE_KEY].
A page calls page_rows() for the filtered rows (it stops the page with a friendly message when there are none) and
plot() for each chart, so that a chart whose columns an older schema lacks becomes a warning, not a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboard import data
from dashboard.charts.common import MissingColumns

STATE_KEY = "kvbench_selection"  # st.session_state key of the current Selection
REFERENCE_KEY = "include_reference"  # the checkbox's key: a test can set it before the first run
NO_RESULTS_HELP = (
    "No results yet. Produce some with `make run` (the quickstart sweep), or "
    "`python -m experiments.decode experiment=quickstart`, then rerun this page."
)
SKIPPED_REASON_CHARS = 100  # pyarrow's reasons run to several lines in a narrow sidebar
FILTER_LABELS = {
    "device": "device",
    "model": "model",
    "cache": "cache",
    "kv_dtype": "kv_dtype",
    "dtype": "dtype",
    "sweep_id": "sweep",
}
assert set(FILTER_LABELS) == set(data.FILTER_COLUMNS)


@dataclass(frozen=True)
class Selection:
    sources: tuple[str, ...]  # resolved folders the rows come from
    all_rows: pd.DataFrame  # every row loaded
    rows: pd.DataFrame  # after the filters
    skipped: list[str] = field(default_factory=list)  # "<path>: <reason>" per file that could not be read


def sidebar() -> Selection:
    """Draw the sidebar, load and filter the rows, and store the Selection for the page."""
    with st.sidebar:
        st.header("Results")
        directory = st.text_input(
            "results folder",
            value=data.default_results_dir(),
            help=f"Relative to the repository root ({data.REPO_ROOT}); ${data.RESULTS_ENV} sets the default.",
        )
        st.session_state.setdefault(REFERENCE_KEY, True)  # on by default; the state, not value=, holds it
        include_reference = st.checkbox(
            "include committed reference results", key=REFERENCE_KEY, help=str(data.REFERENCE_DIR)
        )
        user_dir = data.resolve_dir(directory)
        if not user_dir.is_dir():
            st.caption(f"`{user_dir}` does not exist yet.")
        sources = (str(user_dir),) + ((str(data.REFERENCE_DIR),) if include_reference else ())
        all_rows, skipped = data.load_rows(sources)
        if skipped:
            st.warning(f"Skipped {len(skipped)} unreadable file(s):\n" + "\n".join(map(skipped_item, skipped)))

        st.header("Filters")
        selections = {}
        for column, label in FILTER_LABELS.items():
            options = data.filter_options(all_rows, column)
            if options:
                selections[column] = st.multiselect(label, options, default=options)
        rows = data.filter_rows(all_rows, selections)
        st.caption(f"{len(rows)} of {len(all_rows)} rows")
    selection = Selection(sources=sources, all_rows=all_rows, rows=rows, skipped=skipped)
    st.session_state[STATE_KEY] = selection
    return selection


def skipped_item(line: str) -> str:
    """A Markdown list item for one "<path>: <reason>" line: the path whole, the reason shortened."""
    path, _, reason = line.partition(": ")
    reason = reason if len(reason) <= SKIPPED_REASON_CHARS else reason[: SKIPPED_REASON_CHARS - 1] + "…"
    return f"- `{path}`: {reason}"


def current() -> Selection:
    return st.session_state[STATE_KEY]


def page_rows() -> pd.DataFrame:
    """The filtered rows for a page; with none, a friendly message and the page stops here."""
    selection = current()
    if selection.all_rows.empty:
        st.info(NO_RESULTS_HELP)
        st.stop()
    if selection.rows.empty:
        st.info("No rows match the filters in the sidebar: select more values there.")
        st.stop()
    return selection.rows


def plot(name: str, build: Callable[..., go.Figure], *args, **kwargs) -> go.Figure | None:
    """st.plotly_chart(build(*args, **kwargs)); a chart the rows lack columns for is a warning naming them."""
    try:
        figure = build(*args, **kwargs)
    except MissingColumns as exc:
        st.warning(f"{name}: {exc}")
        return None
    st.plotly_chart(figure, width="stretch", key=f"chart: {name}")  # keyed: two equal figures may not clash
    return figure
