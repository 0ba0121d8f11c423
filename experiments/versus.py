"""`make bench`: our decode loop against transformers' generate(), same config and weights, interleaved rounds.

    python -m experiments.versus                                # small; batch 1,8; fp32,bf16; prompt 128, gen 32; 5 rounds
    python -m experiments.versus --batch 1 --dtype bf16 --rounds 9
    python -m experiments.versus --quick                        # tiny model, 4 tokens, 2 rounds: a smoke test in seconds

For each case (dtype x batch) it times four loops in rounds of A B C D after one warm-up each (harness/run/versus.py):
ours with the harness's probes, transformers with its dynamic and its static cache, and ours bare. Every loop's row
goes to <results_dir>/bench-<time>/ (sweep_id = that folder's name); the table comes last. Inputs are checked before
anything heavy runs: bad input stops with one line naming the field and what it allows.
"""

from __future__ import annotations

import argparse
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
from harness.run import runner, versus, versus_table
from harness.run.point import config_columns
from harness.store import disk

log = logging.getLogger("kvbench")

# The cases; --quick swaps in a smoke test. An option given on the command line wins over either.
DEFAULTS = {"model": "small", "batch": "1,8", "dtype": "fp32,bf16", "prompt_len": 128, "gen_len": 32, "rounds": 5}
QUICK_DEFAULTS = {"model": "tiny", "batch": "1,2", "dtype": "fp32", "prompt_len": 16, "gen_len": 4, "rounds": 2}


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


def case_configs(options: argparse.Namespace) -> tuple[list[RunConfig], int]:
    """Every case as a validated RunConfig (dtype-major: the models load once per dtype), and the rounds."""
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
    return [
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
    ], value["rounds"]


def check_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("transformers: not installed; allowed: pip install -e '.[dev]' (make setup)") from None


def failure_rows(cfg: RunConfig, exc: Exception) -> list[dict]:
    """A case that failed is a row per loop with its status and error, never a missing row."""
    status = "oom" if runner.is_oom(exc) else "error"
    base = config_columns(cfg) | environment_columns(cfg.torch_device())
    error = {"status": status, "error": f"{type(exc).__name__}: {exc}"}
    return [base | versus.loop_columns(cfg, loop=loop) | error for loop in versus.LOOPS]


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


def run(cases: list[RunConfig], *, rounds: int, out_dir: Path) -> tuple[list[dict], list[Floor]]:
    """Measure every case, writing each loop's row as soon as its case is done; return the rows and, per case that
    ran, its matrix products' floor."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the save and load bars would bury the progress lines
    runner.ensure_ceilings(cases[0])  # measured once per device, in a process of its own, then reused
    args = cases[0].model_args()
    rows: list[dict] = []
    floors: list[Floor] = []
    with tempfile.TemporaryDirectory(prefix="kvbench-bench-") as checkpoint:
        log.info("saving transformers' seeded %s to %s", args.name, checkpoint)
        versus.save_checkpoint(args, checkpoint, seed=cases[0].seed)
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
    return rows, floors


@exit_on_config_error
def main(argv: Sequence[str] | None = None) -> int:
    options = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cases, rounds = case_configs(options)
    check_transformers()
    out_dir = Path(options.results_dir) / dt.datetime.now().strftime("bench-%Y-%m-%d_%H-%M-%S")
    rows, floors = run(cases, rounds=rounds, out_dir=out_dir)
    ok = [row for row in rows if row["status"] == "ok"]
    for row in rows:
        if row["status"] != "ok":
            print(f"FAILED {row['dtype']} batch {row['batch_size']} {row['loop']}: {row['status']} {row['error']}")
    print(f"rows: {out_dir}")
    if ok:
        print(floor_table(ok, floors))
        print()
        print(versus_table.format_table(ok))  # last: its verdict lines end the output
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
