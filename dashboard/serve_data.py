"""What the Serving page reads: the serving runs under the results folders, as cached pandas loaders.

A serving run is a folder <source>/serve/<run_id>/ (harness.serve.rows.serve_run_dir) of numbered request and
iteration parts and, once the run has finished, run.parquet. Each source folder the sidebar reads (the user's
results, the committed reference) is searched at that one depth, so results/reference/serve/ is read once, as the
reference's. Every cached loader is keyed on the (path, mtime, size) of the files it reads, as dashboard/data.py's
are, so a run still writing parts shows its new requests on the next rerun.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import streamlit as st

from dashboard.data import Fingerprint, source_label
from harness.serve.rows import RUN_FILE, SCHEMAS, SERVE_DIR, TABLES, load_run, read_run_table

log = logging.getLogger(__name__)

# The columns load_runs adds to the run rows (run.parquet's columns, rows.RUN_FIELDS plus its percentiles).
FINISHED = "finished"  # False: no run.parquet (still running, or killed): its requests load, it has no run row
REQUESTS_WRITTEN = "requests_written"  # request rows on disk (the parts' row counts), finished or not
RUN_DIR, SOURCE = "run_dir", "source"  # the run's folder; "results" or "reference"
ORDER = (FINISHED, "sweep_id", "engine", "strategy", "kv_dtype", "qps")  # finished first, then a sweep's lines by qps
REQUEST_COLUMNS, ITERATION_COLUMNS = SCHEMAS["requests"].names, SCHEMAS["iterations"].names


def run_dirs(sources: tuple[str, ...]) -> list[Path]:
    """Every <source>/serve/<run_id>/ folder that holds a part or a run row, in source order, then by name; hidden
    folders (editor leftovers) are not runs."""
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
    """The run's own files: its table parts (requests-*.parquet, iterations-*.parquet) and run.parquet; never the
    atomic writer's hidden temps."""
    names = {RUN_FILE} | {f"{table}-" for table in TABLES}
    return sorted(
        path
        for path in folder.iterdir()
        if path.is_file() and path.suffix == ".parquet" and any(path.name.startswith(name) for name in names)
    )


def _fingerprint(folders: list[Path]) -> Fingerprint:
    stamps = []
    for folder in folders:
        for path in _run_files(folder):
            try:
                stat = path.stat()
            except OSError:  # removed while we looked
                continue
            stamps.append((str(path), stat.st_mtime_ns, stat.st_size))
    return tuple(sorted(stamps))


# ------------------------------------------------------------------------------------------------------------ runs


def load_runs(sources: tuple[str, ...]) -> tuple[pd.DataFrame, list[str]]:
    """One row per serving run under the sources, and one "<path>: <reason>" line per file that could not be read.

    A finished run's row is its run.parquet (metrics.run_metrics' figures and rows.RUN_CONTEXT) plus `finished`
    True; a run without one (still running, or killed) is listed too, with only run_id, `finished` False and its
    request count. Every row has `requests_written`, `run_dir` and `source`. A run_id found in two sources (a run
    copied into the reference) is listed once, from the first source: the user's results before the reference.
    Finished runs come first, by sweep, engine, strategy, kv_dtype and qps; then the unfinished ones.
    """
    folders = run_dirs(sources)
    return _load_runs(tuple(str(folder) for folder in folders), _fingerprint(folders))


@st.cache_data(show_spinner="Loading serving runs…")
def _load_runs(folders: tuple[str, ...], stamps: Fingerprint) -> tuple[pd.DataFrame, list[str]]:
    rows, skipped, seen = [], [], set()
    for folder_text in folders:
        folder = Path(folder_text)
        if folder.name in seen:
            continue
        try:
            row = _run_row(folder)
        except (pa.ArrowInvalid, OSError, ValueError) as exc:  # a truncated or foreign parquet file
            log.warning("skipped serving run %s: %s", folder, exc)
            skipped.append(f"{folder}: {exc}")
            continue
        seen.add(folder.name)
        rows.append(row)
    if not rows:
        return pd.DataFrame(columns=["run_id", FINISHED, REQUESTS_WRITTEN, RUN_DIR, SOURCE]), skipped
    runs = pd.concat(rows, ignore_index=True)
    order = [column for column in ORDER if column in runs.columns]
    return runs.sort_values(order, ascending=[c != FINISHED for c in order], kind="stable", ignore_index=True), skipped


def _run_row(folder: Path) -> pd.DataFrame:
    """run.parquet's row (or run_id alone), finished, requests_written (from the parts' footers: no rows read)."""
    requests_written = sum(pq.ParquetFile(path).metadata.num_rows for path in folder.glob("requests-*.parquet"))
    run_path = folder / RUN_FILE
    if run_path.exists():
        row = read_run_table(run_path).to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)
    else:
        row = pd.DataFrame({"run_id": [folder.name]})
    return row.assign(
        **{
            FINISHED: run_path.exists(),
            REQUESTS_WRITTEN: pd.array([requests_written], dtype="Int64"),
            RUN_DIR: str(folder),
            SOURCE: source_label(folder.parent.parent),
        }
    )


# ------------------------------------------------------------------------------------- requests and iterations


def load_requests(folders: list[str] | tuple[str, ...]) -> pd.DataFrame:
    """The request rows of the runs in `folders` (load_runs' run_dir), concatenated; run_id says whose. A run killed
    midway gives its flushed requests; a run whose parts cannot be read gives none (its warning is logged)."""
    frames = [_load_tables(folder, _fingerprint([Path(folder)]))[0] for folder in folders]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=REQUEST_COLUMNS)


def load_iterations(folder: str) -> pd.DataFrame:
    """One run's iteration rows (time_s, num_running, num_waiting, kv_used_blocks, ...), in iteration order."""
    return _load_tables(folder, _fingerprint([Path(folder)]))[1]


@st.cache_data(show_spinner=False)
def _load_tables(folder: str, stamps: Fingerprint) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(requests, iterations) of one run, read once per change of its files."""
    try:
        requests, iterations, _ = load_run(folder)
    except (FileNotFoundError, ValueError) as exc:  # the folder went away, or a part is not a parquet table
        log.warning("skipped the tables of serving run %s: %s", folder, exc)
        return pd.DataFrame(columns=REQUEST_COLUMNS), pd.DataFrame(columns=ITERATION_COLUMNS)
    return requests, iterations
