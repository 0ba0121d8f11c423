"""The pairing behind an A/B comparison (harness/store/compare.py): A's and B's ok rows matched by the workload key
(schema.POINT_KEY_COLUMNS), the latest of a key's reruns taken; the label that names each pair's workload; and the
two sweeps the dashboard's Compare page opens on.

Torch-free (numpy, pandas), like the comparison it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from harness.store.schema import POINT_KEY_COLUMNS

LABEL_ALWAYS = ("cache", "kv_dtype")  # named in every pair's label, even when every pair shares them


@dataclass(frozen=True)
class Pairs:
    a: pd.DataFrame  # one row per paired key, aligned with b row by row (fresh index)
    b: pd.DataFrame
    only_a: pd.DataFrame  # the key columns of the ok rows whose key B lacks
    only_b: pd.DataFrame
    notes: tuple[str, ...]  # what pairing chose: the latest of several rows for one key


def pair(a_rows: pd.DataFrame, b_rows: pd.DataFrame) -> Pairs:
    """The ok rows of A and B paired by POINT_KEY_COLUMNS, nulls equal to nulls. Of several rows for one key on a
    side (reruns), the latest by started_at is taken and a note says so; a key on one side only is listed."""
    notes: list[str] = []
    a, b = (_latest_per_key(rows, side=side, notes=notes) for rows, side in ((a_rows, "A"), (b_rows, "B")))
    both = [key for key in a.index if key in b.index]
    return Pairs(
        a=a.loc[both].reset_index(drop=True),
        b=b.loc[both].reset_index(drop=True),
        only_a=a.loc[[key for key in a.index if key not in b.index], list(POINT_KEY_COLUMNS)].reset_index(drop=True),
        only_b=b.loc[[key for key in b.index if key not in a.index], list(POINT_KEY_COLUMNS)].reset_index(drop=True),
        notes=tuple(notes),
    )


def _latest_per_key(rows: pd.DataFrame, *, side: str, notes: list[str]) -> pd.DataFrame:
    """The ok rows indexed by their key tuple, one per key (the latest started_at; a null started_at is oldest)."""
    rows = rows.reindex(columns=list(dict.fromkeys([*rows.columns, *POINT_KEY_COLUMNS, "status", "started_at"])))
    ok = rows[rows["status"].eq("ok").fillna(False).astype(bool).to_numpy()]
    keys = pd.Series([_key(values) for values in ok[list(POINT_KEY_COLUMNS)].itertuples(index=False)], index=ok.index)
    counts = keys.value_counts()
    for key, count in counts[counts > 1].items():
        notes.append(f"{side}: {count} rows for {_key_text(key)}; took the latest by started_at")
    order = ok["started_at"].astype(object).where(ok["started_at"].notna(), "").astype(str).argsort(kind="stable")
    latest = ok.iloc[order].assign(_key=keys.iloc[order].to_numpy()).drop_duplicates("_key", keep="last")
    return latest.set_index("_key", drop=True)


def best_pair(rows: pd.DataFrame) -> tuple[str, str] | None:
    """The two sweeps whose ok rows share the most point keys, (older, newer) by sweep_id; ties go to the latest
    pair. None when no two sweeps share a key: the dashboard's default choice, so that it opens on a comparison."""
    rows = rows.reindex(columns=list(dict.fromkeys([*rows.columns, *POINT_KEY_COLUMNS, "status", "sweep_id"])))
    ok = rows[rows["status"].eq("ok").fillna(False).astype(bool).to_numpy() & rows["sweep_id"].notna().to_numpy()]
    # One (sweep, key) per distinct combination first: 100k rows of reruns hold a few thousand (6.6 s -> 0.1 s).
    distinct = ok[["sweep_id", *POINT_KEY_COLUMNS]].drop_duplicates()
    keys_of = {
        str(sweep): {_key(values) for values in part[list(POINT_KEY_COLUMNS)].itertuples(index=False)}
        for sweep, part in distinct.groupby(distinct["sweep_id"].astype(str), sort=True)
    }
    sweeps = sorted(keys_of)
    shared = [
        (len(keys_of[a] & keys_of[b]), b, a) for i, a in enumerate(sweeps) for b in sweeps[i + 1 :]
    ]  # (count, newer, older): max() prefers more keys, then the later pair
    best = max(shared, default=(0, None, None))
    return (best[2], best[1]) if best[0] else None


def _key(values: tuple) -> tuple:
    """One row's key as plain values: a null is None whatever its dtype, and 512.0 (a float column) equals 512."""
    plain = []
    for value in values:
        if value is None or (not isinstance(value, (list, tuple, np.ndarray)) and pd.isna(value)):
            plain.append(None)
        elif isinstance(value, (float, np.floating)) and float(value).is_integer():
            plain.append(int(value))
        elif isinstance(value, (np.integer, np.bool_)):
            plain.append(value.item())
        else:
            plain.append(value)
    return tuple(plain)


def _key_text(key: tuple) -> str:
    return " ".join(f"{name}={value}" for name, value in zip(POINT_KEY_COLUMNS, key, strict=True) if value is not None)


def workload_labels(keys: pd.DataFrame) -> pd.Series:
    """A label per line naming the key columns that differ between the lines (and LABEL_ALWAYS): 'cache=paged
    kv_dtype=bf16 prompt_len=512'. Nulls are left out."""
    varying = [c for c in POINT_KEY_COLUMNS if c not in LABEL_ALWAYS and keys[c].astype(str).nunique() > 1]
    shown = [*LABEL_ALWAYS, *varying]
    parts = []
    for values in keys[shown].itertuples(index=False):
        key = _key(tuple(values))
        parts.append(" ".join(f"{name}={value}" for name, value in zip(shown, key, strict=True) if value is not None))
    return pd.Series(parts, index=keys.index, dtype=object)
