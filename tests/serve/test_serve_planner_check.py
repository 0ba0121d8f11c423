"""The planner, checked against the scheduler (issue #16 item 7, ahead of the engine): at one KV budget and one
request set, the most requests harness.serve.scheduler runs at once (simulated: its block accounting, no model)
sits within 10% of harness.serve.concurrency's prediction, and the strategies order as the seed notes say: paged
fits more than contiguous, fp8 more than bf16, and a window (issue #30 1d) more than paged. Two independent
computations: the planner sums the layouts' bytes (a window's: the per-request counts its serving manager gives,
through the burst model), the scheduler admits, grows and preempts block by block, iteration by iteration. The
engine's measured concurrency is held to the same."""

from __future__ import annotations

import functools

import pytest

from harness.analytic.ledger import kv_bytes_per_token
from harness.config import Workload
from harness.serve.budget import bytes_per_block
from harness.serve.concurrency import predict_concurrency
from harness.serve.kv_manager import make_kv_manager, num_blocks_for
from harness.serve.requests import RequestSpec, generate
from harness.serve.scheduler import Scheduler, SchedulerConfig, simulate

BLOCK = 16
MAX_MODEL_LEN = 2048
BUDGET = 256 * 2**20  # 256 MiB of KV for the small preset: about a hundred requests of a few hundred tokens
# All at once (qps=inf), lengths uniform around means well below max_model_len: where paging pays.
SPEC = RequestSpec(num_prompts=600, qps=float("inf"), seed=3, prompt_len=192, prompt_dist="uniform",
                   prompt_spread=0.5, output_len=64, output_dist="uniform", output_spread=0.5,
                   max_model_len=MAX_MODEL_LEN)  # fmt: skip


WINDOW = 64  # sliding: a third of the mean prompt, so its requests shrink to ceil(64 / 16) + 1 = 5 blocks once decoding


def workload(cache: str, kv_dtype: str) -> Workload:
    options = {"block_size": BLOCK} if cache in ("paged", "prefix") else {}
    return Workload(model="small", cache={"name": cache, **options}, dtype="bf16", kv_dtype=kv_dtype)


def manager(cache: str, kv_dtype: str):
    """The serving KV manager of this budget's pool (blocks of the paged layout's bytes at kv_dtype)."""
    if cache == "contiguous":  # slots of max_model_len: count its pool in blocks of the same bytes per token
        num_blocks = num_blocks_for(BUDGET, BLOCK * kv_bytes_per_token("small", kv_dtype))
    else:
        num_blocks = num_blocks_for(BUDGET, bytes_per_block(workload("paged", kv_dtype)))
    return make_kv_manager(cache, num_blocks=num_blocks, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                           sliding_window=WINDOW if cache == "sliding" else None)  # fmt: skip


@functools.cache
def observed_max_running(cache: str, kv_dtype: str) -> int:
    """The most requests running in one iteration of a scheduler over this budget's blocks, serving SPEC."""
    requests = generate(SPEC)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1024, max_model_len=MAX_MODEL_LEN), manager(cache, kv_dtype))
    run = simulate(requests, scheduler, step_time_fn=lambda output: 0.01)
    assert len(run.records) == len(requests)  # every request served
    return max(output.num_running for output in run.iterations)


pytestmark = pytest.mark.slow  # three simulations of 600 requests: seconds each


@pytest.mark.parametrize(
    ("cache", "kv_dtype"), [("paged", "bf16"), ("paged", "fp8_e4m3"), ("contiguous", "bf16"), ("sliding", "bf16")]
)
def test_the_scheduler_runs_as_many_requests_at_once_as_the_planner_predicts(cache, kv_dtype):
    requests = generate(SPEC)
    predicted = predict_concurrency(workload(cache, kv_dtype), requests, kv_budget_bytes=BUDGET,
                                    max_model_len=MAX_MODEL_LEN, max_num_seqs=1024,
                                    kv_manager=manager(cache, kv_dtype))  # fmt: skip
    observed = observed_max_running(cache, kv_dtype)
    assert predicted.limited_by == "kv"  # the budget, not the caps, binds: the figure under test
    assert observed == pytest.approx(predicted.predicted_max_running, rel=0.10), (observed, predicted)


def test_at_one_budget_paged_fits_more_than_contiguous_and_fp8_more_than_bf16():
    contiguous, paged, fp8 = (
        observed_max_running(cache, kv_dtype)
        for cache, kv_dtype in (("contiguous", "bf16"), ("paged", "bf16"), ("paged", "fp8_e4m3"))
    )
    # contiguous reserves 2048 tokens per request where these hold ~256: several times fewer.
    assert paged > 3 * contiguous
    # fp8 halves the payload; its fp32 scale per token and head makes the blocks 68/128 of bf16's, not 1/2.
    assert fp8 > 1.6 * paged
    # a window of 64 holds 5 blocks a request where paged's ~256 tokens grow to ~16
    assert observed_max_running("sliding", "bf16") > 2 * paged
