"""A serving run's tables on disk (harness.serve.rows): parts flushed as the run goes, the run row written last.

Rows come from the real producers: metrics.request_row over hand-built RequestRecords, and iteration_row over a
small scheduler.simulate run. Values round-trip exactly: float64 and int64 go to parquet and back unchanged.
"""

from __future__ import annotations

import datetime as dt
import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.errors import ConfigError
from harness.serve.dataset import dataset_columns
from harness.serve.kv_manager import make_kv_manager
from harness.serve.metrics import RequestRecord, request_row, run_metrics
from harness.serve.requests import Request
from harness.serve.rows import (
    FAILED,
    FINISHED,
    MANIFEST_FILE,
    RUN_FILE,
    RUNNING,
    ServeRunWriter,
    iteration_row,
    load_run,
    read_manifest,
    read_run_table,
    serve_run_dir,
)
from harness.serve.scheduler import Scheduler, SchedulerConfig, simulate
from tests.serve.serve_runs import as_written_before_max_running

CONFIG = {"strategy": "paged", "qps": 4.0, "kv_memory_gb": 0.5}
# The run row's context columns (rows.RUN_CONTEXT), as the engine fills them.
CONTEXT = {
    "sweep_id": "20261201-120000", "engine": "kvbench", "strategy": "paged", "kv_dtype": "fp32", "model": "tiny", "device": "cpu",
    "qps": float("inf"), "num_blocks": 64, "block_size": 16, "kv_budget_bytes": 2**20, "max_num_seqs": 4,
    "max_num_batched_tokens": 16, "num_iterations": 9,
    "predicted_max_running": None, "mean_kv_utilization": 0.25, "peak_kv_utilization": 0.5, "mean_step_ms": 3.0,
    "mean_scheduler_ms": 0.1, **dataset_columns("random"),
}  # fmt: skip


def records(count: int = 3) -> list[RequestRecord]:
    """count requests; the first has a one-token output (no TPOT, no ITL), the others a few tokens."""
    made = [
        RequestRecord("r0", arrival_s=0.0, first_scheduled_s=0.01, token_times_s=(0.05,), finished_s=0.05, prompt_len=7)
    ]
    for i in range(1, count):
        times = tuple(0.1 * i + 0.013 * k for k in range(1, i + 2))
        made.append(
            RequestRecord(
                f"r{i}",
                arrival_s=0.1 * i - 0.05,
                first_scheduled_s=0.1 * i,
                token_times_s=times,
                finished_s=times[-1],
                prompt_len=10 + i,
                prefix_hit_tokens=i,
                preemptions=i % 2,
            )
        )
    return made


def step_time_s(output) -> float:
    """A step costs a fixed launch plus a per-token term (tests/serve/test_serve_scheduler.py's)."""
    return 1e-3 + 1e-5 * output.total_num_scheduled_tokens


def plain(frame: pd.DataFrame) -> list[dict]:
    """The frame's rows as dicts, a missing figure (NaN, pd.NA) as None, as request_row writes it."""
    return frame.astype(object).where(frame.notna(), None).to_dict("records")


def simulated_iterations() -> list[dict]:
    kv = make_kv_manager("paged", num_blocks=8, block_size=4, max_model_len=32, sliding_window=None)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32), kv)
    requests = [Request(request_id=i, arrival_s=0.001 * i, prompt_len=9 + i, output_len=3) for i in range(3)]
    simulation = simulate(requests, scheduler, step_time_s)
    return [
        iteration_row(i, output, step_time_s(output), kv_bytes_per_token=512.0)
        for i, output in enumerate(simulation.iterations)
    ]


@pytest.fixture
def run_dir(tmp_path):
    return serve_run_dir(tmp_path, "run-1")


def test_rows_round_trip_with_their_values_and_types(run_dir):
    requests = [request_row(record) for record in records()]
    iterations = simulated_iterations()
    assert any(row["kv_used_blocks"] for row in iterations) and len(iterations) > 3
    run_row = {**run_metrics(records(), duration_s=1.0, ttft_slo_ms=200), **CONTEXT}
    # flush_every=1: r0's part alone has tpot_ms all null, which only an explicit schema keeps float64.
    with ServeRunWriter(run_dir, flush_every=1) as writer:
        for row in requests:
            writer.add_request(row)
        for row in iterations:
            writer.add_iteration(row)
        writer.close(run_row, config=CONFIG)

    requests_df, iterations_df, loaded_run = load_run(run_dir)
    assert plain(requests_df) == [{"run_id": "run-1", **row} for row in requests]
    assert plain(iterations_df) == [{"run_id": "run-1", **row} for row in iterations]
    assert loaded_run == {"run_id": "run-1", "config_json": loaded_run["config_json"], **run_row}
    assert json.loads(loaded_run["config_json"]) == CONFIG
    assert requests_df["tpot_ms"].dtype == "float64" and pd.isna(requests_df["tpot_ms"].iloc[0])
    assert requests_df["prompt_len"].dtype == "Int64" and requests_df["itl_ms"].iloc[0] == []
    assert iterations_df["kv_used_blocks"].dtype == "Int64" and iterations_df["step_ms"].dtype == "float64"
    assert (iterations_df["kv_allocated_bytes"] == iterations_df["kv_allocated_tokens"] * 512.0).all()


def test_an_iteration_without_bytes_per_token_has_null_bytes(run_dir):
    row = iteration_row(0, simulate_one_output(), step_s=1e-3)
    with ServeRunWriter(run_dir) as writer:
        writer.add_iteration(row)
    _, iterations, _ = load_run(run_dir)
    assert iterations["kv_live_bytes"].isna().all() and iterations["kv_live_tokens"].notna().all()


def test_flush_every_two_makes_three_parts_in_request_order(run_dir):
    with ServeRunWriter(run_dir, flush_every=2) as writer:
        for record in records(5):
            writer.add_request(request_row(record))
    assert sorted(path.name for path in run_dir.glob("requests-*.parquet")) == [
        "requests-00000.parquet",
        "requests-00001.parquet",
        "requests-00002.parquet",
    ]
    assert load_run(run_dir)[0]["request_id"].tolist() == ["r0", "r1", "r2", "r3", "r4"]


def test_a_run_killed_midway_loads_its_flushed_requests_and_no_run_row(run_dir):
    writer = ServeRunWriter(run_dir, flush_every=2)
    for record in records(5):
        writer.add_request(request_row(record))
    del writer  # killed: no close, no __exit__, r4 still in the buffer
    requests_df, iterations_df, run_row = load_run(run_dir)
    assert requests_df["request_id"].tolist() == ["r0", "r1", "r2", "r3"]
    assert iterations_df.empty and "kv_used_blocks" in iterations_df.columns
    assert run_row is None


def test_an_exception_in_the_block_keeps_every_row_and_writes_no_run_row(run_dir):
    with pytest.raises(RuntimeError, match="engine died"), ServeRunWriter(run_dir, flush_every=2) as writer:
        for record in records(3):
            writer.add_request(request_row(record))
        raise RuntimeError("engine died")
    requests_df, _, run_row = load_run(run_dir)
    assert requests_df["request_id"].tolist() == ["r0", "r1", "r2"]  # r2 was buffered: __exit__ flushed it
    assert run_row is None and not (run_dir / "run.parquet").exists()


def test_a_hidden_temp_file_is_ignored(run_dir):
    with ServeRunWriter(run_dir, flush_every=1) as writer:
        writer.add_request(request_row(records(1)[0]))
    (run_dir / ".requests-00001.parquet.tmp-123-abcdef01").write_bytes(b"half a parquet file")
    (run_dir / ".requests-00001.parquet").write_bytes(b"an editor's leftover")
    assert load_run(run_dir)[0]["request_id"].tolist() == ["r0"]


def test_an_unknown_column_is_named(run_dir):
    writer = ServeRunWriter(run_dir)
    with pytest.raises(ValueError, match="unknown column 'ttft_s'"):
        writer.add_request({**request_row(records(1)[0]), "ttft_s": 0.05})
    row = iteration_row(0, simulate_one_output(), step_s=1e-3)
    del row["kv_free_blocks"]
    with pytest.raises(ValueError, match="missing column 'kv_free_blocks'"):
        writer.add_iteration(row)
    with pytest.raises(ValueError, match="unknown column 'throughput'"):
        writer.close({**run_metrics(records(), duration_s=1.0), **CONTEXT, "throughput": 1.0}, config=CONFIG)


def simulate_one_output():
    kv = make_kv_manager("paged", num_blocks=4, block_size=4, max_model_len=8, sliding_window=None)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1, max_model_len=8), kv)
    simulation = simulate([Request(request_id=0, arrival_s=0.0, prompt_len=2, output_len=1)], scheduler, lambda _: 1e-3)
    return simulation.iterations[0]


def test_a_folder_that_already_holds_a_run_is_refused(run_dir):
    with ServeRunWriter(run_dir, flush_every=1) as writer:
        writer.add_request(request_row(records(1)[0]))
    with pytest.raises(ConfigError, match="run_id: .* already holds a serving run"):
        ServeRunWriter(run_dir)


def test_a_part_written_before_a_nullable_column_existed_loads_it_as_null(run_dir):
    row = iteration_row(0, simulate_one_output(), step_s=1e-3, kv_bytes_per_token=2.0)
    with ServeRunWriter(run_dir) as writer:
        writer.add_iteration(row)
    part = run_dir / "iterations-00000.parquet"
    pq.write_table(pq.read_table(part).drop_columns(["kv_live_bytes", "kv_allocated_bytes"]), part)  # an older part
    _, iterations, _ = load_run(run_dir)
    assert iterations["kv_live_bytes"].isna().all() and len(iterations) == 1
    pq.write_table(pq.read_table(part).drop_columns(["kv_live_tokens"]), part)  # a required column: not a part
    with pytest.raises(ValueError, match="not a iterations part"):
        load_run(run_dir)


# ------------------------------------------------------------------------------------------------------- manifest


def test_start_writes_a_manifest_running_with_the_config_and_start_time_before_any_part(run_dir):
    ServeRunWriter(run_dir).start(config=CONFIG)  # then killed: no part, no close, no __exit__
    manifest = read_manifest(run_dir)
    assert manifest["status"] == RUNNING and manifest["config"] == CONFIG and manifest["run_id"] == "run-1"
    started = dt.datetime.fromisoformat(manifest["started_at"])
    assert started.tzinfo is not None and abs(dt.datetime.now(dt.timezone.utc) - started) < dt.timedelta(minutes=1)
    assert manifest["ended_at"] is None and manifest["error"] is None
    assert sorted(path.name for path in run_dir.iterdir()) == [MANIFEST_FILE]  # no temp file left behind
    requests_df, iterations_df, run_row = load_run(run_dir)
    assert requests_df.empty and iterations_df.empty and run_row is None


def test_close_marks_the_manifest_finished_and_keeps_its_start_time(run_dir):
    with ServeRunWriter(run_dir) as writer:
        writer.start(config=CONFIG)
        started_at = read_manifest(run_dir)["started_at"]
        writer.add_request(request_row(records(1)[0]))
        writer.close({**run_metrics(records(1), duration_s=1.0), **CONTEXT}, config=CONFIG)
    manifest = read_manifest(run_dir)
    assert manifest["status"] == FINISHED and manifest["started_at"] == started_at and manifest["ended_at"]
    assert manifest["config"] == CONFIG and manifest["error"] is None


def test_an_exception_in_the_block_marks_the_manifest_failed_naming_it(run_dir):
    with pytest.raises(RuntimeError, match="engine died"), ServeRunWriter(run_dir) as writer:
        writer.start(config=CONFIG)
        raise RuntimeError("engine died")
    manifest = read_manifest(run_dir)
    assert manifest["status"] == FAILED and manifest["error"] == "RuntimeError: engine died"
    assert manifest["config"] == CONFIG and manifest["ended_at"]


def test_a_folder_holding_only_the_manifest_of_a_run_killed_at_its_start_is_refused(run_dir):
    ServeRunWriter(run_dir).start(config=CONFIG)
    with pytest.raises(ConfigError, match="run_id: .* already holds a serving run"):
        ServeRunWriter(run_dir)


def test_a_run_without_a_manifest_reads_as_none_and_a_garbled_one_is_named(run_dir):
    with ServeRunWriter(run_dir) as writer:  # written before manifests, as the committed reference runs were
        writer.add_request(request_row(records(1)[0]))
    assert read_manifest(run_dir) is None
    (run_dir / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=f"{MANIFEST_FILE}: not a readable manifest"):
        read_manifest(run_dir)


def test_with_a_skipped_list_an_unreadable_part_is_named_and_every_other_part_loads(run_dir):
    with ServeRunWriter(run_dir, flush_every=1) as writer:
        for record in records(3):
            writer.add_request(request_row(record))
    bad = run_dir / "requests-00001.parquet"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated: no footer
    with pytest.raises(ValueError, match="requests-00001.parquet: not a requests part"):
        load_run(run_dir)
    skipped: list[str] = []
    requests_df, _, _ = load_run(run_dir, skipped=skipped)
    assert requests_df["request_id"].tolist() == ["r0", "r2"]
    assert [line.partition(": ")[0] for line in skipped] == [str(bad)]


def test_a_run_row_written_before_the_scheduler_caps_were_recorded_loads_them_as_null(run_dir):
    with ServeRunWriter(run_dir) as writer:
        writer.close({**run_metrics(records(), duration_s=1.0), **CONTEXT}, config=CONFIG)
    path = run_dir / RUN_FILE
    pq.write_table(pq.read_table(path).drop_columns(["max_num_seqs", "max_num_batched_tokens"]), path)  # as before
    _, _, loaded = load_run(run_dir)
    assert loaded["max_num_seqs"] is None and loaded["max_num_batched_tokens"] is None
    assert loaded["block_size"] == 16 and loaded["completed"] == 3
    assert read_run_table(path).schema.field("max_num_seqs").type == pa.int64()


def test_a_run_row_written_before_max_running_requests_loads_its_old_figure_under_that_name(run_dir):
    run_row = {**run_metrics(records(), duration_s=1.0), **CONTEXT}
    with ServeRunWriter(run_dir) as writer:
        writer.close(run_row, config=CONFIG)
    as_written_before_max_running(run_dir)  # as the committed reference's: max_concurrent_requests counted running
    assert "max_running_requests" not in pq.read_table(run_dir / RUN_FILE).column_names
    _, _, loaded = load_run(run_dir)
    assert loaded["max_running_requests"] == run_row["max_running_requests"]  # what the old column counted
    assert loaded["max_concurrent_requests"] is None  # queueing included: never measured then
    assert read_run_table(run_dir / RUN_FILE).schema.field("max_concurrent_requests").type == pa.int64()
