"""Fake CUDA for token eviction: every policy, in each per-token format, evicts in prefill (200 prompt tokens into a
budget of 128) and in decode without a host sync, on the device, at Llama-3.1-8B shapes (tests/cuda/test_cuda_trace.py
traces the strategy's default case, h2o, through the whole matrix)."""

from __future__ import annotations

import pytest

from harness import kv
from harness.modeling.decode import generate
from tests.cuda import test_cuda_trace as trace
from tests.cuda.test_cuda_trace import CUDA, GEN_LEN, FakeTimer, host_prompt, spec_for, watched_step

pytestmark = [pytest.mark.cuda_trace]
if not trace._is_cuda_build():
    pytestmark.append(pytest.mark.skip(reason="fake CUDA needs the CUDA build of torch: run `make test-cuda-trace`"))


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("policy", ["h2o", "snapkv", "knorm", "random"])
def test_every_policy_evicts_on_the_device_without_a_host_sync(fake_cuda, policy, kv_dtype):
    fake_mode, models = fake_cuda
    model = models["shallow"]
    prompt_ids = host_prompt(model.args, 0)
    with fake_mode:
        cache = kv.build("evict", spec_for(model.args, kv_dtype, 0), {"policy": policy, "budget": 128, "window": 16})
        step, syncs, _ = watched_step(model, cache)

        generated, _ = generate(model, cache, prompt_ids.to(CUDA), GEN_LEN, FakeTimer(), step=step)
    assert syncs.found == [], f"host syncs inside a decode step: {sorted(set(syncs.found))}"
    assert generated.shape == (2, GEN_LEN) and generated.device.type == "cuda"
    assert cache.positions.device.type == cache.scores.device.type == "cuda"
