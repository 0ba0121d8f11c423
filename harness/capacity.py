"""The capacity planner: what a decode point needs in memory, and how many requests or tokens fit.

The formula, with concurrency in it (leaving it out is the usual cause of production OOMs):

    total   = static + dynamic
    static  = weights + model buffers + runtime overhead               # paid once, whatever the load
    dynamic = KV(B requests) + activations(B requests)                 # grows with every concurrent request
    KV      ~ B × (prompt_len + gen_len) × kv_bytes_per_token          # the strategy's exact allocation below
    kv_bytes_per_token = 2 (K and V) × n_layers × n_kv_heads × head_dim × bytes(kv_dtype) (+ scales)

Each term, and where it comes from:

    weights            n_params × bytes(dtype): every parameter, a tied lm_head once (ModelArgs.n_params).
    model buffers      RoPE's cos and sin tables, fp32 [n_positions, head_dim] each (Transformer.setup_rope).
    runtime overhead   what the process holds before the model loads. CPU: measured, the private writable memory
                       (VmData, what RLIMIT_DATA caps) of a spawned child that has imported the harness, generated
                       with the tiny model and run one GEMM of the model's width (thread pools, kernels, BLAS
                       buffers). CUDA: what the device holds outside this process's allocator (the context, library
                       workspaces, other processes), measured when a device is present, else
                       CUDA_RUNTIME_DEFAULT_BYTES, an assumption (override it with runtime_overhead_bytes).
    KV                 exactly what the strategy's kv_bytes_allocated() reports at the peak (kv_bytes_allocated
                       below, read off harness/kv/*.py and checked against the real caches by the tests): payload,
                       scales, int4's full-precision tail, paged block rounding, the prefix held once.
    activations        the peak of the transient tensors of one generation, from the forward pass in
                       harness/model.py (activation_bytes below). Prefill dominates: the whole batch's prompt goes
                       through each layer at once, and SwiGLU's gate|up, silu and product tensors (4 × F values per
                       token) sit beside the residual stream (3 × dim) at the peak. Attention is not materialized
                       (flash-style kernels on the CPU and CUDA: no [T, S] score matrix); the logits are the last
                       token's only. Decode adds only the strategy's read-back transients (paged gathers,
                       dequantization) over the whole context. Also the token ids (int64).

Limits: max_concurrency is the largest B whose total fits the memory; max_context the longest prompt_len + gen_len
(gen_len held) at the given B. Both search the exact ledger, so block rounding and a fixed pool count.

Not counted: the accuracy pass of lossy points (bench builds an exact contiguous cache beside the lossy one: run
the frontier with accuracy=false), allocator fragmentation (CUDA's caching allocator rounds and keeps freed blocks;
glibc keeps freed activations in its heap unless its mmap threshold is pinned: see experiments/capacity.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import multiprocessing as mp
from dataclasses import dataclass
from pathlib import Path

import torch

from harness import kv
from harness.config import DTYPES, KV_DTYPES, check_kv_layout
from harness.errors import ConfigError
from harness.kv.base import blocks_for
from harness.kv.quant import BITS, PLAIN, QUANTIZED
from harness.model import PRESETS, SUPPORTED_MODEL_TYPES, ModelArgs

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # compute dtypes
SCALE_BYTES = 4  # quantization scales and zero points are fp32 (harness.kv.quant.SCALE_DTYPE)
TOKEN_ID_BYTES = 8  # prompts and generated ids are int64
# CUDA context plus cuBLAS/cuDNN workspaces when no device is here to measure them: an assumption, not a figure
# measured here (the context alone is some hundreds of MiB, more without CUDA's lazy module loading).
CUDA_RUNTIME_DEFAULT_BYTES = 1 * GiB
SEARCH_LIMIT = 2**40  # no batch or context is searched beyond this


# --- the model ------------------------------------------------------------------------------------------------------


def resolve_model(model: str | Path | dict | ModelArgs) -> ModelArgs:
    """A preset name, a local directory holding a Hugging Face config.json (or the file), a config dict, or
    ModelArgs -> ModelArgs. Only the config is read: no weights are needed to plan."""
    if isinstance(model, ModelArgs):
        return model
    if isinstance(model, dict):
        return _from_hf_config(model, name=str(model.get("_name_or_path") or "hf-config"))
    name = str(model)
    if name in PRESETS:
        return ModelArgs.from_name(name)
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file() and path.suffix == ".json":
        return _from_hf_config(json.loads(path.read_text()), name=path.resolve().parent.name)
    raise ConfigError(
        f"model: unknown preset {name!r}; allowed: {', '.join(PRESETS)}, or a local directory with a config.json"
    )


def _from_hf_config(config: dict, *, name: str) -> ModelArgs:
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model: {name} has model_type {config.get('model_type')!r}; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        return ModelArgs.from_hf_config(config, name=name)
    except KeyError as exc:
        raise ConfigError(f"model: {name}'s config.json lacks {exc.args[0]!r}") from None


def kv_bytes_per_token(model: str | Path | dict | ModelArgs, kv_dtype: str, *, kv_group_size: int = 32) -> int:
    """K and V of one token of one sequence over all layers, in bytes, scales included (int4's full-precision tail
    excluded: it is per sequence, not per token).

        plain        2 × n_layers × n_kv_heads × head_dim × bytes
        fp8, int8    2 × n_layers × n_kv_heads × (head_dim × 1 + 4): one fp32 scale per token and head
        int4         2 × n_layers × n_kv_heads × (head_dim / 2 + 8 × head_dim / kv_group_size): packed nibbles,
                     plus a scale and a zero point per key channel per group of G tokens (amortized over the
                     group) and per G value channels of each token (KIVI, harness.kv.quant.Int4Kivi)
    """
    args = resolve_model(model)
    _check_choice("kv_dtype", kv_dtype, BITS)
    per_head = args.head_dim * BITS[kv_dtype] // 8
    if kv_dtype in ("fp8_e4m3", "fp8_e5m2", "int8"):
        per_head += SCALE_BYTES
    elif kv_dtype == "int4":
        _check_group(args, kv_group_size)
        per_head += 2 * SCALE_BYTES * args.head_dim // kv_group_size
    return 2 * args.n_layers * args.n_kv_heads * per_head


# --- the workload ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What runs: the model, its formats, the cache strategy and its options, the lengths and the concurrency.

    The same fields as a RunConfig point (batch_size is `concurrency` here), validated here, once.
    """

    model: ModelArgs | str | Path | dict
    dtype: str = "bf16"  # compute dtype of weights and activations
    kv_dtype: str = "auto"  # auto: = dtype
    cache: str = "contiguous"  # a strategy of harness.kv
    block_size: int = 16  # paged, prefix: tokens per block
    pool_tokens: int | None = None  # paged, prefix: pool capacity; None: exactly what the point needs
    window: int = 4096  # sliding: tokens cached per sequence, sinks included
    sinks: int = 0  # sliding: first tokens kept
    prefix_len: int = 0  # leading prompt tokens every request shares
    kv_group_size: int = 32  # int4: values per quantization group
    kv_residual: int = 0  # int4: newest tokens kept in full precision
    prompt_len: int = 128
    gen_len: int = 32
    concurrency: int = 1  # requests decoded together (batch_size)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", resolve_model(self.model))
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _check_choice("cache", self.cache, kv.strategy_names())
        for name in ("prompt_len", "gen_len", "concurrency"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        check_kv_layout(
            kv_group_size=self.kv_group_size,
            kv_residual=self.kv_residual,
            prefix_len=self.prefix_len,
            prompt_len=self.prompt_len,
        )
        try:
            kv.parse_options(self.cache, self.options)  # the strategy's own one-line checks (cache.block_size, ...)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.max_tokens > self.model.max_seq_len:
            raise ConfigError(
                f"prompt_len + gen_len: {self.max_tokens} exceeds {self.model.name}'s {self.model.max_seq_len} "
                f"positions; allowed: at most {self.model.max_seq_len}"
            )
        self._check_supported()

    def _check_supported(self) -> None:
        """The combinations a strategy raises Unsupported for, as one-line errors naming the field."""
        kv_dtype, cache = self.kv_dtype_name, self.cache
        if kv_dtype == "int4":
            _check_group(self.model, self.kv_group_size)
        if cache == "none" and kv_dtype != self.dtype:
            raise ConfigError(f"kv_dtype: none keeps no K/V, so there is nothing to store as {kv_dtype}; allowed: auto")
        if cache in ("sliding", "offload") and kv_dtype == "int4":
            raise ConfigError(
                f"kv_dtype: {cache} cannot store int4; allowed: {', '.join(k for k in BITS if k != 'int4')}"
            )
        if cache == "offload" and kv_dtype in QUANTIZED:
            raise ConfigError(f"kv_dtype: offload stores plain dtypes only; allowed: {', '.join(PLAIN)}")
        if cache in ("paged", "prefix") and kv_dtype == "int4":
            group, block = self.kv_group_size, self.block_size
            if block % group and group % block:
                raise ConfigError(
                    f"cache.block_size: {block} cannot hold whole int4 key groups of {group} tokens; allowed: a "
                    f"divisor or a multiple of {group}"
                )
        if cache == "prefix" and kv_dtype == "int4" and self.kv_residual > 0 and self.prefix_len > 0:
            raise ConfigError("kv_residual: prefix caching of int4 needs kv_residual=0 (its tail is private)")

    @property
    def options(self) -> dict:
        """The strategy's options, as conf/cache/<name>.yaml gives them."""
        if self.cache in ("paged", "prefix"):
            return {"block_size": self.block_size, "pool_tokens": self.pool_tokens}
        if self.cache == "sliding":
            return {"window": self.window, "sinks": self.sinks}
        return {}

    @property
    def kv_dtype_name(self) -> str:
        return self.dtype if self.kv_dtype == "auto" else self.kv_dtype

    @property
    def max_tokens(self) -> int:
        return self.prompt_len + self.gen_len

    def replace(self, **changes) -> Workload:
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: unknown value {value!r}; allowed: {', '.join(allowed)}")


def _check_group(args: ModelArgs, group: int) -> None:
    if args.head_dim % group:
        raise ConfigError(
            f"kv_group_size: {args.name}'s head_dim {args.head_dim} is not a multiple of {group}; "
            f"allowed: a group size dividing {args.head_dim}"
        )


# --- KV: what each strategy allocates -------------------------------------------------------------------------------


def kv_bytes_allocated(
    args: str | Path | dict | ModelArgs,
    *,
    cache: str,
    kv_dtype: str,
    batch_size: int,
    prompt_len: int,
    gen_len: int,
    block_size: int = 16,
    pool_tokens: int | None = None,
    window: int = 4096,
    sinks: int = 0,
    prefix_len: int = 0,
    kv_group_size: int = 32,
    kv_residual: int = 0,
    dtype: str = "bf16",
) -> int:
    """Exactly what `cache`'s kv_bytes_allocated() reports at the peak of a generation (after its first write,
    when int4 allocates its full-precision tail), for CacheSpec.for_model(args, batch_size, max_tokens=prompt_len +
    gen_len, ...). `dtype` is the compute dtype: int4's tail is stored in it."""
    workload = Workload(
        model=args,
        dtype=dtype,
        kv_dtype=kv_dtype,
        cache=cache,
        block_size=block_size,
        pool_tokens=pool_tokens,
        window=window,
        sinks=sinks,
        prefix_len=prefix_len,
        kv_group_size=kv_group_size,
        kv_residual=kv_residual,
        prompt_len=prompt_len,
        gen_len=gen_len,
        concurrency=batch_size,
    )
    return kv_allocation(workload).total_bytes


@dataclass(frozen=True)
class KVAllocation:
    """A strategy's KV storage, by kind: payload, scales, int4's tail; and of it, what sits in host memory."""

    data_bytes: int
    scale_bytes: int = 0
    tail_bytes: int = 0
    host_bytes: int = 0  # offload: the pinned host store (the rest are its two device slots)

    @property
    def total_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes + self.tail_bytes


def kv_allocation(w: Workload) -> KVAllocation:
    """The tensors each strategy allocates (harness/kv/<cache>.py), summed; shapes in the comments are theirs."""
    args, kv_dtype, batch = w.model, w.kv_dtype_name, w.concurrency
    heads, head_dim, layers = args.n_kv_heads, args.head_dim, args.n_layers
    if w.cache == "none":
        return KVAllocation(0)
    if w.cache == "offload":  # host [L, S, K|V, B, H_kv, D] + staging [2, S, K|V, B, H_kv, D], plain dtypes only
        per_layer = w.max_tokens * 2 * batch * heads * head_dim * DTYPE_BYTES[kv_dtype]
        return KVAllocation(data_bytes=(layers + 2) * per_layer, host_bytes=layers * per_layer)
    if w.cache == "sliding":  # data [L, K|V, B, H_kv, slots, D] (+ scale [.., slots, 1]); no int4
        slots = min(w.window, w.max_tokens)
        tokens = layers * 2 * batch * heads * slots
        data = tokens * head_dim * BITS[kv_dtype] // 8
        return KVAllocation(data, scale_bytes=tokens * SCALE_BYTES if kv_dtype in QUANTIZED else 0)
    # contiguous, paged and prefix: a data part with a row per token, and the format's scale parts
    # (harness.kv.quant: TokenFormat.parts, Int4Kivi.parts), each row `width` values per `tokens` positions.
    data_width_bytes = head_dim * BITS[kv_dtype] // 8  # int4: D / 2 bytes
    scale_parts = _scale_parts(w)  # [(tokens per row, width)] of fp32 values
    if w.cache == "contiguous":  # K and V each [L, B, H_kv, S, w]; each scale part [L, B, H_kv, ceil(S / tokens), w]
        lead = layers * batch * heads
        data = lead * 2 * w.max_tokens * data_width_bytes
        scales = sum(lead * blocks_for(w.max_tokens, tokens) * width * SCALE_BYTES for tokens, width in scale_parts)
    else:  # K and V pools each [L, N, H_kv, bs, w]; each scale part [L, N, H_kv, rows per block, w]
        n_blocks = pool_blocks(w)
        lead = layers * n_blocks * heads
        data = lead * 2 * w.block_size * data_width_bytes
        scales = sum(
            lead * _rows_per_block(w.block_size, tokens) * width * SCALE_BYTES for tokens, width in scale_parts
        )
    return KVAllocation(data, scale_bytes=scales, tail_bytes=_int4_tail_bytes(w))


def _scale_parts(w: Workload) -> list[tuple[int, int]]:
    """(tokens per row, width) of each fp32 scale part: fp8/int8 a k_scale and a v_scale of width 1 per token;
    int4 a scale and a zero of width D per G key tokens, and of width D / G per value token."""
    kv_dtype, head_dim, group = w.kv_dtype_name, w.model.head_dim, w.kv_group_size
    if kv_dtype in ("fp8_e4m3", "fp8_e5m2", "int8"):
        return [(1, 1), (1, 1)]
    if kv_dtype == "int4":
        return [(group, head_dim), (group, head_dim), (1, head_dim // group), (1, head_dim // group)]
    return []


def _rows_per_block(block_size: int, tokens_per_row: int) -> int:
    """harness.kv.paged.PagedCache._rows_per_block: a group larger than a block keeps its row in its first block."""
    return block_size // tokens_per_row if block_size % tokens_per_row == 0 else 1


def pool_blocks(w: Workload) -> int:
    """Blocks in a paged or prefix pool: pool_tokens rounded up to blocks, or by default what the point needs at its
    peak, ceil(S / bs) per sequence; prefix holds its shared blocks once (harness.kv.prefix.PrefixCache)."""
    per_sequence = blocks_for(w.max_tokens, w.block_size)
    if w.pool_tokens is not None:
        return blocks_for(w.pool_tokens, w.block_size)
    return w.concurrency * per_sequence - (w.concurrency - 1) * prefix_blocks(w)


def prefix_blocks(w: Workload) -> int:
    """Blocks of the shared prefix: whole blocks only, and for int4 whole key groups too (prefix.shared_unit)."""
    if w.cache != "prefix":
        return 0
    unit = math.lcm(w.block_size, w.kv_group_size) if w.kv_dtype_name == "int4" else w.block_size
    return w.prefix_len // unit * unit // w.block_size


def pool_fits(w: Workload) -> bool:
    """Whether the pool holds the batch at its peak: False is KVPoolExhausted (an `oom` row) in a fixed pool."""
    if w.cache not in ("paged", "prefix"):
        return True
    need = w.concurrency * blocks_for(w.max_tokens, w.block_size) - (w.concurrency - 1) * prefix_blocks(w)
    return need <= pool_blocks(w)


def _int4_tail_bytes(w: Workload) -> int:
    """int4's full-precision ring, [L, B, H_kv, capacity, D] per side in the compute dtype, allocated on the first
    write: keys wait for a whole group (residual + G - 1 tokens at most), values for the residual."""
    if w.kv_dtype_name != "int4":
        return 0
    capacity = min(w.kv_residual + w.kv_group_size - 1, w.max_tokens) + min(w.kv_residual, w.max_tokens)
    args = w.model
    return args.n_layers * w.concurrency * args.n_kv_heads * capacity * args.head_dim * DTYPE_BYTES[w.dtype]


# --- activations: the peak of the transient tensors ---------------------------------------------------------------


def activation_bytes(w: Workload) -> int:
    """Peak bytes of the tensors one generation creates beyond weights, buffers and KV: the larger of prefill and
    the last decode step (the longest context), plus the token ids, which live throughout."""
    token_ids = TOKEN_ID_BYTES * w.concurrency * (2 * w.prompt_len + w.gen_len)  # the prompts, the output buffer
    return token_ids + max(prefill_activation_bytes(w), decode_activation_bytes(w))


def prefill_activation_bytes(w: Workload) -> int:
    """The prompt through every layer at once, B × T tokens. Prefix caching first computes its shared blocks as one
    sequence, then the B suffixes from there, attending with a [T, S] mask."""
    batch, prompt = w.concurrency, w.prompt_len
    shared = min(prefix_blocks(w) * w.block_size, prompt - 1)
    peaks = [
        _forward_bytes(w, n_seqs=batch, n_new=prompt - shared, n_keys=prompt),
    ]
    if shared:
        peaks.append(_forward_bytes(w, n_seqs=1, n_new=shared, n_keys=shared))
    return max(peaks)


def decode_activation_bytes(w: Workload) -> int:
    """The last decode step, whose context is the longest: one new token per sequence over prompt + gen - 1 keys.
    Without a cache (`none`) that step is a forward over the whole sequence so far."""
    if w.gen_len < 2:
        return 0
    keys = w.max_tokens - 1
    if w.cache == "none":
        return _forward_bytes(w, n_seqs=w.concurrency, n_new=keys, n_keys=keys)
    return _forward_bytes(w, n_seqs=w.concurrency, n_new=1, n_keys=keys)


def _forward_bytes(w: Workload, *, n_seqs: int, n_new: int, n_keys: int) -> int:
    """Peak live bytes of one forward (harness.model.Transformer) over n_new new tokens per sequence, attending to
    n_keys. Per token, with b = bytes(dtype), d = dim, q = q_dim, k = kv_dim, F = intermediate_size:

        norm     ffn_norm(h) beside x: fp32 x, h, x·rsqrt, weight·(.) = 16·d; else x, h (2·d·b) + its fp32 copy
                 and x·rsqrt (8·d)
        rope     x, the norm's output, qkv (2·d + q + 2·k) + rotating q: x·cos, cat(-x2, x1), (.)·sin (3·q)
        attend   x, norm out, qkv, rotated q and k (2·d + 2·q + 3·k) + the strategy's write or read-back
                 transients (strategy_transients), then the attention output (q) and its fp32 logsumexp (H·4), and
                 a causal mask offset by start_pos ([T, S] bool, harness.kv.base.attention) when T < S
        wo       2·d + 2·q + 3·k + attention output (q) + wo's output (d)
        mlp      x, h, ffn_norm(h) (3·d) + gate|up (2·F) + silu(gate) (F) + silu·up (F)
        logits   the last layer's output (d: x[:, -1:] keeps its storage) + B × vocab logits

    A sliding window's prefill past the window (harness.kv.sliding._banded_step) builds its [T, T] band mask before
    the layers (10 bytes per pair at the peak: a bool, the int64 distances, a bool) and holds it (1 byte per pair)
    through every phase.
    """
    args, b = w.model, DTYPE_BYTES[w.dtype]
    d, q, k, f = args.dim, args.q_dim, args.kv_dim, args.intermediate_size
    n = n_seqs * n_new  # tokens through the layers
    write, read_peak, read_result = strategy_transients(w, n_seqs=n_seqs, n_new=n_new, n_keys=n_keys)
    attention_out = n * (q * b + args.n_heads * 4)
    mask = n_new * n_keys if 1 < n_new < n_keys else 0  # bool [T, S], for queries that start mid-sequence
    banded = w.cache == "sliding" and n_new > 1 and n_keys > w.window
    band = n_new * n_keys if banded else 0  # [T, S] bool, held by the step
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
    return max(10 * band, band + layers)


def strategy_transients(w: Workload, *, n_seqs: int, n_new: int, n_keys: int) -> tuple[int, int, int]:
    """(write peak, read-back peak, read-back result) in bytes, for one layer's attend: what the strategy creates
    beside the layer's live tensors when it stores n_new tokens per sequence and reads n_keys back.

    Plain storage at the compute dtype is free in a contiguous buffer, a ring within its window, and for `none`
    (views). A paged read gathers each side through the block table, twice (the index, then a reshape), whole blocks;
    a dtype other than the compute dtype is converted on write and on read; fp8/int8 encode through fp32
    temporaries (abs, x / scale, clamp, round) and decode to fp32, times the scale, then to the dtype; int4 likewise
    with its min/max codes and nibble unpacking (an estimate: harness.kv.quant.Int4Kivi).
    """
    kv_dtype, cache = w.kv_dtype_name, w.cache
    b, kv_dim = DTYPE_BYTES[w.dtype], w.model.kv_dim
    if cache == "none":
        return 0, 0, 0
    new = n_seqs * n_new * kv_dim  # values written per side
    if cache == "sliding" and n_new > 1 and n_keys > w.window:  # banded: the held keys and the new ones, concatenated
        return write_sliding(w, new), 0, 2 * new * b
    if cache == "sliding":
        n_keys = min(n_keys, w.window)
    keys = n_seqs * n_keys * kv_dim  # values read back per side
    gathered = 0
    if cache in ("paged", "prefix"):
        keys_rounded = n_seqs * blocks_for(n_keys, w.block_size) * w.block_size * kv_dim
        gathered = keys_rounded * BITS[kv_dtype] // 8  # one side's payload gathered from the pool
    if cache == "offload":  # torch.stack((k, v)) of the new tokens; the device slot is read in place
        return 2 * new * b, 0, 0
    converts = b != 4  # the codecs compute in fp32: a non-fp32 input is copied to fp32 first
    if kv_dtype in PLAIN:
        kv_b = DTYPE_BYTES[kv_dtype]
        write = new * kv_b if kv_b != b else 0
        if cache == "paged" or cache == "prefix":
            result = keys * b if kv_b != b else gathered
            read_peak = result + 2 * gathered if kv_b == b else result + max(2 * gathered, gathered + keys * b)
            return write, read_peak, 2 * result
        if kv_b == b:
            return write, 0, 0
        return write, 2 * keys * b, 2 * keys * b
    if kv_dtype == "int4":  # codes and fp32 temporaries: ~17 bytes per value written, ~12 per value read
        write = new * (17 + 4 * converts)
        read_peak = keys * (b + 12) + (gathered * 2 if gathered else 0)
        return write, read_peak, 2 * keys * b
    # fp8 (x/scale, clamp, cast: 9 bytes per value) and int8 (x/scale, round, clamp: 12), fp32 in
    write = new * ((12 if kv_dtype == "int8" else 9) + 4 * converts)
    read_peak = keys * (b + 8) + gathered  # the other side decoded (b), this one: fp32 codes and codes·scale
    return write, read_peak, 2 * keys * b


def write_sliding(w: Workload, new: int) -> int:
    """A ring's write of `new` values per side: plain at the compute dtype in place, else through its codec."""
    b, kv_dtype = DTYPE_BYTES[w.dtype], w.kv_dtype_name
    if kv_dtype in PLAIN:
        return new * DTYPE_BYTES[kv_dtype] if DTYPE_BYTES[kv_dtype] != b else 0
    return new * ((12 if kv_dtype == "int8" else 9) + 4 * (b != 4))


# --- static terms ---------------------------------------------------------------------------------------------------


def weights_bytes(args: ModelArgs, dtype: str) -> int:
    """Every parameter at the compute dtype (harness.model.build_model casts the whole model, norms included)."""
    return args.n_params * DTYPE_BYTES[dtype]


def buffers_bytes(args: ModelArgs, n_positions: int) -> int:
    """RoPE's cos and sin tables, fp32 [n_positions, head_dim] each (Transformer.setup_rope)."""
    return 2 * n_positions * args.head_dim * 4


def _child_runtime_bytes(sender, dtype: str, dim: int, ffn: int) -> None:
    """In a spawned child: import what a measuring child imports, generate a few tokens with the tiny model at the
    compute dtype (thread pools, kernels), run one GEMM of the workload's widest shape (BLAS's own buffers grow with
    it), free everything, and report the private writable memory."""
    from harness import runner  # noqa: F401  (the measuring child's imports)
    from harness.decode import generate
    from harness.kv.base import CacheSpec
    from harness.model import build_model
    from harness.timing import StepTimer

    cpu, torch_dtype = torch.device("cpu"), DTYPES[dtype]
    args = ModelArgs.from_name("tiny")
    model = build_model(args, dtype=torch_dtype, device=cpu, seed=0, n_positions=64)
    spec = CacheSpec.for_model(args, batch_size=2, max_tokens=48, kv_dtype=dtype, device=cpu)
    generate(model, kv.build("contiguous", spec, {}), torch.zeros((2, 40), dtype=torch.long), 8, StepTimer(cpu, 8))
    with torch.inference_mode():  # w13's shape: [256, dim] x [dim, 2F]
        torch.nn.functional.linear(torch.ones(256, dim, dtype=torch_dtype), torch.empty(ffn, dim, dtype=torch_dtype))
    sender.send(private_memory_bytes())
    sender.close()


def private_memory_bytes() -> int:
    """This process's private writable memory: VmData on Linux (what RLIMIT_DATA caps), else the RSS."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    import psutil

    return psutil.Process().memory_info().rss


@functools.cache
def measured_cpu_runtime_bytes(dtype: str = "fp32", dim: int = 64, ffn: int = 256) -> int:
    """VmData of a freshly spawned child after the harness's imports, a tiny generation and a dim x ffn GEMM at
    `dtype`: the CPU runtime overhead, for a model of that width.

    Spawned from this process, as harness.runner spawns its measuring children, so it pays the same imports (the
    parent's __main__ module included) under the same environment (MALLOC_* variables). Once per process and shape;
    a few seconds.
    """
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_runtime_bytes, args=(sender, dtype, dim, ffn), daemon=True)
    child.start()
    sender.close()
    try:
        measured = receiver.recv()
    except EOFError:
        raise RuntimeError(f"runtime overhead: the measuring child died (exit code {child.exitcode})") from None
    finally:
        child.join()
    return int(measured)


def default_runtime_overhead_bytes(device: str, workload: Workload) -> int:
    """CPU: measured_cpu_runtime_bytes() for the workload's dtype and width. CUDA: the device memory a process holds
    before any tensor (context, workspaces), measured when a device is here, else CUDA_RUNTIME_DEFAULT_BYTES."""
    if device == "cpu":
        args = workload.model
        return measured_cpu_runtime_bytes(workload.dtype, args.dim, 2 * args.intermediate_size)
    if torch.cuda.is_available():
        return measured_cuda_runtime_bytes()
    return CUDA_RUNTIME_DEFAULT_BYTES


@functools.cache
def measured_cuda_runtime_bytes() -> int:
    """Device memory in use after CUDA initializes and runs a bf16 GEMM, minus what the allocator holds."""
    torch.cuda.init()
    x = torch.ones(512, 1024, device="cuda", dtype=torch.bfloat16)
    (x @ x.T).sum().item()
    free, total = torch.cuda.mem_get_info()
    return max(0, total - free - torch.cuda.memory_reserved())  # the context and workspaces: what no allocator counts


def resolve_device(device: str) -> str:
    _check_choice("device", device, ("auto", "cpu", "cuda"))
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def detected_memory_bytes(device: str) -> int:
    """CUDA: the device's total memory; CPU: the machine's total RAM (psutil)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("memory_gb: no CUDA device here to detect its memory; allowed: a number of GiB")
        return torch.cuda.get_device_properties(0).total_memory
    import psutil

    return psutil.virtual_memory().total


# --- the ledger -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ledger:
    """Where the memory of a workload goes, in bytes, and the limits it implies. Concurrency multiplies the dynamic
    part (KV and activations), never the static one."""

    workload: Workload
    device: str
    memory_bytes: int  # the budget: memory_gb, or the device's total
    # static
    weights_bytes: int
    buffers_bytes: int  # RoPE tables
    runtime_overhead_bytes: int
    # dynamic
    kv_bytes_per_token: int  # scales included, int4's tail excluded
    kv_bytes_per_request: int  # the strategy's allocation for one request at this length, on the device
    kv_bytes: int  # ... for the whole concurrency, on the device
    kv_bytes_host: int  # offload: the host store (not in total_bytes)
    activation_bytes: int  # peak transient of one generation, for the whole concurrency
    # limits
    max_concurrency: int  # at prompt_len + gen_len; 0: not even one request fits
    max_context: int  # prompt_len + gen_len (gen_len held) at this concurrency; 0: none fits
    max_context_by: str  # what bounds max_context: "memory" or "model" (its positions)

    @property
    def static_bytes(self) -> int:
        return self.weights_bytes + self.buffers_bytes + self.runtime_overhead_bytes

    @property
    def dynamic_bytes(self) -> int:
        return self.kv_bytes + self.activation_bytes

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.dynamic_bytes

    @property
    def free_bytes(self) -> int:
        return self.memory_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.free_bytes >= 0 and pool_fits(self.workload)


def ledger(
    workload: Workload,
    *,
    memory_gb: float | None = None,
    device: str = "auto",
    runtime_overhead_bytes: int | None = None,
) -> Ledger:
    """The memory ledger of `workload` on `device` with `memory_gb` (None: the detected device's memory).

    runtime_overhead_bytes None: measured (default_runtime_overhead_bytes). A ConfigError names the field when the
    static part alone does not fit.
    """
    device = resolve_device(device)
    if workload.cache == "offload" and device != "cuda":
        raise ConfigError("cache: offload streams K/V from host memory to a CUDA device; allowed here: device=cuda")
    memory_bytes = _memory_bytes(memory_gb, device)
    if runtime_overhead_bytes is None:
        runtime_overhead_bytes = default_runtime_overhead_bytes(device, workload)
    if runtime_overhead_bytes < 0:
        raise ConfigError(f"runtime_overhead_bytes: must be 0 or more, got {runtime_overhead_bytes}")
    args = workload.model
    static = weights_bytes(args, workload.dtype) + runtime_overhead_bytes
    if static + buffers_bytes(args, workload.max_tokens) > memory_bytes:
        raise ConfigError(
            f"memory_gb: {memory_bytes / GiB:.2f} GiB cannot hold {args.name}'s {workload.dtype} weights "
            f"({weights_bytes(args, workload.dtype) / GiB:.2f} GiB) and the runtime ({runtime_overhead_bytes / GiB:.2f} "
            f"GiB); allowed: more than {static / GiB:.2f} GiB"
        )
    allocation = kv_allocation(workload)
    one = kv_allocation(workload.replace(concurrency=1))
    limits = dict(memory_bytes=memory_bytes, runtime_overhead_bytes=runtime_overhead_bytes)
    context, context_by = _max_context(workload, **limits)
    return Ledger(
        workload=workload,
        device=device,
        memory_bytes=memory_bytes,
        weights_bytes=weights_bytes(args, workload.dtype),
        buffers_bytes=buffers_bytes(args, workload.max_tokens),
        runtime_overhead_bytes=runtime_overhead_bytes,
        kv_bytes_per_token=kv_bytes_per_token(args, workload.kv_dtype_name, kv_group_size=workload.kv_group_size),
        kv_bytes_per_request=one.total_bytes - one.host_bytes,
        kv_bytes=allocation.total_bytes - allocation.host_bytes,
        kv_bytes_host=allocation.host_bytes,
        activation_bytes=activation_bytes(workload),
        max_concurrency=_max_concurrency(workload, **limits),
        max_context=context,
        max_context_by=context_by,
    )


def _memory_bytes(memory_gb: float | None, device: str) -> int:
    if memory_gb is None:
        return detected_memory_bytes(device)
    if memory_gb <= 0:
        raise ConfigError(f"memory_gb: must be positive, got {memory_gb}")
    return int(memory_gb * GiB)


def total_bytes(workload: Workload, *, runtime_overhead_bytes: int) -> int:
    """static + dynamic of the ledger, on the device (offload's host store excluded): the quantity that must fit."""
    allocation = kv_allocation(workload)
    return (
        weights_bytes(workload.model, workload.dtype)
        + buffers_bytes(workload.model, workload.max_tokens)
        + runtime_overhead_bytes
        + allocation.total_bytes
        - allocation.host_bytes
        + activation_bytes(workload)
    )


def _fits(workload: Workload, *, memory_bytes: int, runtime_overhead_bytes: int) -> bool:
    return pool_fits(workload) and total_bytes(workload, runtime_overhead_bytes=runtime_overhead_bytes) <= memory_bytes


def _largest(fits, low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), fits monotone (true then false); low - 1 if none."""
    if not fits(low):
        return low - 1
    step = 1
    while low + step <= high and fits(low + step):  # gallop, then bisect
        low, step = low + step, step * 2
    high = min(high, low + step)
    while low < high:  # fits(low); fits(high + 1) is false or high is the cap
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _max_concurrency(workload: Workload, *, memory_bytes: int, runtime_overhead_bytes: int) -> int:
    def fits(batch: int) -> bool:
        return _fits(
            workload.replace(concurrency=batch),
            memory_bytes=memory_bytes,
            runtime_overhead_bytes=runtime_overhead_bytes,
        )

    return _largest(fits, 1, SEARCH_LIMIT)


def _max_context(workload: Workload, *, memory_bytes: int, runtime_overhead_bytes: int) -> tuple[int, str]:
    """The longest prompt_len + gen_len that fits at this concurrency, gen_len (and prefix_len) held."""
    first, last = workload.prefix_len + 1, workload.model.max_seq_len - workload.gen_len
    if last < first:
        return 0, "model"

    def fits(prompt_len: int) -> bool:
        return _fits(
            workload.replace(prompt_len=prompt_len),
            memory_bytes=memory_bytes,
            runtime_overhead_bytes=runtime_overhead_bytes,
        )

    prompt_len = _largest(fits, first, last)
    if prompt_len < first:
        return 0, "memory"
    return prompt_len + workload.gen_len, "model" if prompt_len == last else "memory"


def max_concurrency(
    workload: Workload,
    *,
    memory_gb: float | None = None,
    device: str = "auto",
    runtime_overhead_bytes: int | None = None,
) -> int:
    """The most concurrent requests of workload's length whose total fits: ledger(...).max_concurrency."""
    return ledger(
        workload, memory_gb=memory_gb, device=device, runtime_overhead_bytes=runtime_overhead_bytes
    ).max_concurrency


def max_context(
    workload: Workload,
    *,
    memory_gb: float | None = None,
    device: str = "auto",
    runtime_overhead_bytes: int | None = None,
) -> int:
    """The longest prompt_len + gen_len that fits at workload's concurrency: ledger(...).max_context."""
    return ledger(
        workload, memory_gb=memory_gb, device=device, runtime_overhead_bytes=runtime_overhead_bytes
    ).max_context


def format_ledger(book: Ledger) -> str:
    """The ledger as a table a person reads: bytes and GiB per line, static then dynamic, then the limits."""
    w = book.workload

    def line(label: str, value: int) -> str:
        return f"  {label:<44} {value:>18,} B {value / GiB:>10.3f} GiB"

    header = (
        f"{w.model.name}: {w.dtype} weights, {w.kv_dtype_name} KV, cache={w.cache}, prompt {w.prompt_len} + gen "
        f"{w.gen_len} tokens, {w.concurrency} concurrent, {book.device} with {book.memory_bytes / GiB:.2f} GiB"
    )
    rows = [
        header,
        "static",
        line("weights", book.weights_bytes),
        line("model buffers (RoPE tables)", book.buffers_bytes),
        line("runtime overhead", book.runtime_overhead_bytes),
        "dynamic",
        f"  {'KV per token (scales included)':<44} {book.kv_bytes_per_token:>18,} B",
        line("KV per request", book.kv_bytes_per_request),
        line(f"KV for {w.concurrency} concurrent", book.kv_bytes),
        line("activations (peak transient)", book.activation_bytes),
    ]
    if book.kv_bytes_host:
        rows.append(line("KV in host memory (offload, not counted)", book.kv_bytes_host))
    rows += [
        line("total", book.total_bytes),
        line("free" if book.fits else "SHORT (does not fit)", abs(book.free_bytes)),
        "limits",
        f"  max concurrency at {w.max_tokens} tokens: {book.max_concurrency}",
        f"  max context at {w.concurrency} concurrent: {book.max_context} tokens"
        + (" (the model's positions)" if book.max_context_by == "model" else ""),
    ]
    if not pool_fits(w):
        rows.append(f"  the pool of {pool_blocks(w)} blocks cannot hold {w.concurrency} requests: KV pool exhausted")
    return "\n".join(rows)
