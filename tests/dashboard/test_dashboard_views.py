"""Like-with-like views (issue #14): the strategies page on the committed reference results never mixes workloads.

The references mix 18 crossover points (bf16, batch 1 to 256), the fragmentation pair, the quickstart (fp32, batch
1, three prompts) and the strategies sweep (fp32, batch 2, 24 treatments): a median per (cache, kv_dtype) across
them read as "fp8 KV is twice as slow". The page must say they differ, ask for one, and show that one alone.
And rows whose figures may not be trusted (converged False, host_busy True) or whose ceilings are stale are marked
and counted where figures are shown; a null (a row from before those columns) is never marked.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import data, sidebar
from dashboard.charts.common import ok_rows, workload_keys
from harness.store import disk, schema
from harness.store.schema import WORKLOAD_COLUMNS

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
TIMEOUT_S = 30  # one run on 2 busy cores; AppTest's default is 3 s
WORKLOAD_KEY = "strategies_workload"  # dashboard/app_pages/strategies.py's selectbox


def reference_ok_rows() -> pd.DataFrame:
    return ok_rows(disk.load(data.REFERENCE_DIR))


def strategies_page(monkeypatch, tmp_path) -> AppTest:
    """The app on the committed references alone (an empty results folder beside them), on the strategies page."""
    monkeypatch.setenv(data.RESULTS_ENV, str(tmp_path))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S).run()
    at.switch_page("app_pages/strategies.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def assert_one_workload_and_all_its_rows(table: pd.DataFrame, reference: pd.DataFrame) -> None:
    """The table shown holds one workload key, and every ok reference row of that workload stands behind it."""
    present = [column for column in WORKLOAD_COLUMNS if column in table.columns]
    assert present == list(WORKLOAD_COLUMNS)
    assert (table[present].astype(object).nunique(dropna=False) == 1).all(), table[present].drop_duplicates()
    assert table["workload"].nunique() == 1
    keys = workload_keys(reference)
    (shown,) = set(workload_keys(table))
    assert table["n_points"].sum() == (keys == shown).sum()


@pytest.mark.slow  # two runs of the app over every reference row: 10 to 20 s on 2 busy cores
def test_the_strategies_page_on_the_references_asks_for_a_workload_and_shows_that_one_alone(monkeypatch, tmp_path):
    reference = reference_ok_rows()
    n_workloads = workload_keys(reference).nunique()
    assert n_workloads > 1  # crossover, fragmentation, quickstart, strategies and the real model's workloads
    at = strategies_page(monkeypatch, tmp_path)
    assert any(f"{n_workloads} different workloads" in str(warning.value) for warning in at.warning)
    (choice,) = [box for box in at.selectbox if box.key == WORKLOAD_KEY]
    assert len(choice.options) == n_workloads
    (table,) = at.dataframe
    assert_one_workload_and_all_its_rows(table.value, reference)
    # the default, the workload with the most treatments: cpu-accuracy-real's 32 (SmolLM2's formats, windows, policies)
    assert len(table.value) == 32
    assert (table.value["dtype"] == "fp32").all() and (table.value["batch_size"] == 2).all()

    choice.set_value(choice.options[1]).run()  # another workload: its table alone
    (table,) = at.dataframe
    assert_one_workload_and_all_its_rows(table.value, reference)
    assert table.value["workload"].iloc[0] == choice.options[1]


def write_rows(rows: pd.DataFrame, directory: Path) -> None:
    known = {column.name for column in schema.COLUMNS}
    for record in rows.to_dict("records"):
        disk.write_point({key: value for key, value in record.items() if key in known}, directory / record["sweep_id"])


@pytest.mark.slow  # three runs of the app: 10 to 20 s on 2 busy cores
def test_rows_not_to_trust_are_marked_and_counted_and_stale_ceilings_warned_of(monkeypatch, tmp_path):
    rows = reference_ok_rows()
    rows = rows[rows["arithmetic_intensity"].notna()].head(4).reset_index(drop=True)  # with roofline columns
    rows["converged"] = pd.array([False, True, None, True], dtype="boolean")
    rows["host_busy"] = pd.array([None, True, None, False], dtype="boolean")
    rows["ceilings_stale"] = pd.array([None, None, True, False], dtype="boolean")
    write_rows(rows, tmp_path)
    monkeypatch.setenv(data.RESULTS_ENV, str(tmp_path))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.session_state[sidebar.REFERENCE_KEY] = False
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert "1 not converged and 1 host busy (of 4 ok rows)" in "\n".join(str(w.value) for w in at.warning)
    marks = at.dataframe[1].value["marks"]  # the rows table
    assert sorted(marks) == ["", "", "host busy", "not converged"]  # the nulls are never marked

    at.switch_page("app_pages/roofline.py").run()
    assert not at.exception, [e.value for e in at.exception]
    warnings = "\n".join(str(w.value) for w in at.warning)
    assert "1 ok row(s) beat their ceilings" in warnings and "kvbench-ceilings --force" in warnings
