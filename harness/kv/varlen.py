"""Per-sequence lengths: one forward over sequences at different positions, as a serving engine runs it.

A static batch moves in step: every sequence at start_pos, n_new tokens each, tensors [B, T]. A serving iteration
(harness.serve.engine) holds decoding sequences at different positions and may carry prefill chunks of sequences
being admitted, so its tokens are flattened (vLLM v1's layout): tokens [1, N], N = sum of n_new, sequence i's
tokens at rows offsets[i]..offsets[i] + n_new[i] - 1 of that axis, and a `SeqBatch` saying where each one is.
`model.forward(tokens, start_pos=batch, cache)` and `cache.attend(layer, q, k, v, start_pos=batch)` take it in place
of an int; a static batch is the special case it never goes through, so static results and point_ids are unchanged.

Storage is addressed per token: a strategy maps token (sequence, position) to (row, column) of its parts (contiguous:
slot and position; paged: block and position % block_size, through the scheduler's block table), so every format of
harness.kv.quant writes through the same `put_rows` it always uses (`VarlenRows`), one indexed copy per part for the
whole forward. Attention (`attend`) writes every token of the layer first, so a sequence reading a block another
computes in the same forward (a prefix hit admitted beside its producer) reads it written; then:
- decoding sequences (n_new == 1) together: their keys gathered to the longest, [b, H_kv, S, D], under a key mask
  [b, 1, 1, S] (position < length; and within the window, for a sliding window), one SDPA call;
- each prefill chunk alone, over its own keys, with the causal (or banded) mask of its start position.
Both run the cache's spec.attn_impl: SDPA, or eager (harness.kv.base.eager_attention: the scores [.., q, keys]
written out, the static path's attn_impl=eager), which also turns off a strategy's own decode kernel.
Every index tensor is built on the host and copied once per forward, pinned and non-blocking: no host sync here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from harness.kv import host
from harness.kv.base import attention, eager_attention


@dataclass(frozen=True)
class SeqBatch:
    """Where each sequence of a flattened forward stands. Host-side tuples, one entry per sequence."""

    slots: tuple[int, ...]  # the sequence's storage: a contiguous cache's row; ignored by a paged one
    start_pos: tuple[int, ...]  # tokens already cached: this forward's first position
    n_new: tuple[int, ...]  # tokens this forward computes, >= 1
    block_tables: tuple[tuple[int | None, ...], ...] = ()  # paged: physical block per logical block (None: slid off)
    window: int | None = None  # sliding window: a query at p reads keys j with p - j < window

    def __post_init__(self) -> None:
        n = len(self.slots)
        if not (n == len(self.start_pos) == len(self.n_new)) or n == 0:
            raise ValueError(f"SeqBatch: slots, start_pos and n_new must be equal, non-empty; got {n}")
        if self.block_tables and len(self.block_tables) != n:
            raise ValueError(f"SeqBatch: {len(self.block_tables)} block tables for {n} sequences")
        if min(self.n_new) < 1 or min(self.start_pos) < 0:
            raise ValueError("SeqBatch: n_new must be >= 1 and start_pos >= 0 for every sequence")

    @classmethod
    def uniform(cls, *, batch_size: int, start_pos: int, n_new: int) -> SeqBatch:
        """A static batch written as a SeqBatch (tests compare the two paths on it)."""
        return cls(tuple(range(batch_size)), (start_pos,) * batch_size, (n_new,) * batch_size)

    def __len__(self) -> int:
        return len(self.slots)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Sequence i's first row on the flattened token axis; one more entry: N."""
        out = [0]
        for n in self.n_new:
            out.append(out[-1] + n)
        return tuple(out)

    @property
    def n_tokens(self) -> int:
        return self.offsets[-1]

    @cached_property
    def ends(self) -> tuple[int, ...]:
        """Tokens each sequence holds once this forward has written: start_pos + n_new."""
        return tuple(s + n for s, n in zip(self.start_pos, self.n_new, strict=True))

    @cached_property
    def positions(self) -> list[int]:
        """[N] the position of every flattened token."""
        return [p for s, e in zip(self.start_pos, self.ends, strict=True) for p in range(s, e)]

    @cached_property
    def last_rows(self) -> list[int]:
        """[n] each sequence's last token on the flattened axis: the rows whose logits are sampled."""
        return [end - 1 for end in self.offsets[1:]]

    @cached_property
    def decode_seqs(self) -> list[int]:
        return [i for i, n in enumerate(self.n_new) if n == 1]

    @cached_property
    def prefill_seqs(self) -> list[int]:
        return [i for i, n in enumerate(self.n_new) if n > 1]

    def first_key(self, end: int) -> int:
        """The first key a query at position end - 1 reads (0 without a window)."""
        return 0 if self.window is None else max(0, end - self.window)


def to_device(values: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """Several host int lists -> int64 tensors on `device` through one copy (pinned, non-blocking on CUDA)."""
    lengths = [len(v) for v in values]
    packed = torch.tensor([x for v in values for x in v], dtype=torch.long)
    if device.type == "cuda":
        packed = host.pinned(packed)
    packed = packed.to(device, non_blocking=True)
    return list(packed.split(lengths))


class VarlenRows:
    """A RowStore (harness.kv.quant) over one SeqBatch, made once per forward by the strategy's prepare().

    put_rows writes the forward's N tokens at their addresses (row_index[t], col_index[t]) of each part, a tensor
    [rows, H_kv, cols, width]; get_rows reads back the sequences `select` chose, the strategy saying where their
    first n positions are (`gather_index(index, n)` -> (rows, cols), [b, n] each) from the index it made for them
    when it made this view: `indices` holds one per
    reading (the decoding sequences together, "decode"; each prefill chunk alone, by sequence), a host 2-D list, one
    row per sequence read (contiguous: [slot]; paged: its blocks, padded). Every index goes to the device in one copy.
    """

    def __init__(
        self, cache, batch: SeqBatch, *, row_index: list[int], col_index: list[int], indices: dict[object, list]
    ) -> None:
        self.cache, self.batch = cache, batch
        decode = batch.decode_seqs
        ends = [batch.ends[i] for i in decode]
        lists = [row_index, col_index, [batch.offsets[i] for i in decode], [batch.first_key(e) for e in ends], ends]
        keys = list(indices)
        lists += [[x for row in indices[key] for x in row] for key in keys]
        tensors = to_device(lists, cache.spec.device)
        self.row_index, self.col_index, self.decode_token_rows, firsts, lasts = tensors[:5]  # [N], [N], [b] x 3
        self.indices = {  # [b, width] each; an empty reading (no decoding sequence) stays [0, 0]
            key: t.view(len(indices[key]), -1) if indices[key] else t.view(0, 0)
            for key, t in zip(keys, tensors[5:], strict=True)
        }
        self.decode_keys = max(ends, default=0)  # S: the longest decoding sequence
        k_pos = torch.arange(self.decode_keys, device=cache.spec.device)[None, :]  # [1, S]
        # [b, 1, 1, S] for the decoding sequences' queries: keys first_key..end-1 (True = attend)
        self.decode_mask = ((k_pos >= firsts[:, None]) & (k_pos < lasts[:, None]))[:, None, None, :]
        self.decode_lens = lasts.to(torch.int32)  # [b] keys each decoding sequence reads: a kernel's lengths
        self.selected: object = "decode"
        self.n_kv_heads, self.cols = cache.spec.n_kv_heads, cache.rows["k"].shape[3]  # parts [L, R, H_kv, C, w]
        self.write_index: torch.Tensor | None = None  # [N * H_kv], made at the first write
        self.read_index: dict[tuple[object, int], torch.Tensor] = {}  # (reading, n) -> [b * H_kv * n]

    def select(self, key: object) -> VarlenRows:
        self.selected = key
        return self

    def _flat(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """(row, col) [...] of a part [R, H_kv, C, w] -> flat row indices [..., H_kv] of its [R * H_kv * C, w] view:
        index_copy_ and index_select on one dim run ~10-100x faster here than index_put_ and index with two index
        tensors (each its own TensorIterator pass over a strided view)."""
        heads = torch.arange(self.n_kv_heads, device=rows.device)
        return (rows[..., None] * self.n_kv_heads + heads) * self.cols + cols[..., None]

    def put_rows(self, layer: int, name: str, x: torch.Tensor, first: int) -> None:
        part = self.cache.rows[name][layer]  # [rows, H_kv, cols, width], contiguous
        values = x[0].transpose(0, 1).to(part.dtype)  # [1, H_kv, N, w] -> [N, H_kv, w]
        if values.dtype.itemsize == 1 and values.dtype.is_floating_point:  # fp8: no index_copy_ kernel everywhere
            part, values = part.view(torch.uint8), values.view(torch.uint8)
        if self.write_index is None:
            self.write_index = self._flat(self.row_index, self.col_index).reshape(-1)  # [N * H_kv]
        part.view(-1, part.shape[-1]).index_copy_(0, self.write_index, values.reshape(-1, part.shape[-1]))

    def get_rows(self, layer: int, name: str, n: int) -> torch.Tensor:
        part = self.cache.rows[name][layer]  # [rows, H_kv, cols, width]
        key = (self.selected, n)
        if key not in self.read_index:  # the same for every layer and part of this forward
            rows, cols = self.cache.gather_index(self.indices[self.selected], n)  # [b, n] each
            self.read_index[key] = self._flat(rows, cols).transpose(1, 2).reshape(-1)  # [b * H_kv * n]: [b, H, n]
        width = part.shape[-1]
        flat = part.view(-1, width).index_select(0, self.read_index[key])
        return flat.view(-1, self.n_kv_heads, n, width)  # [b, H_kv, n, w]


def attend(
    cache,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: SeqBatch,
    rows: VarlenRows,
    decode_in_place: Callable[[int, torch.Tensor, VarlenRows], torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [1, H, N, D], k and v [1, H_kv, N, D] of a flattened forward -> [1, H, N, D]; `cache` has a storage format
    (`format`, harness.kv.quant) and `rows` by part name; `rows` is the VarlenRows its prepare() made.

    decode_in_place(layer, q [b, H, D], rows) -> [b, H, D]: the strategy's kernel for the decoding sequences (CUDA's
    Triton kernel reads their blocks in place, lengths rows.decode_lens), in place of the gather and masked SDPA;
    never with a window, which the kernel does not mask, nor with attn_impl=eager."""
    cache.format.write(rows, layer, k, v, 0)
    impl = cache.spec.attn_impl
    masked_attention = F.scaled_dot_product_attention if impl != "eager" else eager_attention  # (q, k, v, mask)
    out = torch.empty_like(q)
    n_heads, head_dim = q.shape[1], q.shape[3]
    n_kv_heads = k.shape[1]
    decode = batch.decode_seqs
    if decode:
        token_rows = rows.decode_token_rows  # [b] the decoding sequences' rows on the flattened axis
        q_d = q[0].index_select(1, token_rows).transpose(0, 1)  # [H, N, D] -> [b, H, D]
        if decode_in_place is not None and batch.window is None and impl != "eager":
            y = decode_in_place(layer, q_d.contiguous(), rows)  # [b, H, D]
        else:
            k_d, v_d = cache.format.read(rows.select("decode"), layer, rows.decode_keys, q.dtype)  # [b, H_kv, S, D]
            # GQA folded into the query axis (harness.kv.base.grouped_attention): [b, H_kv, G, D], one read per
            # K/V head
            q_d = q_d.reshape(len(decode), n_kv_heads, n_heads // n_kv_heads, head_dim)
            y = masked_attention(q_d, k_d, v_d, rows.decode_mask)  # mask [b, 1, 1, S]
        out[0].index_copy_(1, token_rows, y.reshape(len(decode), n_heads, head_dim).transpose(0, 1))  # [H, b, D]
    for i in batch.prefill_seqs:
        first, last, start, end = batch.offsets[i], batch.offsets[i + 1], batch.start_pos[i], batch.ends[i]
        k_i, v_i = cache.format.read(rows.select(i), layer, end, q.dtype)  # [1, H_kv, end, D]
        q_i = q[:, :, first:last]
        if batch.window is None:
            out[:, :, first:last] = attention(q_i, k_i, v_i, start, impl=impl)
        else:  # a band: query p reads keys p - window < j <= p
            q_pos = torch.arange(start, end, device=q.device)[:, None]
            k_pos = torch.arange(end, device=q.device)[None, :]
            band = (k_pos <= q_pos) & (k_pos > q_pos - batch.window)
            folded = q_i.reshape(1, n_kv_heads, (n_heads // n_kv_heads) * (last - first), head_dim)
            band = band.repeat(n_heads // n_kv_heads, 1)
            y = masked_attention(folded, k_i, v_i, band)
            out[:, :, first:last] = y.view(1, n_heads, last - first, head_dim)
    return out
