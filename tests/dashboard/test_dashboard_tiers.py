"""The KV tiers & transfer page (dashboard/app_pages/tiers.py) through Streamlit's AppTest: a results folder with a
tier-bandwidth table, a PD-transfer table (harness.store.tables.write_table, where the experiments write them) and
prefix-reuse rows; and one with none of them. Also its loaders (dashboard/data.py) as plain functions."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import data, sidebar
from harness.store import disk, tables
from tests.dashboard.charts_rows import point
from tests.dashboard.test_charts_tiers import a_cpu_tiers_run, a_pd_run, prefix_sweep

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
PAGE = "app_pages/tiers.py"
TIMEOUT_S = 30  # one run on 2 busy cores; AppTest's default is 3 s
COMMANDS = ("python -m experiments.tiers", "python -m experiments.pd", "experiment=prefix-reuse")


def write_results(directory: Path) -> Path:
    tables.write_table(a_cpu_tiers_run(), tables.TIER_COLUMNS, directory / tables.TIERS_DIR, prefix=tables.TIER_PREFIX)
    tables.write_table(a_pd_run(), tables.PD_COLUMNS, directory / tables.PD_DIR, prefix=tables.PD_PREFIX)
    for i, row in enumerate(prefix_sweep().to_dict("records")):
        disk.write_point(row | dict(point_id=f"prefix-{i}", sweep_id="prefix-reuse"), directory / "prefix-reuse")
    return directory


def tiers_page(monkeypatch, results: Path) -> AppTest:
    """The app over `results` alone (the committed reference left out), switched to this page."""
    monkeypatch.setenv(data.RESULTS_ENV, str(results))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.session_state[sidebar.REFERENCE_KEY] = False
    at.run()
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def chart_titles(at: AppTest) -> list[str]:
    return [json.loads(chart.proto.spec)["layout"]["title"]["text"] for chart in at.get("plotly_chart")]


def texts(elements) -> str:
    return "\n".join(str(element.value) for element in elements)


# -------------------------------------------------------------------------------------------------------- loaders


def test_the_loaders_read_each_table_once_though_the_reference_holds_a_copy(tmp_path, monkeypatch):
    reference = tmp_path / "reference"
    monkeypatch.setattr(data, "REFERENCE_DIR", reference)
    for folder in (tmp_path / "mine", reference / "cpu-run"):
        tables.write_table(a_pd_run(), tables.PD_COLUMNS, folder / tables.PD_DIR, prefix=tables.PD_PREFIX)
    both = data.load_pd_tables((str(tmp_path / "mine"), str(reference)))
    assert len(both) == len(a_pd_run()) and set(both[data.ORIGIN]) == {"results"}
    assert set(both["source"]) == set(a_pd_run()["source"])  # the table's own source: measured or extrapolated


def test_the_loaders_of_a_folder_without_tables_are_empty_with_the_contracts_columns(tmp_path):
    assert data.load_tier_tables((str(tmp_path),)).empty
    assert {c.name for c in tables.TIER_COLUMNS} <= set(data.load_tier_tables((str(tmp_path),)).columns)
    assert {c.name for c in tables.PD_COLUMNS} <= set(data.load_pd_tables((str(tmp_path),)).columns)


def test_a_table_written_after_the_first_load_shows_on_the_next(tmp_path):
    assert data.load_tier_tables((str(tmp_path),)).empty
    tables.write_table(a_cpu_tiers_run(), tables.TIER_COLUMNS, tmp_path / "tiers", prefix=tables.TIER_PREFIX)
    assert len(data.load_tier_tables((str(tmp_path),))) == len(a_cpu_tiers_run())


# ------------------------------------------------------------------------------------------------------- the page


def test_the_page_draws_tiers_prefix_ttft_and_transfer_with_their_captions(monkeypatch, tmp_path):
    at = tiers_page(monkeypatch, write_results(tmp_path))
    titles = chart_titles(at)
    assert titles[0].startswith("Tier bandwidth against block size (CPU:")
    assert titles[1:] == [
        "Time to first token by where the prefix came from",
        "Prefill → decode KV transfer against context",
        "Time to first token: disaggregated against colocated",
    ]
    captions = texts(at.caption)
    assert "every figure is measured" in captions and "Measured crossover: disk beats recompute" in captions
    assert "Extrapolated (dashed" in captions
    (crossings,) = at.dataframe
    assert set(crossings.value["transport"]) == {"tcp", "shm", "pcie5-x16 (extrapolated)"}
    assert not at.info


def test_the_page_without_any_table_or_row_gives_each_command(monkeypatch, tmp_path):
    at = tiers_page(monkeypatch, tmp_path)
    said = texts(at.info)
    assert all(command in said for command in COMMANDS), said
    assert not at.get("plotly_chart")


def test_rows_without_prefix_reuse_give_its_command_and_the_tables_still_draw(monkeypatch, tmp_path):
    tables.write_table(a_cpu_tiers_run(), tables.TIER_COLUMNS, tmp_path / "tiers", prefix=tables.TIER_PREFIX)
    disk.write_point(point(point_id="plain", sweep_id="s"), tmp_path / "s")
    at = tiers_page(monkeypatch, tmp_path)
    assert "experiment=prefix-reuse" in texts(at.info) and "experiments.tiers" not in texts(at.info)
    assert len(at.get("plotly_chart")) == 1


def test_the_transfer_selector_switches_the_kv_dtype_drawn(monkeypatch, tmp_path):
    both = pd.concat([a_pd_run(), a_pd_run(kv_dtype="fp8", tpot_ms=3.0)], ignore_index=True)
    tables.write_table(both, tables.PD_COLUMNS, tmp_path / "pd", prefix=tables.PD_PREFIX)
    at = tiers_page(monkeypatch, tmp_path)
    selector = next(widget for widget in at.selectbox if widget.label == "transfer workload (kv_dtype)")
    selector.set_value("fp8").run()
    assert not at.exception
    (crossings,) = at.dataframe
    tcp = crossings.value.set_index("transport").loc["tcp", "outlasts_step_from"]
    # tcp over fp8's 3 ms step: 2/3 at 512, 2 at 2048 (bf16's 4 ms step would give 1280)
    assert tcp == pytest.approx(512 + (2048 - 512) * (1 - 2 / 3) / (2 - 2 / 3))
