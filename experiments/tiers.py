"""Measure how fast KV blocks move between the device, the host and the disk tier, and store it with the ceilings.

    python -m experiments.tiers                                  # the small preset's blocks, best device present
    python -m experiments.tiers model=llama-3.1-8b kv_dtype=fp8_e4m3 block_tokens=[16,256]
    python -m experiments.tiers quick=true total_mb=4 repeats=2  # a smoke run: seconds

One row per (tier, direction, block size) (harness/movement/tier_bandwidth.py; columns: harness.store.tables.TIER_COLUMNS),
written to <results_dir>/tiers/bandwidth-<time>.parquet. The figures at the largest block size are stored in this
device's ceilings (<results_dir>/ceilings/<fingerprint>.json: tier_gbps), measured first if there are none. On the
CPU the device and host tier are the same RAM: the d2h and h2d rows are memory copies, and say so (same_memory).
The block files are written under disk_dir (default <results_dir>/tiers/blocks) and removed after the run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from harness.config import DEVICES, ModelConfig, check_choice, resolve_dtype, resolve_kv_dtype
from harness.device import ceiling_report, ceilings
from harness.errors import ConfigError, exit_on_config_error
from harness.formats import COMPUTE_DTYPES, KV_DTYPES
from harness.modeling.presets import PRESETS
from harness.movement import tier_bandwidth
from harness.store.tables import TIER_COLUMNS, TIER_PREFIX, TIERS_DIR, write_table

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")  # absolute: see experiments/ceilings.py
INT4_GROUP = 32  # harness.kv.base.CacheSpec's default kv_group_size: an int4 block holds whole key groups

log = logging.getLogger("kvbench")


@dataclass
class TiersConfig:
    device: str = "auto"  # auto: cuda when available, else cpu
    results_dir: str = "results"  # the table goes to <results_dir>/tiers/, the figures to <results_dir>/ceilings/
    # A preset (conf/model/, harness.modeling.presets.PRESETS): model=llama-3.1-8b. Its blocks' shapes only: no weights.
    model: ModelConfig = field(default_factory=ModelConfig)
    dtype: str = "auto"  # compute dtype the blocks belong to; auto: bf16 on cuda, fp32 on cpu (the CPU quickstart's)
    kv_dtype: str = "auto"  # storage format of the blocks: auto (= dtype), a float dtype, fp8, int8, int4
    block_tokens: list[int] = field(default_factory=lambda: [16, 64, 256, 1024])  # tokens per block, one row each
    total_mb: float = 64.0  # MiB one timed repeat moves (n_blocks blocks of the size, at least one)
    repeats: int = 5  # timed repeats behind each median
    disk_dir: str | None = None  # where the block files go; null: <results_dir>/tiers/blocks
    direct: bool = True  # O_DIRECT for the block files where the filesystem allows it
    quick: bool = False  # no timed warm-up, and quick ceilings if none are stored: for tests, not for quoting

    def __post_init__(self) -> None:
        check_choice("device", self.device, DEVICES)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device: cuda requested but no CUDA device is available; allowed here: auto, cpu")
        if isinstance(self.model, dict):
            self.model = ModelConfig(**self.model)
        check_choice("model", self.model.name, tuple(PRESETS))
        if self.model.n_kv_heads is not None:
            raise ConfigError(
                f"model.n_kv_heads: the tiers move a preset's own blocks; allowed: null, got {self.model.n_kv_heads}"
            )
        check_choice("dtype", self.dtype, ("auto", *COMPUTE_DTYPES))
        check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        tokens = list(self.block_tokens)
        if not tokens or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tokens):
            raise ConfigError(f"block_tokens: must be a non-empty list of positive integers, got {tokens}")
        if self.kv_dtype_name == "int4":
            bad = [t for t in tokens if t % INT4_GROUP and INT4_GROUP % t]
            if bad:
                raise ConfigError(
                    f"block_tokens: {bad[0]} cannot hold whole int4 key groups of {INT4_GROUP} tokens; "
                    f"allowed: a divisor or a multiple of {INT4_GROUP}"
                )
            width = cached_row_width(self.model.name)
            if width % INT4_GROUP:
                raise ConfigError(
                    f"kv_dtype: int4 needs {self.model.name}'s cached row of {width} values to be a multiple of "
                    f"{INT4_GROUP}; allowed: a float dtype, fp8_e4m3, fp8_e5m2, int8"
                )
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ConfigError(f"repeats: must be an integer >= 1, got {self.repeats!r}")
        if not self.total_mb > 0:
            raise ConfigError(f"total_mb: must be a positive number of MiB, got {self.total_mb!r}")

    @property
    def dtype_name(self) -> str:
        return resolve_dtype(self.dtype, self.device)

    @property
    def kv_dtype_name(self) -> str:
        return resolve_kv_dtype(self.kv_dtype, self.dtype_name)

    @property
    def disk_path(self) -> Path:
        return Path(self.disk_dir) if self.disk_dir is not None else Path(self.results_dir) / TIERS_DIR / "blocks"


def cached_row_width(model: str) -> int:
    """The width of one cached row of the preset (MLA: its latent), without building anything."""
    from harness.modeling.model_args import ModelArgs

    args = ModelArgs.from_name(model)
    return getattr(args, "cache_head_dim", args.head_dim)


ConfigStore.instance().store(name="tiers_config", node=TiersConfig)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="tiers")
@exit_on_config_error
def main(cfg: DictConfig) -> None:
    config = TiersConfig(**OmegaConf.to_container(cfg, resolve=True))
    device = ceilings.resolve_device(config.device)
    measured = ceilings.load_or_measure(device, config.results_dir, quick=config.quick)
    frame = tier_bandwidth.run(
        model=config.model.name,
        kv_dtype=config.kv_dtype_name,
        dtype=config.dtype_name,
        block_tokens=list(config.block_tokens),
        device=device,
        total_bytes=int(config.total_mb * 2**20),
        repeats=config.repeats,
        disk_dir=config.disk_path,
        direct=config.direct,
        ceilings_used=measured,
        quick=config.quick,
    )
    table_path = write_table(frame, TIER_COLUMNS, Path(config.results_dir) / TIERS_DIR, prefix=TIER_PREFIX)
    gbps, block_bytes, direct_io = tier_bandwidth.largest_block_figures(frame)
    ceilings_path = ceilings.ceilings_path(device, config.results_dir)
    stored = ceilings.store_tier_figures(
        ceilings_path, measured, gbps=gbps, block_bytes=block_bytes, disk_dir=config.disk_path, direct_io=direct_io
    )
    print(tier_bandwidth.format_rows(frame))
    print(ceiling_report.format_table(stored, spec=ceilings.spec_for(stored.device_name)))
    print(f"table: {table_path}")
    print(f"ceilings: {ceilings_path}")


if __name__ == "__main__":
    main()
