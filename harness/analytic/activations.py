"""The planner's transient model: the peak of the tensors one generation creates beyond weights, buffers and KV.

Prefill dominates: the whole batch's prompt goes through each layer at once, and SwiGLU's gate|up, silu and product
tensors (4 × F values per token) sit beside the residual stream (3 × dim) at the peak. Attention is not materialized
(flash-style kernels on the CPU and CUDA: no [T, S] score matrix); the logits are the last token's only. Decode adds
only the strategy's read-back transients (paged gathers, dequantization) over the whole context. Also the token ids
(int64). What a strategy adds (its transients, a mask it holds, recomputing without a cache) is its layout's answer
(harness.kv.base.Layout), checked against the real forward by tests/analytic/test_planner.py.

attn_impl=eager materializes what the fused kernels never hold: the scores and probabilities [B, H, T, S] of one
layer at a time (harness.kv.base.eager_attention), quadratic in the prompt at prefill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.analytic.activations_mla import mla_forward_bytes
from harness.formats import DTYPE_BYTES, TOKEN_ID_BYTES

if TYPE_CHECKING:
    from harness.config import Workload


def activation_bytes(w: Workload) -> int:
    """Peak bytes of the tensors one generation creates beyond weights, buffers and KV: the larger of prefill and
    the last decode step (the longest context), plus the token ids, which live throughout."""
    token_ids = TOKEN_ID_BYTES * w.batch_size * (2 * w.prompt_len + w.gen_len)  # the prompts, the output buffer
    return token_ids + max(prefill_activation_bytes(w), decode_activation_bytes(w))


def prefill_activation_bytes(w: Workload) -> int:
    """The prompt through every layer at once, B × T tokens. A strategy that holds a shared prefix (prefix caching)
    first computes it as one sequence, then the B suffixes from there, attending with a [T, S] mask."""
    batch, prompt = w.batch_size, w.prompt_len
    shared = min(w.layout().prefix_tokens(w.kv_shape()), prompt - 1)
    peaks = [forward_bytes(w, n_seqs=batch, n_new=prompt - shared, n_keys=prompt)]
    if shared:
        peaks.append(forward_bytes(w, n_seqs=1, n_new=shared, n_keys=shared))
    return max(peaks)


def decode_activation_bytes(w: Workload) -> int:
    """The last decode step, whose context is the longest: one new token per sequence over prompt + gen - 1 keys.
    A strategy that recomputes (`none`) makes that step a forward over the whole sequence so far."""
    if w.gen_len < 2:
        return 0
    keys = w.max_tokens - 1
    n_new = keys if w.layout().recomputes_prefix else 1
    return forward_bytes(w, n_seqs=w.batch_size, n_new=n_new, n_keys=keys)


def forward_bytes(w: Workload, *, n_seqs: int, n_new: int, n_keys: int, read_back: bool = True) -> int:
    """Peak live bytes of one forward (harness.modeling.model.Transformer) over n_new new tokens per sequence, attending to
    n_keys. Per token, with b = bytes(dtype), d = dim, q = q_dim, k = kv_dim, F = intermediate_size:

        norm     ffn_norm(h) beside x: fp32 x, h, x·rsqrt, weight·(.) = 16·d; else x, h (2·d·b) + its fp32 copy
                 and x·rsqrt (8·d)
        rope     x, the norm's output, qkv (2·d + q + 2·k) + rotating q: x·cos, cat(-x2, x1), (.)·sin (3·q)
        attend   x, norm out, qkv, rotated q and k (2·d + 2·q + 3·k) + the strategy's write or read-back
                 transients (Layout.transients), then the attention output (q) and its fp32 logsumexp (H·4), and
                 a causal mask offset by start_pos ([T, S] bool, harness.kv.base.attention) when T < S;
                 eager instead: q scaled (q), the scores (b) beside softmax's fp32 output (4) and its cast to b
                 (none at fp32) per head and (query, key) pair, and the mask [T, S] with its folded, inverted copies
                 [G·T, S] whenever T > 1
        wo       2·d + 2·q + 3·k + attention output (q) + wo's output (d)
        mlp      x, h, ffn_norm(h) (3·d) + gate|up (2·F) + silu(gate) (F) + silu·up (F)
        logits   the last layer's output (d: x[:, -1:] keeps its storage) + B × vocab logits

    A mask the strategy builds before the layers and holds through them (Layout.step_mask_bytes: a sliding
    window's band) counts at its building peak, and beside every phase. MLA: harness.analytic.activations_mla.
    read_back=False leaves out the strategy's read-back transients (a serving budget's, as vLLM's kernels read the
    cache in place: harness.serve.budget.profile_forward_bytes).
    """
    if w.model_args().is_mla:  # a latent cache, decompressed or absorbed: its own phases
        return mla_forward_bytes(w, n_seqs=n_seqs, n_new=n_new, n_keys=n_keys)
    layout, args, b = w.layout(), w.model_args(), DTYPE_BYTES[w.dtype]
    d, q, k, f = args.dim, args.q_dim, args.kv_dim, args.intermediate_size
    n = n_seqs * n_new  # tokens through the layers
    write, read_peak, read_result = layout.transients(w.kv_shape(), n_seqs=n_seqs, n_new=n_new, n_keys=n_keys)
    if not read_back:
        read_peak = read_result = 0
    attention_out = n * (q * b + args.n_heads * 4)
    mask = n_new * n_keys if 1 < n_new < n_keys else 0  # bool [T, S], for queries that start mid-sequence
    if w.attn_impl == "eager":  # harness.kv.base.eager_attention
        group = args.n_heads // args.n_kv_heads
        per_pair = b + 4 + (b if b != 4 else 0)  # scores, softmax's fp32 output, its cast (none for fp32)
        attention_out = n * q * b + n_seqs * args.n_heads * n_new * n_keys * per_pair + n * q * b
        mask = n_new * n_keys * (1 + (2 * group if group > 1 else 1)) if n_new > 1 else 0
    held, building = layout.step_mask_bytes(w.kv_shape(), n_new=n_new, n_keys=n_keys)
    norm = 16 * d if b == 4 else 2 * d * b + 8 * d
    attend_live = n * (2 * d + 2 * q + 3 * k) * b
    layers = max(
        n * norm,
        n * (2 * d + q + 2 * k + 3 * q) * b,
        n * (2 * d + 2 * q + 2 * k + 3 * k) * b,
        attend_live + max(write, read_peak, read_result + attention_out + mask),
        n * (3 * d + 3 * q + 3 * k) * b,
        n * (3 * d + 4 * f) * b,
        n * d * b + n_seqs * args.vocab_size * b,
    )
    return max(building, held + layers)
