"""The tensors behind a serving prefix cache's tiers (harness.serve.tiered): a TieredStore (harness.kv.tiers, the
static prefix cache's store) answering the manager's lookups, and one iteration's moves run on the pool.

Keys: a chat turn's block hash (harness.serve.block_pool.hash_blocks: a 64-bit int, the same in every process) as
8 bytes; the store files them under the block identity (the weights, the format, the shapes), so a disk tier
shared by two models never mixes them. Loads are synchronous and timed (the store's transfers); overlapping them
with the forward, as vLLM's connector does on its own stream, is left for later.
"""

from __future__ import annotations

import dataclasses

import torch

from harness.kv import tiers
from harness.kv.paged import PagedCache
from harness.serve.tiered import TierMoves, TierOptions

DIRECTIONS = {"d2h": "tier_d2h_gbps", "h2d": "tier_h2d_gbps", "write": "tier_disk_write_gbps",
              "read": "tier_disk_read_gbps"}  # fmt: skip


def key_bytes(block_hash: object) -> bytes:
    """A block hash as the store's key."""
    return int(block_hash).to_bytes(8, "little", signed=True)


class ServeTiers:
    """The manager's TierIndex over a TieredStore, and the engine's copies between it and the pool."""

    def __init__(self, store: tiers.TieredStore) -> None:
        self.store = store
        # What this iteration's lookups found, on the host: held here from the lookup to the load, so that neither
        # the host tier's LRU (the same iteration's offloads go in first) nor a file changing between can take it.
        self.fetched: dict[bytes, tuple[dict[str, torch.Tensor], str]] = {}

    @classmethod
    def build(cls, options: TierOptions, *, cache: PagedCache, model_id: str) -> ServeTiers:
        """The store for `cache`'s blocks computed by the weights `model_id` names (harness.run.point.model_id)."""
        from harness.kv.prefix import block_identity

        spec = dataclasses.replace(cache.spec, model_id=model_id)
        store = tiers.TieredStore(identity=block_identity(spec, cache), device=cache.spec.device,
                                  host_bytes=int(options.host_gb * tiers.GB), disk_dir=options.disk_dir,
                                  disk_bytes=int(options.disk_gb * tiers.GB))  # fmt: skip
        return cls(store)

    def source(self, block_hash: object) -> str | None:
        key = key_bytes(block_hash)
        if key not in self.fetched:
            block, source = self.store.fetch(key)  # a disk file is read and checked now: a refused one is a miss
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
        if loads:
            cache.write_blocks([block for block, _ in loads], self.store.to_device([block for _, block in loads]))
        self.fetched.clear()  # a lookup not admitted this iteration fetches again at its next one

    def run_columns(self) -> dict:
        """Bytes into and out of the tiers, and the GB/s of each direction's timed copies (null: none ran)."""
        transfers = self.store.transfers
        columns: dict = {
            "tier_offloaded_bytes": sum(t.n_bytes for t in transfers if t.direction == "d2h"),
            "tier_loaded_bytes": sum(t.n_bytes for t in transfers if t.direction == "h2d"),
            "tier_rejected_blocks": len(self.store.rejected),
        }
        for direction, name in DIRECTIONS.items():
            moved = [t for t in transfers if t.direction == direction]
            seconds = sum(t.seconds for t in moved)
            columns[name] = sum(t.n_bytes for t in moved) / seconds / 1e9 if seconds > 0 else None
        return columns
