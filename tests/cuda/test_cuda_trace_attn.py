"""Fake CUDA: attn_impl=eager traced at Llama-3.1-8B shapes, no GPU (see tests/cuda/test_cuda_trace.py for the method).

Eager attention must run on the device without a host sync, and it must turn off a strategy's own decode kernels
(contiguous's triton-dequant, paged's triton-paged and FlashInfer): those are fused attention.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import kv
from harness.modeling.decode import generate
from tests.cuda.test_cuda_trace import (
    CUDA,
    GEN_LEN,
    OPTIONS,
    FakeTimer,
    host_prompt,
    pytestmark,  # noqa: F401 (cuda_trace, and the skip on a CPU build of torch)
    spec_for,
    watched_step,
)

POINTS = [("contiguous", "bf16"), ("contiguous", "int8"), ("paged", "bf16"), ("paged", "fp8_e4m3"), ("sliding", "bf16")]


@pytest.mark.parametrize(("cache_name", "kv_dtype"), POINTS, ids=["-".join(point) for point in POINTS])
def test_an_eager_generation_traces_on_fake_cuda_without_a_host_sync(fake_cuda, cache_name, kv_dtype):
    fake_mode, models = fake_cuda
    model = models["shallow"]
    prompt_ids = host_prompt(model.args, 0)
    host_ids = prompt_ids.tolist()
    with fake_mode:
        spec = dataclasses.replace(spec_for(model.args, kv_dtype, 0), attn_impl="eager")
        cache = kv.build(cache_name, spec, OPTIONS.get(cache_name, {}))
        assert cache.attn_backend.startswith("sdpa"), f"eager must not run a kernel: {cache.attn_backend}"
        step, syncs, steps = watched_step(model, cache)

        generated, _ = generate(model, cache, prompt_ids.to(CUDA), GEN_LEN, FakeTimer(), step=step, prompt_ids=host_ids)
    assert syncs.found == [], f"host syncs inside a decode step: {sorted(set(syncs.found))}"
    assert generated.shape == (prompt_ids.shape[0], GEN_LEN) and generated.device.type == "cuda"
    assert len(steps) == GEN_LEN - 1 and all(out.dtype == torch.long for out in steps)
