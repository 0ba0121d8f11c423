"""The capacity app (experiments.capacity): its plan mode and one-line refusal, the frontier search from any
prediction, and the OOM frontier the planner predicts (slow) and the CUDA peak (gpu)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.capacity import CapacityConfig, find_frontier
from harness.analytic import ledger as planner
from harness.config import RunConfig, Workload

ROOT = Path(__file__).parents[2]


def capacity_app(*overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.capacity", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_the_plan_mode_prints_the_ledger_for_a_gpu(tmp_path):
    proc = capacity_app(
        "mode=plan",
        "model=llama-3.1-8b",
        "dtype=bf16",
        "kv_dtype=fp8_e4m3",
        "prompt_len=8192",
        "gen_len=1024",
        "concurrency=32",
        "memory_gb=141",
        "device=cuda",  # planned from any machine: memory_gb and the runtime are given
        "runtime_overhead_gb=1",
        f"results_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "llama-3.1-8b: bf16 weights, fp8_e4m3 KV" in proc.stdout
    assert "max concurrency at 9216 tokens: " in proc.stdout and "max context at 32 concurrent: " in proc.stdout


def test_the_app_rejects_a_weights_overflow_in_one_line(tmp_path):
    proc = capacity_app(
        "mode=plan",
        "model=llama-3.1-8b",
        "memory_gb=4",
        "device=cpu",
        "runtime_overhead_gb=0",
        f"results_dir={tmp_path}",
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("kvbench: bad config: memory_gb: 4.00 GiB cannot hold llama-3.1-8b's")
    assert len(proc.stderr.strip().splitlines()) == 1


# --- against measured memory ----------------------------------------------------------------------------------------


def fake_probe(frontier: int, seen: list[int]):
    """A probe that fits up to `frontier` and records what it was asked."""

    def probe(cfg: RunConfig) -> dict:
        seen.append(cfg.batch_size)
        return {"status": "ok" if cfg.batch_size <= frontier else "oom", "peak_mem_bytes": 1, "mem_baseline_bytes": 0}

    return probe


@pytest.mark.parametrize("predicted", [1, 30, 37, 38, 90, 4096])
def test_the_frontier_search_finds_the_largest_batch_that_fits_from_any_prediction(predicted):
    seen: list[int] = []
    cfg = CapacityConfig(model={"name": "tiny"}, contexts=[256])
    found = find_frontier(cfg, context=256, predicted=predicted, probe=fake_probe(37, seen))
    assert (found["measured_max_batch"], found["first_oom_batch"], found["bisection_step"]) == (37, 38, 1)
    assert found["probes"] == len(seen) == len(set(seen)) and seen[0] == min(predicted, cfg.max_batch)


def test_an_exact_prediction_costs_two_probes():
    seen: list[int] = []
    find_frontier(CapacityConfig(model={"name": "tiny"}), context=512, predicted=37, probe=fake_probe(37, seen))
    assert seen == [37, 38]


def test_a_coarser_resolution_stops_at_a_wider_bracket():
    seen: list[int] = []
    cfg = CapacityConfig(model={"name": "tiny"}, resolution=0.1)
    found = find_frontier(cfg, context=512, predicted=300, probe=fake_probe(371, seen))
    assert found["measured_max_batch"] <= 371 < found["first_oom_batch"]
    assert found["bisection_step"] <= 0.1 * found["measured_max_batch"]


def test_when_nothing_fits_the_frontier_is_zero():
    found = find_frontier(CapacityConfig(model={"name": "tiny"}), context=512, predicted=3, probe=fake_probe(0, []))
    assert (found["measured_max_batch"], found["first_oom_batch"]) == (0, 1)


@pytest.mark.slow
def test_the_oom_frontier_is_within_one_bisection_step_of_the_prediction(tmp_path):
    # The tiny model: each probe is a spawned child that runs or OOMs in seconds. At 8192 tokens one request is
    # 27 MiB, well above the few MiB the runtime's measurement varies by, so one batch is a fair step. One context:
    # each costs a bisection of spawned probes (about a minute here); the planner's tests cover many.
    overrides = ["model=tiny", "dtype=fp32", "contexts=[8192]", "max_memory_gb=0.6", f"results_dir={tmp_path}"]
    proc = capacity_app(*overrides, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (written,) = (tmp_path / "capacity").glob("frontier-*.parquet")
    table = pd.read_parquet(written)
    assert list(table["context"]) == [8192]
    assert (table["measured_max_batch"] > 5).all()  # a real frontier, well above one request
    assert (table["bisection_step"] == 1).all()
    assert (table["first_oom_batch"] - table["measured_max_batch"] == table["bisection_step"]).all()
    assert table["within_step"].all(), table.to_string()


@pytest.mark.gpu
def test_the_planner_is_within_5_percent_of_the_cuda_allocator_peak():
    cfg = RunConfig(
        model={"name": "llama-3.2-1b"},
        device="cuda",
        dtype="bf16",
        batch_size=8,
        prompt_len=1024,
        gen_len=16,
        warmup=0,
        min_repeats=1,
        max_repeats=1,
        accuracy=False,
    )
    from harness.run.runner import run_point

    row = run_point(cfg).row
    assert row["status"] == "ok", row.get("error")
    workload = Workload("llama-3.2-1b", dtype="bf16", prompt_len=1024, gen_len=16, batch_size=8)
    predicted = planner.total_bytes(workload, runtime_overhead_bytes=0)  # what the allocator holds
    assert abs(predicted - row["torch_peak_allocated_bytes"]) <= 0.05 * row["torch_peak_allocated_bytes"]
