"""Result rows as text: the one table printer (pandas), the summary a sweep or `kvbench-results show` prints, and
the line a run ends with: where to look at what it wrote."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pandas as pd

from harness.store.schema import COLUMNS

_ERROR_WIDTH_CHARS = 60  # format_summary: keeps a failed row's error on one terminal line
_MIB_BYTES = 2**20
DASHBOARD_RESULTS = Path("results")  # the folder `make dashboard` reads (dashboard/data.py), beside results/reference

# (header, column, format): the header carries the unit the format converts to.
_SUMMARY_LAYOUT: tuple[tuple[str, str, Callable[[object], str]], ...] = (
    ("status", "status", str),
    ("model", "model", str),
    ("cache", "cache", str),
    ("kv_dtype", "kv_dtype", str),
    ("batch", "batch_size", "{:.0f}".format),
    ("prompt", "prompt_len", "{:.0f}".format),
    ("gen", "gen_len", "{:.0f}".format),
    ("ttft ms", "ttft_ms", "{:.2f}".format),
    ("tpot ms", "tpot_ms", "{:.3f}".format),
    ("decode tok/s", "decode_tok_s", "{:.1f}".format),
    ("KV alloc MiB", "kv_bytes_allocated", lambda value: f"{value / _MIB_BYTES:.1f}"),
    ("KV live MiB", "kv_bytes_live", lambda value: f"{value / _MIB_BYTES:.1f}"),
    ("KV waste %", "kv_waste_fraction", lambda value: f"{100 * value:.1f}"),
    ("top1", "top1_agreement", "{:.3f}".format),
    ("peak MiB", "peak_mem_bytes", lambda value: f"{value / _MIB_BYTES:.1f}"),
)
# A prefix cache's TTFT by where its prefix came from (harness/kv/tiers.py), shown after `ttft ms` where any row has
# them: ttft ms is then the hit in device memory.
_PREFIX_LAYOUT: tuple[tuple[str, str, Callable[[object], str]], ...] = (
    ("prefix", "prefix_len", "{:.0f}".format),
    ("found in", "prefix_source", str),
    ("host ms", "ttft_host_ms", "{:.2f}".format),
    ("disk ms", "ttft_disk_ms", "{:.2f}".format),
    ("recompute ms", "ttft_miss_ms", "{:.2f}".format),
)
_SUMMARY_TEXT = (
    "status",
    "model",
    "cache",
    "kv_dtype",
    "found in",
    "noise",
    "error",
)  # left-aligned; numbers stay right-aligned
# Treatments shown after `cache` only where the rows differ in them: otherwise two rows of a sweep over attn_impl (or
# an eviction policy, or MLA's decode path) would print as the same point twice.
_VARYING = ("attn_impl", "mla_path", "policy", "budget", "obs_window", "window")


def text_table(
    frame: pd.DataFrame,
    *,
    formatters: Mapping[str, Callable[[object], str]] | None = None,
    left: Sequence[str] = (),
    na_rep: str = "-",
) -> str:
    """`frame` as a fixed-width table, one line per row: pandas' DataFrame.to_string(index=False), each cell by its
    column's formatter (str when it has none), a null as `na_rep`, and the `left` columns (text) left-aligned, which
    pandas cannot do by itself (it right-aligns every column). Trailing blanks are trimmed."""
    formatters = dict(formatters or {})

    def cell(value: object, name: str) -> str:
        if value is None or (pd.api.types.is_scalar(value) and pd.isna(value)):
            return na_rep
        return formatters.get(name, str)(value)

    text = pd.DataFrame({name: [cell(value, name) for value in frame[name]] for name in frame.columns})
    widths = {name: max([len(name), *(len(value) for value in text[name])]) for name in text.columns}
    headers = {name: name.ljust(widths[name]) for name in left}  # pandas right-justifies a header in its width
    justify = {headers[name]: (lambda value, width=widths[name]: value.ljust(width)) for name in left}
    text = text.rename(columns=headers)
    # Two blanks between columns (pandas puts one): every column but the first is one wider than its widest cell.
    space = {name: widths[original] + 1 for name, original in zip(text.columns[1:], frame.columns[1:], strict=True)}
    table = text.to_string(index=False, formatters=justify, col_space=space)
    return "\n".join(line.rstrip() for line in table.splitlines())


def format_summary(df: pd.DataFrame) -> str:
    """One line per row, sorted by model, cache, kv_dtype, batch and prompt; nulls as '-'; a row whose repeats did
    not converge or whose host was busy says so under `noise`; failed rows end with their error, shortened to one
    line."""
    if df.empty:
        return "(no results)"
    df = df.reindex(columns=[c.name for c in COLUMNS]).sort_values(
        ["model", "cache", "kv_dtype", "batch_size", "prompt_len"], na_position="last", kind="stable"
    )
    varying = [column for column in _VARYING if df[column].dropna().astype(str).nunique() > 1]
    layout = list(_SUMMARY_LAYOUT)
    after_cache = [header for header, _, _ in layout].index("cache") + 1
    layout[after_cache:after_cache] = [(column, column, _cell_text) for column in varying]
    if df["prefix_source"].notna().any():
        after_ttft = [header for header, _, _ in layout].index("ttft ms") + 1
        layout[after_ttft:after_ttft] = list(_PREFIX_LAYOUT)
    shown = pd.DataFrame({header: df[column].tolist() for header, column, _ in layout})
    shown["noise"] = [
        noise_mark(converged=converged, host_busy=busy)
        for converged, busy in zip(df["converged"], df["host_busy"], strict=True)
    ]
    shown["error"] = [
        "" if status == "ok" else _shorten(error) for status, error in zip(df["status"], df["error"], strict=True)
    ]
    formatters = {header: fmt for header, _, fmt in layout}
    left = [name for name in (*_SUMMARY_TEXT, *varying) if name in shown.columns]
    return text_table(shown, formatters=formatters, left=left)


def next_step(folder: str | Path, *, results_dir: str | Path, page: str | None = None) -> str:
    """A run's last line: how to look at what it wrote to `folder` under results_dir. The dashboard (told the
    folder when it is not results/), then kvbench-results show, or for tables that command does not read (serving
    runs), the dashboard page that draws them."""
    dashboard = "make dashboard"
    if Path(results_dir) != DASHBOARD_RESULTS:
        dashboard = f"KVBENCH_RESULTS={results_dir} {dashboard}"
    if page is None:
        return f"next: {dashboard}  (or: {results_command()} show {folder})"
    return f"next: {dashboard}, its {page} page  (this run: {folder})"


def results_command() -> str:
    """kvbench-results as it runs from here: by name when it is on PATH, else beside this interpreter
    (.venv/bin/kvbench-results under make, whose venv is not activated), else the module."""
    if shutil.which("kvbench-results"):
        return "kvbench-results"
    script = Path(sys.executable).parent / "kvbench-results"
    if not script.exists():
        return "python -m harness.store"
    return str(script.relative_to(Path.cwd())) if script.is_relative_to(Path.cwd()) else str(script)


def _cell_text(value: object) -> str:
    """A treatment's value: a whole number without its ".0" (a nullable int column comes back as float)."""
    return f"{value:.0f}" if isinstance(value, float) else str(value)


def noise_mark(*, converged: object, host_busy: object) -> str:
    """What makes a row's figures doubtful: "unconverged" (target_rse not met, after the retry if any), "busy host"
    (steal or other processes over host_noise.BUSY_SHARE), both, or "". A null is "not recorded" (a row from before
    these columns, a failed point), never a mark."""
    marks = []
    if _known(converged) and not bool(converged):
        marks.append("unconverged")
    if _known(host_busy) and bool(host_busy):
        marks.append("busy host")
    return ", ".join(marks)


def _known(value: object) -> bool:
    return value is not None and not pd.isna(value)


def _shorten(error: object) -> str:
    if error is None or pd.isna(error) or not str(error).strip():
        return "-"
    text = " ".join(str(error).split())  # one line: tracebacks and multi-line messages collapse
    return text if len(text) <= _ERROR_WIDTH_CHARS else text[: _ERROR_WIDTH_CHARS - 1] + "…"
