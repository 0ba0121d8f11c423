"""The GPU check: its verdicts on synthetic rows, its stages against their limits, its report, and its dry run.

scripts/gpu_check.sh runs once in a rare 15-minute window on an H200; what can be checked without one is checked
here. The verdicts (experiments.gpu_verdicts) read rows shaped as harness.store.disk.load returns them; the stages'
limits are read from the script itself; the slow test runs the whole script on the CPU (GPU_CHECK_DRY=1) into
tmp_path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments import gpu_check, gpu_stages, sizing
from experiments.gpu_check import stage_predictions
from experiments.gpu_verdicts import (
    bandwidth_verdict,
    fp8_verdict,
    nvml_verdict,
    paged_verdict,
    pd_verdict,
    reduce_overhead_verdict,
    serve_concurrency_verdict,
    verdicts,
)
from experiments.sizing import H200, STAGE_ESTIMATES_S, STAGE_PRESETS, preset_claims, stage_limits
from harness.config import RunConfig
from harness.store import disk, schema, tables

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
TARGETS = ["bandwidth", "paged-overhead", "fp8-long-context", "reduce-overhead", "energy-clocks", "serve-concurrency",
           "pd-transfer"]  # fmt: skip
VERDICT_LINE = re.compile(r"^(PASS|FAIL|N/A)\s+([a-z0-9-]+): \S")
BASE = dict(
    status="ok", error=None, model="llama-3.1-8b", n_kv_heads=8, dtype="bf16", kv_dtype="bf16", cache="contiguous",
    batch_size=1, prompt_len=512, gen_len=64, prefix_len=0, lengths="fixed", weights="dummy", device="cuda",
    runner="kvbench", compile="none", seed=0, tpot_ms=5.0, bw_util=0.83, achieved_bw_gbps=3570.0,
    peak_bw_gbps=4300.0, started_at="2026-12-01T10:00:00+00:00",
)  # fmt: skip


def frame(*rows: dict) -> pd.DataFrame:
    """Rows as harness.store.disk.load returns them: every column of the contract (null where a row says nothing),
    nullable dtypes, plus any column a row adds (one the contract does not have yet: cudagraph_skips, ...)."""
    known = [column.name for column in schema.COLUMNS]
    table = pd.DataFrame([BASE | row for row in rows])
    extras = [name for name in table.columns if name not in known]
    return table.reindex(columns=known + extras).convert_dtypes()


def nvml(samples=200, energy=0.5, sm_min=1980) -> dict:
    return dict(nvml_timed_samples=samples, energy_j_per_token=energy, sm_clock_mhz_min=sm_min)


# --- bandwidth -----------------------------------------------------------------------------------------------------


def test_bandwidth_passes_at_83_percent_of_the_measured_copy_bandwidth():
    verdict = bandwidth_verdict(frame({}))
    assert verdict.line().startswith("PASS  bandwidth: 83% of measured HBM bandwidth at batch 1 in bf16 (target >= 80%")


def test_bandwidth_fails_below_80_percent():
    assert bandwidth_verdict(frame({"bw_util": 0.79})).status == "FAIL"


def test_bandwidth_reads_only_the_contiguous_bf16_batch_1_eager_row():
    rows = frame(
        {"bw_util": 0.5, "batch_size": 8},
        {"bw_util": 0.5, "cache": "paged"},
        {"bw_util": 0.5, "kv_dtype": "fp8_e4m3"},
        {"bw_util": 0.95, "compile": "reduce-overhead"},
        {"bw_util": 0.81},
    )
    assert "81%" in bandwidth_verdict(rows).text


def test_bandwidth_prefers_the_decode_stage_over_the_crossover_at_a_shorter_prompt():
    rows = frame({"bw_util": 0.6, "prompt_len": 32, "stage": "crossover"}, {"bw_util": 0.85, "stage": "decode"})
    assert bandwidth_verdict(rows).status == "PASS"


def test_bandwidth_without_its_row_is_not_applicable_and_with_a_failed_row_fails():
    assert bandwidth_verdict(frame({"cache": "paged"})).status == "N/A"
    failed = bandwidth_verdict(frame({"status": "error", "error": "RuntimeError: boom", "bw_util": None}))
    assert failed.status == "FAIL" and "error: RuntimeError: boom" in failed.text


def test_bandwidth_fails_when_the_row_has_no_ceilings_to_compare_with():
    verdict = bandwidth_verdict(frame({"bw_util": None}))
    assert verdict.status == "FAIL" and "ceilings" in verdict.text


# --- paged against contiguous --------------------------------------------------------------------------------------


def test_paged_within_5_percent_of_contiguous_passes():
    rows = frame({"tpot_ms": 5.0}, {"cache": "paged", "tpot_ms": 5.2, "block_size": 16})
    verdict = paged_verdict(rows)
    assert verdict.status == "PASS" and "+4.0%" in verdict.text


def test_paged_judges_the_worst_of_its_workloads():
    rows = frame(
        {"tpot_ms": 5.0},
        {"cache": "paged", "tpot_ms": 5.0, "block_size": 16},
        {"tpot_ms": 20.0, "kv_dtype": "fp8_e4m3"},
        {"cache": "paged", "tpot_ms": 21.2, "kv_dtype": "fp8_e4m3", "block_size": 16},
    )
    verdict = paged_verdict(rows)
    assert verdict.status == "FAIL" and "+6.0%" in verdict.text and "of 2 workloads" in verdict.text


def test_paged_pairs_only_rows_of_the_same_workload():
    rows = frame({"tpot_ms": 5.0, "batch_size": 1}, {"cache": "paged", "tpot_ms": 50.0, "batch_size": 8})
    assert paged_verdict(rows).status == "N/A"


def test_paged_takes_the_latest_of_a_point_measured_twice():
    rows = frame(
        {"tpot_ms": 5.0},
        {"cache": "paged", "tpot_ms": 9.0, "started_at": "2026-12-01T09:00:00+00:00"},
        {"cache": "paged", "tpot_ms": 5.1, "started_at": "2026-12-01T11:00:00+00:00"},
    )
    assert paged_verdict(rows).status == "PASS"


# --- fp8 at long context -------------------------------------------------------------------------------------------


def long_context(**row) -> dict:
    return dict(batch_size=8, prompt_len=8192, gen_len=16) | row


def test_fp8_faster_than_bf16_in_every_strategy_at_8k_passes():
    rows = frame(
        long_context(tpot_ms=10.0),
        long_context(tpot_ms=8.5, kv_dtype="fp8_e4m3", top1_agreement=0.99),
        long_context(tpot_ms=10.2, cache="paged", block_size=16),
        long_context(tpot_ms=8.8, cache="paged", block_size=16, kv_dtype="fp8_e4m3"),
    )
    verdict = fp8_verdict(rows)
    assert (
        verdict.status == "PASS" and "contiguous 0.85x, top-1 0.990" in verdict.text and "paged 0.86x" in verdict.text
    )


def test_fp8_slower_in_one_strategy_fails():
    rows = frame(
        long_context(tpot_ms=10.0),
        long_context(tpot_ms=8.5, kv_dtype="fp8_e4m3"),
        long_context(tpot_ms=10.0, cache="paged", block_size=16),
        long_context(tpot_ms=10.5, cache="paged", block_size=16, kv_dtype="fp8_e4m3"),
    )
    assert fp8_verdict(rows).status == "FAIL"


def test_fp8_compares_like_strategies_only_and_only_at_long_context():
    across = frame(long_context(tpot_ms=10.0), long_context(tpot_ms=8.0, cache="paged", kv_dtype="fp8_e4m3"))
    assert fp8_verdict(across).status == "N/A"
    short = frame({"tpot_ms": 5.0}, {"tpot_ms": 4.0, "kv_dtype": "fp8_e4m3"})
    assert fp8_verdict(short).status == "N/A"
    assert fp8_verdict(short, long_context_tokens=512).status == "PASS"


# --- CUDA graphs ---------------------------------------------------------------------------------------------------


def test_reduce_overhead_captured_without_skips_passes_and_with_skips_fails():
    assert reduce_overhead_verdict(frame({"compile": "reduce-overhead", "cudagraph_skips": 0})).status == "PASS"
    assert reduce_overhead_verdict(frame({"compile": "reduce-overhead", "cudagraph_skips": 2})).status == "FAIL"


def test_reduce_overhead_without_the_skips_column_is_not_applicable():
    older = frame({"compile": "reduce-overhead"}).drop(columns=["cudagraph_skips"])  # rows from before the column
    verdict = reduce_overhead_verdict(older)
    assert verdict.status == "N/A" and verdict.text == "column missing: cudagraph_skips"


def test_reduce_overhead_unsupported_on_the_cpu_is_not_applicable_but_on_cuda_fails():
    on_cpu = frame({"compile": "reduce-overhead", "device": "cpu", "status": "unsupported", "error": "needs CUDA"})
    assert reduce_overhead_verdict(on_cpu).status == "N/A"
    on_cuda = frame({"compile": "reduce-overhead", "status": "unsupported", "error": "no static decode"})
    assert reduce_overhead_verdict(on_cuda).status == "FAIL"
    assert reduce_overhead_verdict(frame({})).status == "N/A"


# --- NVML in the timed window --------------------------------------------------------------------------------------


def test_nvml_read_in_every_timed_window_passes():
    verdict = nvml_verdict(frame(nvml(), nvml(samples=50, sm_min=1755)))
    assert verdict.status == "PASS" and "at least 50 samples" in verdict.text and "1755 MHz" in verdict.text


def test_nvml_fails_for_a_row_without_samples_or_energy_and_names_it():
    verdict = nvml_verdict(frame(nvml(), nvml(samples=0) | {"stage": "crossover", "batch_size": 512}))
    assert (
        verdict.status == "FAIL" and "1 of 2" in verdict.text and "crossover contiguous bf16 batch 512" in verdict.text
    )
    assert nvml_verdict(frame(nvml(), nvml(energy=None))).status == "FAIL"


def test_nvml_without_its_columns_is_not_applicable_naming_them():
    older = frame({"energy_j_per_token": 0.5}).drop(columns=["nvml_timed_samples", "sm_clock_mhz_min"])
    verdict = nvml_verdict(older)
    assert verdict.status == "N/A" and verdict.text == "column missing: nvml_timed_samples, sm_clock_mhz_min"


def test_nvml_on_cpu_rows_only_is_not_applicable():
    assert nvml_verdict(frame(nvml(samples=None, energy=None, sm_min=None) | {"device": "cpu"})).status == "N/A"


# --- the serve runs' concurrency and the PD transfer ---------------------------------------------------------------


def serve_run(**row) -> dict:
    return dict(kv_dtype="bf16", model="llama-3.1-8b", strategy="paged", completed=96, predicted_max_running=31,
                max_running_requests=31) | row  # fmt: skip


def test_serve_concurrency_passes_when_measured_is_the_prediction_in_every_kv_dtype():
    runs = pd.DataFrame(
        [serve_run(), serve_run(kv_dtype="fp8_e4m3", predicted_max_running=61, max_running_requests=60)]
    )
    verdict = serve_concurrency_verdict(runs)
    assert verdict.status == "PASS" and "bf16 31 of 31; fp8_e4m3 60 of 61" in verdict.text


def test_serve_concurrency_fails_off_the_prediction_or_when_the_pool_does_not_limit():
    assert serve_concurrency_verdict(pd.DataFrame([serve_run(max_running_requests=27)])).status == "FAIL"
    unlimited = serve_concurrency_verdict(pd.DataFrame([serve_run(predicted_max_running=96, max_running_requests=96)]))
    assert unlimited.status == "FAIL" and "not KV-limited" in unlimited.text
    assert serve_concurrency_verdict(pd.DataFrame()).status == "N/A"


def pd_row(**row) -> dict:
    return dict(table="pd", source="measured", status="ok", error=None, outputs_match=True, transport="tcp",
                kv_dtype="bf16", context=4096, kv_bytes=4095 * 131072, transfer_gbps=2.5) | row  # fmt: skip


def test_pd_passes_when_every_measured_point_decodes_the_colocated_tokens():
    extrapolated = pd_row(source="extrapolated: PCI-SIG", outputs_match=None)
    movement = pd.DataFrame([pd_row(), pd_row(transport="shm", transfer_gbps=6.0), pd_row(context=1024), extrapolated,
                             {"table": "tiers"}])  # fmt: skip
    verdict = pd_verdict(movement)
    assert verdict.status == "PASS" and "all 3 points" in verdict.text and "shm 6.0 GB/s" in verdict.text


def test_pd_fails_on_an_error_or_different_outputs_and_without_rows_is_not_applicable():
    assert pd_verdict(pd.DataFrame([pd_row(), pd_row(outputs_match=False)])).status == "FAIL"
    failed = pd_verdict(pd.DataFrame([pd_row(status="error", error="RuntimeError: peer gone", outputs_match=None)]))
    assert failed.status == "FAIL" and "peer gone" in failed.text
    assert pd_verdict(pd.DataFrame([{"table": "tiers", "source": "measured"}])).status == "N/A"


def test_there_is_one_verdict_per_target_in_order_on_an_empty_table():
    found = verdicts(frame({}).iloc[0:0])
    assert [verdict.target for verdict in found] == TARGETS
    assert all(VERDICT_LINE.match(verdict.line()) for verdict in found)


# --- the stages against their limits -------------------------------------------------------------------------------


def test_the_script_has_a_limit_for_every_stage():
    limits = stage_limits(SCRIPT.read_text())
    assert set(limits) == set(STAGE_PRESETS) | set(STAGE_ESTIMATES_S) | set(gpu_stages.STAGE_MODELS)


def test_the_limits_leave_a_rerun_inside_the_window():
    # A 15-minute window: the machine's start (1-2 min), the whole run, and time to rerun a failed stage alone.
    limits = stage_limits(SCRIPT.read_text())
    assert len(limits) == len(STAGE_PRESETS) + len(STAGE_ESTIMATES_S) + len(gpu_stages.STAGE_MODELS)
    assert sum(limits.values()) <= 8.0 * 60
    assert sum(limits.values()) + 5 * len(limits) <= 9 * 60  # every stage run out, each killed 5 s after its limit


@pytest.mark.parametrize("stage", sorted(STAGE_PRESETS))
def test_a_measuring_stage_budget_fits_its_limit(stage):
    # The preset's stated budget bounds its predicted time (tests/analytic/test_presets.py); the limit must hold the budget.
    claims = preset_claims(sizing.CONF / "experiment" / f"{STAGE_PRESETS[stage]}.yaml")
    assert claims.gpu == H200
    assert claims.budget_min * 60 <= stage_limits(SCRIPT.read_text())[stage]


def test_every_stage_is_predicted_within_its_limit():
    limits = stage_limits(SCRIPT.read_text())
    predicted = stage_predictions(gpu=H200)
    over = {stage: round(seconds) for stage, seconds in predicted.items() if seconds > limits[stage]}
    assert not over, f"predicted past the limit (s): {over}; limits {limits}"


def test_the_plan_prints_every_stage_limit_beside_its_prediction():
    table = gpu_check.plan_table()
    assert list(table["stage"]) == list(stage_limits(SCRIPT.read_text()))
    assert table["predicted_s"].notna().all() and (table["predicted_s"] <= table["limit_s"]).all()
    assert dict(zip(table["stage"], table["points"], strict=True))["serve"] == 2  # bf16 and fp8_e4m3


def test_the_serve_stage_is_kv_limited_on_the_gpu():
    # Its verdict compares measured and predicted concurrency: only a pool that caps it says anything.
    plans = gpu_stages.serve_plans(gpu_stages.script_args(SCRIPT.read_text(), "serve"))
    assert [p.kv_dtype for p in plans] == ["bf16", "fp8_e4m3"]
    assert all(p.workload.model_args().name == "llama-3.1-8b" and p.cfg.weights == "dummy" for p in plans)
    assert all(1 < p.predicted_max_running < len(p.requests) <= p.cfg.max_num_seqs for p in plans)
    assert plans[1].predicted_max_running > plans[0].predicted_max_running  # fp8 holds about twice the tokens


def test_a_stage_without_its_arguments_line_is_named():
    with pytest.raises(ValueError, match="no line PD_ARGS"):
        gpu_stages.script_args("SERVE_ARGS=(experiment=serve-gpu-check)\n", "pd")


def decode_point(**fields) -> RunConfig:
    return RunConfig(model={"name": "llama-3.1-8b"}, device="cpu", dtype="bf16", prompt_len=512, gen_len=64,
                     warmup=1, accuracy=False, profile=False, **fields)  # fmt: skip


def test_the_time_model_counts_a_retry_at_twice_max_repeats():
    # A budget of time that never binds: each attempt runs to its cap, 5 repeats then the retry's 10.
    point = decode_point(min_repeats=3, max_repeats=5, max_time_s=1e6)
    generation_s = sizing.generation_seconds(point, gpu=H200)
    unretried = sizing.point_seconds(dataclasses.replace(point, retry_noisy=False), gpu=H200)
    assert sizing.point_seconds(point, gpu=H200) - unretried == pytest.approx(2 * 5 * generation_s)


def test_the_time_model_counts_a_retry_at_twice_max_time_s():
    # Repeats that never bind: the retry stops after twice max_time_s, plus the generation that overruns it.
    point = decode_point(min_repeats=1, max_repeats=10_000, max_time_s=2.0)
    generation_s = sizing.generation_seconds(point, gpu=H200)
    unretried = sizing.point_seconds(dataclasses.replace(point, retry_noisy=False), gpu=H200)
    assert sizing.point_seconds(point, gpu=H200) - unretried == pytest.approx(2 * 2.0 + generation_s)


def test_the_gpu_checks_stages_measure_without_retries():
    # Twice a stage's budget does not fit its limit: its rows say they did not converge, and are not measured again.
    for preset in STAGE_PRESETS.values():
        assert not any(point.retry_noisy for point in sizing.preset_points(preset)), preset


def test_an_unknown_stage_is_one_line_naming_the_allowed_ones(tmp_path):
    env = os.environ | {"GPU_CHECK_STAGES": "decode warp", "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert proc.stderr.strip().splitlines() == [
        "gpu_check: bad GPU_CHECK_STAGES: unknown stage 'warp'; allowed: ceilings decode long-context compile "
        "crossover serve tiers pd tests"
    ]


# --- the report ----------------------------------------------------------------------------------------------------


def test_the_report_merges_every_stage_with_its_name_and_ends_with_the_verdicts(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "stages").mkdir(parents=True)
    (work / "stages.tsv").write_text("stage\tlimit_s\texit\tseconds\ndecode\t55\t0\t40\ncrossover\t45\t124\t45\n")
    for stage, point_id, batch in (("decode", "a1", 1), ("decode", "a2", 1), ("crossover", "b1", 8)):
        row = BASE | {"point_id": point_id, "batch_size": batch}
        disk.write_point(row | {"sweep_id": "s", "cache": "paged" if point_id == "a2" else "contiguous"},
                            work / "stages" / stage / "20261201-100000")  # fmt: skip
    gpu_check.write_report(work=work, out=out, dry=True, long_context_tokens=8192)
    merged = disk.load(out / "rows.parquet")
    assert sorted(zip(merged["stage"], merged["point_id"], strict=True)) == [
        ("crossover", "b1"), ("decode", "a1"), ("decode", "a2")
    ]  # fmt: skip
    lines = (out / "summary.md").read_text().splitlines()
    assert [VERDICT_LINE.match(line).group(2) for line in lines[-len(TARGETS) :]] == TARGETS
    assert any("crossover" in line and "124" in line for line in lines)  # the stage that ran out of time
    assert sorted(p.name for p in out.iterdir()) == ["rows.parquet", "summary.md"]  # no ops, no ceilings stored


def test_the_report_folds_the_tier_and_pd_tables_into_movement_parquet(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "stages").mkdir(parents=True)
    (work / "stages.tsv").write_text("stage\tlimit_s\texit\tseconds\ntiers\t26\t0\t20\npd\t42\t0\t30\n")
    tier = dict(run_id="t", device="cuda", model="llama-3.1-8b", kv_dtype="bf16", tier="host", block_tokens=16,
                block_bytes=2**21, n_blocks=32, gbps=25.0, pinned=True, source="measured")  # fmt: skip
    tiers = pd.DataFrame([tier | {"direction": "d2h"}, tier | {"direction": "h2d", "gbps": 24.0}])
    tables.write_table(tiers, tables.TIER_COLUMNS, work / "stages" / "tiers" / "tiers", prefix=tables.TIER_PREFIX)
    pd_rows = pd.DataFrame([pd_row(run_id="p", transport=kind) for kind in ("tcp", "shm")]).drop(columns="table")
    tables.write_table(pd_rows, tables.PD_COLUMNS, work / "stages" / "pd" / "pd", prefix=tables.PD_PREFIX)
    found = gpu_check.write_report(work=work, out=out, dry=True, long_context_tokens=8192)
    movement = pd.read_parquet(out / "movement.parquet")
    assert (
        sorted(zip(movement["table"], movement["stage"], strict=True)) == [("pd", "pd")] * 2 + [("tiers", "tiers")] * 2
    )
    assert movement.loc[movement["table"] == "tiers", "block_tokens"].tolist() == [16, 16]  # integers, not 16.0
    assert [v.status for v in found if v.target == "pd-transfer"] == ["PASS"]
    summary = (out / "summary.md").read_text()
    assert "## Tiers:" in summary and "## PD:" in summary and "## Serving" not in summary  # no serve run
    assert sorted(p.name for p in out.iterdir()) == ["movement.parquet", "rows.parquet", "summary.md"]


# --- the dry run ---------------------------------------------------------------------------------------------------

NAME = re.compile(r"[A-Za-z0-9._-]+")


@pytest.mark.slow
def test_the_dry_run_passes_on_the_cpu_and_brings_back_what_the_device_would(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = os.environ | {"GPU_CHECK_DRY": "1", "OUT": str(out), "GPU_CHECK_WORK": str(work), "PYTHON": sys.executable}
    env.pop("GPU_CHECK_STAGES", None)
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    stages = pd.read_csv(work / "stages.tsv", sep="\t", dtype=str)
    assert list(stages["stage"]) == [
        "setup",
        "ceilings",
        "decode",
        "long-context",
        "compile",
        "crossover",
        "serve",
        "tiers",
        "pd",
        "tests",
        "report",
    ]
    assert (stages["exit"] == "0").all(), stages
    # What the device brings back: at most 8 files, at most two folders deep, named in [A-Za-z0-9._-] alone.
    files = [path.relative_to(out) for path in out.rglob("*") if path.is_file()]
    assert 0 < len(files) <= 8
    assert all(len(path.parts) <= 3 and all(NAME.fullmatch(part) for part in path.parts) for path in files)
    assert (out / "gpu_check.log").stat().st_size > 0
    merged, every = disk.load(out / "rows.parquet"), disk.load(work / "stages")
    assert len(merged) == len(every) > 0 and sorted(merged["point_id"]) == sorted(every["point_id"])
    assert set(merged["stage"]) == {"decode", "long-context", "compile", "crossover"}
    # The serve, tiers and pd stages, folded into two files: the run rows, and the tier and PD tables.
    runs = pd.read_parquet(out / "serve.parquet")
    assert sorted(runs["kv_dtype"]) == ["bf16", "fp8_e4m3"] and (runs["completed"] == 16).all()
    assert (runs["predicted_max_running"] < runs["completed"]).all()  # the tiny pool still limits the dry stream
    movement = pd.read_parquet(out / "movement.parquet")
    tiers, transfers = (movement[movement["table"] == name] for name in ("tiers", "pd"))
    assert set(tiers["direction"]) == {"d2h", "h2d", "write", "read"} and (tiers["gbps"] > 0).all()
    measured = transfers[transfers["source"] == "measured"]
    assert sorted(set(measured["transport"])) == ["shm", "tcp"] and measured["outputs_match"].all()
    assert "tier_gbps" in json.dumps(json.loads((out / "ceilings.json").read_text()))
    lines = (out / "summary.md").read_text().splitlines()
    found = [VERDICT_LINE.match(line) for line in lines]
    assert [match.group(2) for match in found if match] == TARGETS  # one line per target, nowhere else
    assert all(found[-len(TARGETS) :])  # and they end the file
