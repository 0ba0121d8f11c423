"""make bench-tiers-overlap: chat sessions whose history the pool evicts to a disk tier, served with tier loads
overlapped (tier_overlap=true: prefetch while a turn waits, layer by layer during the forward) and synchronous
(tier_overlap=false), side by side: TTFT of the turns that load, and how much load time the overlap hid.

    python -m experiments.bench_tier_overlap                         # SmolLM2-135M, 6 sessions x 4 turns, 2 rounds
    python -m experiments.bench_tier_overlap --rounds 3 -- num_prompts=8 max_turns=3   # serve overrides after --

Each run is experiment=serve-real's chat sessions (dataset=sharegpt-multiturn, prefix caching, 0.05 GiB of KV) with
cache.host_gb=0 and a disk tier of its own, fresh (a tier left by another run would change the hits): the same
requests, the same hits, the tokens equal in both (fp32, greedy). Rounds alternate which mode goes first, so that a
drift of the host falls on both. Every run is written as a serving run (results/serve/<id>-overlap-<mode>-r<N>/).

Printed, per mode and round, all measured: TTFT p50 of every turn and mean TTFT of the turns after the first (those
that can load a history), the load time (tier_load_s: disk reads with checksums, copies in) and the share of it
hidden behind the host's other work; then the median over rounds of each, and overlap / synchronous.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.serve import CONF_DIR  # registers serve_config in Hydra's ConfigStore
from harness.errors import exit_on_config_error
from harness.serve import run as app
from harness.serve.config import ServeConfig
from harness.serve.rows import load_run, serve_run_dir

SESSIONS = ["experiment=serve-real", "dataset=sharegpt-multiturn", "max_turns=4", "num_prompts=6", "strategy=prefix",
            "cache.host_gb=0"]  # fmt: skip


def one_run(overlap: bool, *, disk: Path, results_dir: str, run_id: str, overrides: list[str]) -> dict:
    """One serving run; its TTFT figures (ms) and load columns."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="serve", overrides=[*SESSIONS, f"cache.disk_dir={disk}", f"results_dir={results_dir}",
                                                      f"tier_overlap={str(overlap).lower()}", f"run_id={run_id}",
                                                      *overrides])  # fmt: skip
    cfg = ServeConfig(**OmegaConf.to_container(cfg, resolve=True))
    run_dir = serve_run_dir(cfg.results_dir, run_id)
    app.run(app.plan(cfg), run_dir=run_dir, sweep_id=run_id)
    requests, _, row = load_run(run_dir)
    later = requests[requests["turn"] > 1]
    return {
        "ttft_p50_ms": float(requests["ttft_ms"].median()),
        "ttft_later_mean_ms": float(later["ttft_ms"].mean()) if len(later) else float("nan"),
        "disk_hit_rate": row["prefix_hit_rate_disk"],
        "load_s": row["tier_load_s"],
        "hidden_share": row["tier_load_hidden_share"] or 0.0,
        "run_dir": run_dir,
    }


@exit_on_config_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("overrides", nargs="*", help="serve config overrides (key=value), after --")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    figures: dict[bool, list[dict]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="kv-overlap-") as scratch:
        for r in range(args.rounds):
            for overlap in (False, True) if r % 2 == 0 else (True, False):
                mode = "true" if overlap else "false"
                out = one_run(overlap, disk=Path(scratch) / f"{mode}-r{r}", results_dir=args.results_dir,
                              run_id=f"{stamp}-overlap-{mode}-r{r}", overrides=args.overrides)  # fmt: skip
                figures[overlap].append(out)
                print(f"round {r} tier_overlap={mode:5}  TTFT p50 {out['ttft_p50_ms']:8.1f} ms  turns>1 mean "
                      f"{out['ttft_later_mean_ms']:8.1f} ms  disk hits {100 * out['disk_hit_rate']:4.1f}%  load "
                      f"{out['load_s']:.3f} s, hidden {100 * out['hidden_share']:4.1f}%", flush=True)  # fmt: skip
    print("\nmedian over rounds        tier_overlap=false   tier_overlap=true   true / false")
    for name, label in (("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_later_mean_ms", "TTFT turns>1 mean (ms)"),
                        ("load_s", "tier_load_s (s)"), ("hidden_share", "hidden share")):  # fmt: skip
        off, on = (statistics.median(f[name] for f in figures[mode]) for mode in (False, True))
        ratio = f"{on / off:.2f}" if off else "-"
        print(f"  {label:24} {off:18.3f} {on:19.3f} {ratio:>14}")


if __name__ == "__main__":
    main()
