"""harness.serve.metrics: a serving run's per-request and run figures, its peaks of concurrent and running requests, and
bad input, against numbers worked out by hand.

Times are multiples of 0.25 s, exact in binary, so the hand arithmetic in the comments is exact; the comparisons
still use pytest.approx, because the code goes through seconds -> milliseconds and numpy's reductions.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from harness.errors import ConfigError
from harness.serve.metrics import (
    ACCURACY_RUN_COLUMNS,
    STRATEGY_RUN_COLUMNS,
    TIER_RUN_COLUMNS,
    RequestRecord,
    max_concurrent_requests,
    max_running_requests,
    request_row,
    run_metrics,
)
from harness.serve.sustained import SUSTAINED_COLUMNS

DURATION_S = 2.0


def three_requests() -> list[RequestRecord]:
    """A, B and C, with every figure worked out by hand (ms):

    A: arrives 0, scheduled 0.5, tokens at 1.0 1.25 1.5 1.75, done 1.75: queue 500, TTFT 1000, E2EL 1750,
       TPOT (1750-1000)/3 = 250, ITL 250 250 250.
    B: arrives 0.25, scheduled at once, tokens at 0.75 1.75, done 2.0 (after its last token): queue 0, TTFT 500,
       E2EL 1750, TPOT (1750-500)/1 = 1250, ITL 1000.
    C: arrives 1.0, scheduled 1.75 (the instant A finishes), one token at 2.0, done 2.0: queue 750, TTFT 1000,
       E2EL 1000, no TPOT, no ITL.
    """
    return [
        RequestRecord(
            request_id="A",
            arrival_s=0.0,
            first_scheduled_s=0.5,
            token_times_s=[1.0, 1.25, 1.5, 1.75],
            finished_s=1.75,
            prompt_len=10,
            prefix_hit_tokens=4,
        ),
        RequestRecord(
            request_id="B",
            arrival_s=0.25,
            first_scheduled_s=0.25,
            token_times_s=[0.75, 1.75],
            finished_s=2.0,
            prompt_len=20,
            preemptions=1,
        ),
        RequestRecord(
            request_id="C",
            arrival_s=1.0,
            first_scheduled_s=1.75,
            token_times_s=[2.0],
            finished_s=2.0,
            prompt_len=10,
            prefix_hit_tokens=2,
            preemptions=2,
        ),
    ]


def record(*, arrival_s=0.0, first_scheduled_s=None, token_times_s=(1.0,), finished_s=None, **fields):
    """A record from only the times a test cares about: scheduled on arrival, done at its last token."""
    return RequestRecord(
        request_id=fields.pop("request_id", "r"),
        arrival_s=arrival_s,
        first_scheduled_s=arrival_s if first_scheduled_s is None else first_scheduled_s,
        token_times_s=token_times_s,
        finished_s=token_times_s[-1] if finished_s is None else finished_s,
        prompt_len=fields.pop("prompt_len", 8),
        **fields,
    )


# --- one request's row --------------------------------------------------------------------------------------------


def test_request_row_gives_each_requests_figures_in_ms():
    rows = {row["request_id"]: row for row in map(request_row, three_requests())}
    assert rows["A"]["queue_ms"] == pytest.approx(500.0)
    assert rows["A"]["ttft_ms"] == pytest.approx(1000.0)
    assert rows["A"]["tpot_ms"] == pytest.approx(250.0)
    assert rows["A"]["itl_ms"] == pytest.approx([250.0, 250.0, 250.0])
    assert rows["A"]["e2el_ms"] == pytest.approx(1750.0)
    assert rows["A"]["output_len"] == 4
    assert rows["B"]["tpot_ms"] == pytest.approx(1250.0)  # the tail after its last token is in it, as vLLM's
    assert rows["B"]["preemptions"] == 1
    assert rows["C"]["queue_ms"] == pytest.approx(750.0)


def test_ttft_runs_from_arrival_so_queueing_is_inside_it():
    # A waits 500 ms, then 500 ms more to its first token: TTFT 1000, not the 500 counted from scheduling.
    row = request_row(three_requests()[0])
    assert row["ttft_ms"] == pytest.approx(1000.0)
    assert row["ttft_ms"] == pytest.approx(row["queue_ms"] + 500.0)


def test_tpot_divides_the_time_after_the_first_token_by_the_tokens_after_it():
    # A: (E2EL 1750 - TTFT 1000) / (4 - 1) = 250; dividing by all 4 tokens would give 187.5.
    assert request_row(three_requests()[0])["tpot_ms"] == pytest.approx(250.0)


def test_a_one_token_output_has_no_tpot_and_no_itl():
    row = request_row(three_requests()[2])
    assert row["tpot_ms"] is None
    assert row["itl_ms"] == []


def test_first_token_and_output_length_are_read_from_the_token_times():
    request = three_requests()[0]
    assert request.first_token_s == 1.0
    assert request.output_len == 4


# --- the run row --------------------------------------------------------------------------------------------------


def test_run_metrics_has_vllms_key_names():
    metrics = run_metrics(three_requests(), DURATION_S)
    latency_keys = {
        f"{stat}_{name}_ms"
        for name in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "std", "p50", "p90", "p99")
    }
    assert set(metrics) == latency_keys | {
        "duration_s",
        "completed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "ttft_slo_ms",
        "tpot_slo_ms",
        "e2el_slo_ms",
        "output_throughput",
        "total_token_throughput",
        "max_concurrent_requests",
        "max_running_requests",
        "total_preemptions",
        "prefix_hit_rate",
        "prefix_hit_rate_device",
        "prefix_hit_rate_host",
        "prefix_hit_rate_disk",
        *TIER_RUN_COLUMNS,
        *SUSTAINED_COLUMNS,  # harness.serve.sustained: the window, its achieved rate and attainment, the verdict
        *ACCURACY_RUN_COLUMNS,
        *STRATEGY_RUN_COLUMNS,
    }


def test_the_prefix_hit_rate_splits_by_source_and_the_tiers_are_null_without_tiers():
    records = [dataclasses.replace(r, prefix_hit_tokens=8) for r in three_requests()]  # 24 of 40 prompt tokens
    without = run_metrics(records, DURATION_S)
    assert without["prefix_hit_rate_device"] == without["prefix_hit_rate"] == pytest.approx(0.6)
    assert without["prefix_hit_rate_host"] is None and without["prefix_hit_rate_disk"] is None
    tiered = run_metrics(records, DURATION_S, tier_hit_tokens={"host": 10, "disk": 4})
    assert tiered["prefix_hit_rate_device"] == pytest.approx(10 / 40)
    assert (tiered["prefix_hit_rate_host"], tiered["prefix_hit_rate_disk"]) == pytest.approx((10 / 40, 4 / 40))
    assert all(tiered[name] is None for name in TIER_RUN_COLUMNS)  # the run fills them from its store


def test_counts_and_throughputs_over_the_duration():
    metrics = run_metrics(three_requests(), DURATION_S)
    assert metrics["completed"] == 3
    assert metrics["total_input_tokens"] == 40  # 10 + 20 + 10
    assert metrics["total_output_tokens"] == 7  # 4 + 2 + 1
    assert metrics["request_throughput"] == pytest.approx(1.5)  # 3 requests / 2 s
    assert metrics["output_throughput"] == pytest.approx(3.5)  # 7 tokens / 2 s
    assert metrics["total_token_throughput"] == pytest.approx(23.5)  # 47 tokens / 2 s


def test_ttft_statistics_worked_by_hand():
    # TTFT 1000, 500, 1000: mean 833.33; median 1000; population std sqrt((166.67² + 333.33² + 166.67²) / 3)
    # = sqrt(55555.6) = 235.70 (ddof=0, as vLLM's np.std); p90 at rank 0.9 * 2 = 1.8 of [500, 1000, 1000] = 1000.
    metrics = run_metrics(three_requests(), DURATION_S)
    assert metrics["mean_ttft_ms"] == pytest.approx(2500.0 / 3)
    assert metrics["median_ttft_ms"] == pytest.approx(1000.0)
    assert metrics["std_ttft_ms"] == pytest.approx(np.sqrt(500.0**2 * 2 / 9))
    assert metrics["p90_ttft_ms"] == pytest.approx(1000.0)
    assert metrics["mean_e2el_ms"] == pytest.approx(1500.0)  # (1750 + 1750 + 1000) / 3


def test_tpot_statistics_leave_one_token_outputs_out():
    # TPOT over A (250) and B (1250) only: mean 750. Counting C as 0 would give 500.
    metrics = run_metrics(three_requests(), DURATION_S)
    assert metrics["mean_tpot_ms"] == pytest.approx(750.0)
    assert metrics["median_tpot_ms"] == pytest.approx(750.0)


def test_itl_statistics_pool_every_gap_of_every_request():
    # Gaps 250, 250, 250 (A) and 1000 (B): mean 437.5, median 250, p90 at rank 2.7 = 250 + 0.7 * 750 = 775.
    # The mean of each request's mean gap would be (250 + 1000) / 2 = 625.
    metrics = run_metrics(three_requests(), DURATION_S)
    assert metrics["mean_itl_ms"] == pytest.approx(437.5)
    assert metrics["median_itl_ms"] == pytest.approx(250.0)
    assert metrics["p90_itl_ms"] == pytest.approx(775.0)


def test_only_one_token_outputs_leave_tpot_and_itl_statistics_none():
    metrics = run_metrics([record(token_times_s=(1.0,)), record(token_times_s=(2.0,))], DURATION_S)
    assert metrics["mean_tpot_ms"] is None
    assert metrics["p99_itl_ms"] is None
    assert metrics["mean_ttft_ms"] == pytest.approx(1500.0)


def test_percentiles_equal_numpys_linear_percentiles_over_the_request_rows():
    generator = np.random.default_rng(16)
    records = []
    for index in range(40):
        arrival_s = float(generator.uniform(0.0, 5.0))
        first_token_s = arrival_s + float(generator.exponential(0.3))
        gaps_s = generator.exponential(0.02, size=int(generator.integers(0, 12)))
        records.append(
            record(request_id=str(index), arrival_s=arrival_s, token_times_s=first_token_s + np.cumsum([0.0, *gaps_s]))
        )
    percentiles = (50, 90, 99, 99.9)
    metrics = run_metrics(records, 6.0, percentiles=percentiles)
    rows = [request_row(one) for one in records]
    samples_ms = {
        "ttft": [row["ttft_ms"] for row in rows],
        "tpot": [row["tpot_ms"] for row in rows if row["tpot_ms"] is not None],
        "itl": [gap for row in rows for gap in row["itl_ms"]],
        "e2el": [row["e2el_ms"] for row in rows],
    }
    for name, samples in samples_ms.items():
        for percentile, key in zip(percentiles, ("p50", "p90", "p99", "p99.9"), strict=True):
            assert metrics[f"{key}_{name}_ms"] == pytest.approx(np.percentile(samples, percentile)), (name, key)
        assert metrics[f"median_{name}_ms"] == pytest.approx(metrics[f"p50_{name}_ms"])


def test_median_is_there_without_p50_when_50_is_not_asked():
    metrics = run_metrics(three_requests(), DURATION_S, percentiles=(99,))
    assert "median_ttft_ms" in metrics
    assert "p50_ttft_ms" not in metrics
    assert "p99_ttft_ms" in metrics


# --- concurrency, preemptions, prefix hits ------------------------------------------------------------------------


def test_a_queued_request_is_concurrent_but_not_running():
    # Four arrive at 0 and two run at a time: r0 and r1 on [0, 1), r2 and r3 queued until 1, then on [1, 2).
    burst = [
        record(request_id=f"r{i}", arrival_s=0.0, first_scheduled_s=float(i // 2), token_times_s=(i // 2 + 1.0,))
        for i in range(4)
    ]
    metrics = run_metrics(burst, DURATION_S)
    assert metrics["max_concurrent_requests"] == 4  # all four in flight from 0, as vLLM counts: queueing included
    assert metrics["max_running_requests"] == 2  # two at a time, as the scheduler runs them


def test_the_hand_worked_requests_peak_at_three_in_flight_and_two_running():
    # In flight (arrival to finish): A [0, 1.75), B [0.25, 2.0), C [1.0, 2.0): all three at 1.0, C queued.
    # Running (first scheduled to finish): A [0.5, 1.75), B [0.25, 2.0), C [1.75, 2.0): C starts the instant A ends,
    # so 2, not 3.
    metrics = run_metrics(three_requests(), DURATION_S)
    assert (metrics["max_concurrent_requests"], metrics["max_running_requests"]) == (3, 2)


@pytest.mark.parametrize("peak", [max_concurrent_requests, max_running_requests])
def test_a_peak_of_touching_and_overlapping_intervals(peak):
    first = record(arrival_s=0.0, token_times_s=(1.0,))
    touching = record(arrival_s=1.0, token_times_s=(2.0,))
    overlapping = record(arrival_s=0.75, token_times_s=(2.0,))
    assert peak([first, touching]) == 1
    assert peak([first, overlapping]) == 2
    assert peak([first, touching, overlapping]) == 2


def test_running_requests_touch_where_their_queued_intervals_overlap():
    # Both arrive at 0; the second is scheduled the instant the first finishes: in flight together, never running.
    first = record(arrival_s=0.0, token_times_s=(1.0,))
    second = record(arrival_s=0.0, first_scheduled_s=1.0, token_times_s=(2.0,))
    assert (max_concurrent_requests([first, second]), max_running_requests([first, second])) == (2, 1)


def test_max_concurrent_requests_of_a_burst_is_its_size():
    burst = [record(request_id=str(index), arrival_s=0.0, token_times_s=(1.0 + index,)) for index in range(5)]
    assert max_concurrent_requests(burst) == 5


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("qps", [200.0, float("inf")])
def test_max_running_requests_is_the_most_running_in_one_scheduler_iteration(preemption_mode, qps):
    """Against the scheduler's own count (SchedulerOutput.num_running), in a pool tight enough to preempt: a
    preempted request is counted until it finishes, yet the peak is still one iteration's running requests."""
    from harness.serve.kv_manager import make_kv_manager
    from harness.serve.requests import RequestSpec, generate
    from harness.serve.scheduler import Scheduler, SchedulerConfig, simulate

    spec = RequestSpec(num_prompts=40, qps=qps, seed=2, prompt_len=48, prompt_dist="uniform", prompt_spread=0.5,
                       output_len=24, output_dist="uniform", output_spread=0.5, max_model_len=128)  # fmt: skip
    kv = make_kv_manager("paged", num_blocks=24, block_size=8, max_model_len=128)
    config = SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=16, max_model_len=128,
                             preemption_mode=preemption_mode)  # fmt: skip
    simulation = simulate(generate(spec), Scheduler(config, kv), lambda output: 1e-3 + 1e-5 * output.num_running)
    metrics = run_metrics(simulation.records, 1.0)
    assert metrics["total_preemptions"] > 0  # the case where counting until the finish could overcount
    assert metrics["max_running_requests"] == max(output.num_running for output in simulation.iterations)
    assert metrics["max_concurrent_requests"] > metrics["max_running_requests"]  # requests queued


def test_preemptions_are_summed_and_prefix_hits_are_a_share_of_prompt_tokens():
    metrics = run_metrics(three_requests(), DURATION_S)
    assert metrics["total_preemptions"] == 3  # 0 + 1 + 2
    assert metrics["prefix_hit_rate"] == pytest.approx(0.15)  # (4 + 0 + 2) / 40


# --- bad input ----------------------------------------------------------------------------------------------------


def test_no_records_is_an_error():
    with pytest.raises(ConfigError, match=r"^records: no finished requests"):
        run_metrics([], DURATION_S)


@pytest.mark.parametrize("duration_s", [0, 0.0, -1.0, float("nan"), float("inf")])
def test_a_duration_that_is_not_positive_is_an_error(duration_s):
    with pytest.raises(ConfigError, match=r"^duration_s: must be a positive number of seconds"):
        run_metrics(three_requests(), duration_s)


def test_a_percentile_out_of_range_is_an_error():
    with pytest.raises(ConfigError, match=r"^percentiles: each must be a number in \[0, 100\], got 101"):
        run_metrics(three_requests(), DURATION_S, percentiles=(50, 101))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"token_times_s": ()}, r"token_times_s: empty"),
        ({"arrival_s": 1.0, "first_scheduled_s": 0.5}, r"first_scheduled_s=0.5 is before arrival_s=1.0"),
        ({"token_times_s": (1.0, 0.5)}, r"token_times_s\[1\]=0.5 is before token_times_s\[0\]=1.0"),
        ({"token_times_s": (1.0,), "finished_s": 0.9}, r"finished_s=0.9 is before token_times_s\[0\]=1.0"),
        ({"prompt_len": 0}, r"prompt_len: must be at least 1"),
        ({"prompt_len": 4, "prefix_hit_tokens": 5}, r"prefix_hit_tokens: must be in \[0, prompt_len=4\]"),
        ({"preemptions": -1}, r"preemptions: must be 0 or more"),
    ],
)
def test_a_record_out_of_order_or_out_of_range_is_refused_in_one_line(fields, message):
    times = {key: fields.pop(key) for key in ("arrival_s", "first_scheduled_s", "finished_s") if key in fields}
    token_times_s = fields.pop("token_times_s", (1.0,))
    with pytest.raises(ConfigError, match=r"^request 'r': " + message) as caught:
        RequestRecord(
            request_id="r",
            arrival_s=times.get("arrival_s", 0.0),
            first_scheduled_s=times.get("first_scheduled_s", times.get("arrival_s", 0.0)),
            token_times_s=token_times_s,
            finished_s=times.get("finished_s", token_times_s[-1] if token_times_s else 1.0),
            prompt_len=fields.pop("prompt_len", 8),
            **fields,
        )
    assert "\n" not in str(caught.value)
