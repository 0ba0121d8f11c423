"""What a lossy served strategy costs in accuracy on the run's own model and requests (issue #30 item 1b).

A strategy that drops K/V a query would read (a sliding window; an eviction policy) serves tokens exact serving
would not. After a run's figures are taken, the first `accuracy_requests` of its stream are served twice more,
through the real engine and scheduler (so chunked prefill, batching and preemption are serving's own):

  1. exactly: strategy=paged at the run's dtype and kv_dtype, greedy, each sampling position's log-probabilities
     kept (fp32, on the host);
  2. through the run's strategy, teacher-forced on the outputs of 1 (Engine's forced tokens), so that one early
     divergence cannot compound into every later step: each position compares next-token distributions given the
     same history, as the static sweep's accuracy pass does (harness.measure.accuracy, harness.run.point
     .accuracy_columns).

Per position: KL(exact || lossy) in nats (harness.measure.accuracy.kl_per_step, the sweep's kl_mean's definition)
and top-1 agreement (the argmaxes equal, the sweep's top1_agreement). The reference is paged at the same kv_dtype,
not the compute dtype: the columns price the strategy's dropped K/V alone, the format's rounding being the same on
both sides (the sweep's quantized rows price that). Every arrival is moved to t = 0 so the two passes schedule
alike; neither is timed, and neither writes request or iteration rows.

Host memory: the exact pass's log-probabilities, n · output tokens · vocabulary · 4 bytes at most (8 requests of
32 tokens on SmolLM2's 49,152 tokens: 50 MB), each freed as the lossy pass reaches its position.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.errors import ConfigError
from harness.measure.accuracy import kl_per_step
from harness.serve.engine import Engine, build_cache, serve
from harness.serve.kv_manager import KVManager, make_kv_manager, serving
from harness.serve.metrics import ACCURACY_RUN_COLUMNS
from harness.serve.requests import Request
from harness.serve.scheduler import Scheduler, SchedulerConfig

EXACT_STRATEGY = "paged"  # exact serving: every key kept, the blocks pool every blocks strategy's storage is


DEFAULT_ACCURACY_REQUESTS = 8  # accuracy_requests=null: this many, or the whole stream when it is shorter


def check_accuracy_requests(value, *, num_prompts: int | None) -> None:
    """accuracy_requests: null (the default's), or an integer in [0, num_prompts] (num_prompts None: a trace's
    stream, whose length plan() knows: the measure then takes at most all of it)."""
    if value is None:
        return
    upper = "num_prompts" if num_prompts is None else f"num_prompts = {num_prompts}"
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < 0
        or (num_prompts is not None and value > num_prompts)
    ):
        raise ConfigError(f"accuracy_requests: must be null (up to {DEFAULT_ACCURACY_REQUESTS}) or an integer from "
                          f"0 (off) to {upper}, got {value!r}")  # fmt: skip


def accuracy_requests(value: int | None, stream_len: int) -> int:
    """How many of the stream's first requests are measured."""
    return min(DEFAULT_ACCURACY_REQUESTS if value is None else value, stream_len)


@dataclass(frozen=True)
class Pool:
    """How one pass serves: its engine (new_engine(forced=, on_logprobs=), over the pass's cache) and its KV
    manager (new_manager()), each built fresh per pass. The run's pass is built by the run's own factories
    (harness.serve.run._serve_into), so the lossy pass serves exactly as the run did."""

    new_engine: Callable[..., Engine]
    new_manager: Callable[[], KVManager]


def pool(model: torch.nn.Module, cache, *, strategy: str, num_blocks: int, block_size: int, max_model_len: int,
         num_slots: int | None = None, window: int | None = None) -> Pool:  # fmt: skip
    """A pass over `cache` (built by harness.serve.engine.build_cache) with make_kv_manager's manager of
    `strategy`: the exact reference's, and the tests'."""

    def new_engine(**forcing) -> Engine:
        return Engine(model, cache, num_slots=num_slots, window=window, **forcing)

    def new_manager() -> KVManager:
        return make_kv_manager(strategy, num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                               sliding_window=window)  # fmt: skip

    return Pool(new_engine, new_manager)


def forced_pass(
    requests: Sequence[Request],
    prompt_ids: Sequence[Sequence[int]],
    *,
    pool: Pool,
    scheduler_config: SchedulerConfig,
    on_logprobs: Callable[[int, int, torch.Tensor], None],
    forced: dict[int, list[int]] | None = None,
) -> dict[int, list[int]]:
    """Serve `requests` on `pool` with every arrival at t = 0, appending the forced tokens (None: greedy ones), and
    hand each sampling position's log-probabilities to on_logprobs(request id, output index, [V] fp32 host).
    Returns request id -> its output tokens (the forced ones, when forced)."""
    engine = pool.new_engine(forced=forced, on_logprobs=on_logprobs)
    scheduler = Scheduler(scheduler_config, pool.new_manager())
    at_once = [dataclasses.replace(request, arrival_s=0.0) for request in requests]
    return serve(at_once, prompt_ids, scheduler=scheduler, engine=engine).outputs


def compare_served(
    requests: Sequence[Request],
    prompt_ids: Sequence[Sequence[int]],
    *,
    exact: Pool,
    lossy: Pool,
    scheduler_config: SchedulerConfig,
) -> dict[str, float | int]:
    """The exact pass, then the lossy one forced on its outputs; the columns over every output position."""
    reference: dict[tuple[int, int], torch.Tensor] = {}

    def keep(request_id: int, index: int, logprobs: torch.Tensor) -> None:
        reference[request_id, index] = logprobs

    outputs = forced_pass(requests, prompt_ids, pool=exact, scheduler_config=scheduler_config, on_logprobs=keep)
    kl, agree = [], []

    def measure(request_id: int, index: int, logprobs: torch.Tensor) -> None:
        exact_row = reference.pop((request_id, index))  # [V]; popped: each position is measured once
        kl.append(kl_per_step(exact_row, logprobs).item())
        agree.append(int(exact_row.argmax()) == int(logprobs.argmax()))

    forced = forced_pass(requests, prompt_ids, pool=lossy, scheduler_config=scheduler_config, on_logprobs=measure,
                         forced=outputs)  # fmt: skip
    assert forced == outputs, "the lossy pass must append the exact pass's tokens"
    assert not reference, f"{len(reference)} exact positions the lossy pass never reached"
    return summarize(kl, agree)


def summarize(kl: Sequence[float], agree: Sequence[bool]) -> dict[str, float | int]:
    """Mean, p99 and max KL (clamped at 0, as kl_mean: a KL below it is rounding) and the top-1 agreement."""
    values = torch.tensor(kl, dtype=torch.float64).clamp_min(0.0)
    return {
        "accuracy_kl_mean": values.mean().item(),
        "accuracy_kl_p99": values.quantile(0.99).item(),
        "accuracy_kl_max": values.max().item(),
        "accuracy_top1_agreement": sum(agree) / len(agree),
        "accuracy_tokens": len(kl),
    }


def served_accuracy(
    p, *, model: torch.nn.Module, args, cache, lossy: Pool, prompt_ids: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """A run's accuracy columns (harness.serve.run._serve_into, after the run row's figures): {} for a strategy whose
    Serving declares it exact, or accuracy_requests=0. p: the run's harness.serve.run.Plan; lossy: the run's own
    engine and manager, over its pool `cache` (whose blocks are written before they are read, as warm_up's). The
    exact pass reuses that pool when it is a paged one; else a paged pool just large enough for its requests."""
    cfg = p.cfg
    n = accuracy_requests(cfg.accuracy_requests, len(p.requests))
    declared = serving(cfg.strategy)
    if n == 0 or declared.exact:
        return {}
    requests, prompts = p.requests[:n], prompt_ids[:n]  # the first n in stream order: the same on every rerun
    exact_cache, num_blocks = cache, p.num_blocks
    if not (declared.paged and (declared.storage or cfg.strategy) == EXACT_STRATEGY):
        blocks = sum(math.ceil((r.prompt_len + r.output_len) / cfg.block_size) for r in requests)
        num_blocks = math.ceil(blocks / (1 - cfg.watermark)) + 1  # all of them at once, above the admission watermark
        exact_cache, _ = build_cache(EXACT_STRATEGY, args, kv_dtype=p.kv_dtype, num_blocks=num_blocks,
                                     block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                                     device=next(model.parameters()).device, dtype=cfg.dtype)  # fmt: skip
    exact = pool(model, exact_cache, strategy=EXACT_STRATEGY, num_blocks=num_blocks, block_size=cfg.block_size,
                 max_model_len=cfg.max_model_len)  # fmt: skip
    columns = compare_served(requests, prompts, exact=exact, lossy=lossy, scheduler_config=p.scheduler_config)
    columns |= {"accuracy_requests": n, "accuracy_reference": f"{EXACT_STRATEGY} {p.kv_dtype}"}
    assert tuple(columns) == ACCURACY_RUN_COLUMNS, "the run row's accuracy columns are metrics' (null without)"
    return columns
