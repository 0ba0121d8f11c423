"""The dashboard's loaders (dashboard/data.py) as plain functions: filters, rows tagged by their source, unreadable
files named, frontier and top-ops tables, and the export bytes.

The fixture results' builders live here (the committed reference rows written back with
harness.store.disk.write_point, a small batch sweep for the knee, a profiler top-ops table and a capacity frontier
table); tests/dashboard/test_dashboard_pages.py draws the pages over them.
"""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path

import pandas as pd

from dashboard import data
from harness.store import disk, schema

KNEE_SWEEP = "fixture-crossover"
KNEE_BATCHES = (1, 4, 16)
COMMITTED_REFERENCE = data.REFERENCE_DIR  # results/reference: real rows of three sweeps


# ------------------------------------------------------------------------------------------------------ fixtures


def reference_rows() -> pd.DataFrame:
    """The committed reference rows, a fresh copy for each caller to change as it likes: read from disk once per
    test process (seconds), since the dashboard's tests build most of their fixtures from them."""
    return _committed_reference().copy()


@functools.cache
def _committed_reference() -> pd.DataFrame:
    return disk.load(COMMITTED_REFERENCE)


def with_and_without_itl() -> pd.DataFrame:
    """Two rows without per-step latencies (no timing: fragmentation), then two with."""
    rows = reference_rows()
    return pd.concat([rows[rows["itl_ms"].isna()].head(2), rows[rows["itl_ms"].notna()].head(2)], ignore_index=True)


def write_rows(rows: pd.DataFrame, directory: Path) -> None:
    known = {column.name for column in schema.COLUMNS}
    for record in rows.to_dict("records"):
        row = {key: value for key, value in record.items() if key in known}
        disk.write_point(row, directory / row["sweep_id"])


def knee_sweep(rows: pd.DataFrame) -> pd.DataFrame:
    """A batch sweep from batch 1 in the current schema (roofline and profiler columns), whose TPOT rises past the
    knee at batch 16, with B* = 8."""
    dummy = rows["weights"].fillna("dummy") == "dummy"  # the small preset's rows, whatever else is committed
    base = rows[(rows["status"] == "ok") & (rows["cache"] == "contiguous") & rows["itl_ms"].notna() & dummy].iloc[[0]]
    sweep = []
    for batch, tpot_ms in zip(KNEE_BATCHES, (40.0, 42.0, 90.0), strict=True):
        flops_per_step = 0.4e9 * batch  # FLOP
        bytes_per_step = 0.8e9  # bytes: the weights, read once for the whole batch
        sweep.append(
            base.assign(
                point_id=f"knee-b{batch}",
                sweep_id=KNEE_SWEEP,
                batch_size=batch,
                tpot_ms=tpot_ms,
                decode_tok_s=batch * 1000 / tpot_ms,
                flops_per_step=flops_per_step,
                bytes_per_step=bytes_per_step,
                arithmetic_intensity=flops_per_step / bytes_per_step,
                achieved_tflops=flops_per_step / tpot_ms / 1e9,
                prefill_arithmetic_intensity=20.0 * batch,
                prefill_achieved_tflops=0.1,
                peak_bw_gbps=25.0,
                peak_tflops=0.18,
                predicted_tpot_ms=max(bytes_per_step / 25e9, flops_per_step / 0.18e12) * 1e3,
                bound="compute" if batch >= 8 else "memory",
                critical_batch=8.0,
                critical_context=float("inf"),
                prof_attention_frac=0.1,
                prof_gemm_frac=0.7,
                prof_norm_elementwise_frac=0.1,
                prof_kv_frac=0.05,
                prof_sampling_frac=0.01,
                prof_other_frac=0.04,
            )
        )
    return pd.concat(sweep, ignore_index=True)


def frontier_table() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "model": "small",
            "device": "cpu",
            "dtype": "bf16",
            "kv_dtype": "bf16",
            "cache": "contiguous",
            "context": [512, 2048, 8192],
            "prompt_len": [510, 2046, 8190],
            "gen_len": 2,
            "max_memory_gb": 1.5,
            "runtime_overhead_bytes": 300 * 2**20,
            "predicted_max_batch": [39, 9, 2],
            "measured_max_batch": [39, 9, 2],
            "first_oom_batch": [40, 10, 3],
            "bisection_step": [1, 1, 1],
            "probes": [3, 3, 3],
            "probe_s": [10.0, 12.0, 20.0],
            "peak_mem_bytes": [1.4 * 2**30] * 3,
            "mem_baseline_bytes": [0.3 * 2**30] * 3,
            "kv_bytes_allocated": [2**28, 2**28, 2**28],
            "error": None,
            "within_step": True,
            "predicted_model_bytes": [1.1 * 2**30] * 3,
            "mmap_threshold_pinned": True,
            "rss_error": [0.01, 0.0, -0.01],
        }
    )


def ops_table() -> pd.DataFrame:
    """A top-ops table as harness.measure.profile writes it (TOP_OPS_COLUMNS)."""
    return pd.DataFrame(
        {
            "op": ["aten::mm", "aten::bmm", "aten::_softmax"],
            "category": ["gemm", "attention", "attention"],
            "self_time_ms": [3.0, 1.0, 0.5],
            "calls": [40, 8, 8],
            "share": [0.6, 0.2, 0.1],
        }
    )


# -------------------------------------------------------------------------------------------------- the loaders


def test_filter_rows_keeps_the_rows_whose_values_are_selected():
    rows = pd.DataFrame({"cache": ["none", "paged", "paged", None], "device": ["cpu"] * 4})
    assert data.filter_rows(rows, {"cache": ["paged"]}).index.tolist() == [1, 2]
    assert data.filter_rows(rows, {"cache": ["none", data.NULL_LABEL]}).index.tolist() == [0, 3]
    assert data.filter_rows(rows, {"cache": ["paged"], "device": ["cuda"]}).empty
    assert data.filter_rows(rows, {"cache": []}).empty  # nothing selected, nothing shown
    assert len(data.filter_rows(rows, {"model": ["small"]})) == 4  # a column the rows lack filters nothing
    assert data.filter_options(rows, "cache") == [data.NULL_LABEL, "none", "paged"]


def test_load_rows_tags_each_source_and_reads_the_reference_subfolder_once(tmp_path, monkeypatch):
    reference = tmp_path / "results" / "reference"
    monkeypatch.setattr(data, "REFERENCE_DIR", reference)
    rows = reference_rows()
    write_rows(rows.head(3), tmp_path / "results")
    write_rows(rows.tail(2), reference)

    both, skipped = data.load_rows((str(tmp_path / "results"), str(reference)))
    assert skipped == []
    assert both["source"].value_counts().to_dict() == {"results": 3, "reference": 2}
    alone, _ = data.load_rows((str(tmp_path / "results"),))
    assert len(alone) == 3 and set(alone["source"]) == {"results"}


def test_load_rows_sees_a_point_written_after_the_first_load(tmp_path):
    rows = reference_rows()
    write_rows(rows.head(2), tmp_path)
    assert len(data.load_rows((str(tmp_path),))[0]) == 2
    write_rows(rows.iloc[[5]], tmp_path)
    assert len(data.load_rows((str(tmp_path),))[0]) == 3


def test_load_rows_of_an_empty_or_missing_folder_is_empty_with_every_column(tmp_path):
    rows, skipped = data.load_rows((str(tmp_path / "nothing-here"),))
    assert rows.empty and skipped == []
    assert {"point_id", "status", "tpot_ms", "source"} <= set(rows.columns)


def test_load_rows_skips_unreadable_files_and_names_them(corrupt_dir):
    rows, skipped = data.load_rows((str(corrupt_dir),))
    assert len(rows) == 2
    assert len(skipped) == 2
    assert any(line.startswith(str(corrupt_dir / "x.parquet")) for line in skipped)
    assert any(line.startswith(str(corrupt_dir / "truncated.parquet")) for line in skipped)


def test_load_frontiers_reads_every_table_and_skips_an_unreadable_one(tmp_path):
    (tmp_path / "capacity").mkdir()
    frontier_table().to_parquet(tmp_path / "capacity" / "frontier-1.parquet")
    frontier_table().to_parquet(tmp_path / "capacity" / "frontier-2.parquet")
    (tmp_path / "capacity" / "frontier-3.parquet").write_bytes(b"garbage")
    table = data.load_frontiers((str(tmp_path),))
    assert len(table) == 6
    assert set(table["frontier_file"]) == {"frontier-1.parquet", "frontier-2.parquet"}
    assert data.load_frontiers((str(tmp_path / "elsewhere"),)).empty


def test_load_point_ops_finds_a_points_table_or_none(tmp_path):
    disk.write_ops("abc", ops_table(), tmp_path / "sweep")
    assert data.points_with_ops((str(tmp_path),)) == ["abc"]
    assert data.load_point_ops((str(tmp_path),), "abc")["op"].tolist() == ops_table()["op"].tolist()
    assert data.load_point_ops((str(tmp_path),), "other") is None


def test_load_point_ops_prefers_the_table_in_the_points_own_sweep(tmp_path):
    disk.write_ops("abc", ops_table().head(1), tmp_path / "first-sweep")
    disk.write_ops("abc", ops_table().head(2), tmp_path / "second-sweep")  # the same point, rerun
    sources = (str(tmp_path),)
    assert len(data.load_point_ops(sources, "abc", sweep_id="first-sweep")) == 1
    assert len(data.load_point_ops(sources, "abc", sweep_id="second-sweep")) == 2


def test_parquet_bytes_round_trip_through_results_load_with_itl_ms_lists(tmp_path):
    rows = with_and_without_itl().assign(source="reference")
    (tmp_path / "export.parquet").write_bytes(data.parquet_bytes(rows))
    back = disk.load(tmp_path / "export.parquet")
    assert back["point_id"].tolist() == rows["point_id"].tolist()
    assert back["itl_ms"].tolist() == rows["itl_ms"].tolist()
    assert back["source"].tolist() == ["reference"] * len(rows)


def test_csv_bytes_has_one_line_per_row_and_itl_ms_as_json():
    rows = with_and_without_itl()
    back = pd.read_csv(io.BytesIO(data.csv_bytes(rows)))
    assert back["point_id"].tolist() == rows["point_id"].tolist()
    assert back["itl_ms"].isna().tolist() == [True, True, False, False]
    assert json.loads(back["itl_ms"].iloc[2]) == rows["itl_ms"].iloc[2]
