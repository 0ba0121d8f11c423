"""The tensors behind a serving prefix cache's tiers (harness.serve.tiered): a TieredStore (harness.kv.tiers, the
static prefix cache's store) answering the manager's lookups, and one iteration's moves run on the pool.

Keys: a chat turn's block hash (harness.serve.block_pool.hash_blocks: a 64-bit int, the same in every process) as
8 bytes; the store files them under the block identity (the weights, the format, the shapes), so a disk tier
shared by two models never mixes them.

Loads, with `overlap` (tier_overlap, harness.serve.tier_loader): a request's disk blocks are prefetched by a loader
thread from its arrival, checksums checked there, and an iteration's loads go into the pool layer by layer while
the forward runs (the forward's attention waits per layer, PagedCache.wait_layer). Without it they are synchronous,
as before: a disk file read and checked at the lookup, every block copied in before the forward (and read again at
the next lookup when its request was not admitted; with overlap the verified copy stays staged until the request is
admitted). Either way a lookup counts a block only once it has passed its checksum. Both are timed: `load_times` (the loads' own seconds, and those
the forward and the lookups waited for them), the run row's tier_load_s and tier_load_hidden_s.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable

import torch

from harness.kv import tiers
from harness.kv.paged import PagedCache
from harness.kv.tiers import DISK, HOST
from harness.serve.tier_loader import BACKGROUND, LayerLoads, Loader, LoadTimes, Prefetch, read_task
from harness.serve.tiered import TierMoves, TierOptions

DIRECTIONS = {"d2h": "tier_d2h_gbps", "h2d": "tier_h2d_gbps", "write": "tier_disk_write_gbps",
              "read": "tier_disk_read_gbps"}  # fmt: skip


def key_bytes(block_hash: object) -> bytes:
    """A block hash as the store's key."""
    return int(block_hash).to_bytes(8, "little", signed=True)


class ServeTiers:
    """The manager's TierIndex over a TieredStore, and the engine's copies between it and the pool."""

    def __init__(self, store: tiers.TieredStore, *, overlap: bool = False) -> None:
        self.store, self.overlap = store, overlap
        # What this iteration's lookups found, on the host: held here from the lookup to the load, so that neither
        # the host tier's LRU (the same iteration's offloads go in first) nor a file changing between can take it.
        self.fetched: dict[bytes, tuple[dict[str, torch.Tensor], str]] = {}
        self.load_times = LoadTimes()
        self.loader = Loader(self.load_times) if overlap else None
        if self.loader is not None:
            weakref.finalize(self, self.loader.close)  # the thread ends with the run's tiers
        self.prefetched: dict[bytes, Prefetch] = {}  # disk blocks read ahead for waiting requests, by key
        self.watched: set[bytes] = set()  # waiting requests' blocks held elsewhere for now (prefetch)
        self.prefetch_used = 0  # lookups served by a finished prefetch: the overlap path taken
        self.layered_loads = 0  # iterations whose loads went in layer by layer
        self.timed_on_device: list[LayerLoads] = []  # CUDA: layer loads whose copy time is read at the end
        self.resident: Callable[[object], bool] = lambda block_hash: False  # the device pool's (bind_device)
        self.stream = torch.cuda.Stream(store.device) if overlap and store.device.type == "cuda" else None

    @classmethod
    def build(cls, options: TierOptions, *, cache: PagedCache, model_id: str, overlap: bool = False) -> ServeTiers:
        """The store for `cache`'s blocks computed by the weights `model_id` names (harness.run.point.model_id)."""
        from harness.kv.prefix import block_identity

        spec = dataclasses.replace(cache.spec, model_id=model_id)
        store = tiers.TieredStore(identity=block_identity(spec, cache), device=cache.spec.device,
                                  host_bytes=int(options.host_gb * tiers.GB), disk_dir=options.disk_dir,
                                  disk_bytes=int(options.disk_gb * tiers.GB))  # fmt: skip
        return cls(store, overlap=overlap)

    def bind_device(self, resident: Callable[[object], bool]) -> None:
        """resident(block_hash): the device pool holds it (the manager's), so a prefetch skips it."""
        self.resident = resident

    def _read(self, key: bytes) -> dict[str, torch.Tensor] | None:
        """A disk block file read and checked (a refused one is deleted, a miss); one gone meanwhile is a miss."""
        try:
            return self.store._read_file(key)
        except FileNotFoundError:  # the disk tier's LRU deleted it between the check and the read
            return None

    def prefetch(self, block_hashes) -> list[bytes]:
        """With overlap: a new request's prompt blocks that only the disk tier holds are queued for the loader to
        read while the request waits; the others it may need (on the device or the host tier now) are watched, and
        queued when an offload puts them on disk (`_watch`). Returns every key named, for `release`."""
        if self.loader is None or not block_hashes or DISK not in self.store.tiers or not self.store.enabled:
            return []
        keys = [key_bytes(block_hash) for block_hash in block_hashes]
        for block_hash, key in zip(block_hashes, keys, strict=True):
            if key in self.prefetched:
                continue
            if not self.resident(block_hash) and key not in self.store.host and self.store._on_disk(key):
                self._queue(key)
            else:
                self.watched.add(key)
        return keys

    def _queue(self, key: bytes) -> None:
        self.watched.discard(key)
        self.prefetched[key] = prefetch = Prefetch(key)
        self.loader.submit(BACKGROUND, read_task(prefetch, self._read, pin=self.store.device.type == "cuda"))

    def _watch(self, offloaded: list[bytes]) -> None:
        """After an offload: a watched block now on disk alone (no host tier holds it) is read back ahead of use."""
        for key in offloaded:
            if key in self.watched and key not in self.store.host and self.store._on_disk(key):
                self._queue(key)

    def release(self, keys: list[bytes]) -> None:
        """A request admitted: its prefetches not used by its lookup are dropped (cancelled if not yet started)."""
        for key in keys:
            self.watched.discard(key)
            prefetch = self.prefetched.pop(key, None)
            if prefetch is not None:
                prefetch.claim("cancelled")

    def _fetch_prefetched(self, key: bytes) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """A lookup's disk block through its prefetch: done (verified), in flight (waited for), or not started (read
        here, the loader's task then skips it). A read here or waited for is load time not hidden."""
        prefetch = self.prefetched.pop(key)
        if prefetch.claim("taken"):
            start = time.perf_counter()
            block = self._read(key)
            elapsed = time.perf_counter() - start
            self.load_times.inline_s += elapsed
        else:
            self.prefetch_used += prefetch.done.is_set()
            block = prefetch.result(self.load_times)
        if block is None:
            return None, None
        if HOST in self.store.tiers:
            self.store._host_insert(key, block)  # promoted, as TieredStore.fetch promotes what it reads
        return block, DISK

    def source(self, block_hash: object) -> str | None:
        key = key_bytes(block_hash)
        if key not in self.fetched:
            if key in self.prefetched and key not in self.store.host:
                block, source = self._fetch_prefetched(key)
            else:  # a disk file is read and checked now (timed, not hidden): a refused one is a miss
                start = time.perf_counter()
                block, source = self.store.fetch(key)
                if source == DISK:
                    elapsed = time.perf_counter() - start
                    self.load_times.inline_s += elapsed
            if block is None:
                return None
            self.fetched[key] = (block, source)
        return self.fetched[key][1]

    def apply(self, cache: PagedCache, moves: TierMoves) -> None:
        """Before the forward: the evicted blocks into the tiers (their K/V still there), then the loads into the
        blocks taken for them (an evicted block may be one). An iteration that preempts admits nobody, so a swap
        (the engine's) and a load never touch the same iteration."""
        loads = [(block, self.fetched[key_bytes(block_hash)][0]) for block, block_hash, _ in moves.load]
        if moves.offload:
            keys = [key_bytes(block_hash) for _, block_hash in moves.offload]
            missing = self.store.missing(keys)  # a block loaded back and evicted again is stored already
            if missing:
                parts = cache.read_blocks([moves.offload[i][0] for i in missing])
                self.store.save([keys[i] for i in missing], parts)
            self._watch(keys)
        if self.overlap:  # a verified disk block a lookup found but did not load stays staged for its next lookup
            loaded = {key_bytes(block_hash) for _, block_hash, _ in moves.load}
            for key, (block, source) in self.fetched.items():
                if source == DISK and key not in loaded and key not in self.prefetched:
                    self.prefetched[key] = Prefetch.staged(key, block)
        self.fetched.clear()  # a lookup not admitted this iteration fetches again at its next one
        if not loads:
            return
        if self.overlap:  # layer by layer behind the forward: its attention waits per layer (PagedCache.wait_layer)
            cache.layer_loads = LayerLoads(cache, [block for block, _ in loads], [block for _, block in loads],
                                           self.load_times)  # fmt: skip
            cache.layer_loads.start(self.loader, stream=self.stream)
            self.layered_loads += 1
            return
        start = time.perf_counter()
        cache.write_blocks([block for block, _ in loads], self.store.to_device([block for _, block in loads]))
        elapsed = time.perf_counter() - start  # the h2d copy (to_device) and the pool's writes, all on the path
        self.load_times.inline_s += elapsed

    def finish(self, cache: PagedCache) -> None:
        """After the forward: the layer loads are all in (each layer's wait ran), timed as one h2d transfer."""
        loads = cache.layer_loads
        if loads is None:
            return
        cache.layer_loads = None
        loads.finish()
        if loads.events:  # CUDA: the copies' time is read at the run's end (run_columns), not synced for now
            self.timed_on_device.append(loads)
        else:
            self.store.transfers.append(tiers.Transfer(HOST, "h2d", loads.n_bytes, loads.copy_seconds()))

    def run_columns(self) -> dict:
        """Bytes into and out of the tiers, and the GB/s of each direction's timed copies (null: none ran)."""
        for loads in self.timed_on_device:
            self.store.transfers.append(tiers.Transfer(HOST, "h2d", loads.n_bytes, loads.copy_seconds()))
        self.timed_on_device.clear()
        transfers = self.store.transfers
        columns: dict = {
            "tier_offloaded_bytes": sum(t.n_bytes for t in transfers if t.direction == "d2h"),
            "tier_loaded_bytes": sum(t.n_bytes for t in transfers if t.direction == "h2d"),
            "tier_rejected_blocks": len(self.store.rejected),
            "tier_overlap": self.overlap,
            "tier_load_s": self.load_times.busy_s,
            "tier_load_hidden_s": self.load_times.hidden_s,
            "tier_load_hidden_share": self.load_times.hidden_s / self.load_times.busy_s
            if self.load_times.busy_s > 0
            else None,
        }
        for direction, name in DIRECTIONS.items():
            moved = [t for t in transfers if t.direction == direction]
            seconds = sum(t.seconds for t in moved)
            columns[name] = sum(t.n_bytes for t in moved) / seconds / 1e9 if seconds > 0 else None
        return columns
