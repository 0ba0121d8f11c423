"""The small protocol every KV-cache strategy follows, and the attention they share.

A strategy owns the storage of past Keys and Values and answers one question per layer and step: "here are the
new tokens' q, k, v; store k and v, then attend q over everything this sequence has seen". That keeps paging,
quantization, windows and offloading each inside one file, and keeps the model and the timer ignorant of them.

Queries are never cached: each one is used once, by the step that made it.

Lifecycle, driven by `harness.decode`:
    cache = Strategy(spec, options)   # allocates (contiguous) or builds the pool (paged)
    cache.prepare(start_pos, n_new)   # once per forward, before the layers: grow block tables, check capacity
    cache.attend(layer, q, k, v, start_pos)   # once per layer
    cache.release()                   # the sequences completed: return blocks, forget lengths
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from harness.errors import Unsupported
from harness.kv.quant import BITS, PLAIN


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

    @classmethod
    def for_model(cls, args, *, batch_size: int, max_tokens: int, kv_dtype: str, device: torch.device, **quant):
        """From a harness.model.ModelArgs (any object with n_layers, n_kv_heads, head_dim)."""
        return cls(
            n_layers=args.n_layers,
            n_kv_heads=args.n_kv_heads,
            head_dim=args.head_dim,
            batch_size=batch_size,
            max_tokens=max_tokens,
            kv_dtype=kv_dtype,
            device=device,
            **quant,
        )

    @property
    def bytes_per_token(self) -> float:
        """K and V of one token of one sequence across all layers, in bytes, scales excluded (the seed notes'
        formula per token: 2 x layers x kv_heads x head_dim x bytes)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * BITS[self.kv_dtype] / 8

    @property
    def plain_dtype(self) -> torch.dtype:
        """The torch dtype of a plain (unquantized) format; Unsupported for a quantized one."""
        if self.kv_dtype not in PLAIN:
            raise Unsupported(f"kv_dtype {self.kv_dtype} is not a plain dtype")
        return PLAIN[self.kv_dtype]


class KVCache(Protocol):
    name: ClassVar[str]
    # True only for the no-cache baseline: the decode loop then feeds the whole sequence at every step.
    recomputes_prefix: ClassVar[bool]

    def prepare(self, start_pos: int, n_new: int) -> None: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        """q [B, H, T, D], k and v [B, H_kv, T, D] for positions start_pos..start_pos+T-1 -> [B, H, T, D]."""
        ...

    def release(self) -> None: ...

    def kv_bytes_allocated(self) -> int:
        """Bytes of KV storage this strategy holds right now."""
        ...

    def kv_bytes_live(self) -> int:
        """Bytes the tokens present actually need at the storage format's bits, scales excluded."""
        ...

    def kv_scale_bytes(self) -> int:
        """Of kv_bytes_allocated, the bytes that hold quantization scales and zero points (0 for plain dtypes)."""
        ...

    def kv_tail_bytes(self) -> int:
        """Of kv_bytes_allocated, the full-precision tail a format keeps beside its narrow storage (int4's
        residual window and incomplete key group; 0 otherwise)."""
        ...


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """q [B, H, T, D] over k, v [B, H_kv, S, D] in q's dtype, each group of G = H / H_kv query heads sharing one
    K/V head; mask [T, S] bool (True = attend), or None when every query sees every key. Returns [B, H, T, D].

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
    out = F.scaled_dot_product_attention(folded_q, k, v, attn_mask=folded_mask)
    return out.view(batch, n_heads, n_new, head_dim)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Causal attention of T new queries at positions start_pos.. over S = start_pos + T keys.

    q [B, H, T, D]; k, v [B, H_kv, S, D] in any storage dtype (cast to q's); returns [B, H, T, D].
    GQA/MQA: each group of H / H_kv query heads shares one K/V head (Ainslie et al. 2023).
    """
    n_new, n_keys = q.shape[2], k.shape[2]
    assert n_keys == start_pos + n_new, f"cache holds {n_keys} keys, expected {start_pos + n_new}"
    k, v = k.to(q.dtype), v.to(q.dtype)
    if n_new == 1:
        # One decode token sees every key: no mask, and GQA folded so every K/V head is read once for its group.
        return grouped_attention(q, k, v)
    if start_pos == 0:
        # Square causal: no mask tensor, so flash (which takes GQA natively) runs on CUDA in fp16/bf16. (fp32 with
        # GQA still takes the math backend on CUDA up to torch 2.13: flash takes no fp32, see grouped_attention.)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    # Queries start mid-sequence (chunked prefill, the suffix after a cached prefix): query i sees keys
    # 0..start_pos+i, a lower-right causal mask [T, S], which is_causal (upper-left) cannot express.
    q_pos = torch.arange(start_pos, n_keys, device=q.device)[:, None]
    k_pos = torch.arange(n_keys, device=q.device)[None, :]
    return grouped_attention(q, k, v, mask=k_pos <= q_pos)


def blocks_for(n_tokens: int, block_size: int) -> int:
    return math.ceil(n_tokens / block_size)
