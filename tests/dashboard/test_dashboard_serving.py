"""The Serving page: its loaders (dashboard/serve_data.py) as plain functions, and the page through Streamlit's
AppTest over serving runs made by the real producers (tests/serve/serve_runs.py), with none, and with only a killed one.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import data, serve_data, sidebar
from harness.serve.rows import FINISHED, RUNNING, ServeRunWriter, serve_run_dir
from harness.store import disk
from tests.serve.serve_runs import (
    NUM_PROMPTS,
    QPS,
    STRATEGIES,
    TTFT_SLO_MS,
    as_written_before_max_running,
    write_run,
    write_sweep,
)

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
PAGE = "app_pages/serving.py"
TIMEOUT_S = 30  # one run on 2 busy cores; AppTest's default is 3 s
SERVE_COMMANDS = ("make serve-quick", "python -m experiments.serve experiment=serve-quick")
CHARTS = 7  # the KV pool, three CDFs, throughput and p99 TTFT, goodput, the planner check


def serving_page(monkeypatch, results: Path) -> AppTest:
    """The app over `results` alone (the committed reference left out), switched to the Serving page."""
    monkeypatch.setenv(data.RESULTS_ENV, str(results))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.session_state[sidebar.REFERENCE_KEY] = False
    at.run()
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


# -------------------------------------------------------------------------------------------------------- loaders


def test_every_run_is_listed_and_a_killed_one_as_unfinished_with_its_requests(tmp_path):
    write_run(tmp_path, run_id="done", qps=16.0)
    write_run(tmp_path, run_id="killed", qps=16.0, finished=False)
    runs, skipped = serve_data.load_runs((str(tmp_path),))
    assert skipped == []
    assert runs["run_id"].tolist() == ["done", "killed"]
    assert runs[serve_data.FINISHED].tolist() == [True, False]
    assert runs[serve_data.REQUESTS_WRITTEN].tolist() == [NUM_PROMPTS, NUM_PROMPTS]
    assert runs.loc[0, "strategy"] == "paged" and runs.loc[0, "qps"] == 16.0 and runs.loc[0, "completed"] == NUM_PROMPTS
    assert runs[serve_data.SOURCE].tolist() == ["results", "results"]
    requests = serve_data.load_requests(list(runs[serve_data.RUN_DIR]))
    assert requests.groupby("run_id").size().to_dict() == {"done": NUM_PROMPTS, "killed": NUM_PROMPTS}
    iterations = serve_data.load_iterations(runs.loc[1, serve_data.RUN_DIR])
    assert len(iterations) > 0 and {"time_s", "kv_used_blocks", "num_running", "num_waiting"} <= set(iterations)


def test_an_integer_figure_stays_integer_beside_an_unfinished_runs_null(tmp_path):
    write_run(tmp_path, run_id="done")
    write_run(tmp_path, run_id="killed", finished=False)
    runs, _ = serve_data.load_runs((str(tmp_path),))
    for column in ("max_concurrent_requests", "max_running_requests"):
        assert str(runs[column].dtype) == "Int64" and runs[column].isna().tolist() == [False, True]


def test_a_run_row_from_before_max_running_requests_loads_its_old_figure_as_running_beside_a_new_one(tmp_path):
    write_run(tmp_path, run_id="new", qps=16.0)
    as_written_before_max_running(write_run(tmp_path, run_id="old", qps=16.0))
    runs, skipped = serve_data.load_runs((str(tmp_path),))
    assert skipped == [] and runs["run_id"].tolist() == ["new", "old"]  # the same run, but for its run row
    new_row, old_row = (runs.set_index("run_id").loc[name] for name in ("new", "old"))
    assert old_row["max_running_requests"] == new_row["max_running_requests"]  # what the old column counted
    assert pd.isna(old_row["max_concurrent_requests"]) and pd.notna(new_row["max_concurrent_requests"])
    assert str(runs["max_running_requests"].dtype) == "Int64"


def test_the_committed_references_serving_runs_all_load_a_running_figure():
    runs, skipped = serve_data.load_runs((str(data.REFERENCE_DIR),))
    done = runs[runs[serve_data.FINISHED].astype(bool)]
    assert skipped == [] and len(done) > 0
    assert done["max_running_requests"].notna().all()
    assert (done["max_running_requests"] <= done["completed"]).all()


def test_a_run_written_after_the_first_load_is_found_on_the_next(tmp_path):
    write_run(tmp_path, run_id="first")
    assert serve_data.load_runs((str(tmp_path),))[0]["run_id"].tolist() == ["first"]
    write_run(tmp_path, run_id="second")
    assert serve_data.load_runs((str(tmp_path),))[0]["run_id"].tolist() == ["first", "second"]


def test_a_run_in_two_sources_is_listed_once_from_the_first(tmp_path):
    for source in ("mine", "copy"):
        write_run(tmp_path / source, run_id="same")
    runs, _ = serve_data.load_runs((str(tmp_path / "mine"), str(tmp_path / "copy")))
    assert runs[serve_data.RUN_DIR].tolist() == [str(serve_run_dir(tmp_path / "mine", "same").resolve())]


def test_an_unreadable_run_row_is_skipped_naming_its_folder_and_the_rest_load(tmp_path):
    write_run(tmp_path, run_id="good")
    broken = write_run(tmp_path, run_id="broken")
    (broken / "run.parquet").write_bytes(b"not a parquet file")
    runs, skipped = serve_data.load_runs((str(tmp_path),))
    assert runs["run_id"].tolist() == ["good"]
    assert len(skipped) == 1 and skipped[0].startswith(f"{broken.resolve()}: ")


def test_a_run_killed_before_its_first_part_is_listed_as_running_from_its_manifest(tmp_path):
    write_run(tmp_path, run_id="done")
    ServeRunWriter(serve_run_dir(tmp_path, "early")).start(config={"strategy": "paged"})  # killed in the model build
    runs, skipped = serve_data.load_runs((str(tmp_path),))
    assert skipped == [] and runs["run_id"].tolist() == ["done", "early"]
    early = runs.set_index("run_id").loc["early"]
    assert not early[serve_data.FINISHED] and early[serve_data.STATUS] == RUNNING
    assert early[serve_data.REQUESTS_WRITTEN] == 0 and early[serve_data.STARTED_AT]
    assert runs.set_index("run_id").loc["done", serve_data.STATUS] == FINISHED
    assert serve_data.load_requests([early[serve_data.RUN_DIR]]).empty
    assert serve_data.load_iterations(early[serve_data.RUN_DIR]).empty


def test_an_unreadable_part_is_named_and_the_rest_of_its_run_still_shows(tmp_path):
    run_dir = write_run(tmp_path, run_id="done")
    bad = run_dir / "requests-00001.parquet"
    lost = pq.ParquetFile(bad).metadata.num_rows
    bad.write_bytes(bad.read_bytes()[:40])  # truncated: no footer
    runs, skipped = serve_data.load_runs((str(tmp_path),))
    assert runs["run_id"].tolist() == ["done"] and runs.loc[0, serve_data.FINISHED]
    assert [line.partition(": ")[0] for line in skipped] == [str(bad.resolve())]
    assert runs.loc[0, serve_data.REQUESTS_WRITTEN] == NUM_PROMPTS - lost
    assert len(serve_data.load_requests([runs.loc[0, serve_data.RUN_DIR]])) == NUM_PROMPTS - lost
    assert len(serve_data.load_iterations(runs.loc[0, serve_data.RUN_DIR])) > 0


def test_a_folder_without_serving_runs_has_none(tmp_path):
    (tmp_path / "serve" / "empty").mkdir(parents=True)  # a folder made, nothing written yet
    runs, skipped = serve_data.load_runs((str(tmp_path), str(tmp_path / "absent")))
    assert runs.empty and skipped == [] and serve_data.load_requests([]).empty


# ----------------------------------------------------------------------------------------------------------- page


def test_without_serving_runs_the_page_says_how_to_make_one(monkeypatch, tmp_path):
    at = serving_page(monkeypatch, tmp_path)
    text = "\n".join(str(info.value) for info in at.info)
    assert all(command in text for command in SERVE_COMMANDS), text
    assert len(at.get("plotly_chart")) == 0


@pytest.mark.slow  # simulates 9 runs, then two runs of the app: about 5 s on 2 busy cores
def test_the_page_draws_every_chart_over_a_qps_sweep_and_lists_the_killed_run(monkeypatch, tmp_path):
    write_sweep(tmp_path)
    write_run(tmp_path, run_id="killed", qps=64.0, finished=False)
    at = serving_page(monkeypatch, tmp_path)
    assert len(at.get("plotly_chart")) == CHARTS
    assert not [w.value for w in at.warning if "needs columns" in str(w.value)]  # no chart lacked its columns
    table = at.dataframe[0].value
    assert len(table) == len(STRATEGIES) * len(QPS) + 1
    assert table.set_index("run_id").loc["killed", serve_data.FINISHED] == False  # noqa: E712 (numpy bool)
    assert any("killed" in str(caption.value) and "unfinished" in str(caption.value) for caption in at.caption)
    (slo,) = [box for box in at.number_input if box.key == "serving_slo_ms"]
    assert slo.value == TTFT_SLO_MS  # the runs' own SLO marks the knee


def test_with_only_a_killed_run_the_page_draws_its_requests_and_says_what_needs_a_finished_one(monkeypatch, tmp_path):
    write_run(tmp_path, run_id="killed", finished=False)
    at = serving_page(monkeypatch, tmp_path)
    assert len(at.get("plotly_chart")) == 4  # the KV pool and three CDFs
    assert any("No finished run" in str(info.value) for info in at.info)


def test_a_run_with_only_its_manifest_and_one_with_a_bad_part_are_listed_and_the_part_is_named(monkeypatch, tmp_path):
    ServeRunWriter(serve_run_dir(tmp_path, "early")).start(config={"strategy": "paged"})
    bad = write_run(tmp_path, run_id="done") / "iterations-00000.parquet"
    bad.write_bytes(b"not a parquet file")
    at = serving_page(monkeypatch, tmp_path)
    table = at.dataframe[0].value.set_index("run_id")
    assert table.loc["early", serve_data.STATUS] == RUNNING and table.loc["done", serve_data.STATUS] == FINISHED
    warning = "\n".join(str(w.value) for w in at.warning)
    assert "Skipped 1 unreadable serving file(s)" in warning and str(bad.resolve()) in warning
    assert any("early (running)" in str(caption.value) for caption in at.caption)


def test_the_page_draws_the_planner_check_over_a_run_row_from_before_max_running_requests(monkeypatch, tmp_path):
    as_written_before_max_running(write_run(tmp_path, run_id="old", qps=16.0))
    at = serving_page(monkeypatch, tmp_path)
    assert len(at.get("plotly_chart")) == CHARTS
    assert not [w.value for w in at.warning if "needs columns" in str(w.value)]  # its old figure is the running one


def array_values(array) -> list:
    """A plotly JSON array as a list: plotly writes a numpy array as {"dtype", "bdata": base64 of its bytes}."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=array["dtype"]).tolist()
    return list(array)


def test_a_multi_turn_run_adds_ttft_and_hit_rate_by_turn_and_a_single_turn_run_none(monkeypatch, tmp_path):
    write_run(tmp_path, run_id="flat", qps=16.0)
    write_run(tmp_path, run_id="chat", qps=8.0, turns=4)
    at = serving_page(monkeypatch, tmp_path)
    assert not [w.value for w in at.warning if "needs columns" in str(w.value)]
    charts = [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]
    assert len(charts) == CHARTS + 2
    ttft, hits = charts[-2:]
    assert ttft["layout"]["title"]["text"] == "TTFT by turn"
    assert hits["layout"]["title"]["text"].startswith("Prefix hit rate by turn")
    assert [array_values(trace["x"]) for trace in ttft["data"]] == [[1, 2, 3, 4]] * 2  # p50 and p99 by turn
    assert [trace["name"] for trace in hits["data"]] == ["device"]  # a run without the tiers' columns
    (session,) = [box for box in at.selectbox if box.key == "serving_session_run"]
    assert session.options == ["paged / fp32 / qps 8"]  # the chat run alone: the single-turn one is no session run


def test_serving_parts_are_not_reported_as_unreadable_point_rows(tmp_path):
    write_run(tmp_path, run_id="done")
    _, skipped = data.load_rows((str(tmp_path),))
    assert skipped == []


def test_in_a_results_folder_holding_the_reference_only_a_truly_unreadable_point_file_is_named(tmp_path, monkeypatch):
    # The default sidebar reads results/ (which holds reference/) and results/reference/: results/ is then walked
    # folder by folder, and serve/ is read as a folder of its own (issue #27 item 7: 48 parts were named).
    results = tmp_path / "results"
    monkeypatch.setattr(data, "REFERENCE_DIR", results / "reference")
    write_run(results, run_id="done")
    write_run(results / "reference", run_id="committed")
    point = disk.write_point({"point_id": "p0", "sweep_id": "s1", "status": "ok"}, results / "s1")
    sources = (str(results), str(results / "reference"))
    rows, skipped = data.load_rows(sources)
    assert skipped == [] and rows["point_id"].tolist() == ["p0"]

    whole = point.read_bytes()
    truncated = results / "s1" / "truncated.parquet"
    truncated.write_bytes(whole[: len(whole) // 2])
    rows, skipped = data.load_rows(sources)
    assert [line.partition(": ")[0] for line in skipped] == [str(truncated)]
    assert rows["point_id"].tolist() == ["p0"]
