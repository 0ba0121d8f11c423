"""The latency charts (dashboard/charts/latency.py): TTFT, inter-token latency, TPOT percentiles."""

from __future__ import annotations

import numpy as np

from dashboard.charts.latency import itl_curves, peak_memory_vs_prompt, tpot_percentiles, ttft_vs_prompt
from tests.dashboard.charts_rows import frame, point, trace, trace_names

# -------------------------------------------------------------------------------------------------------- latency


def test_ttft_vs_prompt_draws_one_line_per_cache_and_batch():
    rows = frame(
        point(prompt_len=32, ttft_ms=5.0),
        point(prompt_len=512, ttft_ms=50.0),
        point(prompt_len=32, ttft_ms=9.0, batch_size=4),
        point(prompt_len=32, ttft_ms=7.0, cache="none"),
    )
    fig = ttft_vs_prompt(rows)
    assert trace_names(fig) == ["contiguous, batch 1", "contiguous, batch 4", "none, batch 1"]
    assert list(trace(fig, "contiguous, batch 1").y) == [5.0, 50.0]
    assert fig.layout.xaxis.title.text == "prompt length (tokens)" and fig.layout.yaxis.title.text.endswith("(ms)")


def test_peak_memory_vs_prompt_draws_eager_and_sdpa_attention_as_two_lines_in_mib():
    mib = 2**20
    rows = frame(
        point(prompt_len=1024, peak_mem_bytes=900 * mib, attn_impl="sdpa"),
        point(prompt_len=2048, peak_mem_bytes=950 * mib, attn_impl="sdpa"),
        point(prompt_len=1024, peak_mem_bytes=1000 * mib, attn_impl="eager"),
        point(prompt_len=2048, peak_mem_bytes=1400 * mib, attn_impl="eager"),
    )
    fig = peak_memory_vs_prompt(rows)
    eager, fused = (next(t for t in fig.data if name in t.name) for name in ("eager", "sdpa"))
    assert list(eager.y) == [1000.0, 1400.0] and list(fused.y) == [900.0, 950.0]
    assert fig.layout.yaxis.title.text == "peak memory (MiB)"


def test_itl_curves_draw_each_step_of_each_row_from_step_1():
    fig = itl_curves(frame(point(itl_ms=[1.0, 2.0, 3.0], cache="none"), point(itl_ms=None)))
    assert trace_names(fig) == ["none, prompt 512, batch 1"]
    assert list(fig.data[0].x) == [1, 2, 3] and list(fig.data[0].y) == [1.0, 2.0, 3.0]


def test_itl_curves_keep_at_most_max_lines_longest_prompts_first():
    rows = frame(*(point(prompt_len=p) for p in (32, 2048, 128, 512)))
    fig = itl_curves(rows, max_lines=2)
    assert trace_names(fig) == ["contiguous, prompt 2048, batch 1", "contiguous, prompt 512, batch 1"]


def test_itl_curves_name_the_kv_dtype_when_it_varies():
    fig = itl_curves(frame(point(kv_dtype="int8"), point()))
    assert trace_names(fig) == ["int8 contiguous, prompt 512, batch 1", "bf16 contiguous, prompt 512, batch 1"]


def test_itl_curves_read_numpy_arrays_as_lists():
    assert list(itl_curves(frame(point(itl_ms=np.array([4.0, 5.0])))).data[0].y) == [4.0, 5.0]


def test_tpot_percentiles_are_grouped_bars_of_median_p90_and_p99_per_point():
    fig = tpot_percentiles(frame(point(), point(cache="paged", tpot_ms=20.0)))
    assert trace_names(fig) == ["median", "p90", "p99"] and fig.layout.barmode == "group"
    assert list(trace(fig, "median").x) == ["contiguous", "paged"] and list(trace(fig, "median").y) == [10.0, 20.0]


def test_ttft_vs_prompt_never_draws_one_line_through_two_workloads():
    rows = frame(point(ttft_ms=5.0), point(ttft_ms=9.0, gen_len=256), point(ttft_ms=7.0, dtype="fp32"))
    fig = ttft_vs_prompt(rows)
    assert len(fig.data) == 3 and sorted(y for t in fig.data for y in t.y) == [5.0, 7.0, 9.0]


def test_ttft_vs_prompt_draws_a_point_not_to_trust_with_an_open_marker():
    rows = frame(point(prompt_len=32, converged=False), point(prompt_len=512, converged=None))
    line = ttft_vs_prompt(rows).data[0]
    assert list(line.marker.symbol) == ["circle-open", "circle"]
    assert list(line.hovertext) == ["not converged", "-"]


def test_tpot_percentiles_never_combine_two_workloads_into_one_bar():
    fig = tpot_percentiles(frame(point(prefix_len=0), point(prefix_len=128, tpot_ms=30.0), point(prefix_len=0)))
    assert sorted(trace(fig, "median").y) == [10.0, 30.0]  # prefix 0 twice (one point, its median), prefix 128


def test_latency_charts_name_the_rows_not_to_trust_and_never_a_null():
    rows = frame(point(host_busy=True), point(cache="paged", host_busy=None, converged=None))
    assert list(trace(tpot_percentiles(rows), "median").x) == ["contiguous (host busy)", "paged"]
    assert trace_names(itl_curves(rows)) == [
        "contiguous, prompt 512, batch 1 (host busy)",
        "paged, prompt 512, batch 1",
    ]
