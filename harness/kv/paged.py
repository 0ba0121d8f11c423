"""Paged KV cache: a global pool of fixed-size blocks and a block table per sequence (vLLM's PagedAttention).

Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention". A sequence
takes a block only when it grows into it and returns all of them on completion, so the waste per sequence is at
most one partly filled block instead of everything reserved up to its maximum length. Paging cuts fragmentation,
not the total: the tokens present cost exactly what they cost in a contiguous buffer.

Attention follows the block table. A decode step on CUDA reads the blocks in place: FlashInfer's paged decode for
fp16/bf16 storage when `flashinfer` is installed, else the Triton kernel of harness.kv.triton_paged (plain, int8 and
fp8 storage, dequantized in registers). Prefill, int4, and the CPU gather the sequence's blocks into a contiguous
tensor first and run SDPA over it. `attn_backend` says which decode path ran: "flashinfer", "triton-paged" or
"sdpa-gather".

Quantized formats (harness.kv.quant) keep their narrow data in the pool and their scales in pools of their own,
block for block, so a block returned to the pool frees its scales too. int4 key scales cover a group of
kv_group_size tokens, so block_size must divide it or be a multiple of it.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.kv.base import CacheSpec, KVPoolExhausted, Unsupported, attention, blocks_for
from harness.kv.quant import storage_format

log = logging.getLogger(__name__)
FLASHINFER_DTYPES = ("fp16", "bf16")  # what its paged decode reads here; fp8 would need its own scale layout
FLASHINFER_WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's documented default for its split-K scratch


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
        self.format = storage_format(spec)
        parts = self.format.parts()
        data = parts.pop("data")
        shape = (spec.n_layers, 2, n_blocks, spec.n_kv_heads, self.block_size, data.width)
        # [L, K|V, N, H_kv, bs, D] (int4: D / 2 bytes, two values each)
        self.pool = torch.zeros(shape, dtype=data.dtype, device=spec.device)
        self.tokens_per_row = {"k": 1, "v": 1} | {name: part.tokens for name, part in parts.items()}
        self.scales = {  # name -> [L, N, H_kv, rows per block, width]; empty for plain formats
            name: torch.zeros(
                (spec.n_layers, n_blocks, spec.n_kv_heads, self._rows_per_block(part.tokens), part.width),
                dtype=part.dtype,
                device=spec.device,
            )
            for name, part in parts.items()
        }
        self.rows = {"k": self.pool[:, 0], "v": self.pool[:, 1], **self.scales}  # views, by part name
        self.free_blocks = list(range(n_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first
        self.tables: list[list[int]] = [[] for _ in range(spec.batch_size)]  # per sequence: block ids in order
        # The same tables on the device, for gathers: [B, blocks_per_seq]; refreshed only when a block is added.
        self.table = torch.zeros((spec.batch_size, blocks_per_seq), dtype=torch.long, device=spec.device)
        self.n_tokens = 0  # tokens present per sequence (all sequences of a batch move in step)
        self.attn_backend = self._decode_backend()
        self._lens: tuple[tuple[int, int], torch.Tensor] | None = None  # (batch, tokens) -> [B] int32 on the device
        self._flashinfer = None  # its decode wrapper, made at the first decode step
        self._flashinfer_plan: tuple[int, int] | None = None  # (batch, tokens) the wrapper is planned for

    def _decode_backend(self) -> str:
        """Which decode attention this cache runs: in place on CUDA when a kernel can read its format, else a gather.
        The kernel modules are imported only on CUDA: the CPU never pays for importing triton."""
        spec = self.spec
        if spec.device.type != "cuda":
            return "sdpa-gather"
        if spec.kv_dtype in FLASHINFER_DTYPES and importlib.util.find_spec("flashinfer") is not None:
            return "flashinfer"
        from harness.kv import triton_paged

        reason = triton_paged.kernel_unsupported(spec.kv_dtype, spec.device)
        if reason is None:
            return "triton-paged"
        log.warning("paged %s on %s decodes by gathering the blocks: %s", spec.kv_dtype, spec.device, reason)
        return "sdpa-gather"

    def _rows_per_block(self, tokens_per_row: int) -> int:
        """A part with a row per `tokens_per_row` positions (int4 key scales: per group) keeps its rows in the
        blocks of those positions. A group larger than a block keeps its row in the group's first block (the
        others' row stays unused: honest, if wasteful); any other ratio cannot be addressed by block."""
        if self.block_size % tokens_per_row == 0:
            return self.block_size // tokens_per_row
        if tokens_per_row % self.block_size == 0:
            return 1
        divisors = ", ".join(str(d) for d in range(1, tokens_per_row + 1) if tokens_per_row % d == 0)
        raise Unsupported(
            f"block_size {self.block_size} cannot hold whole int4 key groups of kv_group_size={tokens_per_row} "
            f"tokens; allowed: block_size dividing or a multiple of it ({divisors}, or a multiple of {tokens_per_row})"
        )

    def ensure_blocks(self, seq: int, n_tokens: int) -> bool:
        """Grow sequence `seq`'s table to cover n_tokens positions; returns whether it took a block."""
        blocks = self.tables[seq]
        need = blocks_for(n_tokens, self.block_size)
        grown = len(blocks) < need
        while len(blocks) < need:
            if not self.free_blocks:
                raise KVPoolExhausted(
                    f"paged KV pool exhausted: {self.pool.shape[2]} blocks of {self.block_size} tokens "
                    f"cannot hold {self.spec.batch_size} sequences of {n_tokens} tokens"
                )
            blocks.append(self.free_blocks.pop())
        return grown

    def prepare(self, start_pos: int, n_new: int) -> None:
        end = start_pos + n_new
        grown = [self.ensure_blocks(seq, end) for seq in range(self.spec.batch_size)]  # every sequence, no short cut
        if any(grown):  # one small host-to-device copy every block_size steps, not every step
            need = blocks_for(end, self.block_size)
            rows = torch.tensor([b[:need] for b in self.tables], dtype=torch.long)
            if self.table.is_cuda:  # pinned + non_blocking: the copy queues on the stream, the host never waits
                rows = rows.pin_memory()
            self.table[:, :need].copy_(rows, non_blocking=True)
        self.n_tokens = end

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        self._write(layer, k, v, start_pos)
        if q.shape[2] == 1 and self.attn_backend != "sdpa-gather":  # a decode step: read the blocks in place
            return self._decode_in_place(layer, q, n_tokens=start_pos + 1).unsqueeze(2)
        k_seq, v_seq = self._gather(layer, start_pos + k.shape[2], q.dtype)
        return attention(q, k_seq, v_seq, start_pos)

    def _decode_in_place(self, layer: int, q: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """q [B, H, 1, D] over the first n_tokens positions of every sequence, through the block table -> [B, H, D]."""
        batch = q.shape[0]
        k_pool, v_pool = self.rows["k"][layer], self.rows["v"][layer]  # [N, H_kv, bs, D] each
        if self.attn_backend == "flashinfer":
            self._plan_flashinfer(q, n_tokens)
            return self._flashinfer.run(q[:, :, 0].contiguous(), (k_pool, v_pool))
        from harness.kv import triton_paged

        scales = {}
        if self.scales:  # int8/fp8: [N, H_kv, bs, 1] per token -> [N, H_kv, bs]
            scales = {
                "k_scale": self.scales["k_scale"][layer][..., 0],
                "v_scale": self.scales["v_scale"][layer][..., 0],
            }
        return triton_paged.paged_decode(
            q[:, :, 0],
            k_pool,
            v_pool,
            self.table[:batch],
            self._lengths(batch, n_tokens),
            block_size=self.block_size,
            max_len=n_tokens,
            **scales,
        )

    def _lengths(self, batch: int, n_tokens: int) -> torch.Tensor:
        """[B] int32 on the device, every sequence at n_tokens: made once per step, read by every layer."""
        if self._lens is None or self._lens[0] != (batch, n_tokens):
            self._lens = (batch, n_tokens), torch.full((batch,), n_tokens, dtype=torch.int32, device=self.spec.device)
        return self._lens[1]

    def _plan_flashinfer(self, q: torch.Tensor, n_tokens: int) -> None:
        """FlashInfer plans a decode once per step (its split-K schedule) for the whole batch's page lists (HND
        layout: a page is [H_kv, page_size, D], which is this pool's block)."""
        import flashinfer

        batch, n_heads, _, head_dim = q.shape
        if self._flashinfer is None:
            workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            self._flashinfer = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, kv_layout="HND", use_tensor_cores=n_heads // self.spec.n_kv_heads >= 4
            )
        if self._flashinfer_plan == (batch, n_tokens):
            return
        n_pages = blocks_for(n_tokens, self.block_size)
        indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * n_pages  # [B + 1]
        indices = self.table[:batch, :n_pages].reshape(-1).to(torch.int32)  # [B * n_pages]
        last_page_len = torch.full((batch,), n_tokens - (n_pages - 1) * self.block_size, dtype=torch.int32)
        self._flashinfer.plan(
            indptr,
            indices,
            last_page_len.to(q.device),
            n_heads,
            self.spec.n_kv_heads,
            head_dim,
            self.block_size,
            q_data_type=q.dtype,
            kv_data_type=self.pool.dtype,
        )
        self._flashinfer_plan = (batch, n_tokens)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> None:
        """Store k, v [B, H_kv, T, D] at positions start_pos..start_pos+T-1, through the block table."""
        self.format.write(self, layer, k, v, start_pos)

    def _gather(self, layer: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..end-1 in table order as [B, H_kv, end, D] each, in dtype."""
        return self.format.read(self, layer, end, dtype)

    # harness.kv.quant.RowStore. Row r of a part with g tokens per row covers positions r*g..: it lives in block
    # table[b, r*g // bs], slot r % rows_per_block (g = 1, the data: block p // bs, slot p % bs).
    def put_rows(self, layer: int, name: str, x: torch.Tensor, first: int) -> None:
        part = self.rows[name][layer]  # [N, H_kv, rows per block, width]
        rows = torch.arange(first, first + x.shape[2], device=x.device)
        blocks = self.table[:, rows * self.tokens_per_row[name] // self.block_size]  # [B, n]
        slots = (rows % part.shape[2]).expand_as(blocks)  # [B, n]
        part[blocks, :, slots] = x.transpose(1, 2).to(part.dtype)  # indexed view is [B, n, H_kv, width]

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

    def release(self) -> None:
        """The batch completed: every block goes back to the pool."""
        for blocks in self.tables:
            self.free_blocks.extend(reversed(blocks))
            blocks.clear()
        self.n_tokens = 0

    def blocks_in_use(self) -> int:
        return sum(len(blocks) for blocks in self.tables)

    def kv_bytes_allocated(self) -> int:
        # Data and scales for every block, and the int4 full-precision tail (format.tensors(): per sequence,
        # outside the pool, at most kv_residual + kv_group_size - 1 tokens).
        tensors = [self.pool, *self.scales.values(), *self.format.tensors()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def kv_bytes_live(self) -> int:
        return int(self.n_tokens * self.spec.batch_size * self.spec.bytes_per_token)

    def kv_scale_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.scales.values())

    def kv_tail_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.format.tensors())


STRATEGY = PagedCache
