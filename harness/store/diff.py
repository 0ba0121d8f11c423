"""Comparing rows: what differs between two measurements, and whether two sets of rows are the same.

    kvbench-results diff results/ 3f2a 9c1e   # what changed between two rows (config, environment, figures)

Cell equality (same_value) is shared with compaction, which may delete the originals only when the merged file
reads back as the same rows (same_rows).
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd

from harness.store import disk

logger = logging.getLogger(__name__)

_SHORT_CHARS = 60  # a value in a diff line: itl_ms lists and error messages stay on one line


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
    """The whole row a disk.index() line points at: its file is read, and the row equal in MEASUREMENT_KEY taken."""
    rows = disk.load(line["path"])
    same = pd.Series(True, index=rows.index)
    for key in disk.MEASUREMENT_KEY:
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
        if not same_value(left, right):
            lines.append(f"{column}: {_short(left)} -> {_short(right)}")
    configs = [json.loads(row["config_json"]) if isinstance(row.get("config_json"), str) else {} for row in (a, b)]
    flat = [_flatten(config) for config in configs]
    for key in sorted(set(flat[0]) | set(flat[1])):
        if flat[0].get(key) != flat[1].get(key):
            lines.append(f"config.{key}: {flat[0].get(key)} -> {flat[1].get(key)}")
    return lines


def same_rows(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """The same columns and, measurement by measurement (rows sorted by MEASUREMENT_KEY), the same values; nulls
    and NaNs equal themselves. Both frames hold each measurement once (see disk.drop_repeats), so the sort is total."""
    if len(a) != len(b) or list(a.columns) != list(b.columns):
        return False
    order = list(disk.MEASUREMENT_KEY)
    a, b = a.sort_values(order, ignore_index=True), b.sort_values(order, ignore_index=True)
    return all(same_value(x, y) for column in a.columns for x, y in zip(a[column], b[column], strict=True))


def same_value(x: object, y: object) -> bool:
    """Equality for one cell: lists (itl_ms; extra list columns arrive as arrays) element by element, NaN == NaN,
    and a null equals only a null."""
    if isinstance(x, (list, tuple, np.ndarray)) or isinstance(y, (list, tuple, np.ndarray)):
        if not isinstance(x, (list, tuple, np.ndarray)) or not isinstance(y, (list, tuple, np.ndarray)):
            return False
        return len(x) == len(y) and all(same_value(p, q) for p, q in zip(x, y, strict=True))
    x_null, y_null = bool(pd.isna(x)), bool(pd.isna(y))
    if x_null or y_null:
        return x_null and y_null
    return bool(x == y)


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= _SHORT_CHARS else text[: _SHORT_CHARS - 3] + "..."


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat
