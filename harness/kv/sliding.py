"""Sliding-window KV cache: a ring of `window` slots per sequence, optionally with attention sinks.

Lossy beyond the window. Once a sequence is longer than `window`, its oldest tokens are overwritten and no later
token attends to them: the model then computes windowed attention, not the full attention most models were
trained for (Mistral-7B-v0.1 was trained with a 4096-token window and a rolling buffer like this one: Jiang et al.
2023, "Mistral 7B", section 2). Up to `window` tokens it is exact: it computes what `contiguous` computes.

`window` counts every cached token, sinks included: a sequence holds at most `window` tokens, its first `sinks`
in fixed slots (kept forever: the attention sinks of StreamingLLM, Xiao et al. 2023) and the rest in a ring of
`window - sinks` slots that overwrites the oldest. The rule, in prefill as in decode so that both agree:

    query at position i sees key j  iff  j <= i and (j < sinks or i - j < window - sinks)

RoPE is applied before caching (k arrives rotated), so every key keeps its true position and nothing is
re-rotated; the order of keys in the ring then does not matter to attention. (StreamingLLM instead re-encodes
positions within the cache; this is Mistral's rolling buffer plus sinks.)

Memory is flat in sequence length: min(window, max_tokens) slots per sequence, never max_tokens beyond that.

Formats: plain dtypes, fp8 and int8, through harness.kv.quant's per-token codecs (a token's data and scale share its
slot). int4 is Unsupported: KIVI quantizes keys per channel across groups of consecutive tokens, which a ring that
overwrites one token at a time would tear apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness import kv
from harness.errors import ConfigError, Unsupported
from harness.formats import BITS, DTYPE_BYTES, QUANTIZED, SCALE_BYTES
from harness.formats import PLAIN as PLAIN_NAMES
from harness.kv import varlen
from harness.kv.base import (
    CacheSpec,
    KVAllocation,
    Layout,
    Serving,
    attention,
    cache_width,
    codec_transients,
    grouped_attention,
)
from harness.kv.quant import token_codec


@dataclass(frozen=True)
class Options:
    window: int = 4096  # tokens cached per sequence, sinks included; Mistral-7B-v0.1's sliding_window
    sinks: int = 0  # first tokens kept forever; StreamingLLM keeps 4 (Xiao et al. 2023, section 3.2)

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise ValueError(f"cache.window: must be a positive number of tokens, got {self.window}")
        if self.sinks < 0:
            raise ValueError(f"cache.sinks: must be 0 or a positive number of tokens, got {self.sinks}")
        if self.sinks >= self.window:
            raise ValueError(f"cache.sinks: must be less than cache.window={self.window}, got {self.sinks}")


@dataclass
class _Step:
    """What one forward does, worked out once in `prepare` and followed by every layer's `attend`."""

    write_src: slice | torch.Tensor  # which of the T new tokens are stored
    write_slots: slice | torch.Tensor  # where they go
    read_slots: slice | torch.Tensor  # slots holding keys the queries may see
    # How to attend: "exact" (contiguous's causal attention, slot == position), "all" (one query that sees every
    # held key) or "banded" (old keys read before the write, then `mask` over old + new keys).
    kind: str
    mask: torch.Tensor | None = None  # [T, S_old + T] bool, True = attend; "banded" only


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, *, window: int, sinks: int) -> torch.Tensor:
    """The sliding rule with sinks: [T, 1] query positions x [1, S] key positions -> [T, S] bool."""
    return (k_pos <= q_pos) & ((k_pos < sinks) | (q_pos - k_pos < window - sinks))


class SlidingCache(kv.KVCache):
    name: ClassVar[str] = "sliding"
    recomputes_prefix: ClassVar[bool] = False
    attn_backend: ClassVar[str] = "sdpa"
    prefix_hit: ClassVar[None] = None

    def __init__(self, spec: CacheSpec, options: Options) -> None:
        self.spec, self.window, self.sinks = spec, options.window, options.sinks
        self.ring = options.window - options.sinks  # slots overwritten oldest first; > 0 as sinks < window
        self.n_slots = min(options.window, spec.max_tokens)  # a window longer than the sequence is contiguous
        self.codec = token_codec(spec.kv_dtype)  # Unsupported for int4
        shape = (spec.n_layers, 2, spec.batch_size, spec.n_kv_heads, self.n_slots, spec.head_dim)
        # "data" [L, K|V, B, H_kv, slots, D], and for fp8/int8 "scale" [L, K|V, B, H_kv, slots, 1]
        self.storage = self.codec.alloc(shape, spec.device)
        self.n_tokens = 0  # tokens seen per sequence (all sequences of a batch move in step), not tokens held
        self.step: _Step | None = None

    def _slot(self, pos: torch.Tensor) -> torch.Tensor:
        """Position -> slot: sinks keep theirs, the rest take turns in the ring. Below `window`, slot == position."""
        return torch.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks) % self.ring)

    def _slot_of(self, pos: int) -> int:
        """`_slot` of one position, on the host: a decode step's write needs no index tensor."""
        return pos if pos < self.sinks else self.sinks + (pos - self.sinks) % self.ring

    def prepare(self, start_pos: int, n_new: int | None = None) -> None:
        if isinstance(start_pos, varlen.SeqBatch):  # serving
            raise Unsupported(
                "per-sequence lengths: sliding does not take them (a ring per sequence; serving's sliding window runs on the paged pool (cache=paged with a window)); allowed: contiguous, paged, prefix"
            )
        end = start_pos + n_new
        if end > self.spec.max_tokens:
            raise ValueError(f"sliding cache sized for {self.spec.max_tokens} tokens, asked for {end}")
        assert start_pos == self.n_tokens, f"a ring cannot skip positions: at {self.n_tokens}, asked {start_pos}"
        self.n_tokens = end
        if end <= self.window:  # nothing has slid out yet: slot == position, exactly contiguous's layout
            self.step = _Step(slice(None), slice(start_pos, end), slice(0, end), kind="exact")
        elif n_new == 1:  # after the write the ring holds exactly the keys this query sees
            slot = self._slot_of(start_pos)
            self.step = _Step(slice(None), slice(slot, slot + 1), slice(None), kind="all")
        else:
            self.step = self._banded_step(start_pos, end)

    def _banded_step(self, start_pos: int, end: int) -> _Step:
        """T > 1 queries past the window: attend over the old held keys plus all new ones under the rule's mask,
        then store only the new tokens that survive (sinks, and the last `ring` positions).

        Every position list here is a range of host integers, so every tensor has a shape known before it is
        computed: no boolean indexing (a nonzero: a host sync on a GPU, and a data-dependent shape that fake tensors
        and torch.compile refuse)."""
        device = self.spec.device
        ring_start = max(self.sinks, start_pos - self.ring)
        old_pos = torch.cat(
            [
                torch.arange(min(self.sinks, start_pos), device=device),
                torch.arange(ring_start, max(ring_start, start_pos), device=device),
            ]
        )  # every position the ring holds before this forward (at most `window`)
        new_pos = torch.arange(start_pos, end, device=device)
        # The new tokens that survive: those below `sinks`, and the last `ring` of the sequence. Disjoint and in
        # order, since a banded step has end > window, so end - ring > sinks.
        kept_pos = torch.cat(
            [
                torch.arange(start_pos, max(start_pos, min(self.sinks, end)), device=device),
                torch.arange(max(start_pos, end - self.ring), end, device=device),
            ]
        )
        key_pos = torch.cat([old_pos, new_pos])
        mask = _visible(new_pos[:, None], key_pos[None, :], window=self.window, sinks=self.sinks)  # [T, S_old + T]
        return _Step(
            write_src=kept_pos - start_pos,
            write_slots=self._slot(kept_pos),
            read_slots=self._slot(old_pos),
            kind="banded",
            mask=mask,
        )

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for kv_index, x in enumerate((k, v)):  # x [B, H_kv, T, D]
            for part_name, part in self.codec.encode(x[:, :, self.step.write_src]).items():
                self.storage[part_name][layer, kv_index][:, :, self.step.write_slots] = part

    def _read(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values at step.read_slots, decoded: [B, H_kv, S, D] each, in `dtype`."""
        k, v = (
            self.codec.decode(
                {name: part[layer, kv_index][:, :, self.step.read_slots] for name, part in self.storage.items()},
                dtype,
            )
            for kv_index in (0, 1)
        )
        return k, v

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        """q [B, H, T, D], k and v [B, H_kv, T, D] for positions start_pos..start_pos+T-1 -> [B, H, T, D]."""
        step = self.step
        if step.kind == "exact":
            self._write(layer, k, v)
            k_held, v_held = self._read(layer, q.dtype)
            return attention(q, k_held, v_held, start_pos, impl=self.spec.attn_impl)
        if step.kind == "all":
            self._write(layer, k, v)
            return grouped_attention(
                q, *self._read(layer, q.dtype), impl=self.spec.attn_impl
            )  # one query, all keys held
        # Banded: read before writing, since the new tokens may overwrite slots the earlier queries still see. The
        # new K/V go through the storage format too, so they are the values a token-by-token decode would read back.
        k_old, v_old = self._read(layer, q.dtype)
        k_new, v_new = (self.codec.decode(self.codec.encode(x), q.dtype) for x in (k, v))
        keys = torch.cat([k_old, k_new], dim=2)  # [B, H_kv, S_old + T, D]
        values = torch.cat([v_old, v_new], dim=2)
        # GQA folded into the query axis, never a mask with enable_gqa (the math backend on CUDA: grouped_attention)
        out = grouped_attention(q, keys, values, mask=step.mask, impl=self.spec.attn_impl)
        self._write(layer, k, v)
        return out

    def release(self) -> None:
        self.n_tokens = 0  # the slots stay reserved for the next batch; stale ones are never read
        self.step = None

    def data_tensors(self) -> list[torch.Tensor]:
        return [self.storage["data"]]

    def scale_tensors(self) -> list[torch.Tensor]:
        return [part for name, part in self.storage.items() if name != "data"]  # fp8/int8: "scale"

    def tokens_held(self) -> int:
        return min(self.n_tokens, self.n_slots)


class SlidingLayout(Layout):
    """min(window, max_tokens) slots per sequence; a query reads at most `window` keys; a prefill past the window
    attends through a band mask built for the whole forward (SlidingCache._banded_step). Lossy past the window."""

    lossy: ClassVar[bool] = True
    lossy_family: ClassVar[str | None] = "sliding window"

    def allocation(self, shape) -> KVAllocation:
        """data [L, K|V, B, H_kv, slots, D] (MLA: one latent side of one head of its row) (+ scale [.., slots, 1]
        for fp8/int8); no int4."""
        args = shape.model
        slots = min(self.options.window, shape.max_tokens)
        tokens = args.n_layers * args.cache_sides * shape.batch_size * args.cache_heads * slots
        data = tokens * args.cache_head_dim * BITS[shape.kv_dtype] // 8
        return KVAllocation(data, scale_bytes=tokens * SCALE_BYTES if shape.kv_dtype in QUANTIZED else 0)

    def _banded(self, *, n_new: int, n_keys: int) -> bool:
        return n_new > 1 and n_keys > self.options.window

    def transients(self, shape, *, n_seqs: int, n_new: int, n_keys: int) -> tuple[int, int, int]:
        """A ring's write, and its read-back within the window; banded: the held keys and the new ones,
        concatenated (at the compute dtype)."""
        width, sides = cache_width(shape), shape.model.cache_sides
        new = n_seqs * n_new * width  # values written per side
        if self._banded(n_new=n_new, n_keys=n_keys):
            return self._write_bytes(shape, new), 0, sides * new * DTYPE_BYTES[shape.dtype]
        keys = n_seqs * min(n_keys, self.options.window) * width
        return codec_transients(shape, new=new, keys=keys)

    @staticmethod
    def _write_bytes(shape, new: int) -> int:
        """A ring's write of `new` values per side: plain at the compute dtype in place, else through its codec."""
        b, kv_dtype = DTYPE_BYTES[shape.dtype], shape.kv_dtype
        if kv_dtype in PLAIN_NAMES:
            return new * DTYPE_BYTES[kv_dtype] if DTYPE_BYTES[kv_dtype] != b else 0
        return new * ((12 if kv_dtype == "int8" else 9) + 4 * (b != 4))

    def step_mask_bytes(self, shape, *, n_new: int, n_keys: int) -> tuple[int, int]:
        """A prefill past the window builds its [T, T] band before the layers (10 bytes per pair at the peak: a
        bool, the int64 distances, a bool) and holds it (1 byte per pair) through every phase."""
        band = n_new * n_keys if self._banded(n_new=n_new, n_keys=n_keys) else 0
        return band, 10 * band

    def keys_attended(self, n_keys: float) -> float:
        return min(n_keys, self.options.window)  # sinks included: `window` counts them

    def tokens_written(self, n_new: int) -> float:
        return min(n_new, self.options.window)  # a ring keeps only the last `window` of a long prompt

    def causal_pairs(self, first: int, last: int) -> float:
        """Σ min(n, window) for n = first..last, in closed form."""
        window = self.options.window
        if last < first:
            return 0

        def triangle(n: int) -> int:  # 1 + 2 + ... + n
            return n * (n + 1) // 2

        if last <= window:
            return triangle(last) - triangle(first - 1)
        below = max(0, window - first + 1)  # queries that see fewer keys than the window
        return triangle(first - 1 + below) - triangle(first - 1) + (last - first + 1 - below) * window

    def check(self, shape) -> None:
        if shape.kv_dtype == "int4":
            raise ConfigError(
                f"kv_dtype: {self.name} cannot store int4; allowed: {', '.join(k for k in BITS if k != 'int4')}"
            )


STRATEGY = SlidingCache
LAYOUT = SlidingLayout
# A ring per sequence cannot be addressed by block: served from the paged pool, under the window's mask, the
# blocks before the window freed by the scheduler (vLLM's SlidingWindowManager); no sinks.
SERVING = Serving(pool="blocks", storage="paged", windowed=True, caps_blocks=True, exact=False)
