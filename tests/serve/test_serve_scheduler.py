"""The serving scheduler and its KV block accounting (harness.serve.scheduler, harness.serve.kv_manager).

Torch-free and model-free: requests run on simulate()'s synthetic clock, whose step time is a function of the
tokens scheduled, so every check here is about counts (tokens, blocks, requests), never about time.
"""

from __future__ import annotations

import math

import pytest

from harness.errors import ConfigError
from harness.serve.kv_manager import KVCacheBlocks, PagedKVManager, make_kv_manager, num_blocks_for
from harness.serve.requests import Request, RequestSpec, generate
from harness.serve.scheduler import Scheduler, SchedulerConfig, simulate

BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
WINDOW = 64  # tokens, for sliding


def step_time_s(output) -> float:
    """A step costs a fixed launch plus a per-token term: enough for ordered, distinct token times."""
    return 1e-3 + 1e-5 * output.total_num_scheduled_tokens


def mixed_stream(num_prompts: int = 60, prefix_len: int = 0) -> list[Request]:
    spec = RequestSpec(
        num_prompts=num_prompts,
        qps=200.0,
        seed=1,
        prompt_len=200,
        prompt_dist="uniform",
        prompt_spread=0.7,
        output_len=40,
        output_dist="uniform",
        output_spread=0.9,
        prefix_len=prefix_len,
        max_model_len=MAX_MODEL_LEN,
    )
    return generate(spec)


def make_scheduler(strategy: str = "paged", *, num_blocks: int = 120, **config) -> Scheduler:
    kv = make_kv_manager(
        strategy,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        sliding_window=WINDOW if strategy == "sliding" else None,
    )
    config = {"max_num_batched_tokens": 256, "max_num_seqs": 16, "max_model_len": MAX_MODEL_LEN} | config
    return Scheduler(SchedulerConfig(**config), kv)


def first_admissions(iterations) -> list[int]:
    seen: list[int] = []
    for output in iterations:
        seen += [entry.request_id for entry in output.scheduled if entry.request_id not in seen]
    return seen


# --- the budgets ------------------------------------------------------------------------------------------------


def test_token_budget_and_max_num_seqs_are_never_exceeded():
    scheduler = make_scheduler(max_num_batched_tokens=128, max_num_seqs=6)
    simulation = simulate(mixed_stream(), scheduler, step_time_s)
    assert max(output.total_num_scheduled_tokens for output in simulation.iterations) == 128  # the budget binds
    for output in simulation.iterations:
        assert output.total_num_scheduled_tokens <= 128
        assert len(output.scheduled) <= 6 and output.num_running <= 6
    assert max(output.num_running for output in simulation.iterations) == 6  # the cap binds


def test_chunked_prefill_splits_a_long_prompt_into_chunks_that_sum_to_it():
    scheduler = make_scheduler(max_num_batched_tokens=128)
    simulation = simulate([Request(request_id=0, arrival_s=0.0, prompt_len=450, output_len=3)], scheduler, step_time_s)
    chunks = [output.scheduled[0] for output in simulation.iterations]
    prefill = [entry for entry in chunks if entry.is_prefill]
    assert [entry.num_new_tokens for entry in prefill] == [128, 128, 128, 66]
    assert [entry.num_computed_tokens for entry in prefill] == [0, 128, 256, 384]  # each starts where the last ended
    assert [entry.samples_token for entry in prefill] == [False, False, False, True]  # the last chunk samples
    assert [(entry.num_new_tokens, entry.is_prefill) for entry in chunks[4:]] == [(1, False), (1, False)]


def test_without_chunked_prefill_a_prompt_goes_whole():
    scheduler = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=MAX_MODEL_LEN)
    simulation = simulate(mixed_stream(num_prompts=20), scheduler, step_time_s)
    for output in simulation.iterations:
        for entry in output.scheduled:
            assert not entry.is_prefill or entry.num_computed_tokens == 0 and entry.samples_token


# --- completion and reclamation, for every strategy -------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["contiguous", "paged", "prefix", "sliding"])
def test_every_request_finishes_with_exactly_output_len_tokens(strategy):
    requests = mixed_stream(prefix_len=40)
    simulation = simulate(requests, make_scheduler(strategy, num_blocks=60), step_time_s)
    produced = {record.request_id: record.output_len for record in simulation.records}
    assert produced == {str(request.request_id): request.output_len for request in requests}


@pytest.mark.parametrize("strategy", ["contiguous", "paged", "prefix", "sliding"])
def test_every_block_returns_to_the_pool_at_the_end(strategy):
    scheduler = make_scheduler(strategy, num_blocks=60)
    simulation = simulate(mixed_stream(prefix_len=40), scheduler, step_time_s)
    assert max(output.kv.blocks_used for output in simulation.iterations) > 0
    usage = scheduler.kv.usage()
    assert (usage.blocks_used, usage.blocks_free, usage.tokens_live) == (0, 60, 0)
    assert scheduler.kv.num_free_blocks == 60
    if strategy != "contiguous":
        assert scheduler.kv.tables == {} and all(count == 0 for count in scheduler.kv.pool.ref_counts)


# --- admission --------------------------------------------------------------------------------------------------


def test_admission_order_is_arrival_order_even_under_preemption():
    scheduler = make_scheduler(num_blocks=40)  # tight: preemptions happen
    simulation = simulate(mixed_stream(), scheduler, step_time_s)
    assert sum(record.preemptions for record in simulation.records) > 0
    assert first_admissions(simulation.iterations) == list(range(60))


def test_a_head_of_line_request_that_does_not_fit_blocks_those_behind_it():
    scheduler = make_scheduler(num_blocks=12, watermark=0.0, max_num_batched_tokens=512)
    scheduler.add_request(Request(request_id=0, arrival_s=0.0, prompt_len=120, output_len=8))  # 8 blocks
    scheduler.add_request(Request(request_id=1, arrival_s=0.0, prompt_len=100, output_len=8))  # 7: does not fit
    scheduler.add_request(Request(request_id=2, arrival_s=0.0, prompt_len=10, output_len=8))  # 1: would fit
    output = scheduler.schedule(now_s=0.0)
    assert [entry.request_id for entry in output.scheduled] == [0]
    assert output.num_waiting == 2


def test_the_watermark_keeps_free_blocks_at_admission():
    requests = [Request(request_id=i, arrival_s=0.0, prompt_len=64, output_len=100) for i in range(6)]  # 4 blocks
    admitted = {}
    for watermark in (0.0, 0.25):  # 0.25 of 20 blocks: 5 kept free
        scheduler = make_scheduler(num_blocks=20, watermark=watermark, max_num_batched_tokens=512)
        for request in requests:
            scheduler.add_request(request)
        output = scheduler.schedule(now_s=0.0)
        admitted[watermark] = output.num_running
        assert output.kv.blocks_free >= scheduler.watermark_blocks
    assert admitted == {0.0: 5, 0.25: 3}


# --- preemption -------------------------------------------------------------------------------------------------


def test_a_tiny_pool_preempts_the_last_admitted_by_recompute():
    """6 blocks of 4 tokens; two requests of 8 + 10 tokens each need 5 blocks at their peak: they share the pool
    until both hold 3 blocks, then the first one's next block preempts the second."""
    kv = PagedKVManager(num_blocks=6, block_size=4)
    config = SchedulerConfig(max_num_batched_tokens=64, watermark=0.0, max_model_len=64)
    scheduler = Scheduler(config, kv)
    for request_id in (0, 1):
        scheduler.add_request(Request(request_id=request_id, arrival_s=0.0, prompt_len=8, output_len=10))
    now_s, preempted_at = 0.0, None
    records = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule(now_s)
        if output.preempted_ids and preempted_at is None:
            preempted_at = now_s
            assert output.preempted_ids == (1,)  # the most recently admitted, not the one asking
            assert [entry.request_id for entry in output.scheduled] == [0]
            victim = scheduler.waiting[0]  # at the front of the queue
            assert victim.request.request_id == 1 and victim.num_computed_tokens == 0
            assert victim.num_output_tokens > 0 and kv.get_blocks(1).get_block_ids() == ()
            outputs_before = victim.num_output_tokens
        elif preempted_at is not None and 1 in [entry.request_id for entry in output.scheduled]:
            resumed = next(entry for entry in output.scheduled if entry.request_id == 1)
            if resumed.num_computed_tokens == 0:  # its first chunk after preemption: prompt plus outputs, again
                assert resumed.num_new_tokens == 8 + outputs_before and resumed.is_prefill
        now_s += 1.0
        records += scheduler.update(output, now_s)
    assert preempted_at is not None
    by_id = {record.request_id: record for record in records}
    assert (by_id["0"].preemptions, by_id["1"].preemptions) == (0, 1)
    assert by_id["1"].output_len == 10 and kv.num_free_blocks == 6


def test_swap_keeps_the_computed_tokens_and_names_the_request_out_and_back_in():
    kv = PagedKVManager(num_blocks=6, block_size=4)
    config = SchedulerConfig(max_num_batched_tokens=64, watermark=0.0, max_model_len=64, preemption_mode="swap")
    scheduler = Scheduler(config, kv)
    for request_id in (0, 1):
        scheduler.add_request(Request(request_id=request_id, arrival_s=0.0, prompt_len=8, output_len=10))
    simulation = simulate([], scheduler, step_time_s)
    out = next(output for output in simulation.iterations if output.swapped_out_ids)
    back = next(output for output in simulation.iterations if output.swapped_in_ids)
    assert out.swapped_out_ids == out.preempted_ids == (1,) and back.swapped_in_ids == (1,)
    resumed = next(entry for entry in back.scheduled if entry.request_id == 1)
    assert resumed.num_computed_tokens > 0 and resumed.num_new_tokens == 1  # K/V copied back, not recomputed
    assert {record.output_len for record in simulation.records} == {10}


def swap_stream(strategy: str, *, num_blocks: int) -> list:
    """Three requests of 12 + 20 tokens in a pool of 4-token blocks too small for all: swapped out and back in."""
    kv = PagedKVManager(num_blocks=num_blocks, block_size=4, sliding_window=8 if strategy == "sliding" else None,
                        prefix_caching=strategy == "prefix")  # fmt: skip
    config = SchedulerConfig(max_num_batched_tokens=64, watermark=0.0, max_model_len=64, preemption_mode="swap")
    scheduler = Scheduler(config, kv)
    for request_id in range(3):
        scheduler.add_request(Request(request_id=request_id, arrival_s=0.0, prompt_len=12, output_len=20,
                                      prefix_len=8 if strategy == "prefix" else 0))  # fmt: skip
    simulation = simulate([], scheduler, step_time_s)
    assert {record.output_len for record in simulation.records} == {20}
    return simulation.iterations


def test_a_window_swapped_back_in_takes_only_its_window_and_is_refilled_in_place():
    """Issue #27 item 2: the readmitted table starts at the window's first kept block (8-token window, 4-token
    blocks: the query at position c reads keys from c - 7), and the host rows go back under their logical index."""
    saved: dict[int, set[int]] = {}
    readmissions = 0
    for output in swap_stream("sliding", num_blocks=8):
        for swap in output.swap_out:
            saved[swap.request_id] = set(swap.logical)
        for swap in output.swap_in:
            entry = next(entry for entry in output.scheduled if entry.request_id == swap.request_id)
            first_kept = (entry.num_computed_tokens - 8 + 1) // 4
            held = math.ceil(entry.num_computed_tokens / 4)
            assert first_kept > 0, "the window had not slid yet: a weaker case"
            assert all(block is None for block in entry.blocks.get_block_ids()[:first_kept])
            assert all(block is not None for block in entry.blocks.get_block_ids()[first_kept:])
            assert swap.logical == tuple(range(first_kept, held))  # every held block of the window, in place
            assert set(swap.logical) <= saved[swap.request_id]
            assert swap.blocks == entry.blocks.get_block_ids()[first_kept:held]
            readmissions += 1
    assert readmissions >= 2


def test_a_prefix_request_swapped_back_in_restores_only_the_blocks_it_owns():
    """Issue #27 item 3: its prefix blocks, found cached and held by others too, are not written from the host."""
    shared_hits = 0
    for output in swap_stream("prefix", num_blocks=9):
        for swap in output.swap_in:
            entry = next(entry for entry in output.scheduled if entry.request_id == swap.request_id)
            others = {
                block for e in output.scheduled if e.request_id != swap.request_id for block in e.blocks.get_block_ids()
            }
            assert not set(swap.blocks) & others, f"swap-in writes blocks others hold: {set(swap.blocks) & others}"
            prefix_blocks = set(entry.blocks.get_block_ids()[:2])  # the 8-token prefix: two whole blocks
            assert not set(swap.blocks) & prefix_blocks
            shared_hits += bool(prefix_blocks & others)
            held = math.ceil(entry.num_computed_tokens / 4)
            assert swap.logical == tuple(range(2, held))  # all the rest it had computed
    assert shared_hits >= 1, "no readmission shared its prefix with a running request: a weaker case"


# --- strategies at one budget -----------------------------------------------------------------------------------


def test_contiguous_fits_fewer_concurrent_requests_than_paged_at_the_same_budget():
    running = {}
    for strategy in ("contiguous", "paged"):
        simulation = simulate(mixed_stream(), make_scheduler(strategy, num_blocks=96), step_time_s)
        running[strategy] = max(output.num_running for output in simulation.iterations)
    assert running["contiguous"] == 96 * BLOCK_SIZE // MAX_MODEL_LEN  # 3 slots of max_model_len
    assert running["paged"] > 2 * running["contiguous"]


def test_prefix_hits_are_the_whole_prefix_blocks_for_every_request_after_the_first():
    requests = [Request(request_id=i, arrival_s=0.0, prompt_len=100, output_len=5, prefix_len=40) for i in range(5)]
    scheduler = make_scheduler("prefix", max_num_batched_tokens=1024)
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule(now_s=0.0)
    assert [entry.num_computed_tokens for entry in output.scheduled] == [0, 32, 32, 32, 32]  # 2 whole blocks of 40
    shared = {entry.blocks.get_block_ids()[:2] for entry in output.scheduled}
    assert len(shared) == 1  # one physical copy of the prefix blocks
    private_blocks = sum(len(entry.blocks.get_block_ids()) - 2 for entry in output.scheduled)
    assert output.kv.blocks_used == 2 + private_blocks  # counted once
    assert output.kv.tokens_live == 32 + 5 * (100 - 32)
    now_s, records = 1.0, scheduler.update(output, now_s=1.0)
    while scheduler.has_unfinished_requests():
        now_s += 1.0
        records += scheduler.update(scheduler.schedule(now_s - 1.0), now_s=now_s)
    hits = {record.request_id: record.prefix_hit_tokens for record in records}
    assert hits == {"0": 0, "1": 32, "2": 32, "3": 32, "4": 32}


def test_an_allocation_hands_back_the_requests_blocks_counting_those_it_took_new():
    """The manager's answer is a KVCacheBlocks value (vLLM v1's), not its table: prefix hits first, new blocks last."""
    kv = PagedKVManager(num_blocks=6, block_size=4, prefix_caching=True)
    kv.allocate(Request(request_id=0, arrival_s=0.0, prompt_len=9, output_len=1, prefix_len=8), 9)
    second = Request(request_id=1, arrival_s=0.0, prompt_len=9, output_len=1, prefix_len=8)
    blocks = kv.allocate(second, 9, num_computed_tokens=kv.cached_prefix_tokens(second, 9))
    assert blocks.get_block_ids()[:2] == kv.get_blocks(0).get_block_ids()[:2]  # the two prefix blocks, shared
    assert blocks.num_new == 1 and blocks.new_block_ids == blocks.get_block_ids()[2:]
    assert kv.get_blocks(1) == KVCacheBlocks(blocks.get_block_ids())  # a look-up: the same table, nothing new


def test_prefix_blocks_stay_cached_unreferenced_and_are_evicted_when_the_pool_needs_them():
    kv = PagedKVManager(num_blocks=4, block_size=4, prefix_caching=True)
    first = Request(request_id=0, arrival_s=0.0, prompt_len=9, output_len=1, prefix_len=8)
    kv.allocate(first, 9)  # 3 blocks, the first 2 cached
    kv.free(0)
    assert (kv.num_free_blocks, kv.usage().blocks_cached) == (4, 2)  # free, yet still cached
    second = Request(request_id=1, arrival_s=0.0, prompt_len=9, output_len=1, prefix_len=8)
    assert kv.cached_prefix_tokens(second, 9) == 8  # a hit after the first left
    other = Request(request_id=2, arrival_s=0.0, prompt_len=16, output_len=1)
    kv.allocate(other, 16)  # the whole pool: the cached blocks are evicted
    assert kv.pool.num_evictions == 2 and kv.usage().blocks_cached == 0
    kv.free(2)
    assert kv.cached_prefix_tokens(second, 9) == 0


def test_sliding_holds_a_bounded_number_of_blocks_per_request():
    scheduler = make_scheduler("sliding", num_blocks=60, max_num_batched_tokens=128)
    requests = [Request(request_id=i, arrival_s=0.0, prompt_len=300, output_len=150) for i in range(4)]
    simulation = simulate(requests, scheduler, step_time_s)
    decode_bound = math.ceil(WINDOW / BLOCK_SIZE) + 1  # 5 blocks, where paged would hold up to 29
    held_at_decode = []
    for output in simulation.iterations:
        for entry in output.scheduled:
            held = sum(block is not None for block in entry.blocks.get_block_ids())
            if entry.is_prefill:
                assert held <= math.ceil((WINDOW + entry.num_new_tokens - 1) / BLOCK_SIZE) + 1
            else:
                assert held <= decode_bound
                held_at_decode.append(held)
    assert max(held_at_decode) == decode_bound
    assert {record.output_len for record in simulation.records} == {150}


# --- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", -1),
        ("max_model_len", 1.5),
        ("enable_chunked_prefill", "yes"),
        ("watermark", 1.0),
        ("preemption_mode", "discard"),
    ],
)
def test_a_bad_config_value_is_one_line_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"^{field}: ") as error:
        SchedulerConfig(**{field: value})
    assert "\n" not in str(error.value)


def test_no_chunked_prefill_needs_a_budget_of_max_model_len():
    with pytest.raises(ConfigError, match=r"^max_num_batched_tokens: .*max_model_len=4096"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=2048)


@pytest.mark.parametrize("strategy", ["contiguous", "paged", "prefix", "sliding"])
def test_a_request_too_big_for_the_pool_is_refused_in_one_line(strategy):
    scheduler = make_scheduler(strategy, num_blocks=8)  # 128 tokens
    too_big = Request(request_id=7, arrival_s=0.0, prompt_len=400, output_len=50)
    with pytest.raises(ConfigError, match=r"^request 7: a budget too small for one request") as error:
        scheduler.add_request(too_big)
    assert "\n" not in str(error.value)


def test_a_request_over_max_model_len_is_refused():
    with pytest.raises(ConfigError, match=r"^request 3: .*exceeds max_model_len=512"):
        make_scheduler().add_request(Request(request_id=3, arrival_s=0.0, prompt_len=500, output_len=13))


def test_num_blocks_for_divides_the_budget_into_whole_blocks():
    assert num_blocks_for(kv_budget_bytes=10_000, bytes_per_block=3_000) == 3
    with pytest.raises(ConfigError, match=r"^bytes_per_block: "):
        num_blocks_for(kv_budget_bytes=10_000, bytes_per_block=0)
