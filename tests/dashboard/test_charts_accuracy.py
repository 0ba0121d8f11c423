"""The accuracy charts per model (dashboard/charts/accuracy.py): a real checkpoint's curves apart from dummy weights',
the model named in the title, dummy rows marked as bounding a format's rounding; perplexity for checkpoints only."""

from __future__ import annotations

from dashboard.charts.accuracy import (
    DUMMY_NOTE,
    NO_PPL,
    kl_against_compression,
    model_label,
    ppl_delta_against_compression,
)
from tests.dashboard.charts_rows import annotation_texts, frame, point

SHAPE = dict(n_layers=12, n_kv_heads=4, head_dim=64, prompt_len=480, gen_len=32)  # 12288 bytes a token at bf16
SMOLLM = dict(model="SmolLM2-135M-Instruct.Q4_1", weights="/cache/gguf/ab12/SmolLM2-135M-Instruct.Q4_1")


def evicted(budget: int, kl: float, **overrides) -> dict:
    return point(
        **SHAPE, cache="evict", policy="h2o", budget=budget, obs_window=8, kl_mean=kl,
        kv_bytes_allocated=12288 * budget, top1_agreement=0.9,
    ) | overrides  # fmt: skip


def real(budget: int, kl: float, **overrides) -> dict:
    return evicted(budget, kl, **(SMOLLM | {"prompt_source": "sharegpt"} | overrides))


def dummy(budget: int, kl: float, **overrides) -> dict:
    return evicted(budget, kl, **({"model": "tiny", "weights": "dummy", "prompt_source": "random"} | overrides))


def real_and_dummy():
    return frame(real(64, 0.5), real(128, 0.2), dummy(64, 0.01), dummy(128, 0.004))


def test_real_and_dummy_rows_are_two_curves_never_one():
    fig = kl_against_compression(real_and_dummy())
    (real_curve,) = [t for t in fig.data if t.legendgroup.startswith("SmolLM2")]
    (dummy_curve,) = [t for t in fig.data if t.legendgroup.startswith("tiny")]
    assert list(real_curve.y) == [0.2, 0.5] and list(dummy_curve.y) == [0.004, 0.01]  # each its own budgets
    assert real_curve.line.dash == "solid" and dummy_curve.line.dash == "dot"
    assert dummy_curve.marker.symbol == "circle-open" and real_curve.marker.symbol == "circle"


def test_the_title_names_the_real_model_and_its_prompts_and_the_dummy_rows_say_what_they_bound():
    fig = kl_against_compression(real_and_dummy())
    assert "SmolLM2-135M-Instruct.Q4_1, ShareGPT prompts" in fig.layout.title.text
    assert "tiny" not in fig.layout.title.text  # the title names the real models when there are any
    (dummy_curve,) = [t for t in fig.data if t.legendgroup.startswith("tiny")]
    assert dummy_curve.legendgrouptitle.text == f"tiny, dummy weights ({DUMMY_NOTE})"


def test_dummy_rows_alone_are_marked_in_the_title():
    fig = kl_against_compression(frame(dummy(64, 0.01), dummy(128, 0.004)))
    assert fig.layout.title.text.endswith(f": tiny, dummy weights ({DUMMY_NOTE})")


def test_rows_without_weights_or_prompt_source_read_as_dummy_weights_on_random_prompts():
    rows = frame(evicted(64, 0.01), real(64, 0.5, prompt_source="text", prompt_text="/data/essay.txt"))
    assert model_label(rows).tolist() == [
        "small, dummy weights",
        "SmolLM2-135M-Instruct.Q4_1, text prompts (essay.txt)",
    ]


def test_two_checkpoints_of_one_name_are_told_apart_by_their_weights():
    rows = frame(real(64, 0.5), real(64, 0.3, weights="/other/SmolLM2"))
    groups = {t.legendgroup for t in kl_against_compression(rows).data}
    assert len(groups) == 2 and any("/other/SmolLM2" in group for group in groups)


def test_a_model_with_two_workloads_draws_its_busiest_and_says_so():
    rows = frame(real(64, 0.5), real(128, 0.2), real(64, 0.9, batch_size=4), dummy(64, 0.01))
    fig = kl_against_compression(rows)
    (real_curve,) = [t for t in fig.data if t.legendgroup.startswith("SmolLM2")]
    assert list(real_curve.y) == [0.2, 0.5]  # batch 1's two budgets, not batch 4's point
    assert any(text.startswith("SmolLM2-135M-Instruct.Q4_1, ShareGPT prompts: one workload of 2") for text in
               annotation_texts(fig))  # fmt: skip


def test_the_perplexity_chart_draws_real_checkpoints_only_and_names_the_text():
    rows = frame(
        real(64, 0.5, ppl_delta=1.5, ppl_source="sharegpt"),
        real(128, 0.2, ppl_delta=0.4, ppl_source="sharegpt"),
        dummy(64, 0.01, ppl_delta=900.0, ppl_source="eval_text"),  # random weights: no language to lose
    )
    fig = ppl_delta_against_compression(rows)
    (curve,) = fig.data
    assert list(curve.y) == [0.4, 1.5] and "ppl on sharegpt" in curve.legendgroup
    assert "SmolLM2" in fig.layout.title.text and "perplexity" in fig.layout.yaxis.title.text


def test_the_perplexity_chart_without_a_real_models_delta_says_what_it_needs():
    fig = ppl_delta_against_compression(frame(dummy(64, 0.01, ppl_delta=3.0), real(64, 0.5)))
    assert not fig.data and NO_PPL in annotation_texts(fig)
