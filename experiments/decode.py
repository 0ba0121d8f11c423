"""Measure one decode point per Hydra job; a multirun sweeps them.

    python -m experiments.decode                                    # one point, the defaults
    python -m experiments.decode -m batch_size=1,8,32 prompt_len=128,1024 cache=contiguous,paged
    python -m experiments.decode experiment=quickstart              # a preset sweep from conf/experiment/

Each point is validated before any model is built, measured in its own spawned process, and written atomically as
<results_dir>/<sweep_id>/<point_id>.parquet, whatever its status.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from harness import results, runner
from harness.config import ConfigError, RunConfig

log = logging.getLogger("kvbench")

ConfigStore.instance().store(name="run_config", node=RunConfig)


def output_dir() -> Path:
    """The run's folder (single run) or the sweep's (multirun): its name is the sweep_id."""
    hc = HydraConfig.get()
    return Path(hc.sweep.dir if hc.mode.name == "MULTIRUN" else hc.run.dir)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run_cfg = RunConfig(**OmegaConf.to_container(cfg, resolve=True))
    except ConfigError as exc:
        # Bad input: one line, nothing built, nothing recorded. Exit stops a sweep before it measures more.
        print(f"kvbench: bad config: {exc}", file=sys.stderr)
        sys.exit(2)
    directory = output_dir()
    row = runner.run_point(run_cfg) | {"sweep_id": directory.name}
    top_ops = row.pop("top_ops", None)  # the profiler's table: a second parquet keyed by point_id
    path = results.write_point(row, directory)
    if top_ops is not None:
        results.write_ops(row["point_id"], top_ops, directory)
    log.info("%s %s -> %s", row["status"], row.get("error") or "", path)
    if HydraConfig.get().mode.name != "MULTIRUN":
        print(results.format_summary(results.load(path)))


if __name__ == "__main__":
    main()
