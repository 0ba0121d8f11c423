"""The GPU check's Python half: how long each stage should take, and what the stages' rows say.

scripts/gpu_check.sh runs the stages (each a command under its own time limit) and leaves their rows under a scratch
folder; this module sizes them beforehand and judges them afterwards:

    python -m experiments.gpu_check plan       # each stage: its limit in the script, points, predicted seconds
    python -m experiments.gpu_check report --work DIR --out DIR [--long-context-tokens 8192] [--dry]

`report` merges every stage's rows into one parquet (a `stage` column says whose), the profiler tables into another,
the serve runs' run rows into serve.parquet and the tier and PD tables into movement.parquet
(experiments/gpu_stages.py), copies the stored ceilings (with the tiers stage's figures), and writes summary.md: the
machine, each stage's exit status and seconds, the key rows, and last one verdict line per target (PASS, FAIL or
N/A), computed from the rows alone by experiments/gpu_verdicts.py's `verdicts()`.

The sizing (each stage's predicted seconds, upper bounds, not figures to quote) is experiments/sizing.py, and for
the serve, tiers and pd stages experiments/gpu_stages.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from experiments import gpu_stages, sizing
from experiments.gpu_verdicts import LONG_CONTEXT_TOKENS, STAGE_COLUMN, Verdict, verdicts
from experiments.sizing import H200, ROOT, STAGE_PRESETS, Gpu, preset_points, stage_limits
from harness.analytic import crossover
from harness.errors import exit_on_config_error
from harness.store import disk

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def stage_predictions(*, gpu: Gpu = H200) -> dict[str, float]:
    """Predicted seconds of every stage of the script on `gpu`: experiments/sizing.py's, then the serve, tiers and
    pd stages' (experiments/gpu_stages.py, from their arguments in the script)."""
    predicted = sizing.stage_predictions(gpu=gpu)
    stages = gpu_stages.stage_predictions(SCRIPT.read_text(), gpu=gpu)
    return predicted | {stage: seconds for stage, (seconds, _) in stages.items()}


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

    from harness.measure.environment import nvidia_driver_version

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
    extra: Sequence[str] = (),
) -> str:
    """summary.md: the machine, the stages, the key rows, the crossover's knee and the `extra` sections (the serve,
    tiers and pd stages'), then the verdicts, one a line, last."""
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
    lines += [*extra, "## Verdicts", "", *(verdict.line() for verdict in found)]
    return "\n".join(lines) + "\n"


def write_report(*, work: Path, out: Path, dry: bool, long_context_tokens: int) -> list[Verdict]:
    """rows.parquet, ops.parquet (when a stage profiled), ceilings.json (when measured), serve.parquet and
    movement.parquet (when those stages wrote rows) and summary.md into out.

    The figures first, summary.md next, the stages' predicted seconds (a few Hydra composes) last, rewriting it: a
    report cut short by its time limit still leaves the rows and the verdicts behind."""
    out.mkdir(parents=True, exist_ok=True)
    rows = merge_rows(work)
    rows.to_parquet(out / "rows.parquet", index=False)
    ops = merge_ops(work)
    if len(ops):
        ops.to_parquet(out / "ops.parquet", index=False)
    stored = {path.stem: json.loads(path.read_text()) for path in sorted((work / "store" / "ceilings").glob("*.json"))}
    runs, movement = gpu_stages.serve_runs(work), gpu_stages.movement_rows(work)
    if len(runs):
        runs.to_parquet(out / "serve.parquet", index=False)
    if len(movement):
        movement.to_parquet(out / "movement.parquet", index=False)
    tiers_ceilings = work / "stages" / gpu_stages.TIERS_STAGE / "ceilings"  # the stored ones, tier_gbps added
    stored |= {path.stem: json.loads(path.read_text()) for path in sorted(tiers_ceilings.glob("*.json"))}
    if stored:
        (out / "ceilings.json").write_text(json.dumps(stored, indent=2) + "\n")
    found = verdicts(rows, long_context_tokens=long_context_tokens, serve_runs=runs, movement=movement)
    summary = dict(machine=machine_lines(), stages=read_stages(work), rows=rows, found=found, dry=dry,
                   long_context_tokens=long_context_tokens,
                   extra=gpu_stages.summary_sections(runs, movement))  # fmt: skip
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
    """Every stage of the script: its limit, its points (a preset stage's; the serve stage's runs, the tiers stage's
    rows, the pd stage's measured rows) and its predicted seconds on `gpu`."""
    script = SCRIPT.read_text()
    limits = stage_limits(script)
    predicted = sizing.stage_predictions(gpu=gpu)
    points = {stage: len(preset_points(preset)) for stage, preset in STAGE_PRESETS.items()}
    for stage, (seconds, count) in gpu_stages.stage_predictions(script, gpu=gpu).items():
        predicted[stage], points[stage] = seconds, count
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
