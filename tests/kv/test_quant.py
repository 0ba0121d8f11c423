"""Quantized KV storage: each codec's error, int4 packing, honest bytes, and the same tokens from every strategy."""

from __future__ import annotations

import pytest
import torch

from harness import kv
from harness.errors import Unsupported
from harness.kv.base import CacheSpec
from harness.kv.quant import (
    decode_int4_keys,
    decode_int4_values,
    encode_int4_keys,
    encode_int4_values,
    pack_int4,
    token_codec,
    unpack_int4,
)
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate

CPU = torch.device("cpu")
# One rounding errs by at most half the spacing between neighbours (2^-4 relative for e4m3's 3 mantissa bits, 2^-3
# for e5m2's 2); bounded here at one spacing, the issue's ~2^-3 / ~2^-2, plus a floor for values deep in the
# subnormals (1e-4 of the token's amax).
FP8_RELATIVE = {"fp8_e4m3": 2**-3, "fp8_e5m2": 2**-2}
# Loose bounds on |logits - fp32 cache's logits| / std(fp32 logits) over prefill + decode, tiny model.
LOGIT_ERROR = {"fp8_e4m3": 0.25, "fp8_e5m2": 0.5, "int8": 0.05, "int4": 0.6}
TINY_INT4 = {"kv_group_size": 8}  # tiny's head_dim is 16: the harness's groups of 32/64 need a wider head


def random_tokens(n_tokens: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """[n_tokens, head_dim] with magnitudes spread over six decades from token to token."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10 ** torch.empty(n_tokens, 1).uniform_(-3, 3, generator=gen)
    return torch.randn(n_tokens, head_dim, generator=gen) * magnitude


def wide_spec(kv_dtype: str, *, max_tokens: int = 512, **quant) -> CacheSpec:
    """Realistic head_dim for byte ratios and int4 groups."""
    return CacheSpec(
        n_layers=2,
        n_kv_heads=4,
        head_dim=128,
        batch_size=2,
        max_tokens=max_tokens,
        kv_dtype=kv_dtype,
        device=CPU,
        **quant,
    )


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- codecs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_round_trips_within_its_mantissa_precision(name):
    x = random_tokens(256, 128)
    codec = token_codec(name)
    decoded = codec.decode(codec.encode(x), torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert ((decoded - x).abs() <= FP8_RELATIVE[name] * x.abs() + 1e-4 * amax).all()


@pytest.mark.parametrize(("name", "format_max"), [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_fp8_values_beyond_the_format_range_are_scaled_and_clamped_never_inf_or_nan(name, format_max):
    x = torch.tensor([[1e6, -3e7, 2.5, 1e-3], [1e30, 1.0, -1e30, 0.0], [449.0, -448.5, 57345.0, 1.0]])
    codec = token_codec(name)
    parts = codec.encode(x)
    assert parts["data"].to(torch.float32).abs().max() <= format_max
    decoded = codec.decode(parts, torch.float32)
    assert torch.isfinite(decoded).all()
    assert ((decoded - x).abs() <= FP8_RELATIVE[name] * x.abs() + 1e-4 * x.abs().amax(-1, keepdim=True)).all()


def test_int8_round_trips_within_half_a_step_of_the_token_amax():
    x = random_tokens(256, 128)
    codec = token_codec("int8")
    parts = codec.encode(x)
    assert parts["data"].dtype == torch.int8 and parts["scale"].shape == (256, 1)
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert ((codec.decode(parts, torch.float32) - x).abs() <= 0.5 * step * (1 + 1e-5)).all()


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_token_codecs_allocate_zeroed_parts_with_the_same_leading_dims(name):
    parts = token_codec(name).alloc((3, 5, 16), CPU)
    assert all(t.shape[:-1] == (3, 5) and not t.to(torch.float32).any() for t in parts.values())
    assert parts["data"].shape == (3, 5, 16) and parts["data"].element_size() * 8 == kv.quant.BITS[name]


def test_token_codec_refuses_int4_whose_keys_group_across_tokens():
    with pytest.raises(Unsupported, match="int4"):
        token_codec("int4")


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_zeros_stay_zeros_in_every_token_codec(name):
    codec = token_codec(name)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(4, 16)), torch.float32), torch.zeros(4, 16))


def test_int4_packs_two_values_per_byte_and_unpacks_every_pair_exactly():
    every_pair = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8)  # [256, 2]
    packed = pack_int4(every_pair)
    assert packed.shape == (256, 1) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), every_pair)
    assert encode_int4_values(torch.randn(5, 64), group=32)["data"].shape == (5, 32)  # D/2 columns of uint8


@pytest.mark.parametrize("group", [32, 64])
def test_int4_values_round_trip_per_token_within_half_a_step_of_each_group_range(group):
    v = random_tokens(64, 128)
    parts = encode_int4_values(v, group)
    assert parts["scale"].shape == (64, 128 // group)
    grouped = v.unflatten(-1, (-1, group))
    step = (grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)).expand_as(grouped).flatten(-2) / 15
    assert ((decode_int4_values(parts, group, torch.float32) - v).abs() <= 0.5 * step * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("group", [32, 64])
def test_int4_keys_round_trip_per_channel_within_half_a_step_of_each_group_range(group):
    k = random_tokens(64, 128).T.contiguous()  # [128 tokens, 64 channels], magnitudes varying by channel
    parts = encode_int4_keys(k, group)
    assert parts["scale"].shape == (128 // group, 64)  # a scale per group of tokens, per channel
    grouped = k.unflatten(0, (-1, group))
    step = (grouped.amax(1, keepdim=True) - grouped.amin(1, keepdim=True)).expand_as(grouped).flatten(0, 1) / 15
    assert ((decode_int4_keys(parts, group, torch.float32) - k).abs() <= 0.5 * step * (1 + 1e-5) + 1e-7).all()


def test_int4_zeros_stay_zeros():
    zeros = torch.zeros(64, 32)
    assert torch.equal(decode_int4_keys(encode_int4_keys(zeros, 32), 32, torch.float32), zeros)
    assert torch.equal(decode_int4_values(encode_int4_values(zeros, 32), 32, torch.float32), zeros)


# --- bytes, measured from the real tensors ---------------------------------------------------------------------


def write_one_token(cache, dtype=torch.bfloat16) -> None:
    """One write, so that int4's full-precision tail exists (it is allocated in the first write's dtype)."""
    spec = cache.spec
    k = torch.randn(spec.batch_size, spec.n_kv_heads, 1, spec.head_dim).to(dtype)
    cache.prepare(0, 1)
    cache._write(0, k, k, 0)


@pytest.mark.parametrize("strategy", ["contiguous", "paged"])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_8bit_storage_is_half_of_bf16_plus_one_fp32_scale_per_token_and_head(strategy, kv_dtype):
    spec = wide_spec(kv_dtype)
    bf16 = kv.build(strategy, wide_spec("bf16"), {}).kv_bytes_allocated()
    cache = kv.build(strategy, spec, {})
    write_one_token(cache)
    scale_formula = 2 * spec.n_layers * spec.batch_size * spec.n_kv_heads * spec.max_tokens * 4  # K|V, fp32
    assert cache.kv_scale_bytes() == scale_formula
    assert cache.kv_bytes_allocated() == bf16 / 2 + scale_formula
    assert cache.kv_bytes_allocated() / bf16 == pytest.approx(0.5 + 2 / spec.head_dim)  # 0.516 at head_dim 128


@pytest.mark.parametrize("strategy", ["contiguous", "paged"])
@pytest.mark.parametrize(("group", "residual"), [(32, 0), (64, 0), (32, 16)])
def test_int4_storage_is_a_quarter_of_bf16_plus_scales_plus_the_full_precision_tail(strategy, group, residual):
    spec = wide_spec("int4", kv_group_size=group, kv_residual=residual)
    bf16 = kv.build(strategy, wide_spec("bf16"), {}).kv_bytes_allocated()
    cache = kv.build(strategy, spec, {"block_size": 64} if strategy == "paged" else {})
    write_one_token(cache)
    per_head = spec.n_layers * spec.batch_size * spec.n_kv_heads
    # K: scale + zero per channel per group of tokens; V: scale + zero per token per group of channels; fp32.
    scale_formula = per_head * spec.max_tokens * (2 * spec.head_dim // group + 2 * spec.head_dim // group) * 4
    tail_tokens = (residual + group - 1) + residual  # keys wait for a whole group beyond the window, values do not
    tail_formula = per_head * tail_tokens * spec.head_dim * 2  # bf16, the first write's dtype
    assert cache.kv_scale_bytes() == scale_formula
    assert cache.kv_bytes_allocated() == bf16 / 4 + scale_formula + tail_formula
    assert cache.kv_bytes_allocated() / bf16 == pytest.approx(0.25 + 4 / group + tail_formula / bf16)


@pytest.mark.parametrize("strategy", ["contiguous", "paged"])
def test_scale_bytes_are_the_scale_tensors_and_data_is_really_narrow(strategy):
    cache = kv.build(strategy, wide_spec("int4", kv_group_size=32), {})
    data = (cache.k, cache.v) if strategy == "contiguous" else (cache.k_pool, cache.v_pool)
    assert all(part.dtype == torch.uint8 and part.shape[-1] == 64 for part in data)  # two 4-bit values per byte
    assert cache.kv_scale_bytes() == sum(nbytes(t) for t in cache.scales.values()) > 0
    assert cache.kv_bytes_allocated() == sum(map(nbytes, data)) + cache.kv_scale_bytes()  # no tail before a write


def test_paged_int4_keeps_a_key_scale_row_per_block_when_blocks_are_smaller_than_a_group():
    spec = wide_spec("int4", kv_group_size=32)
    small, whole = (kv.build("paged", spec, {"block_size": size}) for size in (16, 32))
    # [L, N, H_kv, rows per block, D]: one row per block either way, but 16-token blocks need twice the blocks
    assert small.scales["k_scale"].shape[3] == whole.scales["k_scale"].shape[3] == 1
    assert nbytes(small.scales["k_scale"]) == 2 * nbytes(whole.scales["k_scale"])  # half of them stay unused


def test_paged_int4_rejects_a_block_size_that_splits_key_groups():
    with pytest.raises(
        Unsupported,
        match=r"block_size 24 .*allowed: block_size dividing or a multiple of it \(1, 2, 4, 8, 16, 32, or a multiple of 32\)",
    ):
        kv.build("paged", wide_spec("int4", kv_group_size=32), {"block_size": 24})


def test_int4_rejects_a_group_that_does_not_divide_head_dim(tiny_args):
    spec = CacheSpec.for_model(tiny_args, batch_size=1, max_tokens=8, kv_dtype="int4", device=CPU, kv_group_size=32)
    with pytest.raises(Unsupported, match="kv_group_size 32 does not divide head_dim 16"):
        kv.build("contiguous", spec, {})


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_live_bytes_stay_the_payload_formula_without_scales(kv_dtype):
    cache = kv.build("contiguous", wide_spec(kv_dtype), {})
    cache.prepare(0, 100)
    spec = cache.spec
    payload = 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * kv.quant.BITS[kv_dtype] / 8
    assert cache.kv_bytes_live() == 100 * spec.batch_size * payload


def test_plain_contiguous_reads_a_view_of_its_buffer_without_a_copy():
    cache = kv.build("contiguous", wide_spec("fp32"), {})
    write_one_token(cache, dtype=torch.float32)
    k, v = cache._gather(0, 1, torch.float32)
    assert k.data_ptr() == cache.k[0].data_ptr() and v.data_ptr() == cache.v[0].data_ptr()


# --- int4's full-precision tail ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "options"), [("contiguous", {}), ("paged", {"block_size": 16})])
def test_int4_residual_window_reads_back_exactly_and_older_tokens_within_int4_error(strategy, options):
    residual, group = 16, 32
    spec = wide_spec("int4", max_tokens=120, kv_group_size=group, kv_residual=residual)
    cache = kv.build(strategy, spec, options)
    gen = torch.Generator().manual_seed(4)
    shape = (spec.batch_size, spec.n_kv_heads, spec.max_tokens, spec.head_dim)
    keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    start = 0
    for n_new in (50, *[1] * 40, 7, 1):  # a prefill, decode steps, a chunk: groups fill and age out on the way
        cache.prepare(start, n_new)
        cache._write(0, keys[:, :, start : start + n_new], values[:, :, start : start + n_new], start)
        start += n_new
        k, v = cache._gather(0, start, torch.float32)
        assert torch.equal(k[:, :, -residual:], keys[:, :, start - residual : start])
        assert torch.equal(v[:, :, -residual:], values[:, :, start - residual : start])
        # Older tokens are int4: within half a step of a range of about 2 x 4 sigma (loose: 1/15 of 8).
        assert (k - keys[:, :, :start]).abs().max() < 8 / 15 and (v - values[:, :, :start]).abs().max() < 8 / 15


def test_int4_keys_wait_in_full_precision_until_their_group_is_complete():
    cache = kv.build("contiguous", wide_spec("int4", kv_group_size=32), {})  # no residual window
    x = torch.randn(2, 4, 40, 128)
    cache.prepare(0, 40)
    cache._write(0, x, x, 0)
    k, v = cache._gather(0, 40, torch.float32)
    assert torch.equal(k[:, :, 32:], x[:, :, 32:])  # the second group (32..63) is incomplete: exact
    assert not torch.equal(k[:, :, :32], x[:, :, :32])  # the first is quantized
    assert not torch.equal(v[:, :, 32:], x[:, :, 32:])  # values are per token: quantized as they arrive


# --- decoding through quantized caches ---------------------------------------------------------------------------

QUANTIZED_POINTS = [
    ("fp8_e4m3", {}),
    ("fp8_e5m2", {}),
    ("int8", {}),
    ("int4", TINY_INT4),
    ("int4", TINY_INT4 | {"kv_residual": 5}),
    ("int4", {"kv_group_size": 16, "kv_residual": 3}),
]


@pytest.mark.parametrize(("kv_dtype", "quant"), QUANTIZED_POINTS)
def test_contiguous_and_paged_generate_identical_tokens_for_the_same_kv_dtype(tiny_model, tiny_args, kv_dtype, quant):
    prompt = torch.randint(tiny_args.vocab_size, (2, 23), generator=torch.Generator().manual_seed(1))
    outputs = []
    for strategy, options in [("contiguous", {}), ("paged", {}), ("paged", {"block_size": 4})]:
        spec = CacheSpec.for_model(tiny_args, batch_size=2, max_tokens=43, kv_dtype=kv_dtype, device=CPU, **quant)
        cache = kv.build(strategy, spec, options)
        outputs.append(generate(tiny_model, cache, prompt, 20, StepTimer(CPU, n_marks=20))[0])
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


@torch.inference_mode()
def teacher_forced_logits(model, args, strategy: str, kv_dtype: str, tokens: torch.Tensor, n_prefill: int, **quant):
    """Logits [B, S, V] of a prefill of n_prefill tokens, then one decode step per remaining token."""
    spec = CacheSpec.for_model(
        args, batch_size=tokens.shape[0], max_tokens=tokens.shape[1], kv_dtype=kv_dtype, device=CPU, **quant
    )
    cache = kv.build(strategy, spec, {})
    logits = [model(tokens[:, :n_prefill], start_pos=0, cache=cache)]
    for pos in range(n_prefill, tokens.shape[1]):
        logits.append(model(tokens[:, pos : pos + 1], start_pos=pos, cache=cache))
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize(("kv_dtype", "quant"), QUANTIZED_POINTS)
def test_contiguous_and_paged_compute_bitwise_equal_logits_for_the_same_kv_dtype(
    tiny_model, tiny_args, kv_dtype, quant
):
    tokens = torch.randint(tiny_args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    contiguous, paged = (
        teacher_forced_logits(tiny_model, tiny_args, strategy, kv_dtype, tokens, n_prefill=29, **quant)
        for strategy in ("contiguous", "paged")
    )
    assert torch.equal(contiguous, paged)


@pytest.mark.parametrize("strategy", ["contiguous", "paged"])
@pytest.mark.parametrize(("kv_dtype", "quant"), QUANTIZED_POINTS)
def test_quantized_cache_logits_stay_close_to_the_fp32_cache(tiny_model, tiny_args, strategy, kv_dtype, quant):
    tokens = torch.randint(tiny_args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    exact = teacher_forced_logits(tiny_model, tiny_args, "contiguous", "fp32", tokens, n_prefill=32)
    lossy = teacher_forced_logits(tiny_model, tiny_args, strategy, kv_dtype, tokens, n_prefill=32, **quant)
    assert (lossy - exact).abs().max() <= LOGIT_ERROR[kv_dtype] * exact.std()


def test_int4_cache_gives_the_same_tokens_after_release(tiny_model, tiny_args):
    spec = CacheSpec.for_model(tiny_args, batch_size=2, max_tokens=30, kv_dtype="int4", device=CPU, **TINY_INT4)
    cache = kv.build("paged", spec, {"block_size": 8})
    prompt = torch.randint(tiny_args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    first, _ = generate(tiny_model, cache, prompt, 10, StepTimer(CPU, n_marks=10))
    cache.release()
    second, _ = generate(tiny_model, cache, prompt, 10, StepTimer(CPU, n_marks=10))
    assert torch.equal(first, second)
