"""The column contract of a result row, and how rows reach disk and come back.

One measured sweep point is one row: a flat dict of named scalars whose units live in their names (`_ms`, `_bytes`,
`_tok_s`), plus `itl_ms`, the list of per-step decode latencies. `COLUMNS` below is the only place the schema is
written down; the Parquet type, the README table and the loader's column order all come from it.

Each point is written to its own `<point_id>.parquet`, atomically (temp file, fsync, rename), so a sweep that
crashes or is killed leaves only whole rows behind, and a rerun of the same point replaces its file.

    python -m harness.results show results/ --sweep 2024-06-01_12-00
    python -m harness.results export results/ all.csv
    python -m harness.results columns          # the Markdown table the README embeds
    python -m harness.results compact results/ # one file per sweep folder instead of one per point
    python -m harness.results diff results/ 3f2a 9c1e   # what changed between two rows (config, environment)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from harness.store.schema import _ARROW_TYPES, COLUMNS, SCHEMA_VERSION, Column, arrow_schema  # noqa: F401

logger = logging.getLogger(__name__)

# A point_id becomes a file name: keep it to characters that are safe everywhere, and never hidden.
_POINT_ID_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_EXPORT_SUFFIXES = (".csv", ".parquet")
_ERROR_WIDTH_CHARS = 60  # format_summary: keeps a failed row on one terminal line
_MIB_BYTES = 2**20


# ---------------------------------------------------------------------------------------------------------- write


def write_point(row: dict, directory: str | Path) -> Path:
    """Write one row to `directory/<point_id>.parquet` atomically and return that path.

    Unknown keys are rejected; missing keys are written as nulls of their column's type.
    """
    names = {c.name for c in COLUMNS}
    for key in row:
        if key not in names:
            raise ValueError(f"unknown result column {key!r}; add it to harness.results.COLUMNS first")
    point_id = row.get("point_id")
    if not isinstance(point_id, str) or not _POINT_ID_PATTERN.fullmatch(point_id):
        raise ValueError(
            f"point_id must be a non-empty string of [A-Za-z0-9_.-] not starting with '.', got {point_id!r}"
        )
    row = {"schema_version": SCHEMA_VERSION, **row}

    schema = arrow_schema()
    arrays = [_one_value_array(field=field, value=row.get(field.name)) for field in schema]
    table = pa.Table.from_arrays(arrays, schema=schema)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{point_id}.parquet"
    _write_parquet_atomic(table=table, path=path)
    logger.debug("wrote %s", path)
    return path


FRONTIER_PREFIX = "frontier-"  # capacity OOM-frontier tables: <results_dir>/capacity/frontier-<time>.parquet
_IDENTITY_COLUMNS = ("point_id", "status")  # a parquet file without them is not a result row
_MEASUREMENT_KEY = ("point_id", "sweep_id", "started_at")  # one measurement; load() keeps one row per key
REFERENCE_DIR = "reference"  # <results_dir>/reference: committed runs, left alone by compact (and by resume)
COMPACTED_PREFIX = "compacted-"  # python -m harness.results compact: <sweep dir>/compacted-<time>.parquet
OPS_SUFFIX = ".ops.parquet"  # a point's profiler top-ops table, beside its row: <point_id>.ops.parquet


def write_ops(point_id: str, table: pd.DataFrame, directory: str | Path) -> Path:
    """The profiler's top-ops table of one point, keyed by its point_id, written atomically beside the row."""
    path = Path(directory) / f"{point_id}{OPS_SUFFIX}"
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = table.assign(point_id=point_id)
    _write_parquet_atomic(table=pa.Table.from_pandas(frame, preserve_index=False), path=path)
    return path


def load_ops(path: str | Path) -> pd.DataFrame:
    """Every top-ops table under a directory, concatenated (a point_id column says whose)."""
    files = sorted(p for p in Path(path).rglob(f"*{OPS_SUFFIX}") if not p.name.startswith("."))
    if not files:
        return pd.DataFrame(columns=["point_id"])
    return pd.concat([pd.read_parquet(file) for file in files], ignore_index=True)


def _one_value_array(field: pa.Field, value: object) -> pa.Array:
    try:
        # from_pandas: a float NaN becomes null, so "not measured" has one spelling on disk.
        return pa.array([value], type=field.type, from_pandas=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
        raise ValueError(f"column {field.name!r} ({field.type}) cannot hold {value!r}: {exc}") from None


def _write_parquet_atomic(table: pa.Table, path: Path) -> None:
    """Write to a hidden temp file beside `path`, fsync it, then rename over `path`.

    The rename is atomic on POSIX, so readers see either the old file or the whole new one; load() skips the
    hidden temp name, so a crash mid-write leaves nothing that passes for a row.
    """
    tmp_path = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp_path.open("wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)  # makes the rename itself survive a power loss


def _fsync_directory(directory: Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # Windows cannot open a directory; its rename is durable enough
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------- load


def load(path: str | Path, *, skipped: list[str] | None = None) -> pd.DataFrame:
    """Every row under `path` (a directory, searched recursively, or one .parquet file) as one DataFrame.

    Columns come in COLUMNS order, then any columns unknown to this schema (written by a newer one). Integer and
    bool columns use pandas' nullable dtypes (Int64, boolean) so nulls do not turn them into floats; itl_ms cells
    are lists of floats (or None).

    A file in a directory that is not a result table (truncated, garbage, a foreign parquet without point_id and
    status, a column of the wrong type) is skipped with a warning naming it, so one bad file never hides the rest;
    "<path>: <reason>" is appended to `skipped` when a list is given. A single file given as `path` raises instead.

    Rows equal in point_id, sweep_id and started_at are one measurement stored twice (a compaction killed between
    writing its merged file and removing the originals, or a sweep folder copied beside itself): only the first
    copy is kept, so no reader counts a measurement twice. Two runs of the same point differ in started_at and both
    stay.
    """
    return _table_to_frame(_load_table(Path(path), skipped=skipped))


INDEX_COLUMNS = ("point_id", "sweep_id", "status", "error", "device_name", "started_at")


def index(path: str | Path, *, skipped: list[str] | None = None) -> pd.DataFrame:
    """One line per row under `path`: INDEX_COLUMNS and the `path` of its file, reading only those columns of each
    file, so that a resume can look up hundreds of points in a second (load() reads every column, itl_ms lists
    included). Same files as load(): unreadable ones are skipped (and listed in `skipped`), a column a file lacks is
    null, and a measurement stored twice (equal point_id, sweep_id, started_at) is one line."""
    lines = []
    for file in _parquet_files(Path(path)):
        try:
            parquet = pq.ParquetFile(file)  # reads the footer once: the schema, then only the wanted column chunks
            present = parquet.schema_arrow.names
            missing = [name for name in _IDENTITY_COLUMNS if name not in present]
            if missing:
                raise ValueError(f"not a kvbench result table (no {', '.join(missing)} column)")
            frame = parquet.read(columns=[c for c in INDEX_COLUMNS if c in present]).to_pandas()
        except (pa.ArrowInvalid, OSError, ValueError) as exc:
            logger.warning("skipped %s: %s", file, exc)
            if skipped is not None:
                skipped.append(f"{file}: {exc}")
            continue
        lines.append(frame.reindex(columns=list(INDEX_COLUMNS)).assign(path=str(file)))
    if not lines:
        return pd.DataFrame(columns=[*INDEX_COLUMNS, "path"], dtype=object)
    merged = pd.concat(lines, ignore_index=True)
    return merged.drop_duplicates(subset=list(_MEASUREMENT_KEY), keep="first", ignore_index=True)


def _load_table(path: Path, *, skipped: list[str] | None = None) -> pa.Table:
    tables = []
    for file in _parquet_files(path):
        try:
            tables.append(_conform(table=_read_parquet(file), source=file))
        except ValueError as exc:
            if path.is_file():
                raise
            logger.warning("skipped %s", exc)
            if skipped is not None:
                skipped.append(str(exc))
    if not tables:
        return arrow_schema().empty_table()
    merged = pa.concat_tables(tables, promote_options="permissive")
    known = [c.name for c in COLUMNS]
    extras = [name for name in merged.column_names if name not in known]
    return _drop_repeats(merged.select(known + extras))


def _drop_repeats(table: pa.Table) -> pa.Table:
    """One copy of each measurement: rows equal in point_id, sweep_id and started_at are the same row twice on disk
    (a compaction interrupted between writing its merged file and removing the originals)."""
    keys = pd.DataFrame({name: table.column(name).to_pandas() for name in _MEASUREMENT_KEY})
    first = ~keys.duplicated(keep="first").to_numpy()
    return table if first.all() else table.filter(pa.array(first))


def _parquet_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".parquet":
            raise ValueError(f"{path} is not a .parquet file or a directory of them")
        return [path]
    if not path.exists():
        if path.suffix == ".parquet":
            raise FileNotFoundError(path)
        logger.info("%s does not exist: no results", path)
        return []
    # Skip hidden files and folders: write_point's temp files, editor and notebook leftovers.
    return sorted(
        file
        for file in path.rglob("*.parquet")
        if file.is_file()
        and not file.name.endswith(OPS_SUFFIX)  # profiler tables: load_ops()
        and not file.name.startswith(FRONTIER_PREFIX)  # capacity frontier tables: experiments/capacity.py
        and not any(part.startswith(".") for part in file.relative_to(path).parts)
    )


def _read_parquet(path: Path) -> pa.Table:
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:  # pyarrow's message does not say which file
        raise ValueError(f"{path}: not a readable parquet file: {exc}") from None
    missing = [name for name in _IDENTITY_COLUMNS if name not in table.column_names]
    if missing:
        raise ValueError(f"{path}: not a kvbench result table (no {', '.join(missing)} column)")
    return table


def _conform(table: pa.Table, source: Path) -> pa.Table:
    """Cast the known columns to this schema's types and add the ones the file lacks as nulls; keep extras."""
    schema = arrow_schema()
    arrays, fields = [], []
    for field in schema:
        if field.name in table.column_names:
            column = table.column(field.name)
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise ValueError(f"{source}: column {field.name!r} cannot be read as {field.type}: {exc}") from None
        else:
            column = pa.nulls(table.num_rows, type=field.type)
        arrays.append(column)
        fields.append(field)
    for field in table.schema:
        if field.name not in schema.names:
            arrays.append(table.column(field.name))
            fields.append(field.remove_metadata())
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _table_to_frame(table: pa.Table) -> pd.DataFrame:
    nullable = {pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}
    df = table.to_pandas(types_mapper=nullable.get)
    for column in COLUMNS:
        if column.type.startswith("list<"):
            df[column.name] = pd.Series([_as_list(v) for v in df[column.name]], index=df.index, dtype=object)
    return df


def _as_list(value: object) -> list | None:
    # Arrow hands lists back as numpy arrays; plain lists compare with == and serialise to JSON as they are.
    return None if value is None else [float(x) for x in value]


# --------------------------------------------------------------------------------------------------------- export


def export(src: str | Path, out: str | Path) -> Path:
    """Write every row under `src` to one .csv or .parquet file, chosen by the suffix of `out`."""
    src, out = Path(src), Path(out)
    if out.suffix not in _EXPORT_SUFFIXES:
        raise ValueError(f"cannot export to {out.name!r}: the suffix must be one of {', '.join(_EXPORT_SUFFIXES)}")
    if out.suffix == ".parquet" and src.is_dir() and out.resolve().is_relative_to(src.resolve()):
        raise ValueError(f"{out} is inside {src}: load() would read the export back as duplicate rows")
    table = _load_table(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        _write_parquet_atomic(table=table, path=out)
    else:
        df = _table_to_frame(table)
        for column in COLUMNS:
            if column.type.startswith("list<"):
                df[column.name] = [None if v is None else json.dumps(v) for v in df[column.name]]
        df.to_csv(out, index=False)
    logger.info("exported %d rows to %s", table.num_rows, out)
    return out


# ------------------------------------------------------------------------------------------------------- compact


def compact(results_dir: str | Path, *, sweep: str | None = None) -> list[dict]:
    """Merge the row files of every sweep folder under results_dir (or only the folder named `sweep`) into one
    `compacted-<time>.parquet` per folder; returns a line per folder it changed: {folder, files, rows, bytes_before,
    bytes_after}.

    The merged file is written atomically and read back; its rows must equal the inputs' (count and content) before
    any original is removed, so a failed check leaves everything as it was. Killed between the write and the removal,
    the rows exist twice on disk, which load() reads once (rows equal in point_id, sweep_id and started_at), and the
    next run finishes the job. Idempotent: a folder holding one compacted file and nothing else is left alone.
    Unreadable files stay where they are, with a warning; profiler tables (.ops.parquet) are not rows and stay too.
    <results_dir>/reference/ (committed reference runs) is left alone unless given as results_dir itself.
    Columns come in COLUMNS order, then any columns unknown to this schema, kept as load() keeps them. A file that
    changes while it is being merged (a running sweep rewriting its point) is left in place, never deleted.
    """
    root = Path(results_dir)
    if not root.is_dir():
        raise ValueError(f"results_dir: {root} is not a directory")
    folders = sorted({file.parent for file in _parquet_files(root)})
    reference = root / REFERENCE_DIR  # committed reference runs: compacting them would delete tracked files
    folders = [folder for folder in folders if folder != reference and reference not in folder.parents]
    if sweep is not None:
        folders = [folder for folder in folders if folder.name == sweep]
        if not folders:
            raise ValueError(f"--sweep: no folder named {sweep!r} with rows under {root}")
    return [line for folder in folders if (line := _compact_folder(folder)) is not None]


def _compact_folder(folder: Path) -> dict | None:
    files = [file for file in _parquet_files(folder) if file.parent == folder]
    if len(files) == 1 and files[0].name.startswith(COMPACTED_PREFIX):
        return None  # done already
    readable, tables, unreadable = {}, [], 0  # readable: file -> its stat when read
    for file in files:
        try:
            stat = file.stat()
            tables.append(_conform(table=_read_parquet(file), source=file))
            readable[file] = stat
        except (ValueError, FileNotFoundError) as exc:  # FileNotFoundError: removed since the listing
            logger.warning("compact: left in place: %s", exc)
            unreadable += 1
    if len(readable) < 2 and all(file.name.startswith(COMPACTED_PREFIX) for file in readable):
        return None  # nothing to merge: no file, or one compacted file beside unreadable ones
    merged = _drop_repeats(pa.concat_tables(tables, promote_options="permissive"))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S-%f")
    target = folder / f"{COMPACTED_PREFIX}{stamp}.parquet"
    _write_parquet_atomic(table=merged, path=target)
    try:
        written = load(target)
        same = _same_rows(_table_to_frame(merged), written)
    except ValueError:
        same = False
    if not same:
        target.unlink()
        raise ValueError(
            f"compact: {target} did not read back as the {merged.num_rows} rows of {folder}; nothing removed"
        )
    # The merged file is whole and checked: only now do the originals go, each only if it is still the file read.
    removed = []
    for file, stat in readable.items():
        try:
            now = file.stat()
        except FileNotFoundError:
            continue
        if (now.st_ino, now.st_size, now.st_mtime_ns) != (stat.st_ino, stat.st_size, stat.st_mtime_ns):
            logger.warning("compact: %s changed while being merged; left in place for the next run", file)
            continue
        file.unlink()
        removed.append(stat.st_size)
    _fsync_directory(folder)
    return {
        "folder": str(folder),
        "files": len(removed),
        "rows": len(written),
        "bytes_before": sum(removed),
        "bytes_after": target.stat().st_size,
        "unreadable": unreadable,
    }


def _same_rows(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """The same columns and, measurement by measurement (rows sorted by _MEASUREMENT_KEY), the same values; nulls
    and NaNs equal themselves. Both frames hold each measurement once (see _drop_repeats), so the sort is total."""
    if len(a) != len(b) or list(a.columns) != list(b.columns):
        return False
    order = list(_MEASUREMENT_KEY)
    a, b = a.sort_values(order, ignore_index=True), b.sort_values(order, ignore_index=True)
    return all(_same_value(x, y) for column in a.columns for x, y in zip(a[column], b[column], strict=True))


def _same_value(x: object, y: object) -> bool:
    """Equality for one cell: lists (itl_ms; extra list columns arrive as arrays) element by element, NaN == NaN,
    and a null equals only a null."""
    if isinstance(x, (list, tuple, np.ndarray)) or isinstance(y, (list, tuple, np.ndarray)):
        if not isinstance(x, (list, tuple, np.ndarray)) or not isinstance(y, (list, tuple, np.ndarray)):
            return False
        return len(x) == len(y) and all(_same_value(p, q) for p, q in zip(x, y, strict=True))
    x_null, y_null = bool(pd.isna(x)), bool(pd.isna(y))
    if x_null or y_null:
        return x_null and y_null
    return bool(x == y)


# ---------------------------------------------------------------------------------------------------------- diff


def pick_row(rows: pd.DataFrame, wanted: str, argument: str) -> pd.Series:
    """The row whose point_id is `wanted` or starts with it (unique); of several runs of it, the latest. An exact
    point_id wins over longer ids it is a prefix of."""
    ids = rows["point_id"].astype(str)
    matches = rows[ids == wanted] if (ids == wanted).any() else rows[ids.str.startswith(wanted)]
    if matches.empty:
        raise ValueError(f"{argument}: no row's point_id starts with {wanted!r}")
    if matches["point_id"].nunique() > 1:
        raise ValueError(f"{argument}: {wanted!r} matches {matches['point_id'].nunique()} points; give more of the id")
    if len(matches) > 1:
        logger.info(
            "%s: %s was measured %d times; comparing the latest (started_at %s)",
            argument,
            matches["point_id"].iloc[0],
            len(matches),
            matches["started_at"].max(),
        )
    return matches.sort_values("started_at", na_position="first").iloc[-1]


def read_row(line: pd.Series) -> pd.Series:
    """The whole row an index() line points at: its file is read, and the row equal in _MEASUREMENT_KEY taken."""
    rows = load(line["path"])
    same = pd.Series(True, index=rows.index)
    for key in _MEASUREMENT_KEY:
        same &= rows[key].isna() if pd.isna(line[key]) else (rows[key] == line[key]).fillna(False).astype(bool)
    if not same.any():
        raise ValueError(f"{line['path']}: changed since it was indexed (a compaction or a sweep ran); try again")
    return rows[same].iloc[0]


def diff_rows(a: pd.Series, b: pd.Series) -> list[str]:
    """'column: a -> b' for every column that differs, and 'config.<key>: a -> b' for every differing key of the
    two rows' config_json."""
    lines = []
    for column in a.index.union(b.index, sort=False):  # extras unknown to COLUMNS may be in one row only
        if column == "config_json":
            continue
        left, right = a.get(column), b.get(column)
        if not _same_value(left, right):
            lines.append(f"{column}: {_short(left)} -> {_short(right)}")
    configs = [json.loads(row["config_json"]) if isinstance(row.get("config_json"), str) else {} for row in (a, b)]
    flat = [_flatten(config) for config in configs]
    for key in sorted(set(flat[0]) | set(flat[1])):
        if flat[0].get(key) != flat[1].get(key):
            lines.append(f"config.{key}: {flat[0].get(key)} -> {flat[1].get(key)}")
    return lines


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# -------------------------------------------------------------------------------------------------------- summary


def format_summary(df: pd.DataFrame) -> str:
    """A fixed-width table, one line per row; failed rows end with their error, shortened."""
    if df.empty:
        return "(no results)"
    df = df.reindex(columns=[c.name for c in COLUMNS]).sort_values(
        ["model", "cache", "kv_dtype", "batch_size", "prompt_len"], na_position="last", kind="stable"
    )
    # (header, column, format, is text): text is left-aligned, numbers right-aligned.
    layout = [
        ("status", "status", "{}", True),
        ("model", "model", "{}", True),
        ("cache", "cache", "{}", True),
        ("kv_dtype", "kv_dtype", "{}", True),
        ("batch", "batch_size", "{:.0f}", False),
        ("prompt", "prompt_len", "{:.0f}", False),
        ("gen", "gen_len", "{:.0f}", False),
        ("ttft ms", "ttft_ms", "{:.2f}", False),
        ("tpot ms", "tpot_ms", "{:.3f}", False),
        ("decode tok/s", "decode_tok_s", "{:.1f}", False),
        ("KV alloc MiB", "kv_bytes_allocated", "MiB", False),
        ("KV live MiB", "kv_bytes_live", "MiB", False),
        ("KV waste %", "kv_waste_fraction", "%", False),
        ("top1", "top1_agreement", "{:.3f}", False),
        ("peak MiB", "peak_mem_bytes", "MiB", False),
    ]
    cells = [[_format_cell(value, fmt) for value in df[name]] for _, name, fmt, _ in layout]
    widths = [
        max(len(header), *(len(cell) for cell in column)) for (header, *_), column in zip(layout, cells, strict=True)
    ]

    def line(texts: Sequence[str]) -> str:
        return "  ".join(
            text.ljust(width) if is_text else text.rjust(width)
            for text, width, (*_, is_text) in zip(texts, widths, layout, strict=True)
        )

    lines = [line([header for header, *_ in layout])]
    for i, (status, error) in enumerate(zip(df["status"], df["error"], strict=True)):
        text = line([column[i] for column in cells])
        if status != "ok":
            text += "  " + _shorten(error)
        lines.append(text.rstrip())
    return "\n".join(lines)


def _format_cell(value: object, fmt: str) -> str:
    if value is None or pd.isna(value):
        return "-"
    if fmt == "MiB":
        return f"{value / _MIB_BYTES:.1f}"
    if fmt == "%":
        return f"{100 * value:.1f}"
    return fmt.format(value)


def _shorten(error: object) -> str:
    if error is None or pd.isna(error) or not str(error).strip():
        return "-"
    text = " ".join(str(error).split())  # one line: tracebacks and multi-line messages collapse
    return text if len(text) <= _ERROR_WIDTH_CHARS else text[: _ERROR_WIDTH_CHARS - 1] + "…"


def columns_markdown() -> str:
    """The column contract as a Markdown table, for the README (between the columns:start/end markers)."""
    lines = ["| Column | Type | Unit | Meaning |", "|---|---|---|---|"]
    for c in COLUMNS:
        meaning = c.description.replace("|", r"\|")  # a bare pipe would split the cell
        lines.append(f"| `{c.name}` | {c.type} | {c.unit} | {meaning} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.results", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser("export", help="merge every row under SRC into one .csv or .parquet file")
    export_parser.add_argument("src", type=Path, help="results directory (searched recursively) or .parquet file")
    export_parser.add_argument("out", type=Path, help="output file; its suffix (.csv or .parquet) picks the format")
    show_parser = commands.add_parser("show", help="print a summary table of the rows under SRC")
    show_parser.add_argument("src", type=Path, help="results directory (searched recursively) or .parquet file")
    show_parser.add_argument("--sweep", metavar="ID", help="only rows whose sweep_id is ID")
    commands.add_parser("columns", help="print the column contract as a Markdown table")
    compact_parser = commands.add_parser("compact", help="merge each sweep folder's point files into one file")
    compact_parser.add_argument("results_dir", type=Path, help="results directory (every sweep folder under it)")
    compact_parser.add_argument("--sweep", metavar="ID", help="only the sweep folder named ID")
    diff_parser = commands.add_parser("diff", help="what differs between two rows (config, environment, figures)")
    diff_parser.add_argument("src", type=Path, help="results directory (searched recursively) or .parquet file")
    diff_parser.add_argument("a", help="a point_id, or a unique prefix of one")
    diff_parser.add_argument("b", help="another point_id, or a unique prefix of one")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    try:
        if args.command == "export":
            export(src=args.src, out=args.out)
        elif args.command == "show":
            df = load(args.src)
            if args.sweep is not None:
                df = df[df["sweep_id"] == args.sweep]
            print(format_summary(df))
        elif args.command == "compact":
            lines = compact(args.results_dir, sweep=args.sweep)
            for line in lines:
                left = f", {line['unreadable']} unreadable left in place" if line["unreadable"] else ""
                print(
                    f"{line['folder']}: {line['files']} files -> 1, {line['rows']} rows, "
                    f"{line['bytes_before'] / 2**20:.2f} -> {line['bytes_after'] / 2**20:.2f} MiB{left}"
                )
            if not lines:
                print(f"{args.results_dir}: nothing to compact")
        elif args.command == "diff":
            indexed = index(args.src)  # only the two rows' files are then read whole
            a, b = (read_row(pick_row(indexed, wanted, name)) for wanted, name in ((args.a, "a"), (args.b, "b")))
            print("\n".join(diff_rows(a, b)) or "no differences")
        else:
            print(columns_markdown(), end="")
    except (ValueError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
