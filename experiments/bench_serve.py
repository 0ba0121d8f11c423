"""make bench-serve: our serving engine beside transformers' continuous batching, side by side in one run.

    python -m experiments.bench_serve                                # small preset, fp32, 32 requests, qps=inf
    python -m experiments.bench_serve --rounds 2 --qps 4 --num-prompts 64

Both engines serve the same request stream (seeded lengths and token ids) on the same checkpoint (transformers'
Llama at the preset's shapes, saved once as safetensors, loaded by each), with the same KV pool (num_blocks blocks of
block_size tokens), the same max_num_seqs and max_num_batched_tokens, greedy, exactly output_len tokens each, no
prefix sharing, preemption by recompute. Rounds alternate which engine goes first, so that a drift of the host
(another process, thermal) falls on both. Each run is written as a serving run (results/serve/<id>-<engine>-r<N>/,
engine column "kvbench" or "transformers-cb"), which the dashboard's Serving page draws.

Printed: output tok/s, TTFT and TPOT p50/p99, the most requests running at once, preemptions, per engine and round,
then ours / theirs (throughput ratio > 1 is ours ahead; latency ratio < 1 is ours ahead), and how many requests
produced the same tokens in both (fp32: all, but for a near-tie at which the two may part).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from harness.analytic.ledger import kv_bytes_per_token
from harness.config import DTYPES, device_type
from harness.errors import ConfigError, exit_on_config_error
from harness.modeling.model import build_model
from harness.modeling.model_args import ModelArgs
from harness.run.versus import save_checkpoint
from harness.serve import peer
from harness.serve.budget import check_pool_fits
from harness.serve.dataset import dataset_columns
from harness.serve.engine import Engine, build_cache, check_servable, serve
from harness.serve.kv_manager import make_kv_manager
from harness.serve.metrics import request_row, run_metrics
from harness.serve.requests import RequestSpec, generate, prompt_token_ids
from harness.serve.rows import ServeRunWriter, serve_run_dir
from harness.serve.run import warm_up
from harness.serve.scheduler import Scheduler, SchedulerConfig

ROW_METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a preset of harness.modeling.model_args (default: small)")
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda if present")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--qps", type=float, default=math.inf, help="requests/s; inf: all at once (default)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--spread", type=float, default=0.0, help="uniform length spread for both sides, [0, 1)")
    parser.add_argument("--num-blocks", type=int, default=400)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-dir", default="results")
    return parser.parse_args(argv)


def stream(a: argparse.Namespace) -> tuple[list, list[list[int]], int]:
    """(requests, prompt ids, max_model_len), checked before anything heavy."""
    for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "rounds"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be an integer >= 1, got {getattr(a, name)}")
    dist = "uniform" if a.spread > 0 else "fixed"
    longest = math.ceil(a.prompt_len * (1 + a.spread)) + math.ceil(a.output_len * (1 + a.spread))
    spec = RequestSpec(num_prompts=a.num_prompts, qps=a.qps, seed=a.seed, prompt_len=a.prompt_len, prompt_dist=dist,
                       prompt_spread=a.spread, output_len=a.output_len, output_dist=dist, output_spread=a.spread,
                       max_model_len=longest)  # fmt: skip
    requests = generate(spec)
    args = ModelArgs.from_name(a.model)
    check_servable(args)
    if args.is_mla:  # the peer's checkpoint is transformers' Llama (harness.run.versus.hf_config): no MLA
        raise ConfigError(f"--model: {args.name} is MLA, which the side-by-side's shared Llama checkpoint cannot "
                          "hold; allowed: a model with K/V heads, or MLA through experiments.serve")  # fmt: skip
    # Each engine allocates this pool: past the device's free memory it is one line, not the OOM killer.
    pool_bytes = a.num_blocks * a.block_size * kv_bytes_per_token(a.model, a.dtype)
    check_pool_fits(pool_bytes, field="--num-blocks", device=a.device)
    return requests, prompt_token_ids(requests, vocab_size=args.vocab_size, seed=a.seed), longest


def run_ours(a, args, ckpt: Path, requests, prompts, max_model_len: int):
    """Our engine on the checkpoint: (records, outputs per request in order, duration_s)."""
    device = torch.device(a.device)
    model = build_model(args, weights=str(ckpt), dtype=DTYPES[a.dtype], device=device, seed=a.seed,
                        n_positions=max_model_len)  # fmt: skip
    cache, _ = build_cache("paged", args, kv_dtype=a.dtype, num_blocks=a.num_blocks, block_size=a.block_size,
                           max_model_len=max_model_len, device=device, dtype=a.dtype)  # fmt: skip
    manager = make_kv_manager("paged", num_blocks=a.num_blocks, block_size=a.block_size, max_model_len=max_model_len)
    config = SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                             max_model_len=max_model_len)  # fmt: skip
    engine = Engine(model, cache)
    warm_up(model, cache, block_size=a.block_size, paged=True)
    full = []  # (step_s, scheduler_s) of the iterations that ran max_num_seqs requests

    def on_iteration(index, output, step_s, scheduler_s):
        if output.num_running >= a.max_num_seqs:
            full.append((step_s, scheduler_s))

    result = serve(requests, prompts, scheduler=Scheduler(config, manager), engine=engine, on_iteration=on_iteration)
    if full:  # issue #16 item 11: the scheduler's host time against the iteration's, at max_num_seqs running
        step_ms, scheduler_ms = (1e3 * sum(times) / len(full) for times in zip(*full, strict=True))
        print(f"kvbench scheduler at {a.max_num_seqs} running: {scheduler_ms:.2f} ms of {step_ms + scheduler_ms:.0f} "
              f"ms per iteration ({100 * scheduler_ms / (step_ms + scheduler_ms):.2f}%, {len(full)} iterations)")  # fmt: skip
    by_id = {int(r.request_id): r for r in result.records}
    records = [by_id[r.request_id] for r in requests]
    return records, [tuple(result.outputs[r.request_id]) for r in requests], result.duration_s


def run_theirs(a, ckpt: Path, requests, prompts):
    run = peer.run_transformers_cb(ckpt, requests, token_ids=prompts, num_blocks=a.num_blocks,
                                   block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                                   max_num_batched_tokens=a.max_num_batched_tokens, dtype=a.dtype,
                                   device=a.device)  # fmt: skip
    return list(run.records), list(run.output_token_ids), run.duration_s


def write_run(a, sweep_id: str, run_id: str, engine: str, records, duration_s: float) -> dict:
    """One engine's run as a serving run: the requests, and a run row (its iterations are the engine's own)."""
    row = run_metrics(records, duration_s)
    pool_bytes = a.num_blocks * a.block_size * kv_bytes_per_token(a.model, a.dtype)
    row |= {"sweep_id": sweep_id, "engine": engine, "strategy": "paged", "kv_dtype": a.dtype,
            "model": a.model, "device": a.device, "qps": float(a.qps), "num_blocks": a.num_blocks,
            "block_size": a.block_size, "max_num_seqs": a.max_num_seqs,
            "max_num_batched_tokens": a.max_num_batched_tokens, "kv_budget_bytes": pool_bytes, "num_iterations": None,
            "predicted_max_running": None,
            "mean_kv_utilization": None, "peak_kv_utilization": None, "mean_step_ms": None,
            "mean_scheduler_ms": None, **dataset_columns("random")}  # fmt: skip
    with ServeRunWriter(serve_run_dir(a.results_dir, run_id)) as writer:
        for record in records:
            writer.add_request(request_row(record))
        writer.close(row, config=vars(a) | {"engine": engine})
    return row


def table(rows: list[tuple[str, int, dict]]) -> list[str]:
    head = f"{'engine':<16}{'round':>6}{'out tok/s':>11}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>9}"
    head += f"{'max run':>9}{'preempt':>9}"
    lines = [head]
    for engine, index, row in rows:
        lines.append(
            f"{engine:<16}{index:>6}{row['output_throughput']:>11.1f}{row['median_ttft_ms']:>10.0f}"
            f"{row['p99_ttft_ms']:>9.0f}{row['median_tpot_ms']:>10.1f}{row['p99_tpot_ms']:>9.1f}"
            f"{row['max_running_requests']:>9}{row['total_preemptions']:>9}"
        )
    return lines


def medians(rows: list[dict]) -> dict:
    """Each metric's median over the rounds (of two, their mean)."""
    return {name: statistics.median(row[name] for row in rows) for name in ROW_METRICS}


@exit_on_config_error
def main(argv=None) -> None:
    a = parse_args(argv)
    a.device = device_type(a.device)
    requests, prompts, max_model_len = stream(a)
    args = ModelArgs.from_name(a.model)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows, equal = [], []
    with tempfile.TemporaryDirectory() as directory:
        ckpt = save_checkpoint(args, directory, seed=a.seed)
        for index in range(a.rounds):
            order = ("kvbench", "transformers-cb") if index % 2 == 0 else ("transformers-cb", "kvbench")
            outputs = {}
            for engine in order:
                if engine == "kvbench":
                    records, outputs[engine], duration = run_ours(a, args, ckpt, requests, prompts, max_model_len)
                else:
                    records, outputs[engine], duration = run_theirs(a, ckpt, requests, prompts)
                row = write_run(a, f"bench-{stamp}", f"bench-{stamp}-{engine}-r{index}", engine, records, duration)
                rows.append((engine, index, row))
                print(table([rows[-1]])[-1], flush=True)
            equal.append(sum(x == y for x, y in zip(outputs["kvbench"], outputs["transformers-cb"], strict=True)))
    ours = medians([row for engine, _, row in rows if engine == "kvbench"])
    theirs = medians([row for engine, _, row in rows if engine == "transformers-cb"])
    print(f"\nbench-serve: {a.model} {a.dtype}, {len(requests)} requests of {a.prompt_len} + {a.output_len} tokens at "
          f"qps={a.qps:g}, {a.num_blocks} blocks of {a.block_size}, max_num_seqs={a.max_num_seqs}, "
          f"max_num_batched_tokens={a.max_num_batched_tokens}, {a.rounds} round(s), median of rounds")  # fmt: skip
    print("\n".join(table(rows)))
    print(f"ours / theirs: output tok/s {ours['output_throughput'] / theirs['output_throughput']:.2f}x (> 1: ours "
          f"ahead); TTFT p50 {ours['median_ttft_ms'] / theirs['median_ttft_ms']:.2f}x, p99 "
          f"{ours['p99_ttft_ms'] / theirs['p99_ttft_ms']:.2f}x; TPOT p50 "
          f"{ours['median_tpot_ms'] / theirs['median_tpot_ms']:.2f}x, p99 "
          f"{ours['p99_tpot_ms'] / theirs['p99_tpot_ms']:.2f}x (< 1: ours ahead)")  # fmt: skip
    print(f"same tokens: {min(equal)}/{len(requests)} requests in every round")


if __name__ == "__main__":
    main()
