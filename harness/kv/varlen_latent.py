"""MLA's latent attention over a flattened serving forward (harness.kv.varlen's layout), beside `varlen.attend`.

An MLA layer (harness.modeling.mla) caches one latent row per token, [c_kv (R) | k_rope (P)], as one "head" with no
V: a serving pool of latent blocks (harness.kv.paged, or the contiguous slots) holds it through the same
VarlenRows and format codec as K/V heads (put_rows, get_rows; fp16, bf16, fp8 and int8 per token). The forward's
sequences split as vLLM's MLA backends split them (vllm/v1/attention/backends/mla/common.py, FlashMLA's and
the Triton MLA backend's decode beside a "compute friendly" prefill):
- the decoding sequences (n_new == 1) together, `absorbed`: W_UK folded into each query ([b, H, R + P]) and one
  MQA over their gathered latents [b, 1, S, R + P] under the key mask, V = the latent's first R channels, W_UV
  applied after (DeepSeek-V2 section 2.1.2); or `naive`: their latents decompressed through wkv_b, MHA;
- each prefill chunk alone, its latent decompressed (K [1, H, end, nope + rope], V [1, H, end, v]), causal from
  its start position: a chunk is compute-bound, and decompression is paid once per key, not once per head-pair.
The latent is written for every token first, so a chunk reads the rows the same forward wrote (as varlen.attend).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from harness.errors import Unsupported
from harness.kv.base import attention
from harness.kv.varlen import SeqBatch


def attend_latent(
    cache,
    layer: int,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    batch: SeqBatch,
    *,
    absorbed: bool,
    up_weights: tuple[torch.Tensor, torch.Tensor],
    decompress: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    """q_nope [1, H, N, nope], q_rope [1, H, N, P] (RoPE applied), latent [1, 1, N, R + P] -> [1, H, N, v].

    `cache`: a strategy whose prepare(batch) made the forward's VarlenRows (`_varlen`, what its own attend hands to
    varlen.attend) over a latent spec (spec.latent_v_dim = R). up_weights: (W_UK [H, nope, R], W_UV [H, v, R]),
    views of wkv_b; decompress(latent [b, 1, S, R + P]) -> (K [b, H, S, nope + P], V [b, H, S, v]), the layer's
    own (harness.modeling.mla.MLAttention._decompress), so a prefill chunk rounds as the static path's does."""
    if batch.window is not None:  # harness.serve.engine.check_servable refuses it first, in one line
        raise Unsupported("sliding_window: MLA's latent attention reads no window; allowed: null")
    rows = cache._varlen
    assert rows is not None and rows.batch is batch, "attend_latent: after cache.prepare(batch)"
    cache.format.write(rows, layer, latent, None, 0)
    w_uk, w_uv = up_weights
    n_heads, n_tokens, v_dim = q_nope.shape[1], q_nope.shape[2], w_uv.shape[1]
    out = q_nope.new_empty((1, n_heads, n_tokens, v_dim))
    decode = batch.decode_seqs
    if decode:
        token_rows = rows.decode_token_rows  # [b] the decoding sequences' rows on the flattened axis
        q_nope_d = q_nope[0].index_select(1, token_rows).transpose(0, 1)[:, :, None]  # [b, H, 1, nope]
        q_rope_d = q_rope[0].index_select(1, token_rows).transpose(0, 1)[:, :, None]  # [b, H, 1, P]
        # [b, 1, S, R + P], V its first R channels (the format's latent read)
        keys, values = cache.format.read(rows.select("decode"), layer, rows.decode_keys, q_nope.dtype)
        if absorbed:
            q_latent = torch.cat((torch.matmul(q_nope_d, w_uk), q_rope_d), dim=-1)  # [b, H, 1, R + P]
            # MQA: the H heads folded into the query axis of the one latent head, [b, 1, H, R + P]
            y = F.scaled_dot_product_attention(
                q_latent.transpose(1, 2), keys, values, attn_mask=rows.decode_mask, scale=scale
            )  # [b, 1, H, R], mask [b, 1, 1, S]
            y = torch.matmul(y.transpose(1, 2), w_uv.transpose(1, 2))  # [b, H, 1, R] @ [H, R, v] -> [b, H, 1, v]
        else:
            k, v = decompress(keys)  # [b, H, S, nope + P], [b, H, S, v]
            q = torch.cat((q_nope_d, q_rope_d), dim=-1)  # [b, H, 1, nope + P]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=rows.decode_mask, scale=scale)  # [b, H, 1, v]
        out[0].index_copy_(1, token_rows, y[:, :, 0].transpose(0, 1))  # [H, b, v]
    for i in batch.prefill_seqs:
        first, last, start, end = batch.offsets[i], batch.offsets[i + 1], batch.start_pos[i], batch.ends[i]
        latent_i, _ = cache.format.read(rows.select(i), layer, end, q_nope.dtype)  # [1, 1, end, R + P]
        k, v = decompress(latent_i)  # [1, H, end, nope + P], [1, H, end, v]
        q = torch.cat((q_nope[:, :, first:last], q_rope[:, :, first:last]), dim=-1)  # [1, H, T_i, nope + P]
        out[:, :, first:last] = attention(q, k, v, start, scale=scale)
    return out
