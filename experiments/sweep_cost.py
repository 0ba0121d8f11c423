"""`make bench-sweep`: how a sweep's wall time grows with its number of points, with and without warm workers.

Runs real sweeps (`python -m experiments.decode -m ...`, the tiny model, one short measurement per point) of 1, 2, 4
and 8 points, each into a fresh results folder, once with `reuse_worker=true` (the default: a worker whose point
ended ok measures the next one) and once with `reuse_worker=false` (a freshly spawned process per point, as
optimum-benchmark does). It prints the wall time of each sweep and the marginal cost of a point (the slope of wall
time against points), so what isolation costs per point is a figure, not a guess.

    python -m experiments.sweep_cost                  # = make bench-sweep
    python -m experiments.sweep_cost --points 1,4,16
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.errors import ConfigError, exit_on_config_error

ROOT = Path(__file__).resolve().parents[1]
POINT = [  # one quick point: the measurement itself is small, so what remains is the harness's own cost per point
    "model=tiny",
    "dtype=fp32",
    "prompt_len=32",
    "gen_len=8",
    "warmup=1",
    "min_repeats=3",
    "max_repeats=3",
    # No retry at twice the budget: 3 tiny repeats rarely meet target_rse, and a retry (6 more generations, on
    # some points and not others) would put the host's noise into the per-point cost this measures.
    "retry_noisy=false",
    "profile=false",
    "ceilings_quick=true",
]


def sweep_seconds(n_points: int, *, reuse: bool, ceilings_dir: Path) -> float:
    """Wall time of one sweep of n_points (distinct seeds) into a fresh results folder."""
    with tempfile.TemporaryDirectory() as results_dir:
        command = [
            sys.executable, "-m", "experiments.decode", "-m", *POINT,
            f"seed={','.join(str(seed) for seed in range(n_points))}",
            f"reuse_worker={str(reuse).lower()}", f"ceilings_dir={ceilings_dir}", f"results_dir={results_dir}",
        ]  # fmt: skip
        started = time.perf_counter()
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"sweep of {n_points} points failed:\n{proc.stderr[-2000:]}")
    return seconds


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys against xs: seconds per added point."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)


def parse_sizes(points: str) -> list[int]:
    """--points as sweep sizes: at least two, each a positive integer."""
    try:
        sizes = [int(item) for item in points.split(",")]
    except ValueError:
        raise ConfigError(
            f"--points: {points!r} is not a comma-separated list of integers; allowed: e.g. 1,2,4,8"
        ) from None
    if len(sizes) < 2 or min(sizes) < 1:
        raise ConfigError(f"--points: needs at least two positive sizes, got {points!r}; allowed: e.g. 1,2,4,8")
    return sizes


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.sweep_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="1,2,4,8", help="sweep sizes, comma-separated (default 1,2,4,8)")
    args = parser.parse_args(argv)
    sizes = parse_sizes(args.points)
    with tempfile.TemporaryDirectory() as ceilings_dir:
        sweep_seconds(1, reuse=True, ceilings_dir=Path(ceilings_dir))  # measures the quick ceilings once, untimed
        table = {
            reuse: [sweep_seconds(n, reuse=reuse, ceilings_dir=Path(ceilings_dir)) for n in sizes]
            for reuse in (True, False)
        }
    print(f"{'points':>7}{'warm workers s':>16}{'fresh process s':>17}")
    for i, n in enumerate(sizes):
        print(f"{n:>7}{table[True][i]:>16.1f}{table[False][i]:>17.1f}")
    warm, fresh = slope(sizes, table[True]), slope(sizes, table[False])
    print(
        f"\nper added point: {warm:.2f} s with warm workers, {fresh:.2f} s with a fresh process each "
        f"(isolation's own cost: {fresh - warm:.2f} s per point saved by reuse).\n"
        "Each point here measures 4 tiny generations; the rest is the harness: the sweep's start (Hydra, torch), "
        "each point's validation, worker start, model build, writing the row."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
