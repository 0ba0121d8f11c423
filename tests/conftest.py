"""Shared fixtures: the tiny preset in fp32 on the CPU, and a skip marker for CUDA-only tests."""

from __future__ import annotations

import pytest
import torch

from harness.model import ModelArgs, build_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_args() -> ModelArgs:
    return ModelArgs.from_name("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_args):
    return build_model(
        tiny_args, weights="dummy", dtype=torch.float32, device=torch.device("cpu"), seed=0, n_positions=512
    )
