"""What a user reads at the end of a serving run: the figures beside what bounds them."""

from __future__ import annotations

import json
import math
from pathlib import Path

from harness.serve.metrics import SLO_COLUMNS


def summary_lines(row: dict, run_dir: Path) -> list[str]:
    """What a user reads at the end of a run: the figures beside what bounds them."""
    predicted = row["predicted_max_running"]
    return (
        [
            f"serve {row['strategy']} {row['kv_dtype']} at qps={row['qps']:g}: {row['completed']} requests in "
            f"{row['duration_s']:.1f} s ({row['num_iterations']} iterations) -> {run_dir}",
            f"  throughput   {row['output_throughput']:.1f} output tok/s, {row['request_throughput']:.2f} req/s "
            f"(goodput {row['request_goodput']:.2f} req/s: {goodput_terms(row)})",
            f"  TTFT         median {row['median_ttft_ms']:.0f} ms, p99 {row.get('p99_ttft_ms', math.nan):.0f} ms",
            f"  TPOT         median {row['median_tpot_ms']:.1f} ms, p99 {row.get('p99_tpot_ms', math.nan):.1f} ms",
            f"  concurrency  {row['max_running_requests']} running at most, measured; planner predicted "
            f"{'n/a' if predicted is None else predicted}; {row['max_concurrent_requests']} in flight at most "
            f"(queueing included); {row['total_preemptions']} preemptions",
            f"  KV pool      {row['num_blocks']} blocks of {row['block_size']} tokens "
            f"({row['kv_budget_bytes'] / 2**20:.0f} MiB), used {100 * row['mean_kv_utilization']:.0f}% on average, "
            f"{100 * row['peak_kv_utilization']:.0f}% at peak; prefix hit rate {100 * row['prefix_hit_rate']:.0f}%",
            f"  host         {row['mean_step_ms']:.1f} ms per forward, scheduler {row['mean_scheduler_ms']:.2f} ms "
            f"per iteration ({100 * row['mean_scheduler_ms'] / (row['mean_step_ms'] + row['mean_scheduler_ms']):.1f}%)",
        ]
        + _sustained(row)
        + _tiers(row)
        + _by_turn(row)
        + _accuracy(row)
    )


def _sustained(row: dict) -> list[str]:
    """Whether the run held its offered rate (harness.serve.sustained): a knee point, or why not."""
    if row.get("sustained") is None:
        return []
    achieved, offered = row.get("achieved_qps"), row.get("window_offered_qps")
    rate = "" if achieved is None else f"{achieved:.3g} req/s finished of {offered:.3g} offered in the window, "
    attained = row.get("slo_attainment")
    slo = "no SLO" if attained is None else f"SLO attainment {100 * attained:.0f}%"
    verdict = "yes" if row["sustained"] else f"no ({row['not_sustained_reason']})"
    return [f"  sustained    {verdict}: {rate}{slo} (needs {100 * row['slo_attainment_target']:.0f}%)"]


def _accuracy(row: dict) -> list[str]:
    """A lossy strategy's accuracy against exact serving (harness.serve.accuracy); none for an exact one."""
    if row.get("accuracy_tokens") is None:
        return []
    return [
        f"  accuracy     KL vs {row['accuracy_reference']} mean {row['accuracy_kl_mean']:.3g} nats, p99 "
        f"{row['accuracy_kl_p99']:.3g}, max {row['accuracy_kl_max']:.3g}; top-1 agreement "
        f"{100 * row['accuracy_top1_agreement']:.1f}% over {row['accuracy_tokens']} tokens of the first "
        f"{row['accuracy_requests']} requests, teacher-forced"
    ]


def _tiers(row: dict) -> list[str]:
    """A prefix pool's tiers (cache.host_gb, cache.disk_dir): the hits each served and the copies' speed."""
    if row.get("tier_loaded_bytes") is None:
        return []

    def gbps(name: str) -> str:
        return "n/a" if row.get(name) is None else f"{row[name]:.1f} GB/s"

    return [
        f"  tiers        hits device {100 * row['prefix_hit_rate_device']:.0f}%, host "
        f"{100 * (row['prefix_hit_rate_host'] or 0):.0f}%, disk {100 * (row['prefix_hit_rate_disk'] or 0):.0f}%; "
        f"{row['tier_loaded_bytes'] / 2**20:.1f} MiB loaded (not recomputed), {row['tier_offloaded_bytes'] / 2**20:.1f} "
        f"MiB offloaded; d2h {gbps('tier_d2h_gbps')}, h2d {gbps('tier_h2d_gbps')}, disk read {gbps('tier_disk_read_gbps')}"
    ] + _overlap(row)


def _overlap(row: dict) -> list[str]:
    """The tier loads' time and the share of it hidden (tier_overlap); none for a row written before them."""
    if row.get("tier_load_s") is None:
        return []
    mode = "overlapped" if row.get("tier_overlap") else "synchronous"
    return [f"  tier loads   {row['tier_load_s']:.3f} s, {mode}: {100 * (row['tier_load_hidden_share'] or 0):.0f}% "
            "hidden behind the forward"]  # fmt: skip


def _by_turn(row: dict) -> list[str]:
    """Chat sessions' TTFT by turn (the run row's JSON), the figure a prefix cache moves; none for other runs."""
    if not row.get("ttft_ms_by_turn"):
        return []
    turns = json.loads(row["ttft_ms_by_turn"])
    figures = ", ".join(f"{turn}: {f['p50']:.0f}/{f['p99']:.0f} ms" for turn, f in turns.items())
    return [f"  by turn      TTFT p50/p99 per turn number {figures}"]


def goodput_terms(row: dict) -> str:
    """What defines the goodput beside it: how many requests met which SLOs, or that none was given."""
    slos = [f"{name} <= {_duration(row[column])}" for column, name in SLO_COLUMNS.items() if row.get(column)]
    if not slos:
        return "no SLO given, every request counts"
    good = round(row["request_goodput"] * row["duration_s"])  # goodput = good requests / duration
    return f"{good} of {row['completed']} requests met {' and '.join(slos)}"


def _duration(ms: float) -> str:
    return f"{ms / 1e3:g} s" if ms >= 1e3 else f"{ms:g} ms"  # 10 s, 250 ms: as the SLO was likely written
