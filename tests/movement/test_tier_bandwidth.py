"""The tiers experiment (harness/movement/tier_bandwidth.py, experiments/tiers.py): a row per (tier, direction, block size)
whose GB/s is its bytes over its seconds, the real disk, and the figures stored with the ceilings."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments.tiers import TiersConfig
from harness.device import ceiling_report, ceilings
from harness.device.ceilings import Ceilings
from harness.errors import ConfigError
from harness.kv import block_file
from harness.modeling.model_args import ModelArgs
from harness.movement import tier_bandwidth
from harness.store.tables import TIER_COLUMNS, TIER_PREFIX, read_tables, write_table

ROOT = Path(__file__).parents[2]
CPU = torch.device("cpu")
TINY = ModelArgs.from_name("tiny")  # 2 layers, 2 KV heads of 16 values
FIGURES = {"d2h": 3.0, "h2d": 4.0, "disk_write": 0.5, "disk_read": 1.5}


def fake_ceilings() -> Ceilings:
    """Stored ceilings of this CPU (its real fingerprint), with made-up roofs: nothing here is measured."""
    return Ceilings(
        fingerprint=ceilings.device_fingerprint(CPU),
        device="cpu",
        device_name="test cpu",
        n_threads=torch.get_num_threads(),
        n_sms=None,
        total_memory_bytes=2**30,
        peak_bw_gbps=10.0,
        read_bw_gbps=20.0,
        peak_tflops={"fp32": 0.1},
        skipped={},
        median_rse={"copy": 0.01, "read": 0.01, "fp32": 0.01},
        copy_bytes=2**26,
        matmul_n={"fp32": 256},
        repeats={"copy": 3, "read": 3, "fp32": 3},
        quick=True,
        fp32_matmul_precision="highest",
        measured_at="2026-01-01T00:00:00+00:00",
        torch_version=torch.__version__,
    )


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> pd.DataFrame:
    disk_dir = tmp_path_factory.mktemp("blocks")
    return tier_bandwidth.run(
        model="tiny",
        kv_dtype="fp32",
        dtype="fp32",
        block_tokens=[16, 64],
        device=CPU,
        total_bytes=64 * 2**10,
        repeats=2,
        disk_dir=disk_dir,
        direct=True,
        ceilings_used=fake_ceilings(),
        quick=True,
    )


def test_rows_cover_every_tier_direction_and_block_size(rows):
    covered = set(zip(rows["tier"], rows["direction"], rows["block_tokens"], strict=True))
    expected = {(tier, direction, tokens) for tier, direction in tier_bandwidth.DIRECTIONS for tokens in (16, 64)}
    assert covered == expected and len(rows) == len(expected)


def test_a_block_is_every_layer_s_k_and_v_for_its_tokens(rows):
    per_token = 2 * TINY.n_layers * TINY.n_kv_heads * TINY.head_dim * 4  # K and V, fp32
    assert (rows["block_bytes"] == rows["block_tokens"] * per_token).all()
    assert (rows["total_bytes"] == rows["block_bytes"] * rows["n_blocks"]).all()
    assert (rows["n_blocks"] == (64 * 2**10 / rows["block_bytes"]).round().clip(lower=1)).all()


def test_gbps_is_the_bytes_of_a_repeat_over_its_median_seconds(rows):
    assert ((rows["gbps"] - rows["total_bytes"] / rows["seconds"] / 1e9).abs() <= 1e-12 * rows["gbps"]).all()
    assert (rows["seconds"] > 0).all() and (rows["repeats"] == 2).all() and (rows["gbps_rse"] >= 0).all()


def test_on_the_cpu_the_host_tier_is_the_same_memory_and_not_pinned(rows):
    assert rows["same_memory"].all() and not rows["pinned"].any()


def test_disk_rows_say_o_direct_and_cold_reads_on_ext4(rows):
    disk = rows[rows["tier"] == "disk"]
    if set(disk["filesystem"]) != {"ext4"}:
        pytest.skip(f"the test's tmp is on {set(disk['filesystem'])}, not ext4")
    assert disk["direct_io"].all()
    assert disk.loc[disk["direction"] == "read", "cold_read"].all()
    assert rows.loc[rows["tier"] == "host", "direct_io"].isna().all()


def test_the_block_files_are_removed_after_the_run(rows):
    disk_dir = Path(rows["disk_dir"].dropna().iloc[0])
    assert not disk_dir.exists() and disk_dir.parent.exists()


def test_rows_carry_the_ceilings_they_sit_beside(rows):
    assert (rows["peak_read_bw_gbps"] == 20.0).all() and (rows["peak_copy_bw_gbps"] == 10.0).all()
    assert (rows["ceilings_fingerprint"] == ceilings.device_fingerprint(CPU)).all()
    assert (rows["source"] == "measured").all() and rows["run_id"].nunique() == 1


def test_the_rows_fit_the_tier_table_contract(rows, tmp_path):
    write_table(rows, TIER_COLUMNS, tmp_path, prefix=TIER_PREFIX)
    back = read_tables(tmp_path, prefix=TIER_PREFIX, columns=TIER_COLUMNS)
    assert len(back) == len(rows) and list(back.columns) == [c.name for c in TIER_COLUMNS]


def test_the_largest_block_gives_the_ceilings_figures(rows):
    gbps, block_bytes, direct_io = tier_bandwidth.largest_block_figures(rows)
    largest = rows[rows["block_tokens"] == 64].set_index("direction")["gbps"]
    assert gbps == {"d2h": largest["d2h"], "h2d": largest["h2d"], "disk_write": largest["write"],
                    "disk_read": largest["read"]}  # fmt: skip
    assert block_bytes == rows.loc[rows["block_tokens"] == 64, "block_bytes"].iloc[0]


def test_a_quantized_block_carries_its_scales():
    shape = tier_bandwidth.block_shape(TINY, kv_dtype="int8", dtype="fp32", block_tokens=16)
    assert set(shape.parts) == {"k", "v", "k_scale", "v_scale"}
    data = 2 * TINY.n_layers * TINY.n_kv_heads * 16 * TINY.head_dim  # int8 codes, a byte each
    scales = 2 * TINY.n_layers * TINY.n_kv_heads * 16 * 4  # an fp32 scale per token, head and side
    assert shape.block_bytes == data + scales


def test_the_printed_table_says_the_cpu_host_figures_are_memory_copies(rows):
    text = tier_bandwidth.format_rows(rows)
    assert "same RAM" in text and "memory copies" in text and "d2h" in text and "ext4" in text


def test_stored_tier_figures_keep_every_other_field(tmp_path):
    path = tmp_path / "c.json"
    before = fake_ceilings()
    stored = ceilings.store_tier_figures(path, before, gbps=FIGURES, block_bytes=4096, disk_dir="/d", direct_io=True)
    loaded = Ceilings.from_json(path.read_text())
    assert loaded == stored and loaded.tier_gbps == FIGURES and loaded.tier_block_bytes == 4096
    assert dataclasses.replace(loaded, **ceilings.tier_fields(before)) == before
    assert ceilings.tier_gbps(loaded, "disk_read") == 1.5 and not list(tmp_path.glob(".*"))


def test_ceilings_stored_before_the_tier_fields_still_load():
    old = json.loads(fake_ceilings().to_json())
    for name in ("tier_gbps", "tier_block_bytes", "tier_disk_dir", "tier_direct_io"):
        del old[name]
    loaded = Ceilings.from_json(json.dumps(old))
    assert loaded.tier_gbps == {} and loaded.tier_direct_io is None
    assert ceilings.tier_gbps(loaded, "disk_read") is None and "tier " not in ceiling_report.format_table(loaded)


def test_format_table_shows_the_tier_lines_as_measured(tmp_path):
    stored = ceilings.store_tier_figures(
        tmp_path / "c.json", fake_ceilings(), gbps=FIGURES, block_bytes=4096, disk_dir="/d", direct_io=True
    )
    text = ceiling_report.format_table(stored)
    for name in FIGURES:
        assert f"tier {name} GB/s" in text
    assert "measured: 4096 B blocks" in text and "O_DIRECT" in text


def test_an_unknown_tier_figure_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown figure 'disk'"):
        ceilings.store_tier_figures(tmp_path / "c.json", fake_ceilings(), gbps={"disk": 1.0}, block_bytes=1,
                                    disk_dir="/d", direct_io=True)  # fmt: skip


def test_measuring_the_ceilings_again_keeps_the_tier_figures(tmp_path, monkeypatch):
    path = ceilings.ceilings_path(CPU, tmp_path)
    ceilings.store_tier_figures(path, fake_ceilings(), gbps=FIGURES, block_bytes=4096, disk_dir="/d", direct_io=True)
    monkeypatch.setattr(ceilings, "measure", lambda device, quick=False: fake_ceilings())
    again = ceilings.load_or_measure(CPU, tmp_path, quick=True, force=True)
    assert again.tier_gbps == FIGURES and Ceilings.from_json(path.read_text()).tier_gbps == FIGURES


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"block_tokens": [0]}, "block_tokens"),
        ({"block_tokens": []}, "block_tokens"),
        ({"repeats": 0}, "repeats"),
        ({"total_mb": 0}, "total_mb"),
        ({"model": {"name": "gpt-5"}}, "model"),
        ({"model": {"name": "tiny", "n_kv_heads": 1}}, "model.n_kv_heads"),
        ({"kv_dtype": "int3"}, "kv_dtype"),
        ({"device": "tpu"}, "device"),
        ({"kv_dtype": "int4", "block_tokens": [48]}, "block_tokens"),
        ({"kv_dtype": "int4", "model": {"name": "tiny"}}, "kv_dtype"),  # 16-value rows: no whole group of 32
    ],
)
def test_a_bad_config_value_is_one_line_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as caught:
        TiersConfig(**overrides)
    assert str(caught.value).startswith(f"{field}: ") and "\n" not in str(caught.value)


def test_auto_dtypes_resolve_as_the_cpu_quickstart_s():
    config = TiersConfig(device="cpu")
    assert config.dtype_name == "fp32" and config.kv_dtype_name == "fp32"
    assert TiersConfig(device="cpu", dtype="bf16", kv_dtype="fp8_e4m3").kv_dtype_name == "fp8_e4m3"


def tiers_app(*overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.tiers", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_app_writes_the_table_and_stores_the_figures_with_the_ceilings(tmp_path):
    path = ceilings.ceilings_path(CPU, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(fake_ceilings().to_json())  # stored: the app does not measure the ceilings again
    proc = tiers_app(
        "device=cpu", "model=tiny", "block_tokens=[16]", "total_mb=0.0625", "repeats=2", "quick=true",
        f"results_dir={tmp_path}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    tables = list((tmp_path / "tiers").glob(f"{TIER_PREFIX}*.parquet"))
    assert len(tables) == 1 and f"table: {tables[0]}" in proc.stdout and f"ceilings: {path}" in proc.stdout
    assert len(pd.read_parquet(tables[0])) == len(tier_bandwidth.DIRECTIONS)
    stored = Ceilings.from_json(path.read_text())
    assert set(stored.tier_gbps) == set(ceilings.TIER_FIGURES) and stored.peak_bw_gbps == 10.0
    assert "tier disk_read GB/s" in proc.stdout and "memory copies" in proc.stdout
    assert not list((tmp_path / "tiers" / "blocks").rglob(f"*{block_file.FILE_SUFFIX}"))


def test_the_app_rejects_bad_block_tokens_in_one_line_writing_nothing(tmp_path):
    proc = tiers_app("block_tokens=[0]", f"results_dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "kvbench: bad config: block_tokens: must be a non-empty list of positive integers, got [0]"
    )
    assert not list(tmp_path.rglob("*.json")) and not list(tmp_path.rglob("*.parquet"))
