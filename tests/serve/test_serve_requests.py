"""The request stream a serving run replays (harness.serve.requests): its seed, arrivals, lengths and bad specs.

Statistical checks draw a few thousand requests under a fixed seed and hold the sample to its distribution within
5 standard errors, each computed in place from the distribution's own moments: a correct sampler stays inside
(a 5-sigma miss has odds below 1e-6), and the faults they guard against (a wrong gamma scale, a lognormal's mu
without the -sigma²/2) miss by 20 standard errors or more.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.errors import ConfigError
from harness.serve.requests import (
    Request,
    RequestSpec,
    arrival_times_s,
    describe,
    generate,
    inter_arrival_gaps_s,
)


def gaps_of(requests: list[Request]) -> np.ndarray:
    """The gap before each request, seconds; the first one's runs from the run's start."""
    return np.diff([0.0] + [request.arrival_s for request in requests])


def lengths(requests: list[Request], side: str) -> np.ndarray:
    return np.array([getattr(request, f"{side}_len") for request in requests])


def one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, f"not one line: {message!r}"
    return message


# --- the stream is seeded ---


def test_the_same_spec_gives_the_same_stream():
    spec = RequestSpec(num_prompts=50, qps=3.0, prompt_dist="lognormal", prompt_spread=0.7, output_dist="uniform")
    assert generate(spec) == generate(RequestSpec(**vars(spec)))


def test_another_seed_gives_other_arrivals_and_lengths():
    spec = dict(num_prompts=50, qps=3.0, prompt_dist="uniform", prompt_spread=0.5)
    first, second = generate(RequestSpec(**spec, seed=0)), generate(RequestSpec(**spec, seed=1))
    assert [r.arrival_s for r in first] != [r.arrival_s for r in second]
    assert list(lengths(first, "prompt")) != list(lengths(second, "prompt"))


def test_a_faster_qps_replays_the_same_requests_compressed_in_time():
    # A qps sweep must compare one request set at several rates: lengths are drawn apart from the arrivals, and the
    # rescaled gaps make the stream at 2·qps the stream at qps with every arrival halved (to float rounding).
    spec = dict(num_prompts=200, prompt_dist="lognormal", prompt_spread=0.5, output_dist="uniform", output_spread=0.5)
    slow, fast = generate(RequestSpec(**spec, qps=2.0)), generate(RequestSpec(**spec, qps=4.0))
    assert [(r.prompt_len, r.output_len) for r in slow] == [(r.prompt_len, r.output_len) for r in fast]
    np.testing.assert_allclose([r.arrival_s / 2 for r in slow], [r.arrival_s for r in fast], rtol=1e-12)
    all_at_once = generate(RequestSpec(**spec))
    assert [(r.prompt_len, r.output_len) for r in all_at_once] == [(r.prompt_len, r.output_len) for r in slow]


# --- arrivals ---


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gaps_average_one_over_qps_at_every_burstiness(burstiness):
    # Gamma(k, 1/(qps·k)) has mean 1/qps and sd 1/(qps·√k): the mean of n gaps has a standard error of
    # 1/(qps·√(k·n)), 0.9% of the mean at k=0.5, n=2000. A scale of 1/qps (the shape left out) is off by k×.
    qps, n = 5.0, 2000
    gaps_s = inter_arrival_gaps_s(RequestSpec(num_prompts=n, qps=qps, burstiness=burstiness))
    standard_error_s = 1 / (qps * math.sqrt(burstiness * n))
    assert abs(gaps_s.mean() - 1 / qps) < 5 * standard_error_s


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gap_coefficient_of_variation_is_one_over_root_burstiness(burstiness):
    # Gamma(k)'s CV is 1/√k: 1 for Poisson arrivals, 0.5 at k=4, 2 at k=0.25. The sample CV's relative error is
    # about sd(s)/σ + sd(mean)/μ = √((κ-1)/n)/2 + 1/√(k·n), κ = 3 + 6/k the gamma's kurtosis (delta method);
    # 5 of those at n=5000 is 11% of the CV at k=4, 16% at k=1, 32% at k=0.25: the three stay apart.
    n = 5000
    gaps_s = gaps_of(generate(RequestSpec(num_prompts=n, qps=10.0, burstiness=burstiness, prompt_len=8)))
    kurtosis = 3 + 6 / burstiness
    relative_error = math.sqrt((kurtosis - 1) / n) / 2 + 1 / math.sqrt(burstiness * n)
    expected = 1 / math.sqrt(burstiness)
    assert gaps_s.std() / gaps_s.mean() == pytest.approx(expected, rel=5 * relative_error)


def test_the_last_request_arrives_at_num_prompts_over_qps():
    # vLLM's rescale: the offered rate is qps exactly, for every seed (unscaled, 200 gaps sum within ~7% of it).
    for seed in (0, 1, 2):
        arrivals_s = arrival_times_s(RequestSpec(num_prompts=200, qps=4.0, seed=seed))
        assert arrivals_s[-1] == pytest.approx(200 / 4.0, rel=1e-12)


def test_arrivals_never_decrease_and_the_first_waits_a_gap():
    requests = generate(RequestSpec(num_prompts=500, qps=50.0, burstiness=0.3))
    arrivals_s = [request.arrival_s for request in requests]
    assert arrivals_s == sorted(arrivals_s)
    assert arrivals_s[0] > 0
    assert [request.request_id for request in requests] == list(range(500))


def test_qps_inf_puts_every_arrival_at_zero():
    requests = generate(RequestSpec(num_prompts=20, qps=math.inf, burstiness=0.5))
    assert all(request.arrival_s == 0.0 for request in requests)
    assert describe(requests)["offered_qps"] == math.inf


def test_burstiness_inf_spaces_arrivals_evenly():
    arrivals_s = arrival_times_s(RequestSpec(num_prompts=10, qps=2.0, burstiness=math.inf))
    np.testing.assert_allclose(arrivals_s, 0.5 * np.arange(1, 11), rtol=1e-12)


# --- lengths ---


def test_fixed_lengths_are_the_mean_for_every_request():
    requests = generate(RequestSpec(num_prompts=30, prompt_len=300, output_len=20, prefix_len=100))
    assert {(r.prompt_len, r.output_len, r.prefix_len) for r in requests} == {(300, 20, 100)}
    assert all(type(r.prompt_len) is int and type(r.output_len) is int for r in requests)  # JSON-ready, not numpy


def test_uniform_lengths_span_vllms_range_and_average_the_mean():
    # mean 100, ratio 0.1: integers in [90, 110] both ends included. Each end is missed by 2000 draws with
    # probability (20/21)^2000 ~ 1e-42; the mean's standard error is √((21²-1)/12)/√2000 = 0.14 tokens.
    n = 2000
    requests = generate(RequestSpec(num_prompts=n, prompt_len=100, prompt_dist="uniform", prompt_spread=0.1))
    prompts = lengths(requests, "prompt")
    assert prompts.min() == 90 and prompts.max() == 110
    assert abs(prompts.mean() - 100) < 5 * math.sqrt((21**2 - 1) / 12) / math.sqrt(n)


def test_uniform_lengths_stay_at_least_one():
    spec = RequestSpec(num_prompts=500, output_len=2, output_dist="uniform", output_spread=0.9)
    assert spec.output_bounds == (1, 4)  # floor(0.2) = 0 is raised to 1, as vLLM does
    outputs = lengths(generate(spec), "output")
    assert outputs.min() == 1 and outputs.max() == 4


@pytest.mark.parametrize("sigma", [0.5, 1.0])
def test_lognormal_lengths_average_the_stated_mean(sigma):
    # mu = ln(mean) - sigma²/2 makes the mean the stated one. The sample mean's standard error is
    # mean·√(exp(sigma²)-1)/√n (the lognormal's sd), 1.3 tokens at sigma 0.5 and 3.3 at sigma 1 (n=8000); rounding
    # to integers moves the mean by under 0.5. A mu of ln(mean) would overshoot by 13% (sigma 0.5) and 65% (sigma 1).
    mean, n = 200, 8000
    spec = RequestSpec(num_prompts=n, output_len=mean, output_dist="lognormal", output_spread=sigma, prompt_len=8)
    outputs = lengths(generate(spec), "output")
    assert outputs.dtype.kind == "i" and outputs.min() >= 1
    standard_error = mean * math.sqrt(math.exp(sigma**2) - 1) / math.sqrt(n)
    assert abs(outputs.mean() - mean) < 5 * standard_error + 0.5


def test_lognormal_draws_are_kept_above_the_prefix_and_within_max_model_len():
    # sigma 1 puts ~34% of the draws at or below 40 and ~8% over 250: those are drawn again
    spec = RequestSpec(
        num_prompts=2000,
        prompt_len=100,
        prompt_dist="lognormal",
        prompt_spread=1.0,
        prefix_len=40,
        output_len=50,
        max_model_len=300,
    )
    requests = generate(spec)
    prompts = lengths(requests, "prompt")
    assert prompts.min() > 40
    assert (prompts + lengths(requests, "output")).max() <= 300
    assert len(set(prompts.tolist())) > 100  # still a spread of lengths, not clipped onto the bounds


# --- bad specs: one line naming the field ---


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"qps": 0}, r"^qps: must be > 0 requests/s, or inf \(all at once\), got 0$"),
        ({"qps": -2.0}, r"^qps: .*got -2.0$"),
        ({"qps": math.nan}, r"^qps: "),
        ({"num_prompts": 0}, r"^num_prompts: must be an integer >= 1, got 0$"),
        ({"num_prompts": 10.0}, r"^num_prompts: "),
        ({"burstiness": 0.0}, r"^burstiness: must be > 0"),
        ({"seed": -1}, r"^seed: "),
        ({"prompt_dist": "normal"}, r"^prompt_dist: must be one of fixed, uniform, lognormal, got 'normal'$"),
        ({"output_len": 0}, r"^output_len: must be an integer >= 1"),
        ({"prompt_spread": 0.2}, r"^prompt_spread: must be 0 for prompt_dist=fixed"),
        ({"output_dist": "uniform", "output_spread": 1.0}, r"^output_spread: must be in \[0, 1\)"),
        ({"prompt_dist": "lognormal"}, r"^prompt_spread: must be > 0 for prompt_dist=lognormal"),
        ({"prefix_len": -1}, r"^prefix_len: must be an integer >= 0"),
        ({"prompt_len": 64, "prefix_len": 64}, r"^prefix_len: must be below the shortest prompt \(64 tokens"),
        (
            {"prompt_len": 100, "prompt_dist": "uniform", "prompt_spread": 0.5, "prefix_len": 50},
            r"^prefix_len: must be below the shortest prompt \(50 tokens, prompt_dist=uniform\), got 50$",
        ),
        (
            {"prompt_len": 100, "prompt_dist": "lognormal", "prompt_spread": 1.0, "prefix_len": 100},
            r"^prefix_len: must be below the mean prompt",
        ),
        ({"prompt_len": 4000, "output_len": 200}, r"^max_model_len: must hold .*4000 \+ 200 = 4200 tokens.*got 4096$"),
        (
            {"prompt_len": 1000, "prompt_dist": "uniform", "prompt_spread": 0.5, "max_model_len": 1600},
            r"^max_model_len: must hold .*1500 \+ 128",
        ),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_field(fields, match):
    with pytest.raises(ConfigError, match=match) as excinfo:
        RequestSpec(**fields)
    one_line_error(excinfo)


def test_a_lognormal_with_no_room_is_refused_not_looped_on():
    # Only a prompt of exactly 1000 fits (prefix 999, 1000 + 128 = max_model_len): rounds of redrawing end in an error.
    spec = RequestSpec(
        num_prompts=50, prompt_dist="lognormal", prompt_len=1000, prompt_spread=2.0, prefix_len=999, max_model_len=1128
    )
    with pytest.raises(ConfigError, match=r"^max_model_len: \d+ of 50 lognormal draws") as excinfo:
        generate(spec)
    one_line_error(excinfo)
