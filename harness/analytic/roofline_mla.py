"""The roofline's terms for MLA, multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024, sections 2.1.2-2.1.3):
per layer, what one token, one (query, key) pair and one cached key cost, on each decode path. harness.analytic.roofline
adds them up exactly as it adds GQA's.

Notation: dim, H heads, n = qk_nope_head_dim, r = qk_rope_head_dim (P), v = v_head_dim, R = kv_lora_rank, Lq =
q_lora_rank (None: one q projection), F the SwiGLU width. The layer's weights:

    q            q_proj dim -> H·(n + r); or q_a_proj dim -> Lq, q_a_layernorm (Lq), q_b_proj Lq -> H·(n + r)
    kv_a         kv_a_proj_with_mqa dim -> R + r: the latent c_kv and the one RoPE key every head shares; then
                 kv_a_layernorm (R) on c_kv. Only c_kv | k_rope is cached: R + r values a token and layer.
    kv_b         kv_b_proj R -> H·(n + v): W_UK (R -> H·n) and W_UV (R -> H·v), the decompression
    o            o_proj H·v -> dim
    mlp, norms   as GQA's: 3·dim·F, attention_norm and ffn_norm (2·dim)

The two decode paths (FLOPs 2 per multiply-accumulate; values at the compute dtype):

    naive        every step decompresses every cached latent it attends to: k_nope, v = c_kv·W_UKᵀ, c_kv·W_UVᵀ,
                 K = cat(k_nope, k_rope) [H, S, n + r], V [H, S, v]; then multi-head attention over H heads.
                   per key     2·R·H·(n + v) FLOPs (kv_b over the key), and K, V written then read once as
                               activations: 2·H·(n + r + v) values
                   per pair    2·H·(n + r) (q·k) + 2·H·v (p·v)
    absorbed     W_UK folded into the query and W_UV into the output (section 2.1.3's "absorb"): q_lat = q_nope·W_UK
                 [H, R], scores q_lat·c_kv + q_rope·k_rope over R + r, out_lat = p·c_kv [H, R], out = out_lat·W_UV.
                 Attention reads only the latent; MQA-like, one cached head for H query heads.
                   per token   2·H·n·R + 2·H·R·v = 2·R·H·(n + v) FLOPs: the same as kv_b over one key, now paid once
                               per query instead of once per key
                   per pair    2·H·(R + r) (q·k) + 2·H·R (p·v) = 2·H·(2·R + r)

So attention's own intensity at decode, FLOPs per byte of the key it reads (b bytes a cached value):
    absorbed     2·H·(2·R + r) / ((R + r)·b): 30.2 for DeepSeek-V2-Lite in bf16 (H 16), 242 for V3 (H 128)
    GQA          4·H·D / (2·H_kv·D·b) = 2·(H / H_kv) / b: 4 for Llama-3.1-8B in bf16
    naive        (2·R·H·(n + v) + 2·H·(n + r + v)) / ((R + r)·b + 2·H·(n + r + v)·b):
                 194 for V2-Lite in bf16, 204 for V3, but at 121× absorbed's FLOPs per key (V2-Lite): it is busy
                 decompressing, not attending.
V3's 242 sits near an H800's ridge (989 TFLOP/s / 3.35 TB/s ≈ 295): FlashMLA (deepseek-ai/FlashMLA, README), the
absorbed decode kernel, reports both "up to 3000 GB/s in memory-bound configuration and 580 TFLOPS in
computation-bound configuration" on an H800 SXM5, its H query heads sharing every latent byte read as MQA's do.

Both paths apply to every forward of a point (prefill included), as harness.modeling.model's attention runs one path: a
naive prefill decompresses every key visible to its queries once, an absorbed one pays the absorption per query.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.modeling.model_args import ModelArgs

MLA_PATHS = ("absorbed", "naive")


def check_path(mla_path: str) -> None:
    if mla_path not in MLA_PATHS:
        raise ValueError(f"mla_path: {mla_path!r} is not a decode path; allowed: {', '.join(MLA_PATHS)}")


def _q_params(args: ModelArgs) -> int:
    q_out = args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim)
    if args.q_lora_rank is None:
        return args.dim * q_out
    return args.dim * args.q_lora_rank + args.q_lora_rank * q_out


def kv_b_params(args: ModelArgs) -> int:
    """W_UK and W_UV: kv_b_proj, R -> H·(n + v)."""
    return args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)


def linear_params_per_layer(args: ModelArgs) -> int:
    """The layer's matmul weights: q (or q_a, q_b), kv_a_proj_with_mqa, kv_b_proj, o_proj, the SwiGLU's three."""
    kv_a = args.dim * (args.kv_lora_rank + args.qk_rope_head_dim)
    o = args.n_heads * args.v_head_dim * args.dim
    return _q_params(args) + kv_a + kv_b_params(args) + o + 3 * args.dim * args.intermediate_size


def norm_params_per_layer(args: ModelArgs) -> int:
    """attention_norm, ffn_norm (dim each), kv_a_layernorm (R), q_a_layernorm (Lq, with q compression)."""
    return 2 * args.dim + args.kv_lora_rank + (args.q_lora_rank or 0)


def token_flops_per_layer(args: ModelArgs, mla_path: str) -> float:
    """Per token: every matmul but kv_b at 2 FLOPs a weight, plus absorbed's absorption (2·R·H·(n + v))."""
    check_path(mla_path)
    absorption = 2 * kv_b_params(args) if mla_path == "absorbed" else 0
    return 2 * (linear_params_per_layer(args) - kv_b_params(args)) + absorption


def pair_flops_per_layer(args: ModelArgs, mla_path: str) -> float:
    """One query against one key: q·k and p·v over H heads, in the latent space (absorbed) or decompressed."""
    check_path(mla_path)
    heads, rope = args.n_heads, args.qk_rope_head_dim
    if mla_path == "absorbed":
        return 2 * heads * (args.kv_lora_rank + rope) + 2 * heads * args.kv_lora_rank
    return 2 * heads * (args.qk_nope_head_dim + rope) + 2 * heads * args.v_head_dim


def key_flops_per_layer(args: ModelArgs, mla_path: str) -> float:
    """One cached key, once per forward whatever the queries: naive's decompression, 2·R·H·(n + v); absorbed 0."""
    check_path(mla_path)
    return 2 * kv_b_params(args) if mla_path == "naive" else 0


def token_activation_values_per_layer(args: ModelArgs, mla_path: str) -> int:
    """Matmul inputs and outputs of one token, once each (harness.analytic.roofline's convention), values:
    q (dim in, H·(n + r) out; with Lq: dim, Lq, Lq, H·(n + r)), kv_a (dim in, R + r out), attention, o_proj (H·v
    in, dim out), w13 (dim in, 2·F out), w2 (F in, dim out). Attention: naive reads q (H·(n + r)) and writes
    H·v; absorbed reads q_nope (H·n) and writes q_lat (H·R), reads q_lat | q_rope (H·(R + r)) and writes out_lat
    (H·R), then reads out_lat (H·R) and writes H·v."""
    check_path(mla_path)
    heads, nope, rope, rank, v = (
        args.n_heads,
        args.qk_nope_head_dim,
        args.qk_rope_head_dim,
        args.kv_lora_rank,
        args.v_head_dim,
    )
    q_out = heads * (nope + rope)
    q = args.dim + q_out + (2 * args.q_lora_rank if args.q_lora_rank is not None else 0)
    kv_a = args.dim + rank + rope
    if mla_path == "naive":
        attention = q_out + heads * v
    else:
        attention = heads * nope + heads * rank + heads * (rank + rope) + heads * rank + heads * rank + heads * v
    o = heads * v + args.dim
    mlp = args.dim + 2 * args.intermediate_size + args.intermediate_size + args.dim
    return q + kv_a + attention + o + mlp


def key_activation_values_per_layer(args: ModelArgs, mla_path: str) -> int:
    """One key decompressed (naive): K [H, n + r] and V [H, v] written, then read by attention: 2·H·(n + r + v)."""
    check_path(mla_path)
    if mla_path == "absorbed":
        return 0
    return 2 * args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim)
