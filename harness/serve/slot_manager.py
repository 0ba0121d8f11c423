"""The pre-vLLM baseline's KV accounting (Orca, FasterTransformer): a slot of max_model_len tokens reserved whole per
running request at admission (Kwon et al. 2023, section 2.3: the reservation is the waste paging removes), answering
the KVManager protocol of harness.serve.kv_manager, whose make_kv_manager builds it for a slots pool (`contiguous`).
Torch-free bookkeeping, as that module.
"""

from __future__ import annotations

from harness.errors import KVPoolExhausted
from harness.serve.kv_manager import KVCacheBlocks, KVUsage, blocks_for, check_pool
from harness.serve.requests import Request


class ContiguousKVManager:
    """One slot of max_model_len tokens per running request, reserved whole at admission; slots =
    (num_blocks * block_size) // max_model_len, the budget's tokens cut into maximal requests. A slot never grows,
    so the watermark (headroom for growth) does not apply, and a request admitted is never preempted."""

    def __init__(self, *, num_blocks: int, block_size: int, max_model_len: int) -> None:
        check_pool(num_blocks=num_blocks, block_size=block_size)
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.num_slots = num_blocks * block_size // max_model_len
        self.num_tokens: dict[int, int] = {}  # request id -> tokens it holds K/V for, in its slot

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - blocks_for(len(self.num_tokens) * self.max_model_len, self.block_size)

    def cached_prefix_tokens(self, request: Request, num_tokens: int) -> int:
        return 0

    def can_allocate(
        self, request: Request, num_tokens: int, *, num_computed_tokens: int = 0, watermark_blocks: int = 0
    ) -> bool:
        if num_tokens > self.max_model_len:
            return False
        return request.request_id in self.num_tokens or len(self.num_tokens) < self.num_slots

    def allocate(self, request: Request, num_tokens: int, *, num_computed_tokens: int = 0) -> KVCacheBlocks:
        """A slot, taken whole at admission: no blocks (the engine addresses slots by index)."""
        if not self.can_allocate(request, num_tokens):
            raise KVPoolExhausted(f"request {request.request_id}: no free slot of {self.max_model_len} tokens")
        self.num_tokens[request.request_id] = max(num_tokens, self.num_tokens.get(request.request_id, 0))
        return KVCacheBlocks()

    def free(self, request_id: int) -> None:
        self.num_tokens.pop(request_id, None)

    def get_blocks(self, request_id: int) -> KVCacheBlocks:
        return KVCacheBlocks()  # a slot is addressed by its index in the engine, not by blocks

    def peak_blocks(self, num_tokens: int, *, max_chunk_tokens: int) -> int:
        return blocks_for(self.max_model_len, self.block_size)  # the whole slot, whatever the request's length

    def admission_blocks(self, prompt_len: int, *, max_chunk_tokens: int) -> int:
        return blocks_for(self.max_model_len, self.block_size)  # the whole slot, reserved at admission

    def fits_alone(self, num_tokens: int, *, max_chunk_tokens: int, watermark_blocks: int) -> bool:
        return self.num_slots >= 1 and num_tokens <= self.max_model_len

    def prefix_hit_tokens(self, request_id: int) -> int:
        return 0

    def usage(self) -> KVUsage:
        tokens_allocated = len(self.num_tokens) * self.max_model_len
        return KVUsage(
            blocks_used=self.num_blocks - self.num_free_blocks,
            blocks_free=self.num_free_blocks,
            blocks_cached=0,
            tokens_live=sum(self.num_tokens.values()),
            tokens_allocated=tokens_allocated,
        )
