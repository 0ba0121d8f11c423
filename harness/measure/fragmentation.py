"""How much KV memory an allocator wastes when requests have mixed lengths (`lengths=mixed`).

Kwon et al. 2023 (PagedAttention, section 3 and figure 2) found that existing systems kept only 20-38% of their
KV memory in use: each request reserved the maximum length up front, so most of it sat empty. Paging allocates a
block at a time, so a request wastes at most one partly filled block.

A mixed-length point draws each request's prompt and generation length from a seeded uniform distribution over
[min_len_frac, 1] of prompt_len and gen_len, builds the real cache for that batch, grows every sequence to its
own final length, and reads the bytes from the cache's tensors at that peak. It measures allocation, not speed:
its latency columns are null.
"""

from __future__ import annotations

import random

from harness.config import RunConfig
from harness.kv.base import CacheSpec


def request_lengths(cfg: RunConfig) -> list[int]:
    """Final length (prompt + generated tokens) of each of the batch's requests, seeded."""
    rng = random.Random(cfg.seed)

    def draw(maximum: int) -> int:
        return rng.randint(max(1, round(cfg.min_len_frac * maximum)), maximum)

    return [draw(cfg.prompt_len) + draw(cfg.gen_len) for _ in range(cfg.batch_size)]


def waste_columns(cfg: RunConfig, spec: CacheSpec) -> dict:
    """Allocated and live KV bytes at the batch's peak, and the fraction wasted, from the real cache tensors."""
    lengths = request_lengths(cfg)
    # The strategy builds its cache for these requests and grows each to its length (Layout.mixed_batch):
    # contiguous reserves the longest for every one, paged takes exactly the blocks they need.
    cache = cfg.layout().mixed_batch(spec, lengths)
    allocated, scales, tail = cache.kv_bytes_allocated(), cache.kv_scale_bytes(), cache.kv_tail_bytes()
    live = int(sum(lengths) * spec.bytes_per_token)
    return {
        "kv_bytes_allocated": allocated,
        "kv_bytes_live": live,
        "kv_scale_bytes": scales,
        "kv_tail_bytes": tail,
        "kv_waste_fraction": waste_fraction(allocated=allocated, overhead=scales + tail, live=live),
        "mean_request_len": sum(lengths) / len(lengths),
    }


def waste_fraction(*, allocated: int, overhead: int, live: int) -> float | None:
    """Share of the KV payload storage that holds no token. `overhead` (scales, a full-precision tail) is storage
    a format needs beside its payload, reported on its own, so it is neither payload nor waste."""
    payload = allocated - overhead
    return (payload - live) / payload if payload > 0 else None
