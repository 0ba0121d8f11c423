"""How a paged cache (harness.kv.paged.PagedCache) attends other than by gathering its own table: a decode step in
place on CUDA, a decode step at static shapes (`StaticDecode`), and a SeqBatch's positions through the scheduler's
block tables (`varlen_rows`, serving).

Which kernel runs (`decode_backend`): FlashInfer's paged decode for fp16/bf16 storage read by queries of the same
dtype when `flashinfer` is installed, else the Triton kernel of harness.kv.triton_paged (plain, int8 and fp8 storage,
dequantized in registers), else (the CPU, eager attention, MLA's latent) a gather of the blocks into a contiguous
tensor. FlashInfer plans on the host every step from the host tables (`FlashInferDecode`); the Triton kernel takes
a table and the lengths on the device (`triton_decode`), so a compiled step and a serving step can run it.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from harness.errors import Unsupported
from harness.kv import host, varlen
from harness.kv.base import CacheSpec, blocks_for, grouped_attention
from harness.kv.quant import TokenFormat

log = logging.getLogger(__name__)
FLASHINFER_DTYPES = ("fp16", "bf16")  # what its paged decode reads here; fp8 would need its own scale layout
FLASHINFER_WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's documented default for its split-K scratch


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def decode_backend(spec: CacheSpec, *, static: bool = False) -> str:
    """Which decode attention a paged cache runs: in place on CUDA when a kernel can read its format, else a gather.

    FlashInfer's decode reads fp16/bf16 pages with queries of the same dtype only (its plan takes q_data_type and
    kv_data_type, and its kernels are instantiated for equal ones), so it needs the compute dtype to be the storage
    dtype; a static-shape (compiled) step never takes it, since it plans on the host every step. The kernel modules
    are imported only on CUDA: the CPU never pays for importing triton."""
    gather = "sdpa-gather-masked" if static else "sdpa-gather"
    # eager: the scores materialized, never a kernel; the kernels read a V pool of K's width, MLA's latent has none
    if spec.device.type != "cuda" or spec.attn_impl == "eager" or spec.latent_v_dim:
        return gather
    same_dtype = spec.dtype is not None and spec.kv_dtype == spec.dtype
    if not static and spec.kv_dtype in FLASHINFER_DTYPES and same_dtype and flashinfer_installed():
        return "flashinfer"
    from harness.kv import triton_paged

    reason = triton_paged.kernel_unsupported(spec.kv_dtype, spec.device)
    if reason is None:
        return "triton-paged"
    log.warning("paged %s on %s decodes by gathering the blocks: %s", spec.kv_dtype, spec.device, reason)
    return gather


def triton_decode(
    cache,
    layer: int,
    q: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    *,
    max_len: int,
    n_splits: int | None = None,
) -> torch.Tensor:
    """q [b, H, D] over the first lens[i] positions of each sequence, through `table` [b, max_blocks] (device
    tensors both) into the cache's pools -> [b, H, D]. max_len: a host-side bound on lens (the kernel's splits are
    sized by it; n_splits None: paged_decode sizes them). `cache` is a harness.kv.paged.PagedCache."""
    from harness.kv import triton_paged

    scales = {}
    if cache.scales:  # int8/fp8: [N, H_kv, bs, 1] per token -> [N, H_kv, bs]
        scales = {name: cache.scales[name][layer][..., 0] for name in ("k_scale", "v_scale")}
    return triton_paged.paged_decode(q, cache.k_pool[layer], cache.v_pool[layer], table, lens,
                                     block_size=cache.block_size, max_len=max_len, n_splits=n_splits,
                                     **scales)  # fmt: skip


def decode_in_place(cache, layer: int, q: torch.Tensor, lens: torch.Tensor, *, max_len: int) -> torch.Tensor:
    """A decode step of a static batch: q [B, H, 1, D] over the first lens[b] positions of each sequence, through the
    cache's own block table, by its attn_backend (flashinfer or triton-paged) -> [B, H, D]. max_len: a host-side
    bound on lens (the kernel's splits are sized by it, FlashInfer plans for it)."""
    if cache.attn_backend == "flashinfer":
        return cache.flashinfer.run(cache, layer, q, max_len)
    return triton_decode(cache, layer, q[:, :, 0], cache.table[: q.shape[0]], lens, max_len=max_len)


def flashinfer_page_lists(
    tables: list[list[int]], n_tokens: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page lists for sequences of n_tokens each, on the host: indptr [B + 1], indices
    [B * n_pages] (each sequence's first n_pages blocks, in table order), last_page_len [B], all int32."""
    n_pages = blocks_for(n_tokens, block_size)
    indptr = torch.arange(len(tables) + 1, dtype=torch.int32) * n_pages
    indices = torch.tensor([block for blocks in tables for block in blocks[:n_pages]], dtype=torch.int32)
    last_page_len = torch.full((len(tables),), n_tokens - (n_pages - 1) * block_size, dtype=torch.int32)
    return indptr, indices, last_page_len


class FlashInferDecode:
    """FlashInfer's decode wrapper over a paged cache's pools, planned once per step (its split-K schedule) for the
    whole batch's page lists (HND layout: a page is [H_kv, page_size, D], which is the pool's block)."""

    def __init__(self) -> None:
        self.wrapper = None  # made at the first decode step
        self.planned: tuple[int, int] | None = None  # (batch, tokens) the wrapper is planned for

    def run(self, cache, layer: int, q: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """q [B, H, 1, D] over each sequence's first n_tokens positions -> [B, H, D]."""
        self._plan(cache, q, n_tokens)
        return self.wrapper.run(q[:, :, 0].contiguous(), (cache.k_pool[layer], cache.v_pool[layer]))

    def _plan(self, cache, q: torch.Tensor, n_tokens: int) -> None:
        """The page lists go in as host tensors, built from the host tables, as vLLM's FlashInfer backend passes them:
        plan() reads indptr on the host to schedule, and copies the rest to its own device buffers without blocking,
        while device tensors would be copied back to the host first, a sync per step."""
        import flashinfer

        batch, n_heads, _, head_dim = q.shape
        pool_dtype = cache.k_pool.dtype
        assert q.dtype == pool_dtype, f"flashinfer decodes {pool_dtype} pages with equal queries, not {q.dtype}"
        if self.wrapper is None:
            workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, kv_layout="HND", use_tensor_cores=n_heads // cache.spec.n_kv_heads >= 4
            )
        if self.planned == (batch, n_tokens):
            return
        indptr, indices, last_page_len = flashinfer_page_lists(cache.tables[:batch], n_tokens, cache.block_size)
        self.wrapper.plan(
            host.pinned(indptr),
            host.pinned(indices),
            host.pinned(last_page_len),
            n_heads,
            cache.spec.n_kv_heads,
            head_dim,
            cache.block_size,
            q_data_type=q.dtype,
            kv_data_type=pool_dtype,
        )
        self.planned = (batch, n_tokens)


@dataclass(frozen=True)
class StaticDecode:
    """A paged cache's decode step at static shapes (harness.modeling.decode.compile_decode_step, after the cache's
    enable_static_decode): the compiled step receives its position as a device tensor, writes through the device
    table, and attends over every block the table can hold, with the Triton kernel (the lengths from the device) or
    a gather under a length mask."""

    positions: torch.Tensor  # [max_blocks * bs] for the length mask
    n_splits: int | None  # the Triton kernel's split count for the longest context; None: the gather

    @classmethod
    def for_cache(cls, cache) -> StaticDecode:
        spec, n_splits = cache.spec, None
        if cache.attn_backend == "triton-paged":
            from harness.kv import triton_paged

            n_splits = triton_paged.split_count(
                batch=spec.batch_size, n_kv_heads=spec.n_kv_heads, max_len=spec.max_tokens, device=spec.device
            )
        return cls(torch.arange(cache.table.shape[1] * cache.block_size, device=spec.device), n_splits)

    def attend(self, cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        """One token at position pos [1] (a device tensor): the same shapes at every step, whatever the position."""
        assert q.shape[2] == 1, "static shapes: one token"
        cache.format.write(cache, layer, k, v, pos)
        if cache.attn_backend == "triton-paged":  # the kernel reads only the filled positions: their count on device
            lens = (pos + 1).to(torch.int32).expand(q.shape[0]).contiguous()  # [B]
            table = cache.table[: q.shape[0]]
            out = triton_decode(cache, layer, q[:, :, 0], table, lens, max_len=cache.spec.max_tokens,
                                n_splits=self.n_splits)  # fmt: skip
            return out.unsqueeze(2)
        # Every block the table can hold, in table order, under a length mask: [B, H_kv, max_blocks * bs, D].
        k_all, v_all = cache.format.read(cache, layer, self.positions.shape[0], q.dtype)
        mask = (self.positions <= pos)[None, :]  # the filled part
        return grouped_attention(q, k_all, v_all, mask=mask, impl=cache.spec.attn_impl)


def varlen_rows(cache, batch: varlen.SeqBatch) -> varlen.VarlenRows:
    """A paged cache's addresses for one SeqBatch, per-sequence lengths (harness.kv.varlen), through the block
    tables the batch brings (a serving engine's scheduler owns them, as vLLM's does; a serving pool,
    PagedCache.for_scheduler, keeps none of its own): position p of sequence i is in block table_i[p // bs], slot
    p % bs. A block slid out of a window (None) is read as block 0, masked. `cache`: a harness.kv.paged.PagedCache."""
    if not isinstance(cache.format, TokenFormat):
        raise Unsupported(
            f"per-sequence lengths: {cache.spec.kv_dtype} groups tokens across positions; allowed: "
            "plain, fp8 and int8 formats"
        )
    if len(batch.block_tables) != len(batch):
        raise ValueError("paged cache: a SeqBatch must bring one block table per sequence")
    bs = cache.block_size
    row_index, col_index = [], []
    for table, start, end in zip(batch.block_tables, batch.start_pos, batch.ends, strict=True):
        if len(table) < blocks_for(end, bs) or any(table[p // bs] is None for p in range(start, end)):
            raise ValueError(
                f"paged cache: a block table of {len(table)} blocks cannot hold positions {start}..{end - 1}"
            )
        row_index += [table[p // bs] for p in range(start, end)]
        col_index += [p % bs for p in range(start, end)]

    def padded(seqs: list[int]) -> list[list[int]]:
        width = max(blocks_for(batch.ends[i], bs) for i in seqs)
        tables = [[0 if b is None else b for b in batch.block_tables[i][:width]] for i in seqs]
        return [table + [0] * (width - len(table)) for table in tables]

    indices = {"decode": padded(batch.decode_seqs)} if batch.decode_seqs else {"decode": []}
    indices |= {i: padded([i]) for i in batch.prefill_seqs}
    return varlen.VarlenRows(cache, batch, row_index=row_index, col_index=col_index, indices=indices)
