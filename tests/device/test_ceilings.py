"""Measured device ceilings: sane figures, stored once per device fingerprint and reused, specs with sources."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.device import bandwidth, ceiling_report, ceiling_timing, ceilings
from harness.device.ceilings import Ceilings

ROOT = Path(__file__).parents[2]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def quick_cpu() -> Ceilings:
    return ceilings.measure(CPU, quick=True)


def refuse_to_measure(*args, **kwargs):
    raise AssertionError("measured again although this device's ceilings were stored")


def test_quick_cpu_measures_both_the_read_and_the_copy_roof_with_their_spread(quick_cpu):
    # Generous sanity bounds for a small shared CPU box, not performance targets.
    for gbps in (quick_cpu.read_bw_gbps, quick_cpu.peak_bw_gbps):
        assert gbps is not None and math.isfinite(gbps) and 0.1 < gbps < 2000
    for roof in ("read", "copy"):
        assert 0 <= quick_cpu.median_rse[roof] < math.inf
        assert quick_cpu.repeats[roof] == ceilings.QUICK.repeats
        assert 1 <= quick_cpu.tries[roof] <= bandwidth.MAX_TRIES
    assert quick_cpu.copy_bytes > bandwidth.last_level_cache_bytes(CPU)  # streams from memory, not from cache


def test_quick_cpu_fp32_tflops_are_positive_finite_and_plausible(quick_cpu):
    fp32 = quick_cpu.peak_tflops["fp32"]
    assert math.isfinite(fp32) and 0 < fp32 < 50
    assert quick_cpu.matmul_n["fp32"] >= ceilings.CPU_MATMUL_N_MIN


def test_cpu_skips_fp8_and_says_why(quick_cpu):
    assert "fp8_e4m3" not in quick_cpu.peak_tflops
    assert "cpu" in quick_cpu.skipped["fp8_e4m3"]


def test_cpu_ceilings_record_the_device_and_the_method(quick_cpu):
    assert quick_cpu.device == "cpu" and quick_cpu.n_threads == torch.get_num_threads() and quick_cpu.n_sms is None
    assert quick_cpu.quick and quick_cpu.fingerprint == ceilings.device_fingerprint(CPU)
    assert quick_cpu.method_version == ceilings.METHOD_VERSION == 3
    assert all(n >= 3 for n in quick_cpu.repeats.values())
    assert quick_cpu.measured_at.endswith("+00:00")


class TickingCalls:
    """fn() for the warm-up: each call advances a fake clock by `call_s`."""

    def __init__(self, call_s: float) -> None:
        self.call_s, self.now_s, self.calls = call_s, 0.0, 0

    def __call__(self) -> None:
        self.calls += 1
        self.now_s += self.call_s

    def clock(self) -> float:
        return self.now_s


def test_the_warm_up_goes_on_until_its_time_has_passed_not_just_its_count():
    fn = TickingCalls(call_s=0.125)  # a fast call: a fixed two would end after 0.25 s, clocks still ramping
    calls = ceiling_timing.warm_up(fn, CPU, min_calls=2, min_seconds=0.5, clock=fn.clock)
    assert calls == fn.calls == 4 and fn.now_s == 0.5


def test_the_warm_up_runs_at_least_its_count_however_slow_the_calls():
    fn = TickingCalls(call_s=10.0)
    assert ceiling_timing.warm_up(fn, CPU, min_calls=3, min_seconds=0.5, clock=fn.clock) == 3


def test_the_copy_the_read_and_the_matmul_all_warm_up_for_the_plan_s_time(monkeypatch):
    warm_ups = []

    def recording_warm_up(fn, device, *, min_calls, min_seconds):
        fn()
        warm_ups.append((min_calls, min_seconds))
        return 1

    monkeypatch.setattr(ceiling_timing, "warm_up", recording_warm_up)
    bandwidth.copy_once(CPU, ceilings.QUICK)
    bandwidth.read_once(CPU, ceilings.QUICK)
    ceilings.matmul_throughput(CPU, "fp32", ceilings.QUICK)
    assert warm_ups == [(ceilings.QUICK.warmup, ceilings.QUICK.warmup_s)] * 3
    assert ceilings.FULL.warmup_s >= 0.3  # a few hundred milliseconds: a GPU's ramp from idle to boost clocks


def test_json_round_trip_gives_equal_ceilings(quick_cpu):
    assert Ceilings.from_json(quick_cpu.to_json()) == quick_cpu


def method_2_json(current: Ceilings) -> str:
    """What METHOD_VERSION 2 stored: the same fields less the read roof and the tries."""
    stored = json.loads(current.to_json())
    del stored["read_bw_gbps"], stored["tries"]
    stored["median_rse"].pop("read")
    stored["repeats"].pop("read")
    return json.dumps(stored | {"method_version": 2})


def test_ceilings_stored_by_method_2_still_load_without_a_read_roof(quick_cpu):
    old = Ceilings.from_json(method_2_json(quick_cpu))
    assert old.read_bw_gbps is None and old.tries == {} and old.method_version == 2
    assert old.peak_bw_gbps == quick_cpu.peak_bw_gbps


def test_ceilings_stored_by_method_2_are_measured_again(tmp_path, monkeypatch, quick_cpu):
    path = ceilings.ceilings_path("cpu", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(method_2_json(quick_cpu))
    monkeypatch.setattr(ceilings, "measure", lambda device, quick=False: quick_cpu)
    assert ceilings.load_or_measure("cpu", tmp_path, quick=True) == quick_cpu
    assert Ceilings.from_json(path.read_text()).read_bw_gbps == quick_cpu.read_bw_gbps  # stored in its place


def test_the_method_version_is_part_of_the_fingerprint(monkeypatch):
    before = ceilings.device_fingerprint("cpu")
    monkeypatch.setattr(ceilings, "METHOD_VERSION", 2)
    assert ceilings.device_fingerprint("cpu") != before  # a version-2 file is never even looked up


def test_load_or_measure_stores_once_and_then_reuses(tmp_path, monkeypatch, quick_cpu):
    monkeypatch.setattr(ceilings, "measure", lambda device, quick=False: quick_cpu)
    first = ceilings.load_or_measure("cpu", tmp_path, quick=True)
    path = tmp_path / "ceilings" / f"{ceilings.device_fingerprint(CPU)}.json"
    assert path.exists() and first == quick_cpu
    monkeypatch.setattr(ceilings, "measure", refuse_to_measure)
    assert ceilings.load_or_measure("cpu", tmp_path, quick=True) == quick_cpu
    assert not list(path.parent.glob(".*"))  # no temp file left behind by the atomic write


def test_stored_quick_ceilings_do_not_stand_in_for_full_ones(tmp_path, monkeypatch, quick_cpu):
    monkeypatch.setattr(ceilings, "measure", lambda device, quick=False: quick_cpu)
    ceilings.load_or_measure("cpu", tmp_path, quick=True)
    calls = []
    monkeypatch.setattr(ceilings, "measure", lambda device, quick=False: calls.append(quick) or quick_cpu)
    ceilings.load_or_measure("cpu", tmp_path, quick=False)
    assert calls == [False]


def test_force_measures_again(tmp_path, monkeypatch, quick_cpu):
    calls = []
    monkeypatch.setattr(ceilings, "measure", lambda device, quick=False: calls.append(quick) or quick_cpu)
    ceilings.load_or_measure("cpu", tmp_path, quick=True)
    ceilings.load_or_measure("cpu", tmp_path, quick=True, force=True)
    assert len(calls) == 2


def test_an_unreadable_stored_file_is_measured_again(tmp_path, monkeypatch, quick_cpu):
    path = ceilings.ceilings_path("cpu", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    monkeypatch.setattr(ceilings, "measure", lambda device, quick=False: quick_cpu)
    assert ceilings.load_or_measure("cpu", tmp_path, quick=True) == quick_cpu
    assert Ceilings.from_json(path.read_text()) == quick_cpu


def test_fingerprint_is_stable_across_calls():
    assert ceilings.device_fingerprint("cpu") == ceilings.device_fingerprint(CPU)
    assert ceilings.device_fingerprint("cpu").startswith("cpu-")


def test_fingerprint_changes_with_the_thread_count():
    threads = torch.get_num_threads()
    before = ceilings.device_fingerprint("cpu")
    try:
        torch.set_num_threads(threads + 1)
        assert ceilings.device_fingerprint("cpu") != before
    finally:
        torch.set_num_threads(threads)
    assert ceilings.device_fingerprint("cpu") == before


def test_every_spec_row_has_a_source_and_dense_figures():
    peaks = ceilings.spec_peaks()
    assert len(peaks) > 0
    assert peaks["source"].notna().all() and (peaks["source"].str.len() > 20).all()
    assert (peaks["peak_bw_gbps"] > 0).all() and (peaks["peak_tflops_dense"] > 0).all()
    assert set(peaks["dtype"]) <= set(ceilings.MATMUL_DTYPES)


def test_spec_for_finds_the_h200_by_torch_name():
    rows = ceilings.spec_for("NVIDIA H200")
    assert rows is not None and (rows["device_name"] == "NVIDIA H200 SXM").all()
    by_dtype = rows.set_index("dtype")
    assert by_dtype.loc["bf16", "peak_tflops_dense"] == 989.5 and by_dtype.loc["fp8_e4m3", "peak_tflops_dense"] == 1979
    assert by_dtype.loc["bf16", "peak_bw_gbps"] == 4800


@pytest.mark.parametrize(
    ("torch_name", "spec_name"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB SXM"),
        ("NVIDIA L4", "NVIDIA L4"),
        ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"),
        ("NVIDIA H100 PCIe", None),  # other clocks, power and memory than the SXM part
        ("NVIDIA H200 NVL", None),
        ("NVIDIA L40S", None),
        ("AMD EPYC 7B13", None),
    ],
)
def test_spec_for_matches_only_the_exact_part(torch_name, spec_name):
    rows = ceilings.spec_for(torch_name)
    assert (None if rows is None else rows["device_name"].iloc[0]) == spec_name


def table_line(table: str, label: str) -> list[str]:
    return next(line for line in table.splitlines() if line.startswith(label))[len(label) :].split()


def test_table_puts_the_read_roof_beside_the_spec_with_the_ratio_and_both_roofs_with_their_spread(quick_cpu):
    table = ceiling_report.format_table(quick_cpu, spec=ceilings.spec_for("NVIDIA L4"))
    measured, plus_minus, rse, spec, ratio = table_line(table, "read bandwidth GB/s")[:5]
    assert float(measured) == pytest.approx(quick_cpu.read_bw_gbps, rel=1e-3)  # printed to 4 significant digits
    assert plus_minus == "±" and rse == f"{quick_cpu.median_rse['read']:.1%}"
    assert spec == "300" and float(ratio) == pytest.approx(quick_cpu.read_bw_gbps / 300, abs=0.01)
    measured, plus_minus, rse, spec, ratio = table_line(table, "copy bandwidth GB/s")[:5]
    assert float(measured) == pytest.approx(quick_cpu.peak_bw_gbps, rel=1e-3)
    assert rse == f"{quick_cpu.median_rse['copy']:.1%}" and spec == ratio == "-"  # a copy counts bytes twice
    assert "skipped" in table


def test_table_of_ceilings_without_a_read_roof_says_so(quick_cpu):
    table = ceiling_report.format_table(Ceilings.from_json(method_2_json(quick_cpu)))
    assert table_line(table, "read bandwidth GB/s")[:2] == ["not", "measured"] and "force=true" in table


def test_table_says_when_a_roof_was_measured_again(quick_cpu):
    table = ceiling_report.format_table(dataclasses.replace(quick_cpu, tries={"read": 2, "copy": 1}))
    assert "measured 2 times, the tightest kept" in " ".join(table_line(table, "read bandwidth GB/s"))
    assert "measured" not in " ".join(table_line(table, "copy bandwidth GB/s")[1:])


def test_row_columns_give_the_ceilings_of_the_rows_dtype(quick_cpu):
    columns = ceiling_report.row_columns(quick_cpu, "fp32")
    assert columns["peak_tflops"] == quick_cpu.peak_tflops["fp32"]
    assert ceiling_report.row_columns(quick_cpu, "fp8_e4m3")["peak_tflops"] is None


def test_row_columns_use_the_read_roof_and_carry_both(quick_cpu):
    measured = dataclasses.replace(quick_cpu, peak_bw_gbps=10.0, read_bw_gbps=20.0)
    columns = ceiling_report.row_columns(measured, "fp32")
    assert columns["peak_bw_gbps"] == 20.0 and columns["bw_roof"] == "read"
    assert columns["peak_read_bw_gbps"] == 20.0 and columns["peak_copy_bw_gbps"] == 10.0


def test_row_columns_fall_back_to_the_copy_roof_and_say_so(quick_cpu):
    columns = ceiling_report.row_columns(dataclasses.replace(quick_cpu, peak_bw_gbps=10.0, read_bw_gbps=None), "fp32")
    assert columns["peak_bw_gbps"] == 10.0 and columns["bw_roof"] == "copy"
    assert columns["peak_read_bw_gbps"] is None and columns["peak_copy_bw_gbps"] == 10.0


def ceilings_app(*overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.ceilings", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_app_measures_prints_the_table_and_stores_the_file(tmp_path):
    proc = ceilings_app("quick=true", f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert "read bandwidth GB/s" in proc.stdout and "copy bandwidth GB/s" in proc.stdout
    assert "matmul fp32 TFLOP/s" in proc.stdout
    stored = list((tmp_path / "ceilings").glob("*.json"))
    assert len(stored) == 1 and f"stored: {stored[0]}" in proc.stdout
    assert Ceilings.from_json(stored[0].read_text()).quick
    assert any((tmp_path / "ceilings" / "runs").iterdir())  # Hydra's own output under results_dir, not the repo


def test_the_app_rejects_a_bad_device_in_one_line(tmp_path):
    proc = ceilings_app("device=tpu", f"results_dir={tmp_path}")
    assert proc.returncode != 0
    assert proc.stderr.strip() == "kvbench: bad config: device: unknown value 'tpu'; allowed: auto, cpu, cuda"
    assert not list(tmp_path.rglob("*.json"))


@pytest.mark.gpu
def test_cuda_ceilings_are_measured_with_every_supported_dtype():
    measured = ceilings.measure("cuda", quick=True)
    assert measured.device == "cuda" and measured.n_sms > 0 and measured.n_threads is None
    assert 10 < measured.peak_bw_gbps < 20_000 and 10 < measured.read_bw_gbps < 20_000
    assert {"fp32", "fp16"} <= set(measured.peak_tflops)
    assert all(0 < tflops < 10_000 for tflops in measured.peak_tflops.values())
    supported = set(measured.peak_tflops) | set(measured.skipped)
    assert supported == set(ceilings.MATMUL_DTYPES)
    if torch.cuda.get_device_capability() >= (8, 9):
        assert "fp8_e4m3" in measured.peak_tflops, measured.skipped.get("fp8_e4m3")
