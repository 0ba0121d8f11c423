"""Fake CUDA for the prefix's host tier, at Llama-3.1-8B shapes: the blocks a prefill computed are copied to host
memory (write-through), found there once the device copy is forgotten, and copied back into the device pool; the
decode steps after either prefill make no host sync. The disk tier is host code over host tensors (fake tensors
hold no bytes to write): tests/kv/test_kv_tiers.py runs it for real."""

from __future__ import annotations

import pytest

from harness import kv
from harness.kv import tiers
from harness.kv.base import CacheSpec
from harness.modeling.decode import generate
from tests.cuda import test_cuda_trace as trace
from tests.cuda.test_cuda_trace import BATCH, CUDA, DTYPE, GEN_LEN, PROMPT_LEN, FakeTimer, host_prompt, watched_step

pytestmark = [pytest.mark.cuda_trace]
if not trace._is_cuda_build():
    pytestmark.append(pytest.mark.skip(reason="fake CUDA needs the CUDA build of torch: run `make test-cuda-trace`"))

PREFIX_LEN, BLOCK = 64, 16


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3", "int8"])
def test_the_host_tier_round_trips_a_prefix_between_device_and_host(fake_cuda, kv_dtype, monkeypatch):
    fake_mode, models = fake_cuda
    model = models["shallow"]
    prompt_ids = host_prompt(model.args, PREFIX_LEN)
    monkeypatch.setattr(tiers, "synchronize", lambda device: None)  # a CUDA runtime call: nothing to fake
    with fake_mode:
        spec = CacheSpec.for_model(
            model.args,
            batch_size=BATCH,
            max_tokens=PROMPT_LEN + GEN_LEN,
            kv_dtype=kv_dtype,
            device=CUDA,
            prefix_len=PREFIX_LEN,
            dtype=DTYPE,
            model_id="fake",
        )
        cache = kv.build("prefix", spec, {"block_size": BLOCK, "host_gb": 1.0})
        step, syncs, _ = watched_step(model, cache)
        host_ids = prompt_ids.tolist()
        generate(model, cache, prompt_ids.to(CUDA), GEN_LEN, FakeTimer(), step=step, prompt_ids=host_ids)
        cache.release()
        cache.forget_prefix()  # the device copy goes: the next prefill must find it on the host
        generated, _ = generate(model, cache, prompt_ids.to(CUDA), GEN_LEN, FakeTimer(), step=step, prompt_ids=host_ids)
    assert cache.prefix_sources == ["computed", "host"]
    assert syncs.found == [], f"host syncs inside a decode step: {sorted(set(syncs.found))}"
    assert generated.shape == (BATCH, GEN_LEN) and generated.device.type == "cuda"
    blocks = list(cache.store.host.values())
    assert len(blocks) == PREFIX_LEN // BLOCK
    assert {tensor.device.type for block in blocks for tensor in block.values()} == {"cpu"}
    moved = {(t.direction, t.n_bytes) for t in cache.store.transfers}
    assert moved == {("d2h", cache.prefix_bytes()), ("h2d", cache.prefix_bytes())}  # whole blocks, scales included
