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
                  wqkv, wo, and SwiGLU's w13 and w2 (harness.model)
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

Strategies: what each reads (harness.kv).
    contiguous, paged, offload   the filled part: every key 0..pos. Paged is modelled as a kernel that reads its
                  blocks in place (the CPU path gathers them into a copy first); offload's KV is counted as device
                  reads, and the PCIe transfer that bounds it is not modelled.
    prefix        as paged. On a hit, prefill computes only the suffix (FLOPs, activations and KV written), but its
                  attention still reads the prefix's K/V, once for every sequence: sharing saves memory, not reads.
    sliding       a query attends to min(S, window) keys (sinks included: `window` counts them), so decode's KV read
                  stops growing at the window.
    none          nothing cached: decode step at position p is a prefill over all p + 1 tokens. Its attention reads
                  freshly computed K/V (activations, at the compute dtype), not a cache: KV read and written are 0,
                  and FLOPs grow with the context.
    any other     as contiguous.

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

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from harness.kv import strategy_names
from harness.kv.quant import BITS, PLAIN, SCALE_DTYPE

if TYPE_CHECKING:
    from harness.model import ModelArgs

SCALE_BYTES = SCALE_DTYPE.itemsize  # 4: quantization scales and zero points are fp32 (harness.kv.quant)


@dataclass(frozen=True)
class StepCost:
    """One forward step of the whole batch: what it computes and what it moves through memory."""

    flops: float  # matmul and attention FLOPs, 2 per multiply-accumulate (see the module docstring for exclusions)
    weight_bytes: float  # parameters read once per step, at the compute dtype; only the embedding rows looked up
    kv_read_bytes: float  # cached K/V read by attention, at kv_dtype with scales, H_kv heads
    kv_write_bytes: float  # the new tokens' K/V written to the cache
    activation_bytes: float  # each matmul's input read and output written once, at the compute dtype

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes

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


def _matmul_flops_per_token(args: ModelArgs) -> float:
    """2·N_layers (Kaplan et al. 2020): one multiply-accumulate per layer weight per token."""
    return 2 * args.n_layers * _linear_params_per_layer(args)


def _lm_head_flops_per_sequence(args: ModelArgs) -> float:
    return 2 * args.dim * args.vocab_size  # the last position only (last_only=True)


def _attention_flops_per_key(args: ModelArgs) -> float:
    """One query against one key in every layer: q·k and p·v over H query heads of D."""
    return 4 * args.n_layers * args.n_heads * args.head_dim


def _weight_bytes(args: ModelArgs, dtype: str, n_tokens: int) -> float:
    """Every parameter once, except the embedding table: only the n_tokens rows the lookup reads."""
    qkv_bias = args.q_dim + 2 * args.kv_dim if args.qkv_bias else 0
    per_layer = _linear_params_per_layer(args) + qkv_bias + 2 * args.dim  # + attention_norm, ffn_norm
    lm_head = args.vocab_size * args.dim  # the embedding matrix itself when tied: read whole either way
    params = args.n_layers * per_layer + args.dim + lm_head + n_tokens * args.dim  # + final norm, embedding rows
    return params * _weight_dtype_bytes(dtype)


def _activation_bytes(args: ModelArgs, dtype: str, n_tokens: int, n_sequences: int, n_recomputed_keys: int) -> float:
    """Matmul inputs and outputs once each (module docstring); n_recomputed_keys: `none`'s K/V, read as activations."""
    per_layer = 4 * args.dim + 4 * args.q_dim + 2 * args.kv_dim + 3 * args.intermediate_size  # values per token
    per_token = args.dim + args.n_layers * per_layer  # + the embedding's output
    per_sequence = args.dim + args.vocab_size  # lm_head's input and logits, last position only
    recomputed_kv = n_recomputed_keys * args.n_layers * 2 * args.kv_dim
    return (n_tokens * per_token + n_sequences * per_sequence + recomputed_kv) * _weight_dtype_bytes(dtype)


def kv_bytes_per_token_read(args: ModelArgs, kv_dtype: str, kv_group_size: int = 32) -> float:
    """Bytes of one token's K and V over all layers, at kv_dtype, scales included (harness.kv.quant's layouts).

    Per layer, KV head and side (K or V):
        fp32, fp16, bf16    D · bits / 8
        fp8_*, int8         D + 4: one fp32 scale per token and head
        int4 (KIVI)         D / 2 + 8·D / G: K has a scale and a zero per channel per G tokens (2·D·4 / G bytes a
                            token), V a scale and a zero per G channels of each token (2·(D / G)·4): the same rate
    The payload part is CacheSpec.bytes_per_token; bf16 at head_dim 128 is 512 bytes per head, int8 264 (0.516),
    int4 at G = 32 192 (0.375).
    """
    head_dim = args.head_dim
    if kv_dtype in PLAIN:
        per_head_side = head_dim * BITS[kv_dtype] / 8
    elif kv_dtype == "int4":
        per_head_side = head_dim / 2 + 2 * SCALE_BYTES * head_dim / kv_group_size
    elif kv_dtype in BITS:
        per_head_side = head_dim * BITS[kv_dtype] / 8 + SCALE_BYTES
    else:
        raise ValueError(f"kv_dtype: unknown format {kv_dtype!r}; allowed: {', '.join(BITS)}")
    return 2 * args.n_layers * args.n_kv_heads * per_head_side


def _attended(n_keys: float, window: int | None) -> float:
    return n_keys if window is None else min(n_keys, window)


def _causal_pairs(first: int, last: int, window: int | None) -> float:
    """Σ min(n, window) for n = first..last: the (query, key) pairs of queries at positions first-1..last-1."""
    if last < first:
        return 0

    def triangle(n: int) -> int:  # 1 + 2 + ... + n
        return n * (n + 1) // 2

    if window is None or last <= window:
        return triangle(last) - triangle(first - 1)
    below = max(0, window - first + 1)  # queries that see fewer keys than the window
    return triangle(first - 1 + below) - triangle(first - 1) + (last - first + 1 - below) * window


@functools.cache
def _strategies() -> tuple[str, ...]:
    return tuple(strategy_names())  # a package scan: once, not at every one of a generation's steps


def _check(batch_size: int, cache: str, window: int | None) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size: must be at least 1, got {batch_size}")
    if cache not in _strategies():
        raise ValueError(f"cache: unknown strategy {cache!r}; allowed: {', '.join(_strategies())}")
    if window is not None and window < 1:
        raise ValueError(f"window: must be a positive number of tokens or None, got {window}")


# --- one step --------------------------------------------------------------------------------------------------------


def prefill_cost(
    args: ModelArgs,
    *,
    batch_size: int,
    prompt_len: int,
    dtype: str,
    kv_dtype: str,
    cache: str = "contiguous",
    window: int | None = None,
    prefix_cached: int = 0,
    kv_group_size: int = 32,
) -> StepCost:
    """The prefill forward of B prompts of prompt_len tokens, of which the first prefix_cached are already cached.

    Computed tokens T = prompt_len - prefix_cached per sequence (a prefix hit computes only the suffix):
        flops      B·(T·2·N_layers + pairs·4·L·H·D + 2·dim·V), pairs = Σ_{n = prefix_cached+1}^{prompt_len} min(n, window)
        KV read    B·(keys visible to some query)·kv_bytes_per_token_read: all prompt_len without a window (the cached
                   prefix included: it is read for every sequence), and the new tokens written then read back, as the
                   harness's strategies attend after storing
        KV written B·min(T, window)·kv_bytes_per_token_read: a ring keeps only the last `window` of a long prompt
    `none` keeps no cache: KV read and written are 0, its K/V count as activations, and prefix_cached must be 0.
    """
    _check(batch_size, cache, window)
    if not 0 <= prefix_cached < prompt_len:
        raise ValueError(f"prefix_cached: must be in 0..prompt_len-1={prompt_len - 1}, got {prefix_cached}")
    if cache == "none" and prefix_cached:
        raise ValueError("prefix_cached: `none` caches nothing, so no prefix can be cached")
    n_new = prompt_len - prefix_cached
    pairs = _causal_pairs(prefix_cached + 1, prompt_len, window)
    flops = batch_size * (
        n_new * _matmul_flops_per_token(args)
        + pairs * _attention_flops_per_key(args)
        + _lm_head_flops_per_sequence(args)
    )
    if cache == "none":
        kv_read = kv_write = 0.0
        recomputed_keys = batch_size * prompt_len
    else:
        per_token = kv_bytes_per_token_read(args, kv_dtype, kv_group_size)
        first_visible = 0 if window is None else max(0, prefix_cached - window + 1)  # the first query's oldest key
        kv_read = batch_size * (prompt_len - first_visible) * per_token
        kv_write = batch_size * _attended(n_new, window) * per_token
        recomputed_keys = 0
    return StepCost(
        flops=flops,
        weight_bytes=_weight_bytes(args, dtype, n_tokens=batch_size * n_new),
        kv_read_bytes=kv_read,
        kv_write_bytes=kv_write,
        activation_bytes=_activation_bytes(
            args, dtype, n_tokens=batch_size * n_new, n_sequences=batch_size, n_recomputed_keys=recomputed_keys
        ),
    )


def decode_step_cost(
    args: ModelArgs,
    *,
    batch_size: int,
    context_len: float,
    dtype: str,
    kv_dtype: str,
    cache: str = "contiguous",
    window: int | None = None,
    kv_group_size: int = 32,
) -> StepCost:
    """One decode step of B sequences whose new token attends to context_len keys, itself included.

    The token generated at position p (harness.decode: the step fed position p) has context_len = p + 1.
        S_att      min(context_len, window)
        flops      B·(2·N_layers + S_att·4·L·H·D + 2·dim·V)
        weights    all layers + lm_head + B embedding rows, at the compute dtype
        KV read    B·S_att·kv_bytes_per_token_read (the new token's K/V is written, then read back with the rest)
        KV written B·kv_bytes_per_token_read
    `none`: prefill_cost over context_len tokens (every step recomputes the whole sequence so far).
    """
    _check(batch_size, cache, window)
    if context_len < 1:
        raise ValueError(f"context_len: must be at least 1 (the new token), got {context_len}")
    if cache == "none":
        return prefill_cost(
            args,
            batch_size=batch_size,
            prompt_len=round(context_len),
            dtype=dtype,
            kv_dtype=kv_dtype,
            cache=cache,
            window=window,
        )
    attended = _attended(context_len, window)
    per_token = kv_bytes_per_token_read(args, kv_dtype, kv_group_size)
    flops = batch_size * (
        _matmul_flops_per_token(args) + attended * _attention_flops_per_key(args) + _lm_head_flops_per_sequence(args)
    )
    return StepCost(
        flops=flops,
        weight_bytes=_weight_bytes(args, dtype, n_tokens=batch_size),
        kv_read_bytes=batch_size * attended * per_token,
        kv_write_bytes=batch_size * per_token,
        activation_bytes=_activation_bytes(
            args, dtype, n_tokens=batch_size, n_sequences=batch_size, n_recomputed_keys=0
        ),
    )


def decode_contexts(prompt_len: int, gen_len: int) -> range:
    """context_len of every timed decode step: prompt_len + 1 .. prompt_len + gen_len - 1 (mean prompt_len +
    gen_len / 2). harness.decode.generate feeds positions prompt_len .. prompt_len + gen_len - 2 after the prefill,
    which made the first token. With gen_len 1 there is no decode step: the one that would come next stands in."""
    return range(prompt_len + 1, prompt_len + max(gen_len, 2))


def mean_decode_cost(
    args: ModelArgs,
    *,
    batch_size: int,
    prompt_len: int,
    gen_len: int,
    dtype: str,
    kv_dtype: str,
    cache: str = "contiguous",
    window: int | None = None,
    kv_group_size: int = 32,
) -> StepCost:
    """The mean over the timed decode steps (decode_contexts), the step TPOT measures: exact for every strategy,
    where evaluating at the mean context would not be under a window cap or `none`'s quadratic attention."""
    return mean_cost(
        [
            decode_step_cost(
                args,
                batch_size=batch_size,
                context_len=context_len,
                dtype=dtype,
                kv_dtype=kv_dtype,
                cache=cache,
                window=window,
                kv_group_size=kv_group_size,
            )
            for context_len in decode_contexts(prompt_len, gen_len)
        ]
    )


# --- the roofline ----------------------------------------------------------------------------------------------------


def ridge_point(*, peak_bw_gbps: float, peak_tflops: float) -> float:
    """FLOPs per byte at which the compute and the bandwidth ceilings meet."""
    return peak_tflops * 1e12 / (peak_bw_gbps * 1e9)


def _critical_batch_from(one: StepCost, two: StepCost, ridge: float) -> int | None:
    """The smallest B whose intensity reaches the ridge, a step's cost being affine in B: fixed + B·per_sequence."""
    per_flops, per_bytes = two.flops - one.flops, two.bytes - one.bytes
    fixed_flops, fixed_bytes = one.flops - per_flops, one.bytes - per_bytes

    def reaches(batch: int) -> bool:
        return fixed_flops + batch * per_flops >= ridge * (fixed_bytes + batch * per_bytes)

    if per_flops <= ridge * per_bytes:  # the intensity tends to per_flops / per_bytes: never reaches the ridge
        return 1 if reaches(1) else None
    batch = max(1, math.ceil((ridge * fixed_bytes - fixed_flops) / (per_flops - ridge * per_bytes)))
    while batch > 1 and reaches(batch - 1):  # float rounding at the root: settle on the exact smallest batch
        batch -= 1
    while not reaches(batch):
        batch += 1
    return batch


def critical_batch(
    args: ModelArgs,
    *,
    context_len: float,
    dtype: str,
    kv_dtype: str,
    peak_bw_gbps: float,
    peak_tflops: float,
    cache: str = "contiguous",
    window: int | None = None,
    kv_group_size: int = 32,
) -> int | None:
    """B*: the smallest batch whose decode step at context_len reaches the ridge point; None if no batch does.

    A decode step costs W + B·b bytes (W the weights, b a sequence's KV read and write, activations and embedding
    row) and B·f FLOPs, so its intensity B·f / (W + B·b) rises with B towards f / b:
        B* = ridge·W / (f - ridge·b),   None when f <= ridge·b (the context is past critical_context).
    With b = 0 and bf16 weights this is ≈ the ridge point itself, the JAX scaling book's B ≈ 240-300.
    """
    costs = [
        decode_step_cost(
            args,
            batch_size=batch_size,
            context_len=context_len,
            dtype=dtype,
            kv_dtype=kv_dtype,
            cache=cache,
            window=window,
            kv_group_size=kv_group_size,
        )
        for batch_size in (1, 2)
    ]
    return _critical_batch_from(*costs, ridge=ridge_point(peak_bw_gbps=peak_bw_gbps, peak_tflops=peak_tflops))


def critical_context(
    args: ModelArgs,
    *,
    dtype: str,
    kv_dtype: str,
    peak_bw_gbps: float,
    peak_tflops: float,
    cache: str = "contiguous",
    window: int | None = None,
    kv_group_size: int = 32,
) -> float:
    """S*: the context beyond which decode cannot reach the ridge point at any batch; math.inf if it never binds.

    As B → ∞ the intensity tends to a sequence's own f(S) / b(S) = (f0 + a·S) / (b0 + k·S): f0 the matmul and
    lm_head FLOPs, a = 4·L·H·D, b0 the KV write, activations and embedding row, k = kv_bytes_per_token_read. It
    falls with S while attention's own intensity a / k is below the ridge, and equals it at
        S* = (f0 - ridge·b0) / (ridge·k - a)
    0.0 when even the first token cannot reach it; math.inf when a >= ridge·k, when a window caps the keys read
    below S*, and for `none` (recomputing gains intensity with the context: it never binds).
    """
    _check(1, cache, window)
    if cache == "none":
        return math.inf
    ridge = ridge_point(peak_bw_gbps=peak_bw_gbps, peak_tflops=peak_tflops)

    def per_sequence(context_len: int) -> StepCost:
        one, two = (
            decode_step_cost(
                args,
                batch_size=batch_size,
                context_len=context_len,
                dtype=dtype,
                kv_dtype=kv_dtype,
                cache=cache,
                kv_group_size=kv_group_size,
            )
            for batch_size in (1, 2)
        )
        return StepCost(*(getattr(two, f.name) - getattr(one, f.name) for f in fields(StepCost)))

    at_1, at_2 = per_sequence(1), per_sequence(2)
    slope_flops, slope_bytes = at_2.flops - at_1.flops, at_2.bytes - at_1.bytes
    base_flops, base_bytes = at_1.flops - slope_flops, at_1.bytes - slope_bytes
    if slope_flops >= ridge * slope_bytes:
        return math.inf
    context = (base_flops - ridge * base_bytes) / (ridge * slope_bytes - slope_flops)
    if window is not None and context >= window:
        return math.inf
    return max(0.0, context)


def prefix_tokens_cached(
    *, cache: str, prefix_len: int, prompt_len: int, block_size: int, kv_dtype: str, kv_group_size: int
) -> int:
    """Tokens a prefix hit skips (harness.kv.prefix): whole shared units of the prefix, one prompt token left over."""
    if cache != "prefix" or prefix_len <= 0:
        return 0
    unit = math.lcm(block_size, kv_group_size) if kv_dtype == "int4" else block_size
    return max(0, min(prefix_len, prompt_len - 1)) // unit * unit


def _known(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0  # None, NaN (a null cell) and 0 are unknown


def roofline_columns(
    args: ModelArgs,
    *,
    batch_size: int,
    prompt_len: int,
    gen_len: int,
    dtype: str,
    kv_dtype: str,
    cache: str,
    window: int | None = None,
    prefix_len: int = 0,
    kv_group_size: int = 32,
    block_size: int = 16,
    tpot_ms: float | None = None,
    ttft_ms: float | None = None,
    peak_bw_gbps: float | None = None,
    peak_tflops: float | None = None,
) -> dict[str, float | int | str | None]:
    """The analytic, achieved, verdict and ceiling columns of one row.

    Decode figures are the mean over the timed decode steps (mean_decode_cost; context prompt_len + gen_len / 2,
    capped by the window); the prefill figure is the measured prefill, a prefix hit for `prefix`.
        flops_per_step, bytes_per_step     one decode step of the whole batch
        arithmetic_intensity               flops_per_step / bytes_per_step, FLOPs per byte
        prefill_arithmetic_intensity       the same for the prefill
        prefill_flops                      FLOPs of the prefill of the whole batch
        prefill_achieved_tflops            prefill_flops / ttft (TTFT also holds the first token's sampling)
        achieved_bw_gbps, achieved_tflops  bytes_per_step / tpot, flops_per_step / tpot
        bw_util, flops_util                achieved / peak
        bound                              "compute" if arithmetic_intensity >= the ridge point, else "memory"
        predicted_tpot_ms                  max(flops / peak_flops, bytes / peak_bw) · 1e3
        critical_batch                     B* at this row's decode steps (critical_batch); None if no batch
        critical_context                   S* for this model, format and strategy (critical_context); inf if none
        peak_bw_gbps, peak_tflops          the ceilings, as given
    Columns that need tpot_ms or the peaks are None when those are missing (None, NaN or 0).
    """
    shape = dict(dtype=dtype, kv_dtype=kv_dtype, cache=cache, window=window, kv_group_size=kv_group_size)
    decode = mean_decode_cost(args, batch_size=batch_size, prompt_len=prompt_len, gen_len=gen_len, **shape)
    cached = prefix_tokens_cached(
        cache=cache,
        prefix_len=prefix_len,
        prompt_len=prompt_len,
        block_size=block_size,
        kv_dtype=kv_dtype,
        kv_group_size=kv_group_size,
    )
    prefill = prefill_cost(args, batch_size=batch_size, prompt_len=prompt_len, prefix_cached=cached, **shape)
    columns: dict[str, float | int | str | None] = {
        "flops_per_step": decode.flops,
        "bytes_per_step": decode.bytes,
        "arithmetic_intensity": decode.arithmetic_intensity,
        "prefill_arithmetic_intensity": prefill.arithmetic_intensity,
        "prefill_flops": prefill.flops,
        "prefill_achieved_tflops": prefill.flops / (ttft_ms * 1e-3) / 1e12 if _known(ttft_ms) else None,
        "peak_bw_gbps": peak_bw_gbps if _known(peak_bw_gbps) else None,
        "peak_tflops": peak_tflops if _known(peak_tflops) else None,
    }
    timed, peaks = _known(tpot_ms), _known(peak_bw_gbps) and _known(peak_tflops)
    achieved_bw = decode.bytes / (tpot_ms * 1e-3) / 1e9 if timed else None
    achieved_tflops = decode.flops / (tpot_ms * 1e-3) / 1e12 if timed else None
    columns |= {
        "achieved_bw_gbps": achieved_bw,
        "achieved_tflops": achieved_tflops,
        "bw_util": achieved_bw / peak_bw_gbps if timed and _known(peak_bw_gbps) else None,
        "flops_util": achieved_tflops / peak_tflops if timed and _known(peak_tflops) else None,
    }
    if not peaks:
        return columns | dict.fromkeys(("bound", "predicted_tpot_ms", "critical_batch", "critical_context"))
    ridge = ridge_point(peak_bw_gbps=peak_bw_gbps, peak_tflops=peak_tflops)
    decode_two = mean_decode_cost(args, batch_size=2, prompt_len=prompt_len, gen_len=gen_len, **shape)
    decode_one = mean_decode_cost(args, batch_size=1, prompt_len=prompt_len, gen_len=gen_len, **shape)
    return columns | {
        "bound": "compute" if decode.arithmetic_intensity >= ridge else "memory",
        "predicted_tpot_ms": max(decode.flops / (peak_tflops * 1e12), decode.bytes / (peak_bw_gbps * 1e9)) * 1e3,
        "critical_batch": _critical_batch_from(decode_one, decode_two, ridge),
        "critical_context": critical_context(args, peak_bw_gbps=peak_bw_gbps, peak_tflops=peak_tflops, **shape),
    }
