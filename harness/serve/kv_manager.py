"""KV block accounting for a serving engine: which request holds which blocks of a fixed pool, per strategy.

Pure bookkeeping, torch-free: no tensor is touched here. The engine sizes the pool from bytes (`num_blocks_for`:
fp8 or int8 KV gives about twice the blocks of bf16 at one budget; the dtype is not this module's concern), asks
the manager for a request's block table, and writes K/V there.

After vLLM v1 (vllm/v1/core/block_pool.py, kv_cache_manager.py, single_type_kv_cache_manager.py):
- `BlockPool` (harness.serve.block_pool): a free queue in LRU order (blocks freed go to its tail, new blocks come
  from its head), a ref count per block, and a map from block hash to cached block. A cached block whose ref count
  falls to 0 stays cached *and* free: it is reused on a hit, and evicted (its hash dropped) only when the head of
  the free queue hands it out.
- `PagedKVManager`: block tables grown as tokens arrive (`paged`), optionally with prefix caching (`prefix`, vLLM's
  enable_caching) or a sliding window (`sliding`, vLLM's SlidingWindowManager.remove_skipped_blocks).
- `ContiguousKVManager` (harness.serve.slot_manager): the pre-vLLM baseline (Orca, FasterTransformer): a slot of max_model_len tokens reserved
  per running request up front (Kwon et al. 2023, section 2.3: the reservation is the waste paging removes).

Every manager answers the same calls, the `KVManager` protocol the scheduler is typed against, and hands a
request's blocks across as a `KVCacheBlocks` value (vLLM v1's), never its own tables. `num_tokens` is always the
tokens a request holds K/V for once this iteration's tokens are computed (its computed tokens plus the new ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from harness.errors import ConfigError, KVPoolExhausted
from harness.serve.block_pool import BlockPool
from harness.serve.requests import Request

if TYPE_CHECKING:  # harness.kv imports torch; this module does not (see serving)
    from harness.kv.base import Serving


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens (harness.kv.base.blocks_for's, without importing torch)."""
    return math.ceil(num_tokens / block_size)


def num_blocks_for(kv_budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks a KV budget holds (vLLM's determine_available_memory // page_size_bytes)."""
    if not kv_budget_bytes > 0:
        raise ConfigError(f"kv_budget_bytes: must be > 0 bytes, got {kv_budget_bytes!r}")
    if not bytes_per_block > 0:
        raise ConfigError(f"bytes_per_block: must be > 0 bytes, got {bytes_per_block!r}")
    return int(kv_budget_bytes // bytes_per_block)


@dataclass(frozen=True)
class KVUsage:
    """The pool at one instant, for the per-iteration row. Blocks free include cached blocks no request holds
    (evictable, as vLLM's get_num_free_blocks counts them); tokens_live <= tokens_allocated, the gap being internal
    fragmentation (paged: the last block's tail; contiguous: the unreached part of every slot)."""

    blocks_used: int
    blocks_free: int
    blocks_cached: int  # prefix blocks kept in the cache, in use or not; 0 without prefix caching
    tokens_live: int  # tokens whose K/V a later query still reads, shared blocks counted once
    tokens_allocated: int  # blocks_used * block_size (contiguous: slots used * max_model_len)


@dataclass(frozen=True)
class KVCacheBlocks:
    """A request's blocks as the manager hands them to the scheduler (vLLM v1's KVCacheBlocks): its block table, a
    copy, and how many of its last blocks the allocation that returned it took new. A slot (contiguous) has none."""

    table: tuple[int | None, ...] = ()  # physical block per logical block, in order; None: freed by a window
    num_new: int = 0  # the last num_new blocks of `table` were taken by this allocation (0: a plain look-up)

    def get_block_ids(self) -> tuple[int | None, ...]:
        """The table a SeqBatch carries to the cache (harness.kv.varlen): None where a window freed the block."""
        return self.table

    @property
    def first_new(self) -> int:
        """The logical index of the first block taken new."""
        return len(self.table) - self.num_new

    @property
    def new_block_ids(self) -> tuple[int, ...]:
        """The blocks this allocation took new, in table order (vLLM's allocate_slots return); cached hits are not."""
        return tuple(block for block in self.table[self.first_new :] if block is not None)  # none is None

    def held(self, start: int = 0, stop: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(logical indices, blocks) of the blocks held among logical blocks [start, stop), in table order."""
        pairs = [(i, block) for i, block in enumerate(self.table[:stop]) if i >= start and block is not None]
        return tuple(i for i, _ in pairs), tuple(block for _, block in pairs)


class KVManager(Protocol):
    """What the scheduler asks of a pool's bookkeeping (vLLM v1's KVCacheManager: get_computed_blocks,
    allocate_slots, free, get_blocks, usage), whatever the strategy: blocks taken as a request grows
    (PagedKVManager) or a slot reserved whole (ContiguousKVManager)."""

    num_blocks: int
    block_size: int  # tokens per block

    @property
    def num_free_blocks(self) -> int: ...

    def cached_prefix_tokens(self, request: Request, num_tokens: int) -> int:
        """Tokens of a request not holding blocks yet that the cache already has (a prefix hit); 0 without one."""
        ...

    def can_allocate(
        self, request: Request, num_tokens: int, *, num_computed_tokens: int = 0, watermark_blocks: int = 0
    ) -> bool: ...

    def allocate(self, request: Request, num_tokens: int, *, num_computed_tokens: int = 0) -> KVCacheBlocks:
        """Grow the request to num_tokens tokens; returns its blocks, those taken new counted (num_new)."""
        ...

    def free(self, request_id: int) -> None: ...

    def get_blocks(self, request_id: int) -> KVCacheBlocks:
        """The request's blocks (none for a slot, or a request holding none), num_new 0."""
        ...

    def peak_blocks(self, num_tokens: int, *, max_chunk_tokens: int) -> int: ...

    def admission_blocks(self, prompt_len: int, *, max_chunk_tokens: int) -> int:
        """Blocks a request takes to be admitted, no prefix hit: its first chunk's, min(prompt_len, max_chunk_tokens)
        tokens, as the scheduler's admission allocates (harness.serve.concurrency's burst)."""
        ...

    def fits_alone(self, num_tokens: int, *, max_chunk_tokens: int, watermark_blocks: int) -> bool: ...

    def prefix_hit_tokens(self, request_id: int) -> int: ...

    def usage(self) -> KVUsage: ...


class PagedKVManager:
    """Block tables over one BlockPool: `paged`, `prefix` (prefix_caching) or `sliding` (sliding_window tokens).

    prefix: a request's first floor(prefix_len / block_size) blocks are its shared prefix. Every request's prefix
    tokens are the same system prompt (requests.py builds them so), so a block is keyed by its position in the
    prefix alone: vLLM's chained block hash reduces to ("prefix", index) here. A request whose prompt is known
    (block_hashes: a chat session's turn, harness.serve.multiturn) keys its whole prompt blocks by vLLM's chained
    hash instead, so a later turn finds the blocks of the history it repeats. A block is cached as soon as an
    iteration schedules its tokens (vLLM's cache_blocks in allocate_slots): the engine must write a block's K/V
    before a later request in the same iteration reads it, as one forward does layer by layer.

    sliding: a query at position i reads keys j with i - j < window (harness.kv.sliding's rule, no sinks). Before
    an iteration computes tokens [c, c + n), blocks wholly before c - window + 1 are freed (vLLM's
    remove_skipped_blocks), so a decoding request holds at most ceil(window / block_size) + 1 blocks, and one
    computing a chunk of n tokens at most ceil((window + n - 1) / block_size) + 1.
    """

    def __init__(
        self, *, num_blocks: int, block_size: int, prefix_caching: bool = False, sliding_window: int | None = None
    ) -> None:
        check_pool(num_blocks=num_blocks, block_size=block_size)
        if sliding_window is not None and (isinstance(sliding_window, bool) or not sliding_window >= 1):
            raise ConfigError(f"sliding_window: must be an integer >= 1 token, got {sliding_window!r}")
        if prefix_caching and sliding_window is not None:
            raise ConfigError("sliding_window: must be None with prefix_caching (a slid-off prefix is not shared)")
        self.pool = BlockPool(num_blocks=num_blocks, block_size=block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching, self.sliding_window = prefix_caching, sliding_window
        self.tables: dict[int, list[int | None]] = {}  # request id -> block per logical index; None: slid off
        self.num_tokens: dict[int, int] = {}  # request id -> tokens it holds K/V for
        self.hit_tokens: dict[int, int] = {}  # request id -> prefix tokens found cached at its first admission

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _prefix_blocks(self, request: Request, num_tokens: int) -> int:
        """Whole prefix blocks a request may share: at least one token is left to compute (vLLM recomputes the
        last one of a full hit, so that the forward yields logits)."""
        if not self.prefix_caching:
            return 0
        if request.block_hashes:  # a known prompt (a chat session's turn): any whole block of it, by content
            return min(len(request.block_hashes), (num_tokens - 1) // self.block_size)
        return min(request.prefix_len, num_tokens - 1) // self.block_size

    @staticmethod
    def _block_key(request: Request, index: int) -> object:
        return request.block_hashes[index] if request.block_hashes else ("prefix", index)

    def _cached_hits(self, request: Request, num_tokens: int) -> list[int]:
        """The cached blocks of the request's prefix, from its start up to the first miss."""
        hits = []
        for index in range(self._prefix_blocks(request, num_tokens)):
            block = self.pool.cached.get(self._block_key(request, index))
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix_tokens(self, request: Request, num_tokens: int) -> int:
        """Tokens of a request not holding blocks yet that the prefix cache already has (whole blocks)."""
        if request.request_id in self.tables:
            return 0
        return len(self._cached_hits(request, num_tokens)) * self.block_size

    def _first_kept_block(self, num_computed_tokens: int) -> int:
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _plan(self, request: Request, num_tokens: int, num_computed_tokens: int) -> tuple[list[int], int, int]:
        """(cached hits to touch, new blocks to take, blocks the window frees) for growing to num_tokens."""
        table = self.tables.get(request.request_id)
        if table is None:
            hits = self._cached_hits(request, num_tokens)
            skipped = max(len(hits), self._first_kept_block(num_computed_tokens))
            return hits, blocks_for(num_tokens, self.block_size) - skipped, 0
        held_tokens = self.num_tokens[request.request_id]
        first_kept = self._first_kept_block(held_tokens)
        slid_off = sum(1 for block in table[:first_kept] if block is not None)
        return [], blocks_for(num_tokens, self.block_size) - len(table), slid_off

    def can_allocate(
        self, request: Request, num_tokens: int, *, num_computed_tokens: int = 0, watermark_blocks: int = 0
    ) -> bool:
        """Whether growing to num_tokens fits and leaves watermark_blocks free (vLLM v0's can_allocate).
        num_computed_tokens: for a request holding no blocks, the tokens whose K/V it brings (prefix hits, or a
        swapped-out request's computed tokens, restored from the host); a window's table then starts at its
        first kept block, as it stood before the swap."""
        hits, new_blocks, slid_off = self._plan(request, num_tokens, num_computed_tokens)
        revived = sum(1 for block in hits if self.pool.ref_counts[block] == 0)  # leave the free queue on a hit
        return new_blocks + revived <= self.num_free_blocks + slid_off - watermark_blocks

    def allocate(self, request: Request, num_tokens: int, *, num_computed_tokens: int = 0) -> KVCacheBlocks:
        """Grow the request's table to hold num_tokens tokens (can_allocate first: KVPoolExhausted otherwise).
        Returns its blocks, the ones taken new (vLLM v1's allocate_slots) last; cached hits are not among those."""
        if not self.can_allocate(request, num_tokens, num_computed_tokens=num_computed_tokens):
            raise KVPoolExhausted(f"request {request.request_id}: no blocks for {num_tokens} tokens")
        hits, new_blocks, _ = self._plan(request, num_tokens, num_computed_tokens)
        rid = request.request_id
        if rid not in self.tables:
            self.pool.touch(hits)
            skipped = self._first_kept_block(num_computed_tokens) - len(hits)  # a window's, never with hits
            self.tables[rid], self.num_tokens[rid] = list(hits) + [None] * max(0, skipped), num_computed_tokens
            self.hit_tokens.setdefault(rid, len(hits) * self.block_size)  # its first admission only, as vLLM's
        table = self.tables[rid]
        first_kept = self._first_kept_block(self.num_tokens[rid])
        slid_off = [block for block in table[:first_kept] if block is not None]
        self.pool.free_blocks(slid_off[::-1])
        table[:first_kept] = [None] * first_kept
        taken = self.pool.get_new_blocks(new_blocks)
        table += taken
        self.num_tokens[rid] = max(num_tokens, self.num_tokens[rid])
        for index in range(self._prefix_blocks(request, num_tokens)):  # scheduled prefix blocks become hits
            self.pool.cache_block(table[index], self._block_key(request, index))
        return KVCacheBlocks(tuple(table), num_new=len(taken))

    def free(self, request_id: int) -> None:
        """Return a request's blocks (finished or preempted), its last block first (vLLM's free order)."""
        table = self.tables.pop(request_id, [])
        self.num_tokens.pop(request_id, None)
        self.pool.free_blocks([block for block in reversed(table) if block is not None])

    def get_blocks(self, request_id: int) -> KVCacheBlocks:
        """The request's physical block per logical block (None: slid out of the window)."""
        return KVCacheBlocks(tuple(self.tables.get(request_id, ())))

    def peak_blocks(self, num_tokens: int, *, max_chunk_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens ever holds, computing at most max_chunk_tokens at once."""
        whole = blocks_for(num_tokens, self.block_size)
        if self.sliding_window is None:
            return whole
        return min(whole, blocks_for(self.sliding_window + max_chunk_tokens - 1, self.block_size) + 1)

    def admission_blocks(self, prompt_len: int, *, max_chunk_tokens: int) -> int:
        """The first chunk's blocks: computed from position 0, so a window has freed none yet."""
        return blocks_for(min(prompt_len, max_chunk_tokens), self.block_size)

    def fits_alone(self, num_tokens: int, *, max_chunk_tokens: int, watermark_blocks: int) -> bool:
        """Whether a request of num_tokens tokens runs in the empty pool: its peak plus the watermark (vLLM v0's
        AllocStatus.NEVER is the opposite), so that admission alone never blocks the queue for good."""
        return self.peak_blocks(num_tokens, max_chunk_tokens=max_chunk_tokens) + watermark_blocks <= self.num_blocks

    def prefix_hit_tokens(self, request_id: int) -> int:
        return self.hit_tokens.get(request_id, 0)

    def usage(self) -> KVUsage:
        live_per_block: dict[int, int] = {}  # a shared block is counted once
        for rid, table in self.tables.items():
            num_tokens = self.num_tokens[rid]
            live_start = 0 if self.sliding_window is None else max(0, num_tokens - self.sliding_window + 1)
            for index, block in enumerate(table):
                if block is not None:
                    start, end = (
                        max(index * self.block_size, live_start),
                        min((index + 1) * self.block_size, num_tokens),
                    )
                    live_per_block[block] = max(live_per_block.get(block, 0), max(0, end - start))
        blocks_used = self.num_blocks - self.num_free_blocks
        return KVUsage(
            blocks_used=blocks_used,
            blocks_free=self.num_free_blocks,
            blocks_cached=len(self.pool.cached),
            tokens_live=sum(live_per_block.values()),
            tokens_allocated=blocks_used * self.block_size,
        )


def check_pool(*, num_blocks: int, block_size: int) -> None:
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")


def serving(strategy: str) -> Serving:
    """How `strategy` serves, as its module declares it (harness.kv.base.Serving): a one-line ConfigError for a
    strategy unknown or one that does not serve, with its reason and the strategies that do."""
    from harness import kv  # here, not at the top: the bookkeeping stays torch-free

    allowed = ", ".join(kv.serving_names())
    if strategy not in kv.strategy_names():
        raise ConfigError(f"strategy: unknown value {strategy!r}; allowed: {allowed}")
    declared = kv.serving(strategy)
    if not declared.serves:
        raise ConfigError(f"strategy: {strategy} does not serve: {declared.refusal}; allowed: {allowed}")
    return declared


def check_window(strategy: str, sliding_window: int | None) -> None:
    """sliding_window is set for a windowed strategy (its Serving.windowed) and for no other."""
    from harness import kv

    if serving(strategy).windowed != (sliding_window is not None):
        windowed = ", ".join(name for name in kv.serving_names() if kv.serving(name).windowed)
        raise ConfigError(f"sliding_window: must be set (tokens >= 1) for {windowed} only, got {sliding_window!r}")


def make_kv_manager(
    strategy: str,
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    sliding_window: int | None = None,
    budget: int | None = None,
) -> KVManager:
    """The manager of the pool `strategy` serves from (its Serving.pool), num_blocks blocks of block_size tokens;
    budget: the tokens a budgeted strategy's request holds at most (its cache.budget)."""
    declared = serving(strategy)
    check_window(strategy, sliding_window)
    if declared.budgeted != (budget is not None):
        raise ConfigError(f"budget: must be set (tokens >= 1) for a budgeted strategy only, got {budget!r}")
    if declared.budgeted:
        from harness.serve.evict_manager import BudgetKVManager  # it builds on PagedKVManager, here

        return BudgetKVManager(num_blocks=num_blocks, block_size=block_size, budget=budget)
    if not declared.paged:
        from harness.serve.slot_manager import ContiguousKVManager  # it answers this module's protocol, here

        return ContiguousKVManager(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)
    return PagedKVManager(
        num_blocks=num_blocks,
        block_size=block_size,
        prefix_caching=declared.shares_prefix,
        sliding_window=sliding_window,
    )
