"""Paged KV cache: a global pool of fixed-size blocks and a block table per sequence (vLLM's PagedAttention).

Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention". A sequence
takes a block only when it grows into it and returns all of them on completion, so the waste per sequence is at
most one partly filled block instead of everything reserved up to its maximum length. Paging cuts fragmentation,
not the total: the tokens present cost exactly what they cost in a contiguous buffer.

Attention follows the block table. A decode step on CUDA reads the blocks in place (harness.kv.paged_attend:
FlashInfer's paged decode, or the Triton kernel of harness.kv.triton_paged); prefill, int4, and the CPU gather the
sequence's blocks into a contiguous tensor first and run SDPA over it. `attn_backend` says which decode path ran:
"flashinfer", "triton-paged", "sdpa-gather", or "sdpa-gather-masked" (static shapes: `compile`, where the block
bookkeeping stays eager on the host, `prepare` copying new rows to the device table, and the compiled step attends
over every block that table can hold, paged_attend.StaticDecode).

Serving (harness.serve): a pool built `for_scheduler` keeps no tables of its own; each forward's SeqBatch brings
the scheduler's, the only ones.

Quantized formats (harness.kv.quant) keep their narrow data in the pool and their scales in pools of their own,
block for block, so a block returned to the pool frees its scales too. int4 key scales cover a group of
kv_group_size tokens, so block_size must divide it or be a multiple of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from harness import kv
from harness.errors import ConfigError, KVPoolExhausted, Unsupported
from harness.formats import BITS, DTYPE_BYTES, SCALE_BYTES
from harness.formats import PLAIN as PLAIN_NAMES
from harness.kv import host, paged_attend, varlen
from harness.kv.base import (
    CacheSpec,
    KVAllocation,
    Layout,
    Serving,
    attention,
    blocks_for,
    cache_width,
    codec_transients,
    data_row_bytes,
    int4_tail_bytes,
    scale_parts,
)
from harness.kv.quant import FP8, storage_format


@dataclass(frozen=True)
class Options:
    block_size: int = 16  # tokens per block; vLLM's default on CUDA
    pool_tokens: int | None = None  # pool capacity in tokens; None: exactly what the sweep point needs at its peak

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"cache.block_size: must be a positive number of tokens, got {self.block_size}")
        if self.pool_tokens is not None and self.pool_tokens <= 0:
            raise ValueError(f"cache.pool_tokens: must be positive or null, got {self.pool_tokens}")


def rows_per_block(block_size: int, tokens_per_row: int) -> int:
    """A part with a row per `tokens_per_row` positions (int4 key scales: per group) keeps its rows in the blocks of
    those positions. A group larger than a block keeps its row in the group's first block (the others' row stays
    unused: honest, if wasteful); any other ratio cannot be addressed by block."""
    if block_size % tokens_per_row == 0:
        return block_size // tokens_per_row
    if tokens_per_row % block_size == 0:
        return 1
    divisors = ", ".join(str(d) for d in range(1, tokens_per_row + 1) if tokens_per_row % d == 0)
    raise Unsupported(
        f"block_size {block_size} cannot hold whole int4 key groups of kv_group_size={tokens_per_row} "
        f"tokens; allowed: block_size dividing or a multiple of it ({divisors}, or a multiple of {tokens_per_row})"
    )


class PagedCache(kv.KVCache):
    name: ClassVar[str] = "paged"
    recomputes_prefix: ClassVar[bool] = False
    prefix_hit: bool | None = None  # a prefix cache (harness.kv.prefix) sets it at every prefill
    layer_loads = None  # a serving tier's loads this forward waits for per layer (harness.serve.tier_loader.LayerLoads)

    def __init__(self, spec: CacheSpec, options: Options, *, own_tables: bool = True) -> None:
        self.spec, self.block_size = spec, options.block_size
        blocks_per_seq = blocks_for(spec.max_tokens, self.block_size)
        if options.pool_tokens is None:
            n_blocks = spec.batch_size * blocks_per_seq
        else:
            n_blocks = blocks_for(options.pool_tokens, self.block_size)
        self.format = storage_format(spec)
        parts = self.format.parts()
        data = parts.pop("data")
        self.n_blocks = n_blocks
        shape = (spec.n_layers, n_blocks, spec.n_kv_heads, self.block_size, data.width)
        # K and V each [L, N, H_kv, bs, D] (int4: D / 2 bytes, two values each): two tensors, not two views of one,
        # so that a compiled step mutates two static inputs (see harness.kv.contiguous).
        self.k_pool = torch.zeros(shape, dtype=data.dtype, device=spec.device)
        # MLA's latent (spec.latent_v_dim): V is K's first channels, so no V pool.
        self.v_pool = torch.zeros(shape, dtype=data.dtype, device=spec.device) if "v" in spec.sides else None
        self.pools = [t for t in (self.k_pool, self.v_pool) if t is not None]
        self.tokens_per_row = {"k": 1, "v": 1} | {name: part.tokens for name, part in parts.items()}
        self.scales = {  # name -> [L, N, H_kv, rows per block, width]; empty for plain formats
            name: torch.zeros(
                (spec.n_layers, n_blocks, spec.n_kv_heads, self._rows_per_block(part.tokens), part.width),
                dtype=part.dtype,
                device=spec.device,
            )
            for name, part in parts.items()
        }
        self.rows = {"k": self.k_pool, "v": self.v_pool, **self.scales}  # by part name
        # None, all three, in a serving pool (for_scheduler): the scheduler's tables are the only ones.
        self.free_blocks: list[int] | None = None  # a stack: pop() hands out block 0 first
        self.tables: list[list[int]] | None = None  # per sequence: block ids in order
        self.table: torch.Tensor | None = None  # the same on the device, for gathers: [B, blocks_per_seq]
        if own_tables:  # the device table is refreshed only when a block is added
            self.free_blocks = list(range(n_blocks - 1, -1, -1))
            self.tables = [[] for _ in range(spec.batch_size)]
            self.table = torch.zeros((spec.batch_size, blocks_per_seq), dtype=torch.long, device=spec.device)
        self.n_tokens = 0  # tokens present per sequence (all sequences of a batch move in step)
        self.attn_backend = paged_attend.decode_backend(spec)
        self._lens: tuple[tuple[int, int], torch.Tensor] | None = None  # (batch, tokens) -> [B] int32 on the device
        self._varlen: varlen.VarlenRows | None = None  # the current SeqBatch's addresses (prepare)
        self.flashinfer = paged_attend.FlashInferDecode()  # planned at the first decode step it runs
        self._static: paged_attend.StaticDecode | None = None  # set by enable_static_decode

    @classmethod
    def for_scheduler(cls, spec: CacheSpec, options: Options) -> PagedCache:
        """A serving pool (harness.serve.engine.build_cache): the block tables of a serving scheduler's KV manager
        (harness.serve.kv_manager), which every forward's SeqBatch brings, are its only ones. It keeps no free list,
        host tables or device table, and the paths that address positions by an int, which read those, refuse."""
        return cls(spec, options, own_tables=False)

    def _check_own_tables(self, what: str) -> None:
        if self.tables is None:
            raise Unsupported(
                f"paged: {what} needs this cache's own block tables, and a serving pool keeps none (its scheduler's "
                "are the only ones); allowed: a SeqBatch's positions, through the scheduler's tables"
            )

    supports_static_decode: ClassVar[bool] = True  # decode steps at static shapes: enable_static_decode, below

    def enable_static_decode(self) -> None:
        """Prepare decode steps at static shapes (harness.modeling.decode.compile_decode_step): mark what the step reads as
        static inputs (`static_tensors`), fix the positions of the length mask or the kernel's split count for the
        longest context, and leave FlashInfer (host-side planning) for the Triton kernel or the masked gather."""
        spec = self.spec
        self._check_own_tables("compile")
        if spec.kv_dtype == "int4":
            raise Unsupported("compile: int4 (KIVI) quantizes key groups as they complete, a data-dependent write")
        if spec.latent_v_dim:
            raise Unsupported("compile: MLA's latent cache decodes eagerly; allowed: compile=none")
        self.attn_backend = paged_attend.decode_backend(spec, static=True)
        self._static = paged_attend.StaticDecode.for_cache(self)
        for tensor in self.static_tensors():
            torch._dynamo.mark_static_address(tensor)

    def static_tensors(self) -> list[torch.Tensor]:
        """What a static-shape decode step reads from this cache: both pools, their scales, the device block table,
        and the mask's positions. Each is a tensor of its own, none a view of another."""
        positions = [self._static.positions] if self._static is not None else []
        return [*self.pools, *self.scales.values(), self.table, *positions]

    def _rows_per_block(self, tokens_per_row: int) -> int:
        return rows_per_block(self.block_size, tokens_per_row)

    def ensure_blocks(self, seq: int, n_tokens: int) -> bool:
        """Grow sequence `seq`'s table to cover n_tokens positions; returns whether it took a block."""
        self._check_own_tables("ensure_blocks")
        blocks = self.tables[seq]
        need = blocks_for(n_tokens, self.block_size)
        grown = len(blocks) < need
        while len(blocks) < need:
            if not self.free_blocks:
                raise KVPoolExhausted(
                    f"paged KV pool exhausted: {self.n_blocks} blocks of {self.block_size} tokens "
                    f"cannot hold {self.spec.batch_size} sequences of {n_tokens} tokens"
                )
            blocks.append(self.free_blocks.pop())
        return grown

    def prepare(self, start_pos: int | varlen.SeqBatch, n_new: int | None = None) -> None:
        if isinstance(start_pos, varlen.SeqBatch):
            self._varlen = paged_attend.varlen_rows(self, start_pos)
            return
        self._check_own_tables("an int position")
        end = start_pos + n_new
        grown = [self.ensure_blocks(seq, end) for seq in range(self.spec.batch_size)]  # every sequence, no short cut
        if any(grown):  # one small host-to-device copy every block_size steps, not every step
            need = blocks_for(end, self.block_size)
            self._sync_table(need)
        self.n_tokens = end

    def gather_index(self, index: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """index [b, nb] blocks -> (block, slot) of each sequence's first n positions, [b, n] each."""
        positions = torch.arange(n, device=index.device)  # [n]
        blocks = index[:, positions // self.block_size]  # [b, n]
        return blocks, (positions % self.block_size).expand_as(blocks)

    def _sync_table(self, need: int) -> None:
        """The host tables' first `need` blocks -> the device table (every sequence holds at least that many)."""
        rows = torch.tensor([blocks[:need] for blocks in self.tables], dtype=torch.long)  # [B, need]
        if self.table.is_cuda:  # pinned + non_blocking: the copy queues on the stream, the host never waits
            rows = host.pinned(rows)
        self.table[:, :need].copy_(rows, non_blocking=True)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start_pos: int | torch.Tensor | varlen.SeqBatch,
    ) -> torch.Tensor:
        if isinstance(start_pos, varlen.SeqBatch):  # sequences at their own positions, flattened
            if self.layer_loads is not None:  # a serving tier's loads, layer by layer (harness.serve.tier_loader)
                self.layer_loads.wait(layer)
            kernel = self._varlen_decode if self.attn_backend == "triton-paged" else None
            return varlen.attend(self, layer, q, k, v, start_pos, self._varlen, decode_in_place=kernel)
        if isinstance(start_pos, torch.Tensor):  # a decode step at static shapes: the position [1] on the device
            assert self._static is not None, "static shapes: after enable_static_decode"
            return self._static.attend(self, layer, q, k, v, start_pos)
        self._check_own_tables("an int position")  # not in the compiled step: enable_static_decode checked
        in_place = self.attn_backend in ("flashinfer", "triton-paged")
        if q.shape[2] == 1 and in_place:  # a decode step: read the blocks in place
            self._write(layer, k, v, start_pos)
            n_tokens = start_pos + 1
            return paged_attend.decode_in_place(
                self, layer, q, self._lengths(q.shape[0], n_tokens), max_len=n_tokens
            ).unsqueeze(2)
        k_seq, v_seq = self.store_and_read(layer, k, v, start_pos, dtype=q.dtype)
        return attention(q, k_seq, v_seq, start_pos, impl=self.spec.attn_impl, scale=self.spec.softmax_scale)

    def store_and_read(
        self, layer: int, k: torch.Tensor, v: torch.Tensor | None, start_pos: int, *, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (v None: MLA's latent) at start_pos.., then gather positions 0..end-1 in table order,
        [B, H_kv, end, D] each in dtype (default k's). For the latent, V is the view K[..., :latent_v_dim]."""
        self._write(layer, k, v, start_pos)
        return self._gather(layer, start_pos + k.shape[2], k.dtype if dtype is None else dtype)

    def _varlen_decode(self, layer: int, q: torch.Tensor, rows: varlen.VarlenRows) -> torch.Tensor:
        """The decoding sequences of a SeqBatch through the Triton kernel: q [b, H, D] over each one's blocks (its
        padded table, its length on the device) -> [b, H, D]. FlashInfer plans on the host per batch shape, so a
        serving step, whose batch changes every iteration, takes the Triton kernel."""
        return paged_attend.triton_decode(
            self, layer, q, rows.indices["decode"], rows.decode_lens, max_len=rows.decode_keys
        )

    def _lengths(self, batch: int, n_tokens: int) -> torch.Tensor:
        """[B] int32 on the device, every sequence at n_tokens: made once per step, read by every layer."""
        if self._lens is None or self._lens[0] != (batch, n_tokens):
            self._lens = (batch, n_tokens), torch.full((batch,), n_tokens, dtype=torch.int32, device=self.spec.device)
        return self._lens[1]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> None:
        """Store k, v [B, H_kv, T, D] at positions start_pos..start_pos+T-1, through the block table."""
        self.format.write(self, layer, k, v, start_pos)

    def _gather(self, layer: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..end-1 in table order as [B, H_kv, end, D] each, in dtype."""
        return self.format.read(self, layer, end, dtype)

    # harness.kv.quant.RowStore. Row r of a part with g tokens per row covers positions r*g..: it lives in block
    # table[b, r*g // bs], slot r % rows_per_block (g = 1, the data: block p // bs, slot p % bs).
    # `first` is a device tensor [1] in a static-shape step: the same index arithmetic, nothing read on the host.
    def put_rows(self, layer: int, name: str, x: torch.Tensor, first: int | torch.Tensor) -> None:
        part = self.rows[name][layer]  # [N, H_kv, rows per block, width]
        rows = first + torch.arange(x.shape[2], device=x.device)  # [n]
        blocks = self.table[:, rows * self.tokens_per_row[name] // self.block_size]  # [B, n]
        slots = (rows % part.shape[2]).expand_as(blocks)  # [B, n]
        values = x.transpose(1, 2).to(part.dtype)  # [B, n, H_kv, width], as the indexed view
        if values.dtype in FP8.values():  # CUDA's index_put_ may lack an fp8 kernel: write the same bytes as uint8
            part, values = part.view(torch.uint8), values.view(torch.uint8)
        part[blocks, :, slots] = values

    def get_rows(self, layer: int, name: str, n: int) -> torch.Tensor:
        part = self.rows[name][layer]  # [N, H_kv, rows per block, width]
        rows_per_block, tokens = part.shape[2], self.tokens_per_row[name]
        if rows_per_block * tokens == self.block_size:  # every block holds rows: the table's first blocks, in order
            table = self.table[:, : blocks_for(n, rows_per_block)]
        else:  # a row per group of several blocks: the first block of each group
            table = self.table[:, torch.arange(n, device=part.device) * tokens // self.block_size]
        blocks = part[table]  # [B, nb, H_kv, rows per block, width]
        batch, n_blocks, heads, _, width = blocks.shape
        return blocks.transpose(1, 2).reshape(batch, heads, n_blocks * rows_per_block, width)[:, :, :n]

    def read_blocks(self, blocks: list[int]) -> dict[str, torch.Tensor]:
        """What `blocks` store, part by part (k, v, and a quantized format's scales): name -> [L, n, H_kv, rows,
        width], a copy on the device, in the order given. With write_blocks, the unit a tier or a transfer moves."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.spec.device)
        return {name: pool.index_select(1, index) for name, pool in self.rows.items() if pool is not None}

    def write_blocks(self, blocks: list[int], parts: dict[str, torch.Tensor]) -> None:
        """Store `parts` (read_blocks' shapes, on any device) into `blocks` of this pool."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.spec.device)
        for name, pool in self.rows.items():
            if pool is None:
                continue
            part = parts[name].to(pool.device, non_blocking=True)
            if pool.element_size() == 1:  # as bytes: the CPU's index_copy_ has no float8 kernel
                pool, part = pool.view(torch.uint8), part.view(torch.uint8)
            pool.index_copy_(1, index, part)

    def release(self) -> None:
        """The batch completed: every block goes back to the pool."""
        self._check_own_tables("release")
        for blocks in self.tables:
            self.free_blocks.extend(reversed(blocks))
            blocks.clear()
        self.n_tokens = 0

    def blocks_in_use(self) -> int:
        self._check_own_tables("blocks_in_use")
        return sum(len(blocks) for blocks in self.tables)

    def data_tensors(self) -> list[torch.Tensor]:
        return self.pools  # every block, in use or free

    def scale_tensors(self) -> list[torch.Tensor]:
        return list(self.scales.values())

    def tail_tensors(self) -> list[torch.Tensor]:
        # int4's full-precision tail (format.tensors()): per sequence, outside the pool, at most kv_residual +
        # kv_group_size - 1 tokens
        return self.format.tensors()


class PagedLayout(Layout):
    """A pool of blocks: pool_tokens rounded up to blocks, or by default exactly what the point needs at its peak;
    reads gather whole blocks through the table (the CPU path; a kernel on CUDA reads them in place)."""

    stores_latent: ClassVar[bool] = True

    def shared_blocks(self, shape) -> int:
        """Blocks every sequence's table shares, held once (prefix caching); 0 here."""
        return 0

    def pool_blocks(self, shape) -> int:
        if self.options.pool_tokens is not None:
            return blocks_for(self.options.pool_tokens, self.options.block_size)
        return self.blocks_needed(shape)

    def blocks_needed(self, shape) -> int:
        """Blocks the batch holds at its peak: ceil(S / bs) per sequence, the shared ones once."""
        per_sequence = blocks_for(shape.max_tokens, self.options.block_size)
        return shape.batch_size * per_sequence - (shape.batch_size - 1) * self.shared_blocks(shape)

    def allocation(self, shape) -> KVAllocation:
        """K and V pools each [L, N, H_kv, bs, w] (MLA: one latent pool [L, N, 1, bs, w]); each scale part
        [L, N, H_kv, rows per block, width]."""
        args, block_size = shape.model, self.options.block_size
        lead = args.n_layers * self.pool_blocks(shape) * args.cache_heads
        data = lead * args.cache_sides * block_size * data_row_bytes(shape)
        scales = sum(
            lead * rows_per_block(block_size, tokens) * width * SCALE_BYTES for tokens, width in scale_parts(shape)
        )
        return KVAllocation(data, scale_bytes=scales, tail_bytes=int4_tail_bytes(shape))

    def pool_fits(self, shape) -> bool:
        return self.blocks_needed(shape) <= self.pool_blocks(shape)

    def transients(self, shape, *, n_seqs: int, n_new: int, n_keys: int) -> tuple[int, int, int]:
        """A read gathers each side through the block table, twice (the index, then a reshape), whole blocks."""
        width, block_size, sides = cache_width(shape), self.options.block_size, shape.model.cache_sides
        new, keys = n_seqs * n_new * width, n_seqs * n_keys * width  # values written and read back per side
        keys_rounded = n_seqs * blocks_for(n_keys, block_size) * block_size * width
        gathered = keys_rounded * BITS[shape.kv_dtype] // 8  # one side's payload gathered from the pool
        if shape.kv_dtype not in PLAIN_NAMES:
            return codec_transients(shape, new=new, keys=keys, gathered=gathered)
        b, kv_b = DTYPE_BYTES[shape.dtype], DTYPE_BYTES[shape.kv_dtype]
        write = new * kv_b if kv_b != b else 0
        result = keys * b if kv_b != b else gathered
        read_peak = result + 2 * gathered if kv_b == b else result + max(2 * gathered, gathered + keys * b)
        return write, read_peak, sides * result

    def check(self, shape) -> None:
        group, block = shape.kv_group_size, self.options.block_size
        if shape.kv_dtype == "int4" and block % group and group % block:
            raise ConfigError(
                f"cache.block_size: {block} cannot hold whole int4 key groups of {group} tokens; allowed: a "
                f"divisor or a multiple of {group}"
            )

    def mixed_batch(self, spec: CacheSpec, lengths: list[int]) -> PagedCache:
        """A pool of exactly the blocks these requests take at their peak, every sequence grown to its length:
        nothing spare is counted as waste."""
        block_size = self.options.block_size
        pool_tokens = sum(blocks_for(length, block_size) for length in lengths) * block_size
        cache = PagedCache(spec, dataclasses.replace(self.options, pool_tokens=pool_tokens))
        for seq, length in enumerate(lengths):
            cache.ensure_blocks(seq, length)
        assert not cache.free_blocks, "the pool was sized to the blocks in use"
        return cache


STRATEGY = PagedCache
LAYOUT = PagedLayout
SERVING = Serving(pool="blocks")  # its own pool, the block tables kept by the scheduler
