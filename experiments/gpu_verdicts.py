"""The GPU check's verdicts: its targets (bandwidth, paged overhead, fp8 at long context, CUDA graphs, NVML, the
serving planner's concurrency, the PD transfer) and one PASS, FAIL or N/A per target, judged from the merged rows of
scripts/gpu_check.sh's stages alone.

experiments/gpu_check.py merges the rows, calls `verdicts()` and writes them last in summary.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from harness.kv.contiguous import ContiguousCache
from harness.kv.paged import PagedCache

STAGE_COLUMN = "stage"  # the merged rows' column naming the stage that measured each
DECODE_STAGE = "decode"
# Of the row's memory roof (bw_util), at batch 1 in bf16: the measured streaming read since ceilings METHOD_VERSION 3
# (a GEMV only reads), the copy on rows measured before it; the verdict's text names which (bw_roof).
BANDWIDTH_TARGET = 0.80
PAGED_TARGET = 0.05  # paged TPOT at most 5% above contiguous, same workload
DENSE, PAGED = ContiguousCache.name, PagedCache.name  # the strategies the bandwidth and paged targets name
LONG_CONTEXT_TOKENS = 8192
NVML_COLUMNS = ("nvml_timed_samples", "energy_j_per_token", "sm_clock_mhz_min")
# The serve runs' measured max_running_requests against the planner's predicted_max_running: the burst figure is
# exact but for the decodes that start while later prompts still prefill (harness.serve.budget.predict_concurrency:
# "a few percent"), so within 5%, or one request.
CONCURRENCY_TOLERANCE = 0.05
# What makes two rows the same workload, so that they differ only in the strategy or the KV format compared.
WORKLOAD = ("model", "n_kv_heads", "dtype", "batch_size", "prompt_len", "gen_len", "prefix_len", "lengths",
            "weights", "device", "compile", "seed")  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    status: str  # PASS, FAIL or N/A
    target: str
    text: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.target}: {self.text}"


def _eager(rows: pd.DataFrame) -> pd.DataFrame:
    """kvbench's own fixed-length points without compilation: the ones whose timings compare."""
    keep = rows["compile"].fillna("none").eq("none") & rows["lengths"].fillna("fixed").eq("fixed")
    return rows[keep & rows["runner"].fillna("kvbench").eq("kvbench")]


def _latest(rows: pd.DataFrame) -> pd.DataFrame:
    return rows.sort_values("started_at", na_position="first", kind="stable")


def _not_ok(rows: pd.DataFrame) -> str:
    row = _latest(rows).iloc[-1]
    return f"the point ended {row['status']}: {' '.join(str(row['error']).split())[:120]}"


def bandwidth_verdict(rows: pd.DataFrame) -> Verdict:
    """bw_util of the contiguous bf16 batch-1 decode: the decode stage's row when there is a stage column, and of
    several the shortest context (where the weights are nearly all the bytes), then the latest."""
    target = "bandwidth"
    eager = _eager(rows)
    candidates = eager[
        eager["cache"].eq(DENSE) & eager["dtype"].eq("bf16") & eager["kv_dtype"].eq("bf16") & eager["batch_size"].eq(1)
    ]
    if candidates.empty:
        return Verdict("N/A", target, "no contiguous bf16 batch-1 decode row")
    ok = candidates[candidates["status"].eq("ok")]
    if ok.empty:
        return Verdict("FAIL", target, _not_ok(candidates))
    if STAGE_COLUMN in ok.columns and ok[STAGE_COLUMN].eq(DECODE_STAGE).any():
        ok = ok[ok[STAGE_COLUMN].eq(DECODE_STAGE)]  # the decode stage's, not the crossover's few steps at batch 1
    row = _latest(ok[ok["prompt_len"].eq(ok["prompt_len"].min())]).iloc[-1]
    if pd.isna(row["bw_util"]):
        return Verdict("FAIL", target, "bw_util is null: no measured ceilings for this device (see the ceilings stage)")
    memory = "HBM" if row["device"] == "cuda" else "memory"
    roof = row.get("bw_roof")  # read since the read roof (METHOD_VERSION 3); copy, or null, on older rows
    memory += f" {roof}" if isinstance(roof, str) else ""
    status = "PASS" if row["bw_util"] >= BANDWIDTH_TARGET else "FAIL"
    return Verdict(
        status,
        target,
        f"{row['bw_util']:.0%} of measured {memory} bandwidth at batch 1 in bf16 (target >= {BANDWIDTH_TARGET:.0%};"
        f" {row['model']}, prompt {row['prompt_len']}, TPOT {row['tpot_ms']:.3f} ms,"
        f" {row['achieved_bw_gbps']:.0f} of {row['peak_bw_gbps']:.0f} GB/s)",
    )


def _pairs(rows: pd.DataFrame, *, key: Sequence[str], column: str, first: str, second) -> list[tuple]:
    """(key values, row with column == first, row with column matching `second`) for every workload that has both,
    the latest row of each side; `second` is a value or a predicate on the row."""
    pairs = []
    for values, group in rows.groupby(list(key), dropna=False, sort=True):
        left = group[group[column].eq(first)]
        right = group[group.apply(second, axis=1)] if callable(second) else group[group[column].eq(second)]
        if not left.empty and not right.empty:
            pairs.append((values, _latest(left).iloc[-1], _latest(right).iloc[-1]))
    return pairs


def paged_verdict(rows: pd.DataFrame) -> Verdict:
    """paged TPOT against contiguous TPOT, every workload and KV format measured with both: the worst pair."""
    target = "paged-overhead"
    ok = _eager(rows)
    ok = ok[ok["status"].eq("ok") & ok["tpot_ms"].notna()]
    pairs = _pairs(ok, key=[*WORKLOAD, "kv_dtype"], column="cache", first=PAGED, second=DENSE)
    if not pairs:
        return Verdict("N/A", target, "no paged and contiguous rows of the same workload")
    ratios = [(paged["tpot_ms"] / contiguous["tpot_ms"], paged, contiguous) for _, paged, contiguous in pairs]
    ratio, paged, contiguous = max(ratios, key=lambda item: item[0])
    status = "PASS" if ratio <= 1 + PAGED_TARGET else "FAIL"
    return Verdict(
        status,
        target,
        f"paged TPOT {ratio - 1:+.1%} against contiguous at worst, of {len(pairs)} workloads (target <= "
        f"+{PAGED_TARGET:.0%}; worst: {paged['kv_dtype']} KV, batch {paged['batch_size']}, prompt "
        f"{paged['prompt_len']}: {paged['tpot_ms']:.3f} vs {contiguous['tpot_ms']:.3f} ms)",
    )


def fp8_verdict(rows: pd.DataFrame, *, long_context_tokens: int = LONG_CONTEXT_TOKENS) -> Verdict:
    """fp8_e4m3 KV against KV at the compute dtype, same strategy and workload, at prompts of at least
    long_context_tokens: faster in every pair. The fp8 rows' top-1 agreement with the exact cache is reported."""
    target = "fp8-long-context"
    ok = _eager(rows)
    ok = ok[ok["status"].eq("ok") & ok["tpot_ms"].notna() & ok["prompt_len"].ge(long_context_tokens)]
    pairs = _pairs(
        ok,
        key=[*WORKLOAD, "cache", "block_size"],
        column="kv_dtype",
        first="fp8_e4m3",
        second=lambda row: row["kv_dtype"] == row["dtype"],
    )
    if not pairs:
        return Verdict("N/A", target, f"no fp8_e4m3 and full-precision KV rows of one workload at >= "
                       f"{long_context_tokens} tokens")  # fmt: skip
    parts, faster = [], True
    for _, fp8, full in pairs:
        ratio = fp8["tpot_ms"] / full["tpot_ms"]
        faster &= bool(ratio < 1)
        agreement = "" if pd.isna(fp8["top1_agreement"]) else f", top-1 {fp8['top1_agreement']:.3f}"
        parts.append(f"{fp8['cache']} {ratio:.2f}x{agreement}")
    context = int(max(fp8["prompt_len"] for _, fp8, _ in pairs))
    return Verdict(
        "PASS" if faster else "FAIL",
        target,
        f"fp8_e4m3 TPOT / {pairs[0][2]['kv_dtype']} TPOT at {context} tokens: {'; '.join(parts)} (target < 1x)",
    )


def reduce_overhead_verdict(rows: pd.DataFrame) -> Verdict:
    """The compile=reduce-overhead row: ok, and inductor skipped CUDA graphs 0 times (cudagraph_skips)."""
    target = "reduce-overhead"
    compiled = rows[rows["compile"].eq("reduce-overhead")]
    if compiled.empty:
        return Verdict("N/A", target, "no compile=reduce-overhead row")
    row = _latest(compiled).iloc[-1]
    if row["status"] == "unsupported" and row["device"] != "cuda":
        return Verdict("N/A", target, f"unsupported on {row['device']}: {' '.join(str(row['error']).split())}")
    if row["status"] != "ok":
        return Verdict("FAIL", target, _not_ok(compiled))
    if "cudagraph_skips" not in rows.columns:
        return Verdict("N/A", target, "column missing: cudagraph_skips")
    if pd.isna(row["cudagraph_skips"]):
        return Verdict("N/A", target, "cudagraph_skips is null on the reduce-overhead row")
    skips = int(row["cudagraph_skips"])
    return Verdict(
        "PASS" if skips == 0 else "FAIL",
        target,
        f"CUDA graphs skipped {skips} times ({row['model']}, batch {row['batch_size']}, TPOT {row['tpot_ms']:.3f} "
        "ms; target 0)",
    )


def nvml_verdict(rows: pd.DataFrame) -> Verdict:
    """Every ok CUDA row read NVML inside its timed window: samples taken, energy per token and the minimum SM clock
    recorded."""
    target = "energy-clocks"
    missing = [name for name in NVML_COLUMNS if name not in rows.columns]
    if missing:
        return Verdict("N/A", target, f"column missing: {', '.join(missing)}")
    cuda = rows[rows["status"].eq("ok") & rows["device"].eq("cuda")]
    if cuda.empty:
        return Verdict("N/A", target, "no ok CUDA rows (NVML reads CUDA devices only)")
    read = cuda["nvml_timed_samples"].fillna(0).gt(0) & cuda["energy_j_per_token"].notna()
    read &= cuda["sm_clock_mhz_min"].notna()
    if read.all():
        return Verdict(
            "PASS",
            target,
            f"all {len(cuda)} ok CUDA rows sampled NVML in their timed window (at least "
            f"{int(cuda['nvml_timed_samples'].min())} samples; SM clock at least {int(cuda['sm_clock_mhz_min'].min())} MHz)",
        )
    lacking = cuda[~read]
    named = "; ".join(
        " ".join(str(row[name]) for name in (STAGE_COLUMN, "cache", "kv_dtype") if isinstance(row.get(name), str))
        + f" batch {row['batch_size']}"
        for _, row in lacking.head(3).iterrows()
    )
    return Verdict(
        "FAIL",
        target,
        f"{len(lacking)} of {len(cuda)} ok CUDA rows lack NVML samples, energy or the SM clock from the timed window "
        f"({named}{'; ...' if len(lacking) > 3 else ''})",
    )


def serve_concurrency_verdict(runs: pd.DataFrame) -> Verdict:
    """Every serve run (harness.serve.rows' run row): the pool limited the requests running at once (the planner
    predicts fewer than the stream's requests), and the most measured running is the predicted figure, within
    CONCURRENCY_TOLERANCE or one request."""
    target = "serve-concurrency"
    if runs.empty:
        return Verdict("N/A", target, "no serve run row (the serve stage finished no run)")
    parts, ok = [], True
    for _, run in runs.iterrows():
        predicted, measured = run["predicted_max_running"], run["max_running_requests"]
        if pd.isna(predicted):
            return Verdict("N/A", target, f"{run['kv_dtype']}: the planner predicts no concurrency for this pool")
        slack = max(1, int(CONCURRENCY_TOLERANCE * predicted))
        kv_limited = predicted < run["completed"]  # every request of a stream at qps=inf completes
        ok &= bool(kv_limited and abs(measured - predicted) <= slack)
        parts.append(f"{run['kv_dtype']} {measured} of {predicted}" + ("" if kv_limited else " (not KV-limited)"))
    return Verdict(
        "PASS" if ok else "FAIL",
        target,
        f"max running measured of predicted: {'; '.join(parts)} ({runs['model'].iloc[0]}, {runs['strategy'].iloc[0]}; "
        f"target: KV-limited, within {CONCURRENCY_TOLERANCE:.0%} or 1)",
    )


def pd_verdict(movement: pd.DataFrame) -> Verdict:
    """Every measured PD point moved the KV (status ok), and the decode process, from the received KV, generated
    what the colocated baseline did (outputs_match)."""
    target = "pd-transfer"
    if movement.empty or "table" not in movement.columns:
        return Verdict("N/A", target, "no PD rows (the pd stage wrote no table)")
    pd_rows = movement[movement["table"].eq("pd") & movement["source"].eq("measured")]
    if pd_rows.empty:
        return Verdict("N/A", target, "no measured PD rows")
    bad = pd_rows[pd_rows["status"].ne("ok") | pd_rows["outputs_match"].ne(True)]
    if len(bad):
        row = bad.iloc[0]
        why = (
            f"{row['status']}: {' '.join(str(row['error']).split())[:120]}"
            if row["status"] != "ok"
            else "outputs differ"
        )
        return Verdict("FAIL", target, f"{len(bad)} of {len(pd_rows)} points failed; first: {row['transport']} "
                       f"{row['kv_dtype']} at {row['context']} tokens: {why}")  # fmt: skip
    longest = pd_rows[pd_rows["context"].eq(pd_rows["context"].max())]
    speeds = "; ".join(f"{r.transport} {r.transfer_gbps:.1f} GB/s" for r in longest.itertuples())
    return Verdict(
        "PASS",
        target,
        f"all {len(pd_rows)} points moved the KV and decoded the colocated tokens; at {int(longest['context'].iloc[0])}"
        f" tokens ({int(longest['kv_bytes'].iloc[0]) / 2**20:.2f} MiB): {speeds}",
    )


def verdicts(
    rows: pd.DataFrame,
    *,
    long_context_tokens: int = LONG_CONTEXT_TOKENS,
    serve_runs: pd.DataFrame | None = None,
    movement: pd.DataFrame | None = None,
) -> list[Verdict]:
    """One verdict per target, in this order: bandwidth, paged overhead, fp8 at long context, CUDA graphs, NVML, the
    serve runs' concurrency, the PD transfer."""
    return [
        bandwidth_verdict(rows),
        paged_verdict(rows),
        fp8_verdict(rows, long_context_tokens=long_context_tokens),
        reduce_overhead_verdict(rows),
        nvml_verdict(rows),
        serve_concurrency_verdict(pd.DataFrame() if serve_runs is None else serve_runs),
        pd_verdict(pd.DataFrame() if movement is None else movement),
    ]
