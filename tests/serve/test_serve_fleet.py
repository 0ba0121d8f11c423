"""A saturation sweep's consumers (harness.serve.fleet, experiments.capacity mode=fleet): knees per curve, replicas
from them, the newest sweep chosen by its timestamp, unfinished runs skipped, and one-line errors.

The sweep is fake but made by the real producers: requests.generate at each qps, scheduler.simulate on a synthetic
clock whose step grows with the batch, and the run rows written by ServeRunWriter. Two curves at one pool of 64 blocks
of 16 tokens: paged takes blocks as requests grow (about 10 requests of 96 tokens fit), contiguous reserves a slot of
max_model_len = 256 tokens per request (4 fit), so contiguous queues, and its p99 TTFT breaks the SLO, at a lower qps.
The simulation is deterministic (a seeded stream, a clock that is arithmetic), so its p99s are fixed numbers:

    qps                 4      8      16     32
    paged p99 TTFT      10.3   10.9   18.9   437.8  ms
    contiguous          10.3   10.9   99.5   1043   ms

SLO = 50 ms sits far from every point: knees 16 (paged) and 8 (contiguous). At 32 req/s both pools fall behind the
stream (harness.serve.sustained): a loose SLO (2 s) that every p99 meets still puts both knees at 16.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.errors import ConfigError
from harness.serve import fleet
from harness.serve.dataset import dataset_columns
from harness.serve.kv_manager import make_kv_manager
from harness.serve.metrics import knee, request_row, run_metrics
from harness.serve.requests import RequestSpec, generate
from harness.serve.rows import ServeRunWriter, iteration_row, serve_run_dir
from harness.serve.scheduler import Scheduler, SchedulerConfig, simulate
from tests.serve.serve_runs import as_written_before_max_running

ROOT = Path(__file__).parents[2]
QPS = (4.0, 8.0, 16.0, 32.0)
SLO = "50ms"
NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 64, 16, 256
OLDER, NEWER = "20261201-223000", "20261202-090000"


def step_time_s(output) -> float:
    """A forward: a fixed launch, a cost per running request (its attention over its KV), a cost per token."""
    return 2e-3 + 1e-3 * output.num_running + 2e-5 * output.total_num_scheduled_tokens


def write_run(results_dir: Path, *, run_id: str, sweep_id: str, strategy: str, qps: float, close: bool = True) -> None:
    """One serving run of 60 requests (64 prompt + 32 output tokens) at qps, as the engine would leave it."""
    kv = make_kv_manager(strategy, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, max_model_len=MAX_MODEL_LEN)
    spec = RequestSpec(num_prompts=60, qps=qps, seed=0, prompt_len=64, output_len=32, max_model_len=MAX_MODEL_LEN)
    simulation = simulate(generate(spec), Scheduler(config, kv), step_time_s)
    iterations = [iteration_row(i, out, step_time_s(out)) for i, out in enumerate(simulation.iterations)]
    records = simulation.records
    duration_s = max(r.finished_s for r in records) - min(r.arrival_s for r in records)
    used = [row["kv_used_blocks"] / NUM_BLOCKS for row in iterations]
    context = {
        "sweep_id": sweep_id, "engine": "kvbench", "strategy": strategy, "kv_dtype": "bf16", "model": "tiny",
        "device": "cpu", "qps": qps, "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "kv_budget_bytes": 2**20,
        "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
        "num_iterations": len(iterations), "predicted_max_running": None, "mean_kv_utilization": sum(used) / len(used),
        "peak_kv_utilization": max(used), "mean_step_ms": sum(r["step_ms"] for r in iterations) / len(iterations),
        "mean_scheduler_ms": 0.0, **dataset_columns("random"),
    }  # fmt: skip
    writer = ServeRunWriter(serve_run_dir(results_dir, run_id), flush_every=1024)
    for record in records:
        writer.add_request(request_row(record))
    for row in iterations:
        writer.add_iteration(row)
    if close:
        writer.close({**run_metrics(records, duration_s=duration_s), **context}, config={"qps": qps})
    else:
        writer.flush()  # killed before close(): its parts, no run row


def write_sweep(results_dir: Path, sweep_id: str, *, strategies=("paged", "contiguous"), qps=QPS) -> None:
    for strategy in strategies:
        for rate in qps:
            write_run(
                results_dir, run_id=f"{sweep_id}-{strategy}-{rate:g}", sweep_id=sweep_id, strategy=strategy, qps=rate
            )


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    """The sweep of the module docstring, sweep_id NEWER."""
    results_dir = tmp_path_factory.mktemp("results")
    write_sweep(results_dir, NEWER)
    return results_dir


@pytest.fixture(scope="module")
def runs(sweep_dir) -> pd.DataFrame:
    return fleet.load_run_rows(sweep_dir)


def by_strategy(table: pd.DataFrame) -> dict[str, dict]:
    return {row["strategy"]: row for row in table.to_dict("records")}


def test_the_knee_is_the_highest_qps_under_the_slo_per_strategy(runs):
    table = by_strategy(fleet.knees(runs, SLO))
    assert {name: row["knee_qps"] for name, row in table.items()} == {"paged": 16.0, "contiguous": 8.0}
    assert {name: row["status"] for name, row in table.items()} == {"paged": "knee", "contiguous": "knee"}
    assert all(row["num_points"] == 4 and row["ttft_slo_ms"] == 50.0 for row in table.values())


def test_the_knee_carries_its_own_runs_figures(runs):
    knee_run = runs[(runs["strategy"] == "paged") & (runs["qps"] == 16.0)].iloc[0]
    paged = by_strategy(fleet.knees(runs, SLO))["paged"]
    for name in ("p99_ttft_ms", "request_throughput", "output_throughput", "mean_e2el_ms", "max_concurrent_requests",
                 "max_running_requests"):  # fmt: skip
        assert paged[f"knee_{name}"] == knee_run[name]
    assert paged["knee_p99_ttft_ms"] <= 50.0


def test_replicas_are_the_target_over_the_knee_rounded_up(runs):
    table = by_strategy(fleet.fleet(runs, target_qps=100.0, ttft_slo_ms=SLO))
    assert table["paged"]["replicas"] == math.ceil(100 / 16) == 7
    assert table["contiguous"]["replicas"] == math.ceil(100 / 8) == 13
    exact = by_strategy(fleet.fleet(runs, target_qps=32.0, ttft_slo_ms=SLO))  # a whole multiple adds no replica
    assert exact["paged"]["replicas"] == 2 and exact["contiguous"]["replicas"] == 4


def test_predicted_concurrency_is_littles_law_at_the_target_beside_the_measured_peak(runs):
    paged = by_strategy(fleet.fleet(runs, target_qps=100.0, ttft_slo_ms=SLO))["paged"]
    assert paged["predicted_concurrency"] == pytest.approx(100.0 * paged["knee_mean_e2el_ms"] / 1000.0)
    assert paged["predicted_concurrency_per_replica"] == pytest.approx(paged["predicted_concurrency"] / 7)
    # A replica carries 100/7 = 14.3 req/s, below the knee's 16: its mean in flight stays below the knee run's peak
    # in flight (both count queueing), which is at least its peak running.
    assert paged["predicted_concurrency_per_replica"] <= paged["knee_max_concurrent_requests"]
    assert paged["knee_max_concurrent_requests"] >= paged["knee_max_running_requests"]


def test_a_curve_over_the_slo_at_its_lowest_qps_has_no_knee_and_no_replica_count(runs):
    table = fleet.fleet(runs, target_qps=100.0, ttft_slo_ms="5ms")  # every p99 is above 10 ms
    assert table["status"].tolist() == ["below_lowest", "below_lowest"]
    assert table["knee_qps"].isna().all() and table["replicas"].isna().all()
    assert table["predicted_concurrency"].isna().all()
    assert any("below lowest" in line for line in fleet.summary_lines(table))


def test_a_curve_that_never_breaks_the_slo_says_its_knee_is_a_lower_bound(runs):
    table = by_strategy(fleet.knees(runs[runs["qps"] <= 16.0], "2s"))  # every p99 under 1.1 s, each rate sustained
    assert table["paged"]["status"] == "not_reached" and table["paged"]["knee_qps"] == 16.0
    assert table["paged"]["num_sustained"] == 3 and pd.isna(table["paged"]["refused_reason"])


def test_a_saturated_point_inside_a_loose_slo_is_no_knee(runs):
    # At 32 req/s both pools fall behind (they finish 22 and 20 req/s of the 29 offered in the window) and yet every
    # p99 TTFT is under 1.1 s: the offered-qps rule calls 32 a knee not even reached; only sustained points count.
    assert knee(runs[runs["strategy"] == "paged"].drop(columns="sustained"), "2s") == 32.0  # the old rule
    table = by_strategy(fleet.knees(runs, "2s"))
    assert {name: (row["knee_qps"], row["status"]) for name, row in table.items()} == {
        "paged": (16.0, "knee"),
        "contiguous": (16.0, "knee"),
    }
    assert table["paged"]["num_sustained"] == 3
    assert table["paged"]["refused_reason"].startswith("qps 32: not sustained: achieved 22 req/s < 95% of the 29.4")
    assert fleet.fleet(runs, target_qps=100.0, ttft_slo_ms="2s")["replicas"].tolist() == [7, 7]  # not 4 at 32
    assert any(line.startswith("paged / bf16 / kvbench: refused qps 32: not sustained") for line in
               fleet.summary_lines(table=fleet.knees(runs, "2s")))  # fmt: skip


def test_a_burst_at_qps_inf_is_not_a_point_of_the_curve(tmp_path):
    write_sweep(tmp_path, NEWER, strategies=("paged",), qps=(4.0, 8.0, math.inf))
    write_sweep(tmp_path, NEWER, strategies=("contiguous",), qps=(math.inf,))
    table = by_strategy(fleet.fleet(fleet.load_run_rows(tmp_path), target_qps=100.0, ttft_slo_ms=SLO))
    assert table["paged"]["num_points"] == 2 and table["paged"]["max_qps"] == 8.0
    assert table["paged"]["status"] == "not_reached" and table["paged"]["replicas"] == 13  # ceil(100 / 8)
    assert table["contiguous"]["status"] == "no_points" and pd.isna(table["contiguous"]["replicas"])


def test_the_newest_sweep_is_chosen_by_its_timestamp(tmp_path):
    write_sweep(tmp_path, NEWER, strategies=("paged",), qps=(4.0,))
    # An older sweep whose id and run folders sort after the newer one's as text.
    older = f"serve-qps-{OLDER}"
    write_run(tmp_path, run_id="zz-older", sweep_id=older, strategy="contiguous", qps=8.0)
    assert fleet.load_run_rows(tmp_path)["sweep_id"].unique().tolist() == [NEWER]
    chosen = fleet.load_run_rows(tmp_path, sweep_id=older)
    assert chosen["sweep_id"].unique().tolist() == [older] and chosen["strategy"].tolist() == ["contiguous"]


def test_an_unfinished_run_is_skipped(tmp_path):
    write_sweep(tmp_path, NEWER, strategies=("paged",), qps=(4.0, 8.0))
    write_run(tmp_path, run_id="killed", sweep_id=NEWER, strategy="paged", qps=16.0, close=False)
    assert any((tmp_path / "serve" / "killed").glob("requests-*.parquet"))
    assert fleet.load_run_rows(tmp_path)["qps"].tolist() == [4.0, 8.0]


def test_a_sweep_with_a_run_row_from_before_max_running_requests_still_has_its_knees(tmp_path):
    write_sweep(tmp_path, NEWER, strategies=("paged",), qps=(4.0, 8.0, 16.0, 32.0))
    as_written_before_max_running(serve_run_dir(tmp_path, f"{NEWER}-paged-16"))  # the knee run, as the reference's
    (paged,) = fleet.knees(fleet.load_run_rows(tmp_path), SLO).to_dict("records")
    assert paged["knee_qps"] == 16.0 and paged["knee_max_running_requests"] >= 1  # its old figure, under its name
    assert pd.isna(paged["knee_max_concurrent_requests"])  # queueing included: never measured then
    assert "max in flight" in "\n".join(fleet.summary_lines(fleet.knees(fleet.load_run_rows(tmp_path), SLO)))


def test_two_sweeps_on_one_curve_are_refused(tmp_path):
    write_sweep(tmp_path, NEWER, strategies=("paged",), qps=(4.0,))
    write_sweep(tmp_path, OLDER, strategies=("paged",), qps=(8.0,))
    both = pd.concat([fleet.load_run_rows(tmp_path, sweep_id=s) for s in (OLDER, NEWER)])
    with pytest.raises(ConfigError, match=r"^runs: 2 sweeps \(20261201-223000, 20261202-090000\)"):
        fleet.knees(both, SLO)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda d: fleet.load_run_rows(d / "empty"), r"^results_dir: no finished serving runs under .*empty/serve"),
        (lambda d: fleet.load_run_rows(d, sweep_id="nope"), r"^sweep_id: no finished runs of 'nope' .*sweeps there: "),
        (lambda d: fleet.fleet(fleet.load_run_rows(d), target_qps=0, ttft_slo_ms=SLO), r"^target_qps: must be a fi"),
        (lambda d: fleet.knees(fleet.load_run_rows(d), "50"), r"^ttft_slo_ms: '50' has no unit"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(sweep_dir, call, message):
    with pytest.raises(ConfigError, match=message) as error:
        call(sweep_dir)
    assert "\n" not in str(error.value)


# --- experiments.capacity mode=fleet --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"target_qps": 0.0, "ttft_slo_ms": SLO}, r"^target_qps: must be a finite number of requests/s > 0, got 0"),
        ({"target_qps": None, "ttft_slo_ms": SLO}, r"^target_qps: must be a finite number"),
        ({"target_qps": 10.0, "ttft_slo_ms": "500"}, r"^ttft_slo_ms: '500' has no unit"),
        ({"target_qps": 10.0, "ttft_slo_ms": None}, r"^ttft_slo_ms: missing"),
    ],
)
def test_the_app_checks_its_fleet_fields_before_any_work(fields, message):
    from experiments.capacity import CapacityConfig

    with pytest.raises(ConfigError, match=message) as error:
        CapacityConfig(mode="fleet", **fields)
    assert "\n" not in str(error.value)


def test_the_app_refuses_a_results_dir_without_runs(tmp_path):
    from experiments.capacity import CapacityConfig, fleet_rows

    with pytest.raises(ConfigError, match=r"^results_dir: no finished serving runs"):
        fleet_rows(CapacityConfig(mode="fleet", target_qps=10.0, ttft_slo_ms=SLO, results_dir=str(tmp_path)))


def test_the_fleet_mode_prints_the_table_and_writes_it(sweep_dir):
    cmd = [sys.executable, "-m", "experiments.capacity", "mode=fleet", "target_qps=100", "ttft_slo_ms=50ms"]
    proc = subprocess.run(
        [*cmd, f"sweep_id={NEWER}", f"results_dir={sweep_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert f"sweep {NEWER}: knee = the highest qps whose p99 TTFT <= 50 ms" in proc.stdout
    groups, header = proc.stdout.splitlines()[2:4]  # the knee and replicas measured, the concurrency predicted
    assert groups.split() == ["measured", "predicted"]
    assert (
        header.index("replicas") < header.index("max running") < header.index("max in flight")
        < groups.index("predicted") < header.rindex("in flight")
    )  # fmt: skip
    written = Path(proc.stdout.strip().splitlines()[-1].removeprefix("written: "))
    assert written.parent == sweep_dir / "capacity" and written.name.startswith("fleet-")
    table = by_strategy(pd.read_parquet(written))
    assert table["paged"]["replicas"] == 7 and table["contiguous"]["replicas"] == 13
