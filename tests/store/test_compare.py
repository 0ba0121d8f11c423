"""`kvbench-results compare A B` (harness/store/compare.py): FAST / SLOW / SAME / AMBIGUOUS verdicts on synthetic
result sets whose differences are known, their spread, notes and flags."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from harness.store import compare

REPEATS = 10
# Per prompt_len, the known truth: (A's TPOT, B's TPOT, relative noise of one repeat) in ms, ms, fraction.
FAST_PROMPT, SLOW_PROMPT, SAME_PROMPT, NOISY_PROMPT = 128, 256, 512, 1024
KNOWN = {
    FAST_PROMPT: (10.0, 7.0, 0.01),  # a 30% speed-up
    SLOW_PROMPT: (10.0, 13.0, 0.01),  # a 30% slow-down
    SAME_PROMPT: (10.0, 10.0, 0.005),  # one distribution, tight
    NOISY_PROMPT: (10.0, 12.2, 0.10),  # a 22% shift in 10% noise: past the band, its interval reaching back into it
}
ONLY_A_PROMPT, ONLY_B_PROMPT = 2048, 4096


def samples(median_ms: float, noise: float, *, seed: int) -> list[float]:
    """REPEATS per-repeat TPOTs around median_ms, normal with a relative sd of `noise` (seeded)."""
    return list(median_ms * (1 + noise * np.random.default_rng(seed).standard_normal(REPEATS)))


def row(point_id: str, *, prompt_len: int, tpot: list[float] | None, **overrides) -> dict:
    """One ok row of small bf16 contiguous on a CPU, batch 2."""
    return {
        "point_id": point_id,
        "sweep_id": point_id.split("-")[0],
        "status": "ok",
        "model": "small",
        "weights": "dummy",
        "device": "cpu",
        "dtype": "bf16",
        "kv_dtype": "bf16",
        "cache": "contiguous",
        "batch_size": 2,
        "prompt_len": prompt_len,
        "gen_len": 32,
        "prefix_len": 0,
        "lengths": "fixed",
        "compile": "none",
        "runner": "kvbench",
        "tpot_ms": float(np.median(tpot)) if tpot else None,
        "tpot_samples_ms": tpot,
        "ttft_samples_ms": tpot,
        "repeats": len(tpot) if tpot else None,
        "started_at": "2026-12-01T10:00:00",
    } | overrides


def result_sets() -> tuple[pd.DataFrame, pd.DataFrame]:
    """A and B: the four KNOWN pairs, one key only in A, one only in B, and a failed row in B (ignored)."""
    a, b = [], []
    for i, (prompt_len, (a_ms, b_ms, noise)) in enumerate(KNOWN.items()):
        a.append(row(f"a-{prompt_len}", prompt_len=prompt_len, tpot=samples(a_ms, noise, seed=i)))
        b.append(row(f"b-{prompt_len}", prompt_len=prompt_len, tpot=samples(b_ms, noise, seed=100 + i)))
    a.append(row("a-only", prompt_len=ONLY_A_PROMPT, tpot=samples(10.0, 0.01, seed=7)))
    b.append(row("b-only", prompt_len=ONLY_B_PROMPT, tpot=samples(10.0, 0.01, seed=8)))
    b.append(row("b-oom", prompt_len=ONLY_A_PROMPT, tpot=None, status="oom"))
    return pd.DataFrame(a), pd.DataFrame(b)


def verdict_of(comparison: compare.Comparison, prompt_len: int) -> pd.Series:
    (line,) = comparison.verdicts[comparison.verdicts["prompt_len"] == prompt_len].itertuples(index=False)
    return pd.Series(line._asdict())


# -------------------------------------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize(
    ("prompt_len", "expected"),
    [(FAST_PROMPT, "FAST"), (SLOW_PROMPT, "SLOW"), (SAME_PROMPT, "SAME"), (NOISY_PROMPT, "AMBIGUOUS")],
)
def test_each_known_difference_gets_its_verdict(prompt_len, expected):
    line = verdict_of(compare.compare(*result_sets()), prompt_len)
    assert line["verdict"] == expected
    a_ms, b_ms, noise = KNOWN[prompt_len]
    assert line["ci_low"] <= line["ratio"] <= line["ci_high"]
    # the ratio's standard error is about 1.25 × noise × √(2 / 10 repeats) = 0.56 × noise: 3 × noise is 5 of them
    assert line["ratio"] == pytest.approx(b_ms / a_ms, rel=3 * noise)
    assert line["a_point_id"] == f"a-{prompt_len}" and line["b_point_id"] == f"b-{prompt_len}"


def test_the_noisy_pair_is_ambiguous_because_its_interval_crosses_the_band_edge():
    line = verdict_of(compare.compare(*result_sets()), NOISY_PROMPT)
    band = line["threshold"]
    assert band > compare.DEFAULT_THRESHOLD  # the samples' own noise widened it
    assert line["ci_low"] < 1 + band < line["ci_high"] or line["ci_low"] < 1 - band < line["ci_high"]


def test_tight_pairs_use_the_threshold_given_as_the_band():
    comparison = compare.compare(*result_sets(), threshold=0.05)
    assert verdict_of(comparison, SAME_PROMPT)["threshold"] == 0.05


def test_a_threshold_above_the_change_makes_it_same():
    assert verdict_of(compare.compare(*result_sets(), threshold=0.5), SLOW_PROMPT)["verdict"] == "SAME"


@pytest.mark.parametrize(
    ("ratio", "low", "high", "expected"),
    [
        (1.00, 0.99, 1.01, "SAME"),
        (1.015, 0.95, 1.09, "SAME"),  # inside the band, whatever the interval
        (1.06, 1.03, 1.10, "SLOW"),
        (0.93, 0.90, 0.97, "FAST"),
        (1.03, 1.01, 1.05, "AMBIGUOUS"),  # past the band, but the interval reaches back into it
        (0.95, 0.90, 1.10, "AMBIGUOUS"),
        (math.nan, math.nan, 1.0, "AMBIGUOUS"),
    ],
)
def test_verdict_places_the_ratio_and_its_interval_against_the_band(ratio, low, high, expected):
    assert compare.verdict(ratio=ratio, low=low, high=high, threshold=0.02) == expected


@pytest.mark.parametrize("noise", [0.01, 0.05, 0.20])
def test_a_point_compared_with_itself_is_same_whatever_its_noise(noise):
    a = pd.DataFrame([row("a-1", prompt_len=1, tpot=samples(10.0, noise, seed=5))])
    assert verdict_of(compare.compare(a, a), 1)["verdict"] == "SAME"


def test_reruns_of_one_distribution_are_mostly_same_and_never_fast_or_slow():
    # 40 pairs of independent draws from one distribution (5% noise): the band of NOISE_FACTOR = 2 bootstrap
    # standard errors holds about 92% of them (compare.py's NOISE_FACTOR); FAST or SLOW would be a false alarm.
    verdicts = []
    for seed in range(40):
        a = pd.DataFrame([row("a-1", prompt_len=1, tpot=samples(10.0, 0.05, seed=seed))])
        b = pd.DataFrame([row("b-1", prompt_len=1, tpot=samples(10.0, 0.05, seed=1000 + seed))])
        verdicts.append(verdict_of(compare.compare(a, b), 1)["verdict"])
    assert "FAST" not in verdicts and "SLOW" not in verdicts
    assert verdicts.count("SAME") >= 32  # 80%: below the 92% expected, far above a coin


def test_a_higher_is_better_metric_flips_fast_and_slow():
    assert compare.verdict(ratio=1.15, low=1.1, high=1.2, threshold=0.02, higher_is_better=True) == "FAST"
    comparison = compare.compare(*result_sets(), metric="decode_tok_s")
    fast, slow = verdict_of(comparison, FAST_PROMPT), verdict_of(comparison, SLOW_PROMPT)
    # decode_tok_s per repeat = batch_size × 1000 / tpot_ms: B's 30% lower TPOT is 1/0.7 the throughput
    assert fast["verdict"] == "FAST" and fast["ratio"] == pytest.approx(1 / 0.7, rel=0.03)
    assert slow["verdict"] == "SLOW" and slow["ratio"] == pytest.approx(1 / 1.3, rel=0.03)
    assert fast["a_median"] == pytest.approx(2 * 1000 / 10.0, rel=0.03)


def test_ttft_compares_the_ttft_samples():
    a, b = result_sets()
    b["ttft_samples_ms"] = [[2 * x for x in values] if values else None for values in b["ttft_samples_ms"]]
    comparison = compare.compare(a, b, metric="ttft_ms")
    assert verdict_of(comparison, SAME_PROMPT)["verdict"] == "SLOW"
    assert verdict_of(comparison, SAME_PROMPT)["ratio"] == pytest.approx(2.0, rel=0.02)


def test_rows_without_samples_fall_back_on_tpot_rse_with_a_note():
    a = pd.DataFrame([row("a-old", prompt_len=512, tpot=None, tpot_ms=10.0, tpot_rse=0.005)])
    b = pd.DataFrame([row("b-old", prompt_len=512, tpot=None, tpot_ms=13.0, tpot_cv=0.01, repeats=5)])
    (line,) = compare.compare(a, b).verdicts.to_dict("records")
    assert line["verdict"] == "SLOW" and line["ratio"] == pytest.approx(1.3)
    assert line["ci_low"] < 1.3 < line["ci_high"] and "normal approximation" in line["note"]


def test_a_row_without_samples_or_spread_is_ambiguous_and_says_why():
    a = pd.DataFrame([row("a-old", prompt_len=512, tpot=None, tpot_ms=10.0)])
    b = pd.DataFrame([row("b-new", prompt_len=512, tpot=samples(20.0, 0.01, seed=1))])
    (line,) = compare.compare(a, b).verdicts.to_dict("records")
    assert line["verdict"] == "AMBIGUOUS" and "no spread recorded for A" in line["note"]


def test_a_row_with_samples_beside_one_without_uses_both_spreads_in_the_approximation():
    a = pd.DataFrame([row("a-old", prompt_len=512, tpot=None, tpot_ms=10.0, tpot_rse=0.005)])
    b = pd.DataFrame([row("b-new", prompt_len=512, tpot=samples(13.0, 0.01, seed=1))])
    (line,) = compare.compare(a, b).verdicts.to_dict("records")
    assert line["verdict"] == "SLOW" and "normal approximation" in line["note"]


def test_ttft_without_samples_has_no_recorded_spread():
    a = pd.DataFrame([row("a-old", prompt_len=512, tpot=None, ttft_ms=50.0, tpot_rse=0.005)])
    (line,) = compare.compare(a, a, metric="ttft_ms").verdicts.to_dict("records")
    assert line["verdict"] == "AMBIGUOUS" and line["note"] == "no spread recorded for A and B (no ttft_samples_ms)"


def test_a_pair_without_the_metric_is_left_out_and_counted_in_a_note():
    a = pd.DataFrame([row("a-untimed", prompt_len=512, tpot=None)])  # a fragmentation point: no timing
    b = pd.DataFrame([row("b-untimed", prompt_len=512, tpot=None)])
    comparison = compare.compare(a, b)
    assert comparison.verdicts.empty and comparison.notes == ("1 pairs left out: no tpot_ms on one side or both",)


def test_a_side_that_did_not_converge_is_noted():
    a, b = result_sets()
    b["converged"] = pd.array([False] + [None] * (len(b) - 1), dtype="boolean")  # null: not recorded, no note
    comparison = compare.compare(a, b, trust_noisy=True)
    assert verdict_of(comparison, FAST_PROMPT)["note"] == "B not converged"
    assert verdict_of(comparison, SLOW_PROMPT)["note"] == ""


@pytest.mark.parametrize(
    ("a_flags", "b_flags", "reason"),
    [
        ({}, {"host_busy": True}, "B host_busy"),
        ({"converged": False}, {}, "A not converged"),
        (
            {"converged": False},
            {"host_busy": True, "converged": False},
            "A not converged; B not converged; B host_busy",
        ),
    ],
    ids=["B-busy", "A-not-converged", "every-flag"],
)
def test_a_pair_with_a_busy_host_or_an_unconverged_side_is_ambiguous_with_the_reason(a_flags, b_flags, reason):
    a, b = result_sets()
    a, b = a.assign(**a_flags), b.assign(**b_flags)
    comparison = compare.compare(a, b)
    for prompt_len in KNOWN:  # SLOW, FAST and SAME alike: a busy or unsettled machine makes none of them trustworthy
        line = verdict_of(comparison, prompt_len)
        assert line["verdict"] == "AMBIGUOUS" and line["reason"] == reason
    assert "host_busy" not in verdict_of(comparison, SLOW_PROMPT)["note"]  # said once, in the reason


def test_an_unrecorded_flag_leaves_the_verdict_alone():
    a, b = result_sets()
    b["host_busy"] = pd.array([None] * len(b), dtype="boolean")  # null: rows older than the column
    b["converged"] = pd.array([None] * len(b), dtype="boolean")
    line = verdict_of(compare.compare(a, b), SLOW_PROMPT)
    assert line["verdict"] == "SLOW" and line["reason"] == ""


def test_trust_noisy_gives_a_flagged_pair_its_plain_verdict_and_keeps_the_flag_in_the_note():
    a, b = result_sets()
    b["host_busy"] = True
    line = verdict_of(compare.compare(a, b, trust_noisy=True), SLOW_PROMPT)
    assert line["verdict"] == "SLOW" and line["reason"] == "" and line["note"] == "B host_busy"


def test_bad_options_are_refused_with_one_line_naming_them():
    with pytest.raises(ValueError, match=r"--metric: 'e2e' is not one of tpot_ms, ttft_ms, decode_tok_s"):
        compare.compare(*result_sets(), metric="e2e")
    with pytest.raises(ValueError, match=r"--threshold: must be a fraction >= 0"):
        compare.compare(*result_sets(), threshold=-0.1)
