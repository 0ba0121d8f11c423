"""The serving engine against solo decoding (issue #16 item 6): in fp32, every request's greedy tokens equal the
same prompt decoded alone by harness.modeling.decode.generate through a batch-1 contiguous cache, whatever else shares its
iterations: mixed prompt and output lengths, prompts chunked across iterations, preemption (a pool too small for
everyone, by recompute and by swap), prefix hits, and a sliding window (against harness.kv.sliding's ring).

Equality is held as tests/greedy.py holds it between computations that round differently (a flattened batch and a
masked gather against batch 1): equal up to a first difference, which must be a near-tie of the reference."""

from __future__ import annotations

import functools

import pytest
import torch

from harness import kv
from harness.errors import Unsupported
from harness.kv import base, varlen
from harness.kv.base import CacheSpec
from harness.modeling.model import build_model
from harness.modeling.model_args import ModelArgs
from harness.serve.engine import Engine, build_cache, serve
from harness.serve.kv_manager import make_kv_manager
from harness.serve.requests import Request, RequestSpec, generate, prompt_token_ids
from harness.serve.scheduler import Scheduler, SchedulerConfig
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens, greedy_with_logits

CPU = torch.device("cpu")
ARGS = ModelArgs.from_name("tiny")
MAX_MODEL_LEN = 96
BLOCK = 4


@functools.cache
def model():
    return build_model(ARGS, dtype=torch.float32, device=CPU, seed=0, n_positions=MAX_MODEL_LEN)


def mixed_requests(n: int = 10, *, prefix_len: int = 0, seed: int = 1) -> tuple[list[Request], list[list[int]]]:
    spec = RequestSpec(num_prompts=n, qps=float("inf"), seed=seed, prompt_len=24, prompt_dist="uniform",
                       prompt_spread=0.6, output_len=12, output_dist="uniform", output_spread=0.5,
                       prefix_len=prefix_len, max_model_len=MAX_MODEL_LEN)  # fmt: skip
    requests = generate(spec)
    return requests, prompt_token_ids(requests, vocab_size=ARGS.vocab_size, seed=seed)


@functools.cache
def solo_reference(
    prompt: tuple[int, ...], output_len: int, cache: str = "contiguous", window: int = 0, kv_dtype: str = "fp32"
):
    """(tokens [output_len], logits [output_len, V]) of the prompt decoded alone."""
    spec = CacheSpec.for_model(ARGS, batch_size=1, max_tokens=len(prompt) + output_len, kv_dtype=kv_dtype, device=CPU)
    options = {"window": window} if cache == "sliding" else {}
    tokens, logits = greedy_with_logits(model(), kv.build(cache, spec, options), torch.tensor([prompt]), output_len)
    return tokens[0], logits[0]


def run_engine(requests, prompts, *, strategy="paged", num_blocks=256, window=None, attn_impl="sdpa", **knobs):
    manager = make_kv_manager(strategy, num_blocks=num_blocks, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                              sliding_window=window)  # fmt: skip
    scheduler = Scheduler(SchedulerConfig(max_model_len=MAX_MODEL_LEN, **knobs), manager)
    cache, num_slots = build_cache(strategy, ARGS, kv_dtype="fp32", num_blocks=num_blocks, block_size=BLOCK,
                                   max_model_len=MAX_MODEL_LEN, device=CPU, attn_impl=attn_impl)  # fmt: skip
    engine = Engine(model(), cache, num_slots=num_slots, window=window)
    iterations = []
    result = serve(requests, prompts, scheduler=scheduler, engine=engine,
                   on_iteration=lambda i, output, *_: iterations.append(output))  # fmt: skip
    assert sorted(result.outputs) == [r.request_id for r in requests]
    return result, iterations


def assert_solo_equal(requests, prompts, result, *, cache="contiguous", window=0):
    for request, prompt in zip(requests, prompts, strict=True):
        expected, logits = solo_reference(tuple(prompt), request.output_len, cache, window)
        actual = torch.tensor(result.outputs[request.request_id])
        assert len(actual) == request.output_len
        assert_same_greedy_tokens(actual[None], expected[None], logits[None], tol=LOGIT_TOL["fp32"])


@pytest.mark.parametrize("strategy", ["paged", "prefix", "sliding"])
def test_a_blocks_pool_keeps_no_block_table_but_the_schedulers_and_refuses_int_positions(strategy):
    """Issue #28: the KV manager's tables, brought by each SeqBatch, are the only ones; the int-position paths,
    which would read the cache's own, say so in one line."""
    cache, num_slots = build_cache(strategy, ARGS, kv_dtype="fp32", num_blocks=8, block_size=BLOCK,
                                   max_model_len=MAX_MODEL_LEN, device=CPU)  # fmt: skip
    assert num_slots is None and (cache.free_blocks, cache.tables, cache.table) == (None, None, None)
    with pytest.raises(Unsupported, match="own block tables, and a serving pool keeps none"):
        cache.prepare(0, 1)
    with pytest.raises(Unsupported, match="compile needs this cache's own block tables"):
        cache.enable_static_decode()


@pytest.mark.parametrize("strategy", ["contiguous", "paged", "prefix"])
def test_mixed_lengths_with_chunked_prefill_match_solo_decoding(strategy):
    requests, prompts = mixed_requests()
    # 16 tokens per iteration: prompts of 10..38 tokens are chunked, and decodes share iterations with chunks.
    result, iterations = run_engine(requests, prompts, strategy=strategy, max_num_batched_tokens=16)
    assert any(o.num_prefill_tokens and o.num_decode_tokens for o in iterations), "no mixed iteration"
    assert any(s.is_prefill and not s.samples_token for o in iterations for s in o.scheduled), "no chunked prompt"
    assert max(o.num_running for o in iterations) > 3
    assert_solo_equal(requests, prompts, result)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_a_tiny_pool_matches_solo_decoding(mode):
    requests, prompts = mixed_requests()
    # 24 blocks of 4 tokens: about three requests at their peak, so growing decodes preempt.
    result, _ = run_engine(requests, prompts, num_blocks=24, preemption_mode=mode, watermark=0.0)
    assert sum(record.preemptions for record in result.records) > 0
    assert_solo_equal(requests, prompts, result)


def test_prefix_hits_match_solo_decoding():
    requests, prompts = mixed_requests(prefix_len=8)
    result, _ = run_engine(requests, prompts, strategy="prefix", max_num_batched_tokens=32)
    hits = [record.prefix_hit_tokens for record in result.records]
    assert sum(1 for h in hits if h) >= len(requests) - 2 and max(hits) == 8  # the 8-token prefix: two whole blocks
    assert_solo_equal(requests, prompts, result)


def test_sliding_window_on_the_paged_pool_matches_the_ring_cache():
    requests, prompts = mixed_requests()
    result, iterations = run_engine(requests, prompts, strategy="sliding", window=8, max_num_batched_tokens=16)
    # A window of 8 tokens holds at most ceil((8 + 16 - 1) / 4) + 1 = 7 blocks per request, whatever its length.
    assert max(len(s.blocks.held()[1]) for o in iterations for s in o.scheduled) <= 7
    assert_solo_equal(requests, prompts, result, cache="sliding", window=8)


@pytest.mark.parametrize(("strategy", "window"), [("contiguous", None), ("paged", None), ("sliding", 8)])
def test_eager_attention_serves_the_tokens_sdpa_serves_and_solo_decoding_gives(strategy, window, monkeypatch):
    """Issue #30 1c: attn_impl=eager in serving runs the decode batch's masked gather and every prefill chunk
    (causal, or banded for a window) through eager_attention's written-out scores; in fp32 its greedy tokens are
    SDPA serving's, exactly, and solo decoding's."""
    requests, prompts = mixed_requests()
    sdpa, _ = run_engine(requests, prompts, strategy=strategy, window=window, max_num_batched_tokens=16)
    calls = []
    for module in (base, varlen):  # varlen's decode and band call it directly; a causal chunk through base.attention
        monkeypatch.setattr(module, "eager_attention", lambda *a, _f=module.eager_attention, **k: calls.append(1)
                            or _f(*a, **k))  # fmt: skip
    eager, iterations = run_engine(requests, prompts, strategy=strategy, window=window, attn_impl="eager",
                                   max_num_batched_tokens=16)  # fmt: skip
    assert any(o.num_prefill_tokens and o.num_decode_tokens for o in iterations), "no mixed iteration"
    # per layer, one call for an iteration's decode batch (its one-token entries) and one per longer chunk
    readings = [any(s.num_new_tokens == 1 for s in o.scheduled) + sum(s.num_new_tokens > 1 for s in o.scheduled)
                for o in iterations]  # fmt: skip
    assert len(calls) == ARGS.n_layers * sum(readings)
    assert eager.outputs == sdpa.outputs
    assert_solo_equal(requests, prompts, eager, cache="sliding" if window else "contiguous", window=window or 0)


def test_eager_attention_turns_off_a_pools_own_decode_kernel():
    """As in the static path (harness.config: eager also turns off a strategy's own decode kernels): the decode
    batch goes through the gather and eager's scores, never the pool's kernel, whatever its attn_backend says."""
    requests, prompts = mixed_requests(4)
    manager = make_kv_manager("paged", num_blocks=64, block_size=BLOCK, max_model_len=MAX_MODEL_LEN)
    scheduler = Scheduler(SchedulerConfig(max_model_len=MAX_MODEL_LEN), manager)
    cache, _ = build_cache("paged", ARGS, kv_dtype="fp32", num_blocks=64, block_size=BLOCK,
                           max_model_len=MAX_MODEL_LEN, device=CPU, attn_impl="eager")  # fmt: skip
    cache.attn_backend = "triton-paged"  # what CUDA would run for sdpa (harness.kv.paged_attend.decode_backend)
    cache._varlen_decode = lambda *args: pytest.fail("the pool's decode kernel ran under attn_impl=eager")
    result = serve(requests, prompts, scheduler=scheduler, engine=Engine(model(), cache))
    assert_solo_equal(requests, prompts, result)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_decodes_through_the_triton_kernel_match_solo_decoding(kv_dtype):
    """What CUDA runs: the decoding requests of each iteration read their blocks in place through the Triton kernel
    (lengths and padded tables on the device), here in Triton's interpreter on CPU tensors."""
    pytest.importorskip("triton", reason="triton not installed")
    requests, prompts = mixed_requests(6)
    manager = make_kv_manager("paged", num_blocks=128, block_size=BLOCK, max_model_len=MAX_MODEL_LEN)
    scheduler = Scheduler(SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16), manager)
    cache, _ = build_cache("paged", ARGS, kv_dtype=kv_dtype, num_blocks=128, block_size=BLOCK,
                           max_model_len=MAX_MODEL_LEN, device=CPU)  # fmt: skip
    cache.attn_backend = "triton-paged"  # what CUDA runs (harness.kv.paged_attend.decode_backend)
    calls = []
    kernel = cache._varlen_decode
    cache._varlen_decode = lambda *args: calls.append(1) or kernel(*args)
    result = serve(requests, prompts, scheduler=scheduler, engine=Engine(model(), cache))
    assert len(calls) > ARGS.n_layers  # every iteration with a decoding request, every layer
    for request, prompt in zip(requests, prompts, strict=True):
        expected, logits = solo_reference(tuple(prompt), request.output_len, kv_dtype=kv_dtype)
        actual = torch.tensor(result.outputs[request.request_id])
        # the same int8 codes read by another kernel: apart by rounding, within the format's tolerance (greedy.py)
        assert_same_greedy_tokens(actual[None], expected[None], logits[None], tol=LOGIT_TOL[kv_dtype])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("strategy", ["paged", "prefix", "sliding"])
def test_every_block_strategy_preempted_in_a_tiny_pool_matches_solo_decoding(strategy, mode):
    """The crossings of issue #27 items 2 and 3: a window's request swapped out and back in must read its window's
    K/V (not rows written into the blocks of its first tokens, then freed), and a prefix request's swap-in must
    restore its own blocks only. 14 blocks of 4 tokens hold two to three requests at their peak; a window of 8
    tokens holds at most 7 blocks a request (chunks of 16), so 10 blocks preempt it as often."""
    window = 8 if strategy == "sliding" else None
    num_blocks = 10 if window else 14
    requests, prompts = mixed_requests(prefix_len=8 if strategy == "prefix" else 0)
    result, iterations = run_engine(requests, prompts, strategy=strategy, num_blocks=num_blocks, window=window,
                                    preemption_mode=mode, watermark=0.0, max_num_batched_tokens=16)  # fmt: skip
    assert sum(record.preemptions for record in result.records) > 0
    if mode == "swap":
        assert any(output.swapped_in_ids for output in iterations)
    assert_solo_equal(requests, prompts, result, cache="sliding" if window else "contiguous", window=window or 0)
