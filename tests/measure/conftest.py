"""Fixtures the measure tests share."""

from __future__ import annotations

import os

import pytest

from tests.measure.test_probes import FakeNvml, GiB


@pytest.fixture
def nvml(monkeypatch) -> FakeNvml:
    fake = FakeNvml()
    fake.gpus[0].processes = [(os.getpid(), 5 * GiB)]
    monkeypatch.setattr("harness.measure.nvml.load_nvml", lambda: fake)
    return fake
