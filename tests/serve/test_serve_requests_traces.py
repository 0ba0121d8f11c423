"""The request stream a serving run replays (harness.serve.requests): traces read from JSONL and CSV, token ids, its
summary (describe), and that it imports without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import ConfigError
from harness.serve.requests import (
    Request,
    RequestSpec,
    describe,
    generate,
    prompt_token_ids,
    read_trace,
)
from tests.serve.test_serve_requests import one_line_error

ROOT = Path(__file__).resolve().parents[2]


# --- traces ---


def write_jsonl(path, records) -> None:
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in records))


def test_a_jsonl_trace_round_trips(tmp_path):
    requests = generate(RequestSpec(num_prompts=40, qps=7.0, prompt_dist="uniform", prompt_spread=0.5, prefix_len=16))
    path = tmp_path / "requests.jsonl"
    write_jsonl(path, [{k: v for k, v in vars(r).items() if k != "request_id"} for r in requests])
    assert read_trace(path) == requests  # floats round-trip exactly through json's repr


def test_a_csv_trace_round_trips(tmp_path):
    requests = generate(RequestSpec(num_prompts=40, qps=7.0, output_dist="lognormal", output_spread=0.5))
    path = tmp_path / "requests.csv"
    rows = [f"{r.arrival_s!r},{r.prompt_len},{r.output_len},{r.prefix_len}" for r in requests]
    path.write_text("\n".join(["arrival_s,prompt_len,output_len,prefix_len", *rows]) + "\n")
    assert read_trace(path) == requests


def test_a_trace_without_prefix_len_shares_nothing_and_may_carry_other_keys(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [{"arrival_s": 0, "prompt_len": 5, "output_len": 2, "tenant": "a"}, "\n"])
    assert read_trace(path) == [Request(request_id=0, arrival_s=0.0, prompt_len=5, output_len=2, prefix_len=0)]


GOOD = {"arrival_s": 0.5, "prompt_len": 10, "output_len": 4}


@pytest.mark.parametrize(
    ("bad_line", "match"),
    [
        ('{"arrival_s": 1.0, "prompt_len": 10,\n', r"line 3: not valid JSON"),
        ({"arrival_s": 1.0, "prompt_len": 10}, r"line 3: missing output_len"),
        ({**GOOD, "prompt_len": "abc"}, r"line 3: prompt_len must be a positive integer, got 'abc'$"),
        ({**GOOD, "prompt_len": 12.5}, r"line 3: prompt_len must be a positive integer, got 12.5$"),
        ({**GOOD, "output_len": -3}, r"line 3: output_len must be a positive integer, got -3$"),
        ({**GOOD, "arrival_s": -1}, r"line 3: arrival_s must be a number of seconds >= 0"),
        ({**GOOD, "arrival_s": 0.1}, r"line 3: arrival_s 0.1 is before the previous line's 0.5"),
        ({**GOOD, "prefix_len": 10}, r"line 3: prefix_len must be below prompt_len=10, got 10$"),
        ([1, 2, 3], r"line 3: must be a JSON object"),
    ],
)
def test_a_malformed_jsonl_line_is_named_by_its_number(tmp_path, bad_line, match):
    path = tmp_path / "requests.jsonl"
    write_jsonl(path, [GOOD, "\n", bad_line, GOOD])  # line 2 is blank: numbers are the file's lines
    with pytest.raises(ConfigError, match=rf"^trace: .*requests\.jsonl {match}") as excinfo:
        read_trace(path)
    one_line_error(excinfo)


def test_a_malformed_csv_cell_is_named_by_its_line(tmp_path):
    path = tmp_path / "requests.csv"
    path.write_text("arrival_s,prompt_len,output_len\n0,10,4\n1,ten,4\n")
    with pytest.raises(ConfigError, match=r"requests\.csv line 3: prompt_len must be a positive integer, got 'ten'$"):
        read_trace(path)


def test_a_csv_header_without_a_column_is_refused(tmp_path):
    path = tmp_path / "requests.csv"
    path.write_text("arrival_s,prompt_len\n0,10\n")
    with pytest.raises(ConfigError, match=r"requests\.csv line 1: the header lacks output_len") as excinfo:
        read_trace(path)
    one_line_error(excinfo)


def test_a_trace_request_over_max_model_len_is_refused(tmp_path):
    path = tmp_path / "requests.jsonl"
    write_jsonl(path, [GOOD, {**GOOD, "prompt_len": 100}])
    assert len(read_trace(path, max_model_len=104)) == 2
    with pytest.raises(ConfigError, match=r"line 2: prompt_len \+ output_len = 104 tokens, over max_model_len=103"):
        read_trace(path, max_model_len=103)


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("requests.txt", "", r"^trace: .*requests\.txt: the suffix must be one of \.jsonl, \.csv, got '\.txt'$"),
        ("absent.jsonl", None, r"^trace: .*absent\.jsonl: no such file$"),
        ("empty.jsonl", "\n\n", r"^trace: .*empty\.jsonl: holds no requests$"),
        ("empty.csv", "arrival_s,prompt_len,output_len\n", r"^trace: .*empty\.csv: holds no requests$"),
    ],
)
def test_a_trace_that_is_not_there_or_holds_nothing_is_refused(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match) as excinfo:
        read_trace(path)
    one_line_error(excinfo)


# --- token ids ---


def test_random_prompts_share_the_prefix_and_differ_after_it():
    requests = generate(RequestSpec(num_prompts=8, prompt_len=64, prefix_len=24))
    ids = prompt_token_ids(requests, vocab_size=32000, seed=0)
    assert [len(prompt) for prompt in ids] == [64] * 8
    assert len({tuple(prompt[:24]) for prompt in ids}) == 1
    assert len({tuple(prompt[24:]) for prompt in ids}) == 8  # 40 ids alike by chance: odds 32000^-40
    assert all(0 <= token < 32000 for prompt in ids for token in prompt)


def test_requests_with_different_prefix_lens_share_their_common_part():
    requests = [
        Request(request_id=i, arrival_s=0.0, prompt_len=20, output_len=1, prefix_len=p) for i, p in [(0, 4), (1, 9)]
    ]
    short, long = prompt_token_ids(requests, vocab_size=1000, seed=3)
    assert short[:4] == long[:4]


def test_token_ids_are_seeded():
    requests = generate(RequestSpec(num_prompts=4, prompt_len=32, prefix_len=8))
    assert prompt_token_ids(requests, vocab_size=500, seed=1) == prompt_token_ids(requests, vocab_size=500, seed=1)
    assert prompt_token_ids(requests, vocab_size=500, seed=1) != prompt_token_ids(requests, vocab_size=500, seed=2)


def test_text_prompts_are_the_texts_start_then_a_window_of_the_text():
    text = list(range(1000, 1300))  # distinct ids: a window is found by its first id
    requests = generate(
        RequestSpec(num_prompts=6, prompt_len=50, prompt_dist="uniform", prompt_spread=0.5, prefix_len=10)
    )
    ids = prompt_token_ids(requests, vocab_size=2000, seed=0, text_ids=text)
    for request, prompt in zip(requests, ids, strict=True):
        assert len(prompt) == request.prompt_len
        assert prompt[:10] == text[:10]
        start = text.index(prompt[10])
        assert prompt[10:] == text[start : start + request.prompt_len - 10]
    assert len({prompt[10] for prompt in ids}) > 1  # the offsets are drawn, not all the same


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (list(range(63)), r"^text_ids: 63 tokens, shorter than the longest prompt \(64 tokens\)"),
        ([[1, 2], [3, 4]], r"^text_ids: must be a 1-D sequence of integer token ids"),
        ([0.5] * 100, r"^text_ids: must be a 1-D sequence of integer token ids"),
        (list(range(95, 195)), r"^text_ids: ids must lie in \[0, vocab_size=100\), got 194$"),
    ],
)
def test_a_bad_text_is_refused(text, match):
    requests = generate(RequestSpec(num_prompts=3, prompt_len=64))
    with pytest.raises(ConfigError, match=match) as excinfo:
        prompt_token_ids(requests, vocab_size=100, seed=0, text_ids=text)
    one_line_error(excinfo)


def test_a_bad_vocab_size_is_refused():
    with pytest.raises(ConfigError, match=r"^vocab_size: must be an integer >= 1, got 0$"):
        prompt_token_ids(generate(RequestSpec(num_prompts=1, prompt_len=4)), vocab_size=0)


# --- summary ---


def test_describe_counts_the_stream_and_its_offered_rate():
    requests = generate(RequestSpec(num_prompts=100, qps=8.0, prompt_len=30, output_len=5, prefix_len=3))
    summary = describe(requests)
    assert summary["num_requests"] == 100
    assert summary["offered_qps"] == pytest.approx(8.0, rel=1e-12)
    assert summary["total_prompt_tokens"] == 3000 and summary["total_output_tokens"] == 500
    assert summary["max_total_len"] == 35 and summary["max_prefix_len"] == 3


def test_the_request_stream_imports_without_torch():
    # A fresh interpreter: this one has torch already (tests/conftest.py). The stream is drawn before any model loads.
    probe = "import sys, harness.serve.requests; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
