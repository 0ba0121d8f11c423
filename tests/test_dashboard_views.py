"""Like-with-like views (issue #14): the strategies page on the committed reference results never mixes workloads.

The references mix 18 crossover points (bf16, batch 1 to 256), the fragmentation pair, the quickstart (fp32, batch
1, three prompts) and the strategies sweep (fp32, batch 2, 24 treatments): a median per (cache, kv_dtype) across
them read as "fp8 KV is twice as slow". The page must say they differ, ask for one, and show that one alone.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import data
from dashboard.charts.common import ok_rows, workload_keys
from harness.store import disk
from harness.store.schema import WORKLOAD_COLUMNS

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
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
    assert n_workloads > 1  # crossover, fragmentation, quickstart and strategies workloads
    at = strategies_page(monkeypatch, tmp_path)
    assert any(f"{n_workloads} different workloads" in str(warning.value) for warning in at.warning)
    (choice,) = [box for box in at.selectbox if box.key == WORKLOAD_KEY]
    assert len(choice.options) == n_workloads
    (table,) = at.dataframe
    assert_one_workload_and_all_its_rows(table.value, reference)
    assert len(table.value) == 24  # the default: the strategies sweep, the workload with the most treatments
    assert (table.value["dtype"] == "fp32").all() and (table.value["batch_size"] == 2).all()

    choice.set_value(choice.options[1]).run()  # another workload: its table alone
    (table,) = at.dataframe
    assert_one_workload_and_all_its_rows(table.value, reference)
    assert table.value["workload"].iloc[0] == choice.options[1]
