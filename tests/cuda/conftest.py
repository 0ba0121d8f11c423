"""Fixtures the fake-CUDA tests share: the fake mode with an H200's seams and the fake models."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from harness.modeling.model_args import ModelArgs
from tests.cuda.test_cuda_trace import H200_CAPABILITY, H200_SMS, SHALLOW_LAYERS, FakeEvent, FakeStream, fake_model


@pytest.fixture(scope="module")
def fake_cuda():
    """A FakeTensorMode on CUDA, with the seams that reach the CUDA runtime replaced by what an H200 would answer,
    and the two fake models every test shares (built once: initializing 8B parameters costs seconds even fake)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.kv import host, triton_paged

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_paged, "_sm_count", lambda device: H200_SMS)
        patch.setattr(torch.cuda, "get_device_capability", lambda device=None: H200_CAPABILITY)
        patch.setattr(host, "pinned", lambda tensor: tensor)  # page-locking is a driver call: nothing to fake
        patch.setattr(host, "page_locked_zeros", lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        patch.setattr(torch.cuda, "Stream", FakeStream)
        patch.setattr(torch.cuda, "Event", FakeEvent)
        patch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
        patch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        args = ModelArgs.from_name("llama-3.1-8b")
        with mode:
            models = {
                "deep": fake_model(args),
                "shallow": fake_model(dataclasses.replace(args, n_layers=SHALLOW_LAYERS)),
            }
        yield mode, models
