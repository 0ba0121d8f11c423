"""Static per-sequence buffers, preallocated for prompt_len + gen_len (gpt-fast's KVCache).

Every sequence owns max_tokens slots from the start, used or not: simple and fast, and the over-reservation that
PagedAttention (Kwon et al. 2023) removes.

Quantized formats (harness.kv.quant) keep their narrow data in the same buffers and their scales in buffers of
their own, with a row per token (or per group of tokens, for int4 keys); a plain format reads back a slice of the
buffer, with no copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.kv.base import CacheSpec, attention, blocks_for
from harness.kv.quant import storage_format


@dataclass(frozen=True)
class Options:
    """`contiguous` takes no options: its size is the sweep point's prompt_len + gen_len."""


class ContiguousCache:
    name: ClassVar[str] = "contiguous"
    recomputes_prefix: ClassVar[bool] = False

    def __init__(self, spec: CacheSpec, options: Options) -> None:
        self.spec = spec
        self.format = storage_format(spec)
        parts = self.format.parts()
        data = parts.pop("data")
        lead = (spec.n_layers, spec.batch_size, spec.n_kv_heads)
        shape = (spec.n_layers, 2, spec.batch_size, spec.n_kv_heads, spec.max_tokens, data.width)
        # [L, K|V, B, H_kv, S_max, D] (int4: D / 2 bytes, two values each)
        self.buffers = torch.zeros(shape, dtype=data.dtype, device=spec.device)
        self.scales = {  # name -> [L, B, H_kv, S_max / tokens per row, width]; empty for plain formats
            name: torch.zeros(
                (*lead, blocks_for(spec.max_tokens, part.tokens), part.width), dtype=part.dtype, device=spec.device
            )
            for name, part in parts.items()
        }
        self.rows = {"k": self.buffers[:, 0], "v": self.buffers[:, 1], **self.scales}  # views, by part name
        self.n_tokens = 0

    def prepare(self, start_pos: int, n_new: int) -> None:
        if start_pos + n_new > self.spec.max_tokens:
            raise ValueError(f"contiguous cache holds {self.spec.max_tokens} tokens, asked for {start_pos + n_new}")
        self.n_tokens = start_pos + n_new

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        self._write(layer, k, v, start_pos)
        # Read only the filled part: decode attention costs what the context costs, not what was reserved.
        k_seq, v_seq = self._gather(layer, start_pos + k.shape[2], q.dtype)
        return attention(q, k_seq, v_seq, start_pos)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> None:
        self.format.write(self, layer, k, v, start_pos)

    def _gather(self, layer: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..end-1 as [B, H_kv, end, D] each, in dtype."""
        return self.format.read(self, layer, end, dtype)

    # harness.kv.quant.RowStore: a part's rows are its buffer's sequence axis.
    def put_rows(self, layer: int, name: str, x: torch.Tensor, first: int) -> None:
        self.rows[name][layer][:, :, first : first + x.shape[2]] = x

    def get_rows(self, layer: int, name: str, n: int) -> torch.Tensor:
        return self.rows[name][layer][:, :, :n]  # a view

    def release(self) -> None:
        self.n_tokens = 0  # the buffers stay reserved for the next batch, as in gpt-fast

    def kv_bytes_allocated(self) -> int:
        # Data, scales, and the int4 full-precision tail (format.tensors()).
        tensors = [self.buffers, *self.scales.values(), *self.format.tensors()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def kv_bytes_live(self) -> int:
        return int(self.n_tokens * self.spec.batch_size * self.spec.bytes_per_token)

    def kv_scale_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.scales.values())

    def kv_tail_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.format.tensors())


STRATEGY = ContiguousCache
