"""The Serving page's charts (dashboard/charts/serving.py) over serving runs made by the real producers
(tests/serve/serve_runs.py: requests.generate, scheduler.simulate on a synthetic clock, ServeRunWriter), read back as the
page reads them (dashboard/serve_data.py).

The simulated clock is deterministic (seeded arrivals and lengths, a step time that is a formula of the tokens), so
the knee's qps is an exact figure of the fixture; every expected value is also recomputed from the rows drawn.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dashboard import serve_data
from dashboard.charts.common import MissingColumns
from dashboard.charts.serving import (
    MEASURED,
    PREDICTED,
    QPS_TITLE,
    concurrency_check,
    default_ttft_slo_ms,
    goodput_vs_qps,
    kv_timeline,
    latency_cdf,
    qps_curves,
    run_labels,
)
from harness.errors import ConfigError
from harness.serve.metrics import knee
from tests.dashboard.charts_rows import annotation_texts, trace, trace_names
from tests.serve.serve_runs import NUM_BLOCKS, NUM_PROMPTS, QPS, TTFT_SLO_MS, write_run, write_sweep

KILLED = "killed"  # an unfinished run: parts, no run.parquet


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A qps sweep (contiguous and paged at 4, 16, 64, 256 requests/s) and one run killed before its run row."""
    folder = tmp_path_factory.mktemp("results")
    write_sweep(folder)
    write_run(folder, run_id=KILLED, qps=64.0, finished=False)
    return folder


@pytest.fixture(scope="module")
def runs(results) -> pd.DataFrame:
    loaded, skipped = serve_data.load_runs((str(results),))
    assert skipped == []
    return loaded


@pytest.fixture(scope="module")
def requests(runs) -> pd.DataFrame:
    return serve_data.load_requests(list(runs[serve_data.RUN_DIR]))


def finished(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs[serve_data.FINISHED]]


def run_dir(runs: pd.DataFrame, *, strategy: str, qps: float) -> str:
    (found,) = runs.loc[(runs["strategy"] == strategy) & (runs["qps"] == qps), serve_data.RUN_DIR]
    return found


def killed_dir(runs: pd.DataFrame) -> str:
    (found,) = runs.loc[runs["run_id"] == KILLED, serve_data.RUN_DIR]
    return found


# --------------------------------------------------------------------------------------------------------- labels


def test_a_run_is_labelled_strategy_kv_dtype_qps_and_an_unfinished_one_by_its_run_id(runs):
    labels = dict(zip(runs["run_id"], run_labels(runs), strict=True))
    assert labels["20261201-120000-paged-fp32-qps16"] == "paged / fp32 / qps 16"
    assert labels[KILLED] == "killed (unfinished)"


def test_two_runs_that_would_read_alike_are_told_apart_by_their_run_id(runs):
    twins = pd.concat([finished(runs).head(1), finished(runs).head(1).assign(run_id="again")], ignore_index=True)
    assert run_labels(twins).str.endswith(tuple(twins["run_id"])).all()


def test_the_default_ttft_slo_is_the_runs_own(runs):
    assert default_ttft_slo_ms(runs) == TTFT_SLO_MS
    assert default_ttft_slo_ms(runs.assign(ttft_slo_ms=np.nan)) is None


# ---------------------------------------------------------------------------------------------------- the KV pool


def test_kv_timeline_draws_blocks_used_the_pool_and_running_and_waiting_against_time(runs):
    iterations = serve_data.load_iterations(run_dir(runs, strategy="paged", qps=256.0))
    fig = kv_timeline(iterations, num_blocks=NUM_BLOCKS, run="paged / fp32 / qps 256")
    names = ["KV blocks used", f"pool: {NUM_BLOCKS} blocks", "running requests", "waiting requests"]
    assert trace_names(fig) == names
    assert list(trace(fig, "KV blocks used").y) == iterations["kv_used_blocks"].astype(float).tolist()
    assert list(trace(fig, "KV blocks used").x) == iterations["time_s"].tolist()
    assert list(trace(fig, f"pool: {NUM_BLOCKS} blocks").y) == [NUM_BLOCKS, NUM_BLOCKS]
    assert list(trace(fig, "waiting requests").y) == iterations["num_waiting"].astype(float).tolist()
    assert trace(fig, "running requests").yaxis == "y2"  # the second panel
    assert fig.layout.yaxis.title.text == "KV blocks" and fig.layout.yaxis2.title.text == "requests"
    assert fig.layout.xaxis2.title.text == "time (s)"
    assert fig.layout.title.text == "KV blocks used against time: paged / fp32 / qps 256"


def test_kv_timeline_of_an_unfinished_run_has_no_pool_line(runs):
    fig = kv_timeline(serve_data.load_iterations(killed_dir(runs)), num_blocks=None)
    assert trace_names(fig) == ["KV blocks used", "running requests", "waiting requests"]


def test_kv_timeline_without_iterations_says_so():
    empty = pd.DataFrame(columns=serve_data.ITERATION_COLUMNS)
    assert annotation_texts(kv_timeline(empty)) == ["no iterations recorded"]


# ------------------------------------------------------------------------------------------------------ latencies


def test_latency_cdf_steps_through_each_runs_requests_from_its_fastest_to_all(runs, requests):
    fig = latency_cdf(runs, requests, metric="ttft_ms")
    assert len(fig.data) == len(runs)  # every run, the unfinished one included: its requests loaded
    one = trace(fig, "contiguous / fp32 / qps 64")
    (run_id,) = runs.loc[runs[serve_data.RUN_DIR] == run_dir(runs, strategy="contiguous", qps=64.0), "run_id"]
    assert list(one.x) == sorted(requests.loc[requests["run_id"] == run_id, "ttft_ms"])
    assert list(one.y) == pytest.approx([(i + 1) / NUM_PROMPTS for i in range(NUM_PROMPTS)])
    assert "killed (unfinished)" in trace_names(fig)
    assert fig.layout.xaxis.title.text == "time to first token (ms)"
    assert fig.layout.yaxis.title.text == "fraction of requests"


@pytest.mark.parametrize(
    ("metric", "x_title"), [("tpot_ms", "time per output token (ms)"), ("e2el_ms", "end-to-end latency (ms)")]
)
def test_latency_cdf_titles_its_axis_with_the_metric_and_its_unit(runs, requests, metric, x_title):
    fig = latency_cdf(runs, requests, metric=metric)
    assert fig.layout.xaxis.title.text == x_title and len(fig.data) == len(runs)


def test_the_tpot_cdf_leaves_out_a_one_token_output_as_the_run_row_does(runs, requests):
    one_run = runs[runs["run_id"] == KILLED]
    mine = requests[requests["run_id"] == KILLED].copy()
    mine.loc[mine.index[0], "tpot_ms"] = np.nan  # a one-token output: no TPOT
    (line,) = latency_cdf(one_run, mine, metric="tpot_ms").data
    assert len(line.x) == len(mine) - 1 and line.y[-1] == 1.0


def test_latency_cdf_names_the_metrics_it_draws_when_given_another(runs, requests):
    with pytest.raises(ConfigError, match="metric: must be one of ttft_ms, tpot_ms, e2el_ms, got 'itl_ms'"):
        latency_cdf(runs, requests, metric="itl_ms")


def test_latency_cdf_without_requests_says_so(runs):
    empty = pd.DataFrame(columns=serve_data.REQUEST_COLUMNS)
    assert annotation_texts(latency_cdf(runs, empty)) == ["no requests"]


# ----------------------------------------------------------------------------------------------------- against qps


def test_qps_curves_draw_throughput_and_p99_ttft_per_strategy_against_qps(runs):
    fig = qps_curves(finished(runs))
    lines = [t for t in fig.data if t.name == "paged / fp32"]
    assert len(lines) == 2  # throughput on top, p99 TTFT below
    paged = finished(runs)[finished(runs)["strategy"] == "paged"].sort_values("qps")
    assert list(lines[0].x) == list(QPS) and list(lines[0].y) == paged["output_throughput"].tolist()
    assert list(lines[1].y) == paged["p99_ttft_ms"].tolist() and lines[1].yaxis == "y2"
    assert fig.layout.yaxis.title.text == "output throughput (tokens/s)"
    assert fig.layout.yaxis2.title.text == "p99 TTFT (ms)"
    assert fig.layout.xaxis2.title.text == QPS_TITLE and fig.layout.xaxis2.type == "log"
    assert not [name for name in trace_names(fig) if "knee" in name or "SLO" in name]  # no SLO, no knee


def test_qps_curves_mark_each_strategys_knee_under_the_slo(runs):
    done = finished(runs)
    fig = qps_curves(done, slo_ms=TTFT_SLO_MS)
    for strategy, expected_qps in (("contiguous", 16.0), ("paged", 64.0)):  # tests/serve/serve_runs.py's QPS comment
        mine = done[done["strategy"] == strategy]
        assert knee(mine, TTFT_SLO_MS) == expected_qps  # the harness's own knee, over the same rows
        markers = [t for t in fig.data if t.name == f"knee, {strategy} / fp32: qps {expected_qps:g}"]
        assert len(markers) == 2  # on both panels
        at = mine[mine["qps"] == expected_qps]
        assert [m.x[0] for m in markers] == [expected_qps] * 2
        assert [m.y[0] for m in markers] == [at["output_throughput"].item(), at["p99_ttft_ms"].item()]
    assert list(trace(fig, f"TTFT SLO: {TTFT_SLO_MS:g} ms").y) == [TTFT_SLO_MS] * 2


def test_qps_curves_say_when_a_strategy_breaks_the_slo_from_the_lowest_qps(runs):
    fig = qps_curves(finished(runs), slo_ms=1.0)
    assert not [name for name in trace_names(fig) if name.startswith("knee")]
    assert sum("no knee" in text for text in annotation_texts(fig)) == 2


def test_runs_at_qps_inf_are_counted_not_drawn_on_a_qps_axis(runs, tmp_path):
    write_run(tmp_path, strategy="paged", qps=float("inf"))
    at_once, _ = serve_data.load_runs((str(tmp_path),))
    both = pd.concat([finished(runs), at_once], ignore_index=True)
    for fig in (qps_curves(both, slo_ms=TTFT_SLO_MS), goodput_vs_qps(both)):
        assert all(np.isfinite(x) for t in fig.data for x in t.x)
        assert "1 run(s) at qps=inf (all requests at once) not drawn" in annotation_texts(fig)


def test_a_qps_curve_never_joins_two_sweeps(runs):
    done = finished(runs)
    two = pd.concat([done, done.assign(sweep_id="other", run_id=done["run_id"] + "-b")], ignore_index=True)
    names = {t.name for t in qps_curves(two).data}
    assert names == {f"{sweep} / {s} / fp32" for sweep in ("20261201-120000", "other") for s in ("contiguous", "paged")}


def test_goodput_is_drawn_per_strategy_against_qps_with_its_slo_in_the_title(runs):
    fig = goodput_vs_qps(finished(runs))
    assert sorted(trace_names(fig)) == ["contiguous / fp32", "paged / fp32"]
    contiguous = finished(runs)[finished(runs)["strategy"] == "contiguous"].sort_values("qps")
    assert list(trace(fig, "contiguous / fp32").y) == contiguous["request_goodput"].tolist()
    assert f"TTFT ≤ {TTFT_SLO_MS:g} ms" in fig.layout.title.text
    assert fig.layout.yaxis.title.text == "goodput (requests/s within the SLO)"
    assert fig.layout.xaxis.title.text == QPS_TITLE


# ------------------------------------------------------------------------------------------------ the planner


def test_the_planners_prediction_stands_beside_the_measured_concurrency_per_run(runs):
    done = finished(runs)
    fig = concurrency_check(done)
    assert trace_names(fig) == [PREDICTED, MEASURED] and fig.layout.barmode == "group"
    assert PREDICTED == "predicted (planner)" and MEASURED == "measured"
    assert trace(fig, PREDICTED).marker.pattern.shape == "/"  # hatched: not a measurement
    measured = dict(zip(trace(fig, MEASURED).x, trace(fig, MEASURED).y, strict=True))
    predicted = dict(zip(trace(fig, PREDICTED).x, trace(fig, PREDICTED).y, strict=True))
    for row, label in zip(done.itertuples(), run_labels(done), strict=True):
        assert measured[label] == row.max_running_requests and predicted[label] == row.predicted_max_running
    assert KILLED not in " ".join(measured)  # an unfinished run has no figures
    assert fig.layout.yaxis.title.text == "running requests"


def test_the_measured_bar_is_the_running_peak_not_the_in_flight_one(runs):
    done = finished(runs)
    queued = done[done["max_concurrent_requests"] > done["max_running_requests"]]  # requests waited in these runs
    assert len(queued) > 0
    bars = trace(concurrency_check(queued), MEASURED)
    measured = dict(zip(bars.x, bars.y, strict=True))
    assert measured == dict(zip(run_labels(queued), queued["max_running_requests"].astype(float), strict=True))


def test_a_run_without_a_prediction_has_its_measured_bar_alone(runs):
    fig = concurrency_check(finished(runs).assign(predicted_max_running=pd.NA))
    assert trace_names(fig) == [MEASURED]


# -------------------------------------------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("build", [qps_curves, goodput_vs_qps, concurrency_check])
def test_a_chart_over_no_finished_run_says_so(runs, build):
    assert "no finished runs" in annotation_texts(build(runs[runs["run_id"] == KILLED]))


@pytest.mark.parametrize("build", [qps_curves, goodput_vs_qps, concurrency_check])
def test_a_chart_over_rows_without_its_columns_names_them(build):
    with pytest.raises(MissingColumns, match="needs columns"):
        build(pd.DataFrame({"run_id": ["r"]}))
