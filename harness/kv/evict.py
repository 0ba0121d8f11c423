"""Token eviction under a budget: at most `budget` tokens per sequence, layer and KV head, chosen by a policy.

Lossy once a sequence outgrows the budget: later queries never see an evicted token. Up to the budget it is exact,
and with budget >= prompt_len + gen_len it is `contiguous` itself (slot == position, no score is computed).

Rule, per layer and KV head (each evicts on its own, as SnapKV and H2O do):
  - Prefill attends exactly over the whole prompt (its K/V exist transiently, for this layer only), THEN keeps at
    most `budget` tokens: the `window` most recent positions always, and the top-scored others.
  - Decode: the new token is written, then attended with the held ones. When the cache is full it first evicts the
    lowest-scored held token outside the `window` most recent positions and takes its slot, so a decode query reads
    at most `budget` keys and memory never holds budget + 1 (H2O instead attends over budget + 1, then evicts).
  - RoPE is applied before caching, so each kept key keeps its true position; slot order does not matter to attention.

Policies (a score per held token, higher = kept; `window` counts the recent tokens every policy keeps):
  h2o     Zhang et al. 2023, "H2O: Heavy-Hitter Oracle": the attention each key has accumulated, summed over the
          queries that saw it and over the G query heads of its KV head (the prompt's queries at prefill, then each
          decode query). H2O's recent tokens are the `window`. (kvpress's ObservedAttentionPress divides by the number
          of queries that saw the key; H2O sums, as here.)
  snapkv  Li et al. 2024, "SnapKV": the last `window` prompt queries vote (their attention to the earlier keys, summed
          over the window and the group), max-pooled over positions with kernel 7 (SnapKV's LongBench settings in
          KVCache-Factory; kvpress's SnapKVPress averages with kernel 5). In decode the votes stay as they were; a
          generated token has none: it is kept while among the `window` most recent, then evicted first, oldest first
          (SnapKV compresses the prompt only; past the budget its generated tokens slide like a window).
  knorm   Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression": the keys with
          the lowest L2 norm are kept (kvpress's KnormPress scores -||k||), taken on the key as computed.
  random  the control: a seeded, stateless hash of (layer, sequence, head, position), the same on every device.
Following kvpress (NVIDIA/kvpress, presses/scorer_press.py), a policy is a score and eviction is a top-k over it.

What the scores cost (B sequences, H query heads, H_kv KV heads, D head_dim, S held or prompt tokens, T prompt):
  knorm   a norm per written key: B·H_kv·T·D reads and ~2·B·H_kv·T·D FLOPs at prefill, nothing per decode read.
  random  ~10 integer ops per written token; no tensor reads.
  h2o     prefill: q·Kᵀ again beside the fused attention (which never materializes it), 2·B·H·T²·D FLOPs, in chunks of
          queries so that at most SCORE_CHUNK_BYTES of fp32 probabilities [B, H, c, T] exist at once, never
          [B, H, T, T]; decode: [B, H, 1, S] probabilities, 2·B·H·S·D FLOPs, and K read a second time (B·H_kv·S·D·b).
  snapkv  prefill only: the window's [B, H, window, T] fp32 probabilities, 2·B·H·window·T·D FLOPs; decode nothing.
  every   once full, one eviction per layer and step: an argmin over [B, H_kv, budget] fp32 scores beside int64
          positions (12 bytes per held token and head, beside 2·D·b of K/V: 2.3% at D 128 in bf16; bookkeeping,
          not counted in kv_bytes_allocated), then one scatter of the new row: no host sync, no data-dependent shape.

Memory is flat: storage for min(budget, max_tokens) tokens per sequence, never max_tokens.
Served (harness.serve, strategy=evict): harness.kv.evict_paged applies this rule per sequence over a paged pool,
each request's budget slots in its first ceil(budget / block_size) blocks (policies h2o, knorm and random).
Formats: plain dtypes, fp8 and int8 through harness.kv.quant's per-token codecs (evicting a token moves its data and
scale rows together); int4 is Unsupported: KIVI quantizes keys per channel across groups of consecutive tokens,
which a cache that evicts single tokens would tear apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from harness import kv
from harness.errors import ConfigError, Unsupported
from harness.formats import BITS, DTYPE_BYTES, QUANTIZED, SCALE_BYTES
from harness.kv import varlen
from harness.kv.base import CacheSpec, KVAllocation, Layout, Serving, attention, codec_transients, grouped_attention
from harness.kv.quant import FP8, token_codec

POLICIES = ("h2o", "snapkv", "knorm", "random")
POOL_KERNEL = 7  # snapkv: positions pooled per vote (odd: padding kernel // 2 keeps the length)
SCORE_CHUNK_BYTES = 64 * 2**20  # h2o's prefill: fp32 probabilities held at once, [B, H, chunk, T]
RANDOM_SEED = 0  # random: added to its hash's salt; fixed, so that reruns evict the same tokens
NO_VOTE = -(2.0**24)  # snapkv: a generated token's score, + its position: below every vote (>= 0), oldest lowest;
# exact in fp32 for positions below 2**24


@dataclass(frozen=True)
class Options:
    policy: str = "snapkv"  # what is kept: h2o, snapkv, knorm or random
    budget: int = 1024  # tokens kept per sequence, layer and KV head; SnapKV's smallest LongBench budget
    window: int = 32  # most recent tokens always kept; snapkv's observation window (SnapKV's 32)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"cache.policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.budget <= 0:
            raise ValueError(f"cache.budget: must be a positive number of tokens, got {self.budget}")
        if not 0 <= self.window < self.budget:
            raise ValueError(f"cache.window: must be in 0..cache.budget-1={self.budget - 1}, got {self.window}")
        if self.policy == "snapkv" and self.window == 0:
            raise ValueError("cache.window: snapkv needs an observation window of at least 1 token, got 0")


class EvictCache(kv.KVCache):
    name: ClassVar[str] = "evict"
    recomputes_prefix: ClassVar[bool] = False
    attn_backend: ClassVar[str] = "sdpa"
    prefix_hit: ClassVar[None] = None

    def __init__(self, spec: CacheSpec, options: Options) -> None:
        self.spec, self.policy, self.window = spec, options.policy, options.window
        self.n_slots = min(options.budget, spec.max_tokens)
        self.evicts = options.budget < spec.max_tokens  # else nothing is ever evicted: no score is computed
        self.codec = token_codec(spec.kv_dtype)  # Unsupported for int4
        lead = (spec.n_layers, spec.batch_size, spec.n_kv_heads, self.n_slots)
        # "data" [L, K|V, B, H_kv, slots, D], and for fp8/int8 "scale" [L, K|V, B, H_kv, slots, 1]
        self.storage = self.codec.alloc((lead[0], 2, *lead[1:], spec.head_dim), spec.device)
        self.scores = torch.zeros(lead, dtype=torch.float32, device=spec.device)  # [L, B, H_kv, slots]
        self.positions = torch.zeros(lead, dtype=torch.int64, device=spec.device)  # [L, B, H_kv, slots]
        self.salt = random_salt(*lead[:3], spec.device)  # random's, per layer, sequence and head [L, B, H_kv, 1]
        self.n_tokens = 0  # tokens seen per sequence (the batch moves in step), not tokens held

    def prepare(self, start_pos: int | varlen.SeqBatch, n_new: int | None = None) -> None:
        if isinstance(start_pos, varlen.SeqBatch):  # serving
            raise Unsupported(
                "per-sequence lengths: evict does not take them (one eviction state per batch row, all moving in "
                "step); allowed: its serving form over a paged pool (serving_cache, harness.kv.evict_paged)"
            )
        end = start_pos + n_new
        if end > self.spec.max_tokens:
            raise ValueError(f"evict cache sized for {self.spec.max_tokens} tokens, asked for {end}")
        if start_pos != self.n_tokens or (start_pos > 0 and n_new > 1):
            raise Unsupported(
                f"cache.evict: a forward of {n_new} tokens at position {start_pos} after {self.n_tokens}; "
                "allowed: one prefill from position 0, then one token per step"
            )
        self.n_tokens = end

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        """q [B, H, T, D], k and v [B, H_kv, T, D] for positions start_pos..start_pos+T-1 -> [B, H, T, D]."""
        if start_pos == 0:
            return self._prefill(layer, q, k, v)
        return self._decode(layer, q, k, v, start_pos)

    # --- prefill ---------------------------------------------------------------------------------------------
    def _prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = k.shape[2]
        if n <= self.n_slots:  # the prompt fits: slot == position, contiguous's very write, read-back and attention
            self._put(layer, slice(0, n), k, v)
            k_held, v_held = self._read(layer, n, q.dtype)
            out = attention(q, k_held, v_held, 0)
            if self.evicts:
                self.positions[layer, :, :, :n] = torch.arange(n, device=k.device)
                self.scores[layer, :, :, :n] = self._prompt_scores(layer, q, k, k_held)
            return out
        # The prompt outgrows the budget: attend exactly over all of it (through the format, as decode would read it
        # back), then keep the window and the top-scored rest.
        encoded = [self.codec.encode(x) for x in (k, v)]
        k_all, v_all = (self.codec.decode(parts, q.dtype) for parts in encoded)
        out = attention(q, k_all, v_all, 0)
        scores = self._prompt_scores(layer, q, k, k_all)  # [B, H_kv, n] fp32
        recent = torch.arange(n, device=k.device) >= n - self.window  # [n]
        kept = scores.masked_fill(recent, math.inf).topk(self.n_slots, dim=-1).indices.sort(dim=-1).values
        for kv_index, parts in enumerate(encoded):
            for name, part in parts.items():  # [B, H_kv, n, width] -> [B, H_kv, slots, width]
                rows = _as_bytes(part).gather(2, kept[..., None].expand(-1, -1, -1, part.shape[-1]))
                self.storage[name][layer, kv_index] = rows.view(part.dtype)
        self.positions[layer] = kept
        self.scores[layer] = scores.gather(-1, kept)
        return out

    def _prompt_scores(self, layer: int, q: torch.Tensor, k: torch.Tensor, k_read: torch.Tensor) -> torch.Tensor:
        """The policy's score of every prompt token: [B, H_kv, T] fp32. k: the keys as computed; k_read: as stored
        and read back (what attention sees)."""
        n = k.shape[2]
        if self.policy == "knorm":
            return -k.float().norm(dim=-1)
        if self.policy == "random":
            return self._hash(layer, torch.arange(n, device=k.device))
        if self.policy == "h2o":
            return _accumulated_attention(q, k_read)
        return _window_votes(q, k_read, window=min(self.window, n))

    # --- decode ----------------------------------------------------------------------------------------------
    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
        held = min(pos, self.n_slots)  # tokens held before this one
        if held < self.n_slots:  # room left: the next free slot, a slice known on the host
            self._put(layer, slice(held, held + 1), k, v)
            if self.evicts:
                self.positions[layer, :, :, held] = pos
                self.scores[layer, :, :, held] = self._new_score(layer, k, pos)[..., 0]
        else:
            # Full: the lowest score outside the window most recent positions (pos - window + 1 .. pos once this one
            # is written) gives up its slot. At most window - 1 held tokens are protected, and budget > window.
            protected = self.positions[layer] > pos - self.window  # [B, H_kv, slots]
            victim = self.scores[layer].masked_fill(protected, math.inf).argmin(dim=-1, keepdim=True)  # [B, H_kv, 1]
            self._scatter(layer, victim, k, v)
            self.positions[layer].scatter_(-1, victim, torch.full_like(victim, pos))
            self.scores[layer].scatter_(-1, victim, self._new_score(layer, k, pos))
        n_held = min(pos + 1, self.n_slots)
        k_held, v_held = self._read(layer, n_held, q.dtype)
        out = grouped_attention(q, k_held, v_held)  # one query, every held key: contiguous's decode call
        if self.evicts and self.policy == "h2o":
            self.scores[layer, :, :, :n_held] += _accumulated_attention(q, k_held)
        return out

    def _new_score(self, layer: int, k: torch.Tensor, pos: int) -> torch.Tensor:
        """A decoded token's score on arrival: [B, H_kv, 1] fp32 (h2o's grows as queries attend to it)."""
        if self.policy == "knorm":
            return -k.float().norm(dim=-1)
        if self.policy == "random":
            return self._hash(layer, pos)
        if self.policy == "h2o":
            return torch.zeros(k.shape[:3], dtype=torch.float32, device=k.device)
        return torch.full(k.shape[:3], NO_VOTE + pos, dtype=torch.float32, device=k.device)

    def _hash(self, layer: int, positions: torch.Tensor | int) -> torch.Tensor:
        return random_scores(self.salt[layer], positions)  # [B, H_kv, T] (or [B, H_kv, 1])

    # --- storage ---------------------------------------------------------------------------------------------
    def _put(self, layer: int, slots: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        for kv_index, x in enumerate((k, v)):  # x [B, H_kv, T, D]
            for name, part in self.codec.encode(x).items():
                self.storage[name][layer, kv_index][:, :, slots] = part

    def _scatter(self, layer: int, victim: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """One new token per (sequence, head) into the slot victim [B, H_kv, 1] names: its data and scale rows."""
        for kv_index, x in enumerate((k, v)):  # x [B, H_kv, 1, D]
            for name, part in self.codec.encode(x).items():
                rows = _as_bytes(self.storage[name][layer, kv_index])  # a view: the scatter writes the storage
                rows.scatter_(2, victim[..., None].expand(-1, -1, 1, part.shape[-1]), _as_bytes(part))

    def _read(self, layer: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n slots, decoded: [B, H_kv, n, D] each, in dtype (a view for a plain format at dtype)."""
        k, v = (
            self.codec.decode({name: part[layer, kv_index][:, :, :n] for name, part in self.storage.items()}, dtype)
            for kv_index in (0, 1)
        )
        return k, v

    def release(self) -> None:
        self.n_tokens = 0  # the slots stay reserved for the next batch; stale ones are never read

    def data_tensors(self) -> list[torch.Tensor]:
        return [self.storage["data"]]

    def scale_tensors(self) -> list[torch.Tensor]:
        return [part for name, part in self.storage.items() if name != "data"]  # fp8/int8: "scale"

    def tokens_held(self) -> int:
        return min(self.n_tokens, self.n_slots)


def random_salt(n_layers: int, batch_size: int, n_kv_heads: int, device: torch.device) -> torch.Tensor:
    """random's salt per layer, sequence and head [L, B, H_kv, 1] int64: their index, mixed by random_scores, so no
    RNG state is drawn, kept or synchronized (serving salts every sequence as batch row 0: harness.kv.evict_paged)."""
    index = torch.arange(n_layers * batch_size * n_kv_heads, dtype=torch.int64, device=device)
    return (index.view(n_layers, batch_size, n_kv_heads, 1) * 0x632BE5AB + RANDOM_SEED) & 0xFFFFFFFF


def random_scores(salt: torch.Tensor, positions: torch.Tensor | int) -> torch.Tensor:
    """random's score in [0, 1): an integer hash of (salt, position) (a multiply-xorshift mix: the multiplier
    0x45D9F3B of a well-known 32-bit hash), in int64 with every product below 2**63, so CPU and CUDA agree."""
    x = (salt + positions * 0x9E3779B1) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return ((x >> 16) ^ x).float() / 2.0**32


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp8 as uint8 (the same bytes: gather and scatter_ have no fp8 kernels), any other dtype as it is."""
    return x.view(torch.uint8) if x.dtype in FP8.values() else x


def _fold(q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """q [B, H, T, D] -> [B, H_kv, G, T, D] fp32 (query head h = h_kv * G + g, as harness.kv.base folds GQA)."""
    batch, n_heads, n_new, head_dim = q.shape
    return q.float().reshape(batch, n_kv_heads, n_heads // n_kv_heads, n_new, head_dim)


def _causal_probs(q: torch.Tensor, keys: torch.Tensor, first: int) -> torch.Tensor:
    """Softmax attention of folded queries q [B, H_kv, G, c, D] at positions first.. over keys [B, H_kv, S, D]
    (positions 0..S-1): [B, H_kv, G, c, S] fp32, a key after its query at 0."""
    logits = q @ keys.float().transpose(-1, -2)[:, :, None] * q.shape[-1] ** -0.5  # [B, H_kv, G, c, S]
    q_pos = torch.arange(first, first + q.shape[3], device=q.device)[:, None]
    future = torch.arange(keys.shape[2], device=q.device)[None, :] > q_pos  # [c, S]
    return logits.masked_fill(future, -math.inf).softmax(dim=-1)


def _accumulated_attention(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """H2O's mass: q [B, H, T, D], the last T of the S keys [B, H_kv, S, D] -> [B, H_kv, S] fp32, each key's
    attention summed over the queries and the group's heads; in chunks of queries of at most SCORE_CHUNK_BYTES."""
    batch, n_heads, n_new, _ = q.shape
    folded, n_keys = _fold(q, keys.shape[1]), keys.shape[2]
    chunk = max(1, SCORE_CHUNK_BYTES // (batch * n_heads * n_keys * 4))
    total = torch.zeros((batch, keys.shape[1], n_keys), dtype=torch.float32, device=q.device)
    for start in range(0, n_new, chunk):  # host integers: the chunks' shapes are known before they run
        probs = _causal_probs(folded[:, :, :, start : start + chunk], keys, first=n_keys - n_new + start)
        total += probs.sum(dim=(2, 3))
    return total


def _window_votes(q: torch.Tensor, keys: torch.Tensor, *, window: int) -> torch.Tensor:
    """SnapKV's votes: the last `window` prompt queries' attention to every key [B, H_kv, T] fp32, summed over them
    and the group, the keys before the window max-pooled over positions (the window's own keys are kept anyway)."""
    n = keys.shape[2]
    probs = _causal_probs(_fold(q[:, :, n - window :], keys.shape[1]), keys, first=n - window)
    votes = probs.sum(dim=(2, 3))  # [B, H_kv, T]
    if n == window:
        return votes
    before = F.max_pool1d(votes[..., : n - window], kernel_size=POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2)
    return torch.cat([before, votes[..., n - window :]], dim=-1)


class EvictLayout(Layout):
    """min(budget, max_tokens) slots per sequence; prefill attends exactly over the prompt, then keeps the budget; a
    decode query reads at most `budget` keys. Lossy past the budget."""

    lossy: ClassVar[bool] = True
    lossy_family: ClassVar[str | None] = "evict {policy}"  # one trace per policy
    lossy_curve: ClassVar[bool] = True  # its budgets

    def allocation(self, shape) -> KVAllocation:
        """data [L, K|V, B, H_kv, slots, D] (+ scale [.., slots, 1] for fp8/int8); no int4."""
        args = shape.model
        slots = min(self.options.budget, shape.max_tokens)
        tokens = args.n_layers * 2 * shape.batch_size * args.n_kv_heads * slots
        data = tokens * args.head_dim * BITS[shape.kv_dtype] // 8
        return KVAllocation(data, scale_bytes=tokens * SCALE_BYTES if shape.kv_dtype in QUANTIZED else 0)

    def transients(self, shape, *, n_seqs: int, n_new: int, n_keys: int) -> tuple[int, int, int]:
        """The format's write and read-back of the held keys; a prompt past the budget is held whole, decoded
        (2 sides at the compute dtype), beside the policy's fp32 probabilities (an estimate: logits and softmax)."""
        args, budget = shape.model, self.options.budget
        new, b = n_seqs * n_new * args.kv_dim, DTYPE_BYTES[shape.dtype]
        write, read_peak, read_result = codec_transients(
            shape, new=new, keys=n_seqs * min(n_keys, budget) * args.kv_dim
        )
        rows = {"h2o": n_new, "snapkv": min(self.options.window, n_new) if n_new > 1 else 0}.get(self.options.policy, 0)
        probs = 3 * min(n_seqs * args.n_heads * rows * n_keys * 4, SCORE_CHUNK_BYTES)  # logits, masked, softmax
        if n_new > 1 and n_keys > budget:
            return write + 2 * new * b, read_peak, 2 * new * b + probs
        return write, read_peak, read_result + probs

    def keys_attended(self, n_keys: float) -> float:
        return min(n_keys, self.options.budget)  # a decode query: the held keys, itself included

    def tokens_written(self, n_new: int) -> float:
        return min(n_new, self.options.budget)  # a prompt past the budget keeps `budget` of its tokens

    def causal_pairs(self, first: int, last: int) -> float:
        """Prefill is exact: every prompt query reads every key before it (the dense triangle)."""
        return 0 if last < first else last * (last + 1) // 2 - (first - 1) * first // 2

    def option_columns(self) -> dict[str, object]:
        # obs_window, not window: `window` is the sliding window's column (harness.store.schema)
        return {"policy": self.options.policy, "budget": self.options.budget, "obs_window": self.options.window}

    def check(self, shape) -> None:
        if shape.kv_dtype == "int4":
            raise ConfigError(
                f"kv_dtype: {self.name} cannot store int4; allowed: {', '.join(k for k in BITS if k != 'int4')}"
            )


STRATEGY = EvictCache
LAYOUT = EvictLayout
SERVING = Serving(
    pool="blocks", budgeted=True, caps_blocks=True, exact=False
)  # harness.kv.evict_paged over the scheduler's capped tables


def serving_cache(spec: CacheSpec, *, block_size: int, num_blocks: int, options: Options) -> kv.KVCache:
    """The serving form (harness.kv.evict_paged): a paged pool of num_blocks blocks, each sequence's `budget` slots
    in its first ceil(budget / block_size) blocks of the scheduler's table."""
    from harness.kv import evict_paged, paged  # here: evict_paged builds on this module

    pool = paged.Options(block_size=block_size, pool_tokens=num_blocks * block_size)
    return evict_paged.EvictPagedCache(spec, pool, options)


def check_serving(options: Options) -> None:
    """What serving refuses of these options, one ConfigError line (harness.kv.evict_paged.check_serving)."""
    from harness.kv import evict_paged

    evict_paged.check_serving(options)
