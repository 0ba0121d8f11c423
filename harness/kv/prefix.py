"""Prefix caching: the K/V of a prompt prefix every sequence shares is computed once and stored once.

Paged storage (harness.kv.paged) whose prefix blocks are shared and ref-counted, after vLLM's automatic prefix
caching (Kwon et al. 2023, section 4.4 "Shared prefix"; vLLM docs, "Automatic Prefix Caching"). Every sequence's
block table starts with the same physical prefix blocks, with no copy. A block goes back to the free list only
when its last reference goes: each table holding it counts one, and the cache itself holds one, so the prefix
survives `release()` of a batch and the next batch with the same prefix (a hit) prefills only its suffixes.

The prefix is identified by its token ids: one chained sha256 per block (a block's hash covers every token before
it, as vLLM's block hashes do). A different prefix is a miss; the cache keeps one prefix and evicts it on a miss.

Partial last block: only whole blocks are shared. The cached prefix is floor(prefix_len / block_size) * block_size
tokens; the remaining prefix_len % block_size tokens are computed and stored by each sequence as the start of its
suffix. No sequence ever writes into a shared block, so no copy-on-write is needed; sharing them too would save at
most block_size - 1 tokens per sequence. int4 (KIVI) also shares whole key groups only (a group's scales depend on
all its tokens), and needs kv_residual=0: its full-precision tail is private to each sequence and overwritten by
the batch's decode, so a later batch could not find the prefix's newest tokens there (Unsupported otherwise).

The decode hook (KVCache.prefill_prefix, which harness.modeling.decode.prefill calls on every cache; 0 for the others):
`prefill_prefix(model, prompt, prompt_ids) -> int` computes the shared prefix once on a miss (one batch-1 forward
pass into fresh blocks), points every sequence's table at it, and returns the number of leading tokens every
sequence now holds; prefill then runs the rest with start_pos at that number. The prefix is looked up by the
prompt's ids on the host (prompt_ids), as a server holds them. With spec.prefix_len == 0 (or shorter than a block)
it returns 0 and the cache behaves exactly like `paged`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from harness.errors import ConfigError, KVPoolExhausted, Unsupported
from harness.kv import LATER_DEFAULT, paged, tiers, varlen
from harness.kv.base import CacheSpec, Layout, Serving, blocks_for
from harness.kv.paged import PagedCache, PagedLayout


def block_hashes(token_ids: np.ndarray, block_size: int) -> tuple[bytes, ...]:
    """token_ids [n] on the host, n a multiple of block_size -> one sha256 per block, each chained to the previous
    (vLLM's prefix-cache key; sha256, not Python's hash, so two different prefixes never collide in practice)."""
    token_ids = np.asarray(token_ids, dtype=np.int64)
    assert token_ids.size % block_size == 0, "only whole blocks are hashed"
    hashes, parent = [], b""
    for start in range(0, token_ids.size, block_size):
        parent = hashlib.sha256(parent + token_ids[start : start + block_size].tobytes()).digest()
        hashes.append(parent)
    return tuple(hashes)


@dataclass(frozen=True)
class Options(paged.Options):
    """Paged's options, and the tiers below device memory where the prefix's blocks also go (harness.kv.tiers;
    LMCache's local_cpu / local_disk settings). Without either, the prefix lives in device memory alone."""

    # Added with the tiers (issue #18): at these defaults they stay out of point_id (kv.LATER_DEFAULT).
    # host_gb: the host tier, GB = 1e9 bytes (LMCache's max_local_cpu_size); 0: no host tier.
    # disk_dir: the disk tier's directory (LMCache's local_disk), which outlives the run; null: none.
    # disk_gb: the disk tier's capacity, GB; the least recently used files beyond it are deleted.
    host_gb: float = field(default=0.0, metadata={LATER_DEFAULT: 0.0})
    disk_dir: str | None = field(default=None, metadata={LATER_DEFAULT: None})
    disk_gb: float = field(default=16.0, metadata={LATER_DEFAULT: 16.0})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.host_gb >= 0:
            raise ValueError(f"cache.host_gb: must be 0 (no host tier) or a positive size in GB, got {self.host_gb}")
        if not self.disk_gb > 0:
            raise ValueError(f"cache.disk_gb: must be a positive size in GB, got {self.disk_gb}")
        if self.disk_dir is not None and not str(self.disk_dir).strip():
            raise ValueError("cache.disk_dir: must be a directory path, or null for no disk tier")


def block_identity(spec: CacheSpec, cache: PagedCache) -> dict:
    """What a stored block must match to be used: the weights that computed it, its format, every part's shape."""
    return {
        "model_id": spec.model_id,
        "kv_dtype": spec.kv_dtype,
        "kv_group_size": spec.kv_group_size,
        "block_size": cache.block_size,
        "parts": {
            name: [str(pool.dtype).removeprefix("torch."), [pool.shape[0], 1, *pool.shape[2:]]]
            for name, pool in cache.rows.items()
            if pool is not None
        },
    }


def shared_unit(*, block_size: int, kv_dtype: str, kv_group_size: int) -> int:
    """The shared prefix is a multiple of this many tokens: whole blocks, and for int4 whole key groups as well."""
    return math.lcm(block_size, kv_group_size) if kv_dtype == "int4" else block_size


def shared_tokens(*, prefix_len: int, prompt_len: int, unit: int) -> int:
    """Leading tokens stored once for the batch: whole units of the prefix, at least one prompt token left to prefill
    (its logits give the first output token)."""
    return max(0, min(prefix_len, prompt_len - 1)) // unit * unit


class PrefixCache(PagedCache):
    name: ClassVar[str] = "prefix"

    def __init__(self, spec: CacheSpec, options: Options) -> None:
        if spec.kv_dtype == "int4" and spec.kv_residual > 0 and spec.prefix_len > 0:
            raise Unsupported(
                f"prefix: int4 keeps each sequence's newest {spec.kv_residual} tokens in a private full-precision "
                "tail that a later batch cannot reuse; allowed: kv_residual=0"
            )
        self.shared_unit = shared_unit(
            block_size=options.block_size, kv_dtype=spec.kv_dtype, kv_group_size=spec.kv_group_size
        )
        if options.pool_tokens is None:
            # What the point needs at its peak: the prefix blocks once, plus each sequence's own blocks after them.
            # Paged would hold the prefix once per sequence; the difference is exactly kv_bytes_shared().
            n_prefix_blocks = spec.prefix_len // self.shared_unit * self.shared_unit // options.block_size
            per_sequence = blocks_for(spec.max_tokens, options.block_size)
            n_blocks = spec.batch_size * per_sequence - (spec.batch_size - 1) * n_prefix_blocks
            options = dataclasses.replace(options, pool_tokens=n_blocks * options.block_size)
        super().__init__(spec, options)
        self.store = self._store(spec, options)  # the tiers below device memory, or None
        self.prefix_sources: list[str] = []  # per prefill: where its prefix came from (device, host, disk, computed)
        self.refs: dict[int, int] = {}  # shared block id -> references: the tables holding it, plus the cache's own
        self.prefix_blocks: list[int] = []  # the cached prefix's blocks, in order; the cache's references
        self.prefix_key: tuple[bytes, ...] = ()  # block_hashes of the cached prefix
        self.prefix_hit = False  # whether the last prefill found its prefix cached
        self.n_shared_tokens = 0  # leading tokens of the live batch stored in shared blocks

    def _store(self, spec: CacheSpec, options: Options) -> tiers.TieredStore | None:
        if options.host_gb == 0 and options.disk_dir is None:
            return None
        if options.disk_dir is not None and not spec.model_id:
            raise Unsupported(
                "prefix: a disk tier needs the model's identity (CacheSpec.model_id) to file blocks under"
            )
        return tiers.TieredStore(
            identity=block_identity(spec, self),
            device=spec.device,
            host_bytes=int(options.host_gb * tiers.GB),
            disk_dir=options.disk_dir,
            disk_bytes=int(options.disk_gb * tiers.GB),
        )

    def prefill_prefix(
        self, model: torch.nn.Module, prompt: torch.Tensor, *, prompt_ids: list[list[int]] | None = None
    ) -> int:
        """prompt [B, P]: make the shared prefix present for every sequence; return its length in tokens (0: none).

        A miss runs model(prompt[:1, :n], start_pos=0) once, as a single sequence, into blocks the cache keeps.
        prompt_ids: the same ids on the host, as lists of ints, where they are hashed; without them the prefix is
        copied back from the device (a small copy, and a host sync on a GPU).
        """
        self._drop_sequences()  # a new batch (release() has normally done this already)
        # Whole blocks only, and at least one token left to prefill: its logits give the first output token.
        n_tokens = shared_tokens(prefix_len=self.spec.prefix_len, prompt_len=prompt.shape[1], unit=self.shared_unit)
        self.prefix_hit, self.n_shared_tokens = False, 0
        if n_tokens <= 0:
            return 0
        # [B, n] as Python ints: the lookup is host bookkeeping (a server's scheduler), never a tensor program.
        ids = [list(row[:n_tokens]) for row in (prompt_ids or prompt[:, :n_tokens].cpu().tolist())]
        if any(row != ids[0] for row in ids):
            raise ValueError(
                f"prefix_len: the batch's prompts differ within their first {n_tokens} tokens; every sequence "
                "must start with the same prefix"
            )
        key = block_hashes(ids[0], self.block_size)
        self.prefix_hit = key == self.prefix_key
        if self.prefix_hit:
            self.prefix_sources.append("device")
        else:
            self.forget_prefix()  # one prefix at a time: the old one makes room for the new
            self._fill_prefix(model, prompt[:1, :n_tokens], key)
            self.prefix_key = key
        for blocks in self.tables:  # every table points at the same physical blocks: no copy
            blocks.extend(self.prefix_blocks)
        for block in self.prefix_blocks:
            self.refs[block] += len(self.tables)
        self._sync_table(len(self.tables[0]))
        self.n_tokens = self.n_shared_tokens = n_tokens
        return n_tokens

    def _fill_prefix(self, model: torch.nn.Module, prefix: torch.Tensor, key: tuple[bytes, ...]) -> None:
        """prefix [1, n]: its leading blocks from the tiers where they are stored, the rest computed by one forward
        pass as a lone sequence (then written through to the tiers); the blocks become the shared ones."""
        n_tokens = prefix.shape[1]
        with self._single_sequence() as blocks:
            loaded, source = self._load_blocks(blocks, list(key))
            if loaded < n_tokens:  # the logits are not needed, only the K/V
                model(prefix[:, loaded:], start_pos=loaded, cache=self, last_only=True)
        self.prefix_blocks = blocks
        self.refs = {block: 1 for block in blocks}  # the cache's own reference
        missing = self.store.missing(list(key)) if self.store is not None else []
        if missing:  # write-through: what a tier lacks, computed now or evicted from it before
            self.store.save([key[i] for i in missing], self.read_blocks([blocks[i] for i in missing]))
        self.prefix_sources.append(source if loaded == n_tokens else f"{source}+computed" if loaded else "computed")

    def _load_blocks(self, blocks: list[int], keys: list[bytes]) -> tuple[int, str | None]:
        """Into the lone sequence's `blocks`: the longest leading run of `keys` the tiers hold. Returns the tokens
        loaded and the slowest tier they came from."""
        if self.store is None:
            return 0, None
        parts, n_blocks, source = self.store.load(keys)
        if not n_blocks:
            return 0, None
        if len(self.free_blocks) < n_blocks:
            raise KVPoolExhausted(f"prefix: {n_blocks} stored blocks do not fit the {self.n_blocks}-block pool")
        ids = [self.free_blocks.pop() for _ in range(n_blocks)]
        blocks.extend(ids)
        self.write_blocks(ids, parts)
        self._sync_table(n_blocks)
        self.n_tokens = n_blocks * self.block_size
        return self.n_tokens, source

    @contextmanager
    def _single_sequence(self) -> Iterator[list[int]]:
        """For the duration, the cache holds one sequence (its block list is yielded), not the batch."""
        tables, table = self.tables, self.table
        blocks: list[int] = []
        self.tables, self.table = [blocks], table[:1]  # [1, blocks_per_seq], a view of the first row
        try:
            yield blocks
        except BaseException:
            self.free_blocks.extend(reversed(blocks))  # a failed pass (pool exhausted) leaks nothing
            raise
        finally:
            self.tables, self.table = tables, table

    def prepare(self, start_pos: int | varlen.SeqBatch, n_new: int | None = None) -> None:
        if isinstance(start_pos, varlen.SeqBatch):  # a serving engine's tables: prefix sharing is its scheduler's
            super().prepare(start_pos)
            return
        grown = [self.ensure_blocks(seq, start_pos + n_new) for seq in range(len(self.tables))]
        if any(grown):
            self._sync_table(len(self.tables[0]))  # all sequences hold the same number of blocks
        self.n_tokens = start_pos + n_new

    def _unref(self, block: int) -> None:
        """Drop one reference; a block nobody references returns to the pool. Unshared blocks have one."""
        refs = self.refs.pop(block, 1) - 1
        if refs:
            self.refs[block] = refs
        else:
            self.free_blocks.append(block)

    def _drop_sequences(self) -> None:
        for blocks in self.tables:
            for block in reversed(blocks):
                self._unref(block)
            blocks.clear()
        self.n_tokens = self.n_shared_tokens = 0

    def release(self) -> None:
        """The batch completed: its own blocks go back to the pool; the prefix stays, held by the cache."""
        self._drop_sequences()

    def forget_prefix(self) -> None:
        """Drop the cache's reference to its prefix: the next prefill is a miss. Blocks a live batch still reads
        stay until its release()."""
        for block in reversed(self.prefix_blocks):
            self._unref(block)
        self.prefix_blocks, self.prefix_key = [], ()

    def blocks_in_use(self) -> int:
        """Physical blocks held, a shared one counted once."""
        return len({block for blocks in self.tables for block in blocks} | set(self.prefix_blocks))

    def prefix_bytes(self) -> int:
        """Bytes of the cached prefix's blocks, every part (data and scales) of every layer."""
        per_block = sum(pool[:, 0].numel() * pool.element_size() for pool in self.rows.values() if pool is not None)
        return len(self.prefix_blocks) * per_block

    def kv_bytes_shared(self) -> int:
        """KV bytes the live batch saves by sharing: every sequence but one would otherwise hold the prefix."""
        return int((self.spec.batch_size - 1) * self.n_shared_tokens * self.spec.bytes_per_token)

    def peak_columns(self) -> dict[str, int]:
        return {"kv_bytes_shared": self.kv_bytes_shared()}  # what sharing the prefix saved

    def kv_bytes_live(self) -> int:
        """Distinct tokens stored: each sequence's own, plus every shared block still referenced, once."""
        own = self.spec.batch_size * (self.n_tokens - self.n_shared_tokens)
        shared = len(self.refs) * self.block_size
        return int((own + shared) * self.spec.bytes_per_token)

    def row_columns(self, ttft_ms: Callable[[], float], *, n: int) -> dict[str, Any]:
        """The figures beyond the hits (ttft_ms): the TTFT of n generations whose prefix comes from each tier below
        device memory, then recomputed; each a median. Where the point's first prefill found it. {} when there was no
        whole block to share (prefix_len=0, or under a block): the cache measured as paged.

        Host: the device copy forgotten (a server evicted it), the host tier still holds it. Disk: the host tier
        emptied too, as in a new process. Recompute: the tiers bypassed, so neither a lookup nor the write-through
        is timed."""
        store = self.store

        def median_ttft(before: Callable[[], None]) -> float:
            ttfts = []
            for _ in range(n):
                before()
                ttfts.append(ttft_ms())
            return statistics.median(ttfts)

        def from_disk() -> None:
            self.forget_prefix()
            store.drop_host()

        if not self.prefix_sources:
            return {}
        columns = {"prefix_hit": self.prefix_hit, "prefix_source": self.prefix_sources[0]}
        if store is None:
            return columns | {"ttft_miss_ms": median_ttft(self.forget_prefix)}
        if tiers.HOST in store.tiers:
            columns["ttft_host_ms"] = median_ttft(self.forget_prefix)
        if tiers.DISK in store.tiers:
            first = len(store.transfers)
            columns["ttft_disk_ms"] = median_ttft(from_disk)
            reads = [t for t in store.transfers[first:] if t.direction == "read"]
            seconds = sum(t.seconds for t in reads)
            columns["prefix_disk_read_gbps"] = sum(t.n_bytes for t in reads) / seconds / 1e9 if seconds else None
        with store.bypassed():
            columns["ttft_miss_ms"] = median_ttft(self.forget_prefix)
        return columns | {"prefix_bytes_stored": self.prefix_bytes(), "prefix_rejected_blocks": len(store.rejected)}


class PrefixLayout(PagedLayout):
    """Paged, with the prefix's whole shared units held once for the batch and skipped by a hit's prefill."""

    stores_latent: ClassVar[bool] = False  # paged storage, but MLA runs were scoped to contiguous and paged only

    def prefix_tokens(self, shape) -> int:
        unit = shared_unit(
            block_size=self.options.block_size, kv_dtype=shape.kv_dtype, kv_group_size=shape.kv_group_size
        )
        return shared_tokens(prefix_len=shape.prefix_len, prompt_len=shape.prompt_len, unit=unit)

    def shared_blocks(self, shape) -> int:
        return self.prefix_tokens(shape) // self.options.block_size

    def option_columns(self) -> dict:
        """A tier the point does not have is a null, not its default size: host_gb 0 and disk_gb without a disk_dir
        say nothing about the point."""
        columns = super().option_columns()
        has_disk = columns["disk_dir"] is not None
        return columns | {"host_gb": columns["host_gb"] or None, "disk_gb": columns["disk_gb"] if has_disk else None}

    def check(self, shape) -> None:
        super().check(shape)
        if shape.kv_dtype == "int4" and shape.kv_residual > 0 and shape.prefix_len > 0:
            raise ConfigError("kv_residual: prefix caching of int4 needs kv_residual=0 (its tail is private)")

    mixed_batch = Layout.mixed_batch  # allocation waste is measured for contiguous and paged only


STRATEGY = PrefixCache
LAYOUT = PrefixLayout
SERVING = Serving(pool="blocks", storage="paged", shares_prefix=True)  # hits found by the scheduler's block hashes
