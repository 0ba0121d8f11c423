"""The profile charts (dashboard/charts/profile.py): the profiler's shares and one point's top ops."""

from __future__ import annotations

import pandas as pd
import pytest

from dashboard.charts.profile import PROFILE_CATEGORIES, profile_shares, top_ops
from tests.dashboard.charts_rows import frame, point, trace, trace_names

# -------------------------------------------------------------------------------------------------------- profile


def test_profile_categories_are_the_profilers():
    from harness.measure.profile import CATEGORIES

    assert PROFILE_CATEGORIES == CATEGORIES


def test_profile_shares_stack_the_six_shares_median_per_prompt_len():
    shares = dict.fromkeys((f"prof_{c}_frac" for c in PROFILE_CATEGORIES), 0.0)
    rows = frame(
        point(prompt_len=32, **(shares | {"prof_gemm_frac": 0.8, "prof_attention_frac": 0.2})),
        point(prompt_len=32, **(shares | {"prof_gemm_frac": 0.6, "prof_attention_frac": 0.4})),
        point(prompt_len=4096, **(shares | {"prof_gemm_frac": 0.2, "prof_attention_frac": 0.8})),
    )
    fig = profile_shares(rows)
    assert trace_names(fig) == list(PROFILE_CATEGORIES) and fig.layout.barmode == "stack"
    assert list(trace(fig, "gemm").x) == ["32", "4096"] and list(trace(fig, "gemm").y) == pytest.approx([0.7, 0.2])
    assert fig.layout.yaxis.title.text == "share of step time" and list(fig.layout.yaxis.range) == [0, 1]


def test_profile_shares_rejects_an_unknown_by():
    with pytest.raises(ValueError, match="prompt_len, batch_size"):
        profile_shares(frame(point()), by="cache")


def test_profile_shares_by_batch_size_titles_its_axis():
    assert profile_shares(frame(point()), by="batch_size").layout.xaxis.title.text == "batch size (sequences)"


def top_ops_table() -> pd.DataFrame:
    return pd.DataFrame(
        dict(
            op=["aten::mm", "aten::bmm", "aten::add", "aten::softmax", "aten::argmax"],
            category=["gemm", "attention", "norm_elementwise", "attention", "sampling"],
            self_time_ms=[5.0, 3.0, 1.0, 2.0, 0.5],
            calls=[10, 10, 10, 10, 1],
            share=[0.4, 0.25, 0.1, 0.15, 0.05],
        )
    )


def test_top_ops_draws_the_n_biggest_coloured_by_category_biggest_on_top():
    fig = top_ops(top_ops_table(), n=3)
    assert sorted(trace_names(fig)) == ["attention", "gemm"]
    assert list(trace(fig, "attention").y) == ["aten::bmm", "aten::softmax"]
    assert list(fig.layout.yaxis.categoryarray) == ["aten::softmax", "aten::bmm", "aten::mm"]
    assert all(t.orientation == "h" for t in fig.data)


def test_top_ops_and_profile_shares_colour_a_category_alike():
    bars = trace(top_ops(top_ops_table()), "attention")
    assert bars.marker.color == trace(profile_shares(frame(point())), "attention").marker.color


def test_top_ops_refuses_a_table_of_several_points():
    table = top_ops_table().assign(point_id=["a", "a", "b", "b", "b"])
    with pytest.raises(ValueError, match="one point"):
        top_ops(table)
