"""cache=evict served (issue #30 item 1b): each request holds at most `budget` tokens of a paged pool
(harness.kv.evict_paged over harness.serve.evict_manager's capped tables).

- A budget above every request's length evicts nothing: fp32 tokens equal solo decoding, as paged's do.
- A small budget: one request's tokens equal the static EvictCache's for it where the algorithms coincide (its prompt
  in one chunk: knorm, random and h2o), and differ from exact decoding (it is lossy).
- The pool: no request ever holds more than ceil(budget / block_size) blocks, so more requests run at once than paged
  at the same number of blocks; preemption by recompute and by swap in a small pool; bad input is one line.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from harness import kv
from harness.errors import ConfigError
from harness.kv.base import CacheSpec
from harness.serve import run as app
from harness.serve.engine import Engine, build_cache, serve
from harness.serve.kv_manager import blocks_for, make_kv_manager
from harness.serve.requests import Request
from harness.serve.scheduler import Scheduler, SchedulerConfig
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens, greedy_with_logits
from tests.serve.test_serve_engine import (
    ARGS,
    BLOCK,
    CPU,
    MAX_MODEL_LEN,
    mixed_requests,
    model,
    run_engine,
    solo_reference,
)

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
def static_evict(prompt: tuple[int, ...], output_len: int, policy: str, budget: int = BUDGET, window: int = WINDOW,
                 kv_dtype: str = "fp32"):  # fmt: skip
    """(tokens, logits) of the prompt decoded alone through the static EvictCache (batch 1)."""
    spec = CacheSpec.for_model(ARGS, batch_size=1, max_tokens=len(prompt) + output_len, kv_dtype=kv_dtype, device=CPU)
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
    requests, prompts = mixed_requests(4, seed=3)
    lossy = 0
    for request, prompt in zip(requests, prompts, strict=True):
        assert request.prompt_len > BUDGET  # the prompt itself is evicted at prefill
        result, _ = run_evict([request], [prompt], policy=policy)  # prompt in one chunk (2048 tokens an iteration)
        expected, logits = static_evict(tuple(prompt), request.output_len, policy)
        actual = torch.tensor(result.outputs[request.request_id])
        assert_same_greedy_tokens(actual[None], expected[None], logits[None], tol=LOGIT_TOL["fp32"])
        lossy += not torch.equal(actual, solo_reference(tuple(prompt), request.output_len)[0])
    assert lossy >= len(requests) // 2, "a budget of 12 tokens left most requests' tokens exact"


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_narrow_format_evicts_its_tokens_scale_and_all_as_the_static_cache_does(kv_dtype):
    """A kept token's rows move with it, data and per-token scale (fp8 moved as its bytes)."""
    requests, prompts = mixed_requests(3, seed=3)
    for request, prompt in zip(requests, prompts, strict=True):
        result, _ = run_evict([request], [prompt], policy="random", kv_dtype=kv_dtype)
        expected, logits = static_evict(tuple(prompt), request.output_len, "random", kv_dtype=kv_dtype)
        actual = torch.tensor(result.outputs[request.request_id])
        assert_same_greedy_tokens(actual[None], expected[None], logits[None], tol=LOGIT_TOL[kv_dtype])


@pytest.mark.parametrize("decodes", [False, True])
def test_a_prompt_chunked_past_its_budget_keeps_the_positions_the_static_cache_keeps(decodes):
    """random's scores are a hash of (layer, head, position): whatever attention saw, the tokens kept are a function
    of positions alone, so chunks of 8 tokens that evict between them, then decode steps that evict one by one, must
    end holding, per layer and head, exactly the positions the static cache holds after the prompt in one piece."""
    requests, prompts = mixed_requests(3, seed=3)
    request, prompt = max(zip(requests, prompts, strict=True), key=lambda pair: pair[0].prompt_len)
    request = request if decodes else dataclasses.replace(request, output_len=1)  # 1: what the chunks kept
    manager = make_kv_manager("evict", num_blocks=16, block_size=BLOCK, max_model_len=MAX_MODEL_LEN, budget=BUDGET)
    scheduler = Scheduler(SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=8), manager)
    options = {"policy": "random", "budget": BUDGET, "window": WINDOW}
    cache, _ = build_cache("evict", ARGS, kv_dtype="fp32", num_blocks=16, block_size=BLOCK,
                           max_model_len=MAX_MODEL_LEN, device=CPU, options=options)  # fmt: skip
    iterations = []
    serve([request], [prompt], scheduler=scheduler, engine=Engine(model(), cache),
          on_iteration=lambda i, output, *_: iterations.append(output))  # fmt: skip
    assert sum(1 for output in iterations if output.num_prefill_tokens) >= 4  # a prompt of 30+ tokens, 8 at a time
    table = list(iterations[-1].scheduled[0].blocks.table)  # freed at its finish, not overwritten: it was alone
    held = cache.rows["positions"][:, table].transpose(2, 3).reshape(ARGS.n_layers, -1, ARGS.n_kv_heads)[:, :BUDGET]
    spec = CacheSpec.for_model(ARGS, batch_size=1, max_tokens=request.prompt_len + request.output_len,
                               kv_dtype="fp32", device=CPU)  # fmt: skip
    static = kv.build("evict", spec, options)
    greedy_with_logits(model(), static, torch.tensor([prompt]), request.output_len)
    assert torch.equal(held.sort(dim=1).values, static.positions[:, 0].transpose(1, 2).sort(dim=1).values)


def most_blocks_held(iterations) -> int:
    """The most blocks any one request held, over the run (the manager's tables, as each iteration scheduled them)."""
    return max(len(s.blocks.held()[1]) for output in iterations for s in output.scheduled)


def test_no_request_holds_more_than_its_budgets_blocks_so_more_run_at_once_than_paged():
    requests, prompts = mixed_requests()
    result, iterations = run_evict(requests, prompts, num_blocks=40, watermark=0.0, max_num_batched_tokens=64)
    cap = blocks_for(BUDGET, BLOCK)  # 3 blocks of 4 tokens, where these requests reach up to 14 as paged
    assert most_blocks_held(iterations) == cap
    assert max(output.kv.tokens_live for output in iterations) <= BUDGET * max(o.num_running for o in iterations)
    paged, paged_iterations = run_engine(requests, prompts, num_blocks=40, watermark=0.0, max_num_batched_tokens=64)
    assert most_blocks_held(paged_iterations) > 2 * cap
    evict_running = max(output.num_running for output in iterations)
    assert evict_running == len(requests) > max(output.num_running for output in paged_iterations)
    assert sum(record.preemptions for record in result.records) == 0 < sum(r.preemptions for r in paged.records)


def test_the_managers_peak_and_admission_blocks_are_what_its_requests_hold():
    manager = make_kv_manager("evict", num_blocks=64, block_size=BLOCK, max_model_len=MAX_MODEL_LEN, budget=BUDGET)
    assert [manager.peak_blocks(n, max_chunk_tokens=8) for n in (1, 4, 5, 12, 13, 90)] == [1, 1, 2, 3, 3, 3]
    assert [manager.admission_blocks(n, max_chunk_tokens=8) for n in (3, 8, 30)] == [1, 2, 2]  # its first chunk's
    assert manager.admission_blocks(30, max_chunk_tokens=2048) == 3  # the whole prompt, capped at the budget
    request = Request(request_id=0, arrival_s=0.0, prompt_len=30, output_len=8)
    assert manager.allocate(request, 8).num_new == manager.admission_blocks(30, max_chunk_tokens=8)
    assert manager.allocate(request, 30).num_new == 1 and manager.allocate(request, 37).num_new == 0
    assert len(manager.get_blocks(0).table) == manager.peak_blocks(37, max_chunk_tokens=8) == 3
    assert manager.usage().tokens_live == BUDGET and manager.num_free_blocks == 61
    manager.free(0)
    assert manager.num_free_blocks == 64


def test_swapped_out_requests_come_back_with_their_held_tokens_and_scores():
    """Swap copies every part of a block, the positions and scores side tables too: h2o's accumulated attention
    comes back as it left, so each request's tokens are still the static cache's for it alone."""
    requests, prompts = mixed_requests(6)
    # A budget of 24 tokens (6 blocks) over prompts of 10..38: requests admitted below it grow into it, and 16
    # blocks hold under three at their cap, so growing decodes preempt.
    result, iterations = run_evict(requests, prompts, num_blocks=16, policy="h2o", budget=24, preemption_mode="swap",
                                   watermark=0.0)  # fmt: skip
    assert any(output.swapped_in_ids for output in iterations)
    assert most_blocks_held(iterations) == blocks_for(24, BLOCK)
    for request, prompt in zip(requests, prompts, strict=True):
        expected, logits = static_evict(tuple(prompt), request.output_len, "h2o", budget=24)
        actual = torch.tensor(result.outputs[request.request_id])
        assert_same_greedy_tokens(actual[None], expected[None], logits[None], tol=LOGIT_TOL["fp32"])


def test_preemption_by_recompute_in_a_small_pool_is_deterministic_and_stays_capped():
    """A recomputed request re-prefills its prompt and outputs, attending exactly over all of them before keeping
    its budget (prefill's rule), so its later tokens are not the unpreempted run's; they are the same on every run."""
    requests, prompts = mixed_requests(6)
    runs = [run_evict(requests, prompts, num_blocks=16, policy="random", budget=24, watermark=0.0) for _ in range(2)]
    (first, iterations), (second, _) = runs
    assert sum(record.preemptions for record in first.records) > 0
    assert most_blocks_held(iterations) == blocks_for(24, BLOCK)
    assert first.outputs == second.outputs
    assert all(len(first.outputs[r.request_id]) == r.output_len for r in requests)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"policy": "snapkv"}, "^cache.policy: snapkv does not serve .*; allowed: h2o, knorm, random$"),
        ({"policy": "knorm", "budget": 8, "window": 16}, "^cache.window: must be in 0..cache.budget-1=7, got 16$"),
    ],
)
def test_what_serving_cannot_run_is_one_line_naming_the_option(options, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        build_cache("evict", ARGS, kv_dtype="fp32", num_blocks=8, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                    device=CPU, options=options)  # fmt: skip


STREAM = ["kv_memory_gb=0.0002", "num_prompts=12", "prompt_len=48", "output_len=16", "max_num_batched_tokens=256"]


@pytest.mark.slow  # a spawned command line and a second run: ~15 s on 2 cores
def test_experiments_serve_runs_evict_end_to_end_and_its_row_says_policy_budget_and_window(tmp_path):
    """The command line a user runs: cache.* options reach the pool, and the same bytes hold every request at once
    where paged holds under half of them at their peak (26 blocks of 16 tokens; 4 blocks a request as paged, 1 as
    evict with a budget of 16)."""
    from harness.serve.rows import load_run, serve_run_dir
    from tests.serve.test_serve_experiment import TINY, cli, config

    evict = ["strategy=evict", "cache.policy=knorm", "cache.budget=16", "cache.window=4"]
    result = cli(tmp_path, *TINY, *STREAM, *evict, "run_id=evict")
    assert result.returncode == 0, result.stderr[-2000:]
    requests, iterations, row = load_run(serve_run_dir(tmp_path, "evict"))
    assert (row["strategy"], row["policy"], row["budget"], row["obs_window"]) == ("evict", "knorm", 16, 4)
    assert row["completed"] == 12 and row["max_running_requests"] == 12 and row["total_preemptions"] == 0
    assert json.loads(row["config_json"])["cache"] == {"policy": "knorm", "budget": 16, "window": 4}
    assert iterations["kv_used_blocks"].max() == 12  # one block a request, the budget's
    paged = app.plan(config(*TINY, *STREAM, "strategy=paged"))
    paged_row = app.run(paged, run_dir=serve_run_dir(tmp_path, "paged"), sweep_id="s")
    assert paged_row["num_blocks"] == row["num_blocks"] and paged_row["policy"] is None
    assert paged_row["max_running_requests"] < row["max_running_requests"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=evict"], "^cache.policy: snapkv does not serve .*; allowed: h2o, knorm, random$"),
        (
            ["strategy=evict", "cache.policy=h2o", "cache.budget=8", "cache.window=16"],
            "^cache.window: must be in 0..cache.budget-1=7, got 16$",
        ),  # fmt: skip
        (
            ["strategy=evict", "cache.policy=lru"],
            "^cache.policy: must be one of h2o, snapkv, knorm, random, got 'lru'$",
        ),
        (
            ["strategy=evict", "+cache.obs=3"],
            "^cache.obs: not an option of cache 'evict'; allowed: policy, budget, win",
        ),
        (["strategy=paged", "cache.policy=knorm"], "^cache.policy: only strategy=evict takes options in a serving run"),
    ],
)
def test_bad_evict_input_on_the_command_line_is_one_config_error_before_any_work(overrides, message):
    from tests.serve.test_serve_experiment import TINY, config

    with pytest.raises(ConfigError, match=message):
        app.plan(config(*TINY, "kv_memory_gb=0.01", *overrides))
