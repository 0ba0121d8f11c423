"""Whether a run sustained its offered rate (harness.serve.sustained, issue #30 item 2): the measured window, the
achieved rate against the offered one, SLO attainment, the verdict and its reason in the run row, the knee that
counts only sustained points, older run rows recomputed from their request rows, and one-line bad input.

The saturated server is simulated (scheduler.simulate on a synthetic clock: no model, deterministic): 40 requests
into at most 2 running at once, 10 ms per iteration, so the server finishes about 2 / (17 x 10 ms) = 12 req/s.
"""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments.serve  # noqa: F401  (registers serve_config in Hydra's ConfigStore)
from harness.errors import ConfigError
from harness.serve.dataset import dataset_columns
from harness.serve.kv_manager import make_kv_manager
from harness.serve.metrics import knee, request_row, run_metrics
from harness.serve.requests import RequestSpec, generate
from harness.serve.rows import RUN_FILE, ServeRunWriter, part_files, read_run_table, serve_run_dir
from harness.serve.scheduler import Scheduler, SchedulerConfig, simulate
from harness.serve.summary import summary_lines
from harness.serve.sustained import (
    SUSTAINED_COLUMNS,
    UNKNOWN_REASON,
    check_slo_attainment,
    sustained_columns,
)

ROOT = Path(__file__).resolve().parents[2]
LOOSE_SLO = "60s"  # every TTFT of the saturated run is under 4 s: only the rate can refuse it


def step_time_s(output) -> float:
    return 0.010  # a slow model: 10 ms an iteration, whatever it holds


def simulated_records(qps: float, *, num_prompts: int = 40):
    spec = RequestSpec(num_prompts=num_prompts, qps=qps, seed=0, prompt_len=32, output_len=16, max_model_len=64)
    kv = make_kv_manager("paged", num_blocks=64, block_size=16, max_model_len=64)
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=2, max_model_len=64)  # a tiny server
    return simulate(generate(spec), Scheduler(config, kv), step_time_s).records


def run_row(qps: float, **slos) -> dict:
    records = simulated_records(qps)
    duration_s = max(r.finished_s for r in records) - min(r.arrival_s for r in records)
    return run_metrics(records, duration_s, qps=qps, **slos) | {"qps": qps}


# --- the window and the rate ----------------------------------------------------------------------------------


def test_the_window_trims_a_tenth_of_the_requests_at_each_end_and_compares_completions_with_arrivals():
    arrivals = [float(i) for i in range(20)]  # 1 req/s; k = 2: the window is arrivals 2 .. 17
    keeping_up = sustained_columns(arrivals, [a + 0.5 for a in arrivals], None)
    assert (keeping_up["window_start_s"], keeping_up["window_end_s"], keeping_up["window_requests"]) == (2.0, 17.0, 16)
    assert keeping_up["window_offered_qps"] == keeping_up["achieved_qps"] == 1.0
    assert keeping_up["sustained"] is True and keeping_up["not_sustained_reason"] is None
    falling_behind = sustained_columns(arrivals, [2.0 * a + 0.5 for a in arrivals], None)  # it serves 0.5 req/s
    assert falling_behind["achieved_qps"] == 0.5 and falling_behind["sustained"] is False
    assert falling_behind["not_sustained_reason"].startswith("achieved 0.5 req/s < 95% of the 1 req/s offered")


def test_an_achieved_rate_above_the_offered_one_is_a_backlog_draining_not_a_steady_state():
    arrivals = [float(i) for i in range(20)]
    draining = sustained_columns(arrivals, [10.0 + 0.5 * a for a in arrivals], None)  # latency falling through the run
    assert draining["achieved_qps"] == 2.0 and draining["sustained"] is False
    assert "catching up on a backlog" in draining["not_sustained_reason"]


def test_attainment_counts_the_windows_requests_only():
    arrivals = [float(i) for i in range(20)]
    finishes = [a + 0.5 for a in arrivals]
    warm_up_missed = [i >= 2 for i in range(20)]  # the first two (outside the window) missed the SLO
    assert sustained_columns(arrivals, finishes, warm_up_missed)["slo_attainment"] == 1.0
    middle_missed = [i not in (5, 6, 7) for i in range(20)]  # 13 of the window's 16 met it: 81%
    verdict = sustained_columns(arrivals, finishes, middle_missed)
    assert verdict["slo_attainment"] == pytest.approx(13 / 16) and verdict["sustained"] is False
    assert verdict["not_sustained_reason"] == "SLO attainment 81.2% < 90% of the window's requests"
    assert sustained_columns(arrivals, finishes, middle_missed, slo_attainment=0.8)["sustained"] is True


def test_a_burst_at_qps_inf_is_never_sustained_but_keeps_its_figures():
    verdict = sustained_columns([0.0] * 10, [0.1 * (i + 1) for i in range(10)], [True] * 10, qps=math.inf)
    assert verdict["sustained"] is False and verdict["not_sustained_reason"].startswith("qps=inf: ")
    assert verdict["window_start_s"] == verdict["window_end_s"] == 0.0 and verdict["achieved_qps"] is None
    assert verdict["slo_attainment"] == 1.0  # still measured, over the window's 8 requests
    unknown_qps = sustained_columns([0.0] * 10, [0.1 * (i + 1) for i in range(10)], None)  # a trace's burst
    assert unknown_qps["sustained"] is False and "arrived at one instant" in unknown_qps["not_sustained_reason"]


def test_one_request_is_too_few_for_a_window():
    verdict = sustained_columns([0.0], [1.0], None)
    assert (
        verdict["sustained"] is False and verdict["not_sustained_reason"] == "1 request(s): too few for a window of two"
    )


# --- the knee: the test -------------------------------------------------------------------------------


def test_a_saturated_server_inside_a_loose_slo_is_a_knee_by_the_offered_rate_but_not_sustained():
    light, saturated = run_row(4.0, ttft_slo_ms=LOOSE_SLO), run_row(64.0, ttft_slo_ms=LOOSE_SLO)
    assert saturated["p99_ttft_ms"] < 4000.0 and saturated["slo_attainment"] == 1.0  # the SLO never bites
    assert light["sustained"] is True and light["achieved_qps"] == pytest.approx(light["window_offered_qps"], rel=0.05)
    assert saturated["sustained"] is False  # it finishes ~12 req/s of ~60 offered
    assert saturated["achieved_qps"] < 0.25 * saturated["window_offered_qps"]
    assert "the server fell behind (saturated)" in saturated["not_sustained_reason"]
    points = [light, saturated]
    old_rule = [{"qps": p["qps"], "p99_ttft_ms": p["p99_ttft_ms"]} for p in points]  # the offered qps alone
    assert knee(old_rule, LOOSE_SLO) == 64.0
    assert knee(points, LOOSE_SLO) == 4.0  # only the sustained point counts
    assert knee([saturated], LOOSE_SLO) is None  # the lowest rate already saturated: no knee at all


def test_a_null_verdict_is_not_a_sustained_one():
    points = [
        {"qps": 1.0, "p99_ttft_ms": 10.0, "sustained": True},
        {"qps": 2.0, "p99_ttft_ms": 10.0, "sustained": None},
    ]
    assert knee(points, "1s") == 1.0


def test_no_slo_means_no_attainment_and_the_rate_alone_decides():
    light = run_row(4.0)
    assert light["slo_attainment"] is None and light["sustained"] is True
    assert light["slo_attainment_target"] == 0.9


# --- the run row on disk, old and new -------------------------------------------------------------------------


def write(results_dir: Path, qps: float) -> Path:
    records = simulated_records(qps)
    duration_s = max(r.finished_s for r in records) - min(r.arrival_s for r in records)
    context = {"sweep_id": "s", "engine": "kvbench", "strategy": "paged", "kv_dtype": "bf16", "model": "tiny",
               "device": "cpu", "qps": qps, "num_blocks": 64, "block_size": 16, "kv_budget_bytes": 2**20,
               "max_num_seqs": 2, "max_num_batched_tokens": 256, "num_iterations": 1, "predicted_max_running": None,
               "mean_kv_utilization": 0.5, "peak_kv_utilization": 0.5, "mean_step_ms": 10.0,
               "mean_scheduler_ms": 0.0, **dataset_columns("random")}  # fmt: skip
    run_dir = serve_run_dir(results_dir, f"run-{qps:g}")
    with ServeRunWriter(run_dir) as writer:
        for record in records:
            writer.add_request(request_row(record))
        metrics = run_metrics(records, duration_s, ttft_slo_ms="2s", qps=qps)
        writer.close({**metrics, **context}, config={"qps": qps})
    return run_dir


def as_written_before_sustained(run_dir: Path) -> None:
    """run.parquet as a row written before the verdict existed (the committed reference's)."""
    path = run_dir / RUN_FILE
    pq.write_table(pq.read_table(path).drop_columns(list(SUSTAINED_COLUMNS)), path)


@pytest.mark.parametrize("qps", [4.0, 64.0])
def test_an_older_run_row_has_its_verdict_recomputed_from_its_request_rows(tmp_path, qps):
    run_dir = write(tmp_path, qps)
    written = read_run_table(run_dir / RUN_FILE).to_pylist()[0]
    as_written_before_sustained(run_dir)
    recomputed = read_run_table(run_dir / RUN_FILE).to_pylist()[0]
    for name in SUSTAINED_COLUMNS:  # finish = arrival + e2el_ms / 1000: the same figures, to rounding
        assert recomputed[name] == (pytest.approx(written[name]) if isinstance(written[name], float) else written[name])
    assert recomputed["sustained"] is (qps == 4.0)


def test_an_older_run_row_without_request_rows_is_unknown_and_says_so(tmp_path):
    run_dir = write(tmp_path, 4.0)
    as_written_before_sustained(run_dir)
    for part in part_files(run_dir, "requests"):
        part.unlink()
    row = read_run_table(run_dir / RUN_FILE).to_pylist()[0]
    assert row["sustained"] is None and row["not_sustained_reason"] == UNKNOWN_REASON
    assert knee([row], "2s") is None  # unknown is not sustained


def test_the_run_summary_says_whether_the_rate_was_sustained(tmp_path):
    row = run_row(64.0, ttft_slo_ms=LOOSE_SLO)
    (line,) = [line for line in summary_lines_of(row, tmp_path) if line.lstrip().startswith("sustained")]
    assert "no (achieved" in line and "SLO attainment 100%" in line and "(needs 90%)" in line


def summary_lines_of(row: dict, run_dir: Path) -> list[str]:
    context = {"strategy": "paged", "kv_dtype": "bf16", "num_iterations": 1, "predicted_max_running": None,
               "num_blocks": 64, "block_size": 16, "kv_budget_bytes": 2**20, "mean_kv_utilization": 0.5,
               "peak_kv_utilization": 0.5, "mean_step_ms": 10.0, "mean_scheduler_ms": 0.0}  # fmt: skip
    return summary_lines(row | context, run_dir)


# --- bad input ------------------------------------------------------------------------------------------------


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return OmegaConf.to_object(compose(config_name="serve", overrides=["model=tiny", *overrides]))


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.5, math.nan, True, "0.9"])
def test_an_attainment_outside_zero_to_one_is_one_line_naming_the_field(value):
    with pytest.raises(ConfigError, match=r"^slo_attainment: must be a fraction of requests in \(0, 1\]") as error:
        check_slo_attainment(value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("value", ["0", "1.5"])
def test_the_serve_config_refuses_a_bad_attainment_before_any_work(value):
    with pytest.raises(ConfigError, match=r"^slo_attainment: must be a fraction"):
        config("kv_memory_gb=0.01", f"slo_attainment={value}")


def test_the_serve_config_records_an_attainment_only_when_it_is_not_the_default():
    assert config("kv_memory_gb=0.01").slo_attainment == 0.9
    assert "slo_attainment" not in config("kv_memory_gb=0.01").config_dict()  # the keys of the runs before it
    assert config("kv_memory_gb=0.01", "slo_attainment=1").config_dict()["slo_attainment"] == 1.0
