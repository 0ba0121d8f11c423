"""A serving prefix cache that keeps the blocks the device evicts in a host and a disk tier, and loads them back.

After vLLM's KV offloading connector (CPU offloading: a block the device pool evicts is stored on the host, and a
later request's prefix lookup that misses on the device continues on the host and loads what it finds), LMCache's
local_cpu / local_disk backends and SGLang HiCache (its `write_back` policy: a block reaches the host when the
device evicts it). The store is harness.kv.tiers.TieredStore, the static prefix cache's: the same LRU host tier
within `cache.host_gb`, the same checksummed block files under `cache.disk_dir`, every move timed.

Offload on eviction (write-back), not write-through: a block crosses the bus only when the pool takes its id for
other tokens, so a history that stays on the device costs no copy, and a copy costs only on the iterations that
evict. Write-through would copy every computed prompt block each iteration, on the critical path, since stores
are synchronous here (loads overlap with the forward under tier_overlap, harness.serve.tier_loader). Below the device the store is
write-through: an evicted block goes to the host tier and to disk at once (TieredStore.save), so a block the host
tier's LRU drops is still found on disk.

Where in the iteration: the manager decides (it is torch-free, as harness.serve.kv_manager), the engine copies.
`BlockPool.evicted` lists each cached block whose id get_new_blocks hands out, with its hash; a request's first
admission walks its prompt blocks on the device, then, from the first device miss, in the tiers (`TierIndex`),
and the blocks found there are taken new, counted as computed tokens, and cached on the device again. The
scheduler hands both lists to the engine in SchedulerOutput.tier_moves, which copies the evicted blocks out
(their K/V are still those their hash names: the forward that overwrites them has not run), then writes the
loaded ones, before the forward (harness.serve.tier_store). A lookup fetches what it finds to the host at once,
checksums checked (TieredStore.fetch), so a refused file is a miss before the scheduler counts it.

Only a request whose prompt is known (block_hashes: a chat session's turn) uses the tiers: the synthetic stream's
("prefix", index) keys name a position, not tokens, and would be wrong in the next run's disk tier.

Torch-free: the tiers are asked through TierIndex.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from harness.errors import ConfigError
from harness.serve.kv_manager import KVCacheBlocks, PagedKVManager, serving
from harness.serve.requests import Request

HOST, DISK = "host", "disk"  # harness.kv.tiers' names
SOURCES = ("device", HOST, DISK)  # where a prefix hit's tokens came from, nearest first
TIER_DEFAULTS = {"host_gb": 0.0, "disk_dir": None, "disk_gb": 16.0}  # harness.kv.prefix.Options' own defaults


@dataclass(frozen=True)
class TierOptions:
    """cache.host_gb (GB = 1e9 bytes; 0: no host tier), cache.disk_dir (null: no disk tier) and cache.disk_gb (the
    disk tier's capacity, GB), as the static prefix cache's options (harness.kv.prefix.Options) name them."""

    host_gb: float = 0.0
    disk_dir: str | None = None
    disk_gb: float = 16.0

    @property
    def enabled(self) -> bool:
        return self.host_gb != 0 or self.disk_dir is not None

    def as_dict(self) -> dict[str, Any]:
        return {"host_gb": self.host_gb, "disk_dir": self.disk_dir, "disk_gb": self.disk_gb}

    def row_columns(self) -> dict[str, Any]:
        """The run row's: a tier the run does not have is a null, not its default size (as the prefix strategy's
        option columns, harness.kv.prefix.PrefixLayout)."""
        has_disk = self.disk_dir is not None
        return {
            "host_gb": self.host_gb or None,
            "disk_dir": self.disk_dir,
            "disk_gb": self.disk_gb if has_disk else None,
        }


def split_tiers(cache: Mapping[str, Any]) -> tuple[dict[str, Any], TierOptions]:
    """A serving config's `cache` without its tier options, and those options (the rest is derived from strategy)."""
    rest = {key: value for key, value in cache.items() if key not in TIER_DEFAULTS}
    return rest, TierOptions(**{key: cache.get(key, default) for key, default in TIER_DEFAULTS.items()})


def check_tiers(strategy: str, options: TierOptions) -> None:
    """One line per bad tier option, before anything is built; a tier is refused beside a strategy that does not
    cache prefixes."""
    host_gb, disk_gb = options.host_gb, options.disk_gb
    if (
        isinstance(host_gb, bool)
        or not isinstance(host_gb, int | float)
        or not (math.isfinite(host_gb) and host_gb >= 0)
    ):
        raise ConfigError(f"cache.host_gb: must be 0 (no host tier) or a size in GB > 0, got {host_gb!r}")
    if (
        isinstance(disk_gb, bool)
        or not isinstance(disk_gb, int | float)
        or not (math.isfinite(disk_gb) and disk_gb > 0)
    ):
        raise ConfigError(f"cache.disk_gb: must be a size in GB > 0, got {disk_gb!r}")
    if options.disk_dir is not None and not str(options.disk_dir).strip():
        raise ConfigError("cache.disk_dir: must be a directory path, or null for no disk tier")
    if not serving(strategy).shares_prefix:  # the strategy's declaration (harness.kv.base.Serving), not its name
        from harness import kv  # here, not at the top: the bookkeeping stays torch-free

        sharing = ",".join(name for name in kv.serving_names() if kv.serving(name).shares_prefix)
        for name in ("host_gb", "disk_dir"):
            if getattr(options, name) != TIER_DEFAULTS[name]:
                raise ConfigError(
                    f"cache.{name}: only strategy={sharing} keeps evicted blocks in tiers; allowed: "
                    f"{TIER_DEFAULTS[name] if name == 'host_gb' else 'null'} with strategy={strategy}"
                )


def check_overlap(tier_overlap: object, options: TierOptions) -> None:
    """tier_overlap: true, false, or null (true when there are tiers); an explicit true without tiers is refused,
    since there would be nothing to overlap."""
    if tier_overlap is not None and not isinstance(tier_overlap, bool):
        raise ConfigError(f"tier_overlap: allowed: true, false or null (true with tiers), got {tier_overlap!r}")
    if tier_overlap and not options.enabled:
        raise ConfigError("tier_overlap: true needs tiers to load from (strategy=prefix with cache.host_gb > 0 or "
                          "cache.disk_dir); allowed: null or false without them")  # fmt: skip


def overlaps(tier_overlap: bool | None, options: TierOptions) -> bool:
    """The run's tier_overlap: null means true with tiers."""
    return options.enabled if tier_overlap is None else tier_overlap


def make_disk_dir(options: TierOptions) -> None:
    """The disk tier's directory, made now: one that cannot be is one line before the model is built."""
    if options.disk_dir is None:
        return
    try:
        Path(options.disk_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cache.disk_dir: {options.disk_dir} cannot be created ({exc.strerror}); allowed: a "
                          "writable directory, or null") from None  # fmt: skip


class TierIndex(Protocol):
    """What the manager asks of the tiers (harness.serve.tier_store.ServeTiers)."""

    def source(self, block_hash: object) -> str | None:
        """host or disk where the block is held (fetched to the host for this iteration's load), None: a miss."""
        ...


@dataclass(frozen=True)
class TierMoves:
    """One iteration's tier traffic, for the engine to run before its forward, in this order."""

    offload: tuple[tuple[int, object], ...] = ()  # (pool block, its hash): evicted, to copy into the tiers
    load: tuple[tuple[int, object, str], ...] = ()  # (pool block, hash, host | disk): to fill from the tiers


class TieredPrefixManager(PagedKVManager):
    """A prefix-caching PagedKVManager whose evicted blocks go to `tiers` and whose lookups continue there."""

    def __init__(self, *, num_blocks: int, block_size: int, tiers: TierIndex) -> None:
        super().__init__(num_blocks=num_blocks, block_size=block_size, prefix_caching=True)
        self.tiers = tiers
        if (bind := getattr(tiers, "bind_device", None)) is not None:  # a prefetch skips blocks the device holds
            bind(self.pool.cached.__contains__)
        self.pool.evicted = []
        self.loads: list[tuple[int, object, str]] = []
        self.looked_up: dict[int, list[tuple[object, str]]] = {}  # request id -> its tier run at its last lookup
        self.tier_hit_tokens: dict[int, dict[str, int]] = {}  # request id -> host / disk tokens, first admission

    def _tier_run(self, request: Request, num_tokens: int, start: int) -> list[tuple[object, str]]:
        """(hash, source) of the prompt blocks from index `start` on that the tiers hold, up to the first miss."""
        run: list[tuple[object, str]] = []
        if not request.block_hashes:
            return run
        for index in range(start, self._prefix_blocks(request, num_tokens)):
            key = self._block_key(request, index)
            source = self.tiers.source(key)
            if source is None:
                break
            run.append((key, source))
        return run

    def cached_prefix_tokens(self, request: Request, num_tokens: int) -> int:
        """The device's hits, then the tiers': the tokens a first admission brings (the scheduler's computed)."""
        if request.request_id in self.tables:
            return 0
        device = len(self._cached_hits(request, num_tokens))
        run = self._tier_run(request, num_tokens, start=device)
        self.looked_up[request.request_id] = run
        return (device + len(run)) * self.block_size

    def allocate(self, request: Request, num_tokens: int, *, num_computed_tokens: int = 0) -> KVCacheBlocks:
        """The base allocation; on an admission after a lookup, the first blocks it takes new are the tier run's,
        listed for the engine to load. A swapped request's readmission made no lookup: its blocks come from its own
        host copy (the engine's swap), not from the tiers."""
        rid = request.request_id
        run = self.looked_up.pop(rid, []) if rid not in self.tables else []
        device = len(self._cached_hits(request, num_tokens)) if run else 0  # before the base caches its blocks
        blocks = super().allocate(request, num_tokens, num_computed_tokens=num_computed_tokens)
        if rid not in self.tier_hit_tokens:
            counts = {source: sum(1 for _, s in run if s == source) * self.block_size for source in (HOST, DISK)}
            self.tier_hit_tokens[rid] = counts
        if run:
            assert (device + len(run)) * self.block_size == num_computed_tokens, "the lookup and the admission differ"
            for (key, source), block in zip(run, blocks.table[device : device + len(run)], strict=True):
                self.loads.append((block, key, source))
        return blocks

    def free(self, request_id: int) -> None:
        self.looked_up.pop(request_id, None)
        super().free(request_id)

    def take_tier_moves(self) -> TierMoves:
        """This iteration's evictions and loads, handed over once (the scheduler puts them in its output)."""
        # A ("prefix", index) key (the synthetic stream's) names a position, not tokens: it is never stored.
        offload = tuple((block, key) for block, key in self.pool.evicted if isinstance(key, int))
        moves = TierMoves(offload=offload, load=tuple(self.loads))
        self.pool.evicted.clear()
        self.loads.clear()
        return moves

    def prefix_hit_tokens(self, request_id: int) -> int:
        """Every prompt token not computed: the device's hits and the tiers'."""
        return super().prefix_hit_tokens(request_id) + sum(self.tier_hit_tokens.get(request_id, {}).values())

    def hit_tokens_by_source(self, request_id: int) -> dict[str, int]:
        """The request row's prefix_hit_tokens_host and _disk."""
        counts = self.tier_hit_tokens.get(request_id, {})
        return {f"prefix_hit_tokens_{source}": counts.get(source, 0) for source in (HOST, DISK)}

    def tier_tokens(self, request_ids) -> dict[str, int]:
        """Prompt tokens the host and the disk tier served these requests (run_metrics' tier_hit_tokens)."""
        counts = [self.tier_hit_tokens.get(int(rid), {}) for rid in request_ids]
        return {source: sum(count.get(source, 0) for count in counts) for source in (HOST, DISK)}
