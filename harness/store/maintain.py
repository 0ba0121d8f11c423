"""Maintenance of a results folder: export every row to one file, and compact each sweep folder's point files.

kvbench-results export results/ all.csv   # or all.parquet
kvbench-results compact results/          # one file per sweep folder instead of one per point
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

import pyarrow as pa

from harness.store import disk
from harness.store.atomic import atomic_write, fsync_directory
from harness.store.diff import same_rows
from harness.store.schema import COLUMNS

logger = logging.getLogger(__name__)

_EXPORT_SUFFIXES = (".csv", ".parquet")


def export(src: str | Path, out: str | Path) -> Path:
    """Write every row under `src` to one .csv or .parquet file, chosen by the suffix of `out`."""
    src, out = Path(src), Path(out)
    if out.suffix not in _EXPORT_SUFFIXES:
        raise ValueError(f"cannot export to {out.name!r}: the suffix must be one of {', '.join(_EXPORT_SUFFIXES)}")
    if out.suffix == ".parquet" and src.is_dir() and out.resolve().is_relative_to(src.resolve()):
        raise ValueError(f"{out} is inside {src}: load() would read the export back as duplicate rows")
    table = disk.load_table(src)
    if out.suffix == ".parquet":
        disk.write_parquet(table=table, path=out)
    else:
        df = disk.table_to_frame(table)
        for column in COLUMNS:
            if column.type.startswith("list<"):
                df[column.name] = [None if v is None else json.dumps(v) for v in df[column.name]]
        atomic_write(out, lambda f: df.to_csv(f, index=False))  # UTF-8, as to_csv(path) writes it
    logger.info("exported %d rows to %s", table.num_rows, out)
    return out


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
    folders = sorted({file.parent for file in disk.parquet_files(root)})
    reference = root / disk.REFERENCE_DIR  # committed reference runs: compacting them would delete tracked files
    folders = [folder for folder in folders if folder != reference and reference not in folder.parents]
    if sweep is not None:
        folders = [folder for folder in folders if folder.name == sweep]
        if not folders:
            raise ValueError(f"--sweep: no folder named {sweep!r} with rows under {root}")
    return [line for folder in folders if (line := _compact_folder(folder)) is not None]


def _compact_folder(folder: Path) -> dict | None:
    files = [file for file in disk.parquet_files(folder) if file.parent == folder]
    if len(files) == 1 and files[0].name.startswith(disk.COMPACTED_PREFIX):
        return None  # done already
    readable, tables, unreadable = {}, [], 0  # readable: file -> its stat when read
    for file in files:
        try:
            stat = file.stat()
            tables.append(disk.conform(table=disk.read_rows(file), source=file))
            readable[file] = stat
        except (ValueError, FileNotFoundError) as exc:  # FileNotFoundError: removed since the listing
            logger.warning("compact: left in place: %s", exc)
            unreadable += 1
    if len(readable) < 2 and all(file.name.startswith(disk.COMPACTED_PREFIX) for file in readable):
        return None  # nothing to merge: no file, or one compacted file beside unreadable ones
    merged = disk.drop_repeats(pa.concat_tables(tables, promote_options="permissive"))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S-%f")
    target = folder / f"{disk.COMPACTED_PREFIX}{stamp}.parquet"
    disk.write_parquet(table=merged, path=target)
    try:
        written = disk.load(target)
        same = same_rows(disk.table_to_frame(merged), written)
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
    fsync_directory(folder)
    return {
        "folder": str(folder),
        "files": len(removed),
        "rows": len(written),
        "bytes_before": sum(removed),
        "bytes_after": target.stat().st_size,
        "unreadable": unreadable,
    }
