"""cache=evict served (issue #30 item 1b): each request holds at most `budget` tokens of a paged pool
(harness.kv.evict_paged over harness.serve.evict_manager's capped tables).

- A budget above every request's length evicts nothing: fp32 tokens equal solo decoding, as paged's do.
- A small budget: one request's tokens equal the static EvictCache's for it where the algorithms coincide (its prompt
  in one chunk: knorm, random and h2o), and differ from exact decoding (it is lossy).
- The pool: no request ever holds more than ceil(budget / block_size) blocks, so more requests run at once than paged
  at the same number of blocks; preemption by recompute and by swap in a small pool; bad input is one line.
"""

from __future__ import annotations

import functools

import pytest
import torch

from harness import kv
from harness.errors import ConfigError
from harness.kv.base import CacheSpec
from harness.serve.engine import Engine, build_cache, serve
from harness.serve.kv_manager import blocks_for, make_kv_manager
from harness.serve.requests import Request
from harness.serve.scheduler import Scheduler, SchedulerConfig
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens, greedy_with_logits
from tests.serve.test_serve_engine import ARGS, BLOCK, CPU, MAX_MODEL_LEN, mixed_requests, model, solo_reference

BUDGET, WINDOW = 12, 4  # tokens held per request, layer and KV head; of them the most recent always kept


def run_evict(requests, prompts, *, num_blocks=256, policy="knorm", budget=BUDGET, window=WINDOW, kv_dtype="fp32",
              **knobs):  # fmt: skip
    options = {"policy": policy, "budget": budget, "window": window}
    manager = make_kv_manager("evict", num_blocks=num_blocks, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                              budget=budget)  # fmt: skip
    scheduler = Scheduler(SchedulerConfig(max_model_len=MAX_MODEL_LEN, **knobs), manager)
    cache, num_slots = build_cache("evict", ARGS, kv_dtype=kv_dtype, num_blocks=num_blocks, block_size=BLOCK,
                                   max_model_len=MAX_MODEL_LEN, device=CPU, options=options)  # fmt: skip
    iterations = []
    result = serve(requests, prompts, scheduler=scheduler, engine=Engine(model(), cache, num_slots=num_slots),
                   on_iteration=lambda i, output, *_: iterations.append(output))  # fmt: skip
    assert sorted(result.outputs) == [r.request_id for r in requests]
    return result, iterations


@functools.cache
def static_evict(prompt: tuple[int, ...], output_len: int, policy: str, budget: int = BUDGET, window: int = WINDOW):
    """(tokens, logits) of the prompt decoded alone through the static EvictCache (batch 1)."""
    spec = CacheSpec.for_model(ARGS, batch_size=1, max_tokens=len(prompt) + output_len, kv_dtype="fp32", device=CPU)
    cache = kv.build("evict", spec, {"policy": policy, "budget": budget, "window": window})
    tokens, logits = greedy_with_logits(model(), cache, torch.tensor([prompt]), output_len)
    return tokens[0], logits[0]


@pytest.mark.parametrize("policy", ["knorm", "random", "h2o"])
def test_a_budget_above_every_length_serves_exactly_as_solo_decoding(policy):
    requests, prompts = mixed_requests()
    result, iterations = run_evict(requests, prompts, policy=policy, budget=MAX_MODEL_LEN, max_num_batched_tokens=16)
    assert any(s.is_prefill and not s.samples_token for o in iterations for s in o.scheduled), "no chunked prompt"
    for request, prompt in zip(requests, prompts, strict=True):
        expected, logits = solo_reference(tuple(prompt), request.output_len)
        actual = torch.tensor(result.outputs[request.request_id])
        assert_same_greedy_tokens(actual[None], expected[None], logits[None], tol=LOGIT_TOL["fp32"])


@pytest.mark.parametrize("policy", ["knorm", "random", "h2o"])
def test_one_request_past_its_budget_serves_the_static_caches_tokens_and_not_exact_ones(policy):
    requests, prompts = mixed_requests(6, seed=3)
    lossy = 0
    for request, prompt in zip(requests, prompts, strict=True):
        assert request.prompt_len > BUDGET  # the prompt itself is evicted at prefill
        result, _ = run_evict([request], [prompt], policy=policy)  # prompt in one chunk (2048 tokens an iteration)
        expected, logits = static_evict(tuple(prompt), request.output_len, policy)
        actual = torch.tensor(result.outputs[request.request_id])
        assert_same_greedy_tokens(actual[None], expected[None], logits[None], tol=LOGIT_TOL["fp32"])
        lossy += not torch.equal(actual, solo_reference(tuple(prompt), request.output_len)[0])
    assert lossy >= len(requests) // 2, "a budget of 12 tokens left most requests' tokens exact"
