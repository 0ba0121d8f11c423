"""A strategy is one file: everything the planner, the roofline and the sweep know of it comes from its own module.

This file is that module for a test-only strategy, `lastk`: a dense buffer of max_tokens + `headroom` slots per
sequence, whose queries attend to their `keep` most recent keys only. It defines its Options, its cache (STRATEGY),
its layout knowledge (LAYOUT) and how it serves (SERVING: a slot per request, its cache read per sequence through
harness.kv.varlen), joins harness.kv with kv.register, and nothing else in the harness is edited.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments.serve  # noqa: F401  (registers serve_config in Hydra's ConfigStore)
from harness import kv
from harness.analytic import ledger as planner
from harness.analytic.roofline import decode_step_cost, kv_bytes_per_token_read
from harness.analytic.roofline_row import roofline_columns
from harness.config import RunConfig, Workload
from harness.errors import ConfigError, Unsupported
from harness.formats import DTYPE_BYTES, PLAIN, QUANTIZED
from harness.kv import varlen
from harness.kv.base import CacheSpec, KVAllocation, Layout, Serving, grouped_attention
from harness.kv.quant import storage_format
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate
from harness.modeling.model import build_model
from harness.modeling.model_args import ModelArgs
from harness.run import sweep
from harness.run.point import config_columns
from harness.serve import run as serve_run
from harness.serve.config import ServeConfig
from harness.serve.engine import Engine, build_cache, serve
from harness.serve.kv_manager import make_kv_manager
from harness.serve.requests import RequestSpec, prompt_token_ids
from harness.serve.requests import generate as generate_requests
from harness.serve.rows import serve_run_dir
from harness.serve.scheduler import Scheduler, SchedulerConfig
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens, greedy_with_logits

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
        # Serving reads it per sequence (harness.kv.varlen): each side [L, B, H_kv, S, D], sequence i in row slots[i].
        self.format, self.rows = storage_format(spec), {"k": self.kv[:, 0], "v": self.kv[:, 1]}
        self._varlen: varlen.VarlenRows | None = None

    def prepare(self, start_pos: int | varlen.SeqBatch, n_new: int | None = None) -> None:
        if isinstance(start_pos, varlen.SeqBatch):  # serving: sequences at their own positions, a slot each
            batch = dataclasses.replace(start_pos, window=self.keep)  # its rule is a window of `keep` keys
            slots = [slot for slot, n in zip(batch.slots, batch.n_new, strict=True) for _ in range(n)]
            indices = {"decode": [[batch.slots[i]] for i in batch.decode_seqs]}
            indices |= {i: [[batch.slots[i]]] for i in batch.prefill_seqs}
            self._varlen = varlen.VarlenRows(self, batch, row_index=slots, col_index=batch.positions, indices=indices)
            return
        self.n_tokens = start_pos + n_new

    def gather_index(self, index: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """index [b, 1] slots -> (slot, position) of each sequence's first n positions, [b, n] each."""
        positions = torch.arange(n, device=index.device)[None, :]
        return index.expand(-1, n), positions.expand(index.shape[0], -1)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int | varlen.SeqBatch
    ) -> torch.Tensor:
        if isinstance(start_pos, varlen.SeqBatch):
            return varlen.attend(self, layer, q, k, v, self._varlen.batch, self._varlen)
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
    def allocation(self, shape) -> KVAllocation:
        """kv [L, K|V, B, H_kv, max_tokens + headroom, D] at the plain format."""
        args, slots = shape.model, shape.max_tokens + self.options.headroom
        per_slot = args.n_kv_heads * args.head_dim * DTYPE_BYTES[shape.kv_dtype]
        return KVAllocation(args.n_layers * 2 * shape.batch_size * slots * per_slot)

    def keys_attended(self, n_keys: float) -> float:
        return min(n_keys, self.options.keep)

    def comparable_columns(self) -> tuple[str, ...]:
        return ("headroom",)  # memory depends on the headroom; `keep` changes only what is read

    def check(self, shape) -> None:
        if shape.kv_dtype in QUANTIZED:
            raise ConfigError(f"kv_dtype: {self.name} stores plain dtypes only; allowed: {', '.join(PLAIN)}")


STRATEGY = LastKCache
LAYOUT = LastKLayout
SERVING = Serving(pool="slots")  # a slot of max_model_len tokens per running request, a row of its own buffer


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
    assert workload.layout().allocation(workload.kv_shape()).total_bytes == cache.kv_bytes_allocated()
    assert planner.kv_bytes_allocated(
        "tiny", cache=NAME, kv_dtype="fp32", dtype="fp32", batch_size=batch, prompt_len=prompt_len, gen_len=gen_len,
        **options,
    ) == cache.kv_bytes_allocated()  # fmt: skip
    book = planner.ledger(workload, memory_gb=1.0, device="cpu", runtime_overhead_bytes=0)
    assert book.kv_bytes == cache.kv_bytes_allocated() and book.max_concurrency > batch


def test_the_roofline_reads_the_keys_its_layout_says_a_query_attends():
    args = ModelArgs.from_name("tiny")
    layout = kv.layout(NAME, {"keep": 8})
    shape = kv.KVShape(model=args, batch_size=2, dtype="bf16", kv_dtype="bf16")
    step = decode_step_cost(shape, context_len=100, layout=layout)
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


# --- serving: the same module serves a request stream -------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 64


def serve_config(*overrides: str) -> ServeConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return OmegaConf.to_object(compose(config_name="serve", overrides=list(overrides)))


def test_it_is_one_of_the_strategies_that_serve():
    assert NAME in kv.serving_names() and kv.serving(NAME).pool == "slots"


def test_it_serves_a_stream_with_the_concurrency_the_planner_predicts(tmp_path):
    """experiments.serve end to end: plan (the planner's slots of LastKLayout.allocation), then the real engine.
    0.000125 GiB of fp32 K/V holds 4 slots of 64 tokens (512 bytes a token), and 12 requests arrive at once."""
    cfg = serve_config("model=tiny", "dtype=fp32", f"strategy={NAME}", f"max_model_len={MAX_MODEL_LEN}",
                       "block_size=16", "kv_memory_gb=0.000125", "num_prompts=12", "qps=inf", "prompt_len=24",
                       "output_len=8", "warmup=false")  # fmt: skip
    p = serve_run.plan(cfg)
    row = serve_run.run(p, run_dir=serve_run_dir(tmp_path, "r"), sweep_id="s")
    assert row["completed"] == 12 and row["strategy"] == NAME
    assert row["max_running_requests"] == row["predicted_max_running"] == 4


def test_its_served_tokens_equal_its_own_cache_decoding_each_prompt_alone():
    """Mixed lengths, prompts chunked across iterations beside decodes, in fp32: each request's greedy tokens are
    those of its prompt decoded alone through a batch-1 LastKCache (keep=16 < most prompts: the rule matters)."""
    args = ModelArgs.from_name("tiny")
    model = build_model(args, dtype=torch.float32, device=CPU, seed=0, n_positions=MAX_MODEL_LEN)
    spec = RequestSpec(num_prompts=10, qps=float("inf"), seed=1, prompt_len=24, prompt_dist="uniform",
                       prompt_spread=0.6, output_len=12, output_dist="uniform", output_spread=0.5,
                       max_model_len=MAX_MODEL_LEN)  # fmt: skip
    requests = generate_requests(spec)
    prompts = prompt_token_ids(requests, vocab_size=args.vocab_size, seed=1)
    num_blocks, block_size = 64, 4  # 256 tokens: 4 slots of 64
    manager = make_kv_manager(NAME, num_blocks=num_blocks, block_size=block_size, max_model_len=MAX_MODEL_LEN)
    scheduler = Scheduler(SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16), manager)
    cache, num_slots = build_cache(NAME, args, kv_dtype="fp32", num_blocks=num_blocks, block_size=block_size,
                                   max_model_len=MAX_MODEL_LEN, device=CPU)  # fmt: skip
    assert isinstance(cache, LastKCache) and num_slots == 4
    iterations = []
    result = serve(requests, prompts, scheduler=scheduler, engine=Engine(model, cache, num_slots=num_slots),
                   on_iteration=lambda i, output, *_: iterations.append(output))  # fmt: skip
    assert max(o.num_running for o in iterations) == 4
    assert any(s.is_prefill and not s.samples_token for o in iterations for s in o.scheduled), "no chunked prompt"
    for request, prompt in zip(requests, prompts, strict=True):
        solo = CacheSpec.for_model(args, batch_size=1, max_tokens=len(prompt) + request.output_len, kv_dtype="fp32",
                                   device=CPU)  # fmt: skip
        expected, logits = greedy_with_logits(model, kv.build(NAME, solo, {}), torch.tensor([prompt]),
                                              request.output_len)  # fmt: skip
        actual = torch.tensor([result.outputs[request.request_id]])
        assert_same_greedy_tokens(actual, expected, logits, tol=LOGIT_TOL["fp32"])
