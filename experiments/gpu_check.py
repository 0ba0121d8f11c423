"""The GPU check's Python half: how long each stage should take, and what the stages' rows say.

scripts/gpu_check.sh runs the stages (each a command under its own time limit) and leaves their rows under a scratch
folder; this module sizes them beforehand and judges them afterwards:

    python -m experiments.gpu_check plan       # each stage: its limit in the script, points, predicted seconds
    python -m experiments.gpu_check report --work DIR --out DIR [--long-context-tokens 8192] [--dry]

`report` merges every stage's rows into one parquet (a `stage` column says whose), the profiler tables into another,
copies the stored ceilings, and writes summary.md: the machine, each stage's exit status and seconds, the key rows,
and last one verdict line per target (PASS, FAIL or N/A), computed by `verdicts()` from the rows alone.

The time model (`point_seconds`) is an upper bound for sizing, not a figure to quote: the roofline of
harness/roofline.py at half the datasheet peaks of harness/spec_peaks.csv, plus the host's cost of launching an eager
step, plus what a point pays besides its generations (model build, accuracy and profiler passes, compilation).
tests/test_presets.py holds every GPU preset to it and to the capacity planner; tests/test_gpu_check.py holds every
stage of the script to its limit.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments.decode  # noqa: F401  (registers the run_config schema that conf/config.yaml extends)
from experiments.callbacks import sweep_jobs
from harness import capacity, crossover, kv, results, roofline, sweep
from harness.bench import is_lossy
from harness.config import RunConfig
from harness.spec import spec_for

ROOT = Path(__file__).parents[1]
CONF = ROOT / "conf"
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

# --- the time model ------------------------------------------------------------------------------------------------

# Sizing bounds, each an upper bound on the H100/H200 (KINDS.md measured on an H200 here: a device-to-device copy at
# 4.3 of the datasheet's 4.8 TB/s, a bf16 8192^3 matmul at 790 of 989 TFLOP/s; the eager decode loop reaches less).
EFFICIENCY = 0.5  # of the datasheet's bandwidth and dense FLOP/s: the roofline's ceilings for sizing
# Eager PyTorch launches ~25 kernels per layer and step (two RMSNorms of ~5 ops, the fused projections, RoPE, the
# cache write, attention, SwiGLU, residual adds) at ~10 us of Python and dispatcher each, serially on the host.
HOST_S_PER_LAYER = 250e-6
# A sweep's start: Hydra, the torch import and validating every point in the parent (~5 s), then the first spawned
# worker's torch import and CUDA initialization (~10 s). Warm workers are reused for every later ok point.
SWEEP_START_S = 15.0
# Each point: the first call of its Triton kernels (a paged or quantized cache's decode kernel: ~2 s to compile
# once per specialization, from Triton's disk cache after), cache allocation, the row's atomic write and the resume
# index (0.21 s per point with warm workers: README, make bench-sweep); then the dummy weights, built on the device
# at BUILD_BYTES_PER_S (about a second for Llama-3.1-8B's 16 GB).
POINT_OVERHEAD_S = 3.0
BUILD_BYTES_PER_S = 16e9
ACCURACY_GENERATIONS = 3  # the exact cache's own generation, then the teacher-forced pass of each cache
PROFILER_START_S = 3.0  # torch.profiler's first CUDA (CUPTI) start in a process
# torch.compile of the decode step: Dynamo's trace, Inductor's lowering and its Triton kernels, per layer on top of a
# fixed start (the compile workers' pool, the first kernels); CUDA graphs are recorded within the warm-up.
COMPILE_S = 15.0
COMPILE_S_PER_LAYER = 2.5
DEFAULT_MEMORY_GB = 80.0  # a preset that claims no GPU is held to an 80 GB H100
DEFAULT_BUDGET_MIN = 10.0  # ... and to 10 minutes: a 15-minute GPU window less the machine's start and a margin


@dataclass(frozen=True)
class Gpu:
    """A datasheet GPU (harness/spec_peaks.csv), derated by EFFICIENCY for sizing."""

    name: str
    memory_gb: float  # decimal GB, as the datasheet and the presets' comments say
    peak_bw_gbps: float
    peak_tflops: dict[str, float]  # compute dtype -> dense TFLOP/s

    @classmethod
    def from_spec(cls, name: str, *, memory_gb: float) -> Gpu:
        spec = spec_for(name)
        if spec is None:
            raise ValueError(f"gpu: {name!r} is not in harness/spec_peaks.csv")
        return cls(
            name=str(spec["device_name"].iloc[0]),
            memory_gb=memory_gb,
            peak_bw_gbps=float(spec["peak_bw_gbps"].iloc[0]),
            peak_tflops=dict(zip(spec["dtype"], spec["peak_tflops_dense"].astype(float), strict=True)),
        )


H100 = Gpu.from_spec("H100 SXM", memory_gb=80)
H200 = Gpu.from_spec("H200 SXM", memory_gb=141)


def step_seconds(cost: roofline.StepCost, *, gpu: Gpu, dtype: str, n_layers: int) -> float:
    """One forward step: the derated roofline (the slower of its FLOPs and its bytes) plus the eager launches."""
    device_s = max(
        cost.flops / (EFFICIENCY * gpu.peak_tflops[dtype] * 1e12),
        cost.bytes / (EFFICIENCY * gpu.peak_bw_gbps * 1e9),
    )
    return device_s + HOST_S_PER_LAYER * n_layers


def generation_seconds(cfg: RunConfig, *, gpu: Gpu) -> float:
    """One whole generation of the point: its prefill, then its gen_len - 1 decode steps (harness.decode)."""
    args = cfg.model_args()
    options = kv.parse_options(cfg.cache["name"], cfg.cache_options)
    shape = dict(
        dtype=cfg.dtype,
        kv_dtype=cfg.kv_dtype_name,
        cache=cfg.cache["name"],
        window=getattr(options, "window", None),  # a strategy with a window says so (harness.bench does the same)
        kv_group_size=cfg.kv_group_size,
    )
    costs = [roofline.prefill_cost(args, batch_size=cfg.batch_size, prompt_len=cfg.prompt_len, **shape)]
    costs += [
        roofline.decode_step_cost(args, batch_size=cfg.batch_size, context_len=context, **shape)
        for context in roofline.decode_contexts(cfg.prompt_len, cfg.gen_len)
    ]
    return sum(step_seconds(cost, gpu=gpu, dtype=cfg.dtype, n_layers=args.n_layers) for cost in costs)


def point_seconds(cfg: RunConfig, *, gpu: Gpu) -> float:
    """Upper bound on one point's wall time in a warm worker (harness.bench.run_point, harness.timing.measure).

    warm-up generations, then at least min_repeats and at most max_repeats, the budget max_time_s checked after
    each one past min_repeats (so one generation may overrun it); the accuracy pass of a lossy point; the profiler
    pass (one generation at most, and its start); the compilation of a compiled step; the model build. Not
    counted: prefix caching's extra generations that measure a miss (no GPU preset uses it).
    """
    generation = generation_seconds(cfg, gpu=gpu)
    measured = min(cfg.max_repeats * generation, max(cfg.min_repeats * generation, cfg.max_time_s + generation))
    seconds = cfg.warmup * generation + measured
    if cfg.accuracy and is_lossy(cfg):
        seconds += ACCURACY_GENERATIONS * generation
    if cfg.profile and cfg.gen_len > 2 and cfg.compile == "none":
        seconds += PROFILER_START_S + generation
    if cfg.compile != "none":
        seconds += COMPILE_S + COMPILE_S_PER_LAYER * cfg.model_args().n_layers
    weights = capacity.weights_bytes(cfg.model_args(), cfg.dtype)
    return seconds + POINT_OVERHEAD_S + weights / BUILD_BYTES_PER_S


def sweep_seconds(points: Sequence[RunConfig], *, gpu: Gpu) -> float:
    """Upper bound on a whole sweep: its start, then every point."""
    return SWEEP_START_S + sum(point_seconds(cfg, gpu=gpu) for cfg in points)


def point_bytes(cfg: RunConfig) -> int:
    """Device memory a point needs at its peak, by the capacity planner (harness.capacity.total_bytes, with the CUDA
    runtime's assumed overhead), plus what the planner leaves out: the accuracy pass of a lossy point holds an exact
    contiguous cache at the compute dtype beside the point's and two fp32 logit tensors [B, gen_len, V]."""
    workload = sweep.workload(cfg)
    need = capacity.total_bytes(workload, runtime_overhead_bytes=capacity.CUDA_RUNTIME_DEFAULT_BYTES)
    if cfg.accuracy and is_lossy(cfg):
        exact = workload.replace(cache="contiguous", kv_dtype="auto", block_size=16, pool_tokens=None)
        logits = 2 * cfg.batch_size * cfg.gen_len * workload.model.vocab_size * 4
        need += capacity.kv_allocation(exact).total_bytes + logits
    return need


def point_fits(cfg: RunConfig, *, memory_gb: float) -> bool:
    """Whether the point fits memory_gb decimal GB (and its KV pool holds the batch)."""
    return capacity.pool_fits(sweep.workload(cfg)) and point_bytes(cfg) <= memory_gb * 1e9


# --- presets and their sweeps --------------------------------------------------------------------------------------


@functools.cache
def preset_points(preset: str, overrides: tuple[str, ...] = ()) -> tuple[RunConfig, ...]:
    """Every point of `experiment=<preset>` with `overrides`, expanded as Hydra's basic sweeper does, each a validated
    RunConfig. device=cpu only so that it validates on a machine without a GPU: sizes and times are the GPU's.
    Cached: a compose costs a few tenths of a second, and the tests and the plan ask for each preset more than once."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        config = compose(config_name="config", overrides=[f"experiment={preset}", *overrides], return_hydra_config=True)
        jobs = sweep_jobs(config)
        points = []
        for job in jobs:
            composed = compose(config_name="config", overrides=[*job, "device=cpu"])
            points.append(RunConfig(**OmegaConf.to_container(composed, resolve=True)))
    return tuple(points)


@dataclass(frozen=True)
class Claims:
    """What a preset's leading comment claims: the GPU memory every point fits, and a time budget on a GPU."""

    memory_gb: float
    budget_min: float
    gpu: Gpu


def preset_claims(path: Path) -> Claims:
    """Read from the comment lines at the top of a preset: `<N> GB GPU` (the memory every point fits; default an
    80 GB H100) and `at most <M> min on an H100|H200` (the whole sweep's time; default 10 minutes on an H100)."""
    comment = " ".join(line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#"))
    memory = re.search(r"(\d+(?:\.\d+)?) GB GPU", comment)
    budget = re.search(r"at most (\d+(?:\.\d+)?) min(?:utes)? on an? (H100|H200)", comment, flags=re.IGNORECASE)
    return Claims(
        memory_gb=float(memory.group(1)) if memory else DEFAULT_MEMORY_GB,
        budget_min=float(budget.group(1)) if budget else DEFAULT_BUDGET_MIN,
        gpu={"H100": H100, "H200": H200}[budget.group(2).upper()] if budget else H100,
    )


# --- the stages of scripts/gpu_check.sh ----------------------------------------------------------------------------

# The stages that run a preset, and what the script adds to it on the GPU (its own folders are not part of the time).
STAGE_PRESETS = {
    "decode": "gpu-check-decode",
    "long-context": "gpu-check-long-context",
    "compile": "gpu-check-compile",
    "crossover": "gpu-check-crossover",
}
# The others, estimated (seconds on the H200; KINDS.md: torch 2.11 imports and initializes CUDA there in seconds):
STAGE_ESTIMATES_S = {
    "setup": 15.0,  # three wheels into a folder (~3 s), then one python that imports torch and hydra and asks CUDA
    # Collecting the gpu tests (~5 s), 4 xdist workers starting (~10 s), then ~150 tests: some 70 specializations of
    # the Triton kernel (~1 s each), 3 Inductor compilations of the tiny model (~15 s each), 4 spawned workers
    # (~10 s each) and a quick ceilings measurement, spread over the 4 workers.
    "tests": 90.0,
    # One python (~10 s), the copy bandwidth over 8 x L2 and bf16/fp16/fp32/fp8 8192^3 matmuls, 12 calls each:
    # under a second of device time (fp32's 1.1 TFLOP at 67 TFLOP/s is the longest, ~16 ms a call).
    "ceilings": 15.0,
    "report": 8.0,  # one python: pandas, the merge of a few dozen rows, summary.md
}


def stage_limits(script: str) -> dict[str, int]:
    """The GPU time limit of every stage in scripts/gpu_check.sh: its calls `stage NAME GPU_LIMIT DRY_LIMIT ...`."""
    return {name: int(limit) for name, limit in re.findall(r"\bstage ([a-z][a-z-]*) (\d+) \d+ ", script)}


def stage_predictions(*, gpu: Gpu = H200) -> dict[str, float]:
    """Predicted seconds of every stage on `gpu`: the presets' sweeps by the time model, the others' estimates."""
    predicted = dict(STAGE_ESTIMATES_S)
    for stage, preset in STAGE_PRESETS.items():
        predicted[stage] = sweep_seconds(preset_points(preset), gpu=gpu)
    return predicted


# --- verdicts ------------------------------------------------------------------------------------------------------

STAGE_COLUMN = "stage"  # the merged rows' column naming the stage that measured each
DECODE_STAGE = "decode"
BANDWIDTH_TARGET = 0.80  # of the measured copy bandwidth, at batch 1 in bf16
PAGED_TARGET = 0.05  # paged TPOT at most 5% above contiguous, same workload
LONG_CONTEXT_TOKENS = 8192
NVML_COLUMNS = ("nvml_timed_samples", "energy_j_per_token", "sm_clock_mhz_min")
# What makes two rows the same workload, so that they differ only in the strategy or the KV format compared.
WORKLOAD = ("model", "n_kv_heads", "dtype", "batch_size", "prompt_len", "gen_len", "prefix_len", "lengths",
            "weights", "device", "compile", "seed")  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    status: str  # PASS, FAIL or N/A
    target: str
    text: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.target}: {self.text}"


def _eager(rows: pd.DataFrame) -> pd.DataFrame:
    """kvbench's own fixed-length points without compilation: the ones whose timings compare."""
    keep = rows["compile"].fillna("none").eq("none") & rows["lengths"].fillna("fixed").eq("fixed")
    return rows[keep & rows["runner"].fillna("kvbench").eq("kvbench")]


def _latest(rows: pd.DataFrame) -> pd.DataFrame:
    return rows.sort_values("started_at", na_position="first", kind="stable")


def _not_ok(rows: pd.DataFrame) -> str:
    row = _latest(rows).iloc[-1]
    return f"the point ended {row['status']}: {' '.join(str(row['error']).split())[:120]}"


def bandwidth_verdict(rows: pd.DataFrame) -> Verdict:
    """bw_util of the contiguous bf16 batch-1 decode: the decode stage's row when there is a stage column, and of
    several the shortest context (where the weights are nearly all the bytes), then the latest."""
    target = "bandwidth"
    eager = _eager(rows)
    candidates = eager[
        eager["cache"].eq("contiguous")
        & eager["dtype"].eq("bf16")
        & eager["kv_dtype"].eq("bf16")
        & eager["batch_size"].eq(1)
    ]
    if candidates.empty:
        return Verdict("N/A", target, "no contiguous bf16 batch-1 decode row")
    ok = candidates[candidates["status"].eq("ok")]
    if ok.empty:
        return Verdict("FAIL", target, _not_ok(candidates))
    if STAGE_COLUMN in ok.columns and ok[STAGE_COLUMN].eq(DECODE_STAGE).any():
        ok = ok[ok[STAGE_COLUMN].eq(DECODE_STAGE)]  # the decode stage's, not the crossover's few steps at batch 1
    row = _latest(ok[ok["prompt_len"].eq(ok["prompt_len"].min())]).iloc[-1]
    if pd.isna(row["bw_util"]):
        return Verdict("FAIL", target, "bw_util is null: no measured ceilings for this device (see the ceilings stage)")
    memory = "HBM" if row["device"] == "cuda" else "memory"
    status = "PASS" if row["bw_util"] >= BANDWIDTH_TARGET else "FAIL"
    return Verdict(
        status,
        target,
        f"{row['bw_util']:.0%} of measured {memory} bandwidth at batch 1 in bf16 (target >= {BANDWIDTH_TARGET:.0%};"
        f" {row['model']}, prompt {row['prompt_len']}, TPOT {row['tpot_ms']:.3f} ms,"
        f" {row['achieved_bw_gbps']:.0f} of {row['peak_bw_gbps']:.0f} GB/s)",
    )


def _pairs(rows: pd.DataFrame, *, key: Sequence[str], column: str, first: str, second) -> list[tuple]:
    """(key values, row with column == first, row with column matching `second`) for every workload that has both,
    the latest row of each side; `second` is a value or a predicate on the row."""
    pairs = []
    for values, group in rows.groupby(list(key), dropna=False, sort=True):
        left = group[group[column].eq(first)]
        right = group[group.apply(second, axis=1)] if callable(second) else group[group[column].eq(second)]
        if not left.empty and not right.empty:
            pairs.append((values, _latest(left).iloc[-1], _latest(right).iloc[-1]))
    return pairs


def paged_verdict(rows: pd.DataFrame) -> Verdict:
    """paged TPOT against contiguous TPOT, every workload and KV format measured with both: the worst pair."""
    target = "paged-overhead"
    ok = _eager(rows)
    ok = ok[ok["status"].eq("ok") & ok["tpot_ms"].notna()]
    pairs = _pairs(ok, key=[*WORKLOAD, "kv_dtype"], column="cache", first="paged", second="contiguous")
    if not pairs:
        return Verdict("N/A", target, "no paged and contiguous rows of the same workload")
    ratios = [(paged["tpot_ms"] / contiguous["tpot_ms"], paged, contiguous) for _, paged, contiguous in pairs]
    ratio, paged, contiguous = max(ratios, key=lambda item: item[0])
    status = "PASS" if ratio <= 1 + PAGED_TARGET else "FAIL"
    return Verdict(
        status,
        target,
        f"paged TPOT {ratio - 1:+.1%} against contiguous at worst, of {len(pairs)} workloads (target <= "
        f"+{PAGED_TARGET:.0%}; worst: {paged['kv_dtype']} KV, batch {paged['batch_size']}, prompt "
        f"{paged['prompt_len']}: {paged['tpot_ms']:.3f} vs {contiguous['tpot_ms']:.3f} ms)",
    )


def fp8_verdict(rows: pd.DataFrame, *, long_context_tokens: int = LONG_CONTEXT_TOKENS) -> Verdict:
    """fp8_e4m3 KV against KV at the compute dtype, same strategy and workload, at prompts of at least
    long_context_tokens: faster in every pair. The fp8 rows' top-1 agreement with the exact cache is reported."""
    target = "fp8-long-context"
    ok = _eager(rows)
    ok = ok[ok["status"].eq("ok") & ok["tpot_ms"].notna() & ok["prompt_len"].ge(long_context_tokens)]
    pairs = _pairs(
        ok,
        key=[*WORKLOAD, "cache", "block_size"],
        column="kv_dtype",
        first="fp8_e4m3",
        second=lambda row: row["kv_dtype"] == row["dtype"],
    )
    if not pairs:
        return Verdict("N/A", target, f"no fp8_e4m3 and full-precision KV rows of one workload at >= "
                       f"{long_context_tokens} tokens")  # fmt: skip
    parts, faster = [], True
    for _, fp8, full in pairs:
        ratio = fp8["tpot_ms"] / full["tpot_ms"]
        faster &= bool(ratio < 1)
        agreement = "" if pd.isna(fp8["top1_agreement"]) else f", top-1 {fp8['top1_agreement']:.3f}"
        parts.append(f"{fp8['cache']} {ratio:.2f}x{agreement}")
    context = int(max(fp8["prompt_len"] for _, fp8, _ in pairs))
    return Verdict(
        "PASS" if faster else "FAIL",
        target,
        f"fp8_e4m3 TPOT / {pairs[0][2]['kv_dtype']} TPOT at {context} tokens: {'; '.join(parts)} (target < 1x)",
    )


def reduce_overhead_verdict(rows: pd.DataFrame) -> Verdict:
    """The compile=reduce-overhead row: ok, and inductor skipped CUDA graphs 0 times (cudagraph_skips)."""
    target = "reduce-overhead"
    compiled = rows[rows["compile"].eq("reduce-overhead")]
    if compiled.empty:
        return Verdict("N/A", target, "no compile=reduce-overhead row")
    row = _latest(compiled).iloc[-1]
    if row["status"] == "unsupported" and row["device"] != "cuda":
        return Verdict("N/A", target, f"unsupported on {row['device']}: {' '.join(str(row['error']).split())}")
    if row["status"] != "ok":
        return Verdict("FAIL", target, _not_ok(compiled))
    if "cudagraph_skips" not in rows.columns:
        return Verdict("N/A", target, "column missing: cudagraph_skips")
    if pd.isna(row["cudagraph_skips"]):
        return Verdict("N/A", target, "cudagraph_skips is null on the reduce-overhead row")
    skips = int(row["cudagraph_skips"])
    return Verdict(
        "PASS" if skips == 0 else "FAIL",
        target,
        f"CUDA graphs skipped {skips} times ({row['model']}, batch {row['batch_size']}, TPOT {row['tpot_ms']:.3f} "
        "ms; target 0)",
    )


def nvml_verdict(rows: pd.DataFrame) -> Verdict:
    """Every ok CUDA row read NVML inside its timed window: samples taken, energy per token and the minimum SM clock
    recorded."""
    target = "energy-clocks"
    missing = [name for name in NVML_COLUMNS if name not in rows.columns]
    if missing:
        return Verdict("N/A", target, f"column missing: {', '.join(missing)}")
    cuda = rows[rows["status"].eq("ok") & rows["device"].eq("cuda")]
    if cuda.empty:
        return Verdict("N/A", target, "no ok CUDA rows (NVML reads CUDA devices only)")
    read = cuda["nvml_timed_samples"].fillna(0).gt(0) & cuda["energy_j_per_token"].notna()
    read &= cuda["sm_clock_mhz_min"].notna()
    if read.all():
        return Verdict(
            "PASS",
            target,
            f"all {len(cuda)} ok CUDA rows sampled NVML in their timed window (at least "
            f"{int(cuda['nvml_timed_samples'].min())} samples; SM clock at least {int(cuda['sm_clock_mhz_min'].min())} MHz)",
        )
    lacking = cuda[~read]
    named = "; ".join(
        " ".join(str(row[name]) for name in (STAGE_COLUMN, "cache", "kv_dtype") if isinstance(row.get(name), str))
        + f" batch {row['batch_size']}"
        for _, row in lacking.head(3).iterrows()
    )
    return Verdict(
        "FAIL",
        target,
        f"{len(lacking)} of {len(cuda)} ok CUDA rows lack NVML samples, energy or the SM clock from the timed window "
        f"({named}{'; ...' if len(lacking) > 3 else ''})",
    )


def verdicts(rows: pd.DataFrame, *, long_context_tokens: int = LONG_CONTEXT_TOKENS) -> list[Verdict]:
    """One verdict per target, in this order: bandwidth, paged overhead, fp8 at long context, CUDA graphs, NVML."""
    return [
        bandwidth_verdict(rows),
        paged_verdict(rows),
        fp8_verdict(rows, long_context_tokens=long_context_tokens),
        reduce_overhead_verdict(rows),
        nvml_verdict(rows),
    ]


# --- the report ----------------------------------------------------------------------------------------------------

KEY_COLUMNS = (
    (STAGE_COLUMN, "{}"), ("status", "{}"), ("model", "{}"), ("cache", "{}"), ("kv_dtype", "{}"), ("compile", "{}"),
    ("attn_backend", "{}"), ("batch_size", "{}"), ("prompt_len", "{}"), ("gen_len", "{}"), ("tpot_ms", "{:.3f}"),
    ("predicted_tpot_ms", "{:.3f}"), ("bw_util", "{:.2f}"), ("ttft_ms", "{:.1f}"), ("decode_tok_s", "{:.0f}"),
    ("top1_agreement", "{:.3f}"), ("peak_mem_bytes", "GiB"), ("energy_j_per_token", "{:.3f}"),
    ("sm_clock_mhz_min", "{}"), ("cudagraph_skips", "{}"),
)  # fmt: skip


def stage_dirs(work: Path) -> list[Path]:
    """The stages' results folders under work/stages, in the order the stages ran (stages.tsv), then any other."""
    found = sorted(p for p in (work / "stages").glob("*") if p.is_dir())
    order = {name: i for i, name in enumerate(read_stages(work)["stage"])}
    return sorted(found, key=lambda p: (order.get(p.name, len(order)), p.name))


def merge_rows(work: Path) -> pd.DataFrame:
    """Every row of every stage (harness.results.load of each stage's folder), with the stage's name beside it: the
    stages in the order they ran, each stage's rows in the order they were measured."""
    frames = [
        results.load(folder).sort_values("started_at", kind="stable").assign(**{STAGE_COLUMN: folder.name})
        for folder in stage_dirs(work)
    ]
    frames = [frame for frame in frames if not frame.empty]
    if not frames:
        return results.load(work / "stages").assign(**{STAGE_COLUMN: pd.Series(dtype="string")})
    return pd.concat(frames, ignore_index=True)


def merge_ops(work: Path) -> pd.DataFrame:
    """Every profiler top-ops table (harness.results.load_ops) of every stage, with the stage's name beside it."""
    frames = [results.load_ops(folder).assign(**{STAGE_COLUMN: folder.name}) for folder in stage_dirs(work)]
    frames = [frame for frame in frames if len(frame)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def read_stages(work: Path) -> pd.DataFrame:
    """stages.tsv, one line per stage the script ran: stage, limit_s, exit, seconds (exit 124: ran out of time)."""
    path = work / "stages.tsv"
    if not path.is_file():
        return pd.DataFrame(columns=["stage", "limit_s", "exit", "seconds"])
    return pd.read_csv(path, sep="\t", dtype={"stage": str})


def machine_lines() -> list[str]:
    """The machine: nvidia-smi -L, the driver, torch, CUDA, triton and Python versions."""
    import platform

    import torch

    from harness.bench import nvidia_driver_version

    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        smi = f"(nvidia-smi: {exc.__class__.__name__})"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return [
        f"- nvidia-smi -L: {smi or '(no GPU listed)'}",
        f"- device: {device}; driver {nvidia_driver_version() or '-'}; CUDA (torch build) {torch.version.cuda or '-'}",
        f"- torch {torch.__version__}; triton {triton_version}; Python {platform.python_version()} on "
        f"{platform.node()}",
    ]


def _cell(value: object, fmt: str) -> str:
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return "-"
    if fmt == "GiB":
        return f"{value / 2**30:.1f}"
    return fmt.format(value)


def key_rows_table(rows: pd.DataFrame) -> str:
    """The rows' key columns (those present), fixed width, one line per row; errors listed under it."""
    if rows.empty:
        return "(no rows)"
    columns = [(name, fmt) for name, fmt in KEY_COLUMNS if name in rows.columns]
    table = pd.DataFrame({name: [_cell(v, fmt) for v in rows[name]] for name, fmt in columns})
    table = table.rename(columns={"peak_mem_bytes": "peak_GiB", "batch_size": "batch", "prompt_len": "prompt"})
    lines = [table.to_string(index=False)]
    for _, row in rows[rows["status"].ne("ok")].iterrows():
        lines.append(f"{row[STAGE_COLUMN]} {row['cache']} {row['kv_dtype']} batch {row['batch_size']} prompt "
                     f"{row['prompt_len']}: {row['status']}: {' '.join(str(row['error']).split())[:200]}")  # fmt: skip
    return "\n".join(lines)


def summary_markdown(
    *,
    machine: Sequence[str],
    stages: pd.DataFrame,
    predicted: dict[str, float],
    rows: pd.DataFrame,
    found: Sequence[Verdict],
    dry: bool,
    long_context_tokens: int,
) -> str:
    """summary.md: the machine, the stages, the key rows and the crossover's knee, then the verdicts, one a line, last."""
    lines = ["# kvbench GPU check", ""]
    if dry:
        lines += [
            f"Dry run (GPU_CHECK_DRY=1): the same stages on the CPU at tiny sizes; long context = {long_context_tokens}"
            " tokens. The verdicts check the pipeline, not the targets.",
            "",
        ]
    lines += ["## Machine", "", *machine, "", "## Stages", "", "```"]
    table = stages.assign(predicted_s=[predicted.get(name) for name in stages["stage"]])
    table["predicted_s"] = [_cell(v, "{:.0f}") for v in table["predicted_s"]]
    lines += [table.to_string(index=False) if len(table) else "(no stages ran)", "```", ""]
    lines += ["## Key rows", "", "```", key_rows_table(rows), "```", ""]
    knees = crossover.knee_table(rows) if not rows.empty else pd.DataFrame()
    if not knees.empty:
        lines += ["## Crossover: observed knee beside the predicted B*", "", "```", knees.to_string(index=False), "```",
                  ""]  # fmt: skip
    lines += ["## Verdicts", "", *(verdict.line() for verdict in found)]
    return "\n".join(lines) + "\n"


def write_report(*, work: Path, out: Path, dry: bool, long_context_tokens: int) -> list[Verdict]:
    """rows.parquet, ops.parquet (when a stage profiled), ceilings.json (when measured) and summary.md into out.

    The figures first, summary.md next, the stages' predicted seconds (a few Hydra composes) last, rewriting it: a
    report cut short by its time limit still leaves the rows and the verdicts behind."""
    out.mkdir(parents=True, exist_ok=True)
    rows = merge_rows(work)
    rows.to_parquet(out / "rows.parquet", index=False)
    ops = merge_ops(work)
    if len(ops):
        ops.to_parquet(out / "ops.parquet", index=False)
    stored = {path.stem: json.loads(path.read_text()) for path in sorted((work / "store" / "ceilings").glob("*.json"))}
    if stored:
        (out / "ceilings.json").write_text(json.dumps(stored, indent=2) + "\n")
    found = verdicts(rows, long_context_tokens=long_context_tokens)
    summary = dict(machine=machine_lines(), stages=read_stages(work), rows=rows, found=found, dry=dry,
                   long_context_tokens=long_context_tokens)  # fmt: skip
    (out / "summary.md").write_text(summary_markdown(predicted={}, **summary))
    if not dry:  # the GPU's predictions beside a CPU run's seconds would only mislead
        try:
            predicted = stage_predictions(gpu=H200)
        except Exception as exc:  # a courtesy: never lose the summary to it
            print(f"gpu_check: no predicted seconds in summary.md: {exc}", file=sys.stderr)
        else:
            (out / "summary.md").write_text(summary_markdown(predicted=predicted, **summary))
    return found


# --- CLI -----------------------------------------------------------------------------------------------------------


def plan_table(*, gpu: Gpu = H200) -> pd.DataFrame:
    """Every stage of the script: its limit, its points (preset stages) and its predicted seconds on `gpu`."""
    limits = stage_limits(SCRIPT.read_text())
    predicted = stage_predictions(gpu=gpu)
    points = {stage: len(preset_points(preset)) for stage, preset in STAGE_PRESETS.items()}
    lines = [
        {
            "stage": stage,
            "limit_s": limit,
            "points": points.get(stage),
            "predicted_s": round(predicted[stage]) if stage in predicted else None,
        }
        for stage, limit in limits.items()
    ]
    return pd.DataFrame(lines).astype({"points": "Int64", "predicted_s": "Int64"})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("plan", help="each stage of scripts/gpu_check.sh: limit, points, predicted seconds (H200)")
    report = commands.add_parser("report", help="merge the stages' rows into --out and write summary.md")
    report.add_argument("--work", type=Path, required=True, help="the script's scratch folder (stages/, store/)")
    report.add_argument("--out", type=Path, required=True, help="where rows.parquet, summary.md, ... go")
    report.add_argument("--long-context-tokens", type=int, default=LONG_CONTEXT_TOKENS,
                        help="prompts at least this long count as long context (fp8 verdict)")  # fmt: skip
    report.add_argument("--dry", action="store_true", help="a CPU dry run: said so in summary.md")
    args = parser.parse_args(argv)
    if args.command == "plan":
        table = plan_table()
        print(table.to_string(index=False))
        print(f"sum of limits: {table['limit_s'].sum()} s; sum of predictions: {table['predicted_s'].sum():.0f} s")
        return 0
    found = write_report(work=args.work, out=args.out, dry=args.dry, long_context_tokens=args.long_context_tokens)
    print("\n".join(verdict.line() for verdict in found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
