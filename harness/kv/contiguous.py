"""Static per-sequence buffers, preallocated for prompt_len + gen_len (gpt-fast's KVCache).

Every sequence owns max_tokens slots from the start, used or not: simple and fast, and the over-reservation that
PagedAttention (Kwon et al. 2023) removes.

Quantized formats (harness.kv.quant) keep their narrow data in the same buffers and their scales in buffers of
their own, with a row per token (or per group of tokens, for int4 keys); a plain format reads back a slice of the
buffer, with no copy. On CUDA, an int8 or fp8 decode step reads the codes in place with the Triton kernel of
harness.kv.triton_paged (the buffer is a pool of one block per sequence), so no dequantized copy of the context is
ever made; elsewhere the filled part is dequantized and attended with SDPA.

Static shapes (`compile`, harness.modeling.decode.compile_decode_step): a decode step whose position comes as a tensor on the
device writes with index_copy_ and attends over the whole preallocated buffer under a length mask, as gpt-fast does,
so that every step has the same shapes and CUDA graphs can replay it.

`attn_backend`: "sdpa" (a slice of the buffer), "sdpa-masked" (static shapes), "triton-dequant" (the kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness import kv
from harness.errors import Unsupported
from harness.kv import varlen
from harness.kv.base import CacheSpec, Layout, Serving, attention, blocks_for, grouped_attention
from harness.kv.quant import FP8, Int4Kivi, TokenFormat, storage_format


@dataclass(frozen=True)
class Options:
    """`contiguous` takes no options: its size is the sweep point's prompt_len + gen_len."""


class ContiguousCache(kv.KVCache):
    name: ClassVar[str] = "contiguous"
    recomputes_prefix: ClassVar[bool] = False
    prefix_hit: ClassVar[None] = None

    def __init__(self, spec: CacheSpec, options: Options) -> None:
        self.spec = spec
        self.format = storage_format(spec)
        parts = self.format.parts()
        data = parts.pop("data")
        lead = (spec.n_layers, spec.batch_size, spec.n_kv_heads)
        shape = (*lead, spec.max_tokens, data.width)
        # K and V each [L, B, H_kv, S_max, D] (int4: D / 2 bytes, two values each). Two tensors, not two views of
        # one: a compiled step that mutates two views of one base makes AOTAutograd merge them into a synthetic base
        # that is no longer a static input, and CUDA graph trees then skip the graph (harness.modeling.decode).
        self.k = torch.zeros(shape, dtype=data.dtype, device=spec.device)
        # MLA's latent (spec.latent_v_dim): V is K's first channels, so no V buffer.
        self.v = torch.zeros(shape, dtype=data.dtype, device=spec.device) if "v" in spec.sides else None
        self.scales = {  # name -> [L, B, H_kv, S_max / tokens per row, width]; empty for plain formats
            name: torch.zeros(
                (*lead, blocks_for(spec.max_tokens, part.tokens), part.width), dtype=part.dtype, device=spec.device
            )
            for name, part in parts.items()
        }
        self.rows = {"k": self.k, "v": self.v, **self.scales}  # by part name
        self.buffers = [t for t in (self.k, self.v) if t is not None]
        self.n_tokens = 0
        self.fused_dequant = self._kernel_reads(spec)  # int8/fp8 on CUDA: decode reads the codes in place
        self.attn_backend = "triton-dequant" if self.fused_dequant else "sdpa"
        self._lens: tuple[int, torch.Tensor] | None = None  # (tokens, [B] int32 on the device), one per step
        self._varlen: varlen.VarlenRows | None = None  # the current SeqBatch's addresses (prepare)
        # The kernel's block table: sequence b is block b, of S_max tokens.
        self._one_block_table = torch.arange(spec.batch_size, device=spec.device)[:, None]  # [B, 1]
        # Set by enable_static_decode: [S_max] positions for the length mask; the kernel's split count.
        self._positions: torch.Tensor | None = None
        self._static_splits: int | None = None

    @staticmethod
    def _kernel_reads(spec: CacheSpec) -> bool:
        if spec.device.type != "cuda" or not (spec.kv_dtype == "int8" or spec.kv_dtype in FP8):
            return False
        if spec.attn_impl == "eager":  # the kernel is fused attention: eager materializes the scores instead
            return False
        if spec.latent_v_dim:  # the kernel reads a V buffer of K's width; MLA's latent has none: gather and SDPA
            return False
        from harness.kv import triton_paged  # imported on CUDA only: the CPU never pays for importing triton

        return triton_paged.kernel_unsupported(spec.kv_dtype, spec.device) is None

    supports_static_decode: ClassVar[bool] = True  # decode steps at static shapes: enable_static_decode, below

    def enable_static_decode(self) -> None:
        """Prepare decode steps at static shapes (harness.modeling.decode.compile_decode_step): mark every tensor the step
        reads or writes as living at a fixed address (`static_tensors`), so that CUDA graphs update them in place
        instead of copying them in, and fix what the graph needs once: the positions of the length mask, or the
        kernel's split count for the longest context."""
        if self.spec.kv_dtype == "int4":
            raise Unsupported("compile: int4 (KIVI) quantizes key groups as they complete, a data-dependent write")
        if self.spec.latent_v_dim:
            raise Unsupported("compile: MLA's latent cache decodes eagerly; allowed: compile=none")
        spec = self.spec
        self._positions = torch.arange(spec.max_tokens, device=spec.device)  # [S_max]
        for tensor in self.static_tensors():
            torch._dynamo.mark_static_address(tensor)
        if self.fused_dequant:
            from harness.kv import triton_paged

            self._static_splits = triton_paged.split_count(
                batch=spec.batch_size, n_kv_heads=spec.n_kv_heads, max_len=spec.max_tokens, device=spec.device
            )
        else:
            self.attn_backend = "sdpa-masked"

    def static_tensors(self) -> list[torch.Tensor]:
        """What a static-shape decode step reads from this cache: K, V, their scales, the mask's positions (masked
        path) or the kernel's one-block table (fused path). Each is a tensor of its own, none a view of another."""
        extra = [self._one_block_table] if self.fused_dequant else [self._positions]
        return [*self.buffers, *self.scales.values(), *extra]

    def prepare(self, start_pos: int | varlen.SeqBatch, n_new: int | None = None) -> None:
        if isinstance(start_pos, varlen.SeqBatch):
            self._varlen = self._varlen_rows(start_pos)
            return
        if start_pos + n_new > self.spec.max_tokens:
            raise ValueError(f"contiguous cache holds {self.spec.max_tokens} tokens, asked for {start_pos + n_new}")
        self.n_tokens = start_pos + n_new

    def _varlen_rows(self, batch: varlen.SeqBatch) -> varlen.VarlenRows:
        """Per-sequence lengths (harness.kv.varlen): sequence i lives in row batch.slots[i] of every buffer, its
        token at position p in column p."""
        if not isinstance(self.format, TokenFormat):
            raise Unsupported(
                f"per-sequence lengths: {self.spec.kv_dtype} groups tokens across positions; allowed: "
                "plain, fp8 and int8 formats"
            )
        longest = max(batch.ends)
        if longest > self.spec.max_tokens or max(batch.slots) >= self.spec.batch_size:
            raise ValueError(
                f"contiguous cache holds {self.spec.batch_size} slots of {self.spec.max_tokens} tokens, "
                f"asked for slot {max(batch.slots)} at {longest} tokens"
            )
        slots = [slot for slot, n in zip(batch.slots, batch.n_new, strict=True) for _ in range(n)]
        indices = {"decode": [[batch.slots[i]] for i in batch.decode_seqs]}
        indices |= {i: [[batch.slots[i]]] for i in batch.prefill_seqs}
        return varlen.VarlenRows(self, batch, row_index=slots, col_index=batch.positions, indices=indices)

    def gather_index(self, index: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """index [b, 1] slots -> (slot, position) of each sequence's first n positions, [b, n] each."""
        positions = torch.arange(n, device=index.device)[None, :]  # [1, n]
        return index.expand(-1, n), positions.expand(index.shape[0], -1)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start_pos: int | torch.Tensor | varlen.SeqBatch,
    ) -> torch.Tensor:
        if isinstance(start_pos, torch.Tensor):  # a decode step at static shapes: the position [1] on the device
            return self._attend_static(layer, q, k, v, start_pos)
        if isinstance(start_pos, varlen.SeqBatch):  # sequences at their own positions, flattened
            return varlen.attend(self, layer, q, k, v, start_pos, self._varlen)
        if q.shape[2] == 1 and self.fused_dequant:
            self._write(layer, k, v, start_pos)
            n_tokens = start_pos + 1
            return self._decode_in_place(layer, q, self._lengths(n_tokens), max_len=n_tokens)
        k_seq, v_seq = self.store_and_read(layer, k, v, start_pos, dtype=q.dtype)
        return attention(q, k_seq, v_seq, start_pos, impl=self.spec.attn_impl, scale=self.spec.softmax_scale)

    def store_and_read(
        self, layer: int, k: torch.Tensor, v: torch.Tensor | None, start_pos: int, *, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (v None: MLA's latent) at start_pos.., then read positions 0..end-1 back, [B, H_kv, end, D]
        each in dtype (default k's): only the filled part, so attention costs what the context costs, not what was
        reserved. For the latent, V is the view K[..., :latent_v_dim]."""
        self._write(layer, k, v, start_pos)
        return self._gather(layer, start_pos + k.shape[2], k.dtype if dtype is None else dtype)

    def _attend_static(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """One token at position pos [1] (a device tensor): the same shapes at every step, whatever the position."""
        assert q.shape[2] == 1 and self._positions is not None, "static shapes: one token, after enable_static_decode"
        self._write(layer, k, v, pos)
        if self.fused_dequant:  # the kernel reads only the filled positions: their count comes from the device
            lens = (pos + 1).to(torch.int32).expand(q.shape[0]).contiguous()  # [B]
            return self._decode_in_place(layer, q, lens, max_len=self.spec.max_tokens, n_splits=self._static_splits)
        k_all, v_all = self._gather(layer, self.spec.max_tokens, q.dtype)  # [B, H_kv, S_max, D]: the whole buffer
        mask = (self._positions <= pos)[None, :]  # [1, S_max]: the filled part
        return grouped_attention(q, k_all, v_all, mask=mask, impl=self.spec.attn_impl)

    def _decode_in_place(
        self, layer: int, q: torch.Tensor, lens: torch.Tensor, *, max_len: int, n_splits: int | None = None
    ) -> torch.Tensor:
        """q [B, H, 1, D] over the stored codes, dequantized in the kernel: the buffer [B, H_kv, S_max, D] is a
        pool of B blocks of S_max tokens, sequence b in block b; lens [B] -> [B, H, 1, D]."""
        from harness.kv import triton_paged

        out = triton_paged.paged_decode(
            q[:, :, 0],
            self.rows["k"][layer],
            self.rows["v"][layer],
            self._one_block_table,
            lens,
            block_size=self.spec.max_tokens,
            max_len=max_len,
            k_scale=self.scales["k_scale"][layer][..., 0],  # [B, H_kv, S_max]
            v_scale=self.scales["v_scale"][layer][..., 0],
            n_splits=n_splits,
        )
        return out.unsqueeze(2)

    def _lengths(self, n_tokens: int) -> torch.Tensor:
        """[B] int32 on the device, every sequence at n_tokens: made once per step, read by every layer."""
        if self._lens is None or self._lens[0] != n_tokens:
            self._lens = (
                n_tokens,
                torch.full((self.spec.batch_size,), n_tokens, dtype=torch.int32, device=self.spec.device),
            )
        return self._lens[1]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> None:
        self.format.write(self, layer, k, v, start_pos)

    def _gather(self, layer: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..end-1 as [B, H_kv, end, D] each, in dtype."""
        return self.format.read(self, layer, end, dtype)

    # harness.kv.quant.RowStore: a part's rows are its buffer's sequence axis.
    def put_rows(self, layer: int, name: str, x: torch.Tensor, first: int | torch.Tensor) -> None:
        if isinstance(first, torch.Tensor):  # static shapes: the row index stays on the device
            rows, x = self.rows[name][layer], x.to(self.rows[name].dtype)
            if rows.dtype in FP8.values():  # index_copy_ has no fp8 kernel: copy the same bytes as uint8
                rows, x = rows.view(torch.uint8), x.view(torch.uint8)
            rows.index_copy_(2, first, x)
        else:
            self.rows[name][layer][:, :, first : first + x.shape[2]] = x

    def get_rows(self, layer: int, name: str, n: int) -> torch.Tensor:
        return self.rows[name][layer][:, :, :n]  # a view

    def export_kv(self, n_tokens: int) -> dict[str, torch.Tensor]:
        """What the first n_tokens of every sequence hold, as contiguous copies (a prefill instance's KV for a decode
        instance, harness.movement.disagg): "k" and "v" [L, B, H_kv, n, width] (MLA's latent: no "v"), each scale part's rows
        covering them [L, B, H_kv, ceil(n / tokens per row), width], and int4's full-precision tail as "tail_k",
        "tail_v" [L, B, H_kv, capacity, D], whole: a ring addressed by position, so any slot may hold a live token."""
        if not 0 < n_tokens <= self.n_tokens:
            raise ValueError(f"export_kv: n_tokens must be in 1..{self.n_tokens} (the tokens written), got {n_tokens}")
        if isinstance(self.format, Int4Kivi) and n_tokens != self.n_tokens:
            # Which key groups are quantized, and what the tail ring holds, is the state after all n_tokens written;
            # the first n_tokens of a longer int4 cache are a state it never passed through.
            raise ValueError(f"export_kv: int4 exports the tokens written, {self.n_tokens}, not {n_tokens}")
        rows_per_part = {name: blocks_for(n_tokens, part.tokens) for name, part in self.format.parts().items()}
        parts = {side: buffer[:, :, :, :n_tokens].contiguous() for side, buffer in (("k", self.k), ("v", self.v))}
        parts |= {name: t[:, :, :, : rows_per_part[name]].contiguous() for name, t in self.scales.items()}
        parts |= {f"tail_{side}": t.clone() for side, t in getattr(self.format, "tail", {}).items()}
        return {name: t for name, t in parts.items() if t is not None}

    def import_kv(self, parts: dict[str, torch.Tensor], n_tokens: int) -> None:
        """Install export_kv(n_tokens)'s parts from a cache of the same spec: the next forward at position n_tokens
        continues exactly as it would have there. A tail arriving before this cache's first write becomes its tail
        (Int4Kivi allocates one only when it has none)."""
        expected = {"k", *(["v"] if self.v is not None else []), *self.scales}
        expected |= {f"tail_{side}" for side in self.spec.sides} if isinstance(self.format, Int4Kivi) else set()
        if set(parts) != expected and set(parts) != expected - {"tail_k", "tail_v"}:
            raise ValueError(f"import_kv: parts {sorted(parts)} do not match this cache's {sorted(expected)}")
        for name, t in parts.items():
            if name.startswith("tail_"):
                self.format.tail[name.removeprefix("tail_")] = t.to(self.spec.device, copy=True)
            else:
                self.rows[name][:, :, :, : t.shape[3]] = t
        self.n_tokens = n_tokens

    def release(self) -> None:
        self.n_tokens = 0  # the buffers stay reserved for the next batch, as in gpt-fast

    def data_tensors(self) -> list[torch.Tensor]:
        return self.buffers

    def scale_tensors(self) -> list[torch.Tensor]:
        return list(self.scales.values())

    def tail_tensors(self) -> list[torch.Tensor]:
        return self.format.tensors()  # int4's full-precision tail; none for the other formats


class ContiguousLayout(Layout):
    """The dense default (harness.kv.base.Layout): max_tokens rows per sequence, every key read in place."""

    stores_latent: ClassVar[bool] = True

    def mixed_batch(self, spec: CacheSpec, lengths: list[int]) -> ContiguousCache:
        """Every request reserves the longest it may become (spec.max_tokens), as servers before vLLM did."""
        return ContiguousCache(spec, self.options)


STRATEGY = ContiguousCache
LAYOUT = ContiguousLayout
SERVING = Serving(pool="slots")  # a slot of max_model_len tokens per running request, its row of the buffers
