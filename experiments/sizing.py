"""How long a sweep should take on a GPU, and whether it fits: the sizing model behind the GPU presets and the
stages of scripts/gpu_check.sh.

The time model (`point_seconds`) is an upper bound for sizing, not a figure to quote: the roofline of
harness/analytic/roofline.py at half the datasheet peaks of harness/device/spec_peaks.csv, plus the host's cost of launching an eager
step, plus what a point pays besides its generations (model build, accuracy and profiler passes, compilation). The
memory model (`point_bytes`) is the capacity planner's. tests/analytic/test_presets.py holds every GPU preset to both;
tests/experiments/test_gpu_check.py holds every stage of the script to its limit.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments.decode  # noqa: F401  (registers the run_config schema that conf/config.yaml extends)
from experiments.callbacks import sweep_jobs
from harness.analytic import roofline
from harness.analytic.ledger import total_bytes, weights_bytes
from harness.analytic.runtime import CUDA_RUNTIME_DEFAULT_BYTES
from harness.config import RunConfig
from harness.device.spec import spec_for
from harness.formats import EXACT_REFERENCE
from harness.run.point import is_lossy

ROOT = Path(__file__).parents[1]
CONF = ROOT / "conf"

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
    """A datasheet GPU (harness/device/spec_peaks.csv), derated by EFFICIENCY for sizing."""

    name: str
    memory_gb: float  # decimal GB, as the datasheet and the presets' comments say
    peak_bw_gbps: float
    peak_tflops: dict[str, float]  # compute dtype -> dense TFLOP/s

    @classmethod
    def from_spec(cls, name: str, *, memory_gb: float) -> Gpu:
        spec = spec_for(name)
        if spec is None:
            raise ValueError(f"gpu: {name!r} is not in harness/device/spec_peaks.csv")
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
    """One whole generation of the point: its prefill, then its gen_len - 1 decode steps (harness.modeling.decode)."""
    shape = cfg.kv_shape()
    # The strategy's own reads (its layout: a window caps them, `none` recomputes), as harness.run.point asks them.
    layout = cfg.layout()
    costs = [roofline.prefill_cost(shape, layout=layout)]
    costs += [
        roofline.decode_step_cost(shape, context_len=context, layout=layout)
        for context in roofline.decode_contexts(cfg.prompt_len, cfg.gen_len)
    ]
    return sum(step_seconds(cost, gpu=gpu, dtype=cfg.dtype, n_layers=shape.model.n_layers) for cost in costs)


def point_seconds(cfg: RunConfig, *, gpu: Gpu) -> float:
    """Upper bound on one point's wall time in a warm worker (harness.run.point.run_point, harness.measure.timing.measure).

    warm-up generations, then at least min_repeats and at most max_repeats, the budget max_time_s checked after
    each one past min_repeats (so one generation may overrun it); with retry_noisy, the retry of a point that did
    not converge, at twice max_repeats and twice max_time_s (the worst case: every point retried); the accuracy
    pass of a lossy point; the profiler pass (one generation at most, and its start); the compilation of a compiled
    step; the model build. Not counted: prefix caching's extra generations that measure a miss (no GPU preset uses
    it).
    """
    generation = generation_seconds(cfg, gpu=gpu)
    seconds = cfg.warmup * generation + measured_seconds(cfg, generation_s=generation, budget=1)
    if cfg.retry_noisy:
        seconds += measured_seconds(cfg, generation_s=generation, budget=2)
    if cfg.accuracy and is_lossy(cfg):
        seconds += ACCURACY_GENERATIONS * generation
    if cfg.profile and cfg.gen_len > 2 and cfg.compile == "none":
        seconds += PROFILER_START_S + generation
    if cfg.compile != "none":
        seconds += COMPILE_S + COMPILE_S_PER_LAYER * cfg.model_args().n_layers
    weights = weights_bytes(cfg.model_args(), cfg.dtype)
    return seconds + POINT_OVERHEAD_S + weights / BUILD_BYTES_PER_S


def measured_seconds(cfg: RunConfig, *, generation_s: float, budget: int) -> float:
    """Upper bound on one attempt's measured repeats (harness.measure.timing.measure) at `budget` times max_repeats and
    max_time_s: 1 for the first attempt, 2 for the retry (harness.measure.timing.RepeatPolicy.retry)."""
    max_repeats, max_time_s = budget * cfg.max_repeats, budget * cfg.max_time_s
    return min(max_repeats * generation_s, max(cfg.min_repeats * generation_s, max_time_s + generation_s))


def sweep_seconds(points: Sequence[RunConfig], *, gpu: Gpu) -> float:
    """Upper bound on a whole sweep: its start, then every point."""
    return SWEEP_START_S + sum(point_seconds(cfg, gpu=gpu) for cfg in points)


def point_bytes(cfg: RunConfig) -> int:
    """Device memory a point needs at its peak, by the capacity planner (harness.analytic.ledger.total_bytes, with the CUDA
    runtime's assumed overhead), plus what the planner leaves out: the accuracy pass of a lossy point holds an exact
    contiguous cache at the compute dtype beside the point's and two fp32 logit tensors [B, gen_len, V]."""
    workload = cfg.workload()  # the planner's view of the point
    need = total_bytes(workload, runtime_overhead_bytes=CUDA_RUNTIME_DEFAULT_BYTES)
    if cfg.accuracy and is_lossy(cfg):
        exact = workload.replace(cache={"name": EXACT_REFERENCE}, kv_dtype="auto")
        logits = 2 * cfg.batch_size * cfg.gen_len * workload.model_args().vocab_size * 4
        need += exact.layout().allocation(exact.kv_shape()).total_bytes + logits
    return need


def point_fits(cfg: RunConfig, *, memory_gb: float) -> bool:
    """Whether the point fits memory_gb decimal GB (and its KV pool holds the batch)."""
    workload = cfg.workload()
    return workload.layout().pool_fits(workload.kv_shape()) and point_bytes(cfg) <= memory_gb * 1e9


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
