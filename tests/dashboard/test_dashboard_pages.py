"""The dashboard: every page through Streamlit's AppTest over fixture results.

The fixture results are the committed reference rows (quickstart, strategies, fragmentation) written back with
harness.store.disk.write_point, plus a small batch sweep (for the knee), a profiler top-ops table and a capacity
frontier table. The app is pointed at them with KVBENCH_RESULTS, and the committed reference folder is left out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import data, sidebar
from harness.store import disk
from harness.store.schema import PROFILE_CATEGORIES
from tests.dashboard.test_dashboard import (
    KNEE_SWEEP,
    frontier_table,
    knee_sweep,
    ops_table,
    reference_rows,
    write_rows,
)

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
PAGES = ("overview", "roofline", "memory", "strategies", "latency", "profile")
NO_RESULTS_COMMANDS = ("make run", "python -m experiments.decode experiment=quickstart")
TIMEOUT_S = 30  # one run on 2 busy cores; AppTest's default is 3 s
QUICKSTART_SWEEP = "20261201-172538"  # results/reference/cpu-quickstart: none, contiguous, paged × 3 prompts
# results/reference/cpu-strategies' workload on the strategies page (its selectbox label starts so); the page opens
# on the workload with the most treatments, cpu-accuracy-real's (SmolLM2's formats, windows and policies)
STRATEGIES_SWEEP = "small fp32 random sdpa -, weights dummy, batch 2, prompt 160,"
NEWER_COLUMNS = [  # what a row of an older schema lacks (written as nulls)
    "arithmetic_intensity",
    "achieved_tflops",
    "peak_bw_gbps",
    "peak_tflops",
    *(f"prof_{category}_frac" for category in PROFILE_CATEGORIES),
]


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory) -> Path:
    """A results folder: the reference rows, a knee sweep, one point's top-ops table and a frontier table."""
    directory = tmp_path_factory.mktemp("results")
    rows = reference_rows()
    write_rows(rows, directory)
    write_rows(knee_sweep(rows), directory)
    disk.write_ops("knee-b4", ops_table(), directory / KNEE_SWEEP)
    (directory / "capacity").mkdir()
    frontier_table().to_parquet(directory / "capacity" / f"{disk.FRONTIER_PREFIX}20261130-120000.parquet")
    return directory


@pytest.fixture(scope="module")
def fixture_rows(fixture_dir) -> pd.DataFrame:
    """fixture_dir's rows as disk.load reads them, loaded once: no test writes into fixture_dir."""
    return disk.load(fixture_dir)


@pytest.fixture
def quickstart_dir(tmp_path) -> Path:
    """The quickstart rows alone: an older schema (no roofline or profiler columns), no ops, no frontier."""
    rows = reference_rows()
    write_rows(rows[rows["sweep_id"] == QUICKSTART_SWEEP].drop(columns=NEWER_COLUMNS), tmp_path)
    return tmp_path


def open_app(monkeypatch, directory: Path, page: str = "overview") -> AppTest:
    """The app over `directory` without the committed reference results, on `page`, after its first run."""
    monkeypatch.setenv(data.RESULTS_ENV, str(directory))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.session_state[sidebar.REFERENCE_KEY] = False
    at.run()
    if page != "overview":
        at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def choose_strategies_sweep(at: AppTest) -> None:
    """The strategies page on cpu-strategies' workload: every cache and format on dummy weights."""
    (choice,) = [box for box in at.selectbox if box.key == "strategies_workload"]
    (option,) = [label for label in choice.options if label.startswith(STRATEGIES_SWEEP)]
    choice.set_value(option).run()


def figures(at: AppTest) -> list[dict]:
    """The spec (plotly JSON) of every chart on the page."""
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def multiselect(at: AppTest, label: str):
    return next(widget for widget in at.sidebar.multiselect if widget.label == label)


def texts(elements) -> str:
    return "\n".join(str(element.value) for element in elements)


# ---------------------------------------------------------------------------------------------------- the pages


def test_overview_table_adds_the_columns_picked_under_more_columns(monkeypatch, fixture_dir, fixture_rows):
    at = open_app(monkeypatch, fixture_dir)
    (more,) = [widget for widget in at.multiselect if widget.label == "more columns"]
    assert "point_id" in more.options and "itl_ms" not in more.options
    more.set_value(["point_id", "prof_gemm_frac"]).run()
    table = at.dataframe[1].value
    assert list(table.columns[-2:]) == ["point_id", "prof_gemm_frac"]
    assert table["point_id"].tolist() == fixture_rows["point_id"].tolist()


def test_overview_lists_the_sweeps_the_headline_figures_and_the_rows(monkeypatch, fixture_dir, fixture_rows):
    at = open_app(monkeypatch, fixture_dir)
    sweeps, rows = at.dataframe
    expected = fixture_rows
    assert set(sweeps.value["sweep_id"]) == set(expected["sweep_id"])
    assert sweeps.value["rows"].sum() == len(expected)
    assert sweeps.value["unsupported"].sum() == (expected["status"] == "unsupported").sum()
    assert len(rows.value) == len(expected)
    assert "itl_ms" not in rows.value.columns
    assert list(rows.value.columns[:3]) == ["source", "sweep_id", "status"] and "point_id" not in rows.value.columns
    assert [metric.label for metric in at.metric] == [
        "best decode throughput",
        "lowest TPOT",
        "largest context that ran (status ok)",
    ]
    assert at.metric[2].value == f"{int((expected['prompt_len'] + expected['gen_len']).max()):,} tokens"
    assert [button.label for button in at.get("download_button")] == ["download CSV", "download parquet"]


def test_the_cache_filter_narrows_the_rows_shown(monkeypatch, fixture_dir):
    at = open_app(monkeypatch, fixture_dir)
    before = len(at.dataframe[1].value)
    multiselect(at, "cache").unselect("none").run()
    shown = at.dataframe[1].value
    assert 0 < len(shown) < before
    assert "none" not in set(shown["cache"])


def test_the_cache_filter_changes_the_charts(monkeypatch, fixture_dir):
    at = open_app(monkeypatch, fixture_dir, page="latency")
    ttft = figures(at)[0]
    # a line's name starts with its cache: "none fp32, batch 1, ..." (the other fields that vary follow)
    assert any(trace["name"].startswith("none ") for trace in ttft["data"])
    multiselect(at, "cache").unselect("none").run()
    ttft = figures(at)[0]
    assert ttft["data"] and not any(trace["name"].startswith("none ") for trace in ttft["data"])


def test_no_rows_left_by_the_filters_is_said_in_words(monkeypatch, fixture_dir):
    at = open_app(monkeypatch, fixture_dir, page="roofline")
    multiselect(at, "cache").set_value([]).run()
    assert not at.exception
    assert "No rows match the filters" in texts(at.info)
    assert not at.get("plotly_chart")


CHARTS_BY_PAGE = {  # page -> the x-axis title of each chart, in order
    "overview": ["rows"],
    "roofline": ["arithmetic intensity (FLOP/byte)", "batch size (sequences)", "batch size (sequences)"],
    "memory": ["context × batch (tokens × sequences)", "context (tokens per sequence)"],
    "strategies": [  # the default workload, cpu-accuracy-real's: a real model's, so its perplexity too
        "KV allocated (MiB)",
        "KV compression ratio (exact KV bytes at the compute dtype / kv_bytes_allocated)",
        "KV compression ratio (exact KV bytes at the compute dtype / kv_bytes_allocated)",
    ],
    "latency": ["prompt length (tokens)", "prompt length (tokens)", "decode step", "point"],
    "profile": ["prompt length (tokens)", "batch size (sequences)", "self time (ms, over the profiled steps)"],
}


@pytest.mark.parametrize("page", PAGES)
def test_every_page_draws_its_charts_without_an_exception(monkeypatch, fixture_dir, page):
    at = open_app(monkeypatch, fixture_dir, page=page)
    # The fixture mixes workloads: the strategies page says so and asks for one (tests/dashboard/test_dashboard_views.py). And
    # the references hold a point that did not converge, which the pages showing its figures count (marks_warning).
    warnings = [
        str(warning.value)
        for warning in at.warning
        if (page != "strategies" or "workloads" not in warning.value) and "figures are marked" not in warning.value
    ]
    assert not warnings, warnings
    assert [figure["layout"]["xaxis"]["title"]["text"] for figure in figures(at)] == CHARTS_BY_PAGE[page]
    assert all(figure["data"] for figure in figures(at))


def test_roofline_page_shows_decode_points_the_caption_and_the_knee_beside_b_star(monkeypatch, fixture_dir):
    at = open_app(monkeypatch, fixture_dir, page="roofline")
    roofline, throughput, tpot = figures(at)
    assert any(trace["name"].startswith("decode") for trace in roofline["data"])  # "decode bf16", "decode fp32"
    assert throughput["layout"]["yaxis"]["title"]["text"] == "decode throughput (tok/s)"
    assert tpot["layout"]["yaxis"]["title"]["text"] == "time per output token (ms)"
    assert "observed knee 16" in texts(at.info)
    (knees,) = at.dataframe
    # the observed knee beside B*, for every batch sweep (the reference rows bring their own)
    assert 16 in knees.value["knee_batch"].tolist() and knees.value["critical_batch"].notna().all()


def test_roofline_page_draws_only_the_batch_sweep_metric_chosen(monkeypatch, fixture_dir):
    at = open_app(monkeypatch, fixture_dir, page="roofline")
    at.get("button_group")[0].set_value(["tpot_ms"]).run()
    assert [figure["layout"]["yaxis"]["title"]["text"] for figure in figures(at)[1:]] == ["time per output token (ms)"]


def test_memory_page_draws_the_capacity_and_compares_planner_with_measured_kv(monkeypatch, fixture_dir, fixture_rows):
    at = open_app(monkeypatch, fixture_dir, page="memory")
    (capacity,) = at.number_input
    assert capacity.value > 0  # CPU rows without a cap: this machine's RAM
    ledger, frontier = figures(at)
    assert any(shape.get("name") == "device capacity" for shape in ledger["layout"]["shapes"])
    assert [trace["name"] for trace in frontier["data"]] == ["measured", "predicted (planner)"]
    (kv,) = at.dataframe
    assert {"kv_bytes_predicted", "kv_bytes_allocated", "allocated_over_predicted"} <= set(kv.value.columns)
    assert {"kv_bytes_planner", "allocated_over_planner"} <= set(kv.value.columns)
    measured = fixture_rows.query("status == 'ok'")
    assert len(kv.value) == measured["kv_bytes_predicted"].notna().sum()  # mixed lengths have no prediction


def test_strategies_page_tabulates_every_cache_and_format(monkeypatch, fixture_dir, fixture_rows):
    at = open_app(monkeypatch, fixture_dir, page="strategies")
    choose_strategies_sweep(at)
    (table,) = at.dataframe
    ok = fixture_rows.query("status == 'ok'")
    shown = ok.merge(table.value[["model", "dtype", "batch_size", "prompt_len", "gen_len"]].drop_duplicates())
    assert len(table.value) == len(shown[["cache", "kv_dtype"]].drop_duplicates())  # the workload shown, whole
    assert {"none", "contiguous", "paged", "sliding", "prefix"} <= {t["name"] for t in figures(at)[0]["data"]}


def test_profile_page_draws_the_top_ops_of_a_profiled_point(monkeypatch, fixture_dir):
    at = open_app(monkeypatch, fixture_dir, page="profile")
    (point,) = at.selectbox
    assert len(point.options) == 1 and point.value == (KNEE_SWEEP, "knee-b4")  # the one ok row with a top-ops table
    assert [trace["name"] for trace in figures(at)[2]["data"]] == ["attention", "gemm"]


def test_an_older_schema_warns_per_chart_and_still_draws_the_rest(monkeypatch, quickstart_dir):
    at = open_app(monkeypatch, quickstart_dir, page="roofline")
    assert "roofline: needs columns: arithmetic_intensity, achieved_tflops, peak_bw_gbps, peak_tflops" in texts(
        at.warning
    )
    assert len(figures(at)) == 2  # the batch sweeps need no roofline columns
    at.switch_page("app_pages/profile.py").run()
    assert not at.exception
    assert "time shares by prompt length: needs columns: prof_attention_frac" in texts(at.warning)
    assert "profile=true" in texts(at.info)  # and no point has a top-ops table


def test_memory_page_shows_the_planners_kv_bytes_beside_the_analytic_formulas(monkeypatch, quickstart_dir):
    at = open_app(monkeypatch, quickstart_dir, page="memory")
    (kv,) = at.dataframe
    table = kv.value
    assert table["kv_bytes_planner"].tolist() == table["kv_bytes_allocated"].tolist()
    paged = table[table["cache"] == "paged"]
    assert len(paged) == 3 and (paged["kv_bytes_planner"] != paged["kv_bytes_predicted"]).all()  # whole blocks
    (ledger,) = figures(at)
    names = [trace["name"] for trace in ledger["data"]]
    assert "planner (weights + KV)" in names and "analytic formula (weights + KV)" in names


def test_memory_page_without_frontier_tables_gives_the_command(monkeypatch, quickstart_dir):
    at = open_app(monkeypatch, quickstart_dir, page="memory")
    assert "python -m experiments.capacity" in texts(at.info)
    assert len(figures(at)) == 1


@pytest.mark.parametrize("page", PAGES)
def test_an_empty_results_folder_gives_the_command_that_makes_results(monkeypatch, tmp_path, page):
    at = open_app(monkeypatch, tmp_path, page=page)
    message = texts(at.info)
    assert all(command in message for command in NO_RESULTS_COMMANDS)
    assert not at.get("plotly_chart") and not at.dataframe


def test_unreadable_files_are_named_in_a_warning_and_the_other_rows_still_show(monkeypatch, corrupt_dir):
    at = open_app(monkeypatch, corrupt_dir)
    warning = texts(at.sidebar.warning)
    assert "x.parquet" in warning and "truncated.parquet" in warning
    assert len(at.dataframe[1].value) == 2


def test_the_committed_reference_results_are_included_by_default(monkeypatch, tmp_path):
    monkeypatch.setenv(data.RESULTS_ENV, str(tmp_path))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S).run()
    assert not at.exception
    rows = at.dataframe[1].value
    assert len(rows) == len(reference_rows()) and set(rows["source"]) == {"reference"}


def test_strategies_page_draws_a_checkpoints_kl_and_perplexity_and_names_it(monkeypatch, tmp_path):
    rows = reference_rows()
    eviction = rows[rows["sweep_id"] == rows.loc[rows["cache"] == "evict", "sweep_id"].iloc[0]]
    lossy = eviction["kl_mean"].notna()
    as_checkpoint = eviction.assign(
        model="SmolLM2-135M-Instruct.Q4_1",
        weights="/cache/gguf/ab12/SmolLM2-135M-Instruct.Q4_1",
        prompt_source="sharegpt",
        ppl_delta=eviction["kl_mean"].where(lossy) * 10,  # the lossy rows' delta; the exact rows' null
        ppl_source="sharegpt",
    )
    write_rows(as_checkpoint, tmp_path)
    at = open_app(monkeypatch, tmp_path, page="strategies")
    pareto, kl, ppl = figures(at)
    assert kl["layout"]["title"]["text"].endswith(": SmolLM2-135M-Instruct.Q4_1, ShareGPT prompts")
    assert ppl["layout"]["yaxis"]["title"]["text"] == "perplexity delta (lossy - exact cache's)" and ppl["data"]


def test_strategies_page_on_dummy_weights_alone_marks_them_and_draws_no_perplexity(monkeypatch, fixture_dir):
    at = open_app(monkeypatch, fixture_dir, page="strategies")
    choose_strategies_sweep(at)
    pareto, kl = figures(at)
    assert "dummy weights" in kl["layout"]["title"]["text"]
