"""The GPU check's Python half: how long each stage should take, and what the stages' rows say.

scripts/gpu_check.sh runs the stages (each a command under its own time limit) and leaves their rows under a scratch
folder; this module sizes them beforehand and judges them afterwards:

    python -m experiments.gpu_check plan       # each stage: its limit in the script, points, predicted seconds
    python -m experiments.gpu_check report --work DIR --out DIR [--long-context-tokens 8192] [--dry]

`report` merges every stage's rows into one parquet (a `stage` column says whose), the profiler tables into another,
copies the stored ceilings, and writes summary.md: the machine, each stage's exit status and seconds, the key rows,
and last one verdict line per target (PASS, FAIL or N/A), computed by `verdicts()` from the rows alone.

The sizing (each stage's predicted seconds, upper bounds, not figures to quote) is experiments/sizing.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from experiments.sizing import (
    H200,
    ROOT,
    STAGE_PRESETS,
    Gpu,
    preset_points,
    stage_limits,
    stage_predictions,
)
from harness import crossover
from harness.errors import exit_on_config_error
from harness.kv.contiguous import ContiguousCache
from harness.kv.paged import PagedCache
from harness.store import disk

SCRIPT = ROOT / "scripts" / "gpu_check.sh"

# --- verdicts ------------------------------------------------------------------------------------------------------

STAGE_COLUMN = "stage"  # the merged rows' column naming the stage that measured each
DECODE_STAGE = "decode"
# Of the row's memory roof (bw_util), at batch 1 in bf16: the measured streaming read since ceilings METHOD_VERSION 3
# (a GEMV only reads), the copy on rows measured before it; the verdict's text names which (bw_roof).
BANDWIDTH_TARGET = 0.80
PAGED_TARGET = 0.05  # paged TPOT at most 5% above contiguous, same workload
DENSE, PAGED = ContiguousCache.name, PagedCache.name  # the strategies the bandwidth and paged targets name
LONG_CONTEXT_TOKENS = 8192
NVML_COLUMNS = ("nvml_timed_samples", "energy_j_per_token", "sm_clock_mhz_min")
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


def verdicts(rows: pd.DataFrame, *, long_context_tokens: int = LONG_CONTEXT_TOKENS) -> list[Verdict]:
    """One verdict per target, in this order: bandwidth, paged overhead, fp8 at long context, CUDA graphs, NVML."""
    return [
        bandwidth_verdict(rows),
        paged_verdict(rows),
        fp8_verdict(rows, long_context_tokens=long_context_tokens),
        reduce_overhead_verdict(rows),
        nvml_verdict(rows),
    ]


# --- the report ----------------------------------------------------------------------------------------------------

KEY_COLUMNS = (
    (STAGE_COLUMN, "{}"), ("status", "{}"), ("model", "{}"), ("cache", "{}"), ("kv_dtype", "{}"), ("compile", "{}"),
    ("attn_backend", "{}"), ("batch_size", "{}"), ("prompt_len", "{}"), ("gen_len", "{}"), ("tpot_ms", "{:.3f}"),
    ("predicted_tpot_ms", "{:.3f}"), ("bw_util", "{:.2f}"), ("ttft_ms", "{:.1f}"), ("decode_tok_s", "{:.0f}"),
    ("top1_agreement", "{:.3f}"), ("peak_mem_bytes", "GiB"), ("energy_j_per_token", "{:.3f}"),
    ("sm_clock_mhz_min", "{}"), ("cudagraph_skips", "{}"),
)  # fmt: skip


def stage_dirs(work: Path) -> list[Path]:
    """The stages' results folders under work/stages, in the order the stages ran (stages.tsv), then any other."""
    found = sorted(p for p in (work / "stages").glob("*") if p.is_dir())
    order = {name: i for i, name in enumerate(read_stages(work)["stage"])}
    return sorted(found, key=lambda p: (order.get(p.name, len(order)), p.name))


def merge_rows(work: Path) -> pd.DataFrame:
    """Every row of every stage (harness.store.disk.load of each stage's folder), with the stage's name beside it: the
    stages in the order they ran, each stage's rows in the order they were measured."""
    frames = [
        disk.load(folder).sort_values("started_at", kind="stable").assign(**{STAGE_COLUMN: folder.name})
        for folder in stage_dirs(work)
    ]
    frames = [frame for frame in frames if not frame.empty]
    if not frames:
        return disk.load(work / "stages").assign(**{STAGE_COLUMN: pd.Series(dtype="string")})
    return pd.concat(frames, ignore_index=True)


def merge_ops(work: Path) -> pd.DataFrame:
    """Every profiler top-ops table (harness.store.disk.load_ops) of every stage, with the stage's name beside it."""
    frames = [disk.load_ops(folder).assign(**{STAGE_COLUMN: folder.name}) for folder in stage_dirs(work)]
    frames = [frame for frame in frames if len(frame)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def read_stages(work: Path) -> pd.DataFrame:
    """stages.tsv, one line per stage the script ran: stage, limit_s, exit, seconds (exit 124: ran out of time)."""
    path = work / "stages.tsv"
    if not path.is_file():
        return pd.DataFrame(columns=["stage", "limit_s", "exit", "seconds"])
    return pd.read_csv(path, sep="\t", dtype={"stage": str})


def machine_lines() -> list[str]:
    """The machine: nvidia-smi -L, the driver, torch, CUDA, triton and Python versions."""
    import platform

    import torch

    from harness.environment import nvidia_driver_version

    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        smi = f"(nvidia-smi: {exc.__class__.__name__})"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return [
        f"- nvidia-smi -L: {smi or '(no GPU listed)'}",
        f"- device: {device}; driver {nvidia_driver_version() or '-'}; CUDA (torch build) {torch.version.cuda or '-'}",
        f"- torch {torch.__version__}; triton {triton_version}; Python {platform.python_version()} on "
        f"{platform.node()}",
    ]


def _cell(value: object, fmt: str) -> str:
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return "-"
    if fmt == "GiB":
        return f"{value / 2**30:.1f}"
    return fmt.format(value)


def key_rows_table(rows: pd.DataFrame) -> str:
    """The rows' key columns (those present), fixed width, one line per row; errors listed under it."""
    if rows.empty:
        return "(no rows)"
    columns = [(name, fmt) for name, fmt in KEY_COLUMNS if name in rows.columns]
    table = pd.DataFrame({name: [_cell(v, fmt) for v in rows[name]] for name, fmt in columns})
    table = table.rename(columns={"peak_mem_bytes": "peak_GiB", "batch_size": "batch", "prompt_len": "prompt"})
    lines = [table.to_string(index=False)]
    for _, row in rows[rows["status"].ne("ok")].iterrows():
        lines.append(f"{row[STAGE_COLUMN]} {row['cache']} {row['kv_dtype']} batch {row['batch_size']} prompt "
                     f"{row['prompt_len']}: {row['status']}: {' '.join(str(row['error']).split())[:200]}")  # fmt: skip
    return "\n".join(lines)


def summary_markdown(
    *,
    machine: Sequence[str],
    stages: pd.DataFrame,
    predicted: dict[str, float],
    rows: pd.DataFrame,
    found: Sequence[Verdict],
    dry: bool,
    long_context_tokens: int,
) -> str:
    """summary.md: the machine, the stages, the key rows and the crossover's knee, then the verdicts, one a line, last."""
    lines = ["# kvbench GPU check", ""]
    if dry:
        lines += [
            f"Dry run (GPU_CHECK_DRY=1): the same stages on the CPU at tiny sizes; long context = {long_context_tokens}"
            " tokens. The verdicts check the pipeline, not the targets.",
            "",
        ]
    lines += ["## Machine", "", *machine, "", "## Stages", "", "```"]
    table = stages.assign(predicted_s=[predicted.get(name) for name in stages["stage"]])
    table["predicted_s"] = [_cell(v, "{:.0f}") for v in table["predicted_s"]]
    lines += [table.to_string(index=False) if len(table) else "(no stages ran)", "```", ""]
    lines += ["## Key rows", "", "```", key_rows_table(rows), "```", ""]
    knees = crossover.knee_table(rows) if not rows.empty else pd.DataFrame()
    if not knees.empty:
        lines += ["## Crossover: observed knee beside the predicted B*", "", "```", knees.to_string(index=False), "```",
                  ""]  # fmt: skip
    lines += ["## Verdicts", "", *(verdict.line() for verdict in found)]
    return "\n".join(lines) + "\n"


def write_report(*, work: Path, out: Path, dry: bool, long_context_tokens: int) -> list[Verdict]:
    """rows.parquet, ops.parquet (when a stage profiled), ceilings.json (when measured) and summary.md into out.

    The figures first, summary.md next, the stages' predicted seconds (a few Hydra composes) last, rewriting it: a
    report cut short by its time limit still leaves the rows and the verdicts behind."""
    out.mkdir(parents=True, exist_ok=True)
    rows = merge_rows(work)
    rows.to_parquet(out / "rows.parquet", index=False)
    ops = merge_ops(work)
    if len(ops):
        ops.to_parquet(out / "ops.parquet", index=False)
    stored = {path.stem: json.loads(path.read_text()) for path in sorted((work / "store" / "ceilings").glob("*.json"))}
    if stored:
        (out / "ceilings.json").write_text(json.dumps(stored, indent=2) + "\n")
    found = verdicts(rows, long_context_tokens=long_context_tokens)
    summary = dict(machine=machine_lines(), stages=read_stages(work), rows=rows, found=found, dry=dry,
                   long_context_tokens=long_context_tokens)  # fmt: skip
    (out / "summary.md").write_text(summary_markdown(predicted={}, **summary))
    if not dry:  # the GPU's predictions beside a CPU run's seconds would only mislead
        try:
            predicted = stage_predictions(gpu=H200)
        except Exception as exc:  # a courtesy: never lose the summary to it
            print(f"gpu_check: no predicted seconds in summary.md: {exc}", file=sys.stderr)
        else:
            (out / "summary.md").write_text(summary_markdown(predicted=predicted, **summary))
    return found


# --- CLI -----------------------------------------------------------------------------------------------------------


def plan_table(*, gpu: Gpu = H200) -> pd.DataFrame:
    """Every stage of the script: its limit, its points (preset stages) and its predicted seconds on `gpu`."""
    limits = stage_limits(SCRIPT.read_text())
    predicted = stage_predictions(gpu=gpu)
    points = {stage: len(preset_points(preset)) for stage, preset in STAGE_PRESETS.items()}
    lines = [
        {
            "stage": stage,
            "limit_s": limit,
            "points": points.get(stage),
            "predicted_s": round(predicted[stage]) if stage in predicted else None,
        }
        for stage, limit in limits.items()
    ]
    return pd.DataFrame(lines).astype({"points": "Int64", "predicted_s": "Int64"})


@exit_on_config_error  # plan composes every preset the script runs: a bad one is a line, not a traceback
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("plan", help="each stage of scripts/gpu_check.sh: limit, points, predicted seconds (H200)")
    report = commands.add_parser("report", help="merge the stages' rows into --out and write summary.md")
    report.add_argument("--work", type=Path, required=True, help="the script's scratch folder (stages/, store/)")
    report.add_argument("--out", type=Path, required=True, help="where rows.parquet, summary.md, ... go")
    report.add_argument("--long-context-tokens", type=int, default=LONG_CONTEXT_TOKENS,
                        help="prompts at least this long count as long context (fp8 verdict)")  # fmt: skip
    report.add_argument("--dry", action="store_true", help="a CPU dry run: said so in summary.md")
    args = parser.parse_args(argv)
    if args.command == "plan":
        table = plan_table()
        print(table.to_string(index=False))
        print(f"sum of limits: {table['limit_s'].sum()} s; sum of predictions: {table['predicted_s'].sum():.0f} s")
        return 0
    found = write_report(work=args.work, out=args.out, dry=args.dry, long_context_tokens=args.long_context_tokens)
    print("\n".join(verdict.line() for verdict in found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
