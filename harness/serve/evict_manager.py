"""The KV manager of a budgeted strategy (harness.kv.base.Serving.budgeted: `evict`): block tables capped at the
blocks of `budget` tokens per request.

The cache (harness.kv.evict_paged) holds at most `budget` tokens of a request, per layer and KV head, in slots
0..budget-1 of its first ceil(budget / block_size) blocks; a token it evicts leaves a slot the next kept token takes.
A prefill chunk's K/V are the forward's activations until the cache keeps its budget of them, never pool blocks. So
a request holding K/V for num_tokens tokens holds min(num_tokens, budget) of them, in

    blocks_for(min(num_tokens, budget), block_size)

blocks, at every instant: it grows as `paged` until it reaches the budget, and then never again. That is where the
pages of evicted tokens come back: a request past its budget takes none (paged's keeps growing by one every
block_size tokens), so more requests fit in one pool, each freeing its whole cap at completion or preemption. Torch-
free bookkeeping, as harness.serve.kv_manager: PagedKVManager's tables over its BlockPool, with every token count a
request asks for capped at the budget (no prefix sharing, no window).
"""

from __future__ import annotations

from harness.errors import ConfigError
from harness.serve.kv_manager import KVCacheBlocks, PagedKVManager, blocks_for
from harness.serve.requests import Request


class BudgetKVManager(PagedKVManager):
    """PagedKVManager over num_blocks blocks whose requests hold at most `budget` tokens each."""

    def __init__(self, *, num_blocks: int, block_size: int, budget: int) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ConfigError(f"cache.budget: must be an integer >= 1 token, got {budget!r}")
        super().__init__(num_blocks=num_blocks, block_size=block_size)
        self.budget = budget
        self.cap_blocks = blocks_for(budget, block_size)  # the most blocks one request ever holds

    def held_tokens(self, num_tokens: int) -> int:
        """Tokens the cache holds of a request that has seen num_tokens: at most the budget."""
        return min(num_tokens, self.budget)

    def can_allocate(
        self, request: Request, num_tokens: int, *, num_computed_tokens: int = 0, watermark_blocks: int = 0
    ) -> bool:
        return super().can_allocate(request, self.held_tokens(num_tokens),
                                    num_computed_tokens=self.held_tokens(num_computed_tokens),
                                    watermark_blocks=watermark_blocks)  # fmt: skip

    def allocate(self, request: Request, num_tokens: int, *, num_computed_tokens: int = 0) -> KVCacheBlocks:
        """Grow the request's table to the blocks of min(num_tokens, budget) tokens; past the budget it takes none
        (num_new 0), its evicted tokens' slots taking the new ones."""
        return super().allocate(request, self.held_tokens(num_tokens),
                                num_computed_tokens=self.held_tokens(num_computed_tokens))  # fmt: skip

    def peak_blocks(self, num_tokens: int, *, max_chunk_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens ever holds: its tokens', capped at the budget's, whatever
        its chunks (a chunk's K/V never take pool blocks)."""
        return blocks_for(self.held_tokens(num_tokens), self.block_size)

    def admission_blocks(self, prompt_len: int, *, max_chunk_tokens: int) -> int:
        """Blocks a request takes to be admitted: its first scheduled chunk's (at most max_chunk_tokens of its
        prompt), capped at the budget's. The chunk the scheduler gives it can be shorter (tokens left after the
        running requests'): this is the most."""
        return blocks_for(self.held_tokens(min(prompt_len, max_chunk_tokens)), self.block_size)
