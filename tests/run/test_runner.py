"""The run layer's contract: a point's result is its row and its top-ops table apart, a failure is a row, and the
warm worker belongs to a Runner that its owner closes (the library keeps none of its own)."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.config import RunConfig
from harness.run import point, runner
from harness.run.point_result import PointResult
from harness.store.schema import COLUMNS

POINT = dict(model={"name": "tiny"}, device="cpu", dtype="fp32", prompt_len=8, gen_len=4, warmup=0, min_repeats=1,
             max_repeats=1, roofline=False, accuracy=False)  # fmt: skip


def test_a_profiled_point_returns_its_row_and_its_top_ops_table_apart():
    result = runner.run_point(RunConfig(**POINT, isolate=False))
    assert isinstance(result, PointResult)
    assert result.row["status"] == "ok", result.row.get("error")
    assert set(result.row) <= {column.name for column in COLUMNS}  # nothing but columns: no table inside
    assert isinstance(result.ops, pd.DataFrame) and {"op", "category", "self_time_ms"} <= set(result.ops.columns)


def test_a_point_not_profiled_has_no_ops_table():
    result = runner.run_point(RunConfig(**POINT, profile=False, isolate=False))
    assert result.row["status"] == "ok" and result.ops is None


@pytest.mark.parametrize(("raised", "status"), [(RuntimeError("boom"), "error"), (MemoryError("no room"), "oom")])
def test_a_failed_point_is_a_result_whose_row_says_why(monkeypatch, raised, status):
    def build_model(*args, **kwargs):
        raise raised

    monkeypatch.setattr(point, "build_model", build_model)
    result = runner.run_point(RunConfig(**POINT, isolate=False))
    assert result.row["status"] == status and str(raised) in result.row["error"] and result.ops is None
    assert result.row["point_id"] == RunConfig(**POINT).point_id()


def test_point_columns_are_the_config_and_environment_before_anything_is_measured():
    cfg = RunConfig(**POINT)
    columns = runner.point_columns(cfg)
    assert columns["point_id"] == cfg.point_id() and columns["model"] == "tiny" and columns["device_name"]
    assert "status" not in columns and "error" not in columns and "tpot_ms" not in columns
    assert runner.failure_row(cfg, "oom", "out of memory") == columns | {"status": "oom", "error": "out of memory"}


def test_the_run_layer_keeps_no_worker_of_its_own():
    assert not [name for name, value in vars(runner).items() if isinstance(value, runner.Worker)]
    assert not hasattr(runner, "_warm")


@pytest.mark.slow
def test_a_result_crosses_the_workers_pipe_with_its_ops_table_and_closing_the_runner_ends_the_worker():
    with runner.Runner() as points:
        result = points.run_point(RunConfig(**POINT))  # isolated: measured in a spawned worker
        worker = points.warm
        assert result.row["status"] == "ok", result.row.get("error")
        assert isinstance(result.ops, pd.DataFrame) and len(result.ops) > 0
        assert worker is not None and worker.alive()  # kept warm for the next point
    assert points.warm is None and not worker.alive()
