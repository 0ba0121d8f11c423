"""The Serving page's qps charts and the sustained verdict (issue #30 item 2): a point that did not sustain its rate
is hollow with its reason in the hover, and the knee star never stands on one, over the runs of
tests/serve/serve_runs.py (paged keeps its p99 TTFT under the SLO up to 256 req/s, but finishes 162 of the 236
offered there: not sustained; contiguous falls behind from 64).
"""

from __future__ import annotations

import pandas as pd
import pytest

from dashboard import serve_data
from dashboard.charts.serving import (
    NOT_SUSTAINED_NOTE,
    NOT_SUSTAINED_SYMBOL,
    SUSTAINED_SYMBOL,
    goodput_vs_qps,
    qps_curves,
)
from tests.dashboard.charts_rows import annotation_texts, trace_names
from tests.serve.serve_runs import QPS, TTFT_SLO_MS, write_sweep


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> pd.DataFrame:
    folder = tmp_path_factory.mktemp("results")
    write_sweep(folder)
    loaded, skipped = serve_data.load_runs((str(folder),))
    assert skipped == []
    return loaded


def lines(fig, name: str) -> list:
    return [t for t in fig.data if t.name == name]


def test_a_point_not_sustained_is_hollow_with_its_reason_in_the_hover(runs):
    paged = runs[runs["strategy"] == "paged"].sort_values("qps")
    assert paged["sustained"].tolist() == [True, True, True, False]  # the fixture: 256 req/s is saturated
    for fig in (qps_curves(runs, slo_ms=TTFT_SLO_MS), goodput_vs_qps(runs)):
        for trace in lines(fig, "paged / fp32"):
            assert list(trace.x) == list(QPS)
            assert list(trace.marker.symbol) == [SUSTAINED_SYMBOL] * 3 + [NOT_SUSTAINED_SYMBOL]
            assert trace.customdata[0].startswith("sustained: achieved ")
            assert trace.customdata[3] == "not sustained: " + paged["not_sustained_reason"].iloc[3]
            assert "the server fell behind (saturated)" in trace.customdata[3]
        assert NOT_SUSTAINED_NOTE in annotation_texts(fig)


def test_the_knee_stands_on_the_last_sustained_point_not_on_a_saturated_one_inside_the_slo(runs):
    paged = runs[runs["strategy"] == "paged"]
    assert (paged["p99_ttft_ms"] <= TTFT_SLO_MS).all()  # the old rule would star 256
    names = trace_names(qps_curves(runs, slo_ms=TTFT_SLO_MS))
    assert "knee, paged / fp32: qps 64" in names and "knee, paged / fp32: qps 256" not in names


def test_a_run_without_a_verdict_is_drawn_hollow_as_unknown(runs):
    unknown = runs.assign(sustained=None, not_sustained_reason=None)
    fig = qps_curves(unknown, slo_ms=TTFT_SLO_MS)
    (throughput, _) = lines(fig, "paged / fp32")
    assert set(throughput.marker.symbol) == {NOT_SUSTAINED_SYMBOL}
    assert throughput.customdata[0] == "not sustained: unknown (no verdict recorded)"
    assert not [name for name in trace_names(fig) if name.startswith("knee")]  # unknown is not sustained
