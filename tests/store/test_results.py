"""harness.store: the column contract, its schema and the README's column table, and atomic point files."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.store import atomic, disk, schema
from harness.store.disk import load, write_point
from harness.store.schema import COLUMNS, SCHEMA_VERSION, columns_markdown

README_PATH = Path(__file__).resolve().parents[2] / "README.md"


def _row(**overrides: object) -> dict:
    """A plausible measured CPU point; torch/NVML columns stay absent, as on CPU."""
    row = {
        "point_id": "p0",
        "sweep_id": "s1",
        "status": "ok",
        "error": None,
        "model": "tiny",
        "n_params": 1_234_567,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "dtype": "float32",
        "kv_dtype": "float32",
        "cache": "contiguous",
        "batch_size": 2,
        "prompt_len": 8,
        "gen_len": 4,
        "device": "cpu",
        "weights": "dummy",
        "seed": 0,
        "ttft_ms": 3.25,
        "tpot_ms": 1.5,
        "itl_ms": [1.25, 1.5, 1.75],
        "decode_tok_s": 4000.0,
        "repeats": 5,
        "kv_bytes_allocated": 3 * 2**20,
        "kv_bytes_live": 2**20,
        "peak_mem_bytes": 200 * 2**20,
        "output_digest": "ab" * 32,
        "started_at": "2024-06-01T12:00:00+00:00",
    }
    row.update(overrides)
    return row


def test_write_then_load_round_trips_values_and_types(tmp_path):
    row = _row()
    write_point(row, tmp_path)

    loaded = load(tmp_path).iloc[0]

    for name, value in row.items():
        if value is None:
            assert pd.isna(loaded[name]), name
        else:
            assert loaded[name] == value, name
    assert isinstance(loaded["itl_ms"], list)
    assert load(tmp_path)["batch_size"].dtype == "Int64"
    assert load(tmp_path)["ttft_ms"].dtype == "float64"


def test_missing_keys_are_written_as_typed_nulls(tmp_path):
    path = write_point({"point_id": "p0", "status": "ok"}, tmp_path)

    file_schema = pq.read_schema(path)
    loaded = load(tmp_path)

    assert file_schema.field("block_size").type == pa.int64()
    assert file_schema.field("itl_ms").type == pa.list_(pa.float64())
    assert file_schema.field("torch_peak_allocated_bytes").type == pa.int64()
    assert loaded["block_size"].dtype == "Int64"
    assert loaded["max_memory_gb"].dtype == "float64"
    assert pd.isna(loaded.loc[0, "torch_peak_allocated_bytes"])
    assert loaded.loc[0, "itl_ms"] is None


def test_schema_version_is_filled_in_when_absent(tmp_path):
    write_point(_row(), tmp_path)

    assert load(tmp_path).loc[0, "schema_version"] == SCHEMA_VERSION


def test_unknown_key_is_rejected_by_name_and_nothing_is_written(tmp_path):
    with pytest.raises(ValueError, match="ttft_seconds") as excinfo:
        write_point(_row(ttft_seconds=0.1), tmp_path)

    assert "\n" not in str(excinfo.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("point_id", [None, "", ".hidden", "a/b"])
def test_point_id_must_be_a_safe_file_name(tmp_path, point_id):
    row = _row(point_id=point_id) if point_id is not None else {k: v for k, v in _row().items() if k != "point_id"}

    with pytest.raises(ValueError, match="point_id"):
        write_point(row, tmp_path)


def test_value_of_the_wrong_type_names_its_column(tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        write_point(_row(batch_size="two"), tmp_path)


def test_rewriting_a_point_replaces_its_row(tmp_path):
    write_point(_row(ttft_ms=1.0), tmp_path)
    write_point(_row(ttft_ms=2.0), tmp_path)

    assert load(tmp_path)["ttft_ms"].tolist() == [2.0]


def test_failed_rename_leaves_no_file_and_the_existing_point_untouched(tmp_path, monkeypatch):
    existing = write_point(_row(point_id="p0", ttft_ms=1.0), tmp_path)
    existing_bytes = existing.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk vanished")

    monkeypatch.setattr(atomic.os, "replace", crash)
    with pytest.raises(OSError, match="disk vanished"):
        write_point(_row(point_id="p0", ttft_ms=2.0), tmp_path)
    with pytest.raises(OSError, match="disk vanished"):
        write_point(_row(point_id="p1"), tmp_path)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["p0.parquet"]
    assert existing.read_bytes() == existing_bytes
    assert load(tmp_path)["ttft_ms"].tolist() == [1.0]


def test_writer_failing_mid_file_leaves_nothing_behind(tmp_path, monkeypatch):
    def write_half_then_crash(table, where, **kwargs):
        where.write(b"PAR1 half a file")
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(disk.pq, "write_table", write_half_then_crash)
    with pytest.raises(RuntimeError, match="killed mid-write"):
        write_point(_row(), tmp_path)

    assert list(tmp_path.iterdir()) == []
    assert load(tmp_path).empty


def test_columns_come_in_contract_order(tmp_path):
    write_point(_row(), tmp_path)

    assert list(load(tmp_path).columns) == [c.name for c in COLUMNS]


def test_older_file_lacking_a_column_loads_it_as_null(tmp_path):
    write_point(_row(point_id="new"), tmp_path)
    old = pa.table({"point_id": ["old"], "status": ["ok"], "ttft_ms": [9.0]})  # written before the other columns
    pq.write_table(old, tmp_path / "old.parquet")

    loaded = load(tmp_path).set_index("point_id")

    assert list(loaded.reset_index().columns) == [c.name for c in COLUMNS]
    assert loaded.loc["old", "ttft_ms"] == 9.0
    assert pd.isna(loaded.loc["old", "tpot_ms"])
    assert pd.isna(loaded.loc["old", "batch_size"])
    assert loaded["batch_size"].dtype == "Int64"
    assert loaded.loc["new", "tpot_ms"] == 1.5


def test_columns_from_a_newer_schema_are_kept_at_the_end(tmp_path):
    write_point(_row(point_id="now"), tmp_path)
    newer = pa.table({"point_id": ["later"], "status": ["ok"], "energy_j": [12.5]})
    pq.write_table(newer, tmp_path / "later.parquet")

    loaded = load(tmp_path).set_index("point_id")

    assert loaded.columns[-1] == "energy_j"
    assert loaded.loc["later", "energy_j"] == 12.5
    assert pd.isna(loaded.loc["now", "energy_j"])


def test_columns_markdown_lists_every_column():
    table = columns_markdown()

    assert table.splitlines()[0] == "| Column | Type | Unit | Meaning |"
    for column in COLUMNS:
        assert f"| `{column.name}` | {column.type} | {column.unit} |" in table
    assert len(table.splitlines()) == 2 + len(COLUMNS)


def test_column_names_are_unique_and_described():
    names = [c.name for c in COLUMNS]

    assert len(names) == len(set(names))
    assert all(c.description for c in COLUMNS)
    assert schema.arrow_schema().names == names


def test_a_points_top_ops_table_sits_beside_its_row_and_load_skips_it(tmp_path):
    import pandas as pd

    from harness.store.disk import load_ops, write_ops

    write_point(_row(point_id="p1"), tmp_path)
    ops = pd.DataFrame(
        {"op": ["aten::mm", "aten::add"], "category": ["gemm", "norm_elementwise"], "self_ms": [3.0, 1.0]}
    )
    path = write_ops("p1", ops, tmp_path)
    assert path.name == "p1.ops.parquet"
    assert len(load(tmp_path)) == 1
    table = load_ops(tmp_path)
    assert list(table["point_id"]) == ["p1", "p1"] and list(table["op"]) == ["aten::mm", "aten::add"]


def test_readme_column_table_is_current():
    """README.md embeds `kvbench-results columns` between the columns markers; regenerate it if this fails."""
    readme = README_PATH.read_text(encoding="utf-8") if README_PATH.exists() else ""
    match = re.search(r"<!-- columns:start -->(.*?)<!-- columns:end -->", readme, flags=re.DOTALL)

    assert match, f"{README_PATH} needs the column table between <!-- columns:start --> and <!-- columns:end -->"
    assert match.group(1).strip() == columns_markdown().strip()


def test_the_schema_has_one_share_column_per_profiler_category_and_imports_no_torch():
    import subprocess
    import sys

    from harness.store.schema import COLUMNS, PROFILE_CATEGORIES

    shares = {c.name for c in COLUMNS if c.name.startswith("prof_") and c.name.endswith("_frac")}
    assert shares == {f"prof_{category}_frac" for category in PROFILE_CATEGORIES}
    code = "import sys, harness.store.schema; assert 'torch' not in sys.modules, 'the schema imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
