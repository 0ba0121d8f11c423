"""The small base every KV-cache strategy subclasses (KVCache), and the attention they share.

A strategy owns the storage of past Keys and Values and answers one question per layer and step: "here are the
new tokens' q, k, v; store k and v, then attend q over everything this sequence has seen". That keeps paging,
quantization, windows and offloading each inside one file, and keeps the model and the timer ignorant of them.

Queries are never cached: each one is used once, by the step that made it.

Lifecycle, driven by `harness.modeling.decode`:
    cache = Strategy(spec, options)   # allocates (contiguous) or builds the pool (paged)
    cache.prefill_prefix(model, prompt)   # once per prefill: the shared prefix's tokens it holds (0 but prefix)
    cache.prepare(start_pos, n_new)   # once per forward, before the layers: grow block tables, check capacity
    cache.attend(layer, q, k, v, start_pos)   # once per layer
    cache.release()                   # the sequences completed: return blocks, forget lengths
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from harness.errors import Unsupported
from harness.formats import BITS, SCALE_BYTES
from harness.kv.footprint import (
    KVAllocation,
    cache_width,
    codec_transients,
    data_row_bytes,
    int4_tail_bytes,
    scale_parts,
)
from harness.kv.quant import PLAIN
from harness.kv.serve_mode import Serving  # noqa: F401  (re-exported: harness.kv.paged and harness.serve import it here)
from harness.kv.shape import KVShape


@dataclass(frozen=True)
class CacheSpec:
    """What every strategy needs to know about the model and the sweep point, whatever its options."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    batch_size: int
    max_tokens: int  # prompt_len + gen_len: the longest a sequence gets at this point
    kv_dtype: str  # storage format (harness.kv.quant.BITS), independent of the model's compute dtype
    device: torch.device
    kv_group_size: int = 32  # int4: values per quantization group
    kv_residual: int = 0  # int4: the most recent tokens kept in full precision (KIVI's residual)
    prefix_len: int = 0  # leading prompt tokens every sequence of the batch shares (a system prompt)
    dtype: str | None = None  # the model's compute dtype name, when the caller knows it
    attn_impl: str = "sdpa"  # harness.formats.ATTN_IMPLS: SDPA's fused kernels, or eager's materialized scores
    # MLA's latent (harness.modeling.mla): no V is stored, V is the first latent_v_dim channels of K ([c_kv | k_rope]);
    # 0: K and V are stored apart.
    latent_v_dim: int = 0
    softmax_scale: float | None = None  # the factor on q·k in attend; None: 1 / sqrt(q's head width), SDPA's
    # Which weights computed these K/V (harness.run.point.model_id: preset, checkpoint or seed, compute dtype): a
    # store that outlives the process (harness.kv.tiers' disk tier) files its blocks under it. "": unknown.
    model_id: str = ""

    @classmethod
    def for_model(cls, args, *, batch_size: int, max_tokens: int, kv_dtype: str, device: torch.device, **quant):
        """From a harness.modeling.model_args.ModelArgs (any object with n_layers, n_kv_heads, head_dim): the heads and
        width the cache stores per token (MLA: one latent head of kv_lora_rank + qk_rope_head_dim)."""
        is_mla = getattr(args, "is_mla", False)
        return cls(
            n_layers=args.n_layers,
            n_kv_heads=getattr(args, "cache_heads", args.n_kv_heads),
            head_dim=getattr(args, "cache_head_dim", args.head_dim),
            batch_size=batch_size,
            max_tokens=max_tokens,
            kv_dtype=kv_dtype,
            device=device,
            latent_v_dim=args.kv_lora_rank if is_mla else 0,
            softmax_scale=args.softmax_scale if is_mla else None,
            **quant,
        )

    @property
    def sides(self) -> tuple[str, ...]:
        """What is stored per token: ("k", "v"), or MLA's latent alone, ("k",)."""
        return ("k",) if self.latent_v_dim else ("k", "v")

    @property
    def bytes_per_token(self) -> float:
        """K and V of one token of one sequence across all layers, in bytes, scales excluded (the seed notes'
        formula per token: 2 x layers x kv_heads x head_dim x bytes; MLA: layers x (R + P) x bytes)."""
        return len(self.sides) * self.n_layers * self.n_kv_heads * self.head_dim * BITS[self.kv_dtype] / 8

    @property
    def plain_dtype(self) -> torch.dtype:
        """The torch dtype of a plain (unquantized) format; Unsupported for a quantized one."""
        if self.kv_dtype not in PLAIN:
            raise Unsupported(f"kv_dtype {self.kv_dtype} is not a plain dtype")
        return PLAIN[self.kv_dtype]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the tensors' elements take, together."""
    return sum(t.numel() * t.element_size() for t in tensors)


class KVCache:
    """The base every strategy's cache subclasses: the protocol the harness drives, and what a strategy declares it
    can do. Callers ask the declaration, never probe for a method (issue #28 item 3); the defaults are the plain
    case, which most strategies are."""

    name: ClassVar[str]
    # True only for the no-cache baseline: the decode loop then feeds the whole sequence at every step.
    recomputes_prefix: ClassVar[bool] = False
    # Whether decode steps can run at static shapes (enable_static_decode), so compile captures them.
    supports_static_decode: ClassVar[bool] = False
    attn_backend: str = "sdpa"  # the decode attention that runs ("sdpa" unless the strategy has kernels of its own)
    # A prefix cache: whether the last prefill found its prefix stored; None for any other.
    prefix_hit: bool | None = None
    spec: CacheSpec  # the model and sweep point it is built for
    n_tokens: int = 0  # tokens seen per sequence (the sequences of a batch move in step)

    def prepare(self, start_pos: int, n_new: int) -> None:
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        """q [B, H, T, D], k and v [B, H_kv, T, D] for positions start_pos..start_pos+T-1 -> [B, H, T, D]."""
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    # --- declared capabilities ------------------------------------------------------------------------------
    def prefill_prefix(
        self, model: torch.nn.Module, prompt: torch.Tensor, *, prompt_ids: list[list[int]] | None = None
    ) -> int:
        """prompt [B, P]: make the prefix every sequence shares present (found stored, or computed into the cache);
        return how many leading tokens it holds, which harness.modeling.decode's prefill then skips. 0: this strategy
        shares no prefix, and the whole prompt runs (a prefix cache, harness.kv.prefix, overrides it)."""
        return 0

    def enable_static_decode(self) -> None:
        """Prepare decode steps at static shapes (harness.modeling.decode.compile_decode_step). A strategy that declares
        supports_static_decode overrides it."""
        raise Unsupported(f"compile: cache {self.name} has no static-shape decode step")

    # --- bytes: the strategy says what it stores and how many tokens it holds; the base counts them --------------
    def data_tensors(self) -> list[torch.Tensor]:
        """The tensors holding K and V (or MLA's latent) at the storage format, wherever they live; [] for a strategy
        that keeps none."""
        return []

    def scale_tensors(self) -> list[torch.Tensor]:
        """The tensors holding quantization scales and zero points; [] for plain dtypes."""
        return []

    def tail_tensors(self) -> list[torch.Tensor]:
        """The full-precision tail a format keeps beside its narrow storage (int4's); [] otherwise."""
        return []

    def tokens_held(self) -> int:
        """Tokens each sequence has stored right now (the sequences of a batch move in step): those seen, or as many
        as a window or a budget keeps of them."""
        return self.n_tokens

    def kv_bytes_allocated(self) -> int:
        """Bytes of KV storage this strategy holds right now: data, scales and tail."""
        return tensor_bytes([*self.data_tensors(), *self.scale_tensors(), *self.tail_tensors()])

    def kv_bytes_live(self) -> int:
        """Bytes the tokens present actually need at the storage format's bits, scales excluded."""
        return int(self.tokens_held() * self.spec.batch_size * self.spec.bytes_per_token)

    def kv_scale_bytes(self) -> int:
        """Of kv_bytes_allocated, the bytes that hold quantization scales and zero points (0 for plain dtypes)."""
        return tensor_bytes(self.scale_tensors())

    def kv_tail_bytes(self) -> int:
        """Of kv_bytes_allocated, the full-precision tail a format keeps beside its narrow storage (int4's
        residual window and incomplete key group; 0 otherwise)."""
        return tensor_bytes(self.tail_tensors())

    # --- rows -----------------------------------------------------------------------------------------------
    def peak_columns(self) -> dict[str, int]:
        """Row columns of the strategy's own, read at the peak beside kv_bytes_allocated (offload's kv_bytes_host,
        prefix caching's kv_bytes_shared); {} for most."""
        return {}

    def row_columns(self, ttft_ms: Callable[[], float], *, n: int) -> dict[str, Any]:
        """Row columns of the strategy's own, measured after the timed generations by running more of them
        (`ttft_ms`: one more generation, its TTFT; `n` of them per figure): a prefix cache's TTFT per tier below
        device memory (harness.kv.prefix). {} for most."""
        return {}


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    impl: str = "sdpa",
    scale: float | None = None,
) -> torch.Tensor:
    """q [B, H, T, D] over k, v [B, H_kv, S, D] in q's dtype, each group of G = H / H_kv query heads sharing one
    K/V head; mask [T, S] bool (True = attend), or None when every query sees every key. Returns [B, H, T, D].
    impl "eager": eager_attention's materialized scores instead of SDPA.

    GQA is folded into the query axis: [B, H, T, D] -> [B, H_kv, G*T, D] (query head h = h_kv * G + g, the grouping
    of SDPA's enable_gqa) and the mask repeated to [G*T, S], so SDPA sees equal head counts and needs no enable_gqa.
    Why not a mask with enable_gqa: on CUDA the flash kernel takes no arbitrary mask, and up to torch 2.13 the
    memory-efficient kernel refuses enable_gqa (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
    can_use_mem_efficient_attention: check_batch_size_and_num_heads_dense<false /*supports_gqa*/>; 2.13's
    F.scaled_dot_product_attention docstring: GQA "works only for Flash_attention and math kernel"; 2.14 added it),
    so on the torch >= 2.6 this project allows such a call could run the math backend, which repeats K/V per group
    and materializes [B, H, T, S] scores. The folded call suits the memory-efficient kernel on all of them (a mask,
    equal heads; its own head-dim alignment aside), its mask costs [G*T, S] broadcast over B and H_kv, and each K/V
    head is read once for its whole group: repeated K/V would multiply by G the very bytes this benchmark measures.
    Why not torch.nn.attention.bias.causal_lower_right: it reaches a fused kernel only through flash (fp16/bf16),
    falls back to a materialized mask plus enable_gqa (the math backend again) for fp32 up to torch 2.13, and it
    cannot express the sliding window's band, which shares this function (harness.kv.sliding).
    """
    batch, n_heads, n_new, head_dim = q.shape
    n_kv_heads = k.shape[1]
    group = n_heads // n_kv_heads
    folded_q = q.reshape(batch, n_kv_heads, group * n_new, head_dim)  # copies q when it is a transposed view
    folded_mask = mask if mask is None or group == 1 else mask.repeat(group, 1)  # row g*T + t is query t
    if impl == "eager":
        out = eager_attention(folded_q, k, v, mask=folded_mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(folded_q, k, v, attn_mask=folded_mask, scale=scale)
    return out.view(batch, n_heads, n_new, v.shape[-1])  # V's width: MLA's differs from q's


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, scale: float | None = None
) -> torch.Tensor:
    """Attention as it ran before FlashAttention (Dao et al. 2022): the scores written out, then softmax, then a
    second matmul. q [B, H, T, D], k [B, H, S, D] and v [B, H, S, D_v] (GQA already folded), mask [T, S] bool or
    None, scale the factor on q·k (None: 1 / sqrt(D)) -> [B, H, T, D_v].

    Per layer it materializes the scores [B, H, T, S] and the probabilities [B, H, T, S], both in the compute dtype:
    written, read by softmax, written, read by p·v (4 passes over T·S values per head; a mask adds a read and a
    write), which SDPA's fused kernels never do. softmax itself runs in fp32 as transformers' eager path does
    (`eager_attention_forward`: softmax(dtype=float32) then cast back), so its accuracy matches SDPA's; the fp32
    softmax is a third transient of [B, H, T, S] · 4 bytes while it runs. Labelled `kvbench::attention`, so the
    profiler counts its matmuls as attention, not GEMM."""
    with record_function("kvbench::attention"):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        scores = (q * scale) @ k.transpose(-1, -2)  # [B, H, T, S]; q scaled first: T·D, not T·S
        if mask is not None:
            scores = scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [B, H, T, S]
        del scores
        return probs @ v  # [B, H, T, D_v]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_pos: int,
    *,
    impl: str = "sdpa",
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of T new queries at positions start_pos.. over S = start_pos + T keys.

    q [B, H, T, D]; k [B, H_kv, S, D], v [B, H_kv, S, D_v] in any storage dtype (cast to q's); returns
    [B, H, T, D_v]. GQA/MQA: each group of H / H_kv query heads shares one K/V head (Ainslie et al. 2023).
    impl: "sdpa" (fused kernels) or "eager" (eager_attention: the scores materialized), harness.formats.ATTN_IMPLS.
    scale: the factor on q·k (None: 1 / sqrt(D); MLA's differs, harness.modeling.model_args.ModelArgs.softmax_scale).
    """
    n_new, n_keys = q.shape[2], k.shape[2]
    assert n_keys == start_pos + n_new, f"cache holds {n_keys} keys, expected {start_pos + n_new}"
    k, v = k.to(q.dtype), v.to(q.dtype)
    if n_new == 1:
        # One decode token sees every key: no mask, and GQA folded so every K/V head is read once for its group.
        return grouped_attention(q, k, v, impl=impl, scale=scale)
    if start_pos == 0 and impl != "eager":
        # Square causal: no mask tensor, so flash (which takes GQA natively) runs on CUDA in fp16/bf16. (fp32 with
        # GQA still takes the math backend on CUDA up to torch 2.13: flash takes no fp32, see grouped_attention.)
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    # Queries start mid-sequence (chunked prefill, the suffix after a cached prefix), or eager's prefill: query i
    # sees keys 0..start_pos+i, a lower-right causal mask [T, S], which is_causal (upper-left) cannot express.
    q_pos = torch.arange(start_pos, n_keys, device=q.device)[:, None]
    k_pos = torch.arange(n_keys, device=q.device)[None, :]
    return grouped_attention(q, k, v, mask=k_pos <= q_pos, impl=impl, scale=scale)


def blocks_for(n_tokens: int, block_size: int) -> int:
    return math.ceil(n_tokens / block_size)


# --- what a strategy knows about a workload, without building it ------------------------------------------------


class Layout:
    """A strategy's knowledge of a workload, asked by the planner (harness.analytic), the roofline and the sweep's OOM
    backstop, so that none of them knows a strategy by name. Each harness/kv/<name>.py defines `LAYOUT`, a subclass.

    These defaults are the dense case, `contiguous`: every sequence holds max_tokens rows of K and V, each query
    reads every key before it, the codecs' transients are those of a buffer read in place. `shape` is the
    workload's harness.kv.shape.KVShape (harness.config.Workload.kv_shape); token counts are per sequence.
    """

    # True only for the no-cache baseline: a decode step is a forward over the whole sequence so far.
    recomputes_prefix: ClassVar[bool] = False
    # Whether the strategy drops K/V some query would attend to (a sliding window), so accuracy is measured.
    lossy: ClassVar[bool] = False
    # Whether the cache stores MLA's latent (CacheSpec.latent_v_dim: K = [c_kv | k_rope], V its first channels).
    stores_latent: ClassVar[bool] = False
    # How a lossy strategy loses accuracy, as the dashboard's KL chart names its trace (dashboard.charts.strategies
    # .lossy_family), formatted with the row's columns: "evict {policy}". None: an exact layout, whose rows are
    # named by their kv_dtype ("quantized fp8_e4m3").
    lossy_family: ClassVar[str | None] = None
    # Whether a family's rows are one curve through an option (evict's budgets), which the KL chart draws joined.
    lossy_curve: ClassVar[bool] = False

    def __init__(self, name: str, options: Any) -> None:
        self.name, self.options = name, options

    # --- memory ---------------------------------------------------------------------------------------------
    def allocation(self, shape: KVShape) -> KVAllocation:
        """Exactly what the cache's kv_bytes_allocated() reports at the peak of a generation (after its first
        write, when int4 allocates its tail). Dense: K and V each [L, B, H_kv, S, w] (MLA: the one latent side
        [L, B, 1, S, w], w from kv_lora_rank + qk_rope_head_dim); each scale part [L, B, H_kv, ceil(S / tokens),
        width] (harness.kv.contiguous)."""
        args = shape.model
        lead = args.n_layers * shape.batch_size * args.cache_heads
        data = lead * args.cache_sides * shape.max_tokens * data_row_bytes(shape)
        scales = sum(
            lead * blocks_for(shape.max_tokens, tokens) * width * SCALE_BYTES for tokens, width in scale_parts(shape)
        )
        return KVAllocation(data, scale_bytes=scales, tail_bytes=int4_tail_bytes(shape))

    def pool_fits(self, shape: KVShape) -> bool:
        """Whether a fixed pool holds the batch at its peak; False is KVPoolExhausted (an `oom` row)."""
        return True

    def transients(self, shape: KVShape, *, n_seqs: int, n_new: int, n_keys: int) -> tuple[int, int, int]:
        """(write peak, read-back peak, read-back result) in bytes, for one layer's attend: what the strategy
        creates beside the layer's live tensors when it stores n_new tokens per sequence and reads n_keys back."""
        width = cache_width(shape)
        return codec_transients(shape, new=n_seqs * n_new * width, keys=n_seqs * n_keys * width)

    def step_mask_bytes(self, shape: KVShape, *, n_new: int, n_keys: int) -> tuple[int, int]:
        """(held, peak while built) bytes of a mask the strategy builds for a whole forward before the layers and
        holds through them; (0, 0) when it builds none (a layer's own causal mask is the planner's)."""
        return 0, 0

    # --- reads -------------------------------------------------------------------------------------------
    def keys_attended(self, n_keys: float) -> float:
        """Keys one query reads when n_keys precede it, itself included. math.inf -> the most any query ever
        reads (inf: no cap)."""
        return n_keys

    def tokens_written(self, n_new: int) -> float:
        """Of n_new tokens one forward computes for a sequence, how many the cache stores (a ring: the last ones)."""
        return n_new

    def causal_pairs(self, first: int, last: int) -> float:
        """Σ keys_attended(n) for n = first..last: the (query, key) pairs of queries at positions first-1..last-1."""
        if last < first:
            return 0
        if type(self).keys_attended is not Layout.keys_attended:  # a strategy's own rule, summed as it is
            return sum(self.keys_attended(n) for n in range(first, last + 1))
        return last * (last + 1) // 2 - (first - 1) * first // 2

    def prefix_tokens(self, shape: KVShape) -> int:
        """Leading prompt tokens a prefix hit finds stored, held once for the whole batch (0: no sharing)."""
        return 0

    # --- rows --------------------------------------------------------------------------------------------
    def option_columns(self) -> dict[str, Any]:
        """The options as row columns (harness.store.schema names them: block_size, pool_tokens, window, sinks)."""
        return dataclasses.asdict(self.options)

    def comparable_columns(self) -> tuple[str, ...]:
        """Option columns that must match for two points' memory to be compared (the sweep's OOM backstop)."""
        return tuple(self.option_columns())

    def mixed_batch(self, spec: CacheSpec, lengths: list[int]) -> KVCache:
        """The cache for a batch of requests of these final lengths, each grown to its own, at its peak
        (lengths=mixed, harness.measure.fragmentation); Unsupported for a strategy that does not measure allocation waste."""
        raise Unsupported(f"lengths=mixed measures allocation waste of contiguous and paged only, not {self.name}")

    # --- what it cannot run ------------------------------------------------------------------------------
    def check(self, shape: KVShape) -> None:
        """A ConfigError naming the field, for what the cache raises Unsupported for; the dense default stores any
        format (int4 groups checked by the config)."""

    def check_device(self, device: str) -> None:
        """A ConfigError naming the field when the strategy cannot run on `device` ("cpu" or "cuda")."""
