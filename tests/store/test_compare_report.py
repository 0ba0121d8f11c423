"""`kvbench-results compare A B` (harness/store/compare.py, pairing.py, cli.py): pairs by workload key, the markdown and
CSV reports, --fail-on, the CLI's exit codes, and the default pair of sweeps."""

from __future__ import annotations

import io

import pandas as pd
import pytest

from harness.store import cli, compare, disk, pairing
from tests.store.test_compare import (
    FAST_PROMPT,
    KNOWN,
    NOISY_PROMPT,
    ONLY_A_PROMPT,
    ONLY_B_PROMPT,
    SAME_PROMPT,
    SLOW_PROMPT,
    result_sets,
    row,
    samples,
    verdict_of,
)


@pytest.fixture
def sweep_dirs(tmp_path):
    """A and B written as sweep folders with harness.store.disk.write_point, as a sweep leaves them."""
    a, b = result_sets()
    for name, rows in (("a", a), ("b", b)):
        for record in rows.to_dict("records"):
            disk.write_point(record, tmp_path / name)
    return tmp_path / "a", tmp_path / "b"


# --------------------------------------------------------------------------------------------------------- pairing


def test_keys_on_one_side_only_are_listed_not_dropped():
    comparison = compare.compare(*result_sets())
    assert sorted(comparison.verdicts["prompt_len"]) == sorted(KNOWN)
    assert comparison.only_a["prompt_len"].tolist() == [ONLY_A_PROMPT]  # B's oom row there does not pair
    assert comparison.only_b["prompt_len"].tolist() == [ONLY_B_PROMPT]
    assert f"prompt_len={ONLY_A_PROMPT}" in comparison.only_a["workload"].iloc[0]


def test_nulls_in_the_key_pair_with_nulls_only():
    tpot = samples(10.0, 0.01, seed=3)
    a = pd.DataFrame([row("a-1", prompt_len=512, tpot=tpot, block_size=None)])
    b = pd.DataFrame([row("b-1", prompt_len=512, tpot=tpot, block_size=None), row("b-2", prompt_len=512, tpot=tpot)])
    b.loc[1, "block_size"] = 16
    pairs = pairing.pair(a, b)
    assert pairs.b["point_id"].tolist() == ["b-1"] and pairs.only_b["block_size"].tolist() == [16]


def test_of_several_rows_for_one_key_the_latest_is_taken_and_said():
    tpot = samples(10.0, 0.01, seed=3)
    a = pd.DataFrame([row("a-1", prompt_len=512, tpot=tpot)])
    b = pd.DataFrame(
        [
            row("b-new", prompt_len=512, tpot=tpot, started_at="2026-12-02T00:00:00"),
            row("b-old", prompt_len=512, tpot=tpot, started_at="2026-12-01T00:00:00"),
        ]
    )
    pairs = pairing.pair(a, b)
    assert pairs.b["point_id"].tolist() == ["b-new"]
    (note,) = pairs.notes
    assert note.startswith("B: 2 rows for ") and "took the latest by started_at" in note


# --------------------------------------------------------------------------------------------------------- outputs


def test_markdown_has_a_header_with_sources_and_counts_then_one_line_per_pair():
    comparison = compare.compare(*result_sets())
    text = compare.to_markdown(comparison, a_name="results/main", b_name="results/branch")
    header, blank, columns, rule, *table = text.splitlines()
    assert header.startswith("**kvbench compare** tpot_ms") and "A = results/main, B = results/branch" in header
    assert "4 pairs: 1 FAST, 1 SLOW, 1 SAME, 1 AMBIGUOUS; 1 only in A, 1 only in B" in header
    assert columns.startswith("| workload | A (ms) | B (ms) | B/A | CI | threshold | verdict |")
    pair_lines = [line for line in table if line.startswith("| ")]
    assert len(pair_lines) == len(KNOWN)
    slow = next(
        line for line in pair_lines if line.startswith(f"| cache=contiguous kv_dtype=bf16 prompt_len={SLOW_PROMPT} |")
    )
    assert "**SLOW**" in slow and "±2.0%" in slow
    assert f"- only in A: cache=contiguous kv_dtype=bf16 prompt_len={ONLY_A_PROMPT}" in table


def test_csv_has_one_line_per_pair_with_the_verdict_and_the_key():
    comparison = compare.compare(*result_sets())
    lines = pd.read_csv(io.StringIO(compare.to_csv(comparison)))
    assert list(lines.columns[: len(compare.VERDICT_COLUMNS)]) == list(compare.VERDICT_COLUMNS)
    assert dict(zip(lines["prompt_len"], lines["verdict"], strict=True)) == {
        FAST_PROMPT: "FAST",
        SLOW_PROMPT: "SLOW",
        SAME_PROMPT: "SAME",
        NOISY_PROMPT: "AMBIGUOUS",
    }


def test_fails_on_a_slow_pair_past_fail_on_only():
    comparison = compare.compare(*result_sets())
    assert compare.fails(comparison) and compare.fails(comparison, fail_on=0.2)
    assert not compare.fails(comparison, fail_on=0.5)


def test_fails_on_a_throughput_drop_past_fail_on_only():
    comparison = compare.compare(*result_sets(), metric="decode_tok_s")  # the SLOW pair: 1/1.3 the throughput
    assert compare.fails(comparison, fail_on=0.2) and not compare.fails(comparison, fail_on=0.5)


# ------------------------------------------------------------------------------------------------------------- cli


def test_cli_compare_exits_1_on_a_slow_pair_and_prints_markdown(sweep_dirs, capsys):
    a, b = sweep_dirs
    assert cli.main(["compare", str(a), str(b)]) == 1
    printed = capsys.readouterr().out
    assert printed.startswith("**kvbench compare**") and "**SLOW**" in printed and "**AMBIGUOUS**" in printed


def test_cli_compare_exits_0_with_a_fail_on_above_the_slow_down(sweep_dirs):
    a, b = sweep_dirs
    assert cli.main(["compare", str(a), str(b), "--fail-on", "0.5"]) == 0


def test_cli_compare_exits_0_when_nothing_is_slower(sweep_dirs):
    a, b = sweep_dirs
    assert cli.main(["compare", str(a), str(a)]) == 0


def test_cli_compare_writes_csv_to_out(sweep_dirs, tmp_path, capsys):
    a, b = sweep_dirs
    out = tmp_path / "verdicts.csv"
    assert cli.main(["compare", str(a), str(b), "--format", "csv", "--out", str(out), "--fail-on", "1"]) == 0
    assert sorted(pd.read_csv(out)["verdict"]) == ["AMBIGUOUS", "FAST", "SAME", "SLOW"]
    assert "4 pairs" in capsys.readouterr().out


def test_cli_compare_calls_a_busy_b_ambiguous_and_exits_0_unless_trust_noisy(tmp_path, capsys):
    # The case: every B row host_busy, and the slowed point printed SLOW with a tight interval.
    a, b = result_sets()
    for name, rows in (("a", a), ("b", b.assign(host_busy=True))):
        for record in rows.to_dict("records"):
            disk.write_point(record, tmp_path / name)
    sides = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert cli.main(["compare", *sides]) == 0
    printed = capsys.readouterr().out
    assert "**SLOW**" not in printed and "4 pairs: 0 FAST, 0 SLOW, 0 SAME, 4 AMBIGUOUS" in printed
    assert "| verdict | reason | note |" in printed and printed.count("| **AMBIGUOUS** | B host_busy |") == 4
    assert cli.main(["compare", *sides, "--trust-noisy"]) == 1
    printed = capsys.readouterr().out
    assert "**SLOW**" in printed and "| **SLOW** |  | B host_busy |" in printed


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--metric", "e2e_ms"], "--metric: 'e2e_ms' is not one of tpot_ms, ttft_ms, decode_tok_s"),
        (["--threshold", "x"], "--threshold: 'x' is not a number"),
        (["--format", "json"], "--format: 'json' is not one of md, csv"),
        (["--confidence", "95"], "--confidence: must be in (0, 1)"),
    ],
)
def test_cli_compare_exits_2_on_a_bad_option_with_one_line(sweep_dirs, caplog, option, message):
    a, b = sweep_dirs
    assert cli.main(["compare", str(a), str(b), *option]) == 2
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert message in record.getMessage() and "\n" not in record.getMessage()


def test_cli_compare_exits_2_on_a_missing_or_empty_side(sweep_dirs, tmp_path, capsys, caplog):
    a, _ = sweep_dirs
    assert cli.main(["compare", str(a), str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"kvbench-results compare: {tmp_path / 'nowhere'}: no such file or directory\n"
    (tmp_path / "empty").mkdir()
    assert cli.main(["compare", str(tmp_path / "empty"), str(a)]) == 2
    assert "A: no result rows under" in caplog.text


# ------------------------------------------------------------------------------------------- the default pair


def test_best_pair_is_the_two_sweeps_sharing_the_most_keys_older_first():
    a, b = result_sets()  # sweeps "a" and "b" share the four KNOWN keys
    lone = pd.DataFrame([row("z-1", prompt_len=ONLY_B_PROMPT, tpot=samples(10.0, 0.01, seed=9))])  # newest, 1 key
    assert pairing.best_pair(pd.concat([a, b, lone], ignore_index=True)) == ("a", "b")


def test_best_pair_is_none_when_no_two_sweeps_share_a_key():
    a, _ = result_sets()
    lone = pd.DataFrame([row("z-1", prompt_len=ONLY_B_PROMPT, tpot=samples(10.0, 0.01, seed=9))])
    assert pairing.best_pair(pd.concat([a, lone], ignore_index=True)) is None


def test_a_pair_measured_on_different_devices_or_a_busy_host_is_noted():
    a, b = result_sets()
    a["device_name"], b["device_name"] = "AMD EPYC", "Intel Xeon"
    b["host_busy"] = True
    note = verdict_of(compare.compare(a, b, trust_noisy=True), SAME_PROMPT)["note"]
    assert "A ran on AMD EPYC, B ran on Intel Xeon" in note and "B host_busy" in note
    a["device_name"], b["device_name"] = "AMD EPYC", "AMD EPYC"  # one name, two machines: their ISA tells them apart
    a["cpu_capability"], b["cpu_capability"] = "AVX512", "AVX2"
    assert "A dispatched to AVX512, B dispatched to AVX2" in verdict_of(compare.compare(a, b), SAME_PROMPT)["note"]
    a["device_name"], a["cpu_capability"] = None, None  # not recorded: no device note
    note = verdict_of(compare.compare(a, b), SAME_PROMPT)["note"]
    assert "ran on" not in note and "dispatched" not in note
