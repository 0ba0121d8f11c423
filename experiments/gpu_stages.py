"""The GPU check's serving and movement stages (serve, tiers, pd): their predicted seconds, and their tables.

scripts/gpu_check.sh runs them as it runs the decode stages, each under its own limit, with its GPU arguments on
one line of the script (SERVE_ARGS, TIERS_ARGS, PD_ARGS), which this module reads back, so that the plan sizes the
exact command the device runs:

    serve  python -m experiments.serve -m experiment=serve-gpu-check device=cuda: Llama-3.1-8B shapes on dummy
           weights, a paged pool in bf16 and in fp8_e4m3, one fixed synthetic stream at qps=inf
    tiers  python -m experiments.tiers model=llama-3.1-8b block_tokens=[16,256]: d2h and h2d through page-locked
           host memory, the disk tier's write and cold read
    pd     python -m experiments.pd model=llama-3.1-8b transports=[tcp,shm]: a prefilled request's KV from one
           process to another, staged through the host (harness.movement.transport)

The time models are upper bounds for sizing in the style of experiments/sizing.py (the roofline at half the
datasheet peaks plus the host's launches, and a fixed start per process), not figures to quote. The report reads
each stage's tables back: the serve runs' run rows (one per kv_dtype) into serve.parquet, the tier and PD rows into
movement.parquet (a `table` column says which contract, harness.store.tables' TIER_COLUMNS or PD_COLUMNS), so that
the device's eight files hold all three.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import pandas as pd
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.callbacks import sweep_jobs
from experiments.sizing import (
    BUILD_BYTES_PER_S,
    CONF,
    EFFICIENCY,
    POINT_OVERHEAD_S,
    SWEEP_START_S,
    Gpu,
    generation_seconds,
    step_seconds,
)
from harness.analytic import roofline
from harness.analytic.ledger import kv_bytes_per_token, weights_bytes
from harness.config import RunConfig
from harness.device.spec import spec_links
from harness.store import tables

STAGE_ARGS = {"serve": "SERVE_ARGS", "tiers": "TIERS_ARGS", "pd": "PD_ARGS"}  # stage -> its line in the script
SERVE_STAGE, TIERS_STAGE, PD_STAGE = STAGE_ARGS
TABLE_COLUMN = "table"  # movement.parquet: "tiers" or "pd", the contract of the row

# --- sizing --------------------------------------------------------------------------------------------------------

# A serving iteration's host work beyond the forward's launches (sizing.HOST_S_PER_LAYER): schedule and update
# (~0.5 ms for 16 requests on the CPU here, in Python per request), the SeqBatch and its index copies, sampling.
SERVE_HOST_S_PER_ITER = 5e-3
# PCIe 5.0 x16 per direction (harness/device/spec_links.csv), derated as every sizing figure: d2h and h2d, pinned.
PCIE_GBPS = EFFICIENCY * float(spec_links().set_index("link").loc["pcie5-x16", "gbps_per_direction"])
# The disk tier on the device's VM disk (not measured there yet): GB/s per direction, and one block file's cost
# (opened, written, fsynced; or opened cold and read): 15 ms is what a 4 KiB block file's write took on this
# project's CPU machine's ext4 (the dry run's tiers stage), counted for the reads too.
DISK_GBPS, DISK_FILE_S = 0.5, 15e-3
TIERS_WARMUP_S = 0.25  # harness.movement.tier_bandwidth.WARMUP_S: untimed repeats per direction and block size
PROCESS_START_S = 10.0  # one python: Hydra, the torch import, CUDA's initialization (sizing.SWEEP_START_S's parts)
# Host copies of a PD transfer beside the staging over PCIe: a socket over loopback, and shared memory's two copies.
SOCKET_GBPS = {"tcp": 2.0, "shm": 4.0, "gloo": 2.0}


def script_args(script: str, stage: str) -> list[str]:
    """A stage's GPU arguments, its `NAME=(...)` line of scripts/gpu_check.sh split as bash splits it."""
    name = STAGE_ARGS[stage]
    found = re.search(rf"^{name}=\((.*)\)\s*$", script, flags=re.MULTILINE)
    if found is None:
        raise ValueError(f"scripts/gpu_check.sh: no line {name}=(...) for the {stage} stage")
    return shlex.split(found.group(1))


def _compose(config_name: str, overrides: list[str], *, sweep: bool = False) -> list[dict]:
    """conf/<config_name>.yaml with overrides, each job of its sweep (a multirun preset's params) as a dict."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        config = compose(config_name=config_name, overrides=overrides, return_hydra_config=sweep)
        jobs = sweep_jobs(config) if sweep else [overrides]
        return [
            OmegaConf.to_container(compose(config_name=config_name, overrides=list(job)), resolve=True) for job in jobs
        ]


def serve_plans(args: list[str]) -> list:
    """harness.serve.run.plan of every run of the serve stage, on the CPU (the sizes are the GPU's)."""
    import experiments.serve  # noqa: F401  (registers serve_config)
    from harness.serve.config import ServeConfig
    from harness.serve.run import plan

    return [plan(ServeConfig(**job)) for job in _compose("serve", [*args, "device=cpu"], sweep=True)]


def serve_run_seconds(p, *, gpu: Gpu) -> float:
    """One serving run of a fixed stream at qps=inf: the model's build, then its iterations.

    The burst admits predicted_max_running requests; their decodes grow into the pool and preempt until those that
    fit at their peak run on (harness.serve.budget's two figures), so the stream drains in waves of `steady` requests,
    each output_len decode iterations at that batch, mid-context. Prefill: every prompt, plus the preempted
    requests' recompute once a wave, in chunks of max_num_batched_tokens, each an iteration."""
    cfg, workload = p.cfg, p.workload
    shape = workload.model_args()
    peak_blocks = max(math.ceil((r.prompt_len + r.output_len) / cfg.block_size) for r in p.requests)
    admitted = p.predicted_max_running or 1
    steady = max(1, min(admitted, p.num_blocks // peak_blocks))
    waves = math.ceil(len(p.requests) / steady)
    prompt = max(r.prompt_len for r in p.requests)
    output = max(r.output_len for r in p.requests)
    decode = workload.replace(batch_size=steady, prompt_len=prompt, gen_len=output)
    step = roofline.decode_step_cost(decode.kv_shape(), context_len=prompt + output / 2, layout=decode.layout())
    chunk = workload.replace(batch_size=1, prompt_len=cfg.max_num_batched_tokens, gen_len=1)
    chunk_cost = roofline.prefill_cost(chunk.kv_shape(), layout=chunk.layout())
    tokens = sum(r.prompt_len for r in p.requests) + waves * (admitted - steady) * (prompt + output)
    iterations = {
        "prefill": (math.ceil(tokens / cfg.max_num_batched_tokens), chunk_cost),
        "decode": (waves * output, step),
    }
    seconds = sum(
        n * (step_seconds(cost, gpu=gpu, dtype=cfg.dtype, n_layers=shape.n_layers) + SERVE_HOST_S_PER_ITER)
        for n, cost in iterations.values()
    )
    return seconds + POINT_OVERHEAD_S + weights_bytes(shape, cfg.dtype) / BUILD_BYTES_PER_S


def serve_seconds(args: list[str], *, gpu: Gpu) -> tuple[float, int]:
    """(seconds, runs) of the serve stage: one process (a Hydra multirun), its runs one after another."""
    plans = serve_plans(args)
    return SWEEP_START_S + sum(serve_run_seconds(p, gpu=gpu) for p in plans), len(plans)


def tiers_seconds(args: list[str], *, gpu: Gpu) -> tuple[float, int]:
    """(seconds, rows) of the tiers stage: per block size and direction, the untimed warm-up (one repeat, then
    TIERS_WARMUP_S) and the timed repeats, each moving about total_mb of blocks: over PCIe for d2h and h2d, one file
    per block for the disk's write and read."""
    from experiments.tiers import TiersConfig
    from harness.movement import tier_bandwidth
    from harness.movement.tier_bandwidth import DIRECTIONS, blocks_per_repeat

    cfg = TiersConfig(**_compose("tiers", [*args, "device=cpu"])[0])
    per_token = kv_bytes_per_token(cfg.model.name, cfg.kv_dtype_name)
    seconds = PROCESS_START_S
    for tokens in cfg.block_tokens:
        block = tokens * per_token
        n = blocks_per_repeat(block, int(cfg.total_mb * 2**20))
        bus = n * block / (PCIE_GBPS * 1e9)
        disk = n * (block / (DISK_GBPS * 1e9) + DISK_FILE_S)
        repeat = {"d2h": bus, "h2d": bus, "write": disk, "read": disk}
        seconds += sum((tier_bandwidth.WARMUP_CALLS + cfg.repeats) * repeat[d] + TIERS_WARMUP_S for _, d in DIRECTIONS)
    return seconds, len(cfg.block_tokens) * len(DIRECTIONS)


def pd_seconds(args: list[str], *, gpu: Gpu) -> tuple[float, int]:
    """(seconds, measured rows) of the pd stage: its process and two spawned workers (each building the model, in
    parallel), then per (kv_dtype, context) the prefill worker's prefills and the colocated baseline's generations
    (1 untimed + prefill_repeats each), and per transport 1 untimed + repeats transfers, each staged d2h, sent, h2d,
    then decoded for gen_len tokens."""
    from experiments.pd import PdConfig

    cfg = PdConfig(**_compose("pd", [*args, "device=cpu"])[0])
    dtype = "bf16"  # PdConfig's auto on CUDA; device=cpu above resolves it to the CPU's fp32
    seconds = SWEEP_START_S + PROCESS_START_S
    seconds += weights_bytes(RunConfig(model=cfg.model, device="cpu").model_args(), dtype) / BUILD_BYTES_PER_S
    for kv_dtype in cfg.kv_dtypes:
        for context in cfg.contexts:
            point = RunConfig(model=cfg.model, device="cpu", dtype=dtype, kv_dtype=kv_dtype,
                              batch_size=cfg.batch_size, prompt_len=context, gen_len=cfg.gen_len)  # fmt: skip
            generation = generation_seconds(point, gpu=gpu)
            kv_bytes = cfg.batch_size * (context - 1) * kv_bytes_per_token(point.model_args(), kv_dtype)
            seconds += (1 + cfg.prefill_repeats) * 2 * generation + POINT_OVERHEAD_S
            for kind in cfg.transports:
                transfer = kv_bytes * (2 / (PCIE_GBPS * 1e9) + 1 / (SOCKET_GBPS.get(kind, 2.0) * 1e9))
                seconds += (1 + cfg.repeats) * (transfer + generation)
    return seconds, len(cfg.kv_dtypes) * len(cfg.contexts) * len(cfg.transports)


STAGE_MODELS = {SERVE_STAGE: serve_seconds, TIERS_STAGE: tiers_seconds, PD_STAGE: pd_seconds}


def stage_predictions(script: str, *, gpu: Gpu) -> dict[str, tuple[float, int]]:
    """(predicted seconds, points) of each of these stages on `gpu`, from its GPU arguments in `script`."""
    return {stage: model(script_args(script, stage), gpu=gpu) for stage, model in STAGE_MODELS.items()}


# --- the report ----------------------------------------------------------------------------------------------------


def serve_runs(work: Path) -> pd.DataFrame:
    """The serve stage's run rows (harness.serve.rows' run.parquet of each finished run), a `stage` column added;
    empty when none finished."""
    from harness.serve.rows import RUN_FILE, SERVE_DIR, read_run_table

    paths = sorted((work / "stages" / SERVE_STAGE / SERVE_DIR).glob(f"*/{RUN_FILE}"))
    frames = [read_run_table(path).to_pandas() for path in paths]
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return rows.assign(stage=SERVE_STAGE) if len(rows) else rows


def movement_rows(work: Path) -> pd.DataFrame:
    """The tiers and pd stages' tables (harness.store.tables.read_tables), one frame, `table` naming each row's."""
    frames = []
    for stage, folder, prefix, columns in (
        (TIERS_STAGE, tables.TIERS_DIR, tables.TIER_PREFIX, tables.TIER_COLUMNS),
        (PD_STAGE, tables.PD_DIR, tables.PD_PREFIX, tables.PD_COLUMNS),
    ):
        frame = tables.read_tables(work / "stages" / stage / folder, prefix=prefix, columns=columns)
        if len(frame):
            frames.append(frame.assign(**{TABLE_COLUMN: stage, "stage": stage}))
    if not frames:
        return pd.DataFrame(columns=[TABLE_COLUMN, "stage"])
    return pd.concat(frames, ignore_index=True).convert_dtypes()  # each contract's integers stay integers, nullable


SERVE_SHOWN = ("kv_dtype", "completed", "num_blocks", "predicted_max_running", "max_running_requests",
               "total_preemptions", "num_iterations", "duration_s", "output_throughput", "median_ttft_ms",
               "median_tpot_ms", "mean_step_ms", "mean_scheduler_ms")  # fmt: skip
TIERS_SHOWN = ("tier", "direction", "block_tokens", "block_bytes", "n_blocks", "gbps", "pinned", "direct_io")
PD_SHOWN = ("transport", "kv_dtype", "context", "kv_bytes", "transfer_ms", "transfer_gbps", "prefill_ms",
            "ttft_pd_ms", "ttft_colocated_ms", "tpot_ms", "outputs_match", "status")  # fmt: skip


def _table(rows: pd.DataFrame, columns: tuple[str, ...]) -> str:
    shown = rows[[c for c in columns if c in rows.columns]].dropna(axis="columns", how="all").convert_dtypes()
    with pd.option_context("display.width", 250, "display.max_columns", None, "display.float_format", "{:.3f}".format):
        return shown.to_string(index=False)


def summary_sections(runs: pd.DataFrame, movement: pd.DataFrame) -> list[str]:
    """summary.md's lines for these stages: the serve runs (measured concurrency beside the planner's), the tiers'
    GB/s and the PD transfers measured (the datasheet links' extrapolated rows are in movement.parquet)."""
    lines = []
    if len(runs):
        lines += ["## Serving: measured max_running_requests beside the planner's predicted_max_running", "", "```",
                  _table(runs, SERVE_SHOWN), "```", ""]  # fmt: skip
    for stage, title, shown in (
        (TIERS_STAGE, "Tiers: GB/s of KV blocks, device <-> pinned host <-> disk", TIERS_SHOWN),
        (PD_STAGE, "PD: KV from a prefill to a decode process, staged through the host", PD_SHOWN),
    ):
        rows = movement[movement[TABLE_COLUMN].eq(stage)] if len(movement) else movement
        if stage == PD_STAGE and len(rows):
            rows = rows[rows["source"].eq(tables.MEASURED)]
        if len(rows):
            lines += [f"## {title}", "", "```", _table(rows, shown), "```", ""]
    return lines
