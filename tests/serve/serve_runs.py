"""Serving runs for the dashboard's tests (tests/dashboard/test_charts_serving.py, test_dashboard_serving.py, test_browser.py),
made by the real producers without a model: requests.generate, scheduler.simulate on a synthetic clock, then
metrics.request_row / rows.iteration_row / metrics.run_metrics through rows.ServeRunWriter, as the engine writes
them (tests/serve/test_serve_rows.py does the same).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from harness.serve.dataset import dataset_columns
from harness.serve.kv_manager import make_kv_manager
from harness.serve.metrics import request_row, run_metrics
from harness.serve.requests import RequestSpec, generate
from harness.serve.rows import RUN_FILE, ServeRunWriter, iteration_row, serve_run_dir
from harness.serve.scheduler import Scheduler, SchedulerConfig, simulate

SWEEP = "20261201-120000"
STRATEGIES = ("contiguous", "paged")
# requests/s: from idle to a queue. Under TTFT_SLO_MS the knee is at 16 for contiguous (2 requests fit), at 64 for
# paged (8 fit): at 256 paged keeps its p99 TTFT under the SLO but finishes 162 of the 236 req/s offered, not
# sustained (harness.serve.sustained), and contiguous at 64 falls behind too; qps=inf breaks it for both.
QPS = (4.0, 16.0, 64.0, 256.0)
TTFT_SLO_MS = 60.0
NUM_PROMPTS = 16
MAX_MODEL_LEN = 64  # tokens
BLOCK_SIZE = 4  # tokens
NUM_BLOCKS = 40  # 160 tokens: contiguous fits 2 requests of max_model_len, paged more
MAX_NUM_SEQS = 8


def step_time_s(output) -> float:
    """A step costs a fixed 4 ms launch plus 0.1 ms per token computed (a small model on a CPU, roughly)."""
    return 4e-3 + 1e-4 * output.total_num_scheduled_tokens


def predicted_max_running(strategy: str, prompt_lens: list[int]) -> int:
    """A stand-in for the planner's figure (harness.serve.concurrency.predict_concurrency, which needs a model's
    Workload): contiguous reserves max_model_len per request; paged admits prompts while their blocks fit."""
    if strategy == "contiguous":
        return min(NUM_BLOCKS // (MAX_MODEL_LEN // BLOCK_SIZE), MAX_NUM_SEQS)
    used, running = 0, 0
    for prompt_len in prompt_lens:
        used += -(-prompt_len // BLOCK_SIZE)
        if used > NUM_BLOCKS or running == MAX_NUM_SEQS:
            break
        running += 1
    return running


def write_run(
    results_dir: str | Path,
    *,
    strategy: str = "paged",
    qps: float = 8.0,
    kv_dtype: str = "fp32",
    sweep_id: str = SWEEP,
    run_id: str | None = None,
    finished: bool = True,
    seed: int = 0,
    turns: int = 0,
) -> Path:
    """One simulated serving run in <results_dir>/serve/<run_id>/; finished=False leaves it as a run killed after
    its last flush: request and iteration parts, no run.parquet. turns > 0 writes it as chat sessions' (dataset
    sharegpt-multiturn): request i is turn i % turns + 1 of session i // turns, and the run row has its TTFT by turn
    (the stream is still the synthetic one: the dashboard reads the columns, not the prompts)."""
    run_id = run_id or f"{sweep_id}-{strategy}-{kv_dtype}-qps{qps:g}"
    spec = RequestSpec(
        num_prompts=NUM_PROMPTS,
        qps=qps,
        seed=seed,
        prompt_len=16,
        prompt_dist="uniform",
        prompt_spread=0.5,
        output_len=8,
        output_dist="uniform",
        output_spread=0.5,
        max_model_len=MAX_MODEL_LEN,
    )
    requests = generate(spec)
    kv = make_kv_manager(strategy, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)
    simulation = simulate(requests, Scheduler(config, kv), step_time_s)
    iterations = [iteration_row(i, out, step_time_s(out)) for i, out in enumerate(simulation.iterations)]
    run_dir = serve_run_dir(results_dir, run_id)
    with ServeRunWriter(run_dir, flush_every=8) as writer:
        for record in simulation.records:
            index = int(record.request_id)  # "0", "1", ...: the stream's order
            session = {"session_id": index // turns, "turn": index % turns + 1} if turns else {}
            writer.add_request(request_row(record, **session))
        for row in iterations:
            writer.add_iteration(row)
        if not finished:
            return run_dir  # __exit__ flushes the buffered rows, and only close() writes run.parquet
        duration_s = max(r.finished_s for r in simulation.records) - min(r.arrival_s for r in simulation.records)
        utilization = [row["kv_used_blocks"] / NUM_BLOCKS for row in iterations]
        context = {
            "sweep_id": sweep_id,
            "engine": "kvbench",
            "strategy": strategy,
            "kv_dtype": kv_dtype,
            "model": "tiny",
            "device": "cpu",
            "qps": qps,
            "num_blocks": NUM_BLOCKS,
            "block_size": BLOCK_SIZE,
            "kv_budget_bytes": NUM_BLOCKS * BLOCK_SIZE * 1024,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "num_iterations": len(iterations),
            "predicted_max_running": predicted_max_running(strategy, [r.prompt_len for r in requests]),
            "mean_kv_utilization": sum(utilization) / len(utilization),
            "peak_kv_utilization": max(utilization),
            "mean_step_ms": sum(row["step_ms"] for row in iterations) / len(iterations),
            "mean_scheduler_ms": 0.0,
            **(
                dataset_columns("sharegpt-multiturn", ttft_ms_by_turn=_ttft_by_turn(simulation.records, turns))
                if turns
                else dataset_columns("random")
            ),
        }
        metrics = run_metrics(simulation.records, duration_s, ttft_slo_ms=TTFT_SLO_MS)
        writer.close({**metrics, **context}, config={"strategy": strategy, "qps": qps})
    return run_dir


def _ttft_by_turn(records, turns: int) -> str:
    """The run row's ttft_ms_by_turn for request i as turn i % turns + 1 (harness.serve.multiturn's figures)."""
    by_turn: dict[int, list[float]] = {}
    for record in records:
        by_turn.setdefault(int(record.request_id) % turns + 1, []).append(record.ttft_s * 1e3)
    return json.dumps(
        {
            str(turn): {
                "count": len(ttfts),
                "p50": float(np.percentile(ttfts, 50)),
                "p99": float(np.percentile(ttfts, 99)),
            }
            for turn, ttfts in sorted(by_turn.items())
        }
    )


def write_sweep(results_dir: str | Path, *, strategies=STRATEGIES, qps_values=QPS) -> list[Path]:
    """A qps sweep: one finished run per strategy and qps, all of sweep SWEEP."""
    return [write_run(results_dir, strategy=s, qps=q) for s in strategies for q in qps_values]


def as_written_before_max_running(run_dir: str | Path) -> None:
    """Rewrite run_dir's run.parquet as it was written before max_running_requests existed (the committed
    reference's runs): no max_running_requests, and max_concurrent_requests holding what it then counted, the
    requests running (first scheduled to finished)."""
    path = Path(run_dir) / RUN_FILE
    table = pq.read_table(path)
    running = table.column("max_running_requests")
    at = table.column_names.index("max_concurrent_requests")
    table = table.drop_columns(["max_concurrent_requests", "max_running_requests"])
    pq.write_table(table.add_column(at, "max_concurrent_requests", running), path)
