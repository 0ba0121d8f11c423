"""Hydra callbacks for sweeps: validate every point up front, show progress with an ETA, summarize at the end."""

from __future__ import annotations

import itertools
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from harness.analytic import crossover
from harness.config import RunConfig
from harness.errors import ConfigError, exit_on_config_error
from harness.run.sweep import SKIPPED
from harness.store import disk, summary

log = logging.getLogger("kvbench")


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """The override list of every job of this multirun, expanded exactly as Hydra's basic sweeper does: the
    sweeper's params first, then the command line's overrides (a later override of a key replaces the earlier one in
    its place); every combination of the swept values, the last key varying fastest."""
    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
    overrides = OverridesParser.create().parse_overrides(params + list(config.hydra.overrides.task))
    choices: dict[str, list[str]] = {}  # key -> its overrides, one per swept value (one for a plain override)
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():  # choice, glob or range: values to enumerate
            choices[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:  # interval(a,b): a sweeper that samples (Optuna, Ax) may run it; the basic sweeper refuses it too
            raise HydraException(f"{key}: the basic sweeper does not support sweep type {override.value_type.name}")
    return [list(job) for job in itertools.product(*choices.values())]


@exit_on_config_error
def validate_points(jobs: list[list[str]]) -> None:
    """Validate every point before the first is measured: bad input costs a second, not half a sweep. The one line
    names the point (`kvbench: bad config: sweep point [cache=paged batch_size=0]: batch_size: ...`)."""
    for job in jobs:
        try:
            RunConfig(**OmegaConf.to_container(compose(config_name="config", overrides=job), resolve=True))
        except ConfigError as exc:
            raise ConfigError(f"sweep point [{' '.join(job)}]: {exc}") from exc


class SweepProgress(Callback):
    def __init__(self) -> None:
        self.total = 0
        self.done = 0
        self.started = 0.0
        self.sweep_dir: Path | None = None
        self.swept_keys: set[str] = set()  # the keys whose value changes across points: all a progress line shows
        self.rows: list[tuple[str, str]] = []  # (point_id, row file) of every finished job, skipped ones included
        self.skipped = 0  # jobs a resume skipped

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        jobs = sweep_jobs(config)
        self.total, self.done, self.started = len(jobs), 0, time.perf_counter()
        self.rows, self.skipped = [], 0
        self.sweep_dir = Path(config.hydra.sweep.dir)
        values: dict[str, set[str]] = {}
        for job in jobs:
            for override in job:
                key, _, value = override.partition("=")
                values.setdefault(key, set()).add(value)
        self.swept_keys = {key for key, seen in values.items() if len(seen) > 1}
        validate_points(jobs)
        if str(config.hydra.launcher.get("_target_", "")).endswith(".SlurmLauncher"):
            from harness.run import slurm_watch  # imports submitit: only for a SLURM sweep

            slurm_watch.install()  # job states from squeue where the cluster has no sacct
        log.info("sweep of %d points -> %s", self.total, self.sweep_dir)

    def sweep_rows(self) -> pd.DataFrame:
        """The row of every point of this sweep: those measured now and those a resume found recorded earlier. A
        launcher that runs jobs elsewhere (submitit) returns no paths here: then the sweep folder's rows."""
        if not self.rows:
            return disk.load(self.sweep_dir)
        frames = []
        for point_id, path in self.rows:
            rows = disk.load(path)
            frames.append(rows[rows["point_id"] == point_id].tail(1))
        return pd.concat(frames, ignore_index=True)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.total:
            return
        eta = ""
        if self.done:
            remaining_s = (time.perf_counter() - self.started) / self.done * (self.total - self.done)
            eta = f" | ETA {remaining_s / 60:.0f} min {remaining_s % 60:.0f} s"
        point = " ".join(o for o in config.hydra.overrides.task if o.partition("=")[0] in self.swept_keys)
        print(f"[{self.done + 1}/{self.total}] {point}{eta}", file=sys.stderr, flush=True)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        self.done += 1
        outcome = getattr(job_return, "_return_value", None)  # the value itself; .return_value re-raises a failure
        if isinstance(outcome, dict) and outcome.get("path"):
            self.rows.append((outcome["point_id"], outcome["path"]))
            self.skipped += outcome["status"] == SKIPPED

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        table = self.sweep_rows()
        print(summary.format_summary(table))
        failed = table[table["status"] != "ok"]
        elapsed_s = time.perf_counter() - self.started
        print(f"\n{len(table)} points in {elapsed_s:.0f} s, {len(failed)} not ok -> {self.sweep_dir}")
        if self.skipped:
            print(
                f"resumed: {self.skipped} of them already recorded (ok, oom, unsupported or skipped_oom) under "
                f"results_dir and not measured again; force=true measures every point"
            )
        for _, row in failed.iterrows():
            print(
                f"  {row['status']}: {row['cache']} batch={row['batch_size']} prompt={row['prompt_len']}: {row['error']}"
            )
        knees = crossover.knee_table(table)
        if not knees.empty:  # a batch sweep: where TPOT started rising, beside the predicted critical batch
            print(f"\nObserved knee (TPOT > {crossover.KNEE_RISE:.2f} x batch 1) beside the predicted B*:")
            print(knees.to_string(index=False))
        self.print_reuse_crossover(config, table)
        print(f"\n{summary.next_step(self.sweep_dir, results_dir=config.results_dir)}")

    @staticmethod
    def print_reuse_crossover(config: DictConfig, table: pd.DataFrame) -> None:
        """A prefix sweep with a disk tier: the context above which loading the prefix beats recomputing it."""
        if "ttft_disk_ms" not in table.columns or table["ttft_disk_ms"].isna().all():
            return
        from harness.analytic import reuse  # torch: only a sweep that has such rows pays for it
        from harness.device import ceilings

        first = table.dropna(subset=["ttft_disk_ms"]).iloc[0]
        directory = config.get("ceilings_dir") or config.results_dir
        stored = ceilings.read_stored(ceilings.ceilings_path(first["device"], directory))
        print("\nLoading the prefix from disk beats recomputing it above (measured: TTFTs; analytic: ceilings):")
        print(reuse.crossover_table(table, ceilings=stored).to_string(index=False))


class ServeSweepSummary(Callback):
    """At the end of an experiments.serve multirun: each run's measured concurrency beside the planner's, its
    throughput, TTFT and whether it sustained its rate; then, for a qps sweep with a ttft_slo_ms (experiment=serve-qps),
    each strategy's knee, the highest qps whose p99 TTFT stays within the SLO, every point up to it sustained
    (harness.serve.fleet)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from harness.serve import fleet  # the decode app never pays for it

        sweep_id = Path(config.hydra.sweep.dir).name
        try:
            frame = fleet.load_run_rows(config.results_dir, sweep_id=sweep_id)
        except ConfigError as exc:  # every run failed: nothing to summarize, and the jobs said why
            print(f"serve sweep {sweep_id}: no finished run: {exc}")
            return
        columns = ["strategy", "kv_dtype", "qps", "max_running_requests", "predicted_max_running",
                   "max_concurrent_requests", "total_preemptions", "output_throughput", "median_ttft_ms",
                   "prefix_hit_rate", "achieved_qps", "sustained"]  # fmt: skip
        table = frame[columns].rename(columns={"max_running_requests": "max running (measured)",
                                               "predicted_max_running": "(predicted)",
                                               "max_concurrent_requests": "max in flight"})  # fmt: skip
        print(f"serve sweep {sweep_id}: {len(frame)} runs")
        print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
        slo = config.get("ttft_slo_ms")
        if slo is None or not frame["qps"].map(math.isfinite).any():
            return
        print(f"the knee per strategy at p99 TTFT <= {slo}")
        print("\n".join(fleet.summary_lines(fleet.knees(frame, slo))))
        print(f"replicas for a target rate: python -m experiments.capacity mode=fleet sweep_id={sweep_id} "
              f"target_qps=<req/s> ttft_slo_ms={slo}")  # fmt: skip
