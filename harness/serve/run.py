"""A serving run, planned then served: plan() checks everything before anything heavy is built (the stream, the
budget against the longest request, the knobs), run() builds the model and the pool, warms up, serves the stream
and writes the rows (harness.serve.rows). The Hydra app around them is experiments/serve.py.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.config import DTYPES, Workload, device_type
from harness.errors import ConfigError
from harness.modeling.model import build_model
from harness.serve.accuracy import Pool, served_accuracy
from harness.serve.budget import KVBudget, bytes_per_block, check_pool_fits, kv_budget
from harness.serve.concurrency import predict_concurrency
from harness.serve.config import ServeConfig
from harness.serve.dataset import check_vocab, dataset_columns, load_tokenizer, sample_sharegpt
from harness.serve.engine import Engine, build_cache, check_servable, serve
from harness.serve.kv_manager import make_kv_manager, num_blocks_for, serving
from harness.serve.metrics import request_row, run_metrics
from harness.serve.multiturn import Sessions, sample_sessions
from harness.serve.requests import RequestSpec, describe, generate, prompt_token_ids, read_trace
from harness.serve.rows import ServeRunWriter, iteration_row
from harness.serve.scheduler import Scheduler, SchedulerConfig
from harness.serve.sharegpt import read_sharegpt
from harness.serve.tier_store import ServeTiers
from harness.serve.tiered import TieredPrefixManager, make_disk_dir, overlaps

FLUSH_EVERY_S = 1.0  # finished requests reach disk at least this often (s), whatever ServeRunWriter's flush_every


@dataclass
class Plan:
    """What a run needs, worked out from its config before anything heavy is built."""

    cfg: ServeConfig
    workload: Workload
    kv_dtype: str
    device: str
    requests: list
    scheduler_config: SchedulerConfig
    budget: KVBudget
    num_blocks: int
    predicted_max_running: int | None
    budget_bytes_per_block: int
    text_ids: list[int] | None = None
    prompt_ids: list[list[int]] | None = None  # a dataset's prompts, tokenized; None: made from the stream at run()
    dataset_columns: dict = dataclasses.field(default_factory=dict)  # the run row's dataset, its digest, its drops
    sessions: Sessions | None = None  # sharegpt-multiturn's: requests is then every turn, served closed-loop


def plan(cfg: ServeConfig) -> Plan:
    """The checks that need the stream or the model, after ServeConfig's own, in the order a user fixes them; a
    ConfigError names the field."""
    kv_dtype, device = cfg.kv_dtype_name, device_type(cfg.device)  # "auto" resolved (harness.config, the one place)
    scheduler_config = cfg.scheduler_config()
    prompt_ids, sessions, dataset = None, None, dataset_columns("trace" if cfg.trace is not None else cfg.dataset)
    if cfg.trace is not None:
        requests = read_trace(cfg.trace, max_model_len=cfg.max_model_len)
    elif cfg.dataset == "sharegpt":
        requests, prompt_ids, dataset = sharegpt_stream(cfg)
    elif cfg.dataset == "sharegpt-multiturn":
        sessions, dataset = session_stream(cfg)
        requests, prompt_ids = sessions.all_turns()  # every turn, for the checks; run() serves them closed-loop
    else:
        spec = RequestSpec(**{name: getattr(cfg, name) for name in RequestSpec.__dataclass_fields__
                              if name not in ("seed", "max_model_len")}, seed=cfg.seed,
                           max_model_len=cfg.max_model_len)  # fmt: skip
        requests = generate(spec)
    # The planner's workload: the paged layout prices a block (every strategy's pool is one of blocks here).
    paged = cfg.workload(kv_dtype=kv_dtype, cache={"name": "paged", "block_size": cfg.block_size})
    check_servable(paged.model_args(), attn_impl=cfg.attn_impl, windowed=serving(cfg.strategy).windowed)
    if prompt_ids is not None:
        check_vocab(prompt_ids, vocab_size=paged.model_args().vocab_size)
    knobs = dict(max_model_len=cfg.max_model_len, device=device, max_num_batched_tokens=cfg.max_num_batched_tokens,
                 max_num_seqs=cfg.max_num_seqs)  # fmt: skip
    if cfg.kv_memory_gb is None and cfg.gpu_memory_utilization is None and device == "cuda":
        knobs["gpu_memory_utilization"] = 0.9  # vLLM's default
    else:
        knobs |= dict(kv_memory_gb=cfg.kv_memory_gb, gpu_memory_utilization=cfg.gpu_memory_utilization,
                      memory_gb=cfg.memory_gb)  # fmt: skip
    budget = kv_budget(paged, **knobs)
    block_bytes = bytes_per_block(paged)
    num_blocks = num_blocks_for(budget.kv_bytes, block_bytes)
    # The pool against what the device has free now: a budget past it is one line, not the OOM killer mid-run.
    field = "memory_gb" if budget.source == "gpu_memory_utilization" and cfg.memory_gb is not None else budget.source
    check_pool_fits(num_blocks * block_bytes, field=field, device=device)
    # Every request must run alone in this pool, the one-line refusal a server gives before serving.
    probe = Scheduler(scheduler_config, kv_manager(cfg, num_blocks))
    for request in requests:
        probe.add_request(request)
    predicted = None
    # The planner models an open stream, not sessions whose turns wait on each other. A strategy whose serving
    # manager caps what a request holds (Serving.caps_blocks: sliding's window) is predicted by that manager.
    if sessions is None:
        predicted = predict_concurrency(
            cfg.workload(kv_dtype=kv_dtype), requests, kv_budget_bytes=budget.kv_bytes,
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs, watermark=cfg.watermark,
            kv_manager=probe.kv, max_num_batched_tokens=cfg.max_num_batched_tokens,
        ).predicted_max_running  # fmt: skip
    text_ids = read_text_ids(cfg.text_ids) if cfg.text_ids is not None else None
    make_disk_dir(cfg.tier_options)  # one line for a disk_dir that cannot be made, before the model is built
    if text_ids is not None:  # its length and id range, against this stream and this model, before any work
        prompt_token_ids(requests, vocab_size=paged.model_args().vocab_size, seed=cfg.seed, text_ids=text_ids)
    return Plan(cfg, paged, kv_dtype, device, requests, scheduler_config, budget, num_blocks, predicted, block_bytes,
                text_ids, prompt_ids, dataset, sessions)  # fmt: skip


def sharegpt_stream(cfg: ServeConfig) -> tuple[list, list[list[int]], dict]:
    """dataset=sharegpt's requests, their prompt ids (the checkpoint's tokenizer's) and the run row's dataset
    columns: the file's digest, and the conversations dropped by reason (harness.serve.dataset)."""
    file = read_sharegpt(cfg.dataset_path)
    sample = sample_sharegpt(file.conversations, tokenizer=load_tokenizer(cfg.weights), num_prompts=cfg.num_prompts,
                             seed=cfg.seed, max_model_len=cfg.max_model_len, output_len=cfg.sharegpt_output_len,
                             qps=cfg.qps, burstiness=cfg.burstiness)  # fmt: skip
    columns = dataset_columns("sharegpt", sha256=file.sha256, dropped=sample.dropped)
    return sample.requests, sample.prompt_ids, columns


def session_stream(cfg: ServeConfig) -> tuple[Sessions, dict]:
    """dataset=sharegpt-multiturn's sessions (the checkpoint's tokenizer and chat template) and the run row's
    dataset columns: the file's digest, the conversations dropped and the turns cut, by reason."""
    file = read_sharegpt(cfg.dataset_path)
    sessions = sample_sessions(file.conversations, tokenizer=load_tokenizer(cfg.weights), num_sessions=cfg.num_prompts,
                               seed=cfg.seed, max_model_len=cfg.max_model_len, block_size=cfg.block_size,
                               output_len=cfg.sharegpt_output_len, max_turns=cfg.max_turns,
                               think_time_s=cfg.think_time_s, qps=cfg.qps, burstiness=cfg.burstiness)  # fmt: skip
    columns = dataset_columns("sharegpt-multiturn", sha256=file.sha256, dropped=sessions.dropped,
                              cut_turns=sessions.cut_turns)  # fmt: skip
    return sessions, columns


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


def kv_manager(cfg: ServeConfig, num_blocks: int, *, tiers: ServeTiers | None = None):
    """The run's KV manager; with tiers (cache.host_gb, cache.disk_dir), the prefix pool that keeps its evictions."""
    if tiers is not None:
        return TieredPrefixManager(num_blocks=num_blocks, block_size=cfg.block_size, tiers=tiers)
    return make_kv_manager(cfg.strategy, num_blocks=num_blocks, block_size=cfg.block_size,
                           max_model_len=cfg.max_model_len, sliding_window=cfg.sliding_window,
                           budget=cfg.token_budget())  # fmt: skip


def run(p: Plan, *, run_dir: Path, sweep_id: str) -> dict:
    """Build the model and the pool, serve the stream, write the rows; returns the run row.

    The run's manifest is written first (status running, the config, the start time), before the model is built:
    a run killed while building or warming up still leaves its folder, which the Serving page lists as unfinished;
    an exception marks it failed, and close() finished."""
    with ServeRunWriter(run_dir) as writer:
        writer.start(config=p.cfg.config_dict())
        return _serve_into(p, writer=writer, sweep_id=sweep_id)


def _serve_into(p: Plan, *, writer: ServeRunWriter, sweep_id: str) -> dict:
    """run()'s work inside its started writer: the model, the pool, the stream served, the rows and the run row."""
    cfg, device = p.cfg, torch.device(p.device)
    args = p.workload.model_args()
    model = build_model(args, weights=cfg.weights, dtype=DTYPES[cfg.dtype], device=device, seed=cfg.seed,
                        n_positions=cfg.max_model_len, mla_path=cfg.mla_path)  # fmt: skip
    cache, num_slots = build_cache(cfg.strategy, args, kv_dtype=p.kv_dtype, num_blocks=p.num_blocks,
                                   block_size=cfg.block_size, max_model_len=cfg.max_model_len, device=device,
                                   dtype=cfg.dtype, attn_impl=cfg.attn_impl, options=cfg.strategy_options)  # fmt: skip
    tiers = None
    if cfg.tier_options.enabled:
        from harness.run.point import model_id  # the weights' identity, which the disk tier files blocks under

        tiers = ServeTiers.build(cfg.tier_options, cache=cache, model_id=model_id(cfg),
                                 overlap=overlaps(cfg.tier_overlap, cfg.tier_options))  # fmt: skip

    def new_engine(**forcing) -> Engine:  # the run's engine; an accuracy pass builds it again, teacher-forced
        return Engine(model, cache, num_slots=num_slots, window=cfg.sliding_window, tiers=tiers, **forcing)

    engine = new_engine()
    manager = kv_manager(cfg, p.num_blocks, tiers=tiers)
    scheduler = Scheduler(p.scheduler_config, manager)
    prompts = p.prompt_ids
    if prompts is None:
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
        session = {} if p.sessions is None else p.sessions.request_columns(int(record.request_id))
        by_source = {} if tiers is None else manager.hit_tokens_by_source(int(record.request_id))
        writer.add_request(request_row(record, **session, **by_source))
        if time.monotonic() - flushed[0] >= FLUSH_EVERY_S:  # a run killed midway keeps what finished
            writer.flush()
            flushed[0] = time.monotonic()

    requests, next_turn = p.requests, None
    if p.sessions is not None:  # the closed loop: each session's first turn, the others as their turns finish
        (requests, prompts), next_turn = p.sessions.first_turns(), p.sessions.next_turn
    result = serve(requests, prompts, scheduler=scheduler, engine=engine, on_iteration=on_iteration,
                   on_finish=on_finish, next_turn=next_turn)  # fmt: skip
    row = run_metrics(result.records, result.duration_s, percentiles=cfg.percentiles,
                      ttft_slo_ms=cfg.ttft_slo_ms, tpot_slo_ms=cfg.tpot_slo_ms, slo_attainment=cfg.slo_attainment,
                      qps=float(cfg.qps) if cfg.trace is None else describe(p.requests)["offered_qps"],
                      tier_hit_tokens=None if tiers is None else manager.tier_tokens(
                          record.request_id for record in result.records))  # fmt: skip
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
        **p.dataset_columns,
        **cfg.tier_options.row_columns(),
        **cfg.strategy_columns(),
        **(tiers.run_columns() if tiers is not None else {}),
    }
    if p.sessions is not None:
        row["ttft_ms_by_turn"] = p.sessions.ttft_ms_by_turn(result.records)
    # A lossy strategy's accuracy against exact serving, after the figures above so that it times nothing
    row |= served_accuracy(p, model=model, args=args, cache=cache,
                           lossy=Pool(new_engine, lambda: kv_manager(cfg, p.num_blocks, tiers=tiers)),
                           prompt_ids=p.prompt_ids if p.prompt_ids is not None else prompts)  # fmt: skip
    writer.close(row, config=cfg.config_dict())
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
