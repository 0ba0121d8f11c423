"""What a sweep decides before it measures a point: resume (already recorded?) and the OOM backstop (bound to OOM?).

Resume, as vLLM's sweep tool's --resume: a point whose point_id (harness.config.RunConfig.point_id, a hash of what is
measured, never of where results go) already has a row in results_dir on this device, with a status that a rerun
would only repeat (FINAL), is skipped. `error` rows are retried. `force=true` measures again. The committed
reference runs under <results_dir>/reference/ never count: they were measured on another machine of the same name. Rows are found by
harness.store.disk.index, which reads a handful of columns of every row file, so a rerun of a sweep of hundreds of
points costs a second per point, not a model load.

OOM backstop: within one sweep, once a point ran out of memory, every later point of the same model, strategy,
dtypes and options that the capacity planner (harness.analytic.ledger.total_bytes) says needs at least as much memory is
recorded as `skipped_oom`, naming the point that ran out, instead of being run into the same wall. The planner is
monotone in batch and length, so this skips exactly the points "beyond" the OOM, not a guess.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from harness.analytic.ledger import total_bytes
from harness.config import RunConfig
from harness.errors import ConfigError
from harness.store import disk

SKIPPED = "skipped"  # what experiments.decode.main answers for a point it found recorded
REFERENCE = disk.REFERENCE_DIR  # committed reference runs, which resume never counts as done
FINAL = ("ok", "oom", "unsupported", "skipped_oom")  # statuses a rerun would only repeat; `error` is retried
# Columns that must match between an OOM row and a point for the backstop to compare them: the same model, strategy,
# formats and options (the strategy's comparable_columns, backstop_keys); only the batch and the lengths may differ.
BACKSTOP_KEYS = (
    "model",
    "n_kv_heads",
    "device_name",
    "dtype",
    "kv_dtype",
    "cache",
    "kv_group_size",
    "kv_residual",
    "prefix_len",
    "weights",
    "max_memory_gb",
    "compile",
)


def recorded(point_id: str, device_name: str, results_dir: str | Path) -> pd.Series | None:
    """The latest row of `point_id` on `device_name` under results_dir whose status is FINAL, or None."""
    rows = disk.index(results_dir)
    reference = str(Path(results_dir) / REFERENCE) + os.sep
    rows = rows[~rows["path"].astype(str).str.startswith(reference)]  # committed references are not this user's runs
    rows = rows[(rows["point_id"] == point_id) & rows["status"].isin(FINAL)]
    rows = rows[rows["device_name"].isna() | (rows["device_name"] == device_name)]
    if rows.empty:
        return None
    return rows.sort_values("started_at", na_position="first").iloc[-1]


def backstop_keys(cfg: RunConfig) -> tuple[str, ...]:
    """BACKSTOP_KEYS and the option columns the point's strategy says must match (Layout.comparable_columns)."""
    return (*BACKSTOP_KEYS, *cfg.layout().comparable_columns())


def oom_cause(cfg: RunConfig, row: dict, sweep_dir: str | Path) -> pd.Series | None:
    """An `oom` row of this sweep with the same backstop_keys as `row` (the point's config columns) that needs no
    more memory than this point by the planner, or None. The first such row, in the order they were measured."""
    sweep_dir = Path(sweep_dir)
    index = disk.index(sweep_dir) if sweep_dir.is_dir() else pd.DataFrame()
    if index.empty or not (index["status"] == "oom").any():
        return None
    ooms = pd.concat([disk.load(path) for path in index.loc[index["status"] == "oom", "path"].unique()])
    same = pd.Series(True, index=ooms.index)
    for key in backstop_keys(cfg):
        if key in ooms.columns:
            mine = row.get(key)
            same &= ooms[key].isna() if mine is None else (ooms[key] == mine).fillna(False).astype(bool)
    ooms = ooms[same & (ooms["status"] == "oom")].sort_values("started_at", na_position="first")
    if ooms.empty:
        return None
    try:
        mine = cfg.workload()  # the planner's view of the point
        need = total_bytes(mine, runtime_overhead_bytes=0)
        for _, oom in ooms.iterrows():
            shape = dict(
                batch_size=int(oom["batch_size"]), prompt_len=int(oom["prompt_len"]), gen_len=int(oom["gen_len"])
            )
            if need >= total_bytes(mine.replace(**shape), runtime_overhead_bytes=0):
                return oom
    except ConfigError:  # a point the planner cannot describe is measured, never guessed at
        return None
    return None


def skipped_oom_error(cause: pd.Series) -> str:
    return (
        f"skipped: by the capacity planner this point needs at least the memory of point {cause['point_id']} "
        f"(batch {cause['batch_size']}, prompt {cause['prompt_len']}, gen {cause['gen_len']}), which ran out of "
        "memory in this sweep; oom_backstop=false measures it anyway"
    )
