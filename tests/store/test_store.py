"""harness.store beyond rows: the one atomic writer, capacity frontier tables, the one table printer, the commands."""

from __future__ import annotations

import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from experiments.capacity import CapacityConfig, frontier_rows
from harness.device import ceiling_report, ceilings
from harness.store import atomic, disk
from harness.store.schema import FRONTIER_COLUMNS, columns_markdown
from harness.store.summary import format_summary, text_table
from tests.store.test_results import _row

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- the atomic writer


def test_atomic_write_fsyncs_the_file_and_then_its_folder(tmp_path, monkeypatch):
    synced = []
    real_fsync = atomic.os.fsync

    def fsync(fd: int) -> None:
        synced.append(Path(f"/proc/self/fd/{fd}").resolve())
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    path = atomic.atomic_write(tmp_path / "sub" / "a.json", lambda f: f.write(b"{}"))

    assert path.read_bytes() == b"{}"
    assert len(synced) == 2 and synced[0].name.startswith(".a.json.tmp-") and synced[1] == tmp_path / "sub"


def test_atomic_write_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = atomic.atomic_write(tmp_path / "a.json", lambda f: f.write(b"old"))

    def half_then_crash(f) -> None:
        f.write(b"ne")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        atomic.atomic_write(path, half_then_crash)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


def fake_ceilings(**overrides: object) -> ceilings.Ceilings:
    fields = dict(
        fingerprint="abc123",
        device="cpu",
        device_name="AMD EPYC 7B13",
        n_threads=2,
        n_sms=None,
        total_memory_bytes=2**34,
        peak_bw_gbps=20.5,
        peak_tflops={"fp32": 0.51234, "bf16": 1.2},
        skipped={"fp8_e4m3": "no fp8 matmul on this CPU"},
        median_rse={},
        copy_bytes=2**28,
        matmul_n={},
        repeats={},
        quick=True,
        fp32_matmul_precision="highest",
        measured_at="2026-12-01T00:00:00+00:00",
        torch_version="2.13.0",
    )
    return ceilings.Ceilings(**(fields | overrides))


def test_stored_ceilings_go_through_the_one_atomic_writer_with_fsync(tmp_path, monkeypatch):
    monkeypatch.setattr(ceilings, "measure", lambda device, quick=False: fake_ceilings())
    monkeypatch.setattr(ceilings, "device_fingerprint", lambda device: "abc123")
    synced = []
    real_fsync = atomic.os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))

    stored = ceilings.load_or_measure("cpu", tmp_path, quick=True)

    path = tmp_path / "ceilings" / "abc123.json"
    assert ceilings.Ceilings.from_json(path.read_text()) == stored
    assert len(synced) == 2  # the file, then its folder
    assert [p.name for p in path.parent.iterdir()] == ["abc123.json"]


# ------------------------------------------------------------------------------------------------- frontier tables


def fitting_probe(cfg) -> dict:
    """A probe (no child process) whose point fits up to batch 37 and reports the memory columns a real one does."""
    fits = cfg.batch_size <= 37
    return {"status": "ok" if fits else "oom", "peak_mem_bytes": 3 * 2**20, "mem_baseline_bytes": 2**20} | (
        {"kv_bytes_allocated": 2**19} if fits else {}
    )


def capacity_frontier() -> pd.DataFrame:
    """What experiments/capacity.py measures, with a fake probe: a tiny model at two contexts."""
    cfg = CapacityConfig(model={"name": "tiny"}, contexts=[256, 512], device="cpu", runtime_overhead_gb=0)
    return frontier_rows(cfg, probe=fitting_probe)


def test_the_frontier_contract_names_every_column_the_capacity_experiment_writes():
    assert list(capacity_frontier().columns) == [column.name for column in FRONTIER_COLUMNS]
    assert all(column.description for column in FRONTIER_COLUMNS)


def test_the_committed_reference_frontiers_follow_the_contract():
    references = sorted((ROOT / "results" / "reference" / "capacity").glob(f"{disk.FRONTIER_PREFIX}*.parquet"))
    assert references
    for reference in references:
        assert pq.read_schema(reference).names == [column.name for column in FRONTIER_COLUMNS], reference


def test_write_frontier_rejects_a_column_outside_the_contract(tmp_path):
    with pytest.raises(ValueError, match="unknown frontier column 'max_batch_guess'; allowed: model, device"):
        disk.write_frontier(capacity_frontier().assign(max_batch_guess=3), tmp_path)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_write_frontier_rejects_a_value_its_column_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="frontier column 'probes' \\(int64\\)"):
        disk.write_frontier(capacity_frontier().assign(probes="two"), tmp_path)


def test_a_frontier_written_by_the_store_loads_back_with_the_contract_types(tmp_path):
    table = capacity_frontier()
    path = disk.write_frontier(table, tmp_path / "capacity")

    assert path.parent == tmp_path / "capacity" and path.name.startswith(disk.FRONTIER_PREFIX)
    back = pd.read_parquet(path)

    def cells(frame: pd.DataFrame) -> pd.DataFrame:  # a null is None whatever pandas reads it as (None, NaN, NA)
        return frame.astype(object).where(frame.notna(), None)

    pd.testing.assert_frame_equal(cells(back), cells(table), check_dtype=False)
    types = {field.name: str(field.type) for field in pq.read_schema(path)}
    assert types["measured_max_batch"] == "int64" and types["error"] == "string" and types["within_step"] == "bool"
    assert disk.load(tmp_path).empty  # a frontier is not a result row


def test_a_failed_frontier_search_is_written_with_nulls_in_its_measured_columns(tmp_path):
    def broken_probe(cfg) -> dict:
        return {"status": "error", "error": "worker died"}

    cfg = CapacityConfig(model={"name": "tiny"}, contexts=[256], device="cpu", runtime_overhead_gb=0)
    table = frontier_rows(cfg, probe=broken_probe)  # its measured columns are None: object dtype in pandas
    back = pd.read_parquet(disk.write_frontier(table, tmp_path))

    assert back["measured_max_batch"].isna().all() and "worker died" in back["error"].iloc[0]
    assert str(pq.read_schema(next(tmp_path.glob("frontier-*"))).field("probes").type) == "int64"


# ---------------------------------------------------------------------------------------------- the table printer


def test_text_table_left_aligns_text_right_aligns_numbers_and_shows_nulls_as_dashes():
    frame = pd.DataFrame({"name": ["a", "longer"], "ms": [1.5, None], "note": ["", "slow"]})

    lines = text_table(frame, formatters={"ms": "{:.2f}".format}, left=("name", "note")).splitlines()

    assert lines == ["name      ms  note", "a       1.50", "longer     -  slow"]


def test_the_summary_puts_a_failed_rows_error_under_an_error_header(tmp_path):
    disk.write_point(_row(point_id="a"), tmp_path)
    disk.write_point(_row(point_id="b", status="oom", error="CUDA out of memory", ttft_ms=None), tmp_path)

    header, ok_line, oom_line = format_summary(disk.load(tmp_path)).splitlines()

    assert header.split()[-1] == "error"
    assert oom_line.index("CUDA out of memory") == header.index("error")
    assert len(ok_line) < header.index("error")  # an ok row ends before the error column


def test_the_summary_names_a_treatment_only_where_the_rows_differ_in_it(tmp_path):
    disk.write_point(_row(point_id="a", attn_impl="sdpa"), tmp_path)
    disk.write_point(_row(point_id="b", attn_impl="eager"), tmp_path)
    header, *lines = format_summary(disk.load(tmp_path)).splitlines()
    assert header.split()[:4] == ["status", "model", "cache", "attn_impl"]
    assert sorted(line.split()[3] for line in lines) == ["eager", "sdpa"]
    same = tmp_path / "same"
    disk.write_point(_row(point_id="a", attn_impl="sdpa"), same)
    assert "attn_impl" not in format_summary(disk.load(same)).splitlines()[0]


def test_the_ceilings_table_gives_a_skipped_dtype_its_reason_under_the_note_header():
    table = ceiling_report.format_table(fake_ceilings(), spec=ceilings.spec_for("NVIDIA L4"))
    header = next(line for line in table.splitlines() if line.startswith("ceiling"))
    skipped = next(line for line in table.splitlines() if "skipped" in line)

    assert header.split() == ["ceiling", "measured", "spec", "ratio", "note"]
    assert skipped.index("no fp8 matmul on this CPU") == header.index("note")
    assert skipped.startswith("matmul fp8_e4m3 TFLOP/s")


# --------------------------------------------------------------------------------------------------- the commands


def console_scripts() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_kvbench_results_is_a_console_script_of_the_store_cli():
    module, _, function = console_scripts()["kvbench-results"].partition(":")

    assert (module, function) == ("harness.store.cli", "main")
    assert callable(getattr(import_module(module), function))


def test_every_entry_point_is_a_console_script_whose_target_exists():
    scripts = console_scripts()
    modules = {target.partition(":")[0] for target in scripts.values()}
    entry_points = {f"experiments.{path.stem}" for path in (ROOT / "experiments").glob("*.py")}
    # a callback, a time model, the GPU check's verdicts and stages (gpu_check.py's second and third modules)
    entry_points -= {"experiments.__init__", "experiments.callbacks", "experiments.sizing", "experiments.gpu_verdicts",
                     "experiments.gpu_stages"}  # fmt: skip
    assert entry_points <= modules
    for target in scripts.values():
        module, _, function = target.partition(":")
        assert callable(getattr(import_module(module), function)), target


def test_a_hydra_console_script_finds_its_configs_when_called_as_a_function():
    """What the console script's wrapper does: import the module and call main() with the arguments in sys.argv."""
    code = "import sys; from experiments.decode import main; sys.argv = ['kvbench-decode', '--cfg', 'job']; main()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "batch_size:" in proc.stdout and "cache:" in proc.stdout


def test_python_dash_m_harness_store_is_the_same_command():
    proc = subprocess.run(
        [sys.executable, "-m", "harness.store", "columns"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == columns_markdown()
