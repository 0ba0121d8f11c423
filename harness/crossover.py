"""Where decode stops being memory-bound: the observed knee of a batch sweep beside the predicted critical batch.

While decode is memory-bound, a bigger batch costs almost nothing per step: the weights are read once for all
sequences, so TPOT stays flat and throughput grows with the batch. Past the ridge point of the roofline the step
becomes compute-bound and TPOT rises with the batch. The observed knee is the first batch whose TPOT exceeds its
batch-1 value by KNEE_RISE; the predicted critical batch B* comes from the analytic model (harness.roofline).
"""

from __future__ import annotations

import pandas as pd

KNEE_RISE = 1.25  # TPOT 25% above batch 1: well clear of run-to-run noise (tpot_cv is a few %)
GROUP = ["model", "device", "dtype", "kv_dtype", "cache", "prompt_len"]


def knee_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per batch sweep (rows that differ only in batch_size): its observed knee beside B*.

    Columns: GROUP, batches (how many were measured), tpot_b1_ms, knee_batch (null when TPOT never rose by
    KNEE_RISE within the sweep), and critical_batch (the prediction, when the rows carry it).
    """
    ok = rows[(rows["status"] == "ok") & rows["tpot_ms"].notna()]
    lines = []
    for key, sweep in ok.groupby(GROUP, dropna=False):
        sweep = sweep.sort_values("batch_size")
        if sweep["batch_size"].nunique() < 2 or sweep["batch_size"].iloc[0] != 1:
            continue  # not a batch sweep from batch 1
        tpot_b1 = sweep["tpot_ms"].iloc[0]
        risen = sweep[sweep["tpot_ms"] > KNEE_RISE * tpot_b1]
        predicted = sweep["critical_batch"].dropna() if "critical_batch" in sweep else pd.Series(dtype=float)
        lines.append(
            dict(zip(GROUP, key, strict=True))
            | {
                "batches": len(sweep),
                "tpot_b1_ms": tpot_b1,
                "knee_batch": int(risen["batch_size"].iloc[0]) if len(risen) else None,
                "critical_batch": float(predicted.iloc[0]) if len(predicted) else None,
            }
        )
    return pd.DataFrame(lines, columns=[*GROUP, "batches", "tpot_b1_ms", "knee_batch", "critical_batch"])
