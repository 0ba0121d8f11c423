"""A strategy is one file: everything the planner, the roofline and the sweep know of it comes from its own module.

This file is that module for a test-only strategy, `lastk`: a dense buffer of max_tokens + `headroom` slots per
sequence, whose queries attend to their `keep` most recent keys only. It defines its Options, its cache (STRATEGY)
and its layout knowledge (LAYOUT), joins harness.kv with kv.register, and nothing else in the harness is edited.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

import pandas as pd
import pytest
import torch

from harness import kv
from harness.config import RunConfig, Workload
from harness.decode import generate
from harness.errors import ConfigError, Unsupported
from harness.formats import DTYPE_BYTES, PLAIN, QUANTIZED
from harness.kv.base import CacheSpec, KVAllocation, Layout, grouped_attention
from harness.model import build_model
from harness.model_args import ModelArgs
from harness.plan import ledger as planner
from harness.roofline import decode_step_cost, kv_bytes_per_token_read
from harness.roofline_row import roofline_columns
from harness.run import sweep
from harness.run.bench import config_columns
from harness.timing import StepTimer

NAME = "lastk"
CPU = torch.device("cpu")


# --- the strategy: its options, its cache, its layout ---------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    keep: int = 16  # keys each query attends to, the newest ones (itself included)
    headroom: int = 0  # slots reserved per sequence beyond prompt_len + gen_len

    def __post_init__(self) -> None:
        if self.keep <= 0:
            raise ValueError(f"cache.keep: must be a positive number of tokens, got {self.keep}")


class LastKCache(kv.KVCache):
    name: ClassVar[str] = NAME
    recomputes_prefix: ClassVar[bool] = False
    attn_backend: ClassVar[str] = "sdpa"
    prefix_hit: ClassVar[None] = None

    def __init__(self, spec: CacheSpec, options: Options) -> None:
        self.spec, self.keep, self.n_tokens = spec, options.keep, 0
        shape = (spec.n_layers, 2, spec.batch_size, spec.n_kv_heads, spec.max_tokens + options.headroom, spec.head_dim)
        self.kv = torch.zeros(shape, dtype=spec.plain_dtype, device=spec.device)  # Unsupported for quantized formats

    def prepare(self, start_pos: int, n_new: int) -> None:
        self.n_tokens = start_pos + n_new

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        end = start_pos + k.shape[2]
        self.kv[layer, 0, :, :, start_pos:end] = k
        self.kv[layer, 1, :, :, start_pos:end] = v
        keys, values = (self.kv[layer, side, :, :, :end].to(q.dtype) for side in (0, 1))
        q_pos = torch.arange(start_pos, end, device=q.device)[:, None]
        k_pos = torch.arange(end, device=q.device)[None, :]
        return grouped_attention(q, keys, values, mask=(k_pos <= q_pos) & (q_pos - k_pos < self.keep))

    def release(self) -> None:
        self.n_tokens = 0

    def data_tensors(self) -> list[torch.Tensor]:
        return [self.kv]  # the base counts its bytes (kv_bytes_allocated, kv_bytes_live from n_tokens)


class LastKLayout(Layout):
    def allocation(self, w) -> KVAllocation:
        """kv [L, K|V, B, H_kv, max_tokens + headroom, D] at the plain format."""
        args, slots = w.model_args(), w.max_tokens + self.options.headroom
        per_slot = args.n_kv_heads * args.head_dim * DTYPE_BYTES[w.kv_dtype_name]
        return KVAllocation(args.n_layers * 2 * w.batch_size * slots * per_slot)

    def keys_attended(self, n_keys: float) -> float:
        return min(n_keys, self.options.keep)

    def comparable_columns(self) -> tuple[str, ...]:
        return ("headroom",)  # memory depends on the headroom; `keep` changes only what is read

    def check(self, w) -> None:
        if w.kv_dtype_name in QUANTIZED:
            raise ConfigError(f"kv_dtype: {self.name} stores plain dtypes only; allowed: {', '.join(PLAIN)}")


STRATEGY = LastKCache
LAYOUT = LastKLayout


@pytest.fixture(autouse=True)
def registered():
    kv.register(NAME, sys.modules[__name__])
    yield
    kv.unregister(NAME)


# --- what the harness now knows of it ------------------------------------------------------------------------------


def test_a_registered_strategy_is_one_of_the_strategy_names_and_a_valid_cache_config():
    assert NAME in kv.strategy_names()
    assert RunConfig(device="cpu", model={"name": "tiny"}, cache={"name": NAME, "keep": 4}).cache_options == {"keep": 4}


def test_the_planner_predicts_its_allocation_as_its_cache_reports_it_after_a_generation():
    args = ModelArgs.from_name("tiny")
    batch, prompt_len, gen_len, options = 3, 21, 6, {"keep": 8, "headroom": 5}
    model = build_model(args, dtype=torch.float32, device=CPU, seed=0, n_positions=prompt_len + gen_len)
    spec = CacheSpec.for_model(args, batch_size=batch, max_tokens=prompt_len + gen_len, kv_dtype="fp32", device=CPU)
    cache = kv.build(NAME, spec, options)
    prompt = torch.randint(args.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    generate(model, cache, prompt, gen_len, StepTimer(CPU, n_marks=gen_len))
    workload = Workload(
        model="tiny", dtype="fp32", cache={"name": NAME, **options}, batch_size=batch, prompt_len=prompt_len,
        gen_len=gen_len,
    )  # fmt: skip
    assert workload.layout().allocation(workload).total_bytes == cache.kv_bytes_allocated()
    assert planner.kv_bytes_allocated(
        "tiny", cache=NAME, kv_dtype="fp32", dtype="fp32", batch_size=batch, prompt_len=prompt_len, gen_len=gen_len,
        **options,
    ) == cache.kv_bytes_allocated()  # fmt: skip
    book = planner.ledger(workload, memory_gb=1.0, device="cpu", runtime_overhead_bytes=0)
    assert book.kv_bytes == cache.kv_bytes_allocated() and book.max_concurrency > batch


def test_the_roofline_reads_the_keys_its_layout_says_a_query_attends():
    args = ModelArgs.from_name("tiny")
    layout = kv.layout(NAME, {"keep": 8})
    step = decode_step_cost(args, batch_size=2, context_len=100, dtype="bf16", kv_dtype="bf16", layout=layout)
    assert step.kv_read_bytes == 2 * 8 * kv_bytes_per_token_read(args, "bf16")  # 8 keys, not 100
    workload = Workload(model="tiny", cache={"name": NAME, "keep": 8}, batch_size=2, prompt_len=90, gen_len=20)
    dense = Workload(model="tiny", batch_size=2, prompt_len=90, gen_len=20)
    capped = roofline_columns(workload, tpot_ms=None)["bytes_per_step"]
    assert capped < roofline_columns(dense, tpot_ms=None)["bytes_per_step"]


def point(*, batch_size: int, **options) -> RunConfig:
    return RunConfig(
        device="cpu", model={"name": "tiny"}, cache={"name": NAME, **options}, batch_size=batch_size, prompt_len=64,
        gen_len=8,
    )  # fmt: skip


def test_the_oom_backstop_compares_its_points_by_its_own_comparable_columns(tmp_path, monkeypatch):
    oom_cfg = point(batch_size=4, keep=32, headroom=8)
    oom = config_columns(oom_cfg) | {"status": "oom", "started_at": "2026-01-01T00:00:00+00:00"}
    assert {"keep", "headroom"} <= set(oom)  # its options are columns of its rows
    monkeypatch.setattr(sweep.disk, "index", lambda _: pd.DataFrame({"status": ["oom"], "path": ["oom.parquet"]}))
    monkeypatch.setattr(sweep.disk, "load", lambda _: pd.DataFrame([oom]))

    def cause(cfg: RunConfig):
        return sweep.oom_cause(cfg, config_columns(cfg), tmp_path)

    assert "headroom" in sweep.backstop_keys(oom_cfg) and "keep" not in sweep.backstop_keys(oom_cfg)
    # Another `keep` changes nothing the planner counts: a larger batch is held to the OOM.
    assert cause(point(batch_size=8, keep=4, headroom=8))["point_id"] == oom_cfg.point_id()
    assert cause(point(batch_size=2, keep=4, headroom=8)) is None  # needs less than the OOM
    assert cause(point(batch_size=8, keep=32, headroom=0)) is None  # another headroom: not comparable


def test_its_unsupported_combination_is_a_one_line_config_error_as_its_cache_refuses_it():
    with pytest.raises(ConfigError, match=r"^kv_dtype: lastk stores plain dtypes only; allowed: fp32, fp16, bf16$"):
        Workload(model="tiny", kv_dtype="int8", cache={"name": NAME})
    spec = CacheSpec.for_model(ModelArgs.from_name("tiny"), batch_size=1, max_tokens=8, kv_dtype="int8", device=CPU)
    with pytest.raises(Unsupported):
        kv.build(NAME, spec, {})
