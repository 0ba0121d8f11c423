"""No cache: every decode step recomputes K and V for the whole prefix.

The O(n^2) baseline of the seed notes: step t costs a forward pass over t tokens, so time per output token
grows with the context, while memory for K/V is only transient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness import kv
from harness.errors import ConfigError, Unsupported
from harness.formats import QUANTIZED
from harness.kv import varlen
from harness.kv.base import CacheSpec, KVAllocation, Layout, Serving, attention


@dataclass(frozen=True)
class Options:
    """`none` takes no options."""


class NoCache(kv.KVCache):
    name: ClassVar[str] = "none"
    recomputes_prefix: ClassVar[bool] = True
    attn_backend: ClassVar[str] = "sdpa"
    prefix_hit: ClassVar[None] = None

    def __init__(self, spec: CacheSpec, options: Options) -> None:
        if spec.kv_dtype in QUANTIZED or (spec.dtype is not None and spec.kv_dtype != spec.dtype):
            raise Unsupported(f"none keeps no K/V between steps, so there is nothing to store as {spec.kv_dtype}")
        self.spec = spec

    def prepare(self, start_pos: int, n_new: int | None = None) -> None:
        if isinstance(start_pos, varlen.SeqBatch):  # serving
            raise Unsupported(
                "per-sequence lengths: none does not take them (it recomputes the whole sequence every step); allowed: contiguous, paged, prefix"
            )
        assert start_pos == 0, "without a cache every forward starts from position 0"

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        return attention(q, k, v, start_pos, impl=self.spec.attn_impl)

    def release(self) -> None:
        pass  # nothing is kept between steps: the base counts no tensors and no tokens, so every byte figure is 0


class NoCacheLayout(Layout):
    """Nothing is kept: no allocation, no read-back transients (the K/V are views of the forward's own), and a decode
    step is a forward over the whole sequence so far, so its activations and FLOPs grow with the context."""

    recomputes_prefix: ClassVar[bool] = True

    def allocation(self, shape) -> KVAllocation:
        return KVAllocation(0)

    def transients(self, shape, *, n_seqs: int, n_new: int, n_keys: int) -> tuple[int, int, int]:
        return 0, 0, 0

    def check(self, shape) -> None:
        if shape.kv_dtype != shape.dtype:
            raise ConfigError(
                f"kv_dtype: none keeps no K/V, so there is nothing to store as {shape.kv_dtype}; allowed: auto"
            )


STRATEGY = NoCache
LAYOUT = NoCacheLayout
SERVING = Serving.refused("it keeps no KV to serve from (every step recomputes the whole sequence)")
