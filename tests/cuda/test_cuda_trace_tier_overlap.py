"""Fake CUDA for overlapped tier loads (tier_overlap, harness.serve.tier_loader): an iteration's loads are queued
layer by layer on a side stream behind the compute stream's work, an event recorded after each layer, and a layer's
attention waits for its own event on the device: no host sync. The CPU path runs for real in
tests/serve/test_serve_tier_overlap.py."""

from __future__ import annotations

import pytest
import torch

from harness.config import Workload
from harness.serve import tier_loader
from harness.serve.engine import build_cache
from tests.cuda import test_cuda_trace as trace
from tests.cuda.test_cuda_trace import CUDA, FakeStream

pytestmark = [pytest.mark.cuda_trace]
if not trace._is_cuda_build():
    pytestmark.append(pytest.mark.skip(reason="fake CUDA needs the CUDA build of torch: run `make test-cuda-trace`"))


def test_layer_loads_queue_each_layer_on_a_side_stream_and_each_layer_waits_for_its_own_event(fake_cuda, monkeypatch):
    fake_mode, _ = fake_cuda
    compute = FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    args = Workload(model="tiny", cache={"name": "paged"}).model_args()
    with fake_mode:
        cache, _ = build_cache("prefix", args, kv_dtype="bf16", num_blocks=8, block_size=16, max_model_len=64,
                               device=CUDA)  # fmt: skip
        staged = [
            {name: torch.zeros(part.shape, dtype=part.dtype) for name, part in cache.read_blocks([b]).items()}
            for b in (2, 5)
        ]  # fmt: skip  (host blocks, as the tiers hold them)
        loads = tier_loader.LayerLoads(cache, [2, 5], staged, tier_loader.LoadTimes())
        side = FakeStream()
        loads.start(None, stream=side)
        n_layers = cache.rows["k"].shape[0]
        assert side.waited == [compute]  # behind this iteration's offloads, which read the same pool
        assert len(loads.events) == n_layers and all(event.recorded == 1 for event in loads.events)
        for layer in range(n_layers):
            loads.wait(layer)
        loads.finish()
    assert compute.waited == [*loads.events, loads.events[-1]]  # each layer its own event, then the last at finish
    assert not any(event.is_set() for event in loads.ready)  # the host never waited: the device does
