"""KL against the KV compression ratio (dashboard/charts/accuracy.py: kl_against_compression): eviction policies
as curves over their budgets, beside the sliding window and the quantized formats, on the same axes."""

from __future__ import annotations

import dataclasses
import types

import pytest

from dashboard.charts.accuracy import compression_ratio, kl_against_compression, lossy_family
from harness import kv
from harness.kv import KVCache, Layout
from tests.dashboard.charts_rows import annotation_texts, frame, point, trace, trace_names

# small's shapes: 12 layers x 4 KV heads x 64 channels; bf16: 2 x 12 x 4 x 64 x 2 = 12288 bytes a token
SHAPE = dict(n_layers=12, n_kv_heads=4, head_dim=64, prompt_len=480, gen_len=32)
EXACT_BYTES = 12288 * (480 + 32)  # one sequence's 512 tokens


def evicted(policy: str, budget: int, kl: float) -> dict:
    return point(
        **SHAPE, cache="evict", policy=policy, budget=budget, obs_window=8, kl_mean=kl,
        kv_bytes_allocated=12288 * budget, top1_agreement=0.9,
    )  # fmt: skip


def lossy_rows():
    return frame(
        point(**SHAPE, kv_bytes_allocated=EXACT_BYTES, kl_mean=None, top1_agreement=None),  # exact: not drawn
        evicted("h2o", 128, 0.02),
        evicted("h2o", 64, 0.05),
        evicted("h2o", 256, 0.01),
        evicted("knorm", 64, 0.2),
        point(**SHAPE, cache="sliding", window=128, kv_bytes_allocated=12288 * 128, kl_mean=0.1),
        point(**SHAPE, kv_dtype="fp8_e4m3", kv_bytes_allocated=EXACT_BYTES // 2, kl_mean=0.001),
    )


def test_the_compression_ratio_is_exact_bytes_at_the_compute_dtype_over_what_was_allocated():
    ratios = compression_ratio(lossy_rows())
    assert ratios.tolist() == pytest.approx([1, 4, 8, 2, 8, 4, 2])  # 512 tokens / budget; fp8 beside bf16: 2


def test_one_curve_per_eviction_policy_beside_the_window_and_the_formats():
    fig = kl_against_compression(lossy_rows())
    assert sorted(trace_names(fig)) == ["evict h2o", "evict knorm", "quantized fp8_e4m3", "sliding window"]
    h2o = trace(fig, "evict h2o")
    assert list(h2o.x) == [2, 4, 8] and list(h2o.y) == [0.01, 0.02, 0.05]  # its budgets, in order of compression
    assert h2o.mode == "lines+markers" and trace(fig, "sliding window").mode == "markers"
    assert (list(trace(fig, "quantized fp8_e4m3").x), list(trace(fig, "sliding window").x)) == ([2], [4])
    assert "compression ratio" in fig.layout.xaxis.title.text and "kv_bytes_allocated" in fig.layout.xaxis.title.text
    assert "KL" in fig.layout.yaxis.title.text


def test_a_narrow_format_under_eviction_is_a_trace_of_its_own():
    rows = frame(evicted("h2o", 64, 0.05), evicted("h2o", 64, 0.07) | {"kv_dtype": "int8", "kv_bytes_allocated": 1})
    assert sorted(trace_names(kl_against_compression(rows))) == ["evict h2o", "evict h2o int8"]


def test_rows_without_accuracy_give_the_empty_figure_and_two_workloads_a_note():
    empty = kl_against_compression(frame(point(kl_mean=None)))
    assert not empty.data and "no ok lossy rows" in " ".join(annotation_texts(empty))
    two = kl_against_compression(frame(*lossy_rows().to_dict("records"), evicted("h2o", 64, 0.3) | {"batch_size": 4}))
    assert len(trace(two, "evict h2o").x) == 3  # the batch-1 workload's three budgets, not the batch-4 point
    assert any("one workload of 2" in text for text in annotation_texts(two))


def test_a_plugged_in_strategy_names_its_own_trace_from_its_layout_and_says_whether_it_is_a_curve():
    class RingLayout(Layout):
        lossy = True
        lossy_family = "ring of {window}"
        lossy_curve = True

    @dataclasses.dataclass(frozen=True)
    class Options:
        window: int = 64

    plugin = types.ModuleType("plugin_ring")
    plugin.Options, plugin.STRATEGY, plugin.LAYOUT = Options, KVCache, RingLayout
    rows = frame(
        *(
            point(**SHAPE, cache="ring", window=64, kv_bytes_allocated=12288 * 64, kl_mean=kl, kv_dtype=kv_dtype)
            for kl, kv_dtype in ((0.1, "bf16"), (0.2, "bf16"), (0.3, "int8"))
        )
    )
    kv.register("ring", plugin)
    try:
        assert lossy_family(rows).tolist() == ["ring of 64", "ring of 64", "ring of 64 int8"]
        fig = kl_against_compression(rows)
    finally:
        kv.unregister("ring")
    assert sorted(trace_names(fig)) == ["ring of 64", "ring of 64 int8"]
    assert trace(fig, "ring of 64").mode == "lines+markers"  # declared a curve, as evict's budgets are


def test_a_strategy_not_known_here_is_named_by_its_kv_dtype():
    rows = frame(point(**SHAPE, cache="gone", kv_bytes_allocated=EXACT_BYTES // 2, kl_mean=0.1, kv_dtype="int8"))
    assert lossy_family(rows).tolist() == ["quantized int8"]
