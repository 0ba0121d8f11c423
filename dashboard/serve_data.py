"""What the Serving page reads: the serving runs under the results folders, as cached pandas loaders.

A serving run is a folder <source>/serve/<run_id>/ (harness.serve.rows.serve_run_dir) of a manifest (written when
the run starts), numbered request and iteration parts and, once the run has finished, run.parquet. Each source
folder the sidebar reads (the user's results, the committed reference) is searched at that one depth, so
results/reference/serve/ is read once, as the reference's. Every cached loader is keyed on the (path, mtime, size)
of the files it reads (dashboard.data.fingerprint, as dashboard/data.py's are), so a run still writing parts shows its new requests on the next
rerun.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pyarrow as pa
import streamlit as st

from dashboard.data import Fingerprint, fingerprint, source_label
from harness.serve import rows
from harness.serve.rows import (
    MANIFEST_FILE,
    RUN_FILE,
    SCHEMAS,
    SERVE_DIR,
    TABLES,
    load_run,
    part_files,
    part_rows,
    read_manifest,
    read_run_table,
)

log = logging.getLogger(__name__)

# The columns load_runs adds to the run rows (run.parquet's columns, rows.RUN_FIELDS plus its percentiles).
FINISHED = "finished"  # False: no run.parquet (still running, or killed): its requests load, it has no run row
REQUESTS_WRITTEN = "requests_written"  # request rows on disk (the parts' row counts), finished or not
RUN_DIR, SOURCE = "run_dir", "source"  # the run's folder; "results" or "reference"
# The manifest's: running (still running, or killed: a SIGKILL cannot say), finished or failed; a run written before
# manifests has its status from run.parquet alone, and no start time.
STATUS, STARTED_AT = "status", "started_at"
ORDER = (FINISHED, "sweep_id", "engine", "strategy", "kv_dtype", "qps")  # finished first, then a sweep's lines by qps
REQUEST_COLUMNS, ITERATION_COLUMNS = SCHEMAS["requests"].names, SCHEMAS["iterations"].names


def run_dirs(sources: tuple[str, ...]) -> list[Path]:
    """Every <source>/serve/<run_id>/ folder that holds a manifest, a part or a run row, in source order, then by
    name; hidden folders (editor leftovers) are not runs."""
    found = []
    for source in dict.fromkeys(sources):
        serve = Path(source).resolve() / SERVE_DIR
        if not serve.is_dir():
            continue
        for folder in sorted(serve.iterdir()):
            if folder.is_dir() and not folder.name.startswith(".") and _run_files(folder):
                found.append(folder)
    return found


def _run_files(folder: Path) -> list[Path]:
    """The run's own files: its manifest, its table parts (requests-*.parquet, iterations-*.parquet) and
    run.parquet; never the atomic writer's hidden temps."""
    named = [folder / name for name in (MANIFEST_FILE, RUN_FILE)]
    return sorted([path for path in named if path.is_file()] + [p for t in TABLES for p in part_files(folder, t)])


def _fingerprint(folders: list[Path]) -> Fingerprint:
    return fingerprint(path for folder in folders for path in _run_files(folder))


# ------------------------------------------------------------------------------------------------------------ runs


def load_runs(sources: tuple[str, ...]) -> tuple[pd.DataFrame, list[str]]:
    """One row per serving run under the sources, and one "<path>: <reason>" line per file that could not be read.

    A finished run's row is its run.parquet (metrics.run_metrics' figures and rows.RUN_CONTEXT) plus `finished`
    True; a run without one (still running, killed, or failed) is listed too, with only run_id, `finished` False and
    its request count, even with no part yet (killed before its first flush: its manifest alone). Every row has
    `status` and `started_at` (the manifest's), `requests_written`, `run_dir` and `source`. An unreadable part is
    named and left out of `requests_written`, and the run is still listed; an unreadable run.parquet leaves the run
    out, naming its folder. A run_id found in two sources (a run copied into the reference) is listed once, from the
    first source: the user's results before the reference. Finished runs come first, by sweep, engine, strategy,
    kv_dtype and qps; then the unfinished ones.
    """
    folders = run_dirs(sources)
    return _load_runs(tuple(str(folder) for folder in folders), _fingerprint(folders))


@st.cache_data(show_spinner="Loading serving runs…")
def _load_runs(folders: tuple[str, ...], stamps: Fingerprint) -> tuple[pd.DataFrame, list[str]]:
    found, skipped, seen = [], [], set()
    for folder_text in folders:
        folder = Path(folder_text)
        if folder.name in seen:
            continue
        try:
            row = _run_row(folder, skipped=skipped)
        except (pa.ArrowInvalid, OSError, ValueError) as exc:  # run.parquet truncated, or a foreign parquet file
            log.warning("skipped serving run %s: %s", folder, exc)
            skipped.append(f"{folder}: {exc}")
            continue
        seen.add(folder.name)
        found.append(row)
    if not found:
        return pd.DataFrame(
            columns=["run_id", FINISHED, STATUS, STARTED_AT, REQUESTS_WRITTEN, RUN_DIR, SOURCE]
        ), skipped
    runs = pd.concat(found, ignore_index=True)
    order = [column for column in ORDER if column in runs.columns]
    return runs.sort_values(order, ascending=[c != FINISHED for c in order], kind="stable", ignore_index=True), skipped


def _run_row(folder: Path, *, skipped: list[str]) -> pd.DataFrame:
    """run.parquet's row (or run_id alone), finished, the manifest's status and start, requests_written (from the
    parts' footers: no rows read). A part or a manifest that cannot be read is appended to `skipped`, naming it."""
    requests_written = 0
    for table in TABLES:
        for path in part_files(folder, table):
            try:
                count = part_rows(path, table)
            except ValueError as exc:
                log.warning("skipped %s", exc)
                skipped.append(str(exc))
                continue
            requests_written += count if table == "requests" else 0
    run_path = folder / RUN_FILE
    if run_path.exists():
        row = read_run_table(run_path).to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)
    else:
        row = pd.DataFrame({"run_id": [folder.name]})
    try:
        manifest = read_manifest(folder) or {}
    except ValueError as exc:
        log.warning("skipped %s", exc)
        skipped.append(str(exc))
        manifest = {}
    return row.assign(
        **{
            FINISHED: run_path.exists(),
            STATUS: manifest.get("status") or (rows.FINISHED if run_path.exists() else rows.RUNNING),
            STARTED_AT: manifest.get("started_at"),
            REQUESTS_WRITTEN: pd.array([requests_written], dtype="Int64"),
            RUN_DIR: str(folder),
            SOURCE: source_label(folder.parent.parent),
        }
    )


# ------------------------------------------------------------------------------------- requests and iterations


def load_requests(folders: list[str] | tuple[str, ...]) -> pd.DataFrame:
    """The request rows of the runs in `folders` (load_runs' run_dir), concatenated; run_id says whose. A run killed
    midway gives its flushed requests; a part that cannot be read is left out, the rest of its run given (load_runs
    names it; its warning is logged here too)."""
    frames = [_load_tables(folder, _fingerprint([Path(folder)]))[0] for folder in folders]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=REQUEST_COLUMNS)


def load_iterations(folder: str) -> pd.DataFrame:
    """One run's iteration rows (time_s, num_running, num_waiting, kv_used_blocks, ...), in iteration order."""
    return _load_tables(folder, _fingerprint([Path(folder)]))[1]


@st.cache_data(show_spinner=False)
def _load_tables(folder: str, stamps: Fingerprint) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(requests, iterations) of one run, read once per change of its files; its unreadable parts left out."""
    try:
        requests, iterations, _ = load_run(folder, skipped=[])  # load_run logs each part it skips
    except (FileNotFoundError, ValueError) as exc:  # the folder went away, or its run.parquet is not a parquet table
        log.warning("skipped the tables of serving run %s: %s", folder, exc)
        return pd.DataFrame(columns=REQUEST_COLUMNS), pd.DataFrame(columns=ITERATION_COLUMNS)
    return requests, iterations
