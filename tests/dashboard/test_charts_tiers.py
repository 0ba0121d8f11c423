"""The KV tiers & transfer charts (dashboard/charts/tiers.py, transfer.py) on synthetic frames in the contracts:
tier-bandwidth and PD-transfer tables with every TIER_COLUMNS / PD_COLUMNS column, and prefix-reuse decode rows."""

from __future__ import annotations

import dataclasses
import math
import types

import pandas as pd
import pytest

from dashboard.charts.common import MissingColumns
from dashboard.charts.tiers import (
    crossing,
    prefix_caption,
    prefix_reuse_rows,
    prefix_workloads,
    tier_bandwidth,
    tier_caption,
    ttft_by_prefix_source,
)
from dashboard.charts.transfer import pd_caption, pd_step_crossings, pd_transfer, pd_ttft
from harness import kv
from harness.kv import KVCache, Layout, Serving
from harness.store.tables import PD_COLUMNS, TIER_COLUMNS
from tests.dashboard.charts_rows import annotation_texts, frame, point, trace, trace_names

BLOCK_TOKENS = 16
BLOCK_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 2  # K and V, 4 layers, 2 KV heads, head_dim 64, bf16
SIZES = (1, 4, 16)  # blocks per moved block group: block_bytes grows with them
PCIE = "extrapolated: PCIe 5.0 x16 64 GB/s per direction (PCI-SIG PCIe 5.0 base spec)"


def tier_row(**overrides) -> dict:
    block_bytes = overrides.pop("blocks", 1) * BLOCK_TOKENS * BLOCK_BYTES_PER_TOKEN
    row = dict(
        run_id="tiers-1",
        device="cpu",
        device_name="AMD EPYC",
        model="small",
        kv_dtype="fp32",
        tier="host",
        direction="d2h",
        block_tokens=BLOCK_TOKENS,
        block_bytes=block_bytes,
        n_blocks=64,
        total_bytes=64 * block_bytes,
        seconds=64 * block_bytes / 10e9,
        gbps=10.0,
        gbps_rse=0.02,
        repeats=9,
        pinned=False,
        same_memory=True,
        direct_io=None,
        cold_read=None,
        disk_dir=None,
        filesystem=None,
        peak_read_bw_gbps=25.0,
        peak_copy_bw_gbps=18.0,
        ceilings_fingerprint="abc123",
        source="measured",
        started_at="2026-12-01T10:00:00+00:00",
    )
    return row | overrides


def tier_table(*rows: dict) -> pd.DataFrame:
    table = pd.DataFrame(list(rows))
    assert list(table.columns) == [c.name for c in TIER_COLUMNS]  # the synthetic rows follow the contract
    return table


def a_cpu_tiers_run() -> pd.DataFrame:
    rows = []
    for blocks, host_gbps, disk_gbps in zip(SIZES, (8.0, 12.0, 14.0), (0.5, 1.5, 2.5), strict=True):
        rows.append(tier_row(blocks=blocks, direction="d2h", gbps=host_gbps))
        rows.append(tier_row(blocks=blocks, direction="h2d", gbps=host_gbps * 0.9))
        disk = dict(tier="disk", direct_io=True, cold_read=True, disk_dir="/tmp/kv", filesystem="ext4")
        rows.append(tier_row(blocks=blocks, direction="write", gbps=disk_gbps * 0.8, **disk))
        rows.append(tier_row(blocks=blocks, direction="read", gbps=disk_gbps, **disk))
    return tier_table(*rows)


# -------------------------------------------------------------------------------------------------- tier bandwidth


def test_tier_bandwidth_draws_a_line_per_tier_and_direction_and_both_measured_ceilings():
    fig = tier_bandwidth(a_cpu_tiers_run())
    assert trace_names(fig) == [
        "disk read (O_DIRECT)",
        "disk write (O_DIRECT)",
        "host d2h (RAM copy)",
        "host h2d (RAM copy)",
        "device read ceiling (measured, peak_read_bw_gbps)",
        "device copy ceiling (measured, peak_copy_bw_gbps)",
    ]
    disk_read = trace(fig, "disk read (O_DIRECT)")
    assert list(disk_read.x) == [b * BLOCK_TOKENS * BLOCK_BYTES_PER_TOKEN for b in SIZES]
    assert list(disk_read.y) == [0.5, 1.5, 2.5]
    assert list(trace(fig, "device read ceiling (measured, peak_read_bw_gbps)").y) == [25.0, 25.0]
    assert fig.layout.xaxis.type == "log"


def test_tier_bandwidth_hover_carries_block_tokens_and_direct_io():
    line = trace(tier_bandwidth(a_cpu_tiers_run()), "disk read (O_DIRECT)")
    assert [list(point)[0] for point in line.customdata] == [str(BLOCK_TOKENS)] * 3
    assert [list(point)[3] for point in line.customdata] == ["True"] * 3
    assert "block_tokens" in line.hovertemplate and "direct_io" in line.hovertemplate


def test_on_the_cpu_the_title_and_caption_say_d2h_and_h2d_are_ram_copies():
    table = a_cpu_tiers_run()
    assert "memory copies" in tier_bandwidth(table).layout.title.text
    assert "memory copies" in tier_caption(table) and "every figure is measured" in tier_caption(table)
    on_a_gpu = table.assign(device="cuda", same_memory=False, pinned=True)
    assert "memory copies" not in tier_bandwidth(on_a_gpu).layout.title.text
    assert "memory copies" not in tier_caption(on_a_gpu)


def test_an_empty_tier_table_draws_a_message_and_a_table_without_gbps_is_missing_columns():
    empty = tier_table(tier_row()).iloc[0:0]
    assert annotation_texts(tier_bandwidth(empty)) == ["no tier rows with a GB/s"]
    with pytest.raises(MissingColumns, match="gbps"):
        tier_bandwidth(a_cpu_tiers_run().drop(columns="gbps"))


# ------------------------------------------------------------------------------------------ TTFT by prefix source

PREFIXES = (256, 1024, 4096)
SUFFIX = 64


def prefix_point(prefix_len: int, *, disk: float, miss: float, **overrides) -> dict:
    return point(
        cache=overrides.pop("cache", "prefix"),
        device="cpu",
        prefix_len=prefix_len,
        prompt_len=overrides.pop("prompt_len", prefix_len + SUFFIX),
        ttft_ms=5.0,
        ttft_host_ms=8.0,
        ttft_disk_ms=disk,
        ttft_miss_ms=miss,
        prefix_source="disk",
        prefix_disk_read_gbps=2.0,
        predicted_prefix_load_ms=prefix_len * 0.01,
        predicted_prefix_compute_ms=prefix_len * 0.02,
        **overrides,
    )


def prefix_sweep(disks=(30.0, 60.0, 150.0), misses=(20.0, 80.0, 400.0), **overrides) -> pd.DataFrame:
    points = zip(PREFIXES, disks, misses, strict=True)
    return frame(*(prefix_point(p, disk=d, miss=m, **overrides) for p, d, m in points))


def test_ttft_by_prefix_source_draws_each_measured_source_solid_and_the_analytic_lines_dashed():
    fig = ttft_by_prefix_source(prefix_sweep())
    assert trace_names(fig) == [
        "device hit (ttft_ms)",
        "host tier (ttft_host_ms)",
        "disk tier (ttft_disk_ms)",
        "recompute (ttft_miss_ms)",
        "analytic: load the prefix from disk",
        "analytic: compute the prefix",
    ]
    assert list(trace(fig, "disk tier (ttft_disk_ms)").x) == list(PREFIXES)
    assert list(trace(fig, "recompute (ttft_miss_ms)").y) == [20.0, 80.0, 400.0]
    dashes = {t.name: t.line.dash for t in fig.data}
    assert [name for name, dash in dashes.items() if dash == "dash"] == [
        "analytic: load the prefix from disk",
        "analytic: compute the prefix",
    ]


def test_the_disk_beats_recompute_crossover_is_annotated_where_the_lines_cross_linearly():
    rows = prefix_sweep()
    # disk - recompute: +10 at 256, -20 at 1024: the gap closes a third of the way from 256 to 1024
    gap_before, gap_after = 30.0 - 20.0, 60.0 - 80.0
    expected = 256 + (1024 - 256) * gap_before / (gap_before - gap_after)
    fig = ttft_by_prefix_source(rows)
    (line,) = fig.layout.shapes
    assert line.x0 == pytest.approx(expected) and line.x1 == pytest.approx(expected)
    (annotation,) = fig.layout.annotations
    assert annotation.x == pytest.approx(math.log10(expected))  # a log axis places annotations by log10
    assert f"≈ {round(expected)} tokens" in annotation.text and "between 256 and 1024" in annotation.text
    assert f"Measured crossover: disk beats recompute from ≈ {round(expected)} tokens" in prefix_caption(rows)
    # the analytic times: load 0.01 ms/token, compute 0.02: loading beats computing from the shortest prefix
    assert "Analytic crossover: no crossover found: loading beats computing already" in prefix_caption(rows)


def test_no_crossover_when_recompute_stays_faster_is_said_not_drawn():
    rows = prefix_sweep(disks=(30.0, 90.0, 500.0))
    fig = ttft_by_prefix_source(rows)
    assert not fig.layout.shapes
    assert annotation_texts(fig) == ["no crossover found: recompute wins up to the longest context measured (4096)"]


def test_crossing_interpolates_between_the_adjacent_points_that_straddle():
    x = pd.Series([100.0, 200.0, 400.0])
    assert crossing(x, pd.Series([5.0, 3.0, 1.0]), pd.Series([2.0, 2.0, 2.0])) == pytest.approx(300.0)
    assert crossing(x, pd.Series([1.0, 1.0, 1.0]), pd.Series([2.0, 2.0, 2.0])) is None


def test_ttft_by_prefix_source_draws_one_workload_and_the_selector_names_each():
    rows = pd.concat([prefix_sweep(), prefix_sweep(kv_dtype="int8", misses=(10.0, 40.0, 900.0))], ignore_index=True)
    assert sorted(set(prefix_workloads(rows))) == ["bf16", "int8"]
    fig = ttft_by_prefix_source(rows, workload="int8")
    assert list(trace(fig, "recompute (ttft_miss_ms)").y) == [10.0, 40.0, 900.0]


def test_a_sweep_with_a_fixed_prompt_is_one_workload_and_one_line():
    # as experiment=prefix-reuse: the prompt stays fixed and the prefix grows into it, so the suffix shrinks
    rows = frame(*(prefix_point(p, disk=30.0, miss=40.0, prompt_len=4160) for p in PREFIXES))
    assert set(prefix_workloads(rows)) == {"all rows"}
    assert list(trace(ttft_by_prefix_source(rows), "disk tier (ttft_disk_ms)").x) == list(PREFIXES)
    mixed = pd.concat([rows, prefix_sweep()], ignore_index=True)  # prompts and suffixes both vary: told apart
    assert len(set(prefix_workloads(mixed))) > 1


def test_no_prefix_rows_draw_a_message():
    fig = ttft_by_prefix_source(frame(point(cache="contiguous", prefix_len=0)))
    assert annotation_texts(fig) == ["no prefix-reuse rows"]


# ---------------------------------------------------------------------------------------------- PD transfer

CONTEXTS = (512, 2048, 8192)
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 2  # K and V, 4 layers, 2 KV heads, head_dim 64, bf16


def pd_row(transport: str, context: int, *, transfer_ms: float, tpot_ms: float = 4.0, **overrides) -> dict:
    kv_bytes = context * KV_BYTES_PER_TOKEN
    row = dict(
        run_id="pd-1",
        model="small",
        weights=None,
        device="cpu",
        device_name="AMD EPYC",
        dtype="bf16",
        kv_dtype="bf16",
        context=context,
        batch_size=1,
        transport=transport,
        source="measured",
        kv_bytes=kv_bytes,
        transfer_ms=transfer_ms,
        transfer_gbps=kv_bytes / transfer_ms / 1e6,
        transfer_samples_ms=[transfer_ms] * 3,
        prefill_ms=context * 0.05,
        first_step_ms=tpot_ms,
        ttft_pd_ms=context * 0.05 + transfer_ms + tpot_ms,
        ttft_colocated_ms=context * 0.05 + tpot_ms,
        tpot_ms=tpot_ms,
        transfer_over_step=transfer_ms / tpot_ms,
        outputs_match=True,
        repeats=3,
        status="ok",
        error=None,
        started_at="2026-12-01T11:00:00+00:00",
    )
    return row | overrides


def pd_table(*rows: dict) -> pd.DataFrame:
    table = pd.DataFrame(list(rows))
    assert list(table.columns) == [c.name for c in PD_COLUMNS]
    return table


def a_pd_run(**overrides) -> pd.DataFrame:
    rows = []
    for context, tcp_ms, shm_ms in zip(CONTEXTS, (2.0, 6.0, 20.0), (0.5, 1.0, 3.0), strict=True):
        rows.append(pd_row("tcp", context, transfer_ms=tcp_ms, **overrides))
        rows.append(pd_row("shm", context, transfer_ms=shm_ms, **overrides))
        pcie_ms = context * KV_BYTES_PER_TOKEN / 64e9 * 1e3
        rows.append(pd_row("pcie5-x16", context, transfer_ms=pcie_ms, source=PCIE, outputs_match=None, **overrides))
    return pd_table(*rows)


def test_pd_transfer_draws_measured_transports_solid_and_extrapolated_links_dashed_and_labelled():
    fig = pd_transfer(a_pd_run())
    assert trace_names(fig) == ["pcie5-x16 (extrapolated)", "shm", "tcp", "one decode step (tpot_ms, measured)"]
    assert trace(fig, "pcie5-x16 (extrapolated)").line.dash == "dash"
    assert trace(fig, "tcp").line.dash is None and trace(fig, "shm").line.dash is None
    assert list(trace(fig, "tcp").x) == list(CONTEXTS) and list(trace(fig, "tcp").y) == [2.0, 6.0, 20.0]
    assert list(trace(fig, "one decode step (tpot_ms, measured)").y) == [4.0, 4.0, 4.0]


def test_pd_transfer_draws_the_chosen_kv_dtype_only():
    table = pd.concat([a_pd_run(), a_pd_run(kv_dtype="fp8", tpot_ms=3.0)], ignore_index=True)
    fig = pd_transfer(table, workload="fp8")
    assert list(trace(fig, "one decode step (tpot_ms, measured)").y) == [3.0, 3.0, 3.0]


def test_pd_step_crossings_give_the_context_where_a_transfer_outlasts_a_step():
    crossings = pd_step_crossings(a_pd_run()).set_index("transport")
    # tcp over a 4 ms step: 0.5 at 512, 1.5 at 2048: the ratio reaches 1 half-way between them
    expected = 512 + (2048 - 512) * (1 - 0.5) / (1.5 - 0.5)
    assert crossings.loc["tcp", "outlasts_step_from"] == pytest.approx(expected)
    assert math.isnan(crossings.loc["shm", "outlasts_step_from"])  # 3 ms at 8192: never over a 4 ms step
    assert "a decode step outlasts the transfer up to the longest" in crossings.loc["shm", "note"]
    assert crossings.loc["pcie5-x16 (extrapolated)", "source"] == PCIE


def test_pd_ttft_draws_disaggregated_per_transport_against_colocated():
    fig = pd_ttft(a_pd_run())
    assert trace_names(fig) == ["pcie5-x16 (extrapolated)", "shm", "tcp", "colocated (ttft_colocated_ms, measured)"]
    assert trace(fig, "pcie5-x16 (extrapolated)").line.dash == "dash"
    assert list(trace(fig, "tcp").y) == [512 * 0.05 + 2.0 + 4.0, 2048 * 0.05 + 6.0 + 4.0, 8192 * 0.05 + 20.0 + 4.0]


def test_pd_caption_names_the_measured_transports_and_each_links_datasheet():
    text = pd_caption(a_pd_run())
    assert "Measured (solid): shm, tcp" in text and f"pcie5-x16: {PCIE}" in text


def test_an_empty_pd_table_draws_a_message():
    empty = a_pd_run().iloc[0:0]
    assert annotation_texts(pd_transfer(empty)) == ["no ok rows"]
    assert annotation_texts(pd_ttft(empty)) == ["no ok rows"]
    assert pd_step_crossings(empty).empty


def test_the_prefix_rows_are_those_of_a_strategy_whose_serving_declares_it_shares_a_prefix():
    @dataclasses.dataclass(frozen=True)
    class Options:
        pass

    plugin = types.ModuleType("plugin_radix")
    plugin.Options, plugin.STRATEGY, plugin.LAYOUT = Options, KVCache, Layout
    plugin.SERVING = Serving(pool="blocks", storage="paged", shares_prefix=True)
    rows = frame(
        prefix_point(256, disk=30.0, miss=20.0),
        prefix_point(256, disk=30.0, miss=20.0, cache="radix"),
        prefix_point(256, disk=30.0, miss=20.0, cache="paged"),  # it shares nothing: a prefix_len is not enough
        prefix_point(256, disk=30.0, miss=20.0, cache="gone"),  # no strategy of that name here
    )
    kv.register("radix", plugin)
    try:
        assert prefix_reuse_rows(rows)["cache"].tolist() == ["prefix", "radix"]
    finally:
        kv.unregister("radix")
