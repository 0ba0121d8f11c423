"""harness.serve.metrics' SLOs: goodput over tests/serve/test_serve_metrics.py's hand-worked requests, parse_slo_ms's
forms and refusals, and the saturation knee of a QPS sweep."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from harness.errors import ConfigError
from harness.serve.metrics import knee, parse_slo_ms, run_metrics
from tests.serve.test_serve_metrics import DURATION_S, three_requests

# --- goodput ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        # TTFT A 1000, B 500, C 1000; TPOT A 250, B 1250, C none (0 against an SLO); E2EL A 1750, B 1750, C 1000.
        ({"ttft_slo_ms": 900}, 1),  # B
        ({"tpot_slo_ms": 300}, 2),  # A, and C whose one token has no TPOT to break it
        ({"e2el_slo_ms": "1.5s"}, 1),  # C
        ({"ttft_slo_ms": 1000, "tpot_slo_ms": "300ms"}, 2),  # A and C: an SLO is met at equality
        ({"ttft_slo_ms": 900, "tpot_slo_ms": 300}, 0),  # B meets TTFT only, A and C TPOT only
    ],
)
def test_goodput_counts_only_requests_meeting_every_slo_given(slos, good):
    metrics = run_metrics(three_requests(), DURATION_S, **slos)
    assert metrics["request_goodput"] == pytest.approx(good / DURATION_S)


def test_goodput_without_an_slo_equals_the_request_throughput():
    metrics = run_metrics(three_requests(), DURATION_S)
    assert metrics["request_goodput"] == pytest.approx(metrics["request_throughput"])
    assert (metrics["ttft_slo_ms"], metrics["tpot_slo_ms"], metrics["e2el_slo_ms"]) == (None, None, None)


def test_the_slos_are_recorded_in_ms():
    metrics = run_metrics(three_requests(), DURATION_S, ttft_slo_ms="0.2s", tpot_slo_ms=50, e2el_slo_ms="1500000us")
    assert metrics["ttft_slo_ms"] == pytest.approx(200.0)
    assert metrics["tpot_slo_ms"] == pytest.approx(50.0)
    assert metrics["e2el_slo_ms"] == pytest.approx(1500.0)


# --- SLO parsing --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "milliseconds"),
    [
        (200, 200.0),  # a number is milliseconds: the field is named ttft_slo_ms
        (0.5, 0.5),
        (np.float64(12.5), 12.5),
        ("200ms", 200.0),
        ("200 ms", 200.0),
        ("0.2s", 200.0),
        (" 2s ", 2000.0),
        ("1500us", 1.5),
        ("1e3ms", 1000.0),
        (".5s", 500.0),
    ],
)
def test_parse_slo_ms_accepts_a_number_of_ms_or_a_string_with_a_unit(value, milliseconds):
    assert parse_slo_ms(value, "ttft_slo_ms") == pytest.approx(milliseconds)


def test_parse_slo_ms_leaves_no_slo_as_none():
    assert parse_slo_ms(None, "ttft_slo_ms") is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("200", "'200' has no unit"),
        ("200min", "'200min' has an unknown unit 'min'"),
        ("200MS", "'200MS' has an unknown unit 'MS'"),
        ("fast", "'fast' is not a duration"),
        ("200 ms ms", "'200 ms ms' is not a duration"),
        ("", "'' is not a duration"),
        (True, "True is not a duration"),
        ([200], r"\[200\] is not a duration"),
        (0, "0 must be a finite positive duration"),
        (-5.0, "-5.0 must be a finite positive duration"),
        ("-5ms", "'-5ms' must be a finite positive duration"),
        ("0s", "'0s' must be a finite positive duration"),
        (float("inf"), "inf must be a finite positive duration"),
        (float("nan"), "nan must be a finite positive duration"),
    ],
)
def test_parse_slo_ms_refuses_in_one_line_naming_the_field_and_the_forms(value, problem):
    with pytest.raises(ConfigError, match=rf"^ttft_slo_ms: {problem}") as caught:
        parse_slo_ms(value, "ttft_slo_ms")
    message = str(caught.value)
    assert "\n" not in message
    assert message.endswith("give a number of milliseconds (200) or a string with a unit: 200ms, 0.2s, 200us")


def test_run_metrics_refuses_an_slo_without_a_unit():
    with pytest.raises(ConfigError, match=r"^tpot_slo_ms: '50' has no unit"):
        run_metrics(three_requests(), DURATION_S, tpot_slo_ms="50")


# --- the saturation knee ------------------------------------------------------------------------------------------

SWEEP = [
    {"qps": 4.0, "p99_ttft_ms": 450.0},
    {"qps": 1.0, "p99_ttft_ms": 120.0},  # out of order: the knee sorts by qps
    {"qps": 2.0, "p99_ttft_ms": 200.0},
    {"qps": 8.0, "p99_ttft_ms": 3000.0},
]


def test_knee_is_the_highest_qps_whose_p99_ttft_stays_under_the_slo():
    assert knee(SWEEP, "500ms") == 4.0
    assert knee(SWEEP, 200) == 2.0  # met at equality


def test_knee_takes_a_dataframe_and_other_columns():
    frame = pd.DataFrame(SWEEP).rename(columns={"qps": "request_rate", "p99_ttft_ms": "p90_tpot_ms"})
    assert knee(frame, "0.3s", metric="p90_tpot_ms", x="request_rate") == 2.0


def test_knee_stops_at_the_first_failure_even_if_a_higher_qps_meets_the_slo_again():
    noisy = [*SWEEP, {"qps": 16.0, "p99_ttft_ms": 100.0}]
    assert knee(noisy, "500ms") == 4.0


def test_knee_counts_a_missing_metric_as_a_failure():
    failed_run = [
        {"qps": 1.0, "p99_ttft_ms": 100.0},
        {"qps": 2.0, "p99_ttft_ms": None},
        {"qps": 4.0, "p99_ttft_ms": 100.0},
    ]
    assert knee(failed_run, "500ms") == 1.0
    assert knee(pd.DataFrame(failed_run), "500ms") == 1.0  # None becomes NaN in a frame


def test_knee_is_none_when_the_lowest_qps_already_breaks_the_slo():
    assert knee(SWEEP, "100ms") is None


def test_knee_of_bad_input_is_one_line():
    with pytest.raises(ConfigError, match=r"^metric: no column 'p99_itl_ms' in the points; columns: qps, p99_ttft_ms$"):
        knee(SWEEP, "500ms", metric="p99_itl_ms")
    with pytest.raises(ConfigError, match=r"^points: empty"):
        knee([], "500ms")
    with pytest.raises(ConfigError, match=r"^slo_ms: '500' has no unit"):
        knee(SWEEP, "500")
