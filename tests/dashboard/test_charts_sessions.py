"""The Serving page's multi-turn charts (dashboard/charts/sessions.py) over a small chat-session run: two sessions of
three turns, each turn's prompt its history, the later turns' history served from the prefix cache."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from dashboard.charts.sessions import (
    NO_TURNS,
    hit_rate_by_turn,
    hit_tokens_by_source,
    session_runs,
    ttft_by_turn,
    turn_ttft,
)
from tests.dashboard.charts_rows import annotation_texts, trace, trace_names

PROMPT_LENS = {1: 100, 2: 200, 3: 400}  # tokens: each turn's prompt holds the turn before it
HITS = {1: 0, 2: 96, 3: 192}  # tokens served from the prefix cache (block-aligned history)


def session_requests(run_id: str = "chat") -> pd.DataFrame:
    """Two sessions of three turns; session 1 is slower, so p50 and p99 of a turn differ."""
    rows = [
        dict(
            run_id=run_id, request_id=str(3 * session + turn - 1), session_id=session, turn=turn,
            ttft_ms=10.0 * turn + 5.0 * session, prompt_len=PROMPT_LENS[turn], prefix_hit_tokens=HITS[turn],
        )
        for session in (0, 1)
        for turn in (1, 2, 3)
    ]  # fmt: skip
    return pd.DataFrame(rows)


def session_run(run_id: str = "chat", *, recorded: bool = True) -> pd.DataFrame:
    """The run row: dataset sharegpt-multiturn and, when recorded, its TTFT by turn as the run writes it."""
    by_turn = {
        str(turn): {"count": 2, "p50": 10.0 * turn + 2.5, "p99": 10.0 * turn + 4.95} for turn in PROMPT_LENS
    }  # numpy's linear percentiles of (10 t, 10 t + 5)
    return pd.DataFrame(
        [
            dict(
                run_id=run_id, strategy="prefix", kv_dtype="bf16", qps=4.0, dataset="sharegpt-multiturn",
                ttft_ms_by_turn=json.dumps(by_turn) if recorded else None,
            )
        ]
    )  # fmt: skip


def single_turn() -> tuple[pd.DataFrame, pd.DataFrame]:
    runs = pd.DataFrame([dict(run_id="flat", strategy="paged", kv_dtype="bf16", qps=4.0, dataset="random")])
    requests = session_requests("flat").assign(session_id=None, turn=None)
    return runs, requests


def test_the_ttft_by_turn_is_the_run_rows_p50_and_p99_per_turn():
    fig = ttft_by_turn(session_run(), session_requests())
    assert trace_names(fig) == ["p50, prefix / bf16 / qps 4", "p99, prefix / bf16 / qps 4"]
    p50, p99 = trace(fig, "p50, prefix / bf16 / qps 4"), trace(fig, "p99, prefix / bf16 / qps 4")
    assert list(p50.x) == [1, 2, 3] and list(p50.y) == [12.5, 22.5, 32.5]
    assert list(p99.y) == pytest.approx([14.95, 24.95, 34.95]) and p99.line.dash == "dash"
    assert "turn" in fig.layout.xaxis.title.text


def test_without_the_run_rows_figures_the_ttft_by_turn_is_recomputed_from_the_requests_alike():
    requests = session_requests()
    recomputed = turn_ttft(session_run(recorded=False).iloc[0], requests)
    recorded = turn_ttft(session_run().iloc[0], requests)
    pd.testing.assert_frame_equal(recomputed, recorded, check_dtype=False)
    turn_2 = requests.loc[requests["turn"] == 2, "ttft_ms"].to_numpy()
    assert recomputed.loc[1, "p99"] == pytest.approx(np.percentile(turn_2, 99))


def test_the_hit_rate_by_turn_is_hit_tokens_over_prompt_tokens_all_the_devices_without_tier_columns():
    fig = hit_rate_by_turn(session_requests(), run="prefix / bf16 / qps 4")
    assert trace_names(fig) == ["device"]
    device = trace(fig, "device")
    assert list(device.x) == [1, 2, 3] and list(device.y) == pytest.approx([0.0, 96 / 200, 192 / 400])
    assert fig.layout.barmode == "stack" and fig.layout.title.text.endswith("prefix / bf16 / qps 4")


def test_the_hit_rate_by_turn_is_stacked_by_source_where_the_rows_have_the_tier_columns():
    requests = session_requests().assign(
        prefix_hit_tokens_device=[0, 64, 128] * 2, prefix_hit_tokens_host=[0, 32, 32] * 2,
        prefix_hit_tokens_disk=[0, 0, 32] * 2,
    )  # fmt: skip
    fig = hit_rate_by_turn(requests)
    assert trace_names(fig) == ["device", "host", "disk"]
    assert list(trace(fig, "host").y) == pytest.approx([0.0, 32 / 200, 32 / 400])
    total = sum(np.asarray(trace(fig, source).y) for source in ("device", "host", "disk"))
    assert list(total) == pytest.approx([0.0, 96 / 200, 192 / 400])  # the stack is every hit


def test_host_and_disk_columns_without_a_device_one_leave_the_device_the_rest_of_the_hits():
    requests = session_requests().assign(prefix_hit_tokens_host=[0, 32, 32] * 2)
    by_source = hit_tokens_by_source(requests)
    assert list(by_source.columns) == ["device", "host"]
    assert by_source["device"].tolist()[:3] == [0, 64, 160]


def test_a_single_turn_run_is_no_session_run_and_draws_no_multi_turn_chart():
    runs, requests = single_turn()
    assert session_runs(runs).empty
    assert session_runs(pd.concat([runs, session_run()], ignore_index=True))["run_id"].tolist() == ["chat"]
    for fig in (ttft_by_turn(runs, requests), hit_rate_by_turn(requests)):
        assert not fig.data and NO_TURNS in annotation_texts(fig)
