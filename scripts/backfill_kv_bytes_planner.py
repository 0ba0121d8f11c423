"""Fill kv_bytes_planner into point rows written before the column existed: the planner's KV bytes for each row's
workload, computed from the row's own columns as the dashboard computed them before the run recorded the figure.

    python scripts/backfill_kv_bytes_planner.py results/reference          # rewrites the files that lack it
    python scripts/backfill_kv_bytes_planner.py results --dry-run          # counts only

A row file that already has the column is left alone. Every other cell, and the file's schema (its fields, their
order and metadata), stay as they were: the column is inserted after kv_bytes_predicted, through the one atomic
writer. Null, never guessed, where the planner cannot stand for the row: a model that is not a preset here (a
checkpoint's shapes are in its config.json, which this machine may not have) or whose preset's shapes differ from
the row's; mixed lengths (the pool held the drawn lengths, which the row does not record); a workload the planner
refuses. A run today records the figure from its own config (harness.run.point.planner_kv_bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from harness import kv
from harness.analytic import ledger
from harness.errors import ConfigError
from harness.modeling.model_args import PRESETS, ModelArgs
from harness.store import disk, schema

log = logging.getLogger(__name__)

COLUMN, AFTER = "kv_bytes_planner", "kv_bytes_predicted"
# The row's columns the planner reads: the model (a preset name, and the shapes the row ran with), the workload and
# the strategy's options. An option column is null where the strategy has no such option; the planner's default
# then stands, as it did for the run.
PLANNER_COLUMNS = (
    "model", "n_layers", "n_kv_heads", "head_dim", "lengths", "dtype", "kv_dtype", "cache", "batch_size",
    "prompt_len", "gen_len", *schema.OPTION_COLUMNS, "prefix_len", "kv_group_size", "kv_residual",
)  # fmt: skip
PLANNER_REQUIRED = ("model", "dtype", "kv_dtype", "cache", "batch_size", "prompt_len", "gen_len")
KEY = ("point_id", "sweep_id", "started_at")  # one measurement (disk.load keeps one of rows equal on these)


def row_kv_bytes(row: dict) -> int | None:
    """The planner's figure for one row (PLANNER_COLUMNS values, nulls as None), None where it cannot stand."""
    if (
        any(row.get(key) is None for key in PLANNER_REQUIRED)
        or row["model"] not in PRESETS
        or row["lengths"] == "mixed"
    ):
        return None
    args = ModelArgs.from_name(row["model"])
    if row["n_kv_heads"] is not None:  # a preset run with other KV heads (model.n_kv_heads)
        args = dataclasses.replace(args, n_kv_heads=row["n_kv_heads"])
    if any(row[key] is not None and row[key] != getattr(args, key) for key in ("n_layers", "head_dim")):
        return None  # a checkpoint that shares a preset's name, not the preset
    try:
        # the strategy's own options, as its row columns hold them (null: the option's default)
        options = {
            key: row[column] for key, column in option_columns(row["cache"]).items() if row.get(column) is not None
        }
        quant = {key: row[key] for key in ("kv_group_size", "kv_residual") if row[key] is not None}
        return ledger.kv_bytes_allocated(
            args,
            cache=row["cache"],
            kv_dtype=row["kv_dtype"],
            batch_size=row["batch_size"],
            prompt_len=row["prompt_len"],
            gen_len=row["gen_len"],
            prefix_len=row["prefix_len"] or 0,
            dtype=row["dtype"],
            **quant,
            **options,
        )
    except (ConfigError, ValueError) as exc:  # a workload the planner refuses (unsupported, out of range)
        log.info("no planner figure for %s: %s", row, exc)
        return None


def option_columns(cache: str) -> dict[str, str]:
    """A strategy's options -> the row columns that hold them: its layout's option_columns at the defaults, in the
    options' order (evict's `window` is the column obs_window: `window` is the sliding window's)."""
    names = kv.option_names(cache)
    columns = list(kv.layout(cache, {}).option_columns())
    return dict(zip(names, columns, strict=True)) if len(columns) == len(names) else {name: name for name in names}


def _plain(value: object) -> object:
    """A cell as a plain value: None for nulls, int for whole numbers, else str."""
    if value is None or value is pd.NA or (isinstance(value, float) and np.isnan(value)):
        return None
    if isinstance(value, int | np.integer | float | np.floating) and float(value).is_integer():
        return int(value)
    return str(value)


def planner_figures(rows: pd.DataFrame) -> list[int | None]:
    """row_kv_bytes of each row of a loaded frame (disk.load's), in its order."""
    narrow = rows.reindex(columns=list(PLANNER_COLUMNS))
    return [row_kv_bytes({k: _plain(v) for k, v in zip(PLANNER_COLUMNS, values, strict=True)}) for values in
            narrow.itertuples(index=False)]  # fmt: skip


def backfilled(path: Path) -> pa.Table | None:
    """The file's table with COLUMN inserted after AFTER, or None when it has the column already."""
    table = pq.read_table(path)
    if COLUMN in table.column_names:
        return None
    loaded = disk.load(path)  # the rows as the dashboard saw them: conformed to today's columns
    figures = dict(zip(map(tuple, loaded[list(KEY)].astype(object).to_numpy()), planner_figures(loaded), strict=True))
    keys = table.select(list(KEY)).to_pylist()
    values = pa.array([figures[tuple(key[k] for k in KEY)] for key in keys], type=pa.int64())
    at = table.column_names.index(AFTER) + 1 if AFTER in table.column_names else table.num_columns
    field = schema.arrow_schema().field(COLUMN)
    return table.add_column(at, field, values).replace_schema_metadata(table.schema.metadata)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="count the files and figures, write nothing")
    options = parser.parse_args(argv)
    root = options.directory.resolve()
    files = sorted(f for f in root.rglob("*.parquet") if disk.is_row_file(f, root=root))
    written = filled = 0
    for file in files:
        table = backfilled(file)
        if table is None:
            continue
        written += 1
        filled += table[COLUMN].length() - table[COLUMN].null_count
        if not options.dry_run:
            disk.write_parquet(table=table, path=file)
    print(f"{written} of {len(files)} row files lacked {COLUMN}; {filled} rows got a figure, the rest null")


if __name__ == "__main__":
    main()
