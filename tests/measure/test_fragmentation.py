"""Allocation waste with mixed request lengths: reserve-the-maximum against paging."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from harness.config import RunConfig
from harness.errors import Unsupported
from harness.kv.base import CacheSpec
from harness.measure.fragmentation import request_lengths, waste_columns
from harness.run.point import run_point

MIXED = dict(model={"name": "tiny"}, dtype="fp32", lengths="mixed", batch_size=24, prompt_len=200, gen_len=100)


def spec_for(cfg: RunConfig) -> CacheSpec:
    return CacheSpec.for_model(
        cfg.model_args(),
        batch_size=cfg.batch_size,
        max_tokens=cfg.prompt_len + cfg.gen_len,
        kv_dtype="fp32",
        device=torch.device("cpu"),
    )


def test_request_lengths_are_seeded_and_within_bounds():
    cfg = RunConfig(**MIXED, min_len_frac=0.5)
    lengths = request_lengths(cfg)
    assert lengths == request_lengths(RunConfig(**MIXED, min_len_frac=0.5))
    assert lengths != request_lengths(RunConfig(**MIXED, min_len_frac=0.5, seed=1))
    assert all(100 + 50 <= n <= 200 + 100 for n in lengths) and len(set(lengths)) > 1


def test_contiguous_wastes_what_each_request_leaves_of_its_reservation():
    cfg = RunConfig(**MIXED, cache={"name": "contiguous"})
    columns = waste_columns(cfg, spec_for(cfg))
    lengths = request_lengths(cfg)
    assert columns["kv_waste_fraction"] == pytest.approx(1 - sum(lengths) / (len(lengths) * 300))


def test_paging_wastes_at_most_one_partial_block_per_request():
    cfg = RunConfig(**MIXED, cache={"name": "paged", "block_size": 16})
    columns = waste_columns(cfg, spec_for(cfg))
    assert 0 <= columns["kv_waste_fraction"] < 16 * 24 / (columns["mean_request_len"] * 24)
    contiguous = waste_columns(RunConfig(**MIXED), spec_for(RunConfig(**MIXED)))
    assert columns["kv_bytes_allocated"] < contiguous["kv_bytes_allocated"]
    assert columns["kv_bytes_live"] == contiguous["kv_bytes_live"]


def test_mixed_lengths_with_another_strategy_is_unsupported():
    cfg = RunConfig(**MIXED, cache={"name": "sliding"})
    with pytest.raises(Unsupported, match="contiguous and paged only"):
        waste_columns(cfg, spec_for(cfg))


def test_a_mixed_point_is_an_allocation_row_without_timing():
    row = run_point(RunConfig(**MIXED, cache={"name": "paged"}, isolate=False)).row
    assert row["status"] == "ok" and row["lengths"] == "mixed" and row["min_len_frac"] == 0.1
    assert 0 <= row["kv_waste_fraction"] < 0.1
    assert pd.isna(row.get("tpot_ms")) and pd.isna(row.get("ttft_ms"))
