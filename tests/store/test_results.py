"""harness.store: the column contract, atomic point files, load, export and the summary table."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.store import atomic, cli, disk, schema
from harness.store.disk import load, write_point
from harness.store.maintain import export
from harness.store.schema import COLUMNS, SCHEMA_VERSION, columns_markdown
from harness.store.summary import format_summary

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


def test_export_skips_a_corrupt_file_and_keeps_the_rest(tmp_path):
    write_point(_row(point_id="a"), tmp_path / "results")
    (tmp_path / "results" / "broken.parquet").write_bytes(b"garbage")

    out = export(tmp_path / "results", tmp_path / "all.csv")

    assert pd.read_csv(out)["point_id"].tolist() == ["a"]


def test_load_accepts_a_single_parquet_file(tmp_path):
    write_point(_row(point_id="a"), tmp_path)
    path = write_point(_row(point_id="b"), tmp_path)

    assert load(path)["point_id"].tolist() == ["b"]


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


def test_export_to_csv_writes_itl_as_a_json_list(tmp_path):
    write_point(_row(point_id="a"), tmp_path / "results")
    write_point(_row(point_id="b", status="oom", error="out of memory", itl_ms=None), tmp_path / "results")

    out = export(tmp_path / "results", tmp_path / "all.csv")
    table = pd.read_csv(out).set_index("point_id")

    assert list(table.reset_index().columns) == [c.name for c in COLUMNS]
    assert json.loads(table.loc["a", "itl_ms"]) == [1.25, 1.5, 1.75]
    assert pd.isna(table.loc["b", "itl_ms"])


def test_export_to_parquet_keeps_types_and_rows(tmp_path):
    write_point(_row(point_id="a"), tmp_path / "results")
    write_point(_row(point_id="b"), tmp_path / "results" / "nested")

    out = export(tmp_path / "results", tmp_path / "export" / "all.parquet")

    assert pq.read_schema(out).field("block_size").type == pa.int64()
    assert sorted(load(out)["point_id"]) == ["a", "b"]
    assert load(out).loc[0, "itl_ms"] == [1.25, 1.5, 1.75]


def test_export_rejects_an_unknown_suffix_naming_the_allowed_ones(tmp_path):
    write_point(_row(), tmp_path / "results")

    with pytest.raises(ValueError, match=r"\.csv.*\.parquet"):
        export(tmp_path / "results", tmp_path / "all.xlsx")
    assert not (tmp_path / "all.xlsx").exists()


def test_export_refuses_a_parquet_file_inside_its_own_source(tmp_path):
    write_point(_row(), tmp_path)

    with pytest.raises(ValueError, match="duplicate rows"):
        export(tmp_path, tmp_path / "all.parquet")


def test_cli_export_writes_the_file(tmp_path):
    write_point(_row(), tmp_path / "results")

    assert cli.main(["export", str(tmp_path / "results"), str(tmp_path / "all.csv")]) == 0
    assert pd.read_csv(tmp_path / "all.csv")["point_id"].tolist() == ["p0"]


def test_cli_export_with_a_bad_suffix_exits_nonzero(tmp_path, caplog):
    write_point(_row(), tmp_path / "results")

    assert cli.main(["export", str(tmp_path / "results"), str(tmp_path / "all.json")]) == 2
    assert ".csv" in caplog.text


def test_cli_show_filters_by_sweep(tmp_path, capsys):
    write_point(_row(point_id="a", sweep_id="s1", model="alpha"), tmp_path)
    write_point(_row(point_id="b", sweep_id="s2", model="beta"), tmp_path)

    assert cli.main(["show", str(tmp_path), "--sweep", "s2"]) == 0
    printed = capsys.readouterr().out

    assert "beta" in printed
    assert "alpha" not in printed


@pytest.mark.parametrize(
    "arguments",
    [
        ["show", "{missing}"],
        ["export", "{missing}", "{tmp}/all.csv"],
        ["compact", "{missing}"],
        ["diff", "{missing}", "aaaa", "bbbb"],
        ["compare", "{missing}", "{tmp}"],
        ["compare", "{tmp}", "{missing}"],
    ],
    ids=["show", "export", "compact", "diff", "compare-a", "compare-b"],
)
def test_cli_refuses_a_missing_path_with_one_line_and_exit_2_before_reading_anything(
    tmp_path, capsys, monkeypatch, arguments
):
    monkeypatch.setattr(disk, "parquet_files", lambda path: pytest.fail(f"read {path}"))  # every reader lists here
    missing = tmp_path / "no" / "such" / "dir"
    argv = [argument.format(missing=missing, tmp=tmp_path) for argument in arguments]
    assert cli.main(argv) == 2
    printed = capsys.readouterr()
    assert printed.err == f"kvbench-results {argv[0]}: {missing}: no such file or directory\n"
    assert printed.out == "" and not (tmp_path / "all.csv").exists()


def test_cli_show_of_an_existing_empty_folder_says_no_results_and_exits_0(tmp_path, capsys):
    assert cli.main(["show", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "(no results)\n"


def test_cli_columns_prints_the_markdown_table(capsys):
    assert cli.main(["columns"]) == 0
    assert capsys.readouterr().out == columns_markdown()


def test_summary_has_one_line_per_row_sorted_with_nulls_as_dashes(tmp_path):
    write_point(_row(point_id="b", model="tiny", batch_size=8), tmp_path)
    write_point(_row(point_id="a", model="tiny", batch_size=1, tpot_ms=None), tmp_path)

    lines = format_summary(load(tmp_path)).splitlines()

    assert len(lines) == 3
    assert lines[0].split()[:3] == ["status", "model", "cache"]
    batch_column = lines[0].index("batch") + len("batch")
    assert [line[:batch_column].split()[-1] for line in lines[1:]] == ["1", "8"]
    assert re.search(r"\s-\s", lines[1])
    assert "3.0" in lines[1]  # KV alloc: 3 MiB


def test_summary_ends_failed_rows_with_their_shortened_error(tmp_path):
    long_error = "CUDA out of memory. " + "Tried to allocate 2.00 GiB; " * 10 + "\nTraceback follows"
    write_point(_row(point_id="a"), tmp_path)
    write_point(_row(point_id="b", status="oom", error=long_error, ttft_ms=None), tmp_path)

    ok_line, oom_line = format_summary(load(tmp_path)).splitlines()[1:]

    assert "CUDA out of memory" not in ok_line
    tail = oom_line[oom_line.index("CUDA out of memory") :]
    assert len(tail) <= 60
    assert oom_line.startswith("oom")


def test_summary_of_no_rows_says_so():
    assert format_summary(load(Path("/nonexistent/results"))) == "(no results)"


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


def test_the_schema_has_one_share_column_per_profiler_category_and_imports_no_torch():
    import subprocess
    import sys

    from harness.store.schema import COLUMNS, PROFILE_CATEGORIES

    shares = {c.name for c in COLUMNS if c.name.startswith("prof_") and c.name.endswith("_frac")}
    assert shares == {f"prof_{category}_frac" for category in PROFILE_CATEGORIES}
    code = "import sys, harness.store.schema; assert 'torch' not in sys.modules, 'the schema imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
