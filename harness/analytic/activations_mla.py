"""The planner's transient model of one MLA forward (DeepSeek-V2, DeepSeek-AI 2024, section 2.1): what
harness.analytic.activations.forward_bytes answers for a model with kv_lora_rank set.

Shapes per layer (n = qk_nope_head_dim, r = qk_rope_head_dim, v = v_head_dim, R = kv_lora_rank, Lq = q_lora_rank,
H heads, T new tokens, S keys; harness.analytic.roofline_mla has the weights):

    q          [B, T, H·(n + r)] (through q_a [B, T, Lq] and its norm when q is compressed)
    kv_a       [B, T, R + r]: c_kv | k_rope, of which c_kv is normalized ([B, T, R]) and cached with k_rope
    absorbed   q_lat = q_nope·W_UK [B, H, T, R], cat(q_lat, q_rope) [B, H, T, R + r] against the cached latent
               [B, 1, S, R + r] (values: its first R channels), out_lat [B, H, T, R], then out_lat·W_UV [B, H, T, v]
    naive      the cached latents decompressed each forward: kv_b over c_kv [B, S, H·(n + v)] (V a view of it) and
               K = cat(k_nope, k_rope) [B, H, S, n + r]; multi-head attention out [B, H, T, v]
    o_proj     [B, T, H·v] -> [B, T, dim]

Attention itself is not materialized (flash-style kernels: no [T, S] scores), as for GQA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.analytic.roofline_mla import check_path
from harness.formats import DTYPE_BYTES

if TYPE_CHECKING:
    from harness.config import Workload


def mla_forward_bytes(w: Workload, *, n_seqs: int, n_new: int, n_keys: int) -> int:
    """Peak live bytes of one MLA forward over n_new new tokens per sequence attending to n_keys, on the
    workload's decode path (its `mla_path`) for one new token, decompressed (naive) for more: a prefill's path. Per token, with b = bytes(dtype),
    d = dim, Q = H·(n + r), C = R + r (kv_a's output), F = intermediate_size:

        norm     as GQA's (harness.analytic.activations.forward_bytes)
        project  x, h (2·d) + q (Q) + kv_a (C) + q_a and its norm (2·Lq, compressed q only)
        rope     x, h, q, kv_a, normed c_kv (2·d + Q + C + R) + rotating q's and k's rope parts (3·(H·r + r))
        attend   x, h, q, kv_a, c_kv (2·d + Q + C + R) + the strategy's write or read-back transients
                 (Layout.transients, over the latent row), then
                   absorbed  q_lat (H·R) + its cat with q_rope (H·C) + out_lat (H·R) and its fp32 logsumexp (H·4)
                   naive     per key [H·(n + v) + H·(n + r)] (kv_b's output, K), then the output (H·v) and its
                             logsumexp (H·4)
                 and a causal mask offset by start_pos ([T, S] bool) when T < S
        o_proj   2·d + Q + C + R + attention output (H·v) + o_proj's output (d)
        mlp      x, h, ffn_norm(h) (3·d) + gate|up (2·F) + silu(gate) (F) + silu·up (F)
        logits   the last layer's output (d) + B × vocab logits
    """
    mla_path = w.mla_path
    check_path(mla_path)
    if n_new > 1:  # a prefill runs decompressed whatever the decode path (harness.modeling.mla.MLAttention.forward)
        mla_path = "naive"
    layout, args, b = w.layout(), w.model_args(), DTYPE_BYTES[w.dtype]
    d, f, heads = args.dim, args.intermediate_size, args.n_heads
    nope, rope, rank, v = args.qk_nope_head_dim, args.qk_rope_head_dim, args.kv_lora_rank, args.v_head_dim
    q, c = heads * (nope + rope), rank + rope
    n = n_seqs * n_new  # tokens through the layers
    write, read_peak, read_result = layout.transients(w.kv_shape(), n_seqs=n_seqs, n_new=n_new, n_keys=n_keys)
    mask = n_new * n_keys if 1 < n_new < n_keys else 0  # bool [T, S], for queries that start mid-sequence
    held, building = layout.step_mask_bytes(w.kv_shape(), n_new=n_new, n_keys=n_keys)
    norm = 16 * d if b == 4 else 2 * d * b + 8 * d
    q_lora = 2 * args.q_lora_rank if args.q_lora_rank is not None else 0
    live = n * (2 * d + q + c + rank) * b  # x, h, q, kv_a's output, normed c_kv
    if mla_path == "absorbed":
        attention = n * ((heads * rank + heads * c + heads * rank) * b + heads * 4)
    else:
        decompressed = n_seqs * n_keys * heads * ((nope + v) + (nope + rope)) * b
        attention = decompressed + n * (heads * v * b + heads * 4)
    layers = max(
        n * norm,
        n * (2 * d + q + c + q_lora) * b,
        live + n * 3 * (heads * rope + rope) * b,
        live + max(write, read_peak, read_result + attention + mask),
        live + n * (heads * v + d) * b,
        n * (3 * d + 4 * f) * b,
        n * d * b + n_seqs * args.vocab_size * b,
    )
    return max(building, held + layers)
