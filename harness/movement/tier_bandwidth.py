"""GB/s of KV blocks moving between the device, the host and the disk tier, against block size (issue #18).

The blocks are exactly what the prefix cache moves: a paged pool (harness.kv.paged) shaped for a model preset and a
kv_dtype (shapes only, no weights), read and written with PagedCache.read_blocks / write_blocks, one block per
transfer. Four directions, each a row per block size:

    d2h    device pool -> host tier: read_blocks([i]) (a gather on the device) then a copy into the block's host slot,
           page-locked on CUDA (harness.kv.host.page_locked_zeros), so the copy runs at the bus's speed
    h2d    host tier -> device pool: write_blocks([i], slot) (on CUDA a copy to the device, then an index_copy_)
    write  host tier -> disk: harness.kv.block_file.write_block, one file per block (atomic, fsynced, O_DIRECT)
    read   disk -> host: block_file.read_block, cold (O_DIRECT, or the pages dropped first), checksum included

On the CPU the device and host tier are both RAM (same_memory = true): d2h and h2d are memory copies, not a bus, and
d2h makes two of them (the gather, then the slot) where h2d makes one. The disk is real everywhere.

Each timed repeat moves n_blocks blocks (about total_bytes, at least one block), after an untimed warm-up; a figure is
the median of `repeats` with its bootstrap spread (harness.measure.stats), the device synchronized at both ends
(harness/device/ceiling_timing.py). The disk directions are host work and are timed with perf_counter.

Units: GB = 1e9 bytes, as the ceilings.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import math
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from harness import kv
from harness.device import ceilings
from harness.device.ceiling_timing import median_seconds
from harness.kv import block_file, host
from harness.kv.base import CacheSpec
from harness.measure.environment import device_name
from harness.modeling.model_args import ModelArgs
from harness.store.tables import MEASURED

log = logging.getLogger(__name__)

DIRECTIONS = (("host", "d2h"), ("host", "h2d"), ("disk", "write"), ("disk", "read"))  # (tier, direction), in order
FIGURE_NAMES = {"d2h": "d2h", "h2d": "h2d", "write": "disk_write", "read": "disk_read"}  # -> Ceilings.tier_gbps
WARMUP_CALLS = 1  # one untimed repeat: first touch of the host slots, the files' first creation, the allocator
WARMUP_S = 0.25  # ... and untimed repeats for this long (a GPU's clocks ramp up from idle), 0 when quick


@dataclass(frozen=True)
class BlockShape:
    """What one block of a model's paged cache holds: its parts and their bytes."""

    block_tokens: int
    parts: dict[str, tuple[torch.Size, torch.dtype]]  # name -> ([L, 1, H_kv, rows, width], dtype)
    block_bytes: int  # every layer's K and V (and scales) for block_tokens tokens


def device_pool(
    args: ModelArgs, *, kv_dtype: str, dtype: str, block_tokens: int, n_blocks: int, device: torch.device
) -> kv.KVCache:
    """A paged pool of n_blocks blocks on `device`, filled with arbitrary bytes (a checksum sees real data)."""
    spec = CacheSpec.for_model(
        args, batch_size=1, max_tokens=block_tokens, kv_dtype=kv_dtype, device=device, dtype=dtype
    )
    cache = kv.build("paged", spec, {"block_size": block_tokens, "pool_tokens": n_blocks * block_tokens})
    generator = torch.Generator(device=device).manual_seed(0)
    for pool in cache.rows.values():
        if pool is not None:
            pool.view(torch.uint8).random_(0, 256, generator=generator)
    return cache


def block_shape(args: ModelArgs, *, kv_dtype: str, dtype: str, block_tokens: int) -> BlockShape:
    """The parts of one block, from a one-block pool on the CPU (a few MiB at most)."""
    pool = device_pool(
        args, kv_dtype=kv_dtype, dtype=dtype, block_tokens=block_tokens, n_blocks=1, device=torch.device("cpu")
    )
    parts = pool.read_blocks([0])
    shapes = {name: (t.shape, t.dtype) for name, t in parts.items()}
    return BlockShape(block_tokens, shapes, sum(t.numel() * t.element_size() for t in parts.values()))


def blocks_per_repeat(block_bytes: int, total_bytes: int) -> int:
    """Blocks for a repeat of about total_bytes, at least one."""
    return max(1, round(total_bytes / block_bytes))


def host_slots(shape: BlockShape, n_blocks: int, *, pinned: bool) -> dict[str, torch.Tensor]:
    """The host tier: name -> [n_blocks, L, 1, H_kv, rows, width], so that block i's slot slots[name][i] is
    contiguous. Page-locked exactly (cudaHostRegister) when `pinned`."""
    make = host.page_locked_zeros if pinned else (lambda s, dtype: torch.zeros(s, dtype=dtype))
    return {name: make((n_blocks, *size), dtype) for name, (size, dtype) in shape.parts.items()}


def block_identity(args: ModelArgs, *, kv_dtype: str, dtype: str, block_tokens: int) -> dict:
    """What a stored block must match to be used: the fields the prefix cache's own blocks carry."""
    return {
        "model": args.name,
        "weights": None,  # shapes only: no checkpoint behind these blocks
        "n_layers": args.n_layers,
        "kv_dtype": kv_dtype,
        "dtype": dtype,
        "block_size": block_tokens,
    }


@dataclass
class DiskLog:
    """What the disk transfers of one direction said about themselves (block_file.IOStats), all repeats."""

    direct_io: list[bool]
    cold: list[bool]


def time_direction(
    direction: str,
    *,
    pool: kv.KVCache,
    slots: dict[str, torch.Tensor],
    paths: list[Path],
    identity: dict,
    direct: bool,
    repeats: int,
    warmup_s: float,
) -> tuple[float, float, DiskLog]:
    """Median seconds of one repeat (every block once), its rse, and the disk transfers' IOStats flags."""
    n_blocks = len(paths)
    disk = DiskLog(direct_io=[], cold=[])
    device = pool.spec.device

    def d2h() -> None:
        for i in range(n_blocks):
            for name, part in pool.read_blocks([i]).items():  # [L, 1, H_kv, rows, width] on the device
                slots[name][i].copy_(part, non_blocking=True)

    def h2d() -> None:
        for i in range(n_blocks):
            pool.write_blocks([i], {name: slot[i] for name, slot in slots.items()})

    def write() -> None:
        for i, path in enumerate(paths):
            stats = block_file.write_block(
                path, {name: slot[i] for name, slot in slots.items()}, identity=identity, direct=direct
            )
            disk.direct_io.append(stats.direct_io)

    def read() -> None:
        for path in paths:
            _, stats = block_file.read_block(path, identity=identity, direct=direct)
            disk.direct_io.append(stats.direct_io)
            disk.cold.append(stats.cold)

    fn = {"d2h": d2h, "h2d": h2d, "write": write, "read": read}[direction]
    # The disk directions are host work between host buffers: perf_counter, no device events.
    timing_device = device if direction in ("d2h", "h2d") else torch.device("cpu")
    seconds, rse = median_seconds(fn, timing_device, warmup=WARMUP_CALLS, warmup_s=warmup_s, repeats=repeats)
    return seconds, rse, disk


def check_round_trip(paths: list[Path], slots: dict[str, torch.Tensor], identity: dict) -> None:
    """The files read back hold the host slots' bytes: a bandwidth of wrong data is no bandwidth."""
    for i, path in enumerate(paths):
        parts, _ = block_file.read_block(path, identity=identity)
        for name, slot in slots.items():
            if not torch.equal(parts[name].view(torch.uint8), slot[i].view(torch.uint8)):
                raise RuntimeError(f"tiers: block file {path} read back other bytes than written in part {name!r}")


def measure_block_size(
    args: ModelArgs,
    *,
    kv_dtype: str,
    dtype: str,
    block_tokens: int,
    device: torch.device,
    total_bytes: int,
    repeats: int,
    disk_dir: Path,
    direct: bool,
    warmup_s: float,
) -> list[dict]:
    """The four rows (DIRECTIONS) of one block size."""
    shape = block_shape(args, kv_dtype=kv_dtype, dtype=dtype, block_tokens=block_tokens)
    n_blocks = blocks_per_repeat(shape.block_bytes, total_bytes)
    pinned = device.type == "cuda"
    pool = device_pool(
        args, kv_dtype=kv_dtype, dtype=dtype, block_tokens=block_tokens, n_blocks=n_blocks, device=device
    )
    slots = host_slots(shape, n_blocks, pinned=pinned)
    identity = block_identity(args, kv_dtype=kv_dtype, dtype=dtype, block_tokens=block_tokens)
    paths = [
        block_file.block_path(disk_dir, hashlib.sha256(f"{block_tokens}-{i}".encode()).digest())
        for i in range(n_blocks)
    ]
    rows = []
    for tier, direction in DIRECTIONS:
        seconds, rse, disk = time_direction(
            direction,
            pool=pool,
            slots=slots,
            paths=paths,
            identity=identity,
            direct=direct,
            repeats=repeats,
            warmup_s=warmup_s,
        )
        total = shape.block_bytes * n_blocks
        rows.append(
            dict(
                tier=tier,
                direction=direction,
                block_tokens=block_tokens,
                block_bytes=shape.block_bytes,
                n_blocks=n_blocks,
                total_bytes=total,
                seconds=seconds,
                gbps=total / seconds / 1e9,
                gbps_rse=rse,  # the median seconds' relative spread is the GB/s figure's too
                repeats=repeats,
                pinned=pinned,
                same_memory=device.type == "cpu",
                direct_io=all(disk.direct_io) if tier == "disk" else None,
                cold_read=all(disk.cold) if direction == "read" else None,
                disk_dir=str(disk_dir) if tier == "disk" else None,
                filesystem=block_file.filesystem_type(disk_dir) if tier == "disk" else None,
            )
        )
        log.info("tiers: %s %s, %d-token blocks: %.3f GB/s", tier, direction, block_tokens, rows[-1]["gbps"])
    check_round_trip(paths, slots, identity)
    return rows


def run(
    *,
    model: str,
    kv_dtype: str,
    dtype: str,
    block_tokens: list[int],
    device: torch.device,
    total_bytes: int,
    repeats: int,
    disk_dir: Path,
    direct: bool,
    ceilings_used: ceilings.Ceilings,
    quick: bool = False,
) -> pd.DataFrame:
    """Every (tier, direction, block size) row (harness.store.tables.TIER_COLUMNS), beside `ceilings_used`.

    The block files go to a folder of their own under disk_dir, removed after the run, whatever happens."""
    args = ModelArgs.from_name(model)
    run_id = uuid.uuid4().hex[:12]
    started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    run_dir = Path(disk_dir) / f"run-{run_id}"
    run_dir.mkdir(parents=True, exist_ok=False)
    rows = []
    try:
        for tokens in block_tokens:
            rows += measure_block_size(
                args,
                kv_dtype=kv_dtype,
                dtype=dtype,
                block_tokens=tokens,
                device=device,
                total_bytes=total_bytes,
                repeats=repeats,
                disk_dir=run_dir,
                direct=direct,
                warmup_s=0.0 if quick else WARMUP_S,
            )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    common = dict(
        run_id=run_id,
        device=device.type,
        device_name=device_name(device),
        model=model,
        kv_dtype=kv_dtype,
        peak_read_bw_gbps=ceilings_used.read_bw_gbps,
        peak_copy_bw_gbps=ceilings_used.peak_bw_gbps,
        ceilings_fingerprint=ceilings_used.fingerprint,
        source=MEASURED,
        started_at=started_at,
    )
    return pd.DataFrame([common | row for row in rows])


def largest_block_figures(frame: pd.DataFrame) -> tuple[dict[str, float], int, bool]:
    """Ceilings.tier_gbps at the largest block size measured, its block bytes, and whether the disk used O_DIRECT."""
    largest = frame[frame["block_tokens"] == frame["block_tokens"].max()]
    gbps = {FIGURE_NAMES[row.direction]: float(row.gbps) for row in largest.itertuples()}
    disk = largest[largest["tier"] == "disk"]
    return gbps, int(largest["block_bytes"].iloc[0]), bool(disk["direct_io"].all())


def format_rows(frame: pd.DataFrame) -> str:
    """The rows as a table, with a line saying what the host figures are on this device."""
    from harness.store.summary import text_table

    shown = frame.assign(
        block_kib=frame["block_bytes"] / 2**10,
        gbps_spread=[
            f"{g:.3g} ± {r:.1%}" if math.isfinite(r) else f"{g:.3g}"
            for g, r in zip(frame["gbps"], frame["gbps_rse"], strict=True)
        ],
        ms=frame["seconds"] * 1e3,
    )
    columns = ["tier", "direction", "block_tokens", "block_kib", "n_blocks", "ms", "gbps_spread", "direct_io"]
    table = text_table(
        shown[[*columns, "cold_read"]].rename(columns={"gbps_spread": "GB/s"}),
        formatters={"block_kib": "{:.0f}".format, "ms": "{:.2f}".format},
        left=("tier", "direction"),
    )
    first = frame.iloc[0]
    if bool(first["same_memory"]):
        note = "cpu: the device and host tier are the same RAM, so d2h and h2d are memory copies (d2h: two)"
    else:
        note = f"{first['device_name']}: host tier page-locked; d2h/h2d cross the bus"
    disk = frame[frame["tier"] == "disk"].iloc[0]
    where = f"disk: {disk['disk_dir']} ({disk['filesystem']}), one file per block, reads cold"
    header = f"{first['model']} {first['kv_dtype']} blocks on {first['device_name']} ({first['device']})"
    return "\n".join([header, note, where, table])
