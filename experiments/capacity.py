"""The capacity planner from the command line, and the OOM frontier that checks it against real OOMs.

    python -m experiments.capacity                     # frontier: small, bf16, 1.5 GiB cap, contexts 512/2048/8192
    python -m experiments.capacity model=tiny contexts=[256,1024] max_memory_gb=0.6     # seconds per probe
    python -m experiments.capacity mode=plan model=llama-3.1-8b kv_dtype=fp8_e4m3 prompt_len=8192 gen_len=1024 \
        concurrency=32 memory_gb=141                   # how many concurrent requests fit in my GPU?
    python -m experiments.capacity mode=fleet target_qps=100 ttft_slo_ms=500ms   # replicas, from a serve-qps sweep

frontier: for each context length (prompt_len + gen_len tokens per sequence), the largest batch that runs under
`max_memory_gb`, found with real OOMs: each probe is a point measured by harness.run.runner.run_point in its own
spawned process, capped by RLIMIT_DATA on the CPU (the allocator's fraction on CUDA). The search starts at the
planner's prediction, gallops up or down to bracket the frontier, then bisects until the bracket is one
`bisection step` wide (1 batch, or `resolution` of it). Each row puts the measured frontier beside the predicted
max batch; the planner must land within one step of it. Rows go to <results_dir>/capacity/frontier-<time>.parquet.

fleet: how many replicas each strategy needs to serve target_qps within a p99 TTFT SLO, from the knees of a serving
sweep's curves (the newest sweep under <results_dir>/serve, or sweep_id's; a knee stands only on runs that
sustained their rate, harness.serve.sustained), beside the concurrency Little's law predicts for them
(harness.serve.fleet). The table goes to <results_dir>/capacity/fleet-<time>.parquet.

What this found here (2 CPU cores, small preset, bf16, 1.5 GiB, gen_len 2; 3.5 minutes): measured frontier =
predicted max batch at every context, 39 / 9 / 2 at 512 / 2048 / 8192 tokens, two probes each.

glibc's malloc otherwise keeps freed activations of up to 32 MiB in its heap (its mmap threshold rises to each
freed mmapped block), and RLIMIT_DATA counts that heap: the CPU OOM point then depends on the allocation history
(VmData peaked at 1.5-1.8x the live bytes in a prefill of the small preset here, and the frontier at 512 tokens fell
from 39 to 27). The probes therefore run with MALLOC_MMAP_THRESHOLD_ pinned (`pin_mmap_threshold`): every large
tensor is its own mapping, returned when freed, and VmData follows the live tensors.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import pandas as pd
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from harness.analytic import ledger as planner
from harness.analytic.runtime import GiB, default_runtime_overhead_bytes
from harness.config import RunConfig, Workload, device_type
from harness.errors import ConfigError, exit_on_config_error
from harness.run import runner
from harness.serve import fleet
from harness.serve.metrics import SLO_FORMS, parse_slo_ms
from harness.store import disk

# An absolute path: a console script (kvbench-decode, ...) calls main() from a wrapper, where Hydra would read a
# relative config_path as a Python package and find no conf/.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

log = logging.getLogger("kvbench")

MODES = ("frontier", "plan", "fleet")
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial M_MMAP_THRESHOLD, pinned: its dynamic growth disabled


@dataclass
class CapacityConfig(Workload):
    """A Workload (model=llama-3.1-8b, cache=paged cache.block_size=32, weights=<dir> plans a Hugging Face
    config.json, ...) and how the planner is asked about it."""

    # frontier: measure the OOM frontier beside the prediction; plan: print the ledger; fleet: the replicas each
    # strategy needs for target_qps, from a serving sweep's knees
    mode: str = "frontier"
    prompt_len: int = 2048  # plan: tokens per prompt
    gen_len: int = 2  # tokens generated per request (frontier: 2, one decode step, keeps each probe short)
    concurrency: int | None = None  # plan: concurrent requests, the workload's batch_size (null: batch_size)
    memory_gb: float | None = None  # plan: the device's memory in GiB; null: detected (CUDA total, else RAM)
    device: str = "auto"  # auto: cuda when available, else cpu
    runtime_overhead_gb: float | None = None  # null: measured (harness.analytic.runtime.default_runtime_overhead_bytes)
    # frontier
    contexts: list[int] = field(default_factory=lambda: [512, 2048, 8192])  # prompt_len + gen_len of each frontier
    max_memory_gb: float = 1.5  # the cap every probe runs under (GiB)
    resolution: float = 0.0  # bisect until the bracket is max(1, resolution x batch) wide
    max_batch: int = 4096  # the search never probes beyond this
    pin_mmap_threshold: bool = True  # see the module docstring
    # fleet
    target_qps: float | None = None  # requests/s the fleet must serve (> 0)
    ttft_slo_ms: str | None = None  # the p99 TTFT SLO, with its unit: 500ms, 2s
    sweep_id: str | None = None  # the serving sweep under <results_dir>/serve; null: the newest
    results_dir: str = "results"
    seed: int = 0

    def validate(self) -> None:
        """This app's fields, then the workload at the length it is planned for (frontier: the longest context)."""
        if self.concurrency is not None:
            self.batch_size = self.concurrency
        if self.mode not in MODES:
            raise ConfigError(f"mode: unknown value {self.mode!r}; allowed: {', '.join(MODES)}")
        if "name" not in self.cache:
            raise ConfigError("cache.name: missing")
        if self.runtime_overhead_gb is not None and self.runtime_overhead_gb < 0:
            raise ConfigError(f"runtime_overhead_gb: must be 0 or more, got {self.runtime_overhead_gb}")
        if self.max_memory_gb <= 0:
            raise ConfigError(f"max_memory_gb: must be positive, got {self.max_memory_gb}")
        if not 0 <= self.resolution < 1:
            raise ConfigError(f"resolution: must be in [0, 1), got {self.resolution}")
        if self.max_batch <= 0:
            raise ConfigError(f"max_batch: must be positive, got {self.max_batch}")
        if self.mode == "fleet":  # the runs describe the fleet's workload; this one's fields are not read
            if self.target_qps is None or not 0 < self.target_qps < math.inf:
                raise ConfigError(f"target_qps: must be a finite number of requests/s > 0, got {self.target_qps}")
            if parse_slo_ms(self.ttft_slo_ms, "ttft_slo_ms") is None:
                raise ConfigError(f"ttft_slo_ms: missing; the fleet is sized under a p99 TTFT SLO; {SLO_FORMS}")
            return
        if self.mode == "frontier":
            for context in self.contexts:
                if context <= self.gen_len:
                    raise ConfigError(f"contexts: each must exceed gen_len={self.gen_len}, got {context}")
            self.probe_config(batch_size=1, context=max(self.contexts))  # the probes' own checks, up front
            planner.ledger(  # the planner's: a strategy this device cannot run, a cap below the weights
                self.workload(prompt_len=max(self.contexts) - self.gen_len, batch_size=1),
                memory_gb=self.max_memory_gb,
                device=self.device,
                runtime_overhead_bytes=0,
            )
        self.workload(prompt_len=self.prompt_len if self.mode == "plan" else max(self.contexts) - self.gen_len)

    @property
    def runtime_overhead_bytes(self) -> int | None:
        return None if self.runtime_overhead_gb is None else int(self.runtime_overhead_gb * GiB)

    def probe_config(self, *, batch_size: int, context: int) -> RunConfig:
        """One probe: a decode point of this batch and context, one generation, nothing else, under the cap."""
        return RunConfig(
            **(self.workload_fields() | dict(batch_size=batch_size, prompt_len=context - self.gen_len)),
            device=self.device,
            warmup=0,
            min_repeats=1,
            max_repeats=1,
            retry_noisy=False,  # a probe asks whether it fits, never how fast: one repeat, never measured again
            accuracy=False,  # the accuracy pass would build a second, exact cache beside the one measured
            max_memory_gb=self.max_memory_gb,
            results_dir=self.results_dir,
            seed=self.seed,
        )


ConfigStore.instance().store(name="capacity_config", node=CapacityConfig)


# --- the frontier ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def pinned_mmap_threshold(enabled: bool = True) -> Iterator[None]:
    """Children spawned inside inherit MALLOC_MMAP_THRESHOLD_ (read by glibc when a process starts)."""
    key, previous = "MALLOC_MMAP_THRESHOLD_", os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if enabled:
        os.environ[key] = str(MMAP_THRESHOLD_BYTES)
    try:
        yield
    finally:
        if enabled and previous is None:
            os.environ.pop(key, None)
        elif enabled:
            os.environ[key] = previous


FRONTIER_COLUMNS = (  # what find_frontier measures, per context
    "measured_max_batch",
    "first_oom_batch",
    "bisection_step",
    "probes",
    "probe_s",
    "peak_mem_bytes",
    "mem_baseline_bytes",
    "kv_bytes_allocated",
)


@dataclass
class Probe:
    batch_size: int
    status: str
    row: dict
    seconds: float


def measured_row(cfg: RunConfig) -> dict:
    """One probe measured for real: the row of runner.run_point's result (a probe needs no ops table)."""
    return runner.run_point(cfg).row


def find_frontier(cfg: CapacityConfig, *, context: int, predicted: int, probe=measured_row) -> dict:
    """The largest batch that runs at `context` under the cap, bracketed from `predicted` and bisected.

    Returns the frontier's row: measured_max_batch (0: not even one fits), first_oom_batch, bisection_step (their
    distance when the search stopped), the probes run, and the peak memory of the last probe that fit.
    """
    probes: dict[int, Probe] = {}

    def fits(batch: int) -> bool:
        if batch not in probes:
            started = time.perf_counter()
            row = probe(cfg.probe_config(batch_size=batch, context=context))
            probes[batch] = Probe(batch, row["status"], row, time.perf_counter() - started)
            log.info("context %d batch %d: %s (%.0f s)", context, batch, row["status"], probes[batch].seconds)
            if row["status"] not in ("ok", "oom"):
                raise RuntimeError(f"probe at context {context}, batch {batch}: {row['status']}: {row.get('error')}")
        return probes[batch].status == "ok"

    def width(low: int) -> int:
        return max(1, math.floor(cfg.resolution * low))

    start = min(max(1, predicted), cfg.max_batch)
    low, high = planner.bracket(fits, low=1, high=cfg.max_batch, start=start, width=width)
    last_ok = probes[low].row if low in probes else {}
    return {
        "measured_max_batch": low,
        "first_oom_batch": high,
        "bisection_step": high - low,
        "probes": len(probes),
        "probe_s": sum(p.seconds for p in probes.values()),
        "peak_mem_bytes": last_ok.get("peak_mem_bytes"),
        "mem_baseline_bytes": last_ok.get("mem_baseline_bytes"),
        "kv_bytes_allocated": last_ok.get("kv_bytes_allocated"),
    }


def frontier_rows(cfg: CapacityConfig, *, probe=measured_row) -> pd.DataFrame:
    """One row per context: the measured frontier beside the planner's max batch under the same cap."""
    device = device_type(cfg.device)
    rows = []
    with pinned_mmap_threshold(cfg.pin_mmap_threshold):
        # The CPU cap (RLIMIT_DATA) covers the whole process, its runtime included; the CUDA cap (the allocator's
        # fraction) only what the allocator holds, so there the runtime does not count against it.
        runtime_bytes = cfg.runtime_overhead_bytes
        for context in cfg.contexts:
            workload = cfg.workload(prompt_len=context - cfg.gen_len, batch_size=1)
            if runtime_bytes is None:
                runtime_bytes = default_runtime_overhead_bytes(device, workload) if device == "cpu" else 0
            book = planner.ledger(
                workload, memory_gb=cfg.max_memory_gb, device=device, runtime_overhead_bytes=runtime_bytes
            )
            predicted = book.max_concurrency
            try:
                measured = find_frontier(cfg, context=context, predicted=predicted, probe=probe) | {"error": None}
            except RuntimeError as exc:  # a probe that neither ran nor ran out of memory: recorded, not raised
                log.error("%s", exc)
                measured = dict.fromkeys(FRONTIER_COLUMNS) | {"error": str(exc)}
            at_frontier = workload.replace(batch_size=max(1, measured["measured_max_batch"] or 1))
            predicted_dynamic = planner.total_bytes(at_frontier, runtime_overhead_bytes=0)  # without the runtime
            rows.append(
                {
                    "model": workload.model_args().name,
                    "device": device,
                    "dtype": cfg.dtype,
                    "kv_dtype": workload.kv_dtype_name,
                    "cache": workload.cache_name,
                    "context": context,
                    "prompt_len": workload.prompt_len,
                    "gen_len": cfg.gen_len,
                    "max_memory_gb": cfg.max_memory_gb,
                    "runtime_overhead_bytes": runtime_bytes,
                    "predicted_max_batch": predicted,
                    **measured,
                    "within_step": measured["error"] is None
                    and abs(predicted - measured["measured_max_batch"]) <= measured["bisection_step"],
                    # At the measured frontier: the planner's total without the runtime, against the probe's peak
                    # RSS growth (peak - baseline): the CPU RSS error, a cruder check than the OOM itself.
                    "predicted_model_bytes": predicted_dynamic,
                    "mmap_threshold_pinned": cfg.pin_mmap_threshold,
                }
            )
    table = pd.DataFrame(rows)
    growth = pd.to_numeric(table["peak_mem_bytes"]) - pd.to_numeric(table["mem_baseline_bytes"])
    table["rss_error"] = (table["predicted_model_bytes"] - growth) / growth
    return table


def format_frontier(table: pd.DataFrame) -> str:
    shown = table.assign(
        max_memory_gb=table["max_memory_gb"].map("{:.2f}".format),
        runtime_gib=(table["runtime_overhead_bytes"] / GiB).map("{:.3f}".format),
        probe_s=table["probe_s"].map(lambda s: "" if pd.isna(s) else f"{s:.0f}"),
        rss_error=table["rss_error"].map(lambda e: "" if pd.isna(e) else f"{e:+.1%}"),
    )
    columns = ["model", "dtype", "cache", "context", "max_memory_gb", "runtime_gib", "measured_max_batch"]
    columns += ["first_oom_batch", "bisection_step", "predicted_max_batch", "within_step", "probes", "probe_s"]
    return shown[[*columns, "rss_error"]].to_string(index=False)


# --- the fleet ------------------------------------------------------------------------------------------------------


def fleet_rows(cfg: CapacityConfig) -> pd.DataFrame:
    """The fleet table of the sweep cfg names (or the newest): no finished run, or no such sweep, is a ConfigError."""
    runs = fleet.load_run_rows(cfg.results_dir, sweep_id=cfg.sweep_id)
    return fleet.fleet(runs, target_qps=cfg.target_qps, ttft_slo_ms=cfg.ttft_slo_ms)


# --- the app --------------------------------------------------------------------------------------------------------


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="capacity")
@exit_on_config_error
def main(cfg: DictConfig) -> None:
    config = CapacityConfig(**OmegaConf.to_container(cfg, resolve=True))
    if config.mode == "plan":
        book = planner.ledger(
            config.workload(prompt_len=config.prompt_len),
            memory_gb=config.memory_gb,
            device=config.device,
            runtime_overhead_bytes=config.runtime_overhead_bytes,
        )
    if config.mode == "fleet":  # reading the runs is the check that there are any
        table = fleet_rows(config)
    if config.mode == "plan":
        print(planner.format_ledger(book))
        return
    if config.mode == "fleet":
        path = fleet.write_fleet(table, Path(config.results_dir) / "capacity")
        print("\n".join(fleet.summary_lines(table)))
        print(f"written: {path}")
        return
    table = frontier_rows(config)
    path = disk.write_frontier(table, Path(config.results_dir) / "capacity")
    print(format_frontier(table))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
