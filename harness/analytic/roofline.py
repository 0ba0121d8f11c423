"""The analytic step model: FLOPs and bytes of a prefill and of each decode step, and the roofline verdict.

For one sweep point (model shapes, batch, position, compute dtype, kv_dtype, strategy) it says how many FLOPs a step
does and how many bytes it moves, so that a measured step time becomes an achieved bandwidth and FLOP rate, and the
roofline (Williams, Waterman & Patterson 2009, "Roofline") says which ceiling binds:

    predicted step time = max(flops / peak_flops, bytes / peak_bandwidth)
    ridge point         = peak_flops / peak_bandwidth   # FLOPs per byte; above it a step is compute-bound

Notation: B sequences, L layers, dim, H query heads, H_kv KV heads, D head_dim, q_dim = H·D, kv_dim = H_kv·D, F the
SwiGLU width, V the vocabulary; S the keys one query attends to; b_kv the bytes of one stored K or V value.

FLOPs (2 per multiply-accumulate), after Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", Table 1):
    matmuls       2·N_layers per token, N_layers = L·(dim·(q_dim + 2·kv_dim) + q_dim·dim + 3·dim·F): the fused
                  wqkv, wo, and SwiGLU's w13 and w2 (harness.modeling.model)
    attention     4·L·H·D per query and key attended: q·kᵀ and p·v, H·D multiply-accumulates each. H, not H_kv:
                  under GQA every query head still does its own dot products (Ainslie et al. 2023). Kaplan's
                  2·n_layer·n_ctx·d_attn per token is this at the average causal context n_ctx/2; a decode token sees
                  all S keys. Causal prefill counts only the unmasked pairs, as FlashAttention's FLOP counts do.
    lm_head       2·dim·V per sequence: `last_only` applies it to the last position only, in prefill and in decode
    excluded      softmax (~5 per score: about 1% of the attention term at D = 128), RMSNorm, RoPE, SiLU and the
                  gating product, residual adds, biases, dequantization, argmax: O(B·T·(dim + F + H·S)), a few
                  percent at most of the matmuls, and none of them on the tensor cores that peak_tflops describes.

Bytes, first order (every tensor crosses HBM once per step; on-chip caches such as L2 are ignored):
    weights       every parameter once per forward, at the compute dtype: the layers (biases and norms included),
                  the final norm, lm_head's V×dim, and of the embedding only the rows the step looks up (B·T rows of
                  dim). A tied lm_head reads the embedding matrix whole; the lookup's rows count again beside it.
    KV read       the cached K and V that attention reads, at kv_dtype with their scales, H_kv heads
                  (kv_bytes_per_token_read): B × the keys attended. Each KV head once per layer for its whole GQA
                  group, as harness.kv.base.attention reads it (the group folded into the query axis, K/V never
                  repeated). Pope et al. 2022 ("Efficiently Scaling Transformer Inference") make the same split of a
                  decode step's memory time into weights and KV cache. LLM-Viewer's fused-attention path
                  (hahnyuan/LLM-Viewer, model_analyzer.py) counts S·D·H·kv_bytes instead: H in place of 2·H_kv, which
                  overstates GQA's KV traffic (2× for Llama-3.1-8B) and understates MHA's (K without V).
    KV written    the new tokens' K and V, at the same rate.
    activations   each matmul reads its input and writes its output once, at the compute dtype; elementwise ops are
                  taken as fused into their neighbours. Per token and layer: wqkv dim in, q_dim + 2·kv_dim out;
                  attention q_dim in (its K/V are the KV read), q_dim out; wo q_dim in, dim out; w13 dim in, 2·F out;
                  w2 F in, dim out: 4·dim + 4·q_dim + 2·kv_dim + 3·F values. Plus the embedding's output (dim per
                  token) and lm_head's input and logits (dim + V per sequence). About 5 MB a token for Llama-3.1-8B
                  in bf16: nothing beside 15 GB of weights at batch 1, 8% of a step at batch 256.

Eager attention (attn_impl=eager, harness.kv.base.eager_attention) computes the whole [T, S] rectangle of scores, the
masked pairs included (attention FLOPs 4·L·H·D per pair of the rectangle at prefill; a decode query sees every key
either way), and moves them through memory, which SDPA's fused kernels (FlashAttention, Dao et al. 2022) never do:
    scores        per pair, head and layer: the scores written (b) and read by softmax (b), softmax's fp32 output
                  written and read by its cast back (4 + 4, none at fp32), the probabilities written (b) and read by
                  p·v (b); a mask (prefill) adds masked_fill's read and write (2·b). At fp32 that is the scores
                  written twice and read twice, 16 bytes per pair; in bf16 also 16 (8 of them fp32). score_bytes.

Strategies: what each reads is its layout's answer (harness/kv/<name>.py: LAYOUT, a harness.kv.base.Layout).
    keys_attended     the keys one query reads: every key 0..pos by default (contiguous, paged, prefix, offload;
                      paged is modelled as a kernel that reads its blocks in place, the CPU path gathers them into a
                      copy first; offload's KV counts as device reads, the PCIe transfer that bounds it is not
                      modelled); sliding min(S, window), sinks included, so decode's KV read stops growing there.
    prefix_tokens     a prefix hit's prefill computes only the suffix (FLOPs, activations and KV written), but its
                      attention still reads the prefix's K/V, once for every sequence: sharing saves memory, not reads.
    recomputes_prefix nothing cached (`none`): decode step at position p is a prefill over all p + 1 tokens. Its
                      attention reads freshly computed K/V (activations, at the compute dtype), not a cache: KV read
                      and written are 0, and FLOPs grow with the context.

MLA (DeepSeek-V2's latent KV; harness.analytic.roofline_mla has its formulas and sources): weights, matmul and attention
FLOPs and activations take the model's MLA terms, per token, per (query, key) pair and per cached key, on the decode
path `mla_path` (absorbed: attention in the latent space; naive: every cached latent decompressed each step). Its KV
read is the cache geometry's (ModelArgs.cache_sides, cache_heads, cache_head_dim): one latent row of
kv_lora_rank + qk_rope_head_dim values a token and layer, read once for all H query heads.

Quantized formats (harness.kv.quant) are modelled as a fused kernel that dequantizes in registers: the payload plus
the scales, nothing else. The harness itself dequantizes into a full-precision copy before attention; that
difference, like every other departure from the ideal, is what the achieved figures expose. int4's full-precision
tail (at most kv_residual + kv_group_size - 1 recent tokens) is counted at the quantized rate.

Crossovers (the JAX scaling book, "All About Transformer Inference", https://jax-ml.github.io/scaling-book/inference/):
with bf16 weights a decode step does ~2 FLOPs per parameter per sequence and reads 2 bytes per parameter once, so
its intensity is ≈ B and it turns compute-bound near B ≈ ridge point: ~240 on a TPU v5e, 989e12 / 3.35e12 ≈ 295 on
an H100 SXM. KV reads grow with B as fast as the FLOPs do, so they raise that batch (critical_batch), and past some
context no batch reaches the ridge at all (critical_context): as B → ∞ the intensity tends to per-sequence FLOPs over
per-sequence bytes, and attention's own intensity, 4·H·D / (2·H_kv·D·b_kv) = 2·(H / H_kv) / b_kv (4 for
Llama-3.1-8B in bf16), is far below any GPU's ridge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from harness.analytic import roofline_mla as mla
from harness.formats import ATTN_IMPLS, BITS, PLAIN, SCALE_BYTES
from harness.kv.base import Layout

if TYPE_CHECKING:
    from harness.kv.shape import KVShape
    from harness.modeling.model_args import ModelArgs

# What a strategy without its own answer reads: every key before the query, from a cache (harness.kv.base.Layout).
DENSE = Layout("dense", options=None)


@dataclass(frozen=True)
class StepCost:
    """One forward step of the whole batch: what it computes and what it moves through memory."""

    flops: float  # matmul and attention FLOPs, 2 per multiply-accumulate (see the module docstring for exclusions)
    weight_bytes: float  # parameters read once per step, at the compute dtype; only the embedding rows looked up
    kv_read_bytes: float  # cached K/V read by attention, at kv_dtype with scales, H_kv heads
    kv_write_bytes: float  # the new tokens' K/V written to the cache
    activation_bytes: float  # each matmul's input read and output written once, at the compute dtype
    score_bytes: float = 0.0  # eager attention's scores and probabilities through memory (0 for sdpa)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes + self.score_bytes

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes


def mean_cost(costs: Sequence[StepCost]) -> StepCost:
    """Field by field mean of several steps' costs."""
    return StepCost(*(sum(getattr(c, f.name) for c in costs) / len(costs) for f in fields(StepCost)))


# --- per-token and per-key constants of a model ---------------------------------------------------------------------


def _weight_dtype_bytes(dtype: str) -> float:
    if dtype not in PLAIN:
        raise ValueError(f"dtype: {dtype!r} is not a compute dtype; allowed: {', '.join(PLAIN)}")
    return BITS[dtype] / 8


def _linear_params_per_layer(args: ModelArgs) -> int:
    """Weights of one layer's matmuls: wqkv, wo, w13 (gate and up), w2."""
    return args.dim * (args.q_dim + 2 * args.kv_dim) + args.q_dim * args.dim + 3 * args.dim * args.intermediate_size


def _matmul_flops_per_token(args: ModelArgs, mla_path: str) -> float:
    """2·N_layers (Kaplan et al. 2020): one multiply-accumulate per layer weight per token (MLA: its path's)."""
    if args.is_mla:
        return args.n_layers * mla.token_flops_per_layer(args, mla_path)
    return 2 * args.n_layers * _linear_params_per_layer(args)


def _lm_head_flops_per_sequence(args: ModelArgs) -> float:
    return 2 * args.dim * args.vocab_size  # the last position only (last_only=True)


def _attention_flops_per_key(args: ModelArgs, mla_path: str) -> float:
    """One query against one key in every layer: q·k and p·v over H query heads of D (MLA: its path's)."""
    if args.is_mla:
        return args.n_layers * mla.pair_flops_per_layer(args, mla_path)
    return 4 * args.n_layers * args.n_heads * args.head_dim


def eager_score_bytes_per_pair(dtype: str, *, masked: bool) -> float:
    """Bytes eager attention moves per (query, key) pair, head and layer (module docstring: scores)."""
    b = _weight_dtype_bytes(dtype)
    cast = 0 if b == 4 else 4 + 4  # softmax's fp32 output, written then read by the cast back to b
    return b + b + cast + b + b + (2 * b if masked else 0)


def _check_attn_impl(attn_impl: str) -> None:
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl: unknown {attn_impl!r}; allowed: {', '.join(ATTN_IMPLS)}")


def _decompress_flops_per_key(args: ModelArgs, mla_path: str) -> float:
    """One cached key in every layer, once per forward: MLA naive's decompression; 0 otherwise."""
    return args.n_layers * mla.key_flops_per_layer(args, mla_path) if args.is_mla else 0


def _weight_bytes(args: ModelArgs, dtype: str, n_tokens: int) -> float:
    """Every parameter once, except the embedding table: only the n_tokens rows the lookup reads."""
    qkv_bias = args.q_dim + 2 * args.kv_dim if args.qkv_bias else 0
    per_layer = _linear_params_per_layer(args) + qkv_bias + 2 * args.dim  # + attention_norm, ffn_norm
    if args.is_mla:
        per_layer = mla.linear_params_per_layer(args) + mla.norm_params_per_layer(args)
    lm_head = args.vocab_size * args.dim  # the embedding matrix itself when tied: read whole either way
    params = args.n_layers * per_layer + args.dim + lm_head + n_tokens * args.dim  # + final norm, embedding rows
    return params * _weight_dtype_bytes(dtype)


def _activation_bytes(
    args: ModelArgs,
    dtype: str,
    n_tokens: int,
    n_sequences: int,
    n_recomputed_keys: int,
    n_decompressed_keys: float = 0,
    mla_path: str = "absorbed",
) -> float:
    """Matmul inputs and outputs once each (module docstring); n_recomputed_keys: `none`'s K/V, read as activations;
    n_decompressed_keys: MLA naive's K/V decompressed from the latents, written and read once."""
    per_layer = 4 * args.dim + 4 * args.q_dim + 2 * args.kv_dim + 3 * args.intermediate_size  # values per token
    per_key = 0
    if args.is_mla:
        per_layer = mla.token_activation_values_per_layer(args, mla_path)
        per_key = mla.key_activation_values_per_layer(args, mla_path)
    per_token = args.dim + args.n_layers * per_layer  # + the embedding's output
    per_sequence = args.dim + args.vocab_size  # lm_head's input and logits, last position only
    recomputed_kv = n_recomputed_keys * args.n_layers * args.cache_sides * args.cache_heads * args.cache_head_dim
    decompressed = n_decompressed_keys * args.n_layers * per_key
    values = n_tokens * per_token + n_sequences * per_sequence + recomputed_kv + decompressed
    return values * _weight_dtype_bytes(dtype)


def kv_bytes_per_token_read(args: ModelArgs, kv_dtype: str, kv_group_size: int = 32) -> float:
    """Bytes of one token's K and V over all layers, at kv_dtype, scales included (harness.kv.quant's layouts).

    Per layer, KV head and side (K or V):
        fp32, fp16, bf16    D · bits / 8
        fp8_*, int8         D + 4: one fp32 scale per token and head
        int4 (KIVI)         D / 2 + 8·D / G: K has a scale and a zero per channel per G tokens (2·D·4 / G bytes a
                            token), V a scale and a zero per G channels of each token (2·(D / G)·4): the same rate
    The payload part is CacheSpec.bytes_per_token; bf16 at head_dim 128 is 512 bytes per head, int8 264 (0.516),
    int4 at G = 32 192 (0.375). The geometry is the cache's (ModelArgs.cache_*): MLA one side (the latent row, keys'
    int4 layout) of one head of D = kv_lora_rank + qk_rope_head_dim.
    """
    head_dim = args.cache_head_dim
    if kv_dtype in PLAIN:
        per_head_side = head_dim * BITS[kv_dtype] / 8
    elif kv_dtype == "int4":
        per_head_side = head_dim / 2 + 2 * SCALE_BYTES * head_dim / kv_group_size
    elif kv_dtype in BITS:
        per_head_side = head_dim * BITS[kv_dtype] / 8 + SCALE_BYTES
    else:
        raise ValueError(f"kv_dtype: unknown format {kv_dtype!r}; allowed: {', '.join(BITS)}")
    return args.cache_sides * args.n_layers * args.cache_heads * per_head_side


def _check(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size: must be at least 1, got {batch_size}")


# --- one step --------------------------------------------------------------------------------------------------------


def prefill_cost(shape: KVShape, *, layout: Layout = DENSE, prefix_cached: int = 0) -> StepCost:
    """The prefill forward of B prompts of prompt_len tokens (the shape's), of which the first prefix_cached are
    already cached.

    Computed tokens T = prompt_len - prefix_cached per sequence (a prefix hit computes only the suffix):
        flops      B·(T·2·N_layers + pairs·4·L·H·D + 2·dim·V), pairs = Σ_{n = prefix_cached+1}^{prompt_len} min(n, window)
        KV read    B·(keys visible to some query)·kv_bytes_per_token_read: all prompt_len without a window (the cached
                   prefix included: it is read for every sequence), and the new tokens written then read back, as the
                   harness's strategies attend after storing
        KV written B·tokens_written(T)·kv_bytes_per_token_read: a ring keeps only the last `window` of a long prompt
    A layout that recomputes (`none`) keeps no cache: KV read and written are 0, its K/V count as activations, and
    prefix_cached must be 0. Eager attention: pairs = T·(keys visible), the whole rectangle, and score_bytes
    B·pairs·L·H·eager_score_bytes_per_pair.
    prefix_cached must be 0. MLA: a prefill runs decompressed whatever `mla_path` (harness.modeling.mla, as vLLM's MLA
    backends): naive's per-pair FLOPs, and every visible key decompressed once (FLOPs, and its K/V as activations).
    """
    args, batch_size, prompt_len, dtype = shape.model, shape.batch_size, shape.prompt_len, shape.dtype
    attn_impl, mla_path = shape.attn_impl, shape.mla_path
    _check(batch_size)
    _check_attn_impl(attn_impl)
    if not 0 <= prefix_cached < prompt_len:
        raise ValueError(f"prefix_cached: must be in 0..prompt_len-1={prompt_len - 1}, got {prefix_cached}")
    if layout.recomputes_prefix and prefix_cached:
        raise ValueError(f"prefix_cached: `{layout.name}` caches nothing, so no prefix can be cached")
    n_new = prompt_len - prefix_cached
    if (
        n_new > 1
    ):  # MLA: a forward of several tokens runs decompressed (harness.modeling.mla); one token, the chosen path
        mla_path = "naive"
    pairs = layout.causal_pairs(prefix_cached + 1, prompt_len)
    score_bytes = 0.0
    if attn_impl == "eager":  # every query against every visible key, masked or not
        pairs = n_new * layout.keys_attended(prompt_len)
        per_pair = eager_score_bytes_per_pair(dtype, masked=n_new > 1)
        score_bytes = batch_size * pairs * args.n_layers * args.n_heads * per_pair
    if layout.recomputes_prefix:
        kv_read = kv_write = 0.0
        recomputed_keys = visible = batch_size * prompt_len
    else:
        per_token = kv_bytes_per_token_read(args, shape.kv_dtype, shape.kv_group_size)
        first_visible = prefix_cached + 1 - layout.keys_attended(prefix_cached + 1)  # the first query's oldest key
        visible = batch_size * (prompt_len - first_visible)
        kv_read = visible * per_token
        kv_write = batch_size * layout.tokens_written(n_new) * per_token
        recomputed_keys = 0
    flops = batch_size * (
        n_new * _matmul_flops_per_token(args, mla_path)
        + pairs * _attention_flops_per_key(args, mla_path)
        + _lm_head_flops_per_sequence(args)
    ) + visible * _decompress_flops_per_key(args, mla_path)
    return StepCost(
        flops=flops,
        weight_bytes=_weight_bytes(args, dtype, n_tokens=batch_size * n_new),
        kv_read_bytes=kv_read,
        kv_write_bytes=kv_write,
        activation_bytes=_activation_bytes(
            args,
            dtype,
            n_tokens=batch_size * n_new,
            n_sequences=batch_size,
            n_recomputed_keys=recomputed_keys,
            n_decompressed_keys=visible,
            mla_path=mla_path,
        ),
        score_bytes=score_bytes,
    )


def decode_step_cost(shape: KVShape, *, context_len: float, layout: Layout = DENSE) -> StepCost:
    """One decode step of B sequences whose new token attends to context_len keys, itself included (the shape's
    own lengths unused).

    The token generated at position p (harness.modeling.decode: the step fed position p) has context_len = p + 1.
        S_att      layout.keys_attended(context_len): min(context_len, window) for a sliding window
        flops      B·(2·N_layers + S_att·4·L·H·D + 2·dim·V)
        weights    all layers + lm_head + B embedding rows, at the compute dtype
        KV read    B·S_att·kv_bytes_per_token_read (the new token's K/V is written, then read back with the rest)
        KV written B·kv_bytes_per_token_read
        scores     eager only: B·S_att·L·H·eager_score_bytes_per_pair (no mask)
    MLA (`mla_path`, harness.analytic.roofline_mla): flops B·(2·N_layers' + S_att·pair + S_att·decompress), naive decompressing
    the S_att latents it reads (activations B·S_att·L·2·H·(n + r + v) values more), absorbed folding W_UK and W_UV
    into the token's own matmuls.
    A layout that recomputes (`none`): prefill_cost over context_len tokens (every step recomputes the whole
    sequence so far).
    """
    args, batch_size, dtype, mla_path = shape.model, shape.batch_size, shape.dtype, shape.mla_path
    _check(batch_size)
    _check_attn_impl(shape.attn_impl)
    if context_len < 1:
        raise ValueError(f"context_len: must be at least 1 (the new token), got {context_len}")
    if layout.recomputes_prefix:
        return prefill_cost(dataclasses.replace(shape, prompt_len=round(context_len)), layout=layout)
    attended = layout.keys_attended(context_len)
    per_token = kv_bytes_per_token_read(args, shape.kv_dtype, shape.kv_group_size)
    flops = batch_size * (
        _matmul_flops_per_token(args, mla_path)
        + attended * (_attention_flops_per_key(args, mla_path) + _decompress_flops_per_key(args, mla_path))
        + _lm_head_flops_per_sequence(args)
    )
    return StepCost(
        flops=flops,
        weight_bytes=_weight_bytes(args, dtype, n_tokens=batch_size),
        kv_read_bytes=batch_size * attended * per_token,
        kv_write_bytes=batch_size * per_token,
        activation_bytes=_activation_bytes(
            args,
            dtype,
            n_tokens=batch_size,
            n_sequences=batch_size,
            n_recomputed_keys=0,
            n_decompressed_keys=batch_size * attended,
            mla_path=mla_path,
        ),
        score_bytes=(
            batch_size * attended * args.n_layers * args.n_heads * eager_score_bytes_per_pair(dtype, masked=False)
            if shape.attn_impl == "eager"
            else 0.0
        ),
    )


def decode_contexts(prompt_len: int, gen_len: int) -> range:
    """context_len of every timed decode step: prompt_len + 1 .. prompt_len + gen_len - 1 (mean prompt_len +
    gen_len / 2). harness.modeling.decode.generate feeds positions prompt_len .. prompt_len + gen_len - 2 after the prefill,
    which made the first token. With gen_len 1 there is no decode step: the one that would come next stands in."""
    return range(prompt_len + 1, prompt_len + max(gen_len, 2))


def mean_decode_cost(shape: KVShape, *, layout: Layout = DENSE) -> StepCost:
    """The mean over the timed decode steps (decode_contexts of the shape's prompt_len and gen_len), the step TPOT
    measures: exact for every strategy, where evaluating at the mean context would not be under a window cap or
    `none`'s quadratic attention."""
    contexts = decode_contexts(shape.prompt_len, shape.gen_len)
    return mean_cost([decode_step_cost(shape, context_len=context_len, layout=layout) for context_len in contexts])
