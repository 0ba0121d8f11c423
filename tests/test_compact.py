"""`python -m harness.results compact`: one file per sweep folder, every row kept, idempotent, safe to interrupt."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from harness import results
from tests.test_results import _row


def sweep_folder(root: Path, sweep_id: str, n: int) -> Path:
    for i in range(n):
        row = _row(
            point_id=f"{sweep_id}-p{i}", sweep_id=sweep_id, batch_size=i + 1, started_at=f"2026-12-01T00:0{i}:00"
        )
        results.write_point(row, root / sweep_id)
    results.write_ops(f"{sweep_id}-p0", pd.DataFrame({"op": ["aten::mm"], "self_ms": [1.0]}), root / sweep_id)
    return root / sweep_id


def rows_of(root: Path) -> pd.DataFrame:
    return results.load(root).sort_values("point_id", ignore_index=True)


def test_compaction_keeps_every_row_and_leaves_one_file_per_sweep(tmp_path):
    sweep_folder(tmp_path, "s1", 4)
    sweep_folder(tmp_path, "s2", 3)
    before = rows_of(tmp_path)
    lines = results.compact(tmp_path)
    assert sorted((line["files"], line["rows"]) for line in lines) == [(3, 3), (4, 4)]
    pd.testing.assert_frame_equal(rows_of(tmp_path), before)  # every row, every value (itl_ms lists included)
    for sweep in ("s1", "s2"):
        files = [p.name for p in (tmp_path / sweep).glob("*.parquet") if not p.name.endswith(results.OPS_SUFFIX)]
        assert len(files) == 1 and files[0].startswith(results.COMPACTED_PREFIX)
    assert (tmp_path / "s1" / f"s1-p0{results.OPS_SUFFIX}").exists()  # profiler tables stay


def test_compaction_is_idempotent_and_merges_points_written_after_it(tmp_path):
    folder = sweep_folder(tmp_path, "s1", 3)
    results.compact(tmp_path)
    (compacted,) = folder.glob(f"{results.COMPACTED_PREFIX}*")
    assert results.compact(tmp_path) == [] and compacted.exists()  # nothing new: nothing changes
    results.write_point(_row(point_id="late", sweep_id="s1", started_at="2026-12-01T01:00:00"), folder)
    (line,) = results.compact(tmp_path)
    assert line["files"] == 2 and line["rows"] == 4 and not compacted.exists()
    assert sorted(rows_of(tmp_path)["point_id"]) == ["late", "s1-p0", "s1-p1", "s1-p2"]


def test_an_interrupted_compaction_loads_each_row_once_and_the_next_run_finishes_it(tmp_path):
    folder = sweep_folder(tmp_path, "s1", 3)
    before = rows_of(tmp_path)
    # Killed after the merged file was written, before the originals were removed: every row is on disk twice.
    results.export(folder, tmp_path / "merged.parquet")
    (tmp_path / "merged.parquet").rename(folder / f"{results.COMPACTED_PREFIX}20261201-000000-000000.parquet")
    pd.testing.assert_frame_equal(rows_of(tmp_path), before)
    results.compact(tmp_path)
    pd.testing.assert_frame_equal(rows_of(tmp_path), before)
    assert len(list(folder.glob("*.parquet"))) == 2  # the compacted file and the ops table


def test_a_corrupt_file_is_left_in_place_and_the_rest_compacted(tmp_path, caplog):
    folder = sweep_folder(tmp_path, "s1", 2)
    (folder / "broken.parquet").write_bytes(b"garbage")
    (line,) = results.compact(tmp_path)
    assert line["rows"] == 2 and (folder / "broken.parquet").exists()
    assert "broken.parquet" in caplog.text


def test_a_failed_read_back_removes_nothing(tmp_path, monkeypatch):
    folder = sweep_folder(tmp_path, "s1", 2)
    files = sorted(folder.iterdir())
    monkeypatch.setattr(results, "_same_rows", lambda a, b: False)
    with pytest.raises(ValueError, match="did not read back"):
        results.compact(tmp_path)
    assert sorted(folder.iterdir()) == files


def test_the_cli_compacts_and_rejects_a_missing_folder(tmp_path, capsys):
    sweep_folder(tmp_path, "s1", 2)
    assert results.main(["compact", str(tmp_path)]) == 0
    assert "2 files -> 1, 2 rows" in capsys.readouterr().out
    assert results.main(["compact", str(tmp_path / "nope")]) == 2
    assert results.main(["compact", str(tmp_path), "--sweep", "other"]) == 2
