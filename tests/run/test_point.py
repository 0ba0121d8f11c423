"""One point measured in-process: the row's columns, whatever the device."""

from __future__ import annotations

import dataclasses
import statistics

from harness.config import RunConfig
from harness.measure import stats
from harness.measure.timing import STOP_REASONS
from harness.run.point import run_point
from harness.run.runner import ensure_ceilings
from harness.store.schema import COLUMNS

FAST = dict(warmup=0, min_repeats=1, max_repeats=1, isolate=False)


def test_every_key_of_a_row_is_a_column_of_the_contract():
    result = run_point(RunConfig(model={"name": "tiny"}, device="cpu", prompt_len=8, gen_len=4, **FAST))
    row, top_ops = result.row, result.ops  # the profiler's table travels beside the row, to its own parquet
    assert {"op", "category", "self_time_ms"} <= set(top_ops.columns)
    assert set(row) <= {column.name for column in COLUMNS}


def test_a_row_carries_the_roofline_and_the_profile(tmp_path):
    cfg = RunConfig(
        model={"name": "small"}, device="cpu", dtype="fp32", prompt_len=32, gen_len=6, results_dir=str(tmp_path), **FAST
    )
    row = run_point(cfg).row
    # every weight is read once per step, except the embedding table, of which only the batch's rows
    assert row["flops_per_step"] > 0 and row["bytes_per_step"] > row["weights_bytes"] * 0.8
    assert row["achieved_bw_gbps"] > 0 and row["bound"] is None  # no ceilings measured yet: no verdict
    shares = [row[f"prof_{c}_frac"] for c in ("attention", "gemm", "norm_elementwise", "kv", "sampling", "other")]
    assert abs(sum(shares) - 1) < 1e-6 and row["prof_gemm_frac"] > 0.3

    ensure_ceilings(dataclasses.replace(cfg, ceilings_quick=True))
    row = run_point(cfg).row
    assert row["bound"] in {"memory", "compute"} and row["peak_bw_gbps"] > 0 and row["ceilings_fingerprint"]
    assert row["bw_util"] > 0 and row["predicted_tpot_ms"] > 0


def test_energy_clock_and_nvml_columns_are_null_on_the_cpu_and_peak_memory_is_rss():
    row = run_point(RunConfig(model={"name": "tiny"}, device="cpu", prompt_len=8, gen_len=4, **FAST)).row
    for column in (
        "energy_j_per_token",
        "mean_power_w",
        "sm_clock_mhz_min",
        "sm_clock_mhz_max",
        "mem_clock_mhz_min",
        "mem_clock_mhz_max",
        "throttle_reasons",
        "nvml_timed_samples",
        "nvml_error",
    ):
        assert column in row and row[column] is None
    assert row["peak_mem_source"] == "rss"


def test_a_row_keeps_its_repeats_samples_and_says_whether_they_converged():
    cfg = RunConfig(model={"name": "tiny"}, device="cpu", dtype="fp32", prompt_len=8, gen_len=4, warmup=1,
                    min_repeats=3, max_repeats=4, profile=False, roofline=False, isolate=False)  # fmt: skip
    row = run_point(cfg).row
    assert len(row["tpot_samples_ms"]) == len(row["ttft_samples_ms"]) == row["repeats"]
    assert row["tpot_ms"] == statistics.median(row["tpot_samples_ms"])
    assert row["ttft_ms"] == statistics.median(row["ttft_samples_ms"])
    assert row["tpot_rse"] == stats.median_rse(row["tpot_samples_ms"])
    assert row["converged"] == (row["stop_reason"] == "target") == (row["tpot_rse"] < cfg.target_rse)
    assert row["stop_reason"] in STOP_REASONS and row["retries"] in (0, 1)
    # A first attempt that did not converge was retried; the retry may have converged or not.
    assert row["retries"] == 1 or row["converged"]
    assert 0.0 <= row["host_other_cpu_frac"] <= 1.0 and isinstance(row["host_busy"], bool)
