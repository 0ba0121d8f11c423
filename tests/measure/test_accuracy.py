"""The accuracy cost of lossy caches: teacher-forced logits against the exact cache, and perplexity on a text."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from harness import kv
from harness.config import RunConfig
from harness.kv.base import CacheSpec
from harness.measure import accuracy
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate
from harness.run.point import run_point

CPU = torch.device("cpu")
FAST = dict(warmup=0, min_repeats=1, max_repeats=1, isolate=False)


def test_identical_logits_have_no_error():
    logits = torch.randn(2, 5, 11)
    assert accuracy.compare(logits, logits.clone()) == {"logit_max_abs_err": 0.0, "kl_mean": 0.0, "top1_agreement": 1.0}


def test_a_flipped_argmax_lowers_agreement_and_raises_kl():
    exact = torch.zeros(1, 4, 3)
    exact[..., 0] = 5.0
    lossy = exact.clone()
    lossy[0, 1] = torch.tensor([0.0, 6.0, 0.0])
    result = accuracy.compare(exact, lossy)
    assert result["top1_agreement"] == pytest.approx(0.75)
    assert result["kl_mean"] > 0.1 and result["logit_max_abs_err"] == pytest.approx(6.0)


def test_teacher_forcing_the_exact_cache_reproduces_its_greedy_choice(tiny_model, tiny_args):
    spec = CacheSpec.for_model(tiny_args, batch_size=2, max_tokens=20, kv_dtype="fp32", device=CPU)
    cache = kv.build("contiguous", spec, {})
    prompt = torch.randint(tiny_args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    greedy, _ = generate(tiny_model, cache, prompt, 8, StepTimer(CPU, n_marks=8))
    cache.release()
    logits = accuracy.teacher_forced_logits(tiny_model, cache, prompt, greedy)
    assert logits.shape == (2, 8, tiny_args.vocab_size)
    assert torch.equal(logits.argmax(dim=-1), greedy)


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    assert accuracy.perplexity(torch.zeros(2, 3, 50), torch.zeros(2, 3, dtype=torch.long)) == pytest.approx(50.0)


def test_a_lossy_point_records_accuracy_and_an_exact_point_does_not():
    lossy = run_point(
        RunConfig(model={"name": "tiny"}, dtype="fp32", kv_dtype="bf16", prompt_len=16, gen_len=6, **FAST)
    ).row
    exact = run_point(RunConfig(model={"name": "tiny"}, dtype="fp32", prompt_len=16, gen_len=6, **FAST)).row
    assert 0 < lossy["logit_max_abs_err"] < 0.05 and lossy["kl_mean"] >= 0 and lossy["top1_agreement"] > 0.5
    for column in ("logit_max_abs_err", "kl_mean", "top1_agreement"):
        assert pd.isna(exact.get(column))


def test_perplexity_of_a_text_through_a_real_checkpoint(llama_checkpoint):
    row = run_point(
        RunConfig(
            weights=str(llama_checkpoint),
            prompt_source="text",  # the text it was trained on
            prompt_text=str(llama_checkpoint / "eval.txt"),
            dtype="fp32",
            kv_dtype="bf16",
            batch_size=2,
            prompt_len=32,
            gen_len=32,
            eval_text=str(llama_checkpoint / "eval.txt"),
            **FAST,
        )
    ).row
    assert row["status"] == "ok"
    assert 1.0 < row["ppl"] < 128  # trained on this text: far better than uniform over the vocabulary
    assert abs(row["ppl_delta"]) < 0.05 * row["ppl"]  # bf16 K/V barely moves it
    assert row["top1_agreement"] > 0.9


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_8bit_kv_agrees_on_top1_for_the_large_majority_of_steps_with_real_weights(llama_checkpoint, kv_dtype):
    row = run_point(
        RunConfig(
            weights=str(llama_checkpoint),
            prompt_source="text",  # the text it was trained on
            prompt_text=str(llama_checkpoint / "eval.txt"),
            dtype="fp32",
            kv_dtype=kv_dtype,
            batch_size=4,
            prompt_len=48,
            gen_len=24,
            **FAST,
        )
    ).row
    assert row["status"] == "ok", row.get("error")
    assert row["top1_agreement"] >= 0.9
    assert row["kl_mean"] < 0.05 and row["logit_max_abs_err"] > 0  # lossy, but only just


def test_int4_costs_more_accuracy_than_int8(llama_checkpoint):
    rows = {
        kv_dtype: run_point(
            RunConfig(
                weights=str(llama_checkpoint),
                prompt_source="text",  # the text it was trained on
                prompt_text=str(llama_checkpoint / "eval.txt"),
                dtype="fp32",
                kv_dtype=kv_dtype,
                batch_size=4,
                prompt_len=48,
                gen_len=24,
                **FAST,
            )
        ).row
        for kv_dtype in ("int8", "int4")
    }
    assert rows["int4"]["kl_mean"] > rows["int8"]["kl_mean"]
