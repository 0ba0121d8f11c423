"""Whether a serving run sustained its offered rate (issue #30 item 2): the honest half of the saturation knee.

A finite stream lets a saturated server look healthy: n requests offered faster than it can serve still all finish,
and under a loose SLO their p99 TTFT can stay inside it, so a knee read off the offered qps alone
(harness.serve.metrics.knee) calls a rate the server cannot hold. A run *sustained* its rate only when both hold:

1. **Rate.** Over the measured window the server finished requests at the rate they arrived, within RATE_TOLERANCE
   (5%). The window: sort the n requests by arrival and trim k = floor(WINDOW_TRIM x n) at each end (WINDOW_TRIM =
   10%): the first k arrive into an idle server (warm-up) and after the last k the stream stops and the server
   drains; the window's requests are the arrival ranks k .. n-1-k (window_requests = n - 2k), the window runs from
   the k-th arrival to the (n-1-k)-th (window_start_s, window_end_s, on the engine's clock), and

       window_offered_qps = (n - 2k - 1) / (arrival[n-1-k] - arrival[k])       the arrivals inside the window
       achieved_qps       = (n - 2k - 1) / (finish[n-1-k] - finish[k])         the same count of completions,
                                                                                ranks k .. n-1-k by finish time

   A server keeping up finishes each request a roughly constant latency after it arrives, so the completions span
   the arrivals' span and the ratio is 1 (up to the latency's jitter, milliseconds against the window's seconds). A
   saturated one finishes at its own capacity mu < lambda, its queue and latency growing through the run: the
   completions spread over a longer span and achieved / offered = mu / lambda. The offered rate is the window's
   own arrivals, not the configured qps, so that a Poisson stream's sampling noise (a 48-request window's rate is
   about 1/sqrt(47) = 15% off its qps, one sigma) cannot fail a healthy server; `qps` stays in the row beside it. An achieved rate more than 5%
   *above* the offered one fails too: a server catching up on a backlog is not in a steady state either.
2. **Attainment.** At least `slo_attainment` (default 0.9) of the window's requests met every SLO the run set:
   DistServe's SLO attainment (Zhong et al., OSDI 2024, whose goodput is the highest request rate served with the
   attainment goal met, "say, 90%", of requests within both the TTFT and TPOT SLOs), with vLLM's rule for meeting
   one (`vllm bench serve --goodput`, vllm/benchmarks/serve.py `calculate_metrics`: slo >= value, a one-token
   output's TPOT 0). A run with no SLO has no attainment (null) and is judged on its rate alone.

vLLM's own figures are rates over the whole run, warm-up and drain included, compared with nothing:
request_throughput = completed / duration and request_goodput = good completed / duration (vLLM's goodput is that
rate of good requests, not DistServe's highest rate meeting the goal). The run row keeps both beside these.

qps=inf (every request at t = 0) offers no rate: its window has no length and it is never sustained, its reason
says so, and its other figures stand. A chat session's later turns arrive when earlier ones finish (a closed loop,
dataset=sharegpt-multiturn): there the arrivals follow the server, so the rate test says less, and its qps is the
sessions' start rate, not the requests'. Torch-free (numpy only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import numpy as np

from harness.errors import ConfigError

WINDOW_TRIM = 0.1  # of the requests, cut at each end of the window: warm-up into an idle server, and the drain
RATE_TOLERANCE = 0.05  # issue #30: achieved within 5% of offered
DEFAULT_SLO_ATTAINMENT = 0.9  # DistServe's 90% attainment
SUSTAINED_COLUMNS = (  # the run row's, in its order (harness.serve.columns)
    "window_start_s",
    "window_end_s",
    "window_requests",
    "window_offered_qps",
    "achieved_qps",
    "slo_attainment",
    "slo_attainment_target",
    "sustained",
    "not_sustained_reason",
)
# A run row written before these were recorded, whose request rows could not be read: nothing to recompute from.
UNKNOWN_REASON = "unknown: a run row written before sustained was recorded, and no request rows to recompute it from"


def check_slo_attainment(value: object, field: str = "slo_attainment") -> float:
    """The attainment threshold: a fraction in (0, 1]; anything else is one ConfigError line naming the field."""
    if not (isinstance(value, Real) and not isinstance(value, bool) and 0 < value <= 1):
        raise ConfigError(f"{field}: must be a fraction of requests in (0, 1] (DistServe's: 0.9), got {value!r}")
    return float(value)


def sustained_columns(
    arrival_s: Sequence[float],
    finished_s: Sequence[float],
    good: Sequence[bool] | None,
    *,
    slo_attainment: float = DEFAULT_SLO_ATTAINMENT,
    qps: float | None = None,
) -> dict:
    """The run row's SUSTAINED_COLUMNS for n finished requests: arrival_s[i] and finished_s[i] of request i (seconds,
    one clock), good[i] whether it met every SLO of the run (None: the run set no SLO), qps the run's offered rate
    (inf: a burst, never sustained; None: not known, judged by its arrivals). See the module docstring."""
    target = check_slo_attainment(slo_attainment)
    arrivals = np.asarray(arrival_s, dtype=np.float64)
    finishes = np.asarray(finished_s, dtype=np.float64)
    n = arrivals.size
    assert finishes.size == n and (good is None or len(good) == n), "one arrival, finish and verdict per request"
    k = int(math.floor(WINDOW_TRIM * n))
    row = dict.fromkeys(SUSTAINED_COLUMNS) | {"slo_attainment_target": target, "window_requests": n - 2 * k}
    if n - 2 * k < 2:
        return row | {"sustained": False, "not_sustained_reason": f"{n} request(s): too few for a window of two"}
    order = np.argsort(arrivals, kind="stable")  # arrival ranks; ties (a burst) keep the stream's order
    first, last = k, n - 1 - k
    start_s, end_s = float(arrivals[order[first]]), float(arrivals[order[last]])
    row |= {"window_start_s": start_s, "window_end_s": end_s}
    if good is not None:  # the window's requests, by arrival rank
        row["slo_attainment"] = float(np.mean(np.asarray(good, dtype=bool)[order[first : last + 1]]))
    reasons = []
    if qps is not None and math.isinf(qps):  # its window's figures still stand (a session's turns spread out)
        reasons.append("qps=inf: every request offered at once, a burst has no offered rate to sustain")
    if not end_s > start_s:
        if not reasons:
            reasons.append("every request of the window arrived at one instant: a burst has no offered rate to sustain")
    else:
        intervals = last - first  # n - 2k - 1 arrivals (and completions) after the window's first
        offered = intervals / (end_s - start_s)
        done = np.sort(finishes)
        span_s = float(done[last] - done[first])
        achieved = intervals / span_s if span_s > 0 else math.inf
        row |= {"window_offered_qps": offered, "achieved_qps": achieved}
        if achieved < (1 - RATE_TOLERANCE) * offered:
            reasons.append(
                f"achieved {achieved:.3g} req/s < {1 - RATE_TOLERANCE:.0%} of the {offered:.3g} req/s offered in "
                "the window: the server fell behind (saturated)"
            )
        elif achieved > (1 + RATE_TOLERANCE) * offered:
            reasons.append(
                f"achieved {achieved:.3g} req/s > {1 + RATE_TOLERANCE:.0%} of the {offered:.3g} req/s offered in "
                "the window: the server was catching up on a backlog, not in a steady state"
            )
    if row["slo_attainment"] is not None and row["slo_attainment"] < target:
        reasons.append(f"SLO attainment {row['slo_attainment']:.1%} < {target:.0%} of the window's requests")
    return row | {"sustained": not reasons, "not_sustained_reason": "; ".join(reasons) or None}


def from_request_rows(
    requests,
    *,
    ttft_slo_ms: float | None,
    tpot_slo_ms: float | None,
    e2el_slo_ms: float | None,
    slo_attainment: float = DEFAULT_SLO_ATTAINMENT,
    qps: float | None = None,
) -> dict:
    """sustained_columns recomputed from a run's request rows (harness.serve.columns.REQUEST_COLUMNS: arrival_s,
    ttft_ms, tpot_ms, e2el_ms; a pandas frame) under the run row's SLOs (ms; None: not set), for a run row written
    before the verdict was recorded. finish = arrival_s + e2el_ms / 1000, the engine's finished_s to rounding."""
    arrival_s = requests["arrival_s"].to_numpy(dtype=np.float64)
    finished_s = arrival_s + requests["e2el_ms"].to_numpy(dtype=np.float64) / 1000.0
    slos = {"ttft_ms": ttft_slo_ms, "tpot_ms": tpot_slo_ms, "e2el_ms": e2el_slo_ms}
    slos = {column: float(slo) for column, slo in slos.items() if slo is not None and not math.isnan(slo)}
    good = None
    if slos:  # vLLM's rule, as metrics.run_metrics': value <= slo, a one-token output's TPOT (null) counts as 0
        values = {column: requests[column].astype(float).fillna(0.0).to_numpy() for column in slos}
        good = np.logical_and.reduce([values[column] <= slo for column, slo in slos.items()]).tolist()
    return sustained_columns(arrival_s, finished_s, good, slo_attainment=slo_attainment, qps=qps)
