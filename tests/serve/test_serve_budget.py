"""The planner's answer for a serving setup (harness.serve.budget): the KV budget, blocks, predicted concurrency
per strategy, and the fleet formulas.

Every expected figure is computed here from the planner's own functions (harness.analytic.ledger, harness.analytic.
activations) or in closed form from a preset's shapes, never copied from the module under test. The "small" preset
(12 layers, 4 KV heads of head_dim 64) makes a bf16 token 2 × 12 × 4 × 64 × 2 = 12,288 bytes of K and V.
"""

from __future__ import annotations

import math

import pytest

from harness.analytic.activations import forward_bytes
from harness.analytic.ledger import buffers_bytes, kv_bytes_per_token, weights_bytes
from harness.analytic.runtime import GiB
from harness.config import Workload
from harness.errors import ConfigError
from harness.modeling.model_args import ModelArgs
from harness.serve.budget import (
    bytes_per_block,
    concurrency_needed,
    kv_budget,
    kv_budget_bytes,
    replicas_needed,
)
from harness.serve.concurrency import predict_concurrency
from harness.serve.requests import Request

SMALL = ModelArgs.from_name("small")
HEAD_DIM = SMALL.head_dim  # 64
BLOCK = 16  # paged's default block_size
BUDGET = 2 * GiB  # a KV budget every strategy of a comparison shares


def workload(cache: str = "paged", kv_dtype: str = "bf16", **options) -> Workload:
    return Workload(model="small", cache={"name": cache, **options}, dtype="bf16", kv_dtype=kv_dtype)


def mix(n: int, *, prompt_len: int, output_len: int, prefix_len: int = 0) -> list[Request]:
    """n requests of one shape, all arriving at t = 0 (qps=inf)."""
    return [Request(i, 0.0, prompt_len, output_len, prefix_len) for i in range(n)]


def predict(w: Workload, requests: list[Request], **knobs):
    knobs = {"kv_budget_bytes": BUDGET, "max_model_len": 2048, "max_num_seqs": 10_000} | knobs
    return predict_concurrency(w, requests, **knobs)


# --- the budget ---------------------------------------------------------------------------------------------------


def test_budget_from_gpu_memory_utilization_is_its_share_of_memory_less_the_planners_terms():
    w = workload()
    budget = kv_budget(
        w,
        max_model_len=4096,
        gpu_memory_utilization=0.9,
        memory_gb=80,
        device="cuda",
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        runtime_overhead_bytes=GiB,
    )
    # vLLM's profiling forward: 2048 tokens over min(2048, 256) = 256 fresh sequences of 8, plus their int64 ids
    activations = 8 * 2048 + forward_bytes(w, n_seqs=256, n_new=8, n_keys=8)
    expected = math.ceil(0.9 * 80 * GiB) - weights_bytes(SMALL, "bf16") - buffers_bytes(SMALL, 4096) - activations - GiB
    assert budget.kv_bytes == expected
    assert budget.requested_bytes == math.ceil(0.9 * 80 * GiB)
    assert budget.activation_bytes == activations
    assert budget.source == "gpu_memory_utilization"


def test_budget_from_kv_memory_gb_is_those_bytes_with_nothing_subtracted():
    assert kv_budget_bytes(workload(), max_model_len=2048, kv_memory_gb=1.5) == int(1.5 * GiB)


@pytest.mark.parametrize("knobs", [{}, {"kv_memory_gb": 1.0, "gpu_memory_utilization": 0.9}], ids=["neither", "both"])
def test_exactly_one_of_kv_memory_gb_and_gpu_memory_utilization(knobs):
    with pytest.raises(ConfigError) as error:
        kv_budget(workload(), max_model_len=2048, memory_gb=80, device="cuda", runtime_overhead_bytes=0, **knobs)
    message = str(error.value)
    assert message.startswith("kv_memory_gb, gpu_memory_utilization: give exactly one") and "\n" not in message


@pytest.mark.parametrize("utilization", [0.0, 1.5, True])
def test_gpu_memory_utilization_outside_0_1_is_refused(utilization):
    with pytest.raises(ConfigError, match=r"^gpu_memory_utilization: must be in \(0, 1\]"):
        kv_budget(workload(), max_model_len=2048, gpu_memory_utilization=utilization, memory_gb=80, device="cuda")


def test_a_budget_too_small_for_one_request_is_one_line_in_blocks():
    # 0.0005 GiB = 536,870 bytes: 2 blocks of 16 × 12,288 bytes; a 2048-token request needs 2048 / 16 = 128
    with pytest.raises(ConfigError) as error:
        kv_budget(workload(), max_model_len=2048, kv_memory_gb=0.0005)
    assert str(error.value) == (
        "kv_memory_gb: 0.0005 GiB holds 2 blocks of 16 tokens; one request of 2048 tokens needs 128: "
        "raise it or lower max_model_len"
    )


def test_a_utilization_whose_share_the_weights_fill_is_one_line():
    # 0.05 × 0.5 GiB = 25.6 MiB < the small model's 383 MiB of bf16 weights
    with pytest.raises(ConfigError) as error:
        kv_budget(
            workload(),
            max_model_len=2048,
            gpu_memory_utilization=0.05,
            memory_gb=0.5,
            device="cuda",
            runtime_overhead_bytes=0,
        )
    message = str(error.value)
    assert message.startswith("gpu_memory_utilization: 0.05 of 0.5 GiB") and "\n" not in message


def test_a_budget_too_small_for_the_longest_request_of_the_mix_is_refused():
    requests = mix(3, prompt_len=100, output_len=28) + mix(1, prompt_len=1000, output_len=24)
    with pytest.raises(
        ConfigError, match=r"^kv_budget_bytes: .* holds 32 blocks .* one request of 1024 tokens needs 64"
    ):
        predict(workload(), requests, kv_budget_bytes=32 * BLOCK * 12_288)


def test_a_request_over_max_model_len_is_refused():
    with pytest.raises(ConfigError, match=r"^requests: request 0 holds 3000 tokens, over max_model_len=2048"):
        predict(workload(), mix(1, prompt_len=2000, output_len=1000))


# --- blocks -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3", "int8"])
def test_a_block_is_block_size_tokens_at_the_planners_bytes_per_token(kv_dtype):
    assert bytes_per_block(workload(kv_dtype=kv_dtype)) == BLOCK * kv_bytes_per_token(SMALL, kv_dtype)


def test_fp8_and_int8_blocks_are_about_half_of_bf16s_less_their_scales_share():
    # A bf16 token and head is 2·D bytes; fp8/int8 D + 4 (one fp32 scale): the ratio is 2·64 / 68 = 1.88, short of
    # 2 by the scale's 4 / 64 = 6% of the payload.
    bf16 = bytes_per_block(workload(kv_dtype="bf16"))
    for kv_dtype in ("fp8_e4m3", "int8"):
        assert bf16 / bytes_per_block(workload(kv_dtype=kv_dtype)) == pytest.approx(2 * HEAD_DIM / (HEAD_DIM + 4))


def test_an_int4_block_of_one_whole_key_group_is_its_tokens_at_the_planners_bytes_per_token():
    # block_size = kv_group_size = 32: the block holds exactly one row of key scales, the planner's amortized share
    assert bytes_per_block(workload(kv_dtype="int4", block_size=32)) == 32 * kv_bytes_per_token(SMALL, "int4")


def test_a_slot_strategy_has_no_blocks():
    with pytest.raises(ConfigError, match=r"^cache: contiguous has no blocks"):
        bytes_per_block(workload("contiguous"))


# --- predicted concurrency ----------------------------------------------------------------------------------------


def test_a_fixed_mix_takes_the_closed_forms():
    # prompt 500 + output 300: admitted on ceil(500 / 16) = 32 blocks, at its peak ceil(800 / 16) = 50
    num_blocks = BUDGET // (BLOCK * 12_288)
    predicted = predict(workload(), mix(5000, prompt_len=500, output_len=300))
    assert predicted.num_units == num_blocks
    assert predicted.predicted_max_running_at_peak == num_blocks // 50
    assert predicted.predicted_max_running == (num_blocks - int(0.01 * num_blocks)) // 32  # vLLM's watermark
    assert predicted.limited_by == "kv"


def test_mixed_lengths_are_admitted_in_their_fcfs_order():
    # 200 blocks: prompts of 64, 16, 1600 and 32 tokens take 4, 1, 100 and 2 blocks; no watermark
    requests = [Request(i, 0.0, prompt, 16) for i, prompt in enumerate([64, 16, 1600, 32, 1600])]
    predicted = predict(workload(), requests, kv_budget_bytes=200 * BLOCK * 12_288, watermark=0)
    assert predicted.predicted_max_running == 4  # 4 + 1 + 100 + 2 = 107 blocks; the fifth's 100 overflow
    assert predicted.predicted_max_running_at_peak == 4  # peaks 5 + 2 + 101 + 3 = 111; then + 101 > 200


def test_contiguous_fits_fewer_than_paged_at_equal_budget_when_requests_are_short_of_max_model_len():
    # mean length 256 tokens against max_model_len 2048: a contiguous slot reserves 8x what a request holds
    requests = mix(2000, prompt_len=200, output_len=56)
    contiguous = predict(workload("contiguous"), requests)
    paged = predict(workload("paged"), requests)
    assert contiguous.predicted_max_running == BUDGET // (2048 * 12_288)  # 85 slots of max_model_len tokens
    assert paged.predicted_max_running_at_peak > 7 * contiguous.predicted_max_running
    assert paged.predicted_max_running > paged.predicted_max_running_at_peak  # admitted on their prompts alone


def test_fp8_runs_about_twice_the_requests_of_bf16_less_its_scales_share():
    requests = mix(20_000, prompt_len=512, output_len=256)
    bf16 = predict(workload(kv_dtype="bf16"), requests)
    fp8 = predict(workload(kv_dtype="fp8_e4m3"), requests)
    expected = 2 * HEAD_DIM / (HEAD_DIM + 4)  # 1.88, as the blocks; flooring to whole requests moves it < 1%
    for figure in ("predicted_max_running", "predicted_max_running_at_peak"):
        assert getattr(fp8, figure) / getattr(bf16, figure) == pytest.approx(expected, rel=0.01)


def test_a_prefix_cache_holds_a_long_shared_prefix_once_and_runs_more_than_paged():
    # prompt 1100 tokens, 1024 of them shared (64 whole blocks): paged holds 75 blocks per request at its peak,
    # prefix 64 once and 75 - 64 = 11 per request
    requests = mix(5000, prompt_len=1100, output_len=100, prefix_len=1024)
    num_blocks = BUDGET // (BLOCK * 12_288)
    paged = predict(workload("paged"), requests)
    prefix = predict(workload("prefix"), requests)
    assert prefix.shared_units == 64 and paged.shared_units == 0
    assert prefix.predicted_max_running_at_peak == (num_blocks - 64) // 11
    assert paged.predicted_max_running_at_peak == num_blocks // 75
    assert prefix.predicted_max_running > 5 * paged.predicted_max_running


def test_sliding_is_flat_in_length_beyond_its_window():
    requests = mix(5000, prompt_len=900, output_len=100)
    sliding = [predict(workload("sliding", window=512), requests, max_model_len=n) for n in (1024, 2048, 4096)]
    assert {p.predicted_max_running for p in sliding} == {BUDGET // (512 * 12_288)}  # a ring of 512 tokens each
    contiguous = [
        predict(workload("contiguous"), requests, max_model_len=n).predicted_max_running for n in (1024, 4096)
    ]
    assert contiguous == [BUDGET // (1024 * 12_288), BUDGET // (4096 * 12_288)]  # 170 and 42: a slot grows with it


def test_max_num_seqs_caps_the_running_requests():
    predicted = predict(workload(), mix(5000, prompt_len=100, output_len=28), max_num_seqs=256)
    assert predicted.predicted_max_running == predicted.predicted_max_running_at_peak == 256
    assert predicted.limited_by == "max_num_seqs"


def test_a_mix_that_fits_whole_runs_all_of_it():
    predicted = predict(workload(), mix(10, prompt_len=100, output_len=28))
    assert (predicted.predicted_max_running, predicted.limited_by) == (10, "requests")


# --- the fleet ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "per_replica", "replicas"), [(10, 3, 4), (9, 3, 3), (2.1, 0.3, 7), (0.5, 2, 1)])
def test_replicas_needed_is_the_ceiling_of_target_over_one_replicas_knee(target, per_replica, replicas):
    assert replicas_needed(target, per_replica) == replicas  # 2.1 / 0.3 = 7.000000000000001 in floats


@pytest.mark.parametrize(("target", "per_replica"), [(0, 3), (-1, 3), (10, 0), (math.inf, 3), (10, math.nan)])
def test_replicas_needed_refuses_a_rate_not_above_zero(target, per_replica):
    with pytest.raises(ConfigError, match=r"^(target_qps|per_replica_max_qps): must be a finite number"):
        replicas_needed(target, per_replica)


def test_concurrency_needed_is_littles_law():
    assert concurrency_needed(20, 1.5) == pytest.approx(30)  # L = λ W: 20 requests/s staying 1.5 s each
    with pytest.raises(ConfigError, match=r"^qps: must be a finite number of requests/s > 0"):
        concurrency_needed(0, 1.5)
    with pytest.raises(ConfigError, match=r"^mean_e2e_s: must be a finite number of seconds > 0"):
        concurrency_needed(20, -1)
