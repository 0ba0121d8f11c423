"""No cache: every decode step recomputes K and V for the whole prefix.

The O(n^2) baseline of the seed notes: step t costs a forward pass over t tokens, so time per output token
grows with the context, while memory for K/V is only transient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.errors import Unsupported
from harness.kv.base import CacheSpec, attention
from harness.kv.quant import QUANTIZED


@dataclass(frozen=True)
class Options:
    """`none` takes no options."""


class NoCache:
    name: ClassVar[str] = "none"
    recomputes_prefix: ClassVar[bool] = True

    def __init__(self, spec: CacheSpec, options: Options) -> None:
        if spec.kv_dtype in QUANTIZED or (spec.dtype is not None and spec.kv_dtype != spec.dtype):
            raise Unsupported(f"none keeps no K/V between steps, so there is nothing to store as {spec.kv_dtype}")
        self.spec = spec

    def prepare(self, start_pos: int, n_new: int) -> None:
        assert start_pos == 0, "without a cache every forward starts from position 0"

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        return attention(q, k, v, start_pos)

    def release(self) -> None:
        pass

    def kv_bytes_allocated(self) -> int:
        return 0  # nothing is kept between steps

    def kv_bytes_live(self) -> int:
        return 0

    def kv_scale_bytes(self) -> int:
        return 0

    def kv_tail_bytes(self) -> int:
        return 0


STRATEGY = NoCache
