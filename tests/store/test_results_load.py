"""harness.store's load and index: rows merged from nested folders, stray, corrupt and foreign files skipped, one copy
of a measurement stored twice, and the index's columns."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.store import disk
from harness.store.disk import load, write_point
from harness.store.maintain import export
from harness.store.schema import COLUMNS
from tests.store.test_results import _row


def test_load_merges_rows_from_nested_directories(tmp_path):
    write_point(_row(point_id="a", sweep_id="s1"), tmp_path / "s1")
    write_point(_row(point_id="b", sweep_id="s2"), tmp_path / "s2" / "multirun" / "0")
    write_point(_row(point_id="c", sweep_id="s2"), tmp_path / "s2" / "multirun" / "1")

    assert sorted(load(tmp_path)["point_id"]) == ["a", "b", "c"]


def test_load_ignores_stray_temp_and_hidden_files(tmp_path):
    write_point(_row(point_id="a"), tmp_path)
    # What a writer killed between writing and renaming leaves behind, and an editor's hidden copies.
    (tmp_path / f".b.parquet.tmp-{os.getpid()}").write_bytes(b"PAR1 truncated")
    (tmp_path / ".c.parquet").write_bytes(b"PAR1 truncated")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    write_point(_row(point_id="d"), tmp_path / ".ipynb_checkpoints")

    assert load(tmp_path)["point_id"].tolist() == ["a"]


@pytest.mark.parametrize("make_dir", [True, False], ids=["empty", "missing"])
def test_load_without_rows_gives_an_empty_frame_with_every_column(tmp_path, make_dir):
    directory = tmp_path / "results"
    if make_dir:
        directory.mkdir()

    loaded = load(directory)

    assert loaded.empty
    assert list(loaded.columns) == [c.name for c in COLUMNS]
    assert loaded["batch_size"].dtype == "Int64"


def test_load_skips_a_garbage_file_naming_it_and_keeps_every_other_row(tmp_path, caplog):
    write_point(_row(point_id="a"), tmp_path)
    write_point(_row(point_id="b"), tmp_path / "sweep")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    skipped: list[str] = []

    loaded = load(tmp_path, skipped=skipped)

    assert sorted(loaded["point_id"]) == ["a", "b"]
    assert len(skipped) == 1 and "broken.parquet" in skipped[0]
    assert "broken.parquet" in caplog.text


def test_load_skips_a_truncated_file(tmp_path):
    good = write_point(_row(point_id="a"), tmp_path)
    data = write_point(_row(point_id="b"), tmp_path).read_bytes()
    (tmp_path / "b.parquet").write_bytes(data[: len(data) // 2])
    skipped: list[str] = []

    loaded = load(tmp_path, skipped=skipped)

    assert loaded["point_id"].tolist() == ["a"]
    assert good.exists() and "b.parquet" in skipped[0]


def test_load_skips_a_foreign_parquet_table(tmp_path):
    write_point(_row(point_id="a"), tmp_path)
    pd.DataFrame({"x": [1, 2]}).to_parquet(tmp_path / "foreign.parquet")
    skipped: list[str] = []

    loaded = load(tmp_path, skipped=skipped)

    assert loaded["point_id"].tolist() == ["a"]
    assert "foreign.parquet" in skipped[0] and "point_id" in skipped[0]


def test_load_ignores_capacity_frontier_tables_silently(tmp_path):
    write_point(_row(point_id="a"), tmp_path)
    (tmp_path / "capacity").mkdir()
    pd.DataFrame({"context": [512]}).to_parquet(tmp_path / "capacity" / "frontier-20260101-000000.parquet")
    skipped: list[str] = []

    assert load(tmp_path, skipped=skipped)["point_id"].tolist() == ["a"]
    assert skipped == []


def test_load_of_a_serving_folder_or_run_reads_no_rows_and_skips_nothing(tmp_path):
    # kvbench-results pointed at <results>/serve or one run in it: its parts are serving tables, not point rows.
    run = tmp_path / disk.SERVE_DIR / "run-1"
    run.mkdir(parents=True)
    for name in ("requests-00000.parquet", "iterations-00000.parquet", "run.parquet"):
        pd.DataFrame({"run_id": ["run-1"]}).to_parquet(run / name)
    for folder in (tmp_path / disk.SERVE_DIR, run):
        skipped: list[str] = []
        assert load(folder, skipped=skipped).empty and skipped == []


def test_load_of_one_corrupt_file_given_by_name_raises_naming_it(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")

    with pytest.raises(ValueError, match="broken.parquet"):
        load(tmp_path / "broken.parquet")


def test_load_accepts_a_single_parquet_file(tmp_path):
    write_point(_row(point_id="a"), tmp_path)
    path = write_point(_row(point_id="b"), tmp_path)

    assert load(path)["point_id"].tolist() == ["b"]


def test_load_keeps_one_copy_of_a_measurement_stored_twice_and_both_runs_of_a_point(tmp_path):
    write_point(_row(point_id="a", started_at="2026-12-01T00:00:00+00:00"), tmp_path / "s1")
    write_point(_row(point_id="a", started_at="2026-12-01T00:00:00+00:00"), tmp_path / "copy-of-s1")
    write_point(_row(point_id="a", started_at="2026-12-01T01:00:00+00:00"), tmp_path / "rerun")

    assert sorted(load(tmp_path)["started_at"]) == ["2026-12-01T00:00:00+00:00", "2026-12-01T01:00:00+00:00"]


def test_index_has_a_line_per_row_with_its_file(tmp_path):
    write_point(_row(point_id="a", status="ok"), tmp_path / "s1")
    write_point(_row(point_id="b", status="oom", error="CUDA out of memory"), tmp_path / "s1")
    export(tmp_path / "s1", tmp_path / "s2" / "compacted-20261201-000000-000000.parquet")  # a file of many rows
    write_point(_row(point_id="c", sweep_id="s2"), tmp_path / "s2")

    lines = disk.index(tmp_path).sort_values(["point_id", "path"], ignore_index=True)

    assert list(lines.columns) == [*disk.INDEX_COLUMNS, "path"]
    assert lines["point_id"].tolist() == ["a", "b", "c"]  # a and b are in two files: one measurement each
    assert lines["status"].tolist() == ["ok", "oom", "ok"]
    assert lines["error"].tolist()[1] == "CUDA out of memory"
    assert lines["path"].tolist()[2] == str(tmp_path / "s2" / "c.parquet")


def test_index_reads_only_its_columns(tmp_path, monkeypatch):
    write_point(_row(point_id="a"), tmp_path)
    asked = []
    read = pq.ParquetFile.read

    def spy(self, columns=None, **kwargs):
        asked.append(columns)
        return read(self, columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read", spy)
    monkeypatch.setattr(pq, "read_table", lambda *args, **kwargs: pytest.fail("index read a whole table"))

    disk.index(tmp_path)

    assert asked == [list(disk.INDEX_COLUMNS)]  # not itl_ms, not the hundred other columns


def test_index_gives_nulls_for_columns_a_file_lacks_and_skips_unreadable_files(tmp_path):
    pq.write_table(pa.table({"point_id": ["old"], "status": ["ok"]}), tmp_path / "old.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "foreign.parquet")
    skipped: list[str] = []

    lines = disk.index(tmp_path, skipped=skipped)

    assert lines["point_id"].tolist() == ["old"]
    assert lines[["sweep_id", "error", "device_name", "started_at"]].isna().all(axis=None)
    assert sorted(Path(entry.split(":")[0]).name for entry in skipped) == ["broken.parquet", "foreign.parquet"]


@pytest.mark.parametrize("make_dir", [True, False], ids=["empty", "missing"])
def test_index_without_rows_is_an_empty_frame_with_its_columns(tmp_path, make_dir):
    directory = tmp_path / "results"
    if make_dir:
        directory.mkdir()

    lines = disk.index(directory)

    assert lines.empty and list(lines.columns) == [*disk.INDEX_COLUMNS, "path"]
