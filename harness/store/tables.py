"""The column contracts of the KV-movement tables, and their one writer (torch-free, as harness.store.schema).

TIER_COLUMNS: one row per (tier, direction, block size) of `python -m experiments.tiers`: the GB/s a block moves at
between the device, the host and the disk tier (harness/movement/tier_bandwidth.py), beside the same device's ceilings.
Written to <results_dir>/tiers/bandwidth-<time>.parquet.

PD_COLUMNS: one row per (transport, kv_dtype, context) of `python -m experiments.pd`: a prefilled request's KV sent
from a prefill process to a decode process (harness/movement/disagg.py), measured over a real transport, or extrapolated to a
datasheet link (harness/device/spec_links.csv); `source` says which. Written to <results_dir>/pd/transfer-<time>.parquet.

GB = 1e9 bytes throughout, as the ceilings.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pandas as pd
import pyarrow as pa

from harness.store.schema import Column, arrow_fields

TIERS_DIR = "tiers"  # <results_dir>/tiers/bandwidth-<time>.parquet
TIER_PREFIX = "bandwidth-"
PD_DIR = "pd"  # <results_dir>/pd/transfer-<time>.parquet
PD_PREFIX = "transfer-"
MEASURED = "measured"  # the `source` of a measured row; an extrapolated one reads "extrapolated: <datasheet>"

TIER_COLUMNS: tuple[Column, ...] = (
    Column("run_id", "string", "", "One run of the tiers experiment: every row it wrote shares it"),
    Column("device", "string", "", "cpu or cuda: where the device tier lives"),
    Column("device_name", "string", "", "The CUDA device's or the CPU's name"),
    Column("model", "string", "", "Model preset whose paged-cache blocks were moved (shapes only, no weights)"),
    Column("kv_dtype", "string", "", "Storage format of the blocks (a quantized one carries its scales)"),
    Column("tier", "string", "", "host or disk: the tier a block moves to or from (the other end is the device)"),
    Column(
        "direction",
        "string",
        "",
        "d2h, h2d (device <-> host tier), write (host -> disk file), read (disk file -> host), as the block moves",
    ),
    Column("block_tokens", "int64", "tokens", "Tokens per block of the model the blocks are shaped for"),
    Column("block_bytes", "int64", "bytes", "Bytes of one block: every layer's K and V (and scales) for its tokens"),
    Column("n_blocks", "int64", "", "Blocks moved per timed repeat, each a transfer (a disk block: a file) of its own"),
    Column("total_bytes", "int64", "bytes", "block_bytes x n_blocks: what one timed repeat moves"),
    Column("seconds", "float64", "s", "Median seconds of one repeat (all n_blocks), warm-up excluded"),
    Column("gbps", "float64", "GB/s", "total_bytes / seconds, GB = 1e9"),
    Column("gbps_rse", "float64", "", "Relative standard error of the median (harness.measure.stats' bootstrap)"),
    Column("repeats", "int64", "", "Timed repeats behind the median"),
    Column("pinned", "bool", "", "The host tier is page-locked (CUDA); false on the CPU, where host is device memory"),
    Column(
        "same_memory",
        "bool",
        "",
        "Device and host tier are the same RAM (the CPU): d2h and h2d are then memory copies, not a bus",
    ),
    Column("direct_io", "bool", "", "Disk rows: the file was written and read with O_DIRECT (no page cache)"),
    Column(
        "cold_read",
        "bool",
        "",
        "Disk reads: the file's pages were not in the page cache (O_DIRECT, or dropped with posix_fadvise first)",
    ),
    Column("disk_dir", "string", "", "Disk rows: the directory the block files were written to"),
    Column("filesystem", "string", "", "Disk rows: the filesystem type of disk_dir (from /proc/mounts), if known"),
    Column("peak_read_bw_gbps", "float64", "GB/s", "The device's measured streaming-read ceiling, for comparison"),
    Column("peak_copy_bw_gbps", "float64", "GB/s", "The device's measured copy ceiling (read + write bytes)"),
    Column("ceilings_fingerprint", "string", "", "The stored ceilings these rows sit beside"),
    Column("source", "string", "", "measured (every tier figure here is)"),
    Column("started_at", "string", "", "Start of the run, ISO-8601 UTC"),
)

PD_COLUMNS: tuple[Column, ...] = (
    Column("run_id", "string", "", "One run of the pd experiment: every row it wrote shares it"),
    Column("model", "string", "", "Model preset name"),
    Column("weights", "string", "", "Checkpoint directory the weights were loaded from; null: seeded random"),
    Column("device", "string", "", "cpu or cuda: where both processes computed"),
    Column("device_name", "string", "", "The CUDA device's or the CPU's name"),
    Column("dtype", "string", "", "Compute dtype of weights and activations"),
    Column("kv_dtype", "string", "", "Storage dtype of the KV sent (fp8 halves the bytes of bf16)"),
    Column(
        "context",
        "int64",
        "tokens",
        "Prompt tokens P: the prefill process computes the first P - 1, whose KV the decode process receives",
    ),
    Column("batch_size", "int64", "", "Sequences prefilled and sent together"),
    Column(
        "transport",
        "string",
        "",
        "shm, tcp (loopback), gloo, nccl: measured; or a datasheet link (pcie5-x16, nvlink4, rdma-400g): extrapolated",
    ),
    Column(
        "source",
        "string",
        "",
        "measured, or 'extrapolated: <datasheet>' for a link this machine does not have (kv_bytes / its GB/s)",
    ),
    Column("kv_bytes", "int64", "bytes", "Bytes sent: K and V of every layer, with scales and int4's tail"),
    Column("transfer_ms", "float64", "ms", "Median time from the first byte sent to the KV installed in the decoder"),
    Column("transfer_gbps", "float64", "GB/s", "kv_bytes / transfer_ms, GB = 1e9"),
    Column("transfer_samples_ms", "list<float64>", "ms", "Each measured transfer, in order"),
    Column("prefill_ms", "float64", "ms", "The prefill process's forward of the first context - 1 tokens, median"),
    Column("first_step_ms", "float64", "ms", "The decode process's first step (it yields the first token), median"),
    Column(
        "ttft_pd_ms", "float64", "ms", "prefill_ms + transfer_ms + first_step_ms: time to first token, disaggregated"
    ),
    Column(
        "ttft_colocated_ms",
        "float64",
        "ms",
        "The same request prefilled and decoded in one process (prefill + first decode step), median",
    ),
    Column("tpot_ms", "float64", "ms", "The decode process's median decode step after the first"),
    Column(
        "transfer_over_step",
        "float64",
        "",
        "transfer_ms / tpot_ms: above 1, sending this context takes longer than one decode step",
    ),
    Column("outputs_match", "bool", "", "The disaggregated tokens equal the colocated ones (greedy, same weights)"),
    Column("repeats", "int64", "", "Timed transfers behind the medians"),
    Column("status", "string", "", "ok, unsupported or error"),
    Column("error", "string", "", "Why the row is not ok; null when it is"),
    Column("started_at", "string", "", "Start of the run, ISO-8601 UTC"),
)


def arrow_schema(columns: tuple[Column, ...]) -> pa.Schema:
    return pa.schema(arrow_fields(columns))


def write_table(frame: pd.DataFrame, columns: tuple[Column, ...], directory: str | Path, *, prefix: str) -> Path:
    """`frame` to `directory/<prefix><local time>.parquet`, atomically, cast to its contract.

    An unknown column is rejected; a missing one is written as nulls; NaN becomes null."""
    from harness.store.disk import cast_to_schema, write_parquet  # disk imports this module's PREFIXes

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    path = Path(directory) / f"{prefix}{stamp}.parquet"
    write_parquet(table=cast_to_schema(frame, arrow_schema(columns), kind=prefix.rstrip("-")), path=path)
    return path


IDENTITY = ("run_id", "source")  # every table of these contracts has them; a parquet file without them is not one


def read_table_file(path: str | Path) -> pd.DataFrame | None:
    """One table file, or None when it is not a table of these contracts (a result row, say)."""
    frame = pd.read_parquet(path)
    return frame if set(IDENTITY) <= set(frame.columns) else None


def empty_table(columns: tuple[Column, ...]) -> pd.DataFrame:
    """No rows, the contract's columns: what a reader returns where no table was written."""
    return pd.DataFrame({c.name: pd.Series(dtype=object) for c in columns})


def read_tables(directory: str | Path, *, prefix: str, columns: tuple[Column, ...]) -> pd.DataFrame:
    """Every `<prefix>*.parquet` under `directory` (recursively: results/reference/<run>/tiers/ too), concatenated;
    empty_table(columns) when there is none. Files that are not tables of this kind are skipped."""
    paths = sorted(p for p in Path(directory).rglob(f"{prefix}*.parquet") if not p.name.startswith("."))
    frames = [frame for frame in map(read_table_file, paths) if frame is not None]
    return pd.concat(frames, ignore_index=True) if frames else empty_table(columns)
