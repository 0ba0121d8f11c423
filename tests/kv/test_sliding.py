"""The sliding-window cache: exactly contiguous inside the window, flat memory beyond it, one rule for prefill and
decode, and sinks that are never forgotten."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import kv
from harness.errors import Unsupported
from harness.kv.base import CacheSpec
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate
from tests.greedy import LOGIT_TOL

CPU = torch.device("cpu")


def spec_for(args, *, batch_size: int = 2, max_tokens: int, kv_dtype: str = "fp32") -> CacheSpec:
    return CacheSpec.for_model(args, batch_size=batch_size, max_tokens=max_tokens, kv_dtype=kv_dtype, device=CPU)


def random_tokens(args, batch_size: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(args.vocab_size, (batch_size, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def logits_in_chunks(model, cache, tokens: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Feed tokens [B, N] in chunks of the given lengths; the logits of every position, [B, N, V]."""
    assert sum(chunks) == tokens.shape[1]
    logits, start = [], 0
    for n in chunks:
        logits.append(model(tokens[:, start : start + n], start_pos=start, cache=cache))
        start += n
    return torch.cat(logits, dim=1)


def prefill_then_steps(n_prefill: int, n_total: int) -> list[int]:
    return [n_prefill] + [1] * (n_total - n_prefill)


class BandedReference:
    """No cache, every forward from position 0, attention under the sliding rule written out key by key."""

    recomputes_prefix = True

    def __init__(self, window: int, sinks: int) -> None:
        self.window, self.sinks = window, sinks

    def prepare(self, start_pos: int, n_new: int) -> None:
        assert start_pos == 0

    def attend(self, layer, q, k, v, start_pos):
        n = q.shape[2]
        mask = torch.tensor(
            [[j <= i and (j < self.sinks or i - j < self.window - self.sinks) for j in range(n)] for i in range(n)]
        )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("sinks", [0, 3])
def test_within_the_window_tokens_and_logits_equal_contiguous(tiny_model, tiny_args, sinks):
    prompt_len, gen_len = 9, 8
    window = prompt_len + gen_len  # the boundary: the whole sequence just fits
    prompt = random_tokens(tiny_args, batch_size=2, length=prompt_len)
    outputs = {}
    for name, options in (("contiguous", {}), ("sliding", {"window": window, "sinks": sinks})):
        cache = kv.build(name, spec_for(tiny_args, max_tokens=window), options)
        tokens, _ = generate(tiny_model, cache, prompt, gen_len, StepTimer(CPU, n_marks=gen_len))
        cache.release()
        sequence = torch.cat([prompt, tokens], dim=1)
        outputs[name] = tokens, logits_in_chunks(tiny_model, cache, sequence, prefill_then_steps(prompt_len, window))
    assert torch.equal(outputs["sliding"][0], outputs["contiguous"][0])
    assert torch.equal(outputs["sliding"][1], outputs["contiguous"][1])


def test_a_window_longer_than_the_sequence_is_exactly_contiguous(tiny_model, tiny_args):
    max_tokens = 30
    sequence = random_tokens(tiny_args, batch_size=2, length=max_tokens)
    contiguous = kv.build("contiguous", spec_for(tiny_args, max_tokens=max_tokens), {})
    sliding = kv.build("sliding", spec_for(tiny_args, max_tokens=max_tokens), {"window": 4096})
    chunks = prefill_then_steps(12, max_tokens)
    assert torch.equal(
        logits_in_chunks(tiny_model, sliding, sequence, chunks),
        logits_in_chunks(tiny_model, contiguous, sequence, chunks),
    )
    assert sliding.kv_bytes_allocated() == contiguous.kv_bytes_allocated()
    assert sliding.kv_bytes_live() == contiguous.kv_bytes_live()


def test_allocation_is_flat_in_sequence_length_beyond_the_window(tiny_args):
    window = 32
    short, long = (kv.build("sliding", spec_for(tiny_args, max_tokens=n), {"window": window}) for n in (100, 10_000))
    assert short.kv_bytes_allocated() == long.kv_bytes_allocated()
    assert short.kv_bytes_allocated() == window * 2 * spec_for(tiny_args, max_tokens=100).bytes_per_token


def test_live_bytes_cap_at_the_window(tiny_model, tiny_args):
    window, prompt_len, gen_len = 16, 10, 20
    spec = spec_for(tiny_args, max_tokens=prompt_len + gen_len)
    cache = kv.build("sliding", spec, {"window": window, "sinks": 2})
    cache.prepare(0, prompt_len)
    assert cache.kv_bytes_live() == prompt_len * 2 * spec.bytes_per_token
    cache.release()
    generate(tiny_model, cache, random_tokens(tiny_args, 2, prompt_len), gen_len, StepTimer(CPU, n_marks=gen_len))
    assert cache.kv_bytes_live() == window * 2 * spec.bytes_per_token


@pytest.mark.parametrize("sinks", [0, 4])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])  # prefill attends over stored values, as decode
def test_beyond_the_window_prefill_and_token_by_token_decoding_agree(tiny_model, tiny_args, sinks, kv_dtype):
    n_tokens, window = 40, 12
    sequence = random_tokens(tiny_args, batch_size=2, length=n_tokens)
    options = {"window": window, "sinks": sinks}
    last_logits = []
    for chunks in ([n_tokens], prefill_then_steps(5, n_tokens), [5, 20, 1, 14]):  # the last mixes chunks and steps
        cache = kv.build("sliding", spec_for(tiny_args, max_tokens=n_tokens, kv_dtype=kv_dtype), options)
        last_logits.append(logits_in_chunks(tiny_model, cache, sequence, chunks)[:, -1])
    # Other chunks, other GEMM shapes: bf16/int8 may round a stored value to the next code (tests/greedy.py).
    torch.testing.assert_close(last_logits[1], last_logits[0], rtol=1e-5, atol=LOGIT_TOL[kv_dtype])
    torch.testing.assert_close(last_logits[2], last_logits[0], rtol=1e-5, atol=LOGIT_TOL[kv_dtype])


def test_sinks_are_still_attended_after_the_window_has_slid(tiny_model, tiny_args):
    n_tokens, window, sinks = 36, 10, 3
    sequence = random_tokens(tiny_args, batch_size=2, length=n_tokens)
    cache = kv.build("sliding", spec_for(tiny_args, max_tokens=n_tokens), {"window": window, "sinks": sinks})
    decoded = logits_in_chunks(tiny_model, cache, sequence, prefill_then_steps(4, n_tokens))
    with torch.inference_mode():
        reference = tiny_model(sequence, start_pos=0, cache=BandedReference(window=window, sinks=sinks))
        without_sinks = tiny_model(sequence, start_pos=0, cache=BandedReference(window=window, sinks=0))
    torch.testing.assert_close(decoded, reference, rtol=1e-5, atol=1e-5)
    # The sinks change what is computed: the reference is not blind to them.
    assert not torch.allclose(reference[:, -1], without_sinks[:, -1], rtol=1e-5, atol=1e-5)


def test_released_cache_serves_the_next_batch_identically(tiny_model, tiny_args):
    prompt_len, gen_len = 15, 20
    cache = kv.build("sliding", spec_for(tiny_args, max_tokens=prompt_len + gen_len), {"window": 8, "sinks": 2})
    prompt = random_tokens(tiny_args, batch_size=2, length=prompt_len)
    first, _ = generate(tiny_model, cache, prompt, gen_len, StepTimer(CPU, n_marks=gen_len))
    cache.release()
    second, _ = generate(tiny_model, cache, prompt, gen_len, StepTimer(CPU, n_marks=gen_len))
    assert torch.equal(first, second)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_per_token_quantized_formats_match_contiguous_within_the_window(tiny_model, tiny_args, kv_dtype):
    n_tokens = 20
    sequence = random_tokens(tiny_args, batch_size=2, length=n_tokens)
    chunks = prefill_then_steps(8, n_tokens)
    spec = spec_for(tiny_args, max_tokens=n_tokens, kv_dtype=kv_dtype)
    contiguous = kv.build("contiguous", spec, {})
    sliding = kv.build("sliding", spec, {"window": n_tokens, "sinks": 2})
    assert torch.equal(
        logits_in_chunks(tiny_model, sliding, sequence, chunks),
        logits_in_chunks(tiny_model, contiguous, sequence, chunks),
    )
    assert sliding.kv_scale_bytes() == contiguous.kv_scale_bytes() > 0


def test_scales_are_counted_in_allocated_bytes_and_flat_too(tiny_args):
    window = 16
    spec = spec_for(tiny_args, max_tokens=1000, kv_dtype="int8")
    cache = kv.build("sliding", spec, {"window": window})
    scale_bytes = 2 * tiny_args.n_layers * 2 * tiny_args.n_kv_heads * window * 4  # K|V x B x fp32 per token, head
    assert cache.kv_scale_bytes() == scale_bytes
    assert cache.kv_bytes_allocated() == window * 2 * spec.bytes_per_token + scale_bytes


def test_int4_is_unsupported(tiny_args):
    with pytest.raises(Unsupported, match="int4"):
        kv.build("sliding", spec_for(tiny_args, max_tokens=64, kv_dtype="int4"), {"window": 16})


def test_defaults_work_out_of_the_box():
    options = kv.parse_options("sliding", {})
    assert (options.window, options.sinks) == (4096, 0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"window": 0}, r"^cache\.window: must be a positive number of tokens, got 0$"),
        ({"window": -8}, r"^cache\.window: must be a positive number of tokens, got -8$"),
        ({"window": 8, "sinks": 8}, r"^cache\.sinks: must be less than cache\.window=8, got 8$"),
        ({"window": 4, "sinks": 5}, r"^cache\.sinks: must be less than cache\.window=4, got 5$"),
        ({"sinks": -1}, r"^cache\.sinks: must be 0 or a positive number of tokens, got -1$"),
    ],
)
def test_bad_options_give_one_line_errors_naming_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        kv.parse_options("sliding", options)


@pytest.mark.parametrize(("window", "sinks"), [(8, 0), (8, 3)])
@pytest.mark.parametrize(("start_pos", "end"), [(0, 11), (0, 30), (5, 20), (9, 12), (2, 9)])
def test_a_banded_step_stores_exactly_the_positions_the_rule_keeps(tiny_args, window, sinks, start_pos, end):
    cache = kv.build("sliding", spec_for(tiny_args, max_tokens=64), {"window": window, "sinks": sinks})
    step = cache._banded_step(start_pos, end)
    ring = window - sinks
    kept = [p for p in range(start_pos, end) if p < sinks or p >= end - ring]  # the rule, position by position
    assert step.write_src.tolist() == [p - start_pos for p in kept]
    assert step.write_slots.tolist() == [p if p < sinks else sinks + (p - sinks) % ring for p in kept]


def test_a_prefill_past_the_window_traces_with_fake_tensors(tiny_args):
    # Fake tensors carry shapes, not values: an op whose output shape depends on values (boolean indexing, i.e.
    # nonzero) raises DynamicOutputShapeException, as torch.compile's tracing would, and on a GPU it would be a
    # host sync. Every shape of a prefill past the window, a banded chunk after it and a decode step must follow
    # from host integers alone.
    from torch._subclasses.fake_tensor import FakeTensorMode

    window, sinks, chunks = 8, 3, [11, 6, 1]
    n_heads, head_dim = tiny_args.n_heads, tiny_args.head_dim
    with FakeTensorMode():
        cache = kv.build("sliding", spec_for(tiny_args, max_tokens=sum(chunks)), {"window": window, "sinks": sinks})
        start_pos = 0
        for n_new in chunks:
            cache.prepare(start_pos, n_new)
            q = torch.randn(2, n_heads, n_new, head_dim)
            k, v = (torch.randn(2, tiny_args.n_kv_heads, n_new, head_dim) for _ in range(2))
            for layer in range(tiny_args.n_layers):
                assert cache.attend(layer, q, k, v, start_pos).shape == (2, n_heads, n_new, head_dim)
            start_pos += n_new
    assert cache.kv_bytes_live() == window * 2 * cache.spec.bytes_per_token
