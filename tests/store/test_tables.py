"""The KV-movement tables (harness/store/tables.py): written cast to their contract, read back from any depth."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.store import disk, tables


def test_a_table_is_cast_to_its_contract_and_a_missing_column_is_null(tmp_path):
    frame = pd.DataFrame({"run_id": ["r"], "tier": ["disk"], "block_bytes": [4096.0], "source": [tables.MEASURED]})
    path = tables.write_table(frame, tables.TIER_COLUMNS, tmp_path / "tiers", prefix=tables.TIER_PREFIX)
    assert path.name.startswith(tables.TIER_PREFIX)
    back = pd.read_parquet(path)
    assert list(back.columns) == [c.name for c in tables.TIER_COLUMNS]
    assert back["block_bytes"].dtype == "int64" and back["gbps"].isna().all()


def test_an_unknown_column_is_refused_by_name():
    frame = pd.DataFrame({"run_id": ["r"], "gigabytes": [1.0]})
    with pytest.raises(ValueError, match=r"^unknown transfer column 'gigabytes'; allowed: run_id, model"):
        tables.write_table(frame, tables.PD_COLUMNS, "unused", prefix=tables.PD_PREFIX)


def test_tables_are_read_from_every_depth_and_are_never_result_rows(tmp_path):
    frame = pd.DataFrame({"run_id": ["a"], "transport": ["tcp"], "source": [tables.MEASURED]})
    tables.write_table(frame, tables.PD_COLUMNS, tmp_path / "pd", prefix=tables.PD_PREFIX)
    tables.write_table(frame.assign(run_id="b"), tables.PD_COLUMNS, tmp_path / "reference" / "x" / "pd",
                       prefix=tables.PD_PREFIX)  # fmt: skip
    read = tables.read_tables(tmp_path, prefix=tables.PD_PREFIX, columns=tables.PD_COLUMNS)
    assert sorted(read["run_id"]) == ["a", "b"]
    assert disk.parquet_files(tmp_path) == []  # the row loader never mistakes them for result rows
    empty = tables.read_tables(tmp_path / "none", prefix=tables.TIER_PREFIX, columns=tables.TIER_COLUMNS)
    assert empty.empty and list(empty.columns) == [c.name for c in tables.TIER_COLUMNS]
