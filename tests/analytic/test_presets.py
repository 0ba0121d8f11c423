"""Every GPU preset fits the GPU its comment claims, by the capacity planner, and its time budget, by the analytic model.

A GPU window is rare and short (15 minutes of one H200, the machine's start included): a preset that needs more
memory or time than it says wastes one. Each preset under conf/experiment/ named `*-gpu` or `gpu-check-*` is composed
with Hydra's compose API as `python -m experiments.decode experiment=NAME` composes it, and its sweep expanded as
Hydra's basic sweeper expands it (experiments.sizing.preset_points). Its leading comment claims `<N> GB GPU` (else
an 80 GB H100) and `at most <M> min on an H100|H200` (else 10 minutes on an H100):
    memory  harness.analytic's planner (weights, RoPE tables, the CUDA runtime, the strategy's KV, the activations'
            peak) plus the accuracy pass of lossy points, against N decimal GB
    time    experiments.sizing.sweep_seconds: per point, generations (prefill + decode steps by harness.analytic.roofline at
            half the datasheet peaks, plus the host's launches of an eager step) x (warm-up + repeats, max_time_s
            bounding the repeats past min_repeats), the accuracy and profiler passes, compilation and the model
            build; per sweep, its start and its first worker. An upper bound, against M minutes
"""

from __future__ import annotations

import pytest

from experiments.sizing import (
    CONF,
    DEFAULT_BUDGET_MIN,
    DEFAULT_MEMORY_GB,
    H100,
    H200,
    point_bytes,
    point_fits,
    point_seconds,
    preset_claims,
    preset_points,
    sweep_seconds,
)
from harness.config import RunConfig

EXPERIMENTS = CONF / "experiment"
GPU_PRESETS = sorted(
    path.stem for path in EXPERIMENTS.glob("*.yaml") if path.stem.endswith("-gpu") or path.stem.startswith("gpu-check-")
)


def describe(cfg: RunConfig) -> str:
    return f"{cfg.cache['name']} {cfg.kv_dtype_name} batch {cfg.batch_size} prompt {cfg.prompt_len} gen {cfg.gen_len}"


def test_the_gpu_presets_are_found():
    assert {"quickstart-gpu", "crossover-gpu", "gpu-check-decode", "gpu-check-long-context"} <= set(GPU_PRESETS)


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_point_of_a_gpu_preset_fits_the_memory_its_comment_claims(preset):
    claims = preset_claims(EXPERIMENTS / f"{preset}.yaml")
    too_big = [
        f"{describe(cfg)}: {point_bytes(cfg) / 1e9:.1f} GB"
        for cfg in preset_points(preset)
        if not point_fits(cfg, memory_gb=claims.memory_gb)
    ]
    assert not too_big, f"{preset} claims a {claims.memory_gb:g} GB GPU; by the planner these need more: {too_big}"


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_a_gpu_preset_fits_its_time_budget(preset):
    claims = preset_claims(EXPERIMENTS / f"{preset}.yaml")
    points = preset_points(preset)
    seconds = sweep_seconds(points, gpu=claims.gpu)
    slowest = max(points, key=lambda cfg: point_seconds(cfg, gpu=claims.gpu))
    assert seconds <= claims.budget_min * 60, (
        f"{preset}: {len(points)} points predicted at {seconds / 60:.1f} min on an {claims.gpu.name}, over its "
        f"budget of {claims.budget_min:g} min; slowest: {describe(slowest)}, "
        f"{point_seconds(slowest, gpu=claims.gpu):.0f} s"
    )


def test_a_preset_that_claims_nothing_is_held_to_an_80_gb_h100_and_10_minutes(tmp_path):
    path = tmp_path / "silent.yaml"
    path.write_text("# @package _global_\n# A sweep.\ndevice: cuda\n")
    claims = preset_claims(path)
    assert (claims.memory_gb, claims.budget_min, claims.gpu) == (DEFAULT_MEMORY_GB, DEFAULT_BUDGET_MIN, H100)


def test_the_claims_are_read_from_the_comment_lines_only(tmp_path):
    path = tmp_path / "claims.yaml"
    path.write_text("# Sized for a 141 GB GPU (H200);\n# at most 2.5 min on an H200.\nnote: at most 1 min on an H100\n")
    claims = preset_claims(path)
    assert (claims.memory_gb, claims.budget_min, claims.gpu) == (141, 2.5, H200)


def test_the_planner_puts_batch_512_at_512_tokens_of_llama_3_1_8b_past_80_gb():
    # The KV alone is 35 GB, but the prefill's activations (the whole batch's 262k tokens at once) are as much again.
    point = RunConfig(model={"name": "llama-3.1-8b"}, device="cpu", dtype="bf16", batch_size=512, prompt_len=512,
                      gen_len=16, accuracy=False)  # fmt: skip
    assert not point_fits(point, memory_gb=80) and point_fits(point, memory_gb=141)


def test_the_time_model_puts_none_at_batch_16_and_4096_tokens_past_a_gpu_window():
    # Every decode step recomputes 16 x ~4100 tokens: ~1e15 FLOPs, a second or two, 63 times per generation.
    point = RunConfig(model={"name": "llama-3.1-8b"}, cache={"name": "none"}, device="cpu", dtype="bf16",
                      batch_size=16, prompt_len=4096, gen_len=64, warmup=2, min_repeats=5, max_repeats=20,
                      max_time_s=30)  # fmt: skip
    assert point_seconds(point, gpu=H100) > 10 * 60
