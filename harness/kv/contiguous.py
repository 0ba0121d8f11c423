"""Static per-sequence buffers, preallocated for prompt_len + gen_len (gpt-fast's KVCache).

Every sequence owns max_tokens slots from the start, used or not: simple and fast, and the over-reservation that
PagedAttention (Kwon et al. 2023) removes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.kv.base import CacheSpec, attention


@dataclass(frozen=True)
class Options:
    """`contiguous` takes no options: its size is the sweep point's prompt_len + gen_len."""


class ContiguousCache:
    name: ClassVar[str] = "contiguous"
    recomputes_prefix: ClassVar[bool] = False

    def __init__(self, spec: CacheSpec, options: Options) -> None:
        self.spec = spec
        shape = (spec.n_layers, 2, spec.batch_size, spec.n_kv_heads, spec.max_tokens, spec.head_dim)
        self.buffers = torch.zeros(shape, dtype=spec.plain_dtype, device=spec.device)  # [L, K|V, B, H_kv, S_max, D]
        self.n_tokens = 0

    def prepare(self, start_pos: int, n_new: int) -> None:
        if start_pos + n_new > self.spec.max_tokens:
            raise ValueError(f"contiguous cache holds {self.spec.max_tokens} tokens, asked for {start_pos + n_new}")
        self.n_tokens = start_pos + n_new

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        end = start_pos + k.shape[2]
        k_buf, v_buf = self.buffers[layer]  # [B, H_kv, S_max, D] each
        k_buf[:, :, start_pos:end] = k
        v_buf[:, :, start_pos:end] = v
        # Read only the filled part: decode attention costs what the context costs, not what was reserved.
        return attention(q, k_buf[:, :, :end], v_buf[:, :, :end], start_pos)

    def release(self) -> None:
        self.n_tokens = 0  # the buffers stay reserved for the next batch, as in gpt-fast

    def kv_bytes_allocated(self) -> int:
        return self.buffers.numel() * self.buffers.element_size()

    def kv_bytes_live(self) -> int:
        return int(self.n_tokens * self.spec.batch_size * self.spec.bytes_per_token)

    def kv_scale_bytes(self) -> int:
        return 0  # plain dtypes only, for now


STRATEGY = ContiguousCache
