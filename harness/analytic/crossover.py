"""Where decode stops being memory-bound: the observed knee of a batch sweep beside the predicted critical batch.

While decode is memory-bound, a bigger batch costs almost nothing per step: the weights are read once for all
sequences, so TPOT stays flat and throughput grows with the batch. Past the ridge point of the roofline the step
becomes compute-bound and TPOT rises with the batch. The observed knee is the first batch whose TPOT exceeds its
batch-1 value by KNEE_RISE; the predicted critical batch B* comes from the analytic model (harness.analytic.roofline).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from harness.store.schema import POINT_KEY_COLUMNS

KNEE_RISE = 1.25  # TPOT 25% above batch 1: well clear of run-to-run noise (tpot_cv is a few %)
# A batch sweep: rows equal on every point key column but batch_size (the workload and the KV treatment), so that a
# knee is never read across two workloads (another gen_len, prefix, compile mode or strategy option).
GROUP = [c for c in POINT_KEY_COLUMNS if c != "batch_size"]


def knee_batch(batch_sizes: Sequence[float], tpot_ms: Sequence[float]) -> int | None:
    """The first batch whose TPOT exceeds KNEE_RISE x its batch-1 value; None without batch 1 or without a rise.

    batch_sizes ascending, one TPOT each (a median, when a batch was measured more than once).
    """
    if len(batch_sizes) < 2 or batch_sizes[0] != 1:
        return None
    for batch, tpot in zip(batch_sizes, tpot_ms, strict=True):
        if tpot > KNEE_RISE * tpot_ms[0]:
            return int(batch)
    return None


def knee_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per batch sweep (rows that differ only in batch_size): its observed knee beside B*.

    Columns: GROUP, batches (how many were measured), tpot_b1_ms, knee_batch (null when TPOT never rose by
    KNEE_RISE within the sweep), and critical_batch (the prediction, when the rows carry it).
    """
    # Narrow (a row has ~140 columns); a key column older rows lack is null for all of them, one value of its own.
    needed = [*GROUP, "batch_size", "tpot_ms", *(["critical_batch"] if "critical_batch" in rows.columns else [])]
    ok = rows.loc[(rows["status"] == "ok") & rows["tpot_ms"].notna()].reindex(columns=needed)
    lines = []
    for key, sweep in ok.groupby(GROUP, dropna=False):
        per_batch = sweep.groupby("batch_size")["tpot_ms"].median().sort_index()
        if len(per_batch) < 2 or per_batch.index[0] != 1:
            continue  # not a batch sweep from batch 1
        tpot_b1 = float(per_batch.iloc[0])
        predicted = sweep["critical_batch"].dropna() if "critical_batch" in sweep else pd.Series(dtype=float)
        lines.append(
            dict(zip(GROUP, key, strict=True))
            | {
                "batches": len(per_batch),
                "tpot_b1_ms": tpot_b1,
                "knee_batch": knee_batch(per_batch.index.tolist(), per_batch.tolist()),
                "critical_batch": float(predicted.iloc[0]) if len(predicted) else None,
            }
        )
    return pd.DataFrame(lines, columns=[*GROUP, "batches", "tpot_b1_ms", "knee_batch", "critical_batch"])
