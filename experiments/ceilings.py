"""Measure this device's ceilings (or load them) and show them beside the published spec.

    python -m experiments.ceilings                        # best device present (cuda, else cpu)
    python -m experiments.ceilings device=cpu force=true  # measure again even if stored
    python -m experiments.ceilings quick=true             # small sizes, few repeats: a smoke test

The table shows both memory roofs with their spread: the streaming read (bytes read; the roofline's roof for
decode, set against the spec's GB/s) and the copy (bytes read + written, for comparison), then each matmul dtype.
The figures are stored as <results_dir>/ceilings/<fingerprint>.json (harness/device/ceilings.py) and reused by every later
run on the same device, this app's and the decode rows' alike; ceilings stored by an older method are measured again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from harness.config import DEVICES
from harness.device import ceiling_report, ceilings
from harness.errors import ConfigError, exit_on_config_error

# An absolute path: a console script (kvbench-decode, ...) calls main() from a wrapper, where Hydra would read a
# relative config_path as a Python package and find no conf/.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

log = logging.getLogger("kvbench")


@dataclass
class CeilingsConfig:
    device: str = "auto"  # auto: cuda when available, else cpu
    results_dir: str = "results"  # ceilings are stored as <results_dir>/ceilings/<fingerprint>.json
    quick: bool = False  # small sizes, few repeats: for tests, not figures to quote
    force: bool = False  # measure again even when this device's ceilings are stored

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device: unknown value {self.device!r}; allowed: {', '.join(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device: cuda requested but no CUDA device is available; allowed here: auto, cpu")


ConfigStore.instance().store(name="ceilings_config", node=CeilingsConfig)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="ceilings")
@exit_on_config_error
def main(cfg: DictConfig) -> None:
    config = CeilingsConfig(**OmegaConf.to_container(cfg, resolve=True))
    device = ceilings.resolve_device(config.device)
    measured = ceilings.load_or_measure(device, config.results_dir, quick=config.quick, force=config.force)
    print(ceiling_report.format_table(measured, spec=ceilings.spec_for(measured.device_name)))
    print(f"stored: {ceilings.ceilings_path(device, config.results_dir)}")


if __name__ == "__main__":
    main()
