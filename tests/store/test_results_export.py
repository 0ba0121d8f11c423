"""harness.store: export to CSV and Parquet, the kvbench-results CLI (export, show, columns) and the summary table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.store import cli, disk
from harness.store.disk import load, write_point
from harness.store.maintain import export
from harness.store.schema import COLUMNS, columns_markdown
from harness.store.summary import format_summary
from tests.store.test_results import _row


def test_export_skips_a_corrupt_file_and_keeps_the_rest(tmp_path):
    write_point(_row(point_id="a"), tmp_path / "results")
    (tmp_path / "results" / "broken.parquet").write_bytes(b"garbage")

    out = export(tmp_path / "results", tmp_path / "all.csv")

    assert pd.read_csv(out)["point_id"].tolist() == ["a"]


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
