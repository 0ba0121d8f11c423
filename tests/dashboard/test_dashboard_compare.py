"""The dashboard's Compare page (dashboard/app_pages/compare.py) through Streamlit's AppTest, on two synthetic sweeps
whose differences are known (tests/store/test_compare.py's result sets), and its chart and table functions."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import data, sidebar
from dashboard.charts.compare import VERDICT_COLOURS, ratio_chart, styled_verdicts, verdict_table
from harness.store import compare, disk
from tests.store.test_compare import FAST_PROMPT, NOISY_PROMPT, SAME_PROMPT, SLOW_PROMPT, result_sets, row, samples

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
TIMEOUT_S = 30  # one run on 2 busy cores; AppTest's default is 3 s
KNOWN_VERDICTS = {FAST_PROMPT: "FAST", SLOW_PROMPT: "SLOW", SAME_PROMPT: "SAME", NOISY_PROMPT: "AMBIGUOUS"}


def write(rows: pd.DataFrame, directory: Path) -> None:
    for record in rows.to_dict("records"):
        disk.write_point(record, directory / record["sweep_id"])


@pytest.fixture
def two_sweeps(tmp_path) -> Path:
    """Sweeps "a" and "b" (their rows' sweep_id) under one results folder."""
    a, b = result_sets()
    write(pd.concat([a, b], ignore_index=True), tmp_path)
    return tmp_path


def open_compare(monkeypatch, directory: Path) -> AppTest:
    """The app over `directory` without the committed reference results, on the Compare page."""
    monkeypatch.setenv(data.RESULTS_ENV, str(directory))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.session_state[sidebar.REFERENCE_KEY] = False
    at.run()
    at.switch_page("app_pages/compare.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def selectbox(at: AppTest, label: str):
    return next(widget for widget in at.selectbox if widget.label == label)


def shown_verdicts(at: AppTest) -> dict[int, str]:
    """prompt_len -> verdict, read off the page's verdict table."""
    (table,) = at.dataframe
    frame = table.value
    prompts = frame["workload"].str.extract(r"prompt_len=(\d+)")[0].astype(int)
    return dict(zip(prompts, frame["verdict"], strict=True))


def texts(elements) -> str:
    return "\n".join(str(element.value) for element in elements)


# ------------------------------------------------------------------------------------------------------- the page


def test_compare_page_shows_the_known_verdict_of_every_pair(monkeypatch, two_sweeps):
    at = open_compare(monkeypatch, two_sweeps)
    assert selectbox(at, "A (baseline) sweep").value == "a" and selectbox(at, "B sweep").value == "b"
    assert shown_verdicts(at) == KNOWN_VERDICTS
    assert "4 pairs: 1 FAST, 1 SLOW, 1 SAME, 1 AMBIGUOUS; 1 only in A, 1 only in B" in texts(at.markdown)
    assert "Only in A: " in texts(at.caption) and not at.warning
    (chart,) = at.get("plotly_chart")
    names = [trace.get("name") for trace in json.loads(chart.proto.spec)["data"]]
    assert names == ["band 1 ± t", "FAST", "SLOW", "SAME", "AMBIGUOUS"]


def test_swapping_a_and_b_swaps_fast_and_slow(monkeypatch, two_sweeps):
    at = open_compare(monkeypatch, two_sweeps)
    selectbox(at, "A (baseline) sweep").set_value("b")
    selectbox(at, "B sweep").set_value("a")
    at.run()
    verdicts = shown_verdicts(at)
    assert verdicts[FAST_PROMPT] == "SLOW" and verdicts[SLOW_PROMPT] == "FAST"


def test_a_threshold_above_the_change_makes_the_slow_pair_same(monkeypatch, two_sweeps):
    at = open_compare(monkeypatch, two_sweeps)
    at.number_input[0].set_value(50.0).run()
    assert shown_verdicts(at)[SLOW_PROMPT] == "SAME"


def test_the_throughput_metric_keeps_fast_fast(monkeypatch, two_sweeps):
    at = open_compare(monkeypatch, two_sweeps)
    selectbox(at, "metric").set_value("decode_tok_s").run()
    verdicts = shown_verdicts(at)
    assert verdicts[FAST_PROMPT] == "FAST" and verdicts[SLOW_PROMPT] == "SLOW"


def test_a_busy_b_sweep_is_ambiguous_with_its_reason_until_trusted(monkeypatch, tmp_path):
    a, b = result_sets()
    # Another started_at: other measurements than two_sweeps' to the page's cache, which is keyed on their identity.
    busy = b.assign(host_busy=True, started_at="2026-12-01T11:00:00")
    write(pd.concat([a, busy], ignore_index=True), tmp_path)
    at = open_compare(monkeypatch, tmp_path)
    (table,) = at.dataframe
    assert set(table.value["verdict"]) == {"AMBIGUOUS"} and set(table.value["reason"]) == {"B host_busy"}
    trust = next(widget for widget in at.checkbox if widget.label == "trust noisy rows")
    assert trust.value is False
    trust.check().run()
    assert shown_verdicts(at) == KNOWN_VERDICTS


def test_two_sweeps_with_nothing_to_pair_say_so(monkeypatch, tmp_path):
    write(
        pd.DataFrame(
            [
                row("a-1", prompt_len=128, tpot=samples(10.0, 0.01, seed=1)),
                row("b-1", prompt_len=256, tpot=samples(10.0, 0.01, seed=2)),
            ]
        ),
        tmp_path,
    )
    at = open_compare(monkeypatch, tmp_path)
    assert "Nothing to pair" in texts(at.info)
    assert not at.dataframe and not at.get("plotly_chart")


def test_one_sweep_asks_for_a_second(monkeypatch, tmp_path):
    write(pd.DataFrame([row("a-1", prompt_len=128, tpot=samples(10.0, 0.01, seed=1))]), tmp_path)
    at = open_compare(monkeypatch, tmp_path)
    assert "Compare needs two sweeps" in texts(at.info) and not at.selectbox


def test_an_empty_results_folder_gives_the_command_that_makes_results(monkeypatch, tmp_path):
    at = open_compare(monkeypatch, tmp_path)
    assert "make run" in texts(at.info)


# ------------------------------------------------------------------------------------------- the table and chart


def test_the_verdict_table_colours_each_verdict():
    table = verdict_table(compare.compare(*result_sets()))
    html = styled_verdicts(table).to_html()
    assert all(colour in html for colour in VERDICT_COLOURS.values())
    assert list(table.columns) == [
        "workload",
        "A",
        "B",
        "B/A",
        "CI low",
        "CI high",
        "threshold",
        "verdict",
        "reason",
        "note",
    ]


def test_the_ratio_chart_of_no_pairs_says_so():
    a, _ = result_sets()
    empty = compare.compare(a, a.iloc[0:0])
    figure = ratio_chart(empty)
    assert not figure.data and figure.layout.annotations[0].text == "no pairs"
