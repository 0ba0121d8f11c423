"""Serve a request stream on the real model, continuous batching over a KV pool; one Hydra job per run.

    python -m experiments.serve experiment=serve-quick            # the small model on the CPU, a few dozen requests
    python -m experiments.serve strategy=contiguous kv_memory_gb=0.25 num_prompts=64 qps=4
    python -m experiments.serve -m experiment=serve-qps          # qps x strategy: the saturation sweep and its knee
    python -m experiments.serve trace=my_trace.jsonl               # arrival_s, prompt_len, output_len per line

Everything is checked before the model is built (the stream, the budget against the longest request, the knobs,
the SLOs), so bad input costs one line and writes nothing. The run's rows go to <results_dir>/serve/<run_id>/ as
it runs (harness.serve.rows): a run killed midway keeps its finished requests; run.parquet, written last, holds the
run row: vLLM benchmark_serving's metrics beside the planner's predicted concurrency for the same pool.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from harness.config import DTYPES, ModelConfig, Workload, check_choice, device_type, resolve_kv_dtype
from harness.errors import ConfigError, exit_on_config_error
from harness.model import build_model
from harness.serve import capacity
from harness.serve.engine import SERVE_KV_DTYPES, Engine, build_cache, check_servable, serve
from harness.serve.kv_manager import check_window, make_kv_manager, num_blocks_for, serving
from harness.serve.metrics import SLO_COLUMNS, parse_slo_ms, request_row, run_metrics
from harness.serve.requests import RequestSpec, describe, generate, prompt_token_ids, read_trace
from harness.serve.rows import ServeRunWriter, iteration_row, serve_run_dir
from harness.serve.scheduler import Scheduler, SchedulerConfig
from harness.store.summary import next_step

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
log = logging.getLogger("kvbench")
FLUSH_EVERY_S = 1.0  # finished requests reach disk at least this often (s), whatever ServeRunWriter's flush_every


@dataclass
class ServeConfig:
    """One serving run: the model, the KV pool, vLLM's scheduler knobs, the request stream, the SLOs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    weights: str = "dummy"  # "dummy" (seeded, the preset's shapes) or a local Hugging Face checkpoint directory
    dtype: str = "fp32"  # compute dtype
    kv_dtype: str = "auto"  # auto (= dtype), fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, int8
    device: str = "auto"
    seed: int = 0
    # The KV pool: exactly one of kv_memory_gb (GiB of KV) and gpu_memory_utilization (vLLM's; the planner subtracts
    # weights, buffers, activations and runtime from that share of memory_gb, or of the device's memory).
    strategy: str = "paged"  # one that serves (harness.kv.serving_names): contiguous | paged | prefix | sliding
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
    prefix_len: int = 0
    trace: str | None = None  # JSONL or CSV: arrival_s, prompt_len, output_len
    text_ids: str | None = None  # a tokenized local text (a JSON list or .npy of ids) the prompts are cut from
    # SLOs with a unit ("500ms", "2s"): goodput counts the requests meeting all of them
    ttft_slo_ms: str | None = None
    tpot_slo_ms: str | None = None
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    warmup: bool = True  # one forward before the clock starts (first-call costs: allocator, oneDNN, kernels)
    results_dir: str = "results"
    run_id: str | None = None  # null: <sweep_id>-<strategy>-<kv_dtype>-qps<qps>


ConfigStore.instance().store(name="serve_config", node=ServeConfig)


@dataclass
class Plan:
    """What a run needs, worked out from its config before anything heavy is built."""

    cfg: ServeConfig
    workload: Workload
    kv_dtype: str
    device: str
    requests: list
    scheduler_config: SchedulerConfig
    budget: capacity.KVBudget
    num_blocks: int
    predicted_max_running: int | None
    budget_bytes_per_block: int
    text_ids: list[int] | None = None


def plan(cfg: ServeConfig) -> Plan:
    """Every check, in the order a user fixes them; a ConfigError names the field."""
    served = serving(cfg.strategy)  # one line for a strategy unknown or that does not serve, with its reason
    check_choice("dtype", cfg.dtype, tuple(DTYPES))
    kv_dtype = resolve_kv_dtype(cfg.kv_dtype, cfg.dtype)
    check_choice("kv_dtype", kv_dtype, ("auto", *SERVE_KV_DTYPES))
    check_choice("preemption_mode", cfg.preemption_mode, ("recompute", "swap"))
    check_window(cfg.strategy, cfg.sliding_window)
    device = device_type(cfg.device)
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        parse_slo_ms(getattr(cfg, name), name)
    scheduler_config = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        watermark=cfg.watermark,
        preemption_mode=cfg.preemption_mode,
        max_model_len=cfg.max_model_len,
    )
    if cfg.trace is not None:
        requests = read_trace(cfg.trace, max_model_len=cfg.max_model_len)
    else:
        spec = RequestSpec(**{name: getattr(cfg, name) for name in RequestSpec.__dataclass_fields__
                              if name not in ("seed", "max_model_len")}, seed=cfg.seed,
                           max_model_len=cfg.max_model_len)  # fmt: skip
        requests = generate(spec)
    # The planner's workload: the paged layout prices a block (every strategy's pool is one of blocks here).
    paged = Workload(model=cfg.model, weights=cfg.weights, dtype=cfg.dtype, kv_dtype=kv_dtype,
                     cache={"name": "paged", "block_size": cfg.block_size})  # fmt: skip
    check_servable(paged.model_args())
    knobs = dict(max_model_len=cfg.max_model_len, device=device, max_num_batched_tokens=cfg.max_num_batched_tokens,
                 max_num_seqs=cfg.max_num_seqs)  # fmt: skip
    if cfg.kv_memory_gb is None and cfg.gpu_memory_utilization is None and device == "cuda":
        knobs["gpu_memory_utilization"] = 0.9  # vLLM's default
    else:
        knobs |= dict(kv_memory_gb=cfg.kv_memory_gb, gpu_memory_utilization=cfg.gpu_memory_utilization,
                      memory_gb=cfg.memory_gb)  # fmt: skip
    budget = capacity.kv_budget(paged, **knobs)
    block_bytes = capacity.bytes_per_block(paged)
    num_blocks = num_blocks_for(budget.kv_bytes, block_bytes)
    # The pool against what the device has free now: a budget past it is one line, not the OOM killer mid-run.
    field = "memory_gb" if budget.source == "gpu_memory_utilization" and cfg.memory_gb is not None else budget.source
    capacity.check_pool_fits(num_blocks * block_bytes, field=field, device=device)
    # Every request must run alone in this pool, the one-line refusal a server gives before serving.
    probe = Scheduler(scheduler_config, kv_manager(cfg, num_blocks))
    for request in requests:
        probe.add_request(request)
    predicted = None
    if not served.windowed:  # the planner models a window as a ring per request, not as paged blocks
        options = {"block_size": cfg.block_size} if served.paged else {}
        workload = Workload(model=cfg.model, weights=cfg.weights, dtype=cfg.dtype, kv_dtype=kv_dtype,
                            cache={"name": cfg.strategy, **options})  # fmt: skip
        predicted = capacity.predict_concurrency(
            workload, requests, kv_budget_bytes=budget.kv_bytes, max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs, watermark=cfg.watermark,
        ).predicted_max_running  # fmt: skip
    text_ids = read_text_ids(cfg.text_ids) if cfg.text_ids is not None else None
    if text_ids is not None:  # its length and id range, against this stream and this model, before any work
        prompt_token_ids(requests, vocab_size=paged.model_args().vocab_size, seed=cfg.seed, text_ids=text_ids)
    return Plan(cfg, paged, kv_dtype, device, requests, scheduler_config, budget, num_blocks, predicted, block_bytes,
                text_ids)  # fmt: skip


def read_text_ids(path: str) -> list[int]:
    """A tokenized text: a JSON list of ints, or a 1-D integer .npy (what a tokenizer's encode() gives, saved)."""
    import json

    import numpy as np

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"text_ids: {path} is not a file (a JSON list of token ids, or a .npy of them)")
    try:
        ids = np.load(file) if file.suffix == ".npy" else np.asarray(json.loads(file.read_text()))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"text_ids: {path} is neither a JSON list nor a .npy of token ids: {exc}") from None
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(
            f"text_ids: {path} must hold a non-empty 1-D list of integer ids, got {ids.dtype} {ids.shape}"
        )
    return ids.tolist()


def kv_manager(cfg: ServeConfig, num_blocks: int):
    return make_kv_manager(cfg.strategy, num_blocks=num_blocks, block_size=cfg.block_size,
                           max_model_len=cfg.max_model_len, sliding_window=cfg.sliding_window)  # fmt: skip


def run(p: Plan, *, run_dir: Path, sweep_id: str) -> dict:
    """Build the model and the pool, serve the stream, write the rows; returns the run row.

    The run's manifest is written first (status running, the config, the start time), before the model is built:
    a run killed while building or warming up still leaves its folder, which the Serving page lists as unfinished;
    an exception marks it failed, and close() finished."""
    with ServeRunWriter(run_dir) as writer:
        writer.start(config=config_dict(p.cfg))
        return _serve_into(p, writer=writer, sweep_id=sweep_id)


def _serve_into(p: Plan, *, writer: ServeRunWriter, sweep_id: str) -> dict:
    """run()'s work inside its started writer: the model, the pool, the stream served, the rows and the run row."""
    cfg, device = p.cfg, torch.device(p.device)
    args = p.workload.model_args()
    model = build_model(args, weights=cfg.weights, dtype=DTYPES[cfg.dtype], device=device, seed=cfg.seed,
                        n_positions=cfg.max_model_len)  # fmt: skip
    cache, num_slots = build_cache(cfg.strategy, args, kv_dtype=p.kv_dtype, num_blocks=p.num_blocks,
                                   block_size=cfg.block_size, max_model_len=cfg.max_model_len, device=device,
                                   dtype=cfg.dtype)  # fmt: skip
    engine = Engine(model, cache, num_slots=num_slots, window=cfg.sliding_window)
    scheduler = Scheduler(p.scheduler_config, kv_manager(cfg, p.num_blocks))
    prompts = prompt_token_ids(p.requests, vocab_size=args.vocab_size, seed=cfg.seed, text_ids=p.text_ids)
    if cfg.warmup:
        warm_up(model, cache, block_size=cfg.block_size, paged=num_slots is None)
    used, steps_ms, scheduler_ms = [], [], []
    bytes_per_token = p.budget_bytes_per_block / cfg.block_size  # a block's K, V and scales over all layers

    def on_iteration(index, output, step_s, scheduler_s):
        writer.add_iteration(iteration_row(index, output, step_s, scheduler_s=scheduler_s,
                                           kv_bytes_per_token=bytes_per_token))  # fmt: skip
        used.append(output.kv.blocks_used)
        steps_ms.append(step_s * 1e3)
        scheduler_ms.append(scheduler_s * 1e3)

    flushed = [time.monotonic()]

    def on_finish(record):
        writer.add_request(request_row(record))
        if time.monotonic() - flushed[0] >= FLUSH_EVERY_S:  # a run killed midway keeps what finished
            writer.flush()
            flushed[0] = time.monotonic()

    result = serve(p.requests, prompts, scheduler=scheduler, engine=engine, on_iteration=on_iteration,
                   on_finish=on_finish)  # fmt: skip
    row = run_metrics(result.records, result.duration_s, percentiles=cfg.percentiles,
                      ttft_slo_ms=cfg.ttft_slo_ms, tpot_slo_ms=cfg.tpot_slo_ms)  # fmt: skip
    row |= {
        "sweep_id": sweep_id,
        "engine": "kvbench",
        "strategy": cfg.strategy,
        "kv_dtype": p.kv_dtype,
        "model": args.name,
        "device": p.device,
        # a trace's offered rate: its requests over its last arrival (inf when all arrive at 0)
        "qps": float(cfg.qps) if cfg.trace is None else describe(p.requests)["offered_qps"],
        "num_blocks": p.num_blocks,
        "block_size": cfg.block_size,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "kv_budget_bytes": p.budget.kv_bytes,
        "num_iterations": result.num_iterations,
        "predicted_max_running": p.predicted_max_running,
        "mean_kv_utilization": sum(used) / len(used) / p.num_blocks,
        "peak_kv_utilization": max(used) / p.num_blocks,
        "mean_step_ms": sum(steps_ms) / len(steps_ms),
        "mean_scheduler_ms": sum(scheduler_ms) / len(scheduler_ms),
    }
    writer.close(row, config=config_dict(cfg))
    return row


def warm_up(model, cache, *, block_size: int, paged: bool) -> None:
    """One 8-token prefill into block (or slot) 0 before the clock starts; whatever it writes is overwritten before
    any query reads it, as a request's own tokens are written before they are read."""
    from harness.kv.varlen import SeqBatch

    n = min(8, block_size) if paged else 8
    batch = SeqBatch((0,), (0,), (n,), block_tables=((0,),) if paged else ())
    with torch.inference_mode():
        model(torch.zeros((1, n), dtype=torch.long, device=next(model.parameters()).device), batch, cache,
              last_only=True)  # fmt: skip


def config_dict(cfg: ServeConfig) -> dict[str, Any]:
    out = asdict(cfg)
    out["model"] = asdict(cfg.model) if not isinstance(cfg.model, dict) else cfg.model
    return out


def summary_lines(row: dict, run_dir: Path) -> list[str]:
    """What a user reads at the end of a run: the figures beside what bounds them."""
    predicted = row["predicted_max_running"]
    return [
        f"serve {row['strategy']} {row['kv_dtype']} at qps={row['qps']:g}: {row['completed']} requests in "
        f"{row['duration_s']:.1f} s ({row['num_iterations']} iterations) -> {run_dir}",
        f"  throughput   {row['output_throughput']:.1f} output tok/s, {row['request_throughput']:.2f} req/s "
        f"(goodput {row['request_goodput']:.2f} req/s: {goodput_terms(row)})",
        f"  TTFT         median {row['median_ttft_ms']:.0f} ms, p99 {row.get('p99_ttft_ms', math.nan):.0f} ms",
        f"  TPOT         median {row['median_tpot_ms']:.1f} ms, p99 {row.get('p99_tpot_ms', math.nan):.1f} ms",
        f"  concurrency  {row['max_running_requests']} running at most, measured; planner predicted "
        f"{'n/a' if predicted is None else predicted}; {row['max_concurrent_requests']} in flight at most "
        f"(queueing included); {row['total_preemptions']} preemptions",
        f"  KV pool      {row['num_blocks']} blocks of {row['block_size']} tokens "
        f"({row['kv_budget_bytes'] / 2**20:.0f} MiB), used {100 * row['mean_kv_utilization']:.0f}% on average, "
        f"{100 * row['peak_kv_utilization']:.0f}% at peak; prefix hit rate {100 * row['prefix_hit_rate']:.0f}%",
        f"  host         {row['mean_step_ms']:.1f} ms per forward, scheduler {row['mean_scheduler_ms']:.2f} ms "
        f"per iteration ({100 * row['mean_scheduler_ms'] / (row['mean_step_ms'] + row['mean_scheduler_ms']):.1f}%)",
    ]


def goodput_terms(row: dict) -> str:
    """What defines the goodput beside it: how many requests met which SLOs, or that none was given."""
    slos = [f"{name} <= {_duration(row[column])}" for column, name in SLO_COLUMNS.items() if row.get(column)]
    if not slos:
        return "no SLO given, every request counts"
    good = round(row["request_goodput"] * row["duration_s"])  # goodput = good requests / duration
    return f"{good} of {row['completed']} requests met {' and '.join(slos)}"


def _duration(ms: float) -> str:
    return f"{ms / 1e3:g} s" if ms >= 1e3 else f"{ms:g} ms"  # 10 s, 250 ms: as the SLO was likely written


def run_names(cfg: ServeConfig, kv_dtype: str) -> tuple[str, str]:
    """(sweep_id, run_id): the sweep's (or the run's) Hydra folder name, and this run's folder name."""
    hc = HydraConfig.get()
    sweep_id = Path(hc.sweep.dir if hc.mode.name == "MULTIRUN" else hc.run.dir).name
    if cfg.run_id is not None:
        return sweep_id, cfg.run_id
    qps = "trace" if cfg.trace is not None else ("inf" if math.isinf(cfg.qps) else f"{cfg.qps:g}")
    suffix = f"-{hc.job.num}" if hc.mode.name == "MULTIRUN" else ""
    return sweep_id, f"{sweep_id}-{cfg.strategy}-{kv_dtype}-qps{qps}{suffix}"


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="serve")
@exit_on_config_error
def main(cfg: DictConfig) -> dict:
    serve_cfg = OmegaConf.to_object(cfg)
    started = time.perf_counter()
    p = plan(serve_cfg)
    sweep_id, run_id = run_names(serve_cfg, p.kv_dtype)
    run_dir = serve_run_dir(serve_cfg.results_dir, run_id)
    ServeRunWriter(run_dir)  # refuses a folder that already holds a run, before the model is built
    log.info("serving %d requests, %d blocks of %d tokens (%s)", len(p.requests), p.num_blocks,
             serve_cfg.block_size, serve_cfg.strategy)  # fmt: skip
    row = run(p, run_dir=run_dir, sweep_id=sweep_id)
    print("\n".join(summary_lines(row, run_dir)) + f"\n  wall         {time.perf_counter() - started:.1f} s")
    print(next_step(run_dir, results_dir=serve_cfg.results_dir, page="Serving"))
    return {"run_dir": str(run_dir), "row": row}


if __name__ == "__main__":
    main()
