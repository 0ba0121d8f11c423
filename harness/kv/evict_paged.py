"""Token eviction served: each sequence of a paged serving pool holds at most `budget` tokens per layer and KV head.

harness.kv.evict's rule (a policy's score per held token, the `window` most recent always kept, one eviction per
layer, head and step), applied per sequence over the scheduler's block tables, as harness.kv.paged serves them:
- A sequence's cache slots 0..budget-1 live in its first ceil(budget / block_size) blocks, slot j at block
  table[j // bs], row j % bs. Which position a slot holds, and its score, are per layer and KV head: a side table
  `positions` [L, N, H_kv, bs] int64 and `scores` [L, N, H_kv, bs] fp32 beside the K/V pools, block for block (so
  a block swapped to the host and back keeps them: they are parts of `rows`, which read_blocks copies).
- Held tokens are h = min(start_pos, budget), in slots 0..h-1: until a sequence outgrows the budget, slot ==
  position (paged's very layout, so a budget above every request's length serves exactly as `paged`).
- A decode token (n_new == 1) is written into slot h while h < budget, else into the slot of the lowest score
  outside the window (evict's decode, the victim an argmin on the device, no host sync); the query then reads the
  held slots, at most budget keys. h2o adds the query's attention to the held tokens' scores.
- A prefill chunk attends exactly over the held tokens and the chunk (its K/V live transiently, as the layer's
  activations, never in the pool; the static cache's prefill does the same with the whole prompt), then keeps at
  most `budget` of them: the window most recent and the top-scored rest. Survivors keep their slots, kept chunk
  tokens fill the freed ones in position order (with nothing held, the static cache's very order: kept positions
  ascending in slots 0..). So no sequence ever takes a block past its cap, and the scheduler's manager
  (harness.serve.evict_manager) never grants one: an evicted token's slot is taken by the next token kept, which is
  how pages are reclaimed here.

Policies served: knorm and random (stateless per key: a chunked or preempted-and-recomputed prompt keeps the same
tokens as one decoded token by token, since a top-k over a fixed score equals the sequence of argmin evictions),
and h2o (the attention each key has accumulated from every query that saw it while held: H2O's own definition, per
sequence). snapkv is refused: its votes are the prompt's last `window` queries over the whole prompt, which a
chunked prefill only has when the prompt's last chunk holds the window and nothing was evicted before it.

random salts every sequence as batch row 0 of the static cache, so one request's scores are the static cache's for
it (and do not depend on the batch it shares). Serving's bookkeeping cost: 12 bytes per slot and head (int64
position, fp32 score) beside 2·D·b of K/V, not counted in the pool's KV bytes (as harness.kv.evict says).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F

from harness.errors import ConfigError, Unsupported
from harness.kv import varlen
from harness.kv.base import CacheSpec, attention
from harness.kv.evict import Options, _accumulated_attention, _fold, random_salt, random_scores
from harness.kv.paged import Options as PagedOptions
from harness.kv.paged import PagedCache
from harness.kv.quant import FP8

SERVING_POLICIES = ("h2o", "knorm", "random")  # evicting per sequence, exactly as the rule above says
SIDE_TABLES = ("positions", "scores")  # per slot, layer and KV head, beside the K/V parts in `rows`


def check_serving(options: Options) -> None:
    """One ConfigError line for a policy serving cannot run per sequence (snapkv)."""
    if options.policy not in SERVING_POLICIES:
        raise ConfigError(
            f"cache.policy: {options.policy} does not serve (its votes need the whole prompt's last "
            f"{options.window} queries in one chunk, with nothing evicted before); "
            f"allowed: {', '.join(SERVING_POLICIES)}"
        )


class EvictPagedCache(PagedCache):
    """A serving pool (PagedCache.for_scheduler's) whose sequences hold at most options.budget tokens each."""

    name: ClassVar[str] = "evict"
    supports_static_decode: ClassVar[bool] = False

    def __init__(self, spec: CacheSpec, pool: PagedOptions, options: Options) -> None:
        check_serving(options)
        super().__init__(spec, pool, own_tables=False)
        self.policy, self.budget, self.window = options.policy, options.budget, options.window
        self.attn_backend = "sdpa-gather"  # its own reads: held slots gathered, masked SDPA
        self.codec = self.format.codec  # a per-token codec: serving takes no int4
        lead = (spec.n_layers, self.n_blocks, spec.n_kv_heads, self.block_size)
        self.rows["positions"] = torch.zeros(lead, dtype=torch.int64, device=spec.device)  # [L, N, H_kv, bs]
        self.rows["scores"] = torch.zeros(lead, dtype=torch.float32, device=spec.device)  # [L, N, H_kv, bs]
        self.salt = random_salt(spec.n_layers, 1, spec.n_kv_heads, spec.device)[:, 0]  # [L, H_kv, 1], row 0's
        self.heads = torch.arange(spec.n_kv_heads, device=spec.device)
        self._batch: varlen.SeqBatch | None = None
        self._index: dict[object, torch.Tensor] = {}

    # --- per forward: where each sequence's slots are ----------------------------------------------------------
    def prepare(self, start_pos: int | varlen.SeqBatch, n_new: int | None = None) -> None:
        if not isinstance(start_pos, varlen.SeqBatch):
            raise Unsupported("evict serving: a forward takes a SeqBatch (the scheduler's tables); allowed: serving")
        batch, budget = start_pos, self.budget
        decode = batch.decode_seqs
        width = max([len(batch.block_tables[i]) for i in decode], default=0)
        tables = [list(batch.block_tables[i]) + [0] * (width - len(batch.block_tables[i])) for i in decode]
        lists = {
            "decode_rows": [batch.offsets[i] for i in decode],  # [b] their tokens on the flattened axis
            "decode_start": [batch.start_pos[i] for i in decode],  # [b] the new token's position
            "decode_held": [min(batch.start_pos[i], budget) for i in decode],  # [b] slots held before it
            "decode_reads": [min(batch.ends[i], budget) for i in decode],  # [b] slots its query reads
            "decode_table": [x for row in tables for x in row],  # [b, width], padded with block 0 (never read)
        } | {("table", i): list(batch.block_tables[i]) for i in batch.prefill_seqs}
        tensors = varlen.to_device(list(lists.values()), self.spec.device)
        self._index = dict(zip(lists, tensors, strict=True))
        if decode:
            self._index["decode_table"] = self._index["decode_table"].view(len(decode), width)
        self._batch = batch

    def _flat(self, table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """table [b, nb] blocks, slots [S] (the same for every head) -> flat rows [b, H_kv, S] of a part's
        [N * H_kv * bs] view (harness.kv.varlen.VarlenRows._flat's arithmetic)."""
        blocks = table[:, slots // self.block_size]  # [b, S]
        rows = blocks[:, None, :] * len(self.heads) + self.heads[None, :, None]  # [b, H_kv, S]: (block, head)
        return rows * self.block_size + slots % self.block_size

    def _part(self, layer: int, name: str) -> torch.Tensor:
        """A part of this layer as flat rows: [N * H_kv * bs, width] (K/V and scales; fp8 as its bytes) or
        [N * H_kv * bs] (a side table)."""
        part = self.rows[name][layer]
        part = part.view(torch.uint8) if part.dtype in FP8.values() else part
        return part.reshape(-1, part.shape[-1]) if part.dim() == 4 else part.reshape(-1)

    def _names(self) -> list[tuple[str, str, str]]:
        """(side, codec part, row name) of every stored part: ("k", "data", "k"), ("k", "scale", "k_scale"), ..."""
        return [
            (side, p, side if p == "data" else f"{side}_{p}") for side in ("k", "v") for p in self.format.codec_parts
        ]

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """k, v [b, H_kv, T, D] -> their stored rows by name, [b, H_kv, T, width] each (fp8 as its bytes)."""
        encoded = {side: self.codec.encode(x) for side, x in (("k", k), ("v", v))}
        rows = {name: encoded[side][p] for side, p, name in self._names()}
        return {name: x.view(torch.uint8) if x.dtype in FP8.values() else x for name, x in rows.items()}

    def _decode(self, rows: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored rows by name [b, H_kv, S, width] -> K and V [b, H_kv, S, D] in dtype."""
        parts = {"k": {}, "v": {}}
        for side, p, name in self._names():
            parts[side][p] = rows[name].view(self.rows[name].dtype)
        return self.codec.decode(parts["k"], dtype), self.codec.decode(parts["v"], dtype)

    def _read(self, layer: int, index: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
        """The parts' rows at flat index [b, H_kv, S] -> [b, H_kv, S(, width)] by name (default: every part, the
        side tables included)."""
        out = {}
        for name in self.rows if names is None else names:
            part = self._part(layer, name)
            out[name] = part.index_select(0, index.reshape(-1)).view(*index.shape, *part.shape[1:])
        return out

    def _write(self, layer: int, index: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """rows by name [b, H_kv, S(, width)] -> the parts at flat index [b, H_kv, S] (distinct entries)."""
        for name, x in rows.items():
            part = self._part(layer, name)
            part.index_copy_(0, index.reshape(-1), x.reshape(-1, *part.shape[1:]).to(part.dtype))

    def _new_scores(self, layer: int, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Scores of new tokens on arrival: k [b, H_kv, T, D], positions [b, 1, T] -> [b, H_kv, T] fp32 (h2o's grow
        as queries attend to them)."""
        if self.policy == "knorm":
            return -k.float().norm(dim=-1)
        if self.policy == "random":
            return random_scores(self.salt[layer][None], positions)
        return torch.zeros(k.shape[:3], dtype=torch.float32, device=k.device)

    # --- attention ---------------------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos) -> torch.Tensor:
        """q [1, H, N, D], k and v [1, H_kv, N, D] of a flattened forward (harness.kv.varlen) -> [1, H, N, D]."""
        if not isinstance(start_pos, varlen.SeqBatch) or start_pos is not self._batch:
            raise Unsupported("evict serving: attend takes the SeqBatch prepare() was given; allowed: serving")
        out = torch.empty_like(q)
        if start_pos.decode_seqs:
            self._attend_decode(layer, q, k, v, out)
        for i in start_pos.prefill_seqs:
            self._attend_chunk(layer, q, k, v, out, i)
        return out

    def _attend_decode(self, layer: int, q, k, v, out: torch.Tensor) -> None:
        """The decoding sequences together: each new token into its slot (a free one, or its victim's), then one
        masked SDPA over each one's held slots."""
        batch, index = self._batch, self._index
        reads = [min(batch.ends[i], self.budget) for i in batch.decode_seqs]
        n_slots = max(reads)  # S: the most slots one reads
        rows, start = index["decode_rows"], index["decode_start"][:, None, None]  # [b], [b, 1, 1]
        q_d = q[0].index_select(1, rows).transpose(0, 1)  # [b, H, D]
        k_d, v_d = (x[0].index_select(1, rows).transpose(0, 1)[:, :, None] for x in (k, v))  # [b, H_kv, 1, D]
        slots = torch.arange(n_slots, device=q.device)
        flat = self._flat(index["decode_table"], slots)  # [b, H_kv, S]
        side = self._read(layer, flat, SIDE_TABLES)
        # The slot each new token takes: slot h while h < budget (the cache not full), else the lowest score outside
        # the window most recent positions (start - window + 1 .. start once it is written): evict's decode.
        held = index["decode_held"][:, None, None]  # [b, 1, 1]
        protected = side["positions"] > start - self.window
        candidates = side["scores"].masked_fill(protected | (slots >= held), math.inf)
        victim = candidates.masked_fill(slots == held, -math.inf).argmin(dim=-1, keepdim=True)  # [b, H_kv, 1]
        target = flat.gather(-1, victim)  # [b, H_kv, 1]
        new = self._encode(k_d, v_d)
        new["positions"] = start.expand(-1, len(self.heads), 1)
        new["scores"] = self._new_scores(layer, k_d, start[:, :, :1])
        self._write(layer, target, new)
        stored = self._read(layer, flat, [name for *_, name in self._names()])  # K/V and scales, not side tables
        k_r, v_r = self._decode(stored, q.dtype)  # [b, H_kv, S, D]
        valid = None if min(reads) == n_slots else slots[None, :] < index["decode_reads"][:, None]  # [b, S]
        n_heads, head_dim = q.shape[1], q.shape[3]
        folded = q_d.reshape(len(reads), len(self.heads), n_heads // len(self.heads), head_dim)  # [b, H_kv, G, D]
        mask = None if valid is None else valid[:, None, None, :]
        y = F.scaled_dot_product_attention(folded, k_r, v_r, attn_mask=mask)  # [b, H_kv, G, D]
        out[0].index_copy_(1, rows, y.reshape(len(reads), n_heads, head_dim).transpose(0, 1))
        if self.policy == "h2o":  # every held key's attention from this query, added where it is held
            mass = _masked_mass(q_d[:, :, None], k_r, valid)  # [b, H_kv, S], 0 on padding
            self._part(layer, "scores").index_add_(0, flat.reshape(-1), mass.reshape(-1))

    def _attend_chunk(self, layer: int, q, k, v, out: torch.Tensor, i: int) -> None:
        """One prefill chunk: exact attention over the held slots then the chunk, then at most budget kept."""
        batch, budget = self._batch, self.budget
        first, last, start, end = batch.offsets[i], batch.offsets[i + 1], batch.start_pos[i], batch.ends[i]
        n, held = last - first, min(start, budget)
        table = self._index[("table", i)][None]  # [1, nb]
        q_i, k_i, v_i = (x[:, :, first:last] for x in (q, k, v))
        new = self._encode(k_i, v_i)  # [1, H_kv, n, w]
        positions = torch.arange(start, end, device=q.device)
        new["positions"] = positions.expand(1, len(self.heads), n)
        new["scores"] = self._new_scores(layer, k_i, positions[None, None])
        held_index = self._flat(table, torch.arange(held, device=q.device))  # [1, H_kv, h]
        rows = {name: torch.cat([old, new[name]], dim=2) for name, old in self._read(layer, held_index).items()}
        k_all, v_all = self._decode(rows, q.dtype)  # [1, H_kv, h + n, D]: held slots, then the chunk
        # Held keys all precede the chunk: query t sees candidates 0..h+t, the causal mask of start_pos h (with
        # h == start, nothing evicted yet, exactly paged's call over positions 0..end-1).
        out[:, :, first:last] = attention(q_i, k_all, v_all, held)
        if self.policy == "h2o":
            rows["scores"] = rows["scores"] + _accumulated_attention(q_i, k_all)
        if held + n <= budget:  # all fit: the chunk into slots h..h+n-1, held scores updated (h2o)
            slots = torch.arange(held + n, device=q.device) if self.policy == "h2o" else positions - start + held
            self._write(layer, self._flat(table, slots), {name: x[:, :, -len(slots) :] for name, x in rows.items()})
            return
        # Keep the window most recent and the top-scored rest; survivors stay in their slots, kept chunk tokens take
        # the freed slots in position order (nothing held: kept positions ascending in slots 0.., evict's prefill).
        recent = rows["positions"] >= end - self.window  # [1, H_kv, h + n]
        kept = rows["scores"].masked_fill(recent, math.inf).topk(budget, dim=-1).indices
        is_kept = torch.zeros_like(recent).scatter_(-1, kept, True)
        free = torch.ones((1, len(self.heads), budget), dtype=torch.bool, device=q.device)
        free[:, :, :held] = ~is_kept[:, :, :held]
        rank = (free.cumsum(dim=-1) - 1).clamp(0, n - 1)  # [1, H_kv, budget]: a free slot's place among the free
        order = torch.sort((~is_kept[:, :, held:]).int(), dim=-1, stable=True).indices  # kept chunk tokens first
        source = torch.where(free, held + order.gather(-1, rank), torch.arange(budget, device=q.device))
        kept_rows = {
            name: x.gather(2, source.view(*source.shape, *([1] * (x.dim() - 3))).expand(*source.shape, *x.shape[3:]))
            for name, x in rows.items()
        }
        self._write(layer, self._flat(table, torch.arange(budget, device=q.device)), kept_rows)


def _masked_mass(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """H2O's mass of one query per sequence: q [b, H, 1, D] over keys [b, H_kv, S, D], valid [b, S] (None: all)
    -> [b, H_kv, S] fp32, summed over the group (harness.kv.evict._accumulated_attention's arithmetic, padded)."""
    if valid is None:
        return _accumulated_attention(q, keys)
    folded = _fold(q, keys.shape[1])  # [b, H_kv, G, 1, D]
    logits = folded @ keys.float().transpose(-1, -2)[:, :, None] * q.shape[-1] ** -0.5  # [b, H_kv, G, 1, S]
    logits = logits.masked_fill(~valid[:, None, None, None, :], -math.inf)
    return logits.softmax(dim=-1).sum(dim=(2, 3))
