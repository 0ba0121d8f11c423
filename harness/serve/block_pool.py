"""The pool a paged KV manager takes its blocks from (vLLM v1's vllm/v1/core/block_pool.py): a free queue in LRU
order, a ref count per block, and a map from block hash to cached block. Torch-free bookkeeping, as
harness.serve.kv_manager, which keeps the block tables over it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from harness.errors import KVPoolExhausted


def hash_blocks(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """One hash per whole block of token_ids, each over its parent's hash and its own ids (vLLM v1's chained
    hash_block_tokens): equal hashes mean equal tokens from the sequence's start, so a block is shared only where
    the whole prefix before it matches. Python's hash of a tuple of ints is the same in every process."""
    hashes, parent = [], 0  # not None: its hash is its address before Python 3.12
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, *token_ids[start : start + block_size]))
        hashes.append(parent)
    return tuple(hashes)


class BlockPool:
    """num_blocks blocks of block_size tokens: a free queue (LRU order), ref counts and the prefix-cache map."""

    def __init__(self, *, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = evicted first
        self.block_hash: dict[int, object] = {}  # block id -> its hash, for cached blocks only
        self.cached: dict[object, int] = {}  # hash -> block id (vLLM's cached_block_hash_to_block)
        self.num_evictions = 0
        # A list: each eviction's (block, hash) is appended, for the tiers to copy out before the block is reused
        # (harness.serve.tiered); None: evicted blocks are simply dropped.
        self.evicted: list[tuple[int, object]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, count: int) -> list[int]:
        """count blocks off the free queue's head, ref count 1; a cached block taken this way is evicted."""
        if count > len(self.free_queue):
            raise KVPoolExhausted(f"KV pool: {count} blocks asked, {len(self.free_queue)} free")
        blocks = []
        for _ in range(count):
            block, _ = self.free_queue.popitem(last=False)
            if block in self.block_hash:  # vLLM's _maybe_evict_cached_block
                block_hash = self.block_hash.pop(block)
                del self.cached[block_hash]
                self.num_evictions += 1
                if self.evicted is not None:
                    self.evicted.append((block, block_hash))
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """One more holder for each (cached) block; a free one leaves the free queue."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def free_blocks(self, blocks: list[int]) -> None:
        """One holder fewer for each; at 0 a block goes to the free queue's tail (kept cached if it was).
        The caller passes a table tail first, as vLLM does, so that a prefix's last blocks are evicted first."""
        for block in blocks:
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed more often than taken"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def cache_block(self, block: int, block_hash: object) -> None:
        if block_hash not in self.cached and block not in self.block_hash:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash
