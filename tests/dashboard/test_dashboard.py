"""The dashboard: its loaders as plain functions, and every page through Streamlit's AppTest over fixture results.

The fixture results are the committed reference rows (quickstart, strategies, fragmentation) written back with
harness.store.disk.write_point, plus a small batch sweep (for the knee), a profiler top-ops table and a capacity
frontier table. The app is pointed at them with KVBENCH_RESULTS, and the committed reference folder is left out.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import data, sidebar
from harness.store import disk, schema
from harness.store.schema import PROFILE_CATEGORIES

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
PAGES = ("overview", "roofline", "memory", "strategies", "latency", "profile")
NO_RESULTS_COMMANDS = ("make run", "python -m experiments.decode experiment=quickstart")
TIMEOUT_S = 30  # one run on 2 busy cores; AppTest's default is 3 s
KNEE_SWEEP = "fixture-crossover"
KNEE_BATCHES = (1, 4, 16)
COMMITTED_REFERENCE = data.REFERENCE_DIR  # results/reference: real rows of three sweeps
QUICKSTART_SWEEP = "20261201-172538"  # results/reference/cpu-quickstart: none, contiguous, paged × 3 prompts
NEWER_COLUMNS = [  # what a row of an older schema lacks (written as nulls)
    "arithmetic_intensity",
    "achieved_tflops",
    "peak_bw_gbps",
    "peak_tflops",
    *(f"prof_{category}_frac" for category in PROFILE_CATEGORIES),
]


# ------------------------------------------------------------------------------------------------------ fixtures


def reference_rows() -> pd.DataFrame:
    return disk.load(COMMITTED_REFERENCE)


def with_and_without_itl() -> pd.DataFrame:
    """Two rows without per-step latencies (no timing: fragmentation), then two with."""
    rows = reference_rows()
    return pd.concat([rows[rows["itl_ms"].isna()].head(2), rows[rows["itl_ms"].notna()].head(2)], ignore_index=True)


def write_rows(rows: pd.DataFrame, directory: Path) -> None:
    known = {column.name for column in schema.COLUMNS}
    for record in rows.to_dict("records"):
        row = {key: value for key, value in record.items() if key in known}
        disk.write_point(row, directory / row["sweep_id"])


def knee_sweep(rows: pd.DataFrame) -> pd.DataFrame:
    """A batch sweep from batch 1 in the current schema (roofline and profiler columns), whose TPOT rises past the
    knee at batch 16, with B* = 8."""
    base = rows[(rows["status"] == "ok") & (rows["cache"] == "contiguous") & rows["itl_ms"].notna()].iloc[[0]]
    sweep = []
    for batch, tpot_ms in zip(KNEE_BATCHES, (40.0, 42.0, 90.0), strict=True):
        flops_per_step = 0.4e9 * batch  # FLOP
        bytes_per_step = 0.8e9  # bytes: the weights, read once for the whole batch
        sweep.append(
            base.assign(
                point_id=f"knee-b{batch}",
                sweep_id=KNEE_SWEEP,
                batch_size=batch,
                tpot_ms=tpot_ms,
                decode_tok_s=batch * 1000 / tpot_ms,
                flops_per_step=flops_per_step,
                bytes_per_step=bytes_per_step,
                arithmetic_intensity=flops_per_step / bytes_per_step,
                achieved_tflops=flops_per_step / tpot_ms / 1e9,
                prefill_arithmetic_intensity=20.0 * batch,
                prefill_achieved_tflops=0.1,
                peak_bw_gbps=25.0,
                peak_tflops=0.18,
                predicted_tpot_ms=max(bytes_per_step / 25e9, flops_per_step / 0.18e12) * 1e3,
                bound="compute" if batch >= 8 else "memory",
                critical_batch=8.0,
                critical_context=float("inf"),
                prof_attention_frac=0.1,
                prof_gemm_frac=0.7,
                prof_norm_elementwise_frac=0.1,
                prof_kv_frac=0.05,
                prof_sampling_frac=0.01,
                prof_other_frac=0.04,
            )
        )
    return pd.concat(sweep, ignore_index=True)


def frontier_table() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "model": "small",
            "device": "cpu",
            "dtype": "bf16",
            "kv_dtype": "bf16",
            "cache": "contiguous",
            "context": [512, 2048, 8192],
            "prompt_len": [510, 2046, 8190],
            "gen_len": 2,
            "max_memory_gb": 1.5,
            "runtime_overhead_bytes": 300 * 2**20,
            "predicted_max_batch": [39, 9, 2],
            "measured_max_batch": [39, 9, 2],
            "first_oom_batch": [40, 10, 3],
            "bisection_step": [1, 1, 1],
            "probes": [3, 3, 3],
            "probe_s": [10.0, 12.0, 20.0],
            "peak_mem_bytes": [1.4 * 2**30] * 3,
            "mem_baseline_bytes": [0.3 * 2**30] * 3,
            "kv_bytes_allocated": [2**28, 2**28, 2**28],
            "error": None,
            "within_step": True,
            "predicted_model_bytes": [1.1 * 2**30] * 3,
            "mmap_threshold_pinned": True,
            "rss_error": [0.01, 0.0, -0.01],
        }
    )


def ops_table() -> pd.DataFrame:
    """A top-ops table as harness.measure.profile writes it (TOP_OPS_COLUMNS)."""
    return pd.DataFrame(
        {
            "op": ["aten::mm", "aten::bmm", "aten::_softmax"],
            "category": ["gemm", "attention", "attention"],
            "self_time_ms": [3.0, 1.0, 0.5],
            "calls": [40, 8, 8],
            "share": [0.6, 0.2, 0.1],
        }
    )


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


@pytest.fixture
def quickstart_dir(tmp_path) -> Path:
    """The quickstart rows alone: an older schema (no roofline or profiler columns), no ops, no frontier."""
    rows = reference_rows()
    write_rows(rows[rows["sweep_id"] == QUICKSTART_SWEEP].drop(columns=NEWER_COLUMNS), tmp_path)
    return tmp_path


@pytest.fixture
def corrupt_dir(tmp_path) -> Path:
    """Two good rows, a file of garbage and a truncated parquet."""
    rows = reference_rows().head(2)
    write_rows(rows, tmp_path)
    whole = next(tmp_path.rglob("*.parquet")).read_bytes()  # a good row's file
    (tmp_path / "truncated.parquet").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "x.parquet").write_bytes(b"this is not a parquet file" * 10)
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


def figures(at: AppTest) -> list[dict]:
    """The spec (plotly JSON) of every chart on the page."""
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def multiselect(at: AppTest, label: str):
    return next(widget for widget in at.sidebar.multiselect if widget.label == label)


def texts(elements) -> str:
    return "\n".join(str(element.value) for element in elements)


# -------------------------------------------------------------------------------------------------- the loaders


def test_filter_rows_keeps_the_rows_whose_values_are_selected():
    rows = pd.DataFrame({"cache": ["none", "paged", "paged", None], "device": ["cpu"] * 4})
    assert data.filter_rows(rows, {"cache": ["paged"]}).index.tolist() == [1, 2]
    assert data.filter_rows(rows, {"cache": ["none", data.NULL_LABEL]}).index.tolist() == [0, 3]
    assert data.filter_rows(rows, {"cache": ["paged"], "device": ["cuda"]}).empty
    assert data.filter_rows(rows, {"cache": []}).empty  # nothing selected, nothing shown
    assert len(data.filter_rows(rows, {"model": ["small"]})) == 4  # a column the rows lack filters nothing
    assert data.filter_options(rows, "cache") == [data.NULL_LABEL, "none", "paged"]


def test_load_rows_tags_each_source_and_reads_the_reference_subfolder_once(tmp_path, monkeypatch):
    reference = tmp_path / "results" / "reference"
    monkeypatch.setattr(data, "REFERENCE_DIR", reference)
    rows = reference_rows()
    write_rows(rows.head(3), tmp_path / "results")
    write_rows(rows.tail(2), reference)

    both, skipped = data.load_rows((str(tmp_path / "results"), str(reference)))
    assert skipped == []
    assert both["source"].value_counts().to_dict() == {"results": 3, "reference": 2}
    alone, _ = data.load_rows((str(tmp_path / "results"),))
    assert len(alone) == 3 and set(alone["source"]) == {"results"}


def test_load_rows_sees_a_point_written_after_the_first_load(tmp_path):
    rows = reference_rows()
    write_rows(rows.head(2), tmp_path)
    assert len(data.load_rows((str(tmp_path),))[0]) == 2
    write_rows(rows.iloc[[5]], tmp_path)
    assert len(data.load_rows((str(tmp_path),))[0]) == 3


def test_load_rows_of_an_empty_or_missing_folder_is_empty_with_every_column(tmp_path):
    rows, skipped = data.load_rows((str(tmp_path / "nothing-here"),))
    assert rows.empty and skipped == []
    assert {"point_id", "status", "tpot_ms", "source"} <= set(rows.columns)


def test_load_rows_skips_unreadable_files_and_names_them(corrupt_dir):
    rows, skipped = data.load_rows((str(corrupt_dir),))
    assert len(rows) == 2
    assert len(skipped) == 2
    assert any(line.startswith(str(corrupt_dir / "x.parquet")) for line in skipped)
    assert any(line.startswith(str(corrupt_dir / "truncated.parquet")) for line in skipped)


def test_load_frontiers_reads_every_table_and_skips_an_unreadable_one(tmp_path):
    (tmp_path / "capacity").mkdir()
    frontier_table().to_parquet(tmp_path / "capacity" / "frontier-1.parquet")
    frontier_table().to_parquet(tmp_path / "capacity" / "frontier-2.parquet")
    (tmp_path / "capacity" / "frontier-3.parquet").write_bytes(b"garbage")
    table = data.load_frontiers((str(tmp_path),))
    assert len(table) == 6
    assert set(table["frontier_file"]) == {"frontier-1.parquet", "frontier-2.parquet"}
    assert data.load_frontiers((str(tmp_path / "elsewhere"),)).empty


def test_load_point_ops_finds_a_points_table_or_none(tmp_path):
    disk.write_ops("abc", ops_table(), tmp_path / "sweep")
    assert data.points_with_ops((str(tmp_path),)) == ["abc"]
    assert data.load_point_ops((str(tmp_path),), "abc")["op"].tolist() == ops_table()["op"].tolist()
    assert data.load_point_ops((str(tmp_path),), "other") is None


def test_load_point_ops_prefers_the_table_in_the_points_own_sweep(tmp_path):
    disk.write_ops("abc", ops_table().head(1), tmp_path / "first-sweep")
    disk.write_ops("abc", ops_table().head(2), tmp_path / "second-sweep")  # the same point, rerun
    sources = (str(tmp_path),)
    assert len(data.load_point_ops(sources, "abc", sweep_id="first-sweep")) == 1
    assert len(data.load_point_ops(sources, "abc", sweep_id="second-sweep")) == 2


def test_parquet_bytes_round_trip_through_results_load_with_itl_ms_lists(tmp_path):
    rows = with_and_without_itl().assign(source="reference")
    (tmp_path / "export.parquet").write_bytes(data.parquet_bytes(rows))
    back = disk.load(tmp_path / "export.parquet")
    assert back["point_id"].tolist() == rows["point_id"].tolist()
    assert back["itl_ms"].tolist() == rows["itl_ms"].tolist()
    assert back["source"].tolist() == ["reference"] * len(rows)


def test_csv_bytes_has_one_line_per_row_and_itl_ms_as_json():
    rows = with_and_without_itl()
    back = pd.read_csv(io.BytesIO(data.csv_bytes(rows)))
    assert back["point_id"].tolist() == rows["point_id"].tolist()
    assert back["itl_ms"].isna().tolist() == [True, True, False, False]
    assert json.loads(back["itl_ms"].iloc[2]) == rows["itl_ms"].iloc[2]


# ---------------------------------------------------------------------------------------------------- the pages


def test_overview_table_adds_the_columns_picked_under_more_columns(monkeypatch, fixture_dir):
    at = open_app(monkeypatch, fixture_dir)
    (more,) = [widget for widget in at.multiselect if widget.label == "more columns"]
    assert "point_id" in more.options and "itl_ms" not in more.options
    more.set_value(["point_id", "prof_gemm_frac"]).run()
    table = at.dataframe[1].value
    assert list(table.columns[-2:]) == ["point_id", "prof_gemm_frac"]
    assert table["point_id"].tolist() == disk.load(fixture_dir)["point_id"].tolist()


def test_overview_lists_the_sweeps_the_headline_figures_and_the_rows(monkeypatch, fixture_dir):
    at = open_app(monkeypatch, fixture_dir)
    sweeps, rows = at.dataframe
    expected = disk.load(fixture_dir)
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
    "strategies": [
        "KV allocated (MiB)",
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


def test_memory_page_draws_the_capacity_and_compares_planner_with_measured_kv(monkeypatch, fixture_dir):
    at = open_app(monkeypatch, fixture_dir, page="memory")
    (capacity,) = at.number_input
    assert capacity.value > 0  # CPU rows without a cap: this machine's RAM
    ledger, frontier = figures(at)
    assert any(shape.get("name") == "device capacity" for shape in ledger["layout"]["shapes"])
    assert [trace["name"] for trace in frontier["data"]] == ["measured", "predicted (planner)"]
    (kv,) = at.dataframe
    assert {"kv_bytes_predicted", "kv_bytes_allocated", "allocated_over_predicted"} <= set(kv.value.columns)
    assert {"kv_bytes_planner", "allocated_over_planner"} <= set(kv.value.columns)
    measured = disk.load(fixture_dir).query("status == 'ok'")
    assert len(kv.value) == measured["kv_bytes_predicted"].notna().sum()  # mixed lengths have no prediction


def test_strategies_page_tabulates_every_cache_and_format(monkeypatch, fixture_dir):
    at = open_app(monkeypatch, fixture_dir, page="strategies")
    (table,) = at.dataframe
    ok = disk.load(fixture_dir).query("status == 'ok'")
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
