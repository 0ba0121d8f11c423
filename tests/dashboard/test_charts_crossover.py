"""The batch sweep and the crossover caption (dashboard/charts/crossover.py): lines, markers, B*, the knee, S*."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from dashboard.charts.crossover import NO_BATCH_SWEEP, batch_sweep, crossover_caption
from tests.dashboard.charts_rows import annotation_texts, frame, point, sweep, trace, trace_names

# ---------------------------------------------------------------------------------------------------- batch sweep


def test_batch_sweep_leaves_out_configs_measured_at_one_batch():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}), sweep({2: 10.0}, cache="paged")], ignore_index=True)
    assert [name for name in trace_names(batch_sweep(rows)) if "paged" in name] == []
    fig = batch_sweep(sweep({2: 10.0}, cache="paged"))
    assert not fig.data and NO_BATCH_SWEEP in annotation_texts(fig)


def test_batch_sweep_rejects_an_unknown_metric_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="decode_tok_s, tpot_ms"):
        batch_sweep(sweep({1: 10.0}), metric="ttft_ms")


def test_batch_sweep_draws_one_line_per_prompt_len_on_a_log2_batch_axis():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}, prompt_len=32), sweep({1: 10.0, 2: 10.0})], ignore_index=True)
    fig = batch_sweep(rows)
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == ["prompt 32", "prompt 512"]
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis.dtick == pytest.approx(math.log10(2))
    assert list(lines[0].x) == [1.0, 2.0]


def test_batch_sweep_names_the_config_when_several_are_present():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}), sweep({1: 10.0, 2: 10.0}, cache="paged")], ignore_index=True)
    names = trace_names(batch_sweep(rows))
    assert "contiguous, prompt 512" in names and "paged, prompt 512" in names


def test_batch_sweep_throughput_and_tpot_axes_say_their_units():
    assert "tok/s" in batch_sweep(sweep({1: 10.0}), metric="decode_tok_s").layout.yaxis.title.text
    assert "(ms)" in batch_sweep(sweep({1: 10.0}), metric="tpot_ms").layout.yaxis.title.text


def test_batch_sweep_predicted_throughput_is_batch_times_1000_over_predicted_tpot():
    fig = batch_sweep(sweep({1: 10.0, 4: 10.0}, predicted_tpot_ms=8.0))
    predicted = trace(fig, "predicted (roofline)")
    assert predicted.line.dash == "dot"
    assert list(predicted.y) == pytest.approx([1 * 1000 / 8.0, 4 * 1000 / 8.0])


def test_batch_sweep_compute_ceiling_is_peak_flops_over_flops_per_sequence():
    fig = batch_sweep(sweep({1: 10.0, 4: 10.0}, peak_tflops=800.0))  # flops_per_step = 2e9 × batch
    ceiling = trace(fig, "compute ceiling")
    assert ceiling.line.dash == "dash"
    assert list(ceiling.y) == pytest.approx([800e12 / 2e9] * 2)


def test_batch_sweep_tpot_compute_ceiling_is_the_compute_only_step_time():
    fig = batch_sweep(sweep({1: 10.0, 4: 10.0}, peak_tflops=800.0), metric="tpot_ms")
    assert list(trace(fig, "compute ceiling").y) == pytest.approx([2e9 / 800e12 * 1e3, 8e9 / 800e12 * 1e3])


def test_batch_sweep_marks_b_star_and_the_observed_knee():
    fig = batch_sweep(sweep({1: 10.0, 2: 10.0, 4: 13.0, 8: 20.0}, critical_batch=8.0))
    assert "B* = 8" in annotation_texts(fig) and "knee = 4" in annotation_texts(fig)
    shapes = {shape.name: shape.x0 for shape in fig.layout.shapes}
    assert shapes == {"B*: prompt 512": 8.0, "knee: prompt 512": 4.0}


def test_batch_sweep_skips_a_marker_that_is_null():
    fig = batch_sweep(sweep({1: 10.0, 2: 10.0}, critical_batch=None))  # no B*, and TPOT never rises
    assert not fig.layout.shapes
    assert not [text for text in annotation_texts(fig) if text.startswith(("B*", "knee"))]


def test_batch_sweep_draws_one_b_star_line_where_lines_agree():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}, prompt_len=32), sweep({1: 10.0, 2: 10.0})], ignore_index=True)
    assert annotation_texts(batch_sweep(rows)).count("B* = 8") == 1


def test_batch_sweep_notes_s_star_in_tokens():
    fig = batch_sweep(sweep({1: 10.0, 2: 10.0}, critical_context=12345.6))
    assert "S* ≈ 12,346 tokens" in annotation_texts(fig)


def test_batch_sweep_says_when_s_star_never_binds():
    fig = batch_sweep(sweep({1: 10.0, 2: 10.0}, critical_context=math.inf))
    assert "S*: never binds" in annotation_texts(fig)


def test_batch_sweep_takes_the_median_of_repeated_points():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}), sweep({1: 20.0, 2: 10.0}), sweep({1: 30.0})], ignore_index=True)
    line = trace(batch_sweep(rows, metric="tpot_ms"), "prompt 512")
    assert list(line.y) == [20.0, 10.0]


# -------------------------------------------------------------------------------------------------------- caption


def test_caption_states_the_knee_b_star_and_context():
    caption = crossover_caption(sweep({1: 10.0, 2: 10.0, 4: 13.0, 8: 20.0}, critical_batch=8.0))
    assert caption.startswith("small bf16 on NVIDIA H200: decode stays memory-bound up to batch ≈ 2")
    assert "at 544-token context" in caption and "observed knee 4" in caption and "predicted B* 8" in caption


def test_caption_covers_each_prompt_length_longest_first():
    rows = pd.concat([sweep({1: 10.0, 2: 10.0}, prompt_len=32), sweep({1: 10.0, 2: 20.0})], ignore_index=True)
    caption = crossover_caption(rows)
    assert caption.index("544-token context") < caption.index("at 64 tokens through batch 2")


def test_caption_needs_only_status_batch_prompt_and_tpot():
    rows = pd.DataFrame({"status": "ok", "batch_size": [1, 2], "prompt_len": 8, "tpot_ms": [1.0, 2.0]})
    assert crossover_caption(rows).startswith("Decode stays memory-bound up to batch ≈ 1 at 8-token context")


def test_caption_reports_the_roofline_verdict():
    rows = sweep({1: 10.0, 2: 10.0})
    rows.loc[1, "bound"] = "compute"
    assert "roofline verdict compute from batch 2" in crossover_caption(rows)


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        (frame(point()).drop(columns=["tpot_ms"]), "tpot_ms"),
        (frame(point(status="oom")), "no ok rows"),
        (frame(point()), "no batch sweep"),
        (pd.DataFrame(), "no rows"),
    ],
    ids=["no tpot column", "no ok rows", "no sweep", "empty"],
)
def test_caption_says_what_is_missing(rows, says):
    caption = crossover_caption(rows)
    assert caption.startswith("No crossover to describe") and says in caption
