"""The tiers a prefix's KV blocks live in below device memory: a host tier and a disk tier, behind one store.

After LMCache's local backends (`local_cpu` within `max_local_cpu_size` GB; `local_disk`, one file per chunk, LRU
beyond `max_local_disk_size`) and NVIDIA Dynamo KVBM's G2 (host) and G3 (local SSD) tiers. Blocks move whole: one
block is every layer's K and V (and a quantized format's scales) for block_size tokens, as PagedCache.read_blocks
gives it, and every move is timed (`transfers`).

Keys: the hash chain the prefix cache computes (harness.kv.prefix.block_hashes; a block's key covers every token
before it, as vLLM's block hashes), so a key names the same tokens in every process and every run. The disk tier
files them under a digest of the block identity (the weights that computed them, the format, the shapes): two
models sharing a directory never meet, and each file's header repeats the identity, checked at every read with the
payload's checksum (harness.kv.block_file). A file that fails either check is a miss with a warning, and is deleted
so that the prefill computes and writes it again: never wrong KV.

Write-through (SGLang HiCache's `write_through` policy): blocks a prefill computed go to the host tier and to disk
at once, so that a later process finds them. A lookup walks host then disk and takes the longest leading run of
blocks found; a block read from disk is kept in the host tier too (a hierarchical cache promotes what it reads).

On the CPU the "device" and the host tier are the same RAM: a host-tier copy is a memory copy, not a bus transfer
(the tier rows say same_memory). Disk is real everywhere. On CUDA the host tier is page-locked, so that its copies
run at the bus's speed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.kv import block_file

log = logging.getLogger(__name__)

HOST, DISK = "host", "disk"
GB = 1e9  # the capacities are in GB = 1e9 bytes, as LMCache's max_local_*_size


@dataclass(frozen=True)
class Transfer:
    """One timed move: `n_bytes` of blocks between the device and a tier, or between the host and disk."""

    tier: str  # host or disk
    direction: str  # d2h, h2d (device <-> host tier), write, read (host <-> disk file)
    n_bytes: int
    seconds: float


def parts_bytes(parts: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in parts.values())


def synchronize(device: torch.device) -> None:
    """Wait for the device's copies before a transfer's clock stops (a seam: fake-CUDA tests replace it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def identity_digest(identity: dict) -> str:
    """16 hex digits naming a block identity: the disk tier's folder for it."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


class TieredStore:
    """A host tier of `host_bytes` and a disk tier of `disk_bytes` under `disk_dir`, for blocks of one identity."""

    def __init__(
        self,
        *,
        identity: dict,
        device: torch.device,
        host_bytes: int,
        disk_dir: str | Path | None,
        disk_bytes: int,
        direct_io: bool = True,
    ) -> None:
        self.identity, self.device = identity, device
        self.host_bytes, self.disk_bytes, self.direct_io = host_bytes, disk_bytes, direct_io
        self.root = Path(disk_dir) / identity_digest(identity) if disk_dir is not None else None
        self.host: OrderedDict[bytes, dict[str, torch.Tensor]] = OrderedDict()  # LRU order: oldest first
        self.host_used = 0
        self.transfers: list[Transfer] = []
        self.rejected: list[str] = []  # one line per refused block file
        self.enabled = True  # False: lookups and write-through are bypassed (a recompute, measured as such)

    @property
    def tiers(self) -> tuple[str, ...]:
        return (HOST,) * (self.host_bytes > 0) + (DISK,) * (self.root is not None)

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """For the duration, the store neither answers lookups nor stores: the prefix is recomputed."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def path(self, key: bytes) -> Path:
        assert self.root is not None, "no disk tier"
        return block_file.block_path(self.root, key)

    def _on_disk(self, key: bytes) -> bool:
        return self.root is not None and self.path(key).exists()

    # ------------------------------------------------------------------------------------------------------ store

    def save(self, keys: list[bytes], parts: dict[str, torch.Tensor]) -> None:
        """Write-through of blocks a prefill holds: parts [L, n, ...] on the device, block i under keys[i], into
        every tier that lacks it (the caller asked `missing`)."""
        if not self.enabled or not keys:
            return
        wrote = False
        for key, block in zip(keys, self._to_host(parts), strict=True):
            if DISK in self.tiers and not self._on_disk(key):
                self._write_file(key, block)
                wrote = True
            if HOST in self.tiers:
                self._host_insert(key, block)
        if wrote:
            self._trim_disk()  # once per save: it lists every file of the tier

    def missing(self, keys: list[bytes]) -> list[int]:
        """Indices of the keys some tier of this store lacks (none while the store is bypassed)."""
        if not self.enabled:
            return []
        host, disk = HOST in self.tiers, DISK in self.tiers
        return [i for i, key in enumerate(keys) if (host and key not in self.host) or (disk and not self._on_disk(key))]

    def _to_host(self, parts: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Each block's parts copied to host memory of its own (page-locked on CUDA), timed as one d2h."""
        pin = self.device.type == "cuda"
        start = time.perf_counter()
        blocks = []
        for i in range(next(iter(parts.values())).shape[1]):
            block = {}
            for name, tensor in parts.items():
                one = tensor[:, i : i + 1]
                # A copy even on the CPU, where .cpu() would alias the pool that the next batch overwrites.
                block[name] = torch.empty(one.shape, dtype=one.dtype, pin_memory=pin).copy_(one, non_blocking=pin)
            blocks.append(block)
        synchronize(self.device)
        n_bytes = sum(parts_bytes(block) for block in blocks)
        self.transfers.append(Transfer(HOST, "d2h", n_bytes, time.perf_counter() - start))
        return blocks

    def _host_insert(self, key: bytes, block: dict[str, torch.Tensor]) -> None:
        size = parts_bytes(block)
        if size > self.host_bytes:
            return
        if key in self.host:
            self.host_used -= parts_bytes(self.host.pop(key))
        while self.host_used + size > self.host_bytes:  # least recently used first
            _, evicted = self.host.popitem(last=False)
            self.host_used -= parts_bytes(evicted)
        self.host[key] = block
        self.host_used += size

    def _write_file(self, key: bytes, block: dict[str, torch.Tensor]) -> None:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        stats = block_file.write_block(path, block, identity=self.identity, direct=self.direct_io)
        self.transfers.append(Transfer(DISK, "write", stats.n_bytes, stats.seconds))

    def _trim_disk(self) -> None:
        """Delete the least recently used files (by mtime, which a read refreshes) beyond disk_bytes."""
        files = [(p.stat().st_mtime_ns, p.stat().st_size, p) for p in self.root.rglob(f"*{block_file.FILE_SUFFIX}")]
        used = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if used <= self.disk_bytes:
                break
            path.unlink(missing_ok=True)
            used -= size

    def drop_host(self) -> None:
        """Empty the host tier (what a new process starts with): the next lookup reads from disk."""
        self.host.clear()
        self.host_used = 0

    # ----------------------------------------------------------------------------------------------------- lookup

    def load(self, keys: list[bytes]) -> tuple[dict[str, torch.Tensor] | None, int, str | None]:
        """The longest leading run of `keys` held in a tier: (its parts [L, n, ...] on the device, n, the slowest
        tier it came from), or (None, 0, None). A refused file ends the run there (a miss with a warning)."""
        if not self.enabled:
            return None, 0, None
        blocks, slowest = [], None
        for key in keys:
            if key in self.host:
                self.host.move_to_end(key)
                blocks.append(self.host[key])
                slowest = slowest or HOST
                continue
            block = self._read_file(key) if self._on_disk(key) else None
            if block is None:
                break
            blocks.append(block)
            slowest = DISK
            if HOST in self.tiers:
                self._host_insert(key, block)
        if not blocks:
            return None, 0, None
        return self.to_device(blocks), len(blocks), slowest

    def fetch(self, key: bytes) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """One block on the host and the tier it came from: the host tier's, or a disk file's that passed both
        checks (then kept in the host tier too); (None, None) for a miss or a refused file."""
        if not self.enabled:
            return None, None
        if key in self.host:
            self.host.move_to_end(key)
            return self.host[key], HOST
        block = self._read_file(key) if self._on_disk(key) else None
        if block is None:
            return None, None
        if HOST in self.tiers:
            self._host_insert(key, block)
        return block, DISK

    def to_device(self, blocks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Host blocks as parts [L, n, ...] on the device, timed as one h2d."""
        start = time.perf_counter()
        non_blocking = self.device.type == "cuda"
        parts = {
            name: torch.cat([block[name] for block in blocks], dim=1).to(self.device, non_blocking=non_blocking)
            for name in blocks[0]
        }
        synchronize(self.device)
        self.transfers.append(Transfer(HOST, "h2d", parts_bytes(parts), time.perf_counter() - start))
        return parts

    def _read_file(self, key: bytes) -> dict[str, torch.Tensor] | None:
        path = self.path(key)
        try:
            block, stats = block_file.read_block(path, identity=self.identity, direct=self.direct_io)
        except block_file.BlockRejected as exc:
            log.warning("%s; the prefix is recomputed from this block on", exc)
            self.rejected.append(str(exc))
            path.unlink(missing_ok=True)  # the prefill writes it again, right
            return None
        os.utime(path)  # recently used: the last file the disk tier's LRU deletes
        self.transfers.append(Transfer(DISK, "read", stats.n_bytes, stats.seconds))
        return block
