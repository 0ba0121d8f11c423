"""Paged KV cache: a global pool of fixed-size blocks and a block table per sequence (vLLM's PagedAttention).

Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention". A sequence
takes a block only when it grows into it and returns all of them on completion, so the waste per sequence is at
most one partly filled block instead of everything reserved up to its maximum length. Paging cuts fragmentation,
not the total: the tokens present cost exactly what they cost in a contiguous buffer.

Attention follows the block table. Here (CPU, and any device without a paged kernel) it gathers the sequence's
blocks into a contiguous tensor first; a fused paged-attention kernel that reads blocks in place comes later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.kv.base import CacheSpec, KVPoolExhausted, attention, blocks_for


@dataclass(frozen=True)
class Options:
    block_size: int = 16  # tokens per block; vLLM's default on CUDA
    pool_tokens: int | None = None  # pool capacity in tokens; None: exactly what the sweep point needs at its peak

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"cache.block_size: must be a positive number of tokens, got {self.block_size}")
        if self.pool_tokens is not None and self.pool_tokens <= 0:
            raise ValueError(f"cache.pool_tokens: must be positive or null, got {self.pool_tokens}")


class PagedCache:
    name: ClassVar[str] = "paged"
    recomputes_prefix: ClassVar[bool] = False

    def __init__(self, spec: CacheSpec, options: Options) -> None:
        self.spec, self.block_size = spec, options.block_size
        blocks_per_seq = blocks_for(spec.max_tokens, self.block_size)
        if options.pool_tokens is None:
            n_blocks = spec.batch_size * blocks_per_seq
        else:
            n_blocks = blocks_for(options.pool_tokens, self.block_size)
        shape = (spec.n_layers, 2, n_blocks, spec.n_kv_heads, self.block_size, spec.head_dim)
        self.pool = torch.zeros(shape, dtype=spec.plain_dtype, device=spec.device)  # [L, K|V, N, H_kv, bs, D]
        self.free_blocks = list(range(n_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first
        self.tables: list[list[int]] = [[] for _ in range(spec.batch_size)]  # per sequence: block ids in order
        # The same tables on the device, for gathers: [B, blocks_per_seq]; refreshed only when a block is added.
        self.table = torch.zeros((spec.batch_size, blocks_per_seq), dtype=torch.long, device=spec.device)
        self.n_tokens = 0  # tokens present per sequence (all sequences of a batch move in step)

    def prepare(self, start_pos: int, n_new: int) -> None:
        need = blocks_for(start_pos + n_new, self.block_size)
        grown = False
        for blocks in self.tables:
            while len(blocks) < need:
                if not self.free_blocks:
                    raise KVPoolExhausted(
                        f"paged KV pool exhausted: {self.pool.shape[2]} blocks of {self.block_size} tokens "
                        f"cannot hold {self.spec.batch_size} sequences of {start_pos + n_new} tokens"
                    )
                blocks.append(self.free_blocks.pop())
                grown = True
        if grown:  # one small host-to-device copy every block_size steps, not every step
            rows = torch.tensor([b[:need] for b in self.tables], dtype=torch.long)
            if self.table.is_cuda:  # pinned + non_blocking: the copy queues on the stream, the host never waits
                rows = rows.pin_memory()
            self.table[:, :need].copy_(rows, non_blocking=True)
        self.n_tokens = start_pos + n_new

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        n_new = k.shape[2]
        end = start_pos + n_new
        k_pool, v_pool = self.pool[layer]  # [N, H_kv, bs, D] each
        # Scatter the new tokens: token at position p lives in block table[b, p // bs], slot p % bs.
        pos = torch.arange(start_pos, end, device=k.device)
        blocks = self.table[:, pos // self.block_size]  # [B, T]
        slots = (pos % self.block_size).expand_as(blocks)  # [B, T]
        k_pool[blocks, :, slots] = k.transpose(1, 2).to(k_pool.dtype)  # indexed view is [B, T, H_kv, D]
        v_pool[blocks, :, slots] = v.transpose(1, 2).to(v_pool.dtype)
        # Gather the sequence's blocks in table order: [B, nb, H_kv, bs, D] -> [B, H_kv, nb * bs, D] -> first `end`.
        n_blocks = blocks_for(end, self.block_size)
        table = self.table[:, :n_blocks]
        k_seq = self._contiguous(k_pool[table])[:, :, :end]
        v_seq = self._contiguous(v_pool[table])[:, :, :end]
        return attention(q, k_seq, v_seq, start_pos)

    @staticmethod
    def _contiguous(blocks: torch.Tensor) -> torch.Tensor:
        batch, n_blocks, heads, block_size, head_dim = blocks.shape
        return blocks.transpose(1, 2).reshape(batch, heads, n_blocks * block_size, head_dim)

    def release(self) -> None:
        """The batch completed: every block goes back to the pool."""
        for blocks in self.tables:
            self.free_blocks.extend(reversed(blocks))
            blocks.clear()
        self.n_tokens = 0

    def blocks_in_use(self) -> int:
        return sum(len(blocks) for blocks in self.tables)

    def kv_bytes_allocated(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def kv_bytes_live(self) -> int:
        return int(self.n_tokens * self.spec.batch_size * self.spec.bytes_per_token)

    def kv_scale_bytes(self) -> int:
        return 0  # plain dtypes only, for now


STRATEGY = PagedCache
