"""What the dashboard reads: result rows, capacity frontiers, profiler and KV-movement tables, as cached pandas
loaders. The planner's KV bytes are a column of the row (kv_bytes_planner, written by the run): the dashboard never
imports the planner.

Plain functions, testable without a running app. Every cached loader is keyed on the (path, mtime, size) of the
files it reads, so a point written while the app is open shows up on the next rerun, and nothing is read twice.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from harness.store import disk, schema, tables

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_ENV = "KVBENCH_RESULTS"  # the default results folder (the tests point the app at fixture data with it)
REFERENCE_DIR = REPO_ROOT / "results" / "reference"  # committed reference runs
SOURCE_RESULTS, SOURCE_REFERENCE = "results", "reference"  # the `source` column's values
FILTER_COLUMNS = ("device", "model", "cache", "kv_dtype", "dtype", "sweep_id")  # the sidebar's multiselects
NULL_LABEL = "(none)"  # how a null value of a filter column is offered and selected
_LIST_COLUMNS = tuple(column.name for column in schema.COLUMNS if column.type.startswith("list<"))

Fingerprint = tuple[tuple[str, int, int], ...]  # (path, mtime_ns, size) of every file a loader reads


def default_results_dir() -> str:
    return os.environ.get(RESULTS_ENV) or "results"


def resolve_dir(directory: str) -> Path:
    """A folder typed in the sidebar: relative to the repository root, whatever the working directory."""
    path = Path(directory).expanduser()
    return (path if path.is_absolute() else REPO_ROOT / path).resolve()


def source_label(directory: str | Path) -> str:
    return SOURCE_REFERENCE if Path(directory).resolve() == REFERENCE_DIR.resolve() else SOURCE_RESULTS


def fingerprint(files: Iterable[Path]) -> Fingerprint:
    """The (path, mtime_ns, size) of each file, sorted: the key every cached loader here and in
    dashboard/serve_data.py is called with, so that a file written, rewritten or removed reloads it. A file removed
    while we looked is left out."""
    stamps = set()
    for file in files:
        try:
            stat = file.stat()
        except OSError:  # removed while we looked
            continue
        stamps.add((str(file), stat.st_mtime_ns, stat.st_size))
    return tuple(sorted(stamps))


def _fingerprint(sources: tuple[str, ...], pattern: str = "*.parquet") -> Fingerprint:
    """The files under the sources that match `pattern`: not hidden, and not in the reference folder unless it is
    itself one of the sources."""
    return fingerprint(_source_files(sources, pattern))


def _source_files(sources: tuple[str, ...], pattern: str) -> Iterator[Path]:
    reference = REFERENCE_DIR.resolve()
    with_reference = any(Path(source).resolve() == reference for source in sources)
    for source in sources:
        root = Path(source).resolve()
        for file in root.rglob(pattern):
            if any(part.startswith(".") for part in file.relative_to(root).parts):
                continue  # write_point's temp files, editor leftovers
            if not with_reference and file.is_relative_to(reference):
                continue
            yield file


# ----------------------------------------------------------------------------------------------------------- rows


def load_rows(sources: tuple[str, ...]) -> tuple[pd.DataFrame, list[str]]:
    """Every result row under the source folders, with a `source` column ("results" or "reference"), and one
    "<path>: <reason>" line per file that was skipped (unreadable, or not a result table).

    The reference folder sits inside results/: a user folder is read without it, so each row comes once.
    """
    return _load_rows(sources, _fingerprint(sources))


@st.cache_data(show_spinner="Loading results…")
def _load_rows(sources: tuple[str, ...], stamps: Fingerprint) -> tuple[pd.DataFrame, list[str]]:
    frames, skipped = [], []
    for source in dict.fromkeys(sources):  # each folder once, in order
        label = source_label(source)
        exclude = None if label == SOURCE_REFERENCE else REFERENCE_DIR.resolve()
        for frame in _load_tree(Path(source).resolve(), exclude=exclude, skipped=skipped):
            frames.append(frame.assign(source=label))
    frames = [frame for frame in frames if len(frame)]
    if not frames:
        return schema.arrow_schema().empty_table().to_pandas().assign(source=pd.Series(dtype=str)), skipped
    rows = pd.concat(frames, ignore_index=True)
    rows = rows.drop_duplicates(subset=["point_id", "sweep_id", "source"], keep="last", ignore_index=True)
    return rows, list(dict.fromkeys(skipped))


def _load_tree(root: Path, *, exclude: Path | None, skipped: list[str]) -> list[pd.DataFrame]:
    """disk.load(root), less the `exclude` subtree when it lies inside root."""
    if exclude is None or not root.is_dir() or not exclude.is_relative_to(root):
        return [disk.load(root, skipped=skipped)]
    frames = []
    for child in sorted(root.iterdir()):
        if child.name.startswith(".") or child.resolve() == exclude:
            continue
        if child.is_dir():
            frames += _load_tree(child, exclude=exclude, skipped=skipped)
        elif disk.is_row_file(child, root=root):
            try:
                frames.append(disk.load(child))
            except (ValueError, OSError) as exc:  # load() raises for a single bad file; a folder's it skips
                log.warning("skipped %s", exc)
                skipped.append(str(exc))
    return frames


def filter_rows(rows: pd.DataFrame, selections: dict[str, list]) -> pd.DataFrame:
    """The rows whose value in each selected column is one of its selected values (NULL_LABEL selects nulls).

    A column absent from `selections` (or from the rows) is not filtered; an empty list selects nothing.
    """
    keep = pd.Series(True, index=rows.index)
    for column, selected in selections.items():
        if column in rows.columns:
            keep &= filter_values(rows[column]).isin([str(value) for value in selected])
    return rows[keep]


def filter_values(column: pd.Series) -> pd.Series:
    """A filter column as the strings the sidebar offers: nulls become NULL_LABEL."""
    return column.astype("string").fillna(NULL_LABEL).astype(str)


def filter_options(rows: pd.DataFrame, column: str) -> list[str]:
    if column not in rows.columns:
        return []
    return sorted(filter_values(rows[column]).unique())


# ------------------------------------------------------------------------------------------ frontiers and profiles


def load_frontiers(sources: tuple[str, ...]) -> pd.DataFrame:
    """Every capacity OOM-frontier table (capacity/frontier-<time>.parquet) under the sources, concatenated, with
    `source` and `frontier_file` columns; unreadable tables are skipped with a logged warning."""
    return _load_frontiers(sources, _fingerprint(sources, f"{disk.FRONTIER_PREFIX}*.parquet"))


@st.cache_data(show_spinner=False)
def _load_frontiers(sources: tuple[str, ...], stamps: Fingerprint) -> pd.DataFrame:
    frames = []
    for path_text, _, _ in stamps:
        path = Path(path_text)
        if path.parent.name != "capacity":
            continue  # not <results_dir>/capacity/frontier-*.parquet
        try:
            frame = pd.read_parquet(path)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            log.warning("skipped frontier table %s: %s", path, exc)
            continue
        frames.append(frame.assign(source=source_label(path.parent.parent), frontier_file=path.name))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def points_with_ops(sources: tuple[str, ...]) -> list[str]:
    """The point_ids that have a profiler top-ops table (<point_id>.ops.parquet) under the sources."""
    names = (Path(path).name for path, _, _ in _fingerprint(sources, f"*{disk.OPS_SUFFIX}"))
    return sorted({name.removesuffix(disk.OPS_SUFFIX) for name in names})


def load_point_ops(sources: tuple[str, ...], point_id: str, *, sweep_id: str | None = None) -> pd.DataFrame | None:
    """One point's top-ops table, or None when it has none (or it cannot be read).

    A point rerun in another sweep has the same point_id: the table in the sweep's own folder
    (<results_dir>/<sweep_id>/) is preferred, else the newest.
    """
    return _load_point_ops(_fingerprint(sources, f"{point_id}{disk.OPS_SUFFIX}"), sweep_id)


@st.cache_data(show_spinner=False)
def _load_point_ops(stamps: Fingerprint, sweep_id: str | None) -> pd.DataFrame | None:
    for path_text, _, _ in sorted(stamps, key=lambda s: (Path(s[0]).parent.name == sweep_id, s[1]), reverse=True):
        try:
            return pd.read_parquet(path_text)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            log.warning("skipped top-ops table %s: %s", path_text, exc)
    return None


# ----------------------------------------------------------------------------------- KV tier and PD transfer tables

ORIGIN = "origin"  # results or reference; these tables' own `source` column says measured or extrapolated
# A table's row is one measurement per these columns and its run: a run copied into the reference folder is one run.
TIER_KEY = ("run_id", "tier", "direction", "block_bytes", "direct_io")
PD_KEY = ("run_id", "transport", "kv_dtype", "context", "batch_size")


def load_tier_tables(sources: tuple[str, ...]) -> pd.DataFrame:
    """Every tier-bandwidth table (tiers/bandwidth-<time>.parquet, harness.store.tables.TIER_COLUMNS) under the
    sources, with an ORIGIN column; empty, with the contract's columns, when there is none."""
    stamps = _fingerprint(sources, f"{tables.TIER_PREFIX}*.parquet")
    return _load_kv_tables(stamps, prefix=tables.TIER_PREFIX, key=TIER_KEY)


def load_pd_tables(sources: tuple[str, ...]) -> pd.DataFrame:
    """Every PD-transfer table (pd/transfer-<time>.parquet, harness.store.tables.PD_COLUMNS) under the sources, as
    load_tier_tables."""
    stamps = _fingerprint(sources, f"{tables.PD_PREFIX}*.parquet")
    return _load_kv_tables(stamps, prefix=tables.PD_PREFIX, key=PD_KEY)


@st.cache_data(show_spinner=False)
def _load_kv_tables(stamps: Fingerprint, *, prefix: str, key: tuple[str, ...]) -> pd.DataFrame:
    """The tables among the files of `stamps` (tables.read_table_file), results before reference, a row stored in
    both kept once."""
    columns = tables.TIER_COLUMNS if prefix == tables.TIER_PREFIX else tables.PD_COLUMNS
    reference = REFERENCE_DIR.resolve()
    frames = []
    for path_text, _, _ in sorted(stamps, key=lambda stamp: Path(stamp[0]).is_relative_to(reference)):
        try:
            frame = tables.read_table_file(path_text)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            log.warning("skipped %s table %s: %s", prefix.rstrip("-"), path_text, exc)
            continue
        if frame is not None:
            origin = SOURCE_REFERENCE if Path(path_text).is_relative_to(reference) else SOURCE_RESULTS
            frames.append(frame.assign(**{ORIGIN: origin}))
    if not frames:
        return tables.empty_table(columns).assign(**{ORIGIN: pd.Series(dtype=object)})
    merged = pd.concat(frames, ignore_index=True)
    return merged.drop_duplicates(subset=[k for k in key if k in merged.columns], keep="first", ignore_index=True)


# -------------------------------------------------------------------------------------------------------- export


def csv_bytes(rows: pd.DataFrame) -> bytes:
    """CSV of the rows; a list cell (itl_ms) is written as its JSON text, as harness.store.maintain.export does."""
    frame = rows.copy()
    for column in _LIST_COLUMNS:
        if column in frame.columns:
            frame[column] = [_json_list(value) for value in frame[column]]
    return frame.to_csv(index=False).encode()


def _json_list(value: object) -> str | None:
    return json.dumps([float(x) for x in value]) if isinstance(value, list | tuple | np.ndarray) else None


def parquet_bytes(rows: pd.DataFrame) -> bytes:
    """Parquet of the rows, readable by harness.store.disk.load (itl_ms stays a list of floats)."""
    buffer = io.BytesIO()
    rows.to_parquet(buffer, index=False)
    return buffer.getvalue()
