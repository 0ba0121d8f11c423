"""Measure one decode point per Hydra job; a multirun sweeps them.

    python -m experiments.decode                                    # one point, the defaults
    python -m experiments.decode -m batch_size=1,8,32 prompt_len=128,1024 cache=contiguous,paged
    python -m experiments.decode experiment=quickstart              # a preset sweep from conf/experiment/

Each point is validated before any model is built, measured in its own spawned process, and written atomically as
<results_dir>/<sweep_id>/<point_id>.parquet, whatever its status.
"""

from __future__ import annotations

import atexit
import logging
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from harness.config import RunConfig
from harness.errors import ConfigError, exit_on_config_error
from harness.measure import environment
from harness.run import point, runner, sweep
from harness.run.point_result import PointResult
from harness.store import disk, summary

# An absolute path: a console script (kvbench-decode, ...) calls main() from a wrapper, where Hydra would read a
# relative config_path as a Python package and find no conf/.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

log = logging.getLogger("kvbench")

ConfigStore.instance().store(name="run_config", node=RunConfig)

# Hydra calls main once per job, all in this process (the basic launcher) or one per process (submitit): the worker
# kept warm between this process's points is this entry point's, closed when the process exits.
POINTS = runner.Runner()
atexit.register(POINTS.close)


def output_dir() -> Path:
    """The run's folder (single run) or the sweep's (multirun): its name is the sweep_id."""
    hc = HydraConfig.get()
    return Path(hc.sweep.dir if hc.mode.name == "MULTIRUN" else hc.run.dir)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
@exit_on_config_error  # bad input: one line, nothing built, nothing recorded; the exit stops a sweep there
def main(cfg: DictConfig) -> dict:
    """Measure (or skip) one point. Returns {status, path, point_id}: what became of it and where its row is (an
    earlier one when skipped), which SweepProgress gathers for the sweep's summary."""
    run_cfg = RunConfig(**OmegaConf.to_container(cfg, resolve=True))
    directory = inside_results_dir(output_dir(), run_cfg.results_dir)
    base = runner.point_columns(run_cfg)  # the point's config and environment columns, nothing measured
    if not run_cfg.force:
        earlier = sweep.recorded(base["point_id"], base["device_name"], run_cfg.results_dir)
        if earlier is not None:
            log.info("skip %s: recorded as %s in %s (force=true measures it again)", base["point_id"],
                     earlier["status"], earlier["path"])  # fmt: skip
            if HydraConfig.get().mode.name != "MULTIRUN":
                print(f"already recorded as {earlier['status']} (force=true measures it again):")
                print(summary.format_summary(disk.load(earlier["path"]).query(f"point_id == '{base['point_id']}'")))
                print(summary.next_step(Path(earlier["path"]).parent, results_dir=run_cfg.results_dir))
            return {"status": sweep.SKIPPED, "path": earlier["path"], "point_id": base["point_id"]}
    cause = sweep.oom_cause(run_cfg, base, directory) if run_cfg.oom_backstop else None
    if cause is not None:
        result = PointResult(row=base | {"status": "skipped_oom", "error": sweep.skipped_oom_error(cause)})
    else:
        result = POINTS.run_point(run_cfg)
    row = result.row | {"sweep_id": directory.name}
    try:
        path = disk.write_point(row, directory)
        if result.ops is not None:  # the profiler's table: a second parquet keyed by point_id
            disk.write_ops(row["point_id"], result.ops, directory)
    except OSError as exc:  # disk full, read-only, over quota: every earlier row is whole; stop the sweep here
        print(f"kvbench: cannot write results to {directory}: {exc}; this point is not recorded", file=sys.stderr)
        sys.exit(1)
    log.info("%s %s -> %s", row["status"], row.get("error") or "", path)
    if HydraConfig.get().mode.name != "MULTIRUN":
        print(summary.format_summary(disk.load(path)))
        print(summary.next_step(directory, results_dir=run_cfg.results_dir))
    return {"status": row["status"], "path": str(path), "point_id": row["point_id"]}


# What the job's node would have said of itself; the submitting process that writes a killed job's row cannot.
NODE_COLUMNS = ("cpu_model", "cpu_capability", "device_name", "device_count", "driver_version", "cuda_version")


def record_killed_job(config: DictConfig, *, job_id: str, node: str | None, error: str) -> dict:
    """The `oom` row of a point whose SLURM job was killed for memory before it reported anything, written by the
    submitting process (harness.run.slurm_watch.RecordingSlurmJob), which calls it with the job's composed config.
    The point's config columns, `error`, the job's id and node; the node's CPU and device columns are null, since
    nothing ran there to read them. Returns what main() returns for the point."""
    HydraConfig.instance().set_config(config)  # the config's ${hydra:...} interpolations resolve against it
    sweep_dir = Path(config.hydra.sweep.dir)
    task = OmegaConf.to_container(config, resolve=False)
    del task["hydra"]  # Hydra's own node, as the job's task function never sees it (some of it is the job's alone)
    run_cfg = RunConfig(**OmegaConf.to_container(OmegaConf.create(task), resolve=True))
    # the environment as the CPU sees it here (no CUDA initialised in the submitting process), the node's nulled
    row = point.config_columns(run_cfg) | environment.environment_columns(torch.device("cpu"))
    row |= dict.fromkeys(NODE_COLUMNS) | {"host": node, "slurm_job_id": job_id, "sweep_id": sweep_dir.name}
    row |= {"status": "oom", "error": error}
    path = disk.write_point(row, inside_results_dir(sweep_dir, run_cfg.results_dir))
    return {"status": row["status"], "path": str(path), "point_id": row["point_id"]}


def inside_results_dir(directory: Path, results_dir: str) -> Path:
    """`directory` (Hydra's run or sweep folder) when it lies inside results_dir; else a ConfigError. Every row
    goes under results_dir, which resume searches and which `make clean-results` owns."""
    resolved, root = directory.resolve(), Path(results_dir).resolve()
    if not resolved.is_relative_to(root) or resolved == root:
        raise ConfigError(
            f"hydra.sweep.dir: {directory} is not a folder inside results_dir ({root}); allowed: a path under it, "
            "e.g. hydra.sweep.dir=${results_dir}/my-sweep"
        )
    return directory


if __name__ == "__main__":
    main()
