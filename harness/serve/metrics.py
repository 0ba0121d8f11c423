"""What a serving run reports: per-request latencies, and the run's throughput, percentiles and goodput.

Torch-free (numpy and pandas only). The engine fills one `RequestRecord` per finished request, in wall seconds on
one clock; `request_row` turns it into the request's parquet row and `run_metrics` turns them all into the run row.

The figures and their names are vLLM's `vllm bench serve` (vllm/benchmarks/serve.py, `calculate_metrics` and the
result dict it saves), so that a kvbench run and a vLLM run read side by side:
- TTFT runs from arrival (vLLM: from the request being sent), so queueing is inside it; queue_ms is the queueing alone.
- TPOT = (E2EL - TTFT) / (output_len - 1): the decode time per token after the first. A one-token output has no
  TPOT: it is left out of the TPOT statistics and counts as 0 against a TPOT SLO, both as vLLM does.
- ITL statistics pool every gap between successive tokens of every request, as vLLM's `itls +=` does, so a long
  output weighs more than a short one (TPOT weighs each request once).
- std is the population one (numpy's ddof=0) and percentiles are numpy's default (linear interpolation), as vLLM's.
- median_<m>_ms is always there; p50_<m>_ms too when 50 is among the percentiles, as vLLM's output has both.

- max_concurrent_requests counts a request from its arrival to its finish, queueing included, as vLLM's does;
  max_running_requests, which vLLM's client cannot see, counts it from its first admission, as the planner does.

Where kvbench departs from vLLM, it says so where it does (statistics of nothing, goodput without an SLO, the
concurrency peak against vLLM's older per-second form).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from numbers import Real

import numpy as np
import pandas as pd

from harness.errors import ConfigError
from harness.serve.sustained import DEFAULT_SLO_ATTAINMENT, sustained_columns

MS_PER_S = 1000.0
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's selected_percentile_metrics, in its print order
DEFAULT_PERCENTILES = (50, 90, 99)  # issue #16's run row; vLLM's own default is 99 alone
ACCURACY_RUN_COLUMNS = (  # a lossy strategy's accuracy against exact serving (harness.serve.accuracy), null without
    "accuracy_kl_mean",
    "accuracy_kl_p99",
    "accuracy_kl_max",
    "accuracy_top1_agreement",
    "accuracy_tokens",
    "accuracy_requests",
    "accuracy_reference",
)
STRATEGY_RUN_COLUMNS = ("policy", "budget", "obs_window")  # a budgeted strategy's options (evict's), null without
TIER_RUN_COLUMNS = (  # a prefix pool's tiers: their figures (harness.serve.tier_store) and options, null without
    "tier_offloaded_bytes",
    "tier_loaded_bytes",
    "tier_d2h_gbps",
    "tier_h2d_gbps",
    "tier_disk_write_gbps",
    "tier_disk_read_gbps",
    "tier_rejected_blocks",
    "tier_overlap",
    "tier_load_s",
    "tier_load_hidden_s",
    "tier_load_hidden_share",
    "host_gb",
    "disk_dir",
    "disk_gb",
)

# An SLO string's unit, to milliseconds per unit. Lower case only: "200S" or "200Ms" is a typo, not a unit.
SLO_UNIT_MS = {"ms": 1.0, "s": 1000.0, "us": 0.001}
SLO_COLUMNS = {"ttft_slo_ms": "TTFT", "tpot_slo_ms": "TPOT", "e2el_slo_ms": "E2E"}  # the run row's SLOs, as printed
SLO_FORMS = "give a number of milliseconds (200) or a string with a unit: 200ms, 0.2s, 200us"
_SLO_STRING = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-zµ]*)\s*$")


@dataclass(frozen=True)
class RequestRecord:
    """One finished request, as the engine saw it: wall times in seconds on the engine's clock.

    The engine builds it when the request finishes (so a run killed midway still has every finished one), from:
    - arrival_s: when the request entered the waiting queue (its trace or Poisson arrival);
    - first_scheduled_s: when the scheduler first admitted it (queue time = first_scheduled_s - arrival_s);
    - token_times_s: when each output token was produced, the first included, so len() = the output length;
    - finished_s: when the request left the engine (last token, then its blocks freed);
    - prompt_len, prefix_hit_tokens: prompt tokens, and those of them found in the prefix cache (not recomputed);
    - preemptions: how many times it was preempted (recompute or swap) before finishing.

    first_token_s and output_len are read from token_times_s rather than stored beside it, so they cannot disagree.
    """

    request_id: str
    arrival_s: float
    first_scheduled_s: float
    token_times_s: tuple[float, ...]
    finished_s: float
    prompt_len: int
    prefix_hit_tokens: int = 0
    preemptions: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_times_s", tuple(float(t) for t in self.token_times_s))
        for name in ("arrival_s", "first_scheduled_s", "finished_s"):
            object.__setattr__(self, name, float(getattr(self, name)))
        where = f"request {self.request_id!r}"
        if not self.token_times_s:
            raise ConfigError(f"{where}: token_times_s: empty; a finished request has produced at least one token")
        if self.prompt_len < 1:
            raise ConfigError(f"{where}: prompt_len: must be at least 1, got {self.prompt_len}")
        if not 0 <= self.prefix_hit_tokens <= self.prompt_len:
            raise ConfigError(
                f"{where}: prefix_hit_tokens: must be in [0, prompt_len={self.prompt_len}], "
                f"got {self.prefix_hit_tokens}"
            )
        if self.preemptions < 0:
            raise ConfigError(f"{where}: preemptions: must be 0 or more, got {self.preemptions}")
        # The one order a request lives in; a time out of it is the engine's clock misread.
        chain = [("arrival_s", self.arrival_s), ("first_scheduled_s", self.first_scheduled_s)]
        chain += [(f"token_times_s[{i}]", t) for i, t in enumerate(self.token_times_s)]
        chain += [("finished_s", self.finished_s)]
        for name, value in chain:
            if not math.isfinite(value):
                raise ConfigError(f"{where}: {name}: must be a finite time in seconds, got {value}")
        for (name_before, before), (name_after, after) in pairwise(chain):
            if after < before:
                raise ConfigError(
                    f"{where}: {name_after}={after} is before {name_before}={before}; allowed order: arrival_s <= "
                    "first_scheduled_s <= token_times_s (non-decreasing) <= finished_s"
                )

    @property
    def first_token_s(self) -> float:
        return self.token_times_s[0]

    @property
    def output_len(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2el_s(self) -> float:
        return self.finished_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """None for a one-token output: no token after the first to divide by."""
        if self.output_len < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)

    @property
    def itl_s(self) -> list[float]:
        """The gaps between successive tokens: output_len - 1 of them, none for a one-token output."""
        return np.diff(self.token_times_s).tolist()


def request_row(
    record: RequestRecord,
    *,
    session_id: int | None = None,
    turn: int | None = None,
    prefix_hit_tokens_host: int | None = None,
    prefix_hit_tokens_disk: int | None = None,
) -> dict:
    """The request's row of the per-request table (issue #16 item 5), in milliseconds; session_id and turn (from
    1) for a chat session's turn (harness.serve.multiturn), null otherwise. The prefix hits by source: those from
    the host and disk tiers (harness.serve.tiered; null without tiers), the device's the rest of them."""
    tpot_s = record.tpot_s
    from_tiers = (prefix_hit_tokens_host or 0) + (prefix_hit_tokens_disk or 0)
    return {
        "request_id": record.request_id,
        "arrival_s": record.arrival_s,
        "queue_ms": (record.first_scheduled_s - record.arrival_s) * MS_PER_S,
        "ttft_ms": record.ttft_s * MS_PER_S,
        "tpot_ms": None if tpot_s is None else tpot_s * MS_PER_S,
        "itl_ms": [gap * MS_PER_S for gap in record.itl_s],
        "e2el_ms": record.e2el_s * MS_PER_S,
        "prompt_len": record.prompt_len,
        "output_len": record.output_len,
        "prefix_hit_tokens": record.prefix_hit_tokens,
        "prefix_hit_tokens_device": record.prefix_hit_tokens - from_tiers,
        "prefix_hit_tokens_host": prefix_hit_tokens_host,
        "prefix_hit_tokens_disk": prefix_hit_tokens_disk,
        "preemptions": record.preemptions,
        "session_id": session_id,
        "turn": turn,
    }


def parse_slo_ms(value: object, field: str) -> float | None:
    """An SLO in milliseconds: None stays None (no SLO); a number is milliseconds already (the field's name,
    e.g. ttft_slo_ms, carries the unit); a string must carry its unit ("200ms", "0.2s", "200 ms", "1500us").

    A unitless string is refused rather than guessed: "200" from a YAML file or a command line could as well
    have meant seconds, and an SLO off by 1000x passes or fails every request silently (issue #16: "an SLO without
    a unit" is bad input).
    """
    if value is None:
        return None
    if isinstance(value, Real) and not isinstance(value, bool):
        milliseconds = float(value)
    elif isinstance(value, str):
        match = _SLO_STRING.match(value)
        if match is None:
            raise ConfigError(f"{field}: {value!r} is not a duration; {SLO_FORMS}")
        number, unit = match.groups()
        if not unit:
            raise ConfigError(f"{field}: {value!r} has no unit; {SLO_FORMS}")
        if unit not in SLO_UNIT_MS:
            raise ConfigError(f"{field}: {value!r} has an unknown unit {unit!r}; {SLO_FORMS}")
        milliseconds = float(number) * SLO_UNIT_MS[unit]
    else:
        raise ConfigError(f"{field}: {value!r} is not a duration; {SLO_FORMS}")
    if not (math.isfinite(milliseconds) and milliseconds > 0):
        raise ConfigError(
            f"{field}: {value!r} must be a finite positive duration (no SLO: leave it unset); {SLO_FORMS}"
        )
    return milliseconds


def _percentile_key(percentile: float) -> str:
    """vLLM's p_word: 99 -> "99", 99.9 -> "99.9", so that p99_ttft_ms and p99.9_ttft_ms are its keys."""
    return str(int(percentile)) if int(percentile) == percentile else str(percentile)


def _statistics_ms(name: str, samples_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    """mean_, median_, std_ and p<P>_ <name>_ms over samples in seconds.

    No samples (every output one token long, so no TPOT and no ITL) gives None throughout: vLLM reports 0 there
    (`np.mean(tpots or 0)`), which reads as an infinitely fast decode.
    """
    samples_ms = np.asarray(samples_s, dtype=np.float64) * MS_PER_S
    empty = samples_ms.size == 0
    figures = {
        f"mean_{name}_ms": None if empty else float(np.mean(samples_ms)),
        f"median_{name}_ms": None if empty else float(np.median(samples_ms)),
        f"std_{name}_ms": None if empty else float(np.std(samples_ms)),  # ddof=0, as vLLM
    }
    for percentile in percentiles:
        figures[f"p{_percentile_key(percentile)}_{name}_ms"] = (
            None if empty else float(np.percentile(samples_ms, percentile))
        )
    return figures


def _peak_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """The most half-open intervals [start, end) that hold one instant, by an event sweep: at a tie the end is swept
    before the start, so one that ends at the very instant another starts does not overlap it."""
    events = sorted(event for start, end in intervals for event in ((start, +1), (end, -1)))  # (t, -1) < (t, +1)
    return max(0, int(np.cumsum([delta for _, delta in events]).max(initial=0)))


def max_concurrent_requests(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at one instant, each from arrival_s to finished_s: queueing included.

    vLLM's max_concurrent_requests ("Peak concurrent requests"; vllm/benchmarks/serve.py, `calculate_metrics`,
    PR #23867) counts each request from its start_time (sent by the client) to start_time + latency (its last token
    received). Its first form counted a request in every whole second from int(start) to int(end) and took the
    most in one second, which overcounts requests that follow one another within a second (vllm-project/vllm
    issue #56653); its later form (main at 009e6d4a) sweeps the half-open [start, end) exactly, departures before
    arrivals at a tie. Ours is that exact sweep, over the engine's arrival_s (the request's trace or Poisson time,
    no network between) and finished_s: never above the per-second form, equal to the exact one.
    """
    return _peak_overlap((record.arrival_s, record.finished_s) for record in records)


def max_running_requests(records: Sequence[RequestRecord]) -> int:
    """The most requests running at one instant, each from first_scheduled_s to finished_s: queueing left out.

    The figure the planner predicts (harness.serve.budget's predicted_max_running), and for our scheduler exactly
    the most requests running in one iteration (SchedulerOutput.num_running): a request counts from the iteration
    that first admits it to the one that finishes it, and one preempted in between counts on while it waits (its
    record holds no pause), but no request is first admitted meanwhile (it waits at the front of the queue, which
    admits in order), so the peak, reached at a first admission, is that iteration's running count.
    tests/serve/test_serve_metrics.py checks it against the iterations, preemptions included. For the peer
    (harness.serve.peer) it is the same sweep over its scheduler's own admission stamps. vLLM's benchmark, a
    client, has no such figure.
    """
    return _peak_overlap((record.first_scheduled_s, record.finished_s) for record in records)


def run_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    ttft_slo_ms: float | str | None = None,
    tpot_slo_ms: float | str | None = None,
    e2el_slo_ms: float | str | None = None,
    tier_hit_tokens: Mapping[str, int] | None = None,
    slo_attainment: float = DEFAULT_SLO_ATTAINMENT,
    qps: float | None = None,
) -> dict:
    """The run row: counts, throughputs, the latency statistics and goodput, under vLLM's result keys, and whether
    the run sustained its offered rate (harness.serve.sustained: the measured window, its achieved rate and SLO
    attainment against slo_attainment, the verdict and its reason; qps, the offered rate: inf is never sustained).

    duration_s (vLLM's `duration`, seconds) is the run's wall time (first arrival to last finish, or the engine's own
    clock), which every throughput divides. The SLOs take what parse_slo_ms takes and are recorded in the row.
    tier_hit_tokens: the prompt tokens the host and disk tiers served ({"host": n, "disk": n}; None: no tiers, their
    rates and figures null), part of every record's prefix_hit_tokens; the device's are the rest.
    """
    if len(records) == 0:
        raise ConfigError("records: no finished requests; a run's metrics need at least one RequestRecord")
    if not (isinstance(duration_s, Real) and math.isfinite(duration_s) and duration_s > 0):
        raise ConfigError(f"duration_s: must be a positive number of seconds, got {duration_s!r}")
    for percentile in percentiles:
        if not (isinstance(percentile, Real) and 0 <= percentile <= 100):
            raise ConfigError(f"percentiles: each must be a number in [0, 100], got {percentile!r}")
    slos_ms = {
        "ttft": parse_slo_ms(ttft_slo_ms, "ttft_slo_ms"),
        "tpot": parse_slo_ms(tpot_slo_ms, "tpot_slo_ms"),
        "e2el": parse_slo_ms(e2el_slo_ms, "e2el_slo_ms"),
    }

    total_input_tokens = sum(record.prompt_len for record in records)
    total_output_tokens = sum(record.output_len for record in records)
    samples_s = {
        "ttft": [record.ttft_s for record in records],
        "tpot": [record.tpot_s for record in records if record.tpot_s is not None],
        "itl": [gap for record in records for gap in record.itl_s],
        "e2el": [record.e2el_s for record in records],
    }

    # vLLM's goodput (DistServe, Zhong et al. OSDI 2024): a request is good when it meets every SLO given, each
    # as value <= slo; a one-token output's TPOT is 0 there. With no SLO every request is good, so the goodput is
    # the request throughput (vLLM reports None then; a number keeps the column numeric, and the SLO columns,
    # None, say that nothing constrained it).
    def is_good(record: RequestRecord) -> bool:
        value_ms = {
            "ttft": record.ttft_s * MS_PER_S,
            "tpot": (record.tpot_s or 0.0) * MS_PER_S,
            "e2el": record.e2el_s * MS_PER_S,
        }
        return all(value_ms[name] <= slo for name, slo in slos_ms.items() if slo is not None)

    good = [is_good(record) for record in records]
    good_completed = sum(good)

    row = {
        "duration_s": float(duration_s),
        "completed": len(records),
        "total_input_tokens": total_input_tokens,
        "total_output_tokens": total_output_tokens,
        "request_throughput": len(records) / duration_s,  # req/s
        "request_goodput": good_completed / duration_s,  # req/s
        "ttft_slo_ms": slos_ms["ttft"],
        "tpot_slo_ms": slos_ms["tpot"],
        "e2el_slo_ms": slos_ms["e2el"],
        "output_throughput": total_output_tokens / duration_s,  # tok/s
        "total_token_throughput": (total_input_tokens + total_output_tokens) / duration_s,  # tok/s
    }
    for name in LATENCY_METRICS:
        row.update(_statistics_ms(name, samples_s[name], percentiles))
    row["max_concurrent_requests"] = max_concurrent_requests(records)  # in flight: queueing included, as vLLM's
    row["max_running_requests"] = max_running_requests(records)  # running: what the planner predicts
    row["total_preemptions"] = sum(record.preemptions for record in records)
    # Every prompt has at least one token (RequestRecord checks), so the rate is always defined; a run without a
    # prefix cache reads 0.0.
    hit_tokens = sum(record.prefix_hit_tokens for record in records)
    row["prefix_hit_rate"] = hit_tokens / total_input_tokens
    from_tiers = dict.fromkeys(("host", "disk")) if tier_hit_tokens is None else tier_hit_tokens
    row["prefix_hit_rate_device"] = (hit_tokens - sum(n or 0 for n in from_tiers.values())) / total_input_tokens
    for source, tokens in from_tiers.items():
        row[f"prefix_hit_rate_{source}"] = None if tokens is None else tokens / total_input_tokens
    any_slo = any(slo is not None for slo in slos_ms.values())
    row |= sustained_columns([record.arrival_s for record in records], [record.finished_s for record in records],
                             good if any_slo else None, slo_attainment=slo_attainment, qps=qps)  # fmt: skip
    # harness.serve.run fills them from its tiers, its strategy's options and a lossy strategy's accuracy pass
    return row | dict.fromkeys((*TIER_RUN_COLUMNS, *STRATEGY_RUN_COLUMNS, *ACCURACY_RUN_COLUMNS))


def knee(
    points: Iterable[Mapping] | pd.DataFrame,
    slo_ms: float | str,
    *,
    metric: str = "p99_ttft_ms",
    x: str = "qps",
    sustained: str = "sustained",
) -> float | None:
    """The saturation knee (issue #16 item 8, issue #30 item 2): the highest x (qps) below which every point
    sustained its rate and kept metric at or under the SLO.

    The points are walked up in x, and the knee is the last one before the first that breaks the SLO or was not
    sustained (its `sustained` column not True: harness.serve.sustained, the achieved rate within 5% of the offered
    one and the SLO attainment met; null, unknown, is not sustained): a finite stream lets a saturated server finish
    inside a loose SLO, and a point that meets it again above a failure is noise on an overloaded server, not
    capacity. A missing metric (None, NaN: a run that failed) breaks the SLO. None when the lowest x already breaks
    it. Points without a `sustained` column (a hand-made list) are judged on the metric alone; every kvbench run row
    has one (harness.serve.rows.read_run_table recomputes it for rows written before it).
    """
    frame = points if isinstance(points, pd.DataFrame) else pd.DataFrame(list(points))
    if frame.empty:
        raise ConfigError("points: empty; the knee needs at least one measured point")
    limit_ms = parse_slo_ms(slo_ms, "slo_ms")
    if limit_ms is None:
        raise ConfigError(f"slo_ms: the knee needs an SLO; {SLO_FORMS}")
    for field, column in (("x", x), ("metric", metric)):
        if column not in frame.columns:
            raise ConfigError(
                f"{field}: no column {column!r} in the points; columns: {', '.join(map(str, frame.columns))}"
            )
    ordered = frame.sort_values(x, kind="stable")
    held = ordered[sustained] if sustained in frame.columns else pd.Series(True, index=ordered.index)
    highest = None
    for x_value, value, ok in zip(ordered[x], ordered[metric], held, strict=True):
        # NaN compares False, so a failed run breaks the SLO; a null verdict (None, pd.NA) is not a sustained one
        if value is None or not value <= limit_ms or not (isinstance(ok, bool | np.bool_) and ok):
            break
        highest = float(x_value)
    return highest
