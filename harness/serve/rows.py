"""How a serving run's three tables reach disk: request rows, iteration rows and the run row, in one run folder.

`<results_dir>/serve/<run_id>/` holds manifest.json, written by start() before anything heavy (status `running`,
the config, the start time), numbered part files (requests-00000.parquet, iterations-00000.parquet, ...) flushed
as the run goes, and run.parquet, written last by close(), which then marks the manifest `finished`. Every file
goes through the one atomic writer (harness.store.atomic), so a run killed midway leaves whole parts and never half
of one: its finished requests load, with no run row; a run killed before its first part (in the model's build, say)
leaves its manifest, still `running`. Rows buffered since the last flush die with a SIGKILL; an exception (Ctrl-C
included) inside `with ServeRunWriter(...)` flushes them first and marks the manifest `failed`, naming it.

Every part is built against an explicit schema (the column contracts of harness.serve.columns), so all parts of a table have one set of types whatever
values a part happened to hold (a part of one-token outputs has tpot_ms all null, still float64).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from harness.errors import ConfigError
from harness.serve.columns import ITERATION_COLUMNS, REQUEST_COLUMNS, RUN_COLUMNS
from harness.serve.dataset import DROP_REASONS
from harness.serve.metrics import LATENCY_METRICS
from harness.serve.scheduler import SchedulerOutput
from harness.serve.sustained import UNKNOWN_REASON, from_request_rows
from harness.store import disk
from harness.store.atomic import atomic_write
from harness.store.disk import write_parquet
from harness.store.schema import arrow_fields

log = logging.getLogger(__name__)

SERVE_DIR = disk.SERVE_DIR  # <results_dir>/serve/<run_id>/
RUN_FILE = disk.SERVE_RUN_FILE  # run.parquet
TABLES = disk.SERVE_TABLES  # requests, iterations: the numbered parts' names (the point-row reader skips them)
MANIFEST_FILE = "manifest.json"  # run_id, status, started_at, ended_at, error, config
RUNNING, FINISHED, FAILED = "running", "finished", "failed"  # a manifest's status; a killed run stays RUNNING
_RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")  # a folder name, safe everywhere and never hidden
_PERCENTILE_COLUMN = re.compile(rf"p\d+(\.\d+)?_({'|'.join(LATENCY_METRICS)})_ms")  # run_metrics' p<P>_<m>_ms

F64, I64 = pa.float64(), pa.int64()

# Each table's parquet schema, from its column contract (harness.serve.columns): units and meanings as metadata.
REQUEST_SCHEMA = pa.schema(arrow_fields(REQUEST_COLUMNS))
ITERATION_SCHEMA = pa.schema(arrow_fields(ITERATION_COLUMNS))
RUN_FIELDS = arrow_fields(RUN_COLUMNS)  # the run row's fixed columns; run_schema adds its percentiles
RUN_CONTEXT = (
    "sweep_id", "engine", "strategy", "kv_dtype", "model", "device", "qps", "num_blocks", "block_size", "kv_budget_bytes",
    "max_num_seqs", "max_num_batched_tokens", "num_iterations", "predicted_max_running", "mean_kv_utilization",
    "peak_kv_utilization", "mean_step_ms", "mean_scheduler_ms", "dataset", "dataset_sha256",
    *(f"dataset_dropped_{reason}" for reason in DROP_REASONS),
)  # fmt: skip
SCHEMAS = {"requests": REQUEST_SCHEMA, "iterations": ITERATION_SCHEMA}


def serve_run_dir(results_dir: str | Path, run_id: str) -> Path:
    """<results_dir>/serve/<run_id>: the folder of one serving run."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run_id: must be a non-empty string of [A-Za-z0-9_.-] not starting with '.', got {run_id!r}")
    return Path(results_dir) / SERVE_DIR / run_id


def iteration_row(
    index: int,
    output: SchedulerOutput,
    step_s: float,
    *,
    scheduler_s: float = 0.0,
    kv_bytes_per_token: float | None = None,
) -> dict:
    """One scheduler iteration's row: time_s is when it was scheduled (the engine's clock, seconds), step_ms how
    long its forward took, scheduler_ms the host time of its schedule() and update(); the KV figures are the pool
    after this iteration's allocation, in bytes too when kv_bytes_per_token (the pool's bytes per token slot) is
    given."""
    per_token = math.nan if kv_bytes_per_token is None else kv_bytes_per_token
    return {
        "iteration": index,
        "time_s": output.now_s,
        "step_ms": step_s * 1000.0,
        "scheduler_ms": scheduler_s * 1000.0,
        "num_running": output.num_running,
        "num_waiting": output.num_waiting,
        "num_prefill_tokens": output.num_prefill_tokens,
        "num_decode_tokens": output.num_decode_tokens,
        "num_preempted": len(output.preempted_ids),
        "kv_used_blocks": output.kv.blocks_used,
        "kv_free_blocks": output.kv.blocks_free,
        "kv_cached_blocks": output.kv.blocks_cached,
        "kv_live_tokens": output.kv.tokens_live,
        "kv_allocated_tokens": output.kv.tokens_allocated,
        "kv_live_bytes": output.kv.tokens_live * per_token,
        "kv_allocated_bytes": output.kv.tokens_allocated * per_token,
    }


def run_schema(columns) -> pa.Schema:
    """RUN_FIELDS plus the row's own percentile columns, in the row's order."""
    return pa.schema(RUN_FIELDS + [pa.field(name, F64) for name in columns if _PERCENTILE_COLUMN.fullmatch(name)])


def _check_columns(row: Mapping, schema: pa.Schema, what: str) -> None:
    """A row's keys must be the schema's (run_id aside, which the writer adds): anything else is a bug upstream."""
    expected = [name for name in schema.names if name != "run_id"]
    for name in row:
        if name not in expected:
            raise ValueError(f"{what}: unknown column {name!r}; allowed: {', '.join(expected)}")
    for name in expected:
        if name not in row:
            raise ValueError(f"{what}: missing column {name!r}")


def _table(rows: list[Mapping], schema: pa.Schema) -> pa.Table:
    arrays = []
    for field in schema:
        try:  # from_pandas: a NaN becomes null, so "no figure" has one spelling on disk
            array = pa.array([row[field.name] for row in rows], type=field.type, from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
            raise ValueError(f"column {field.name!r} ({field.type}) cannot hold its values: {exc}") from None
        if not field.nullable and array.null_count:
            raise ValueError(f"column {field.name!r}: null in a column that is never missing")
        arrays.append(array)
    return pa.Table.from_arrays(arrays, schema=schema)


class ServeRunWriter:
    """Buffers request and iteration rows and flushes each table as a numbered part every flush_every rows.

    flush_every bounds what a SIGKILL loses (rows since the last flush, per table) against the number of files
    (one fsync'd part per flush); the engine may also call flush() itself, e.g. once per second.
    """

    def __init__(self, run_dir: str | Path, *, flush_every: int = 64) -> None:
        if not (isinstance(flush_every, int) and flush_every >= 1):
            raise ConfigError(f"flush_every: must be an integer >= 1 rows, got {flush_every!r}")
        self.run_dir, self.flush_every = Path(run_dir), flush_every
        self.run_id = self.run_dir.name
        # Refuse to mix two runs in one folder: new parts would interleave with (or overwrite) the old ones, and a
        # new manifest would erase the record of a run killed before its first part.
        if self.run_dir.is_dir() and (
            any(part_files(self.run_dir, t) for t in TABLES)
            or (self.run_dir / RUN_FILE).exists()
            or (self.run_dir / MANIFEST_FILE).exists()
        ):
            raise ConfigError(f"run_id: {self.run_dir} already holds a serving run; choose a new run_id")
        self.buffers: dict[str, list[dict]] = {table: [] for table in TABLES}
        self.next_part = dict.fromkeys(TABLES, 0)
        self.closed = False
        self.started_at, self.config = _utc_now(), {}  # start() sets both; a writer never started keeps these

    def start(self, *, config: Mapping) -> Path:
        """The manifest, status running, with the config and the start time: called before the model is built, so
        that a run killed in its first minute still leaves a folder that says what it was and that it never
        finished. Nothing else is written until the first flush."""
        self.started_at, self.config = _utc_now(), dict(config)
        return self._write_manifest(status=RUNNING)

    def _write_manifest(self, *, status: str, error: str | None = None) -> Path:
        manifest = {
            "run_id": self.run_id,
            "status": status,
            "started_at": self.started_at,  # ISO-8601 UTC
            "ended_at": None if status == RUNNING else _utc_now(),
            "error": error,
            "config": self.config,
        }
        text = json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n"
        return atomic_write(self.run_dir / MANIFEST_FILE, lambda f: f.write(text.encode()))

    def add_request(self, row: Mapping) -> None:
        self._add("requests", row)

    def add_iteration(self, row: Mapping) -> None:
        self._add("iterations", row)

    def _add(self, table: str, row: Mapping) -> None:
        if self.closed:
            raise ValueError(f"{self.run_dir}: add_{table[:-1]} after close()")
        _check_columns(row, SCHEMAS[table], f"{table} row")
        self.buffers[table].append({**row, "run_id": self.run_id})
        if len(self.buffers[table]) >= self.flush_every:
            self._flush(table)

    def flush(self) -> None:
        """Every buffered row to disk now, one part per table that has any."""
        for table in TABLES:
            self._flush(table)

    def _flush(self, table: str) -> None:
        rows = self.buffers[table]
        if not rows:
            return
        path = self.run_dir / f"{table}-{self.next_part[table]:05d}.parquet"
        write_parquet(table=_table(rows, SCHEMAS[table]), path=path)
        self.next_part[table] += 1
        self.buffers[table] = []

    def close(self, run_row: Mapping, *, config: Mapping) -> Path:
        """Flush the rest, then write run.parquet (run_metrics' row, the config as JSON): its presence marks a run
        that finished; then the manifest says so too (status finished, with the same config)."""
        schema = run_schema(run_row)
        row = {**run_row, "config_json": json.dumps(dict(config), sort_keys=True)}
        _check_columns(row, schema, "run row")
        self.flush()
        path = self.run_dir / RUN_FILE
        write_parquet(table=_table([{**row, "run_id": self.run_id}], schema), path=path)
        self.closed, self.config = True, dict(config)
        self._write_manifest(status=FINISHED)
        return path

    def __enter__(self) -> ServeRunWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        # Whatever ended the block, the finished rows are kept; only close() writes a run row.
        if self.closed:
            return
        try:
            self.flush()
        finally:
            if exc_type is not None:
                try:
                    self._write_manifest(status=FAILED, error=f"{exc_type.__name__}: {exc}")
                except OSError as write_error:  # a full disk: the exception that ended the run is the one to see
                    log.warning("%s: could not mark the run failed: %s", self.run_dir, write_error)


def _utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def read_manifest(run_dir: str | Path) -> dict | None:
    """A run's manifest.json (ServeRunWriter._write_manifest's keys), or None for a run written without one (before
    manifests, or a producer that never called start() and never closed); ValueError naming the file when it is not
    a manifest."""
    path = Path(run_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # json's JSONDecodeError and a non-UTF-8 file are ValueErrors
        raise ValueError(f"{path}: not a readable manifest: {exc}") from None
    if not isinstance(manifest, dict) or "status" not in manifest:
        raise ValueError(f"{path}: not a manifest (no status)")
    return manifest


def part_files(run_dir: Path, table: str) -> list[Path]:
    """A table's part files in part order; hidden files (the atomic writer's temps) never match."""
    pattern = re.compile(rf"{table}-(\d+)\.parquet")
    numbered = [(int(m.group(1)), p) for p in Path(run_dir).iterdir() if (m := pattern.fullmatch(p.name))]
    return [path for _, path in sorted(numbered)]


def part_rows(path: Path, table: str) -> int:
    """A part's row count, from its footer alone (no rows read); ValueError naming the part when it is truncated,
    not parquet, or not in `table`'s schema (load_run would refuse it)."""
    try:
        with pq.ParquetFile(path) as parquet:
            _conform(parquet.schema_arrow.empty_table(), SCHEMAS[table])
            return parquet.metadata.num_rows
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{path}: not a {table} part: {exc}") from None


def _frame(tables: list[pa.Table], schema: pa.Schema) -> pd.DataFrame:
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    frame = table.to_pandas(types_mapper={I64: pd.Int64Dtype()}.get)  # Int64: nullable ints stay ints
    if "itl_ms" in frame:  # Arrow hands lists back as numpy arrays; plain lists compare with ==
        frame["itl_ms"] = pd.Series([[float(x) for x in v] for v in frame["itl_ms"]], index=frame.index, dtype=object)
    return frame


def _conform(part: pa.Table, schema: pa.Schema) -> pa.Table:
    """A part in this schema: a nullable column added since the part was written loads as null (older runs stay
    readable); anything else missing or uncastable is not a part of this table."""
    for field in schema:
        if field.name not in part.column_names and field.nullable:
            part = part.append_column(field, pa.nulls(len(part), type=field.type))
    return part.select(schema.names).cast(schema)


def read_run_table(path: str | Path) -> pa.Table:
    """A run.parquet, in today's run columns. One written before max_running_requests existed (the committed
    reference's) counted, under max_concurrent_requests, the requests running (first scheduled to finished), which
    is today's max_running_requests: it loads under that name, and its max_concurrent_requests (queueing included)
    as null, never measured. A nullable column added since the row was written (max_num_seqs and
    max_num_batched_tokens, say) loads as null, at the end; one written before the sustained verdict (issue #30) has
    it recomputed from the run's request parts (harness.serve.sustained). The file is not rewritten."""
    table = pq.read_table(path)
    names = table.column_names
    if "max_running_requests" not in names and "max_concurrent_requests" in names:
        at = names.index("max_concurrent_requests")
        table = table.rename_columns(["max_running_requests" if n == "max_concurrent_requests" else n for n in names])
        table = table.add_column(at, pa.field("max_concurrent_requests", I64), pa.nulls(len(table), type=I64))
    for field in RUN_FIELDS:
        if field.nullable and field.name not in table.column_names:
            table = table.append_column(field, pa.nulls(len(table), type=field.type))
    if "sustained" not in names:  # a row from before the verdict: recomputed from its request rows (issue #30)
        table = _recompute_sustained(table, Path(path).parent)
    return table


def _recompute_sustained(table: pa.Table, run_dir: Path) -> pa.Table:
    """The sustained columns of an older one-row run table from the run's request parts, under the row's SLOs and
    the default attainment (harness.serve.sustained.from_request_rows); none readable: the verdict stays null and
    not_sustained_reason says it is unknown."""
    row = table.to_pylist()[0]
    try:
        parts = [_conform(pq.read_table(p), REQUEST_SCHEMA) for p in part_files(run_dir, "requests")]
        requests = _frame(parts, REQUEST_SCHEMA)
        slos = {name: row.get(name) for name in ("ttft_slo_ms", "tpot_slo_ms", "e2el_slo_ms")}
        columns = {"not_sustained_reason": UNKNOWN_REASON}
        if len(requests):
            columns = from_request_rows(requests, **slos, qps=row.get("qps"))
    except (pa.ArrowInvalid, OSError, ValueError, KeyError) as exc:
        log.warning("%s: the request rows to recompute sustained from cannot be read: %s", run_dir, exc)
        columns = {"not_sustained_reason": UNKNOWN_REASON}
    for name, value in columns.items():
        at = table.column_names.index(name)
        field = table.schema.field(name)
        table = table.set_column(at, field, pa.array([value], type=field.type, from_pandas=True))
    return table


def load_run(
    run_dir: str | Path, *, skipped: list[str] | None = None
) -> tuple[pd.DataFrame, pd.DataFrame, dict | None]:
    """(requests, iterations, run row): the parts concatenated in order; run row None for a run that never closed.

    A part that cannot be read raises ValueError naming it; with a `skipped` list it is left out instead, its
    "<path>: <reason>" appended, and every other part still loads (one bad file never hides a run)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no serving run folder")
    frames = []
    for table in TABLES:
        parts = []
        for path in part_files(run_dir, table):
            try:
                parts.append(_conform(pq.read_table(path), SCHEMAS[table]))
            except (pa.ArrowInvalid, OSError, ValueError, KeyError) as exc:
                if skipped is None:
                    raise ValueError(f"{path}: not a {table} part: {exc}") from None
                log.warning("skipped %s: not a %s part: %s", path, table, exc)
                skipped.append(f"{path}: not a {table} part: {exc}")
        frames.append(_frame(parts, SCHEMAS[table]))
    run_path = run_dir / RUN_FILE
    run_row = read_run_table(run_path).to_pylist()[0] if run_path.exists() else None
    return frames[0], frames[1], run_row
