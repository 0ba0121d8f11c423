"""A/B verdicts: did B make each point faster, slower, or neither? (`kvbench-results compare A B`, the dashboard's
Compare page.)

    kvbench-results compare results/main/ results/branch/ --metric tpot_ms --fail-on 0.05

The ok rows of A and B are paired by the workload key (schema.POINT_KEY_COLUMNS; harness/store/pairing.py). For each
pair the ratio B/A of the metric's medians gets a bootstrap confidence interval from the per-repeat samples
(harness.measure.stats.ratio_ci), and a verdict, after nvbench's compare script (NVIDIA/nvbench, scripts/nvbench_compare.py,
compare_benches): there a relative difference of the mean times within the smaller of the two sides' relative noise
(sd / mean of the samples) is SAME, beyond it FAST or SLOW by its sign, and a pair without a noise figure on either
side is "????" (unknown); its --threshold-diff only hides small differences from the table. Here SAME is nvbench's
rule with a band that the threshold given widens, and FAST or SLOW need the whole interval past the band; what is
past the band but not wholly is AMBIGUOUS:

    t = max(threshold, NOISE_FACTOR × the larger side's median_rse)
    SAME       the ratio lies within [1 - t, 1 + t]: no change beyond what a rerun or the threshold allows
    SLOW       the whole interval lies above 1 + t    (FAST for a higher-is-better metric, decode_tok_s)
    FAST       the whole interval lies below 1 - t    (SLOW for a higher-is-better metric)
    AMBIGUOUS  the ratio is past the band but its interval reaches back into it (the noise overlaps the change),
               or there is no spread to judge by, or a side is host_busy or not converged (below)

A point compared with itself is SAME, whatever the spread of its samples.

A pair whose either side was measured on a busy host (host_busy) or stopped before its repeats converged
(converged false) is AMBIGUOUS whatever its interval, and its `reason` says which ("B host_busy", "A not
converged"). The measurement itself flagged such a row: a busy host's steal can shift every repeat at once (a
tight interval around a shifted median), and a row that did not converge stopped with its noise above its target,
so no interval on their samples is evidence of a change. trust_noisy (`--trust-noisy`, the Compare page's "trust
noisy rows") gives such a pair its plain verdict, and the flags move to its note. A flag not recorded (null: an
older row) is no flag.

Torch-free (numpy, pandas), so that the dashboard computes the very verdicts the command prints.
"""

from __future__ import annotations

import io
import math
import statistics
from dataclasses import dataclass

import numpy as np
import pandas as pd

from harness.measure import stats
from harness.store.pairing import pair, workload_labels
from harness.store.schema import POINT_KEY_COLUMNS

FAST, SLOW, SAME, AMBIGUOUS = "FAST", "SLOW", "SAME", "AMBIGUOUS"
VERDICTS = (FAST, SLOW, SAME, AMBIGUOUS)
# A relative difference below 2% is not worth a verdict: it is about the run-to-run drift of a median TPOT on one
# quiet machine (turbo and cache state), and nvbench's users gate on 2 to 5% for the same reason.
DEFAULT_THRESHOLD = 0.02
# The band is also at least two standard errors of the noisier median (2 ~ the 95% normal quantile, 1.96). The
# bootstrap's error of a median at the 3 to 20 repeats of a point runs above the normal 1.2533·sd/√n (its resampled
# medians take a few values only), so reruns of one distribution land inside the band about 92% of the time (60
# simulated pairs of 10 repeats at 5% and 10% noise: 55 SAME, 5 AMBIGUOUS, none FAST or SLOW), while a 30% change in
# 10% noise is SLOW three times in four and never SAME.
NOISE_FACTOR = 2.0
DEFAULT_CONFIDENCE = 0.95
MEDIAN_SE_FACTOR = math.sqrt(math.pi / 2)  # 1.2533: the standard error of a normal sample's median, in sd/√n
FORMATS = ("md", "csv")


@dataclass(frozen=True)
class Metric:
    column: str  # the row's median figure
    samples_column: str  # its per-repeat samples (a list column)
    higher_is_better: bool
    unit: str
    # Where a row without samples (older than the list columns) recorded its spread: tpot_rse, else tpot_cv with
    # repeats. TTFT has none.
    recorded_spread: bool = True


METRICS = {
    "tpot_ms": Metric("tpot_ms", "tpot_samples_ms", higher_is_better=False, unit="ms"),
    "ttft_ms": Metric("ttft_ms", "ttft_samples_ms", higher_is_better=False, unit="ms", recorded_spread=False),
    # Per repeat, batch_size × 1000 / tpot_ms (harness.measure.timing.summarize's decode_tok_s, one repeat at a time).
    "decode_tok_s": Metric("decode_tok_s", "tpot_samples_ms", higher_is_better=True, unit="tok/s"),
}
VERDICT_COLUMNS = (
    "workload",
    "a_median",
    "b_median",
    "ratio",
    "ci_low",
    "ci_high",
    "threshold",
    "verdict",
    "reason",  # why a flagged pair is AMBIGUOUS whatever its interval; empty otherwise
    "note",
    "a_point_id",
    "b_point_id",
)


def check_options(*, metric: str, threshold: float, confidence: float, fail_on: float = 0.0) -> None:
    """ValueError, one line naming the argument and its allowed values, before any row is read."""
    if metric not in METRICS:
        raise ValueError(f"--metric: {metric!r} is not one of {', '.join(METRICS)}")
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"--threshold: must be a fraction >= 0 (0.02 is 2%), got {threshold}")
    if not 0 < confidence < 1:
        raise ValueError(f"--confidence: must be in (0, 1), e.g. 0.95, got {confidence}")
    if not (math.isfinite(fail_on) and fail_on >= 0):
        raise ValueError(f"--fail-on: must be a fraction >= 0 (0.05 tolerates 5%), got {fail_on}")


# ------------------------------------------------------------------------------------------------------ verdicts


@dataclass(frozen=True)
class Comparison:
    metric: str
    verdicts: pd.DataFrame  # VERDICT_COLUMNS, then the key columns; one line per pair
    only_a: pd.DataFrame  # the key columns and a workload label, per key A alone has
    only_b: pd.DataFrame
    notes: tuple[str, ...]

    def counts(self) -> dict[str, int]:
        found = self.verdicts["verdict"].value_counts()
        return {verdict: int(found.get(verdict, 0)) for verdict in VERDICTS}


def compare(
    a_rows: pd.DataFrame,
    b_rows: pd.DataFrame,
    *,
    metric: str = "tpot_ms",
    threshold: float = DEFAULT_THRESHOLD,
    confidence: float = DEFAULT_CONFIDENCE,
    trust_noisy: bool = False,
) -> Comparison:
    """Pair A's and B's ok rows and give each pair its ratio B/A, interval, threshold and verdict (AMBIGUOUS for a
    pair with a host_busy or not converged side, unless trust_noisy)."""
    check_options(metric=metric, threshold=threshold, confidence=confidence)
    spec = METRICS[metric]
    pairs = pair(a_rows, b_rows)
    lines, measured = [], []
    for (_, a), (_, b) in zip(pairs.a.iterrows(), pairs.b.iterrows(), strict=True):
        # A pair without the metric on a side (a point that was not timed: fragmentation, capacity) has nothing
        # to compare; nvbench's compare skips such states too.
        measured.append(_has_metric(a, spec) and _has_metric(b, spec))
        if measured[-1]:
            lines.append(
                _compare_one(a, b, spec=spec, threshold=threshold, confidence=confidence, trust_noisy=trust_noisy)
            )
    unmeasured = measured.count(False)
    notes = pairs.notes + ((f"{unmeasured} pairs left out: no {metric} on one side or both",) if unmeasured else ())
    keys = pairs.a.loc[measured, list(POINT_KEY_COLUMNS)].reset_index(drop=True)
    # One labelling of every key, paired or not, so that a key reads the same in the table and the unpaired list.
    labels = workload_labels(pd.concat([keys, pairs.only_a, pairs.only_b], ignore_index=True)).to_numpy()
    ends = np.cumsum([len(keys), len(pairs.only_a)])
    verdicts = pd.DataFrame(lines, columns=[c for c in VERDICT_COLUMNS if c != "workload"])
    verdicts.insert(0, "workload", pd.Series(labels[: ends[0]], dtype=object))
    verdicts = pd.concat([verdicts, keys], axis=1)
    only_a = pairs.only_a.assign(workload=labels[ends[0] : ends[1]])
    only_b = pairs.only_b.assign(workload=labels[ends[1] :])
    return Comparison(metric=metric, verdicts=verdicts, only_a=only_a, only_b=only_b, notes=notes)


def verdict(*, ratio: float, low: float, high: float, threshold: float, higher_is_better: bool = False) -> str:
    """The verdict of a ratio B/A and its interval [low, high] against the band [1 - threshold, 1 + threshold]."""
    if not all(math.isfinite(value) for value in (ratio, low, high, threshold)):
        return AMBIGUOUS
    if abs(ratio - 1) <= threshold:
        return SAME
    if low > 1 + threshold:
        return FAST if higher_is_better else SLOW
    if high < 1 - threshold:
        return SLOW if higher_is_better else FAST
    return AMBIGUOUS


def _compare_one(
    a: pd.Series, b: pd.Series, *, spec: Metric, threshold: float, confidence: float, trust_noisy: bool
) -> dict:
    samples_a, samples_b = _samples(a, spec), _samples(b, spec)
    # converged and host_busy: null is "not recorded" (rows older than the columns), never a flag
    flags = [f"{side} not converged" for side, row in (("A", a), ("B", b)) if _recorded_false(row.get("converged"))]
    flags += [f"{side} host_busy" for side, row in (("A", a), ("B", b)) if _recorded_true(row.get("host_busy"))]
    held = bool(flags) and not trust_noisy  # the verdict held back as AMBIGUOUS, the flags its reason
    notes = [] if held else flags
    for column, what in (("device_name", "ran on"), ("cpu_capability", "dispatched to")):
        values = [row.get(column) for row in (a, b)]
        if all(isinstance(value, str) for value in values) and values[0] != values[1]:  # a null: not recorded
            notes.append(f"A {what} {values[0]}, B {what} {values[1]}")
    if samples_a is not None and samples_b is not None:
        median_a, median_b = float(np.median(samples_a)), float(np.median(samples_b))
        ratio, low, high = stats.ratio_ci(samples_a, samples_b, confidence=confidence)
        noise = max(stats.median_rse(samples_a), stats.median_rse(samples_b))
    else:
        # Older rows keep no samples: a normal approximation on log(ratio) from each side's recorded spread.
        (median_a, rse_a), (median_b, rse_b) = _median_and_rse(a, samples_a, spec), _median_and_rse(b, samples_b, spec)
        ratio = median_b / median_a if median_a > 0 else math.nan
        noise = max(rse_a, rse_b)
        z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
        spread = z * math.sqrt(rse_a**2 + rse_b**2)
        low, high = ratio * math.exp(-spread), ratio * math.exp(spread)
        notes.append("no samples: normal approximation from tpot_rse or tpot_cv")
        if not math.isfinite(noise):
            missing = [side for side, rse in (("A", rse_a), ("B", rse_b)) if not math.isfinite(rse)]
            fallback = ", tpot_rse or tpot_cv" if spec.recorded_spread else ""
            notes[-1] = f"no spread recorded for {' and '.join(missing)} (no {spec.samples_column}{fallback})"
    band = max(threshold, NOISE_FACTOR * noise)
    plain = verdict(ratio=ratio, low=low, high=high, threshold=band, higher_is_better=spec.higher_is_better)
    return {
        "a_median": median_a,
        "b_median": median_b,
        "ratio": ratio,
        "ci_low": low,
        "ci_high": high,
        "threshold": band,
        "verdict": AMBIGUOUS if held else plain,
        "reason": "; ".join(flags) if held else "",
        "note": "; ".join(notes),
        "a_point_id": a.get("point_id"),
        "b_point_id": b.get("point_id"),
    }


def _has_metric(row: pd.Series, spec: Metric) -> bool:
    return _samples(row, spec) is not None or math.isfinite(_number(row.get(spec.column)))


def _samples(row: pd.Series, spec: Metric) -> list[float] | None:
    """The row's per-repeat samples in the metric's unit; None when fewer than two were kept (nothing to
    resample)."""
    values = row.get(spec.samples_column)
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) < 2:  # null: an older row
        return None
    values = [float(v) for v in values]
    if spec.column == "decode_tok_s":
        return [float(row["batch_size"]) * 1e3 / tpot_ms for tpot_ms in values]
    return values


def _median_and_rse(row: pd.Series, samples: list[float] | None, spec: Metric) -> tuple[float, float]:
    """The row's median and the relative standard error of it: from its samples, else from tpot_rse, else
    MEDIAN_SE_FACTOR × tpot_cv / √repeats; inf when none is recorded. decode_tok_s takes TPOT's: a reciprocal has
    the same relative error, to first order."""
    if samples is not None:
        return float(np.median(samples)), stats.median_rse(samples)
    median = _number(row.get(spec.column))
    if not spec.recorded_spread:
        return median, math.inf
    rse, cv, repeats = _number(row.get("tpot_rse")), _number(row.get("tpot_cv")), _number(row.get("repeats"))
    if math.isfinite(rse):
        return median, rse
    if math.isfinite(cv) and repeats >= 2:
        return median, MEDIAN_SE_FACTOR * cv / math.sqrt(repeats)
    return median, math.inf


def _recorded_false(value: object) -> bool:
    return value is not None and not pd.isna(value) and not bool(value)


def _recorded_true(value: object) -> bool:
    return value is not None and not pd.isna(value) and bool(value)


def _number(value: object) -> float:
    try:
        return math.nan if value is None or pd.isna(value) else float(value)
    except (TypeError, ValueError):
        return math.nan


# ------------------------------------------------------------------------------------------------------- outputs


def fails(comparison: Comparison, *, fail_on: float = 0.0) -> bool:
    """Some SLOW pair is slower than 1 + fail_on times A (for decode_tok_s: A's throughput over B's)."""
    slow = comparison.verdicts[comparison.verdicts["verdict"] == SLOW]
    slowdown = 1 / slow["ratio"] if METRICS[comparison.metric].higher_is_better else slow["ratio"]
    return bool((slowdown > 1 + fail_on).any())


def summary_line(comparison: Comparison, *, a_name: str, b_name: str) -> str:
    counts = ", ".join(f"{n} {verdict}" for verdict, n in comparison.counts().items())
    return (
        f"{comparison.metric}, B/A: A = {a_name}, B = {b_name}; {len(comparison.verdicts)} pairs: {counts}; "
        f"{len(comparison.only_a)} only in A, {len(comparison.only_b)} only in B"
    )


def to_markdown(comparison: Comparison, *, a_name: str, b_name: str) -> str:
    """For a PR comment: a header line with the sources and the counts, then one table line per pair, then the
    unpaired keys and the pairing notes."""
    unit = METRICS[comparison.metric].unit
    lines = [f"**kvbench compare** {summary_line(comparison, a_name=a_name, b_name=b_name)}", ""]
    if len(comparison.verdicts):
        lines += [
            f"| workload | A ({unit}) | B ({unit}) | B/A | CI | threshold | verdict | reason | note |",
            "|---|---:|---:|---:|---|---:|---|---|---|",
        ]
        for line in comparison.verdicts.itertuples(index=False):
            lines.append(
                f"| {_cell(line.workload)} | {line.a_median:.4g} | {line.b_median:.4g} | {line.ratio:.3f} | "
                f"[{line.ci_low:.3f}, {line.ci_high:.3f}] | ±{line.threshold:.1%} | **{line.verdict}** | "
                f"{_cell(line.reason)} | {_cell(line.note)} |"
            )
    else:
        lines.append("No pairs: no ok row of A has the workload key of an ok row of B.")
    for side, unpaired in (("A", comparison.only_a), ("B", comparison.only_b)):
        lines += [f"- only in {side}: {label}" for label in unpaired["workload"]]
    lines += [f"- {note}" for note in comparison.notes]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", r"\|")  # a bare pipe would split the Markdown cell


def to_csv(comparison: Comparison) -> str:
    """One line per pair: VERDICT_COLUMNS, then the key columns."""
    buffer = io.StringIO()
    comparison.verdicts.to_csv(buffer, index=False)
    return buffer.getvalue()
