"""Result files on disk: a row (and its profiler table) written atomically, every row under a folder read back.

One measured sweep point is one row: a flat dict of named scalars whose units live in their names (`_ms`, `_bytes`,
`_tok_s`), plus `itl_ms`, the list of per-step decode latencies (harness.store.schema.COLUMNS says what each is).
Each point is written to its own `<point_id>.parquet` through the one atomic writer (harness.store.atomic), so a
sweep that crashes or is killed leaves only whole rows behind, and a rerun of the same point replaces its file.
Capacity OOM-frontier tables (harness.store.schema.FRONTIER_COLUMNS) are written here too, and never read as rows.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from harness.store.atomic import atomic_write
from harness.store.schema import COLUMNS, SCHEMA_VERSION, arrow_schema, frontier_arrow_schema
from harness.store.tables import PD_PREFIX, TIER_PREFIX

ABSENT = {column.name: column.absent for column in COLUMNS}  # what a file without the column had in it

logger = logging.getLogger(__name__)

# A point_id becomes a file name: keep it to characters that are safe everywhere, and never hidden.
_POINT_ID_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
FRONTIER_PREFIX = "frontier-"  # capacity OOM-frontier tables: <results_dir>/capacity/frontier-<time>.parquet
FLEET_PREFIX = "fleet-"  # capacity fleet tables: <results_dir>/capacity/fleet-<time>.parquet (harness.serve.fleet)
SERVE_DIR = "serve"  # serving runs' tables: <results_dir>/serve/<run_id>/ (harness.serve.rows reads them)
SERVE_TABLES, SERVE_RUN_FILE = ("requests", "iterations"), "run.parquet"  # <table>-<part>.parquet parts, run row
_SERVE_FILE = re.compile(rf"({'|'.join(SERVE_TABLES)})-\d+\.parquet|{re.escape(SERVE_RUN_FILE)}")
IDENTITY_COLUMNS = ("point_id", "status")  # a parquet file without them is not a result row
MEASUREMENT_KEY = ("point_id", "sweep_id", "started_at")  # one measurement; load() keeps one row per key
REFERENCE_DIR = "reference"  # <results_dir>/reference: committed runs, left alone by compact (and by resume)
COMPACTED_PREFIX = "compacted-"  # kvbench-results compact: <sweep dir>/compacted-<time>.parquet
OPS_SUFFIX = ".ops.parquet"  # a point's profiler top-ops table, beside its row: <point_id>.ops.parquet
INDEX_COLUMNS = ("point_id", "sweep_id", "status", "error", "device_name", "started_at")


# ---------------------------------------------------------------------------------------------------------- write


def write_point(row: dict, directory: str | Path) -> Path:
    """Write one row to `directory/<point_id>.parquet` atomically and return that path.

    Unknown keys are rejected; missing keys are written as nulls of their column's type.
    """
    names = {c.name for c in COLUMNS}
    for key in row:
        if key not in names:
            raise ValueError(f"unknown result column {key!r}; add it to harness.store.schema.COLUMNS first")
    point_id = row.get("point_id")
    if not isinstance(point_id, str) or not _POINT_ID_PATTERN.fullmatch(point_id):
        raise ValueError(
            f"point_id must be a non-empty string of [A-Za-z0-9_.-] not starting with '.', got {point_id!r}"
        )
    row = {"schema_version": SCHEMA_VERSION, **row}

    schema = arrow_schema()
    arrays = [_one_value_array(field=field, value=row.get(field.name)) for field in schema]
    table = pa.Table.from_arrays(arrays, schema=schema)

    path = Path(directory) / f"{point_id}.parquet"
    write_parquet(table=table, path=path)
    logger.debug("wrote %s", path)
    return path


def write_ops(point_id: str, table: pd.DataFrame, directory: str | Path) -> Path:
    """The profiler's top-ops table of one point, keyed by its point_id, written atomically beside the row."""
    path = Path(directory) / f"{point_id}{OPS_SUFFIX}"
    frame = table.assign(point_id=point_id)
    write_parquet(table=pa.Table.from_pandas(frame, preserve_index=False), path=path)
    return path


def write_frontier(table: pd.DataFrame, directory: str | Path) -> Path:
    """A capacity OOM-frontier table (one row per context) to `directory/frontier-<local time>.parquet`, atomically.

    Columns must be FRONTIER_COLUMNS' (an unknown one is rejected, a missing one is written as nulls), and each is
    cast to its contract's type, so that every frontier file has one schema whatever pandas inferred.
    """
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(directory) / f"{FRONTIER_PREFIX}{stamp}.parquet"
    write_parquet(table=cast_to_schema(table, frontier_arrow_schema(), kind="frontier"), path=path)
    return path


def cast_to_schema(frame: pd.DataFrame, schema: pa.Schema, *, kind: str) -> pa.Table:
    """`frame` as an Arrow table of exactly `schema`: an unknown column is rejected, a missing one is nulls, and each
    is cast to its contract's type, so that every file of one `kind` has one schema whatever pandas inferred."""
    for name in frame.columns:
        if name not in schema.names:
            raise ValueError(f"unknown {kind} column {name!r}; allowed: {', '.join(schema.names)}")
    arrays = []
    for field in schema:
        values = frame[field.name] if field.name in frame.columns else [None] * len(frame)
        try:
            # from_pandas: NaN becomes null (a failed search's measured columns), and integral floats become ints.
            arrays.append(pa.array(list(values), type=field.type, from_pandas=True))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
            raise ValueError(f"{kind} column {field.name!r} ({field.type}) cannot hold its values: {exc}") from None
    return pa.Table.from_arrays(arrays, schema=schema)


def write_parquet(table: pa.Table, path: Path) -> None:
    """One Arrow table to `path` through the one atomic writer (load() skips the hidden temp file)."""
    atomic_write(path, lambda f: pq.write_table(table, f))


def _one_value_array(field: pa.Field, value: object) -> pa.Array:
    try:
        # from_pandas: a float NaN becomes null, so "not measured" has one spelling on disk.
        return pa.array([value], type=field.type, from_pandas=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
        raise ValueError(f"column {field.name!r} ({field.type}) cannot hold {value!r}: {exc}") from None


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
    return table_to_frame(load_table(Path(path), skipped=skipped))


def load_ops(path: str | Path) -> pd.DataFrame:
    """Every top-ops table under a directory, concatenated (a point_id column says whose)."""
    files = sorted(p for p in Path(path).rglob(f"*{OPS_SUFFIX}") if not p.name.startswith("."))
    if not files:
        return pd.DataFrame(columns=["point_id"])
    return pd.concat([pd.read_parquet(file) for file in files], ignore_index=True)


def index(path: str | Path, *, skipped: list[str] | None = None) -> pd.DataFrame:
    """One line per row under `path`: INDEX_COLUMNS and the `path` of its file, reading only those columns of each
    file, so that a resume can look up hundreds of points in a second (load() reads every column, itl_ms lists
    included). Same files as load(): unreadable ones are skipped (and listed in `skipped`), a column a file lacks is
    null, and a measurement stored twice (equal point_id, sweep_id, started_at) is one line."""
    lines = []
    for file in parquet_files(Path(path)):
        try:
            parquet = pq.ParquetFile(file)  # reads the footer once: the schema, then only the wanted column chunks
            present = parquet.schema_arrow.names
            missing = [name for name in IDENTITY_COLUMNS if name not in present]
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
    return merged.drop_duplicates(subset=list(MEASUREMENT_KEY), keep="first", ignore_index=True)


def load_table(path: Path, *, skipped: list[str] | None = None) -> pa.Table:
    """load() before the conversion to pandas: every row file under `path`, conformed, merged, repeats dropped."""
    tables = []
    for file in parquet_files(path):
        try:
            tables.append(conform(table=read_rows(file), source=file))
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
    return drop_repeats(merged.select(known + extras))


def drop_repeats(table: pa.Table) -> pa.Table:
    """One copy of each measurement: rows equal in point_id, sweep_id and started_at are the same row twice on disk
    (a compaction interrupted between writing its merged file and removing the originals)."""
    keys = pd.DataFrame({name: table.column(name).to_pandas() for name in MEASUREMENT_KEY})
    first = ~keys.duplicated(keep="first").to_numpy()
    return table if first.all() else table.filter(pa.array(first))


def parquet_files(path: Path) -> list[Path]:
    """The row files under `path` (or `path` itself): is_row_file's."""
    if path.is_file():
        if path.suffix != ".parquet":
            raise ValueError(f"{path} is not a .parquet file or a directory of them")
        return [path]
    if not path.exists():
        if path.suffix == ".parquet":
            raise FileNotFoundError(path)
        logger.info("%s does not exist: no results", path)
        return []
    return sorted(file for file in path.rglob("*.parquet") if file.is_file() and is_row_file(file, root=path))


def is_row_file(file: Path, *, root: Path) -> bool:
    """A .parquet file under `root` that may be a point row: not hidden, not a profiler, frontier, fleet,
    tier-bandwidth or PD-transfer table, not a serving run's table. Each is told by its name, as its writer names it;
    anything else that fails to read as a row is reported, never silently dropped."""
    relative = file.relative_to(root).parts
    return (
        file.name.endswith(".parquet")
        # Hidden files and folders: the atomic writer's temp files, editor and notebook leftovers.
        and not any(part.startswith(".") for part in relative)
        and not file.name.endswith(OPS_SUFFIX)  # profiler tables: load_ops()
        and not file.name.startswith((FRONTIER_PREFIX, FLEET_PREFIX))  # capacity tables: write_frontier(), fleet
        and not file.name.startswith((TIER_PREFIX, PD_PREFIX))  # KV movement tables: harness.store.tables
        and SERVE_DIR not in relative[:-1]  # anything in <root>/.../serve/
        and not is_serve_file(file)  # a run's own files, though `root` is serve/ or the run's folder itself
    )


def is_serve_file(file: Path) -> bool:
    """One of a serving run's own files, <...>/serve/<run_id>/<requests|iterations>-<part>.parquet or run.parquet:
    told by its name and its folder's place, so that a point row of a results folder that happens to be called
    serve/ is still a row."""
    return file.parent.parent.name == SERVE_DIR and _SERVE_FILE.fullmatch(file.name) is not None


def read_rows(path: Path) -> pa.Table:
    """One row file as it is on disk; ValueError naming the file when it is unreadable or not a result table."""
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:  # pyarrow's message does not say which file
        raise ValueError(f"{path}: not a readable parquet file: {exc}") from None
    present = set(table.column_names)
    missing = [name for name in IDENTITY_COLUMNS if name not in present]
    if missing:
        raise ValueError(f"{path}: not a kvbench result table (no {', '.join(missing)} column)")
    return table


def conform(table: pa.Table, source: Path) -> pa.Table:
    """Cast the known columns to this schema's types and add the ones the file lacks as nulls; keep extras."""
    schema = arrow_schema()
    # Sets, built once: table.column_names and schema.names build a new list on every access, which, asked for each
    # of the schema's ~150 fields, made this loop most of load()'s time (seconds over the committed reference).
    present, known = set(table.column_names), set(schema.names)
    arrays, fields = [], []
    for field in schema:
        if field.name in present:
            column = table.column(field.name)
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise ValueError(f"{source}: column {field.name!r} cannot be read as {field.type}: {exc}") from None
        elif ABSENT.get(field.name) is not None:  # a value every older row had, known
            column = pa.array([ABSENT[field.name]] * table.num_rows, type=field.type)
        else:
            column = pa.nulls(table.num_rows, type=field.type)
        arrays.append(column)
        fields.append(field)
    for field in table.schema:
        if field.name not in known:
            arrays.append(table.column(field.name))
            fields.append(field.remove_metadata())
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def table_to_frame(table: pa.Table) -> pd.DataFrame:
    """Rows as pandas: nullable Int64 and boolean columns, list columns (itl_ms) as lists of floats or None."""
    nullable = {pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}
    df = table.to_pandas(types_mapper=nullable.get)
    for column in COLUMNS:
        if column.type.startswith("list<"):
            df[column.name] = pd.Series([_as_list(v) for v in df[column.name]], index=df.index, dtype=object)
    return df


def _as_list(value: object) -> list | None:
    # Arrow hands lists back as numpy arrays; plain lists compare with == and serialise to JSON as they are.
    return None if value is None else [float(x) for x in value]
