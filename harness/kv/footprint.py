"""The bytes a layout's storage and codecs take, by kind, without building the cache: what harness.kv.base.Layout's
dense defaults and the strategies' own layouts count (per-row payload, scale parts, int4's tail, codec transients).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.formats import BITS, DTYPE_BYTES, PER_TOKEN_SCALED
from harness.formats import PLAIN as PLAIN_NAMES
from harness.kv.shape import KVShape


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


def cache_width(shape: KVShape) -> int:
    """Values one side (K, V, or MLA's latent row) of one token holds in one layer: H_kv x D; MLA 1 x (kv_lora_rank
    + qk_rope_head_dim), the cache geometry of harness.modeling.model_args.ModelArgs (cache_heads, cache_head_dim)."""
    args = shape.model
    return args.cache_heads * args.cache_head_dim


def data_row_bytes(shape: KVShape) -> int:
    """Bytes of one token's K (or V, or MLA's latent row) of one cached head at the storage format's bits: int4
    D / 2."""
    return shape.model.cache_head_dim * BITS[shape.kv_dtype] // 8


def scale_parts(shape: KVShape) -> list[tuple[int, int]]:
    """(tokens per row, width) of each fp32 scale part (harness.kv.quant: TokenFormat.parts, Int4Kivi.parts):
    fp8/int8 a k_scale and a v_scale of width 1 per token; int4 a scale and a zero of width D per G key tokens, and
    of width D / G per value token. MLA caches one side, quantized as keys are: one scale per token (fp8/int8), a
    scale and a zero per channel per G tokens (int4: the latent's channels, like K's, carry the outliers)."""
    kv_dtype, head_dim, group = shape.kv_dtype, shape.model.cache_head_dim, shape.kv_group_size
    sides = shape.model.cache_sides
    if kv_dtype in PER_TOKEN_SCALED:
        return [(1, 1)] * sides
    if kv_dtype == "int4":
        values = [(1, head_dim // group), (1, head_dim // group)] if sides == 2 else []
        return [(group, head_dim), (group, head_dim), *values]
    return []


def int4_tail_bytes(shape: KVShape) -> int:
    """int4's full-precision ring, [L, B, H_kv, capacity, D] per side in the compute dtype, allocated on the first
    write: keys wait for a whole group (residual + G - 1 tokens at most), values for the residual. MLA's one latent
    side waits as keys do."""
    if shape.kv_dtype != "int4":
        return 0
    args = shape.model
    capacity = min(shape.kv_residual + shape.kv_group_size - 1, shape.max_tokens)
    if args.cache_sides == 2:
        capacity += min(shape.kv_residual, shape.max_tokens)
    return (
        args.n_layers * shape.batch_size * args.cache_heads * capacity * args.cache_head_dim * DTYPE_BYTES[shape.dtype]
    )


def codec_transients(shape: KVShape, *, new: int, keys: int, gathered: int = 0) -> tuple[int, int, int]:
    """(write peak, read-back peak, read-back result) of the format's codec, `new` values written and `keys` read
    back per side, `gathered` bytes of one side's payload gathered first (a paged read; 0 for a buffer read in place).

    Plain storage at the compute dtype is free (views); a dtype other than the compute dtype is converted on write
    and on read; fp8/int8 encode through fp32 temporaries (abs, x / scale, clamp, round) and decode to fp32, times
    the scale, then to the dtype; int4 likewise with its min/max codes and nibble unpacking (an estimate:
    harness.kv.quant.Int4Kivi). Both sides are read back (K and V), or MLA's one latent side (`sides`).
    """
    kv_dtype, b, sides = shape.kv_dtype, DTYPE_BYTES[shape.dtype], shape.model.cache_sides
    other = (sides - 1) * b  # per value read: the other side, already decoded, while this one decodes
    converts = b != 4  # the codecs compute in fp32: a non-fp32 input is copied to fp32 first
    if kv_dtype in PLAIN_NAMES:
        kv_b = DTYPE_BYTES[kv_dtype]
        write = new * kv_b if kv_b != b else 0
        if kv_b == b:
            return write, 0, 0
        return write, sides * keys * b, sides * keys * b
    if kv_dtype == "int4":  # codes and fp32 temporaries: ~17 bytes per value written, ~12 per value read
        write = new * (17 + 4 * converts)
        read_peak = keys * (other + 12) + sides * gathered
        return write, read_peak, sides * keys * b
    # fp8 (x/scale, clamp, cast: 9 bytes per value) and int8 (x/scale, round, clamp: 12), fp32 in
    write = new * ((12 if kv_dtype == "int8" else 9) + 4 * converts)
    read_peak = keys * (other + 8) + gathered  # the other side decoded (b), this one: fp32 codes and codes·scale
    return write, read_peak, sides * keys * b
