"""`kvbench-results compact`: one file per sweep folder, every row kept, idempotent, safe to interrupt."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from harness.store import cli, diff, disk, maintain
from tests.store.test_results import _row


def sweep_folder(root: Path, sweep_id: str, n: int) -> Path:
    for i in range(n):
        row = _row(
            point_id=f"{sweep_id}-p{i}", sweep_id=sweep_id, batch_size=i + 1, started_at=f"2026-12-01T00:0{i}:00"
        )
        disk.write_point(row, root / sweep_id)
    disk.write_ops(f"{sweep_id}-p0", pd.DataFrame({"op": ["aten::mm"], "self_ms": [1.0]}), root / sweep_id)
    return root / sweep_id


def rows_of(root: Path) -> pd.DataFrame:
    return disk.load(root).sort_values("point_id", ignore_index=True)


def test_compaction_keeps_every_row_and_leaves_one_file_per_sweep(tmp_path):
    sweep_folder(tmp_path, "s1", 4)
    sweep_folder(tmp_path, "s2", 3)
    before = rows_of(tmp_path)
    lines = maintain.compact(tmp_path)
    assert sorted((line["files"], line["rows"]) for line in lines) == [(3, 3), (4, 4)]
    pd.testing.assert_frame_equal(rows_of(tmp_path), before)  # every row, every value (itl_ms lists included)
    for sweep in ("s1", "s2"):
        files = [p.name for p in (tmp_path / sweep).glob("*.parquet") if not p.name.endswith(disk.OPS_SUFFIX)]
        assert len(files) == 1 and files[0].startswith(disk.COMPACTED_PREFIX)
    assert (tmp_path / "s1" / f"s1-p0{disk.OPS_SUFFIX}").exists()  # profiler tables stay


def test_compaction_is_idempotent_and_merges_points_written_after_it(tmp_path):
    folder = sweep_folder(tmp_path, "s1", 3)
    maintain.compact(tmp_path)
    (compacted,) = folder.glob(f"{disk.COMPACTED_PREFIX}*")
    assert maintain.compact(tmp_path) == [] and compacted.exists()  # nothing new: nothing changes
    disk.write_point(_row(point_id="late", sweep_id="s1", started_at="2026-12-01T01:00:00"), folder)
    (line,) = maintain.compact(tmp_path)
    assert line["files"] == 2 and line["rows"] == 4 and not compacted.exists()
    assert sorted(rows_of(tmp_path)["point_id"]) == ["late", "s1-p0", "s1-p1", "s1-p2"]


def test_an_interrupted_compaction_loads_each_row_once_and_the_next_run_finishes_it(tmp_path):
    folder = sweep_folder(tmp_path, "s1", 3)
    before = rows_of(tmp_path)
    # Killed after the merged file was written, before the originals were removed: every row is on disk twice.
    maintain.export(folder, tmp_path / "merged.parquet")
    (tmp_path / "merged.parquet").rename(folder / f"{disk.COMPACTED_PREFIX}20261201-000000-000000.parquet")
    pd.testing.assert_frame_equal(rows_of(tmp_path), before)
    maintain.compact(tmp_path)
    pd.testing.assert_frame_equal(rows_of(tmp_path), before)
    assert len(list(folder.glob("*.parquet"))) == 2  # the compacted file and the ops table


def test_a_corrupt_file_is_left_in_place_and_the_rest_compacted(tmp_path, caplog):
    folder = sweep_folder(tmp_path, "s1", 2)
    (folder / "broken.parquet").write_bytes(b"garbage")
    (line,) = maintain.compact(tmp_path)
    assert line["rows"] == 2 and (folder / "broken.parquet").exists()
    assert "broken.parquet" in caplog.text


def test_a_failed_read_back_removes_nothing(tmp_path, monkeypatch):
    folder = sweep_folder(tmp_path, "s1", 2)
    files = sorted(folder.iterdir())
    monkeypatch.setattr(maintain, "same_rows", lambda a, b: False)
    with pytest.raises(ValueError, match="did not read back"):
        maintain.compact(tmp_path)
    assert sorted(folder.iterdir()) == files


def test_the_cli_compacts_and_rejects_a_missing_folder(tmp_path, capsys):
    sweep_folder(tmp_path, "s1", 2)
    assert cli.main(["compact", str(tmp_path)]) == 0
    assert "2 files -> 1, 2 rows" in capsys.readouterr().out
    assert cli.main(["compact", str(tmp_path / "nope")]) == 2
    assert cli.main(["compact", str(tmp_path), "--sweep", "other"]) == 2


def test_rows_with_nans_and_nulls_compact(tmp_path):
    folder = tmp_path / "s1"
    disk.write_point(_row(point_id="a", itl_ms=[1.0, float("nan")], ttft_ms=float("nan"), error=None), folder)
    disk.write_point(_row(point_id="b", itl_ms=None, tpot_ms=None, started_at=None), folder)
    before = rows_of(tmp_path)

    (line,) = maintain.compact(tmp_path)

    assert line["rows"] == 2
    pd.testing.assert_frame_equal(rows_of(tmp_path), before)


def test_the_read_back_check_compares_measurements_not_positions():
    rows = pd.DataFrame(
        {"point_id": ["b", "a"], "sweep_id": ["s", "s"], "started_at": ["t", "t"], "ttft_ms": [float("nan"), 1.0]}
    )
    assert diff.same_rows(rows, rows.iloc[::-1])
    assert not diff.same_rows(rows, rows.assign(ttft_ms=float("nan")))
    assert not diff.same_rows(rows, rows.assign(ttft_ms=[2.0, 1.0]))


def test_a_point_rewritten_while_compacting_is_left_in_place(tmp_path, monkeypatch):
    folder = sweep_folder(tmp_path, "s1", 2)
    write = disk.write_parquet

    def write_while_a_sweep_reruns_p1(table, path):
        write(table=table, path=path)
        if path.name.startswith(disk.COMPACTED_PREFIX):
            disk.write_point(_row(point_id="s1-p1", sweep_id="s1", started_at="2026-12-01T02:00:00"), folder)

    monkeypatch.setattr(disk, "write_parquet", write_while_a_sweep_reruns_p1)
    (line,) = maintain.compact(tmp_path)

    assert line["files"] == 1 and (folder / "s1-p1.parquet").exists() and not (folder / "s1-p0.parquet").exists()
    runs = rows_of(tmp_path).query("point_id == 's1-p1'")["started_at"]
    assert sorted(runs) == ["2026-12-01T00:01:00", "2026-12-01T02:00:00"]  # the rerun is kept, the first run too


def test_the_cli_counts_unreadable_files_and_says_when_there_is_nothing_to_compact(tmp_path, capsys):
    folder = sweep_folder(tmp_path, "s1", 2)
    (folder / "broken.parquet").write_bytes(b"garbage")

    assert cli.main(["compact", str(tmp_path)]) == 0
    assert "2 files -> 1, 2 rows" in (out := capsys.readouterr().out) and "1 unreadable left in place" in out
    assert cli.main(["compact", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path}: nothing to compact"


def test_the_cli_rejects_a_file_in_one_line_naming_it_and_touches_nothing(tmp_path, caplog):
    folder = sweep_folder(tmp_path, "s1", 2)
    files = sorted(folder.iterdir())
    point = folder / "s1-p0.parquet"

    assert cli.main(["compact", str(point)]) == 2
    (error,) = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert "\n" not in error and "results_dir" in error and str(point) in error
    assert sorted(folder.iterdir()) == files


def test_the_committed_reference_folder_is_left_alone(tmp_path):
    sweep_folder(tmp_path, "s1", 2)
    reference = sweep_folder(tmp_path / "reference", "cpu-run", 2)
    files = sorted(reference.iterdir())
    (line,) = maintain.compact(tmp_path)
    assert line["folder"].endswith("s1") and sorted(reference.iterdir()) == files
    assert maintain.compact(tmp_path / "reference")  # asked for by name, it is compacted
