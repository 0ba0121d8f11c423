"""The serving run's config: a Workload (the model, its formats, the prompt lengths) plus the KV pool, vLLM's
scheduler knobs, the request stream and the SLOs.

Hydra composes conf/serve.yaml onto ServeConfig (registered in its ConfigStore by experiments/serve.py, the app, as
experiments/decode.py registers RunConfig); the checks that need no heavy work run at construction.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from harness import kv
from harness.config import DTYPES, Workload, check_choice, device_type
from harness.errors import ConfigError
from harness.formats import ATTN_IMPLS
from harness.serve.accuracy import check_accuracy_requests
from harness.serve.dataset import DATASETS, check_tokenizer_dir
from harness.serve.engine import SERVE_KV_DTYPES
from harness.serve.kv_manager import check_window, serving
from harness.serve.metrics import STRATEGY_RUN_COLUMNS, parse_slo_ms
from harness.serve.multiturn import check_session_knobs
from harness.serve.scheduler import SchedulerConfig
from harness.serve.sustained import DEFAULT_SLO_ATTAINMENT, check_slo_attainment
from harness.serve.tiered import check_overlap, check_tiers, split_tiers

# Workload fields a serving run does not take: the stream sets the batch, the engine attends on a float or
# per-token-scaled pool (no int4 groups). Each must stay at its default, so that none is silently ignored.
NOT_SERVED = ("batch_size", "kv_group_size", "kv_residual")
# Fields served later than the first recorded runs: recorded only when set away from their default, so that a run
# at the default keeps the config keys recorded before the field served (the run row records slo_attainment anyway).
RECORDED_IF_SET = {"attn_impl": "sdpa", "mla_path": "absorbed", "slo_attainment": DEFAULT_SLO_ATTAINMENT}
DATASET_FIELDS = ("dataset", "dataset_path", "sharegpt_output_len")  # dataset=sharegpt's (check_dataset)
SESSION_FIELDS = ("max_turns", "think_time_s")  # dataset=sharegpt-multiturn's alone
DERIVED = {"cache": "strategy and block_size", "gen_len": "output_len"}  # set from these at construction


@dataclass
class ServeConfig(Workload):
    """One serving run: the model, the KV pool, vLLM's scheduler knobs, the request stream, the SLOs.

    The Workload's fields keep their meaning (model, weights, dtype, kv_dtype, prompt_len, prefix_len, attn_impl,
    ...); prompt_len and prefix_len are the stream's (harness.serve.requests.RequestSpec). The pool is named with
    vLLM's knobs, strategy, block_size and sliding_window, which every serving command line, preset and run row
    already uses; the Workload's `cache` is derived from them at construction (the strategy, plus its block_size
    when it serves from blocks), and gen_len from output_len, so that the config names each thing once and
    `workload()` is the planner's Workload of this run. Setting cache or gen_len directly has no effect.

    Validated at construction: the serving checks that need no heavy work, in the order a user fixes them (the
    strategy, the dtypes, the scheduler's preemption mode, the dataset and its tokenizer's files, the window, the
    device, the SLOs); the stream (a dataset read and sampled), the budget and the Workload's own checks follow in
    harness.serve.run.plan, on the workloads it prices the pool with.
    """

    dtype: str = "fp32"  # compute dtype
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    # The KV pool: exactly one of kv_memory_gb (GiB of KV) and gpu_memory_utilization (vLLM's; the planner subtracts
    # weights, buffers, activations and runtime from that share of memory_gb, or of the device's memory).
    strategy: str = "paged"  # one that serves (harness.kv.serving_names): contiguous | evict | paged | prefix | sliding
    block_size: int = 16
    sliding_window: int | None = None  # sliding: tokens a query reads back (its own included)
    kv_memory_gb: float | None = None
    gpu_memory_utilization: float | None = None
    memory_gb: float | None = None
    # vLLM's scheduler, at its defaults (harness.serve.scheduler.SchedulerConfig, the one place they are declared)
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    watermark: float = SchedulerConfig.watermark
    preemption_mode: str = SchedulerConfig.preemption_mode  # recompute | swap
    max_model_len: int = 2048
    # The stream (harness.serve.requests.RequestSpec), or a trace file that replaces it
    num_prompts: int = 100
    qps: float = math.inf
    burstiness: float = 1.0
    prompt_len: int = 256
    prompt_dist: str = "fixed"
    prompt_spread: float = 0.0
    output_len: int = 64
    output_dist: str = "fixed"
    output_spread: float = 0.0
    trace: str | None = None  # JSONL or CSV: arrival_s, prompt_len, output_len
    # random: the stream above; sharegpt: prompts and replies of ShareGPT V3 conversations, sampled as vLLM bench
    # serve does (harness.serve.dataset), tokenized by the checkpoint's tokenizer (weights=DIR); the arrivals above
    dataset: str = "random"
    dataset_path: str | None = None  # sharegpt: a local ShareGPT-format JSON instead of the packaged file
    sharegpt_output_len: int | None = None  # sharegpt: every request's output tokens; null: its reply's (vLLM's)
    # sharegpt-multiturn: each conversation a chat session (harness.serve.multiturn), num_prompts of them starting
    # at the arrivals above, each turn's prompt its whole history through the tokenizer's chat template
    max_turns: int | None = None  # turns per session at most; null: every turn of the conversation
    # Mean seconds between a turn's reply and the next turn (exponential, seeded). 0, the default: the next turn as
    # soon as the reply is in, the tightest closed loop, so a run's wall time is its compute; a person's pause costs
    # wall time (the engine sleeps through it when idle) and gives other sessions' blocks time to evict the history.
    think_time_s: float = 0.0
    text_ids: str | None = None  # a tokenized local text (a JSON list or .npy of ids) the prompts are cut from
    # SLOs with a unit ("500ms", "2s"): goodput counts the requests meeting all of them
    ttft_slo_ms: str | None = None
    tpot_slo_ms: str | None = None
    slo_attainment: float = DEFAULT_SLO_ATTAINMENT  # a sustained run's share of requests within the SLOs (sustained.py)
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    # A lossy strategy's (its Serving.exact False, sliding): the first n requests of the stream served again after
    # the run, exactly (paged) then teacher-forced through the strategy, for the run row's accuracy_* (KL, top-1;
    # harness.serve.accuracy). null: 8, or all of a shorter stream; 0: off. Untimed: the run's figures come first.
    accuracy_requests: int | None = None
    # strategy=prefix with cache.host_gb / disk_dir: tier loads overlapped with the forward (harness.serve.tier_loader:
    # disk blocks prefetched from a request's arrival, loads copied in layer by layer); false: synchronous, before the
    # forward. null, the default: true when the run has tiers; an explicit true without tiers is refused.
    tier_overlap: bool | None = None
    warmup: bool = True  # one forward before the clock starts (first-call costs: allocator, oneDNN, kernels)
    results_dir: str = "results"
    run_id: str | None = None  # null: <sweep_id>-<strategy>-<kv_dtype>-qps<qps>

    def __post_init__(self) -> None:
        served = serving(self.strategy)  # one line for a strategy unknown or that does not serve, with its reason
        # cache.host_gb / disk_dir / disk_gb (conf/serve.yaml): the prefix pool's tiers, the one part of `cache` a
        # serving run sets (harness.serve.tiered); the planner's cache stays the strategy's.
        rest, self.tier_options = split_tiers({"name": self.cache} if isinstance(self.cache, str) else self.cache)
        # A budgeted strategy's options (evict's cache.policy, cache.budget, cache.window) are the rest of `cache`;
        # null (conf/serve.yaml's): the option's default
        rest = {key: value for key, value in rest.items() if value is not None}
        self.strategy_options = {key: rest.pop(key) for key in list(rest) if key != "name"} if served.budgeted else {}
        self.cache = rest or {"name": "contiguous"}  # only tier options given: the rest is the default
        # A windowed or budgeted strategy's cache is its name (and a budget's options) alone: its blocks are its
        # storage's (Serving.storage), and the planner asks its serving manager what a request holds
        # (harness.serve.concurrency.predict_concurrency).
        blocks = {"block_size": self.block_size} if served.paged and not (served.windowed or served.budgeted) else {}
        derived = {"cache": {"name": self.strategy, **blocks, **self.strategy_options}, "gen_len": self.output_len}
        if unknown := sorted(set(self.cache) - {"name"}):  # a budgeted strategy's option beside another strategy
            budgeted = ", ".join(name for name in kv.serving_names() if kv.serving(name).budgeted)
            raise ConfigError(f"cache.{unknown[0]}: only strategy={budgeted} takes options in a serving run; "
                              f"allowed: leave it unset with strategy={self.strategy}")  # fmt: skip
        defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                    for f in dataclasses.fields(Workload)}  # fmt: skip
        for name, value in derived.items():  # a value set by hand: refused, not overwritten unseen
            if getattr(self, name) not in (defaults[name], value):
                raise ConfigError(f"{name}: set from {DERIVED[name]} in a serving run; allowed: leave it unset")
            setattr(self, name, value)
        for name in NOT_SERVED:
            if getattr(self, name) != defaults[name]:
                raise ConfigError(f"{name}: a serving run does not take it; allowed: {defaults[name]}")
        super().__post_init__()

    def validate(self) -> None:
        """The serving checks, each one line naming its field; the Workload's run on plan()'s workloads."""
        check_choice("dtype", self.dtype, tuple(DTYPES))
        check_choice("kv_dtype", self.kv_dtype_name, ("auto", *SERVE_KV_DTYPES))
        check_choice("attn_impl", self.attn_impl, ATTN_IMPLS)  # eager: harness.kv.varlen.attend's scores written out
        check_choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        self.check_dataset()
        check_window(self.strategy, self.sliding_window)
        if self.sliding_window is not None and self.sliding_window >= self.max_model_len:
            raise ConfigError(f"sliding_window: must be below max_model_len={self.max_model_len} (a window of a whole "
                              f"request frees no block: strategy=paged), got {self.sliding_window}")  # fmt: skip
        check_tiers(self.strategy, self.tier_options)
        if serving(self.strategy).budgeted:  # parsed, then what serving refuses (snapkv): one line each
            kv.serving_options(self.strategy, self.strategy_options)
        check_overlap(self.tier_overlap, self.tier_options)
        device_type(self.device)
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            parse_slo_ms(getattr(self, name), name)
        check_slo_attainment(self.slo_attainment)
        check_accuracy_requests(self.accuracy_requests, num_prompts=self.num_prompts if self.trace is None else None)

    def check_dataset(self) -> None:
        """dataset and what goes with it: a dataset's prompts come whole from its text, so the knobs that make or
        replace prompts are refused beside it, and its text needs the checkpoint's tokenizer."""
        check_choice("dataset", self.dataset, DATASETS)
        check_session_knobs(max_turns=self.max_turns, think_time_s=self.think_time_s)
        if self.dataset != "sharegpt-multiturn":
            for name, allowed in (("max_turns", None), ("think_time_s", 0.0)):
                if getattr(self, name) != allowed:
                    raise ConfigError(f"{name}: only dataset=sharegpt-multiturn takes it; allowed: "
                                      f"{'null' if allowed is None else 0} with dataset={self.dataset}")  # fmt: skip
        if self.dataset == "random":
            for name in ("dataset_path", "sharegpt_output_len"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"{name}: only dataset=sharegpt or sharegpt-multiturn takes it; allowed: null with dataset=random"
                    )
            return
        for name, allowed in (("trace", None), ("text_ids", None), ("prefix_len", 0)):
            if getattr(self, name) != allowed:
                raise ConfigError(
                    f"{name}: dataset={self.dataset} takes its prompts from its conversations; allowed: "
                    f"{'null' if allowed is None else allowed}"
                )
        value = self.sharegpt_output_len
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"sharegpt_output_len: must be an integer >= 1, or null (the reply's), got {value!r}")
        check_tokenizer_dir(self.weights, self.dataset)

    def config_dict(self) -> dict[str, Any]:
        """The config a run records (its manifest and config_json): the fields a user sets. Those derived or not
        taken (always their defaults) are left out, so every run's config_json has the same keys, earlier ones too;
        so are the dataset's fields in a dataset=random run (the run row's `dataset` column says random), which keeps
        a random run's keys those of the runs recorded before datasets existed."""
        out = {name: value for name, value in asdict(self).items() if name not in (*DERIVED, *NOT_SERVED)}
        if self.dataset == "random":
            for name in DATASET_FIELDS:
                del out[name]
        for name, default in RECORDED_IF_SET.items():
            if out[name] == default:
                del out[name]
        if self.dataset != "sharegpt-multiturn":  # so a sharegpt run's keys stay those recorded before sessions
            for name in SESSION_FIELDS:
                del out[name]
        out["model"] = asdict(self.model) if not isinstance(self.model, dict) else self.model
        if serving(self.strategy).exact:  # no accuracy pass: its keys stay those recorded before accuracy_requests
            del out["accuracy_requests"]
        if self.tier_options.enabled:  # a run without tiers keeps the keys recorded before them
            out["cache"] = self.tier_options.as_dict()
        else:  # tier_overlap means nothing without tiers: the keys recorded before it
            del out["tier_overlap"]
        if self.strategy_options:  # a budgeted strategy's options as given (their defaults: strategy_columns)
            out["cache"] = dict(self.strategy_options)
        return out

    def token_budget(self) -> int | None:
        """Tokens a budgeted strategy's request holds at most (evict's cache.budget); None for the others."""
        if not serving(self.strategy).budgeted:
            return None
        return kv.serving_options(self.strategy, self.strategy_options).budget

    def strategy_columns(self) -> dict[str, Any]:
        """The run row's budgeted-strategy columns (evict's policy, budget, obs_window, as its static rows name them:
        harness.kv.evict.EvictLayout.option_columns); null for the other strategies."""
        if not serving(self.strategy).budgeted:
            return dict.fromkeys(STRATEGY_RUN_COLUMNS)
        options = self.strategy_options
        columns = kv.layout(self.strategy, options).option_columns()
        return {name: columns.get(name) for name in STRATEGY_RUN_COLUMNS}

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            watermark=self.watermark,
            preemption_mode=self.preemption_mode,
            max_model_len=self.max_model_len,
        )
