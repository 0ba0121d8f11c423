"""The planner's concurrency through the serving KV manager (harness.serve.concurrency, issue #30 item 1d), and the
serving budget of attn_impl=eager (item 1c).

A strategy whose Serving declares caps_blocks (sliding) is predicted from what its serving manager says a request
takes (KVManager.admission_blocks, peak_blocks), any manager that answers the protocol; every other strategy keeps
its layout's figure, a manager given or not. Expected figures are closed forms of the shapes, as in
test_serve_budget.py: the "small" preset's bf16 token is 2 × 12 × 4 × 64 × 2 = 12,288 bytes of K and V.
"""

from __future__ import annotations

import math

import pytest

from harness import kv
from harness.analytic.runtime import GiB
from harness.config import Workload
from harness.kv.serve_mode import Serving
from harness.modeling.model_args import ModelArgs
from harness.serve.budget import kv_budget
from harness.serve.concurrency import predict_concurrency
from harness.serve.kv_manager import blocks_for, make_kv_manager
from harness.serve.requests import Request
from harness.serve.scheduler import Scheduler, SchedulerConfig

SMALL = ModelArgs.from_name("small")
BLOCK = 16
BUDGET = 2 * GiB
NUM_BLOCKS = BUDGET // (BLOCK * 12_288)  # 10,922 blocks of bf16
RESERVE = int(0.01 * NUM_BLOCKS)  # vLLM's watermark


def workload(cache: str = "paged", **fields) -> Workload:
    options = {"block_size": BLOCK} if cache in ("paged", "prefix") else {}
    return Workload(model="small", cache={"name": cache, **options}, dtype="bf16", kv_dtype="bf16", **fields)


def mix(n: int, *, prompt_len: int, output_len: int, prefix_len: int = 0) -> list[Request]:
    return [Request(i, 0.0, prompt_len, output_len, prefix_len) for i in range(n)]


def manager(strategy: str, *, window: int | None = None, num_blocks: int = NUM_BLOCKS):
    return make_kv_manager(strategy, num_blocks=num_blocks, block_size=BLOCK, max_model_len=2048,
                           sliding_window=window)  # fmt: skip


def predict(w: Workload, requests: list[Request], **knobs):
    knobs = {"kv_budget_bytes": BUDGET, "max_model_len": 2048, "max_num_seqs": 10_000} | knobs
    return predict_concurrency(w, requests, **knobs)


def first_refused(admitted: int, held: int) -> int:
    """The first k (from 0) whose admission does not fit: held·k + admitted > num_blocks − watermark."""
    return (NUM_BLOCKS - RESERVE - admitted) // held + 1


def test_a_window_is_predicted_by_its_serving_manager_as_its_decodes_shrink_to_the_window():
    # prompt 500 + output 300, window 256: admitted on its first chunk's ceil(500 / 16) = 32 blocks, then holds
    # ceil(256 / 16) + 1 = 17 while decoding: each admission after the first finds the earlier ones at 17
    requests = mix(5000, prompt_len=500, output_len=300)
    predicted = predict(workload("sliding"), requests, kv_manager=manager("sliding", window=256))
    assert (predicted.unit, predicted.num_units) == ("block", NUM_BLOCKS)
    assert predicted.predicted_max_running == first_refused(admitted=32, held=17) == 635
    # its peak, computing up to 2048 tokens at once, is its whole 799 tokens' 50 blocks: never a preemption
    assert predicted.predicted_max_running_at_peak == NUM_BLOCKS // 50
    ring = predict(workload("sliding"), requests)
    assert ring.unit == "slot"  # without its manager: the static layout's ring per request, as before


def test_a_window_longer_than_the_requests_is_predicted_as_paged():
    requests = mix(5000, prompt_len=500, output_len=300)
    sliding = predict(workload("sliding"), requests, kv_manager=manager("sliding", window=1024))
    paged = predict(workload("paged"), requests)
    assert sliding.predicted_max_running == paged.predicted_max_running == (NUM_BLOCKS - RESERVE) // 32


def test_a_window_predicted_within_its_closed_form_for_a_mix():
    # mixed prompts: each admission finds those before it at min(admitted, 17)
    prompts = [100, 500, 300, 900, 50] * 400
    requests = [Request(i, 0.0, p, 100) for i, p in enumerate(prompts)]
    predicted = predict(workload("sliding"), requests, kv_manager=manager("sliding", window=256))
    held = [min(math.ceil(p / BLOCK), 17) for p in prompts]
    admitted = [math.ceil(p / BLOCK) for p in prompts]
    k = next(k for k in range(len(prompts)) if sum(held[:k]) + admitted[k] > NUM_BLOCKS - RESERVE)
    assert predicted.predicted_max_running == k


class CappedManager:
    """A serving manager known only by the protocol: a request holds at most `cap` blocks (an eviction budget)."""

    def __init__(self, *, num_blocks: int, cap: int) -> None:
        self.num_blocks, self.block_size, self.cap = num_blocks, BLOCK, cap

    def admission_blocks(self, prompt_len: int, *, max_chunk_tokens: int) -> int:
        return blocks_for(min(prompt_len, max_chunk_tokens), BLOCK)

    def peak_blocks(self, num_tokens: int, *, max_chunk_tokens: int) -> int:
        return min(blocks_for(num_tokens, BLOCK), self.cap)


def test_any_manager_answering_the_protocol_is_asked_for_what_a_request_takes():
    requests = mix(5000, prompt_len=500, output_len=300)
    predicted = predict(workload("sliding"), requests, kv_manager=CappedManager(num_blocks=NUM_BLOCKS, cap=8))
    assert predicted.predicted_max_running == first_refused(admitted=32, held=8)
    assert predicted.predicted_max_running_at_peak == NUM_BLOCKS // 8


@pytest.mark.parametrize("strategy", ["contiguous", "paged", "prefix"])
def test_a_strategy_whose_manager_caps_nothing_keeps_its_layouts_figures(strategy):
    requests = mix(5000, prompt_len=1100, output_len=100, prefix_len=1024)
    alone = predict(workload(strategy), requests)
    given = predict(workload(strategy), requests, kv_manager=manager(strategy))
    assert given == alone


def test_a_manager_of_another_pool_than_the_budgets_is_a_programming_error():
    with pytest.raises(ValueError, match="^kv_manager: 100 blocks, but the budget holds 10922$"):
        predict(workload("sliding"), mix(4, prompt_len=50, output_len=10),
                kv_manager=manager("sliding", window=64, num_blocks=100))  # fmt: skip


@pytest.mark.parametrize("strategy", ["contiguous", "paged", "prefix", "sliding"])
def test_admission_blocks_are_what_the_schedulers_admission_takes(strategy):
    # a prompt of 50 tokens under a budget of 32 per iteration: admitted on its first chunk, 2 blocks
    kv = manager(strategy, window=8 if strategy == "sliding" else None, num_blocks=256)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_model_len=2048), kv)
    scheduler.add_request(Request(0, 0.0, 50, 4))
    output = scheduler.schedule(0.0)
    assert [s.num_new_tokens for s in output.scheduled] == [32]
    assert kv.num_blocks - kv.num_free_blocks == kv.admission_blocks(50, max_chunk_tokens=32)


# --- attn_impl=eager: its scores in the budget ----------------------------------------------------------------


def test_eager_leaves_room_for_its_largest_chunks_scores_in_a_utilization_budget():
    knobs = dict(max_model_len=4096, gpu_memory_utilization=0.9, memory_gb=80, device="cuda",
                 max_num_batched_tokens=2048, max_num_seqs=256, runtime_overhead_bytes=GiB)  # fmt: skip
    sdpa, eager = (kv_budget(workload(attn_impl=impl), **knobs) for impl in ("sdpa", "eager"))
    # one layer's scores (bf16), fp32 softmax and probabilities (bf16) of the largest chunk: 2048 queries of each
    # of 16 heads over 4095 keys; the decode batch's, 256 queries over as many, is 8x smaller
    scores = SMALL.n_heads * 2048 * 4095 * (2 + 4 + 2)
    extra = eager.activation_bytes - sdpa.activation_bytes
    assert eager.kv_bytes == sdpa.kv_bytes - extra
    assert scores < extra < 1.25 * scores  # the rest: its masks' copies and the layer's live tensors
    same = dict(knobs, kv_memory_gb=1.0, gpu_memory_utilization=None)
    assert kv_budget(workload(attn_impl="eager"), **same).kv_bytes == kv_budget(workload(), **same).kv_bytes


def test_which_strategies_the_manager_predicts_is_their_serving_declaration():
    assert sorted(name for name in kv.serving_names() if kv.serving(name).caps_blocks) == ["evict", "sliding"]
    with pytest.raises(ValueError, match="needs caps_blocks"):
        Serving(pool="blocks", storage="paged", windowed=True)  # a window frees blocks: it caps what one holds
    with pytest.raises(ValueError, match="needs caps_blocks"):
        Serving(pool="blocks", budgeted=True)  # a budget never grows past its blocks
    with pytest.raises(ValueError, match="pool 'blocks'"):
        Serving(pool="slots", caps_blocks=True)
