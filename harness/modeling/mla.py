"""Multi-head latent attention (MLA: DeepSeek-V2, DeepSeek-AI 2024, section 2.1), after transformers'
DeepseekV2Attention/DeepseekV3Attention, so their checkpoints load without permutation.

Per token, x -> q (one projection `wq`, or a low-rank pair `wq_a`, `q_norm`, `wq_b`) as H heads of nope + rope;
x -> `wkv_a` -> [c_kv (R = kv_lora_rank) | k_rope (P = qk_rope_head_dim)], c_kv through `kv_norm`; `wkv_b` lifts c_kv
to each head's [k_nope | v]. RoPE rotates q_rope and the one k_rope every head shares. The cache stores only the
latent [c_kv | k_rope] ([B, 1, S, R + P], one "head"), never K or V.

Two decode paths over that latent (`path`):
    naive     decompress every cached token's K [B, H, S, nope + rope] and V [B, H, S, v] through wkv_b at every
              step, then ordinary attention: wkv_b's FLOPs and the decompressed K/V grow with the context.
    absorbed  fold W_UK into the query (q_nope @ W_UK: [B, H, T, R]) and W_UV into the output, so attention is MQA over
              the latent itself, K = [c_kv | k_rope], V = c_kv (section 2.1.2's "absorb"): each step reads R + P
              values per cached token, for all H heads at once.
Both apply the same softmax scale (ModelArgs.softmax_scale: nope + rope, YaRN's mscale) and are equal in exact
arithmetic.

Serving (start_pos a harness.kv.varlen.SeqBatch: the tokens of sequences at their own positions, flattened) reads the
latent from a pool (harness.kv.paged's blocks, or contiguous slots) through the forward's VarlenRows and format
codec, as K/V heads are read (per-token formats: fp16, bf16, fp8, int8). `_attend_varlen` splits the sequences as
vLLM's MLA backends do (vllm/v1/attention/backends/mla/common.py, a "data-movement friendly" decode beside a
"compute friendly" prefill):
- the decoding sequences (n_new == 1) together: absorbed, W_UK folded into each query and one MQA over their
  gathered latents [b, 1, S, R + P] under the key mask, V its first R channels; or naive, decompressed;
- each prefill chunk alone: its latent decompressed through wkv_b, causal from its start position.
Every token's latent is written first, so a chunk reads the rows the same forward wrote (as varlen.attend does).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.errors import Unsupported
from harness.kv import varlen
from harness.kv.base import KVCache, attention
from harness.modeling.model import (  # harness.modeling.model imports this module only when it builds an MLA layer
    RMSNorm,
    apply_rope,
)
from harness.modeling.model_args import ModelArgs

MLA_PATHS = ("absorbed", "naive")
# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV2RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...]: DeepSeek's RoPE pairs (2i, 2i+1) become rotate_half's
    (i, i + P/2), as transformers' apply_rotary_pos_emb_interleave lays them out (V2's complex rotation pairs the
    same channels; q·k is unchanged by a permutation both share)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, path: str = "absorbed") -> None:
        super().__init__()
        if path not in MLA_PATHS:
            raise ValueError(f"mla_path: unknown value {path!r}; allowed: {', '.join(MLA_PATHS)}")
        self.layer_index, self.path = layer_index, path
        self.n_heads, self.rope_interleave = args.n_heads, args.rope_interleave
        self.rank, self.rope_dim = args.kv_lora_rank, args.qk_rope_head_dim
        self.nope_dim, self.v_dim = args.qk_nope_head_dim, args.v_head_dim
        self.scale = args.softmax_scale
        q_out = args.n_heads * (self.nope_dim + self.rope_dim)
        if args.q_lora_rank is None:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int, cache: KVCache
    ) -> torch.Tensor:
        batch_size, n_new, _ = x.shape  # [B, T, dim]
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(batch_size, n_new, self.n_heads, -1).transpose(1, 2)  # [B, H, T, nope + rope]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = self.wkv_a(x).split([self.rank, self.rope_dim], dim=-1)  # [B, T, R], [B, T, P]
        c_kv = self.kv_norm(c_kv).unsqueeze(1)  # [B, 1, T, R]
        k_rope = k_rope.unsqueeze(1)  # [B, 1, T, P]: one RoPE key shared by every head
        if self.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        latent = torch.cat((c_kv, k_rope), dim=-1)  # [B, 1, T, R + P]: all the cache stores
        if isinstance(start_pos, varlen.SeqBatch):  # serving: B = 1, T = N tokens of sequences at their own positions
            y = self._attend_varlen(q_nope, q_rope, latent, start_pos, cache)  # [1, H, N, v]
            return self.wo(y.transpose(1, 2).reshape(batch_size, n_new, self.n_heads * self.v_dim))
        # A prefill (T > 1) always runs decompressed: it is compute-bound, and the absorbed form's attention costs
        # H·(2R + P) multiply-adds per pair against naive's H·(2n + r) (4.25x for V2-Lite), while its decompression
        # is paid once per token. vLLM's MLA backends split the same way (vllm/v1/attention/backends/mla/common.py:
        # the "compute friendly" form for prefill, the "data-movement friendly" absorbed form for decode).
        if self.path == "absorbed" and n_new == 1:
            y = self._absorbed(q_nope, q_rope, latent, start_pos, cache)
        else:
            y = self._naive(q_nope, q_rope, latent, start_pos, cache)
        y = y.transpose(1, 2).reshape(batch_size, n_new, self.n_heads * self.v_dim)  # [B, T, H * v]
        return self.wo(y)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """wkv_b's weight [H * (nope + v), R] as W_UK [H, nope, R] and W_UV [H, v, R] (views, no copy)."""
        w = self.wkv_b.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _absorbed(self, q_nope, q_rope, latent, start_pos, cache: KVCache) -> torch.Tensor:
        w_uk, w_uv = self._up_weights()
        q_latent = torch.matmul(q_nope, w_uk)  # [B, H, T, nope] @ [H, nope, R] -> [B, H, T, R]
        q = torch.cat((q_latent, q_rope), dim=-1)  # [B, H, T, R + P]
        # MQA over the latent: K = latent [B, 1, S, R + P], V = its first R channels (the cache's latent_v_dim).
        y_latent = cache.attend(self.layer_index, q, latent, None, start_pos)  # [B, H, T, R]
        return torch.matmul(y_latent, w_uv.transpose(1, 2))  # [B, H, T, R] @ [H, R, v] -> [B, H, T, v]

    def _decompress(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, 1, S, R + P] -> K [B, H, S, nope + rope], V [B, H, S, v] through wkv_b (the naive form)."""
        c_all, k_rope_all = latent.split([self.rank, self.rope_dim], dim=-1)
        batch_size, _, n_keys, _ = c_all.shape
        kv = self.wkv_b(c_all[:, 0]).view(batch_size, n_keys, self.n_heads, -1).transpose(1, 2)  # [B, H, S, nope+v]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope_all.expand(-1, self.n_heads, -1, -1)), dim=-1)  # [B, H, S, nope + rope]
        return k, v

    def _naive(self, q_nope, q_rope, latent, start_pos, cache: KVCache) -> torch.Tensor:
        latent_all, _ = cache.store_and_read(self.layer_index, latent, None, start_pos)  # [B, 1, S, R + P]
        k, v = self._decompress(latent_all)
        q = torch.cat((q_nope, q_rope), dim=-1)  # [B, H, T, nope + rope]
        return attention(q, k, v, start_pos, scale=self.scale)  # [B, H, T, v]

    def _attend_varlen(self, q_nope, q_rope, latent, batch: varlen.SeqBatch, cache: KVCache) -> torch.Tensor:
        """q_nope [1, H, N, nope], q_rope [1, H, N, P] (RoPE applied), latent [1, 1, N, R + P] -> [1, H, N, v].

        `cache`: a serving strategy (contiguous or paged) whose prepare(batch) made this forward's VarlenRows
        (`_varlen`, what its own attend hands to harness.kv.varlen.attend), over a latent spec (latent_v_dim = R)."""
        if batch.window is not None:  # harness.serve.engine.check_servable refuses it first, in one line
            raise Unsupported("sliding_window: MLA's served latent attention reads no window; allowed: null")
        rows = cache._varlen
        assert rows is not None and rows.batch is batch, "MLA serving: after cache.prepare(batch)"
        cache.format.write(rows, self.layer_index, latent, None, 0)
        out = q_nope.new_empty((1, self.n_heads, q_nope.shape[2], self.v_dim))
        if batch.decode_seqs:
            token_rows = rows.decode_token_rows  # [b] the decoding sequences' rows on the flattened axis
            q_nope_d = q_nope[0].index_select(1, token_rows).transpose(0, 1)[:, :, None]  # [b, H, 1, nope]
            q_rope_d = q_rope[0].index_select(1, token_rows).transpose(0, 1)[:, :, None]  # [b, H, 1, P]
            # [b, 1, S, R + P] and V its first R channels, the format's latent read; mask [b, 1, 1, S]
            keys, values = cache.format.read(rows.select("decode"), self.layer_index, rows.decode_keys, q_nope.dtype)
            if self.path == "absorbed":
                w_uk, w_uv = self._up_weights()
                q = torch.cat((torch.matmul(q_nope_d, w_uk), q_rope_d), dim=-1)  # [b, H, 1, R + P]
                # MQA: the H heads folded into the query axis of the one latent head, [b, 1, H, R + P] -> [b, 1, H, R]
                y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=rows.decode_mask,
                                                   scale=self.scale)  # fmt: skip
                y = torch.matmul(y.transpose(1, 2), w_uv.transpose(1, 2))  # [b, H, 1, R] @ [H, R, v] -> [b, H, 1, v]
            else:
                k, v = self._decompress(keys)  # [b, H, S, nope + P], [b, H, S, v]
                q = torch.cat((q_nope_d, q_rope_d), dim=-1)  # [b, H, 1, nope + P]
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=rows.decode_mask, scale=self.scale)
            out[0].index_copy_(1, token_rows, y[:, :, 0].transpose(0, 1))  # [H, b, v]
        for i in batch.prefill_seqs:
            first, last, start, end = batch.offsets[i], batch.offsets[i + 1], batch.start_pos[i], batch.ends[i]
            latent_i, _ = cache.format.read(rows.select(i), self.layer_index, end, q_nope.dtype)  # [1, 1, end, R + P]
            k, v = self._decompress(latent_i)  # [1, H, end, nope + P], [1, H, end, v]
            q = torch.cat((q_nope[:, :, first:last], q_rope[:, :, first:last]), dim=-1)  # [1, H, T_i, nope + P]
            out[:, :, first:last] = attention(q, k, v, start, scale=self.scale)
        return out
