"""kvbench-results: look at, merge and compare the result rows under a folder.

    kvbench-results show results/ --sweep 2024-06-01_12-00
    kvbench-results export results/ all.csv
    kvbench-results columns          # the Markdown table the README embeds
    kvbench-results compact results/ # one file per sweep folder instead of one per point
    kvbench-results diff results/ 3f2a 9c1e   # what changed between two rows (config, environment)
    kvbench-results compare results/main/ results/branch/ --fail-on 0.05   # FAST/SLOW/SAME/AMBIGUOUS per point
    kvbench-results compare a.parquet b.parquet --metric ttft_ms --format csv --out verdicts.csv

`python -m harness.store ...` is the same command without the installed console script.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.store import compare, diff, disk, maintain
from harness.store.atomic import atomic_write
from harness.store.schema import columns_markdown
from harness.store.summary import format_summary

logger = logging.getLogger(__name__)

_MIB_BYTES = 2**20


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbench-results", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser("export", help="merge every row under SRC into one .csv or .parquet file")
    export_parser.add_argument("src", type=Path, help="results directory (searched recursively) or .parquet file")
    export_parser.add_argument("out", type=Path, help="output file; its suffix (.csv or .parquet) picks the format")
    export_parser.set_defaults(inputs=("src",))
    show_parser = commands.add_parser("show", help="print a summary table of the rows under SRC")
    show_parser.add_argument("src", type=Path, help="results directory (searched recursively) or .parquet file")
    show_parser.add_argument("--sweep", metavar="ID", help="only rows whose sweep_id is ID")
    show_parser.set_defaults(inputs=("src",))
    commands.add_parser("columns", help="print the column contract as a Markdown table")
    compact_parser = commands.add_parser("compact", help="merge each sweep folder's point files into one file")
    compact_parser.add_argument("results_dir", type=Path, help="results directory (every sweep folder under it)")
    compact_parser.add_argument("--sweep", metavar="ID", help="only the sweep folder named ID")
    compact_parser.set_defaults(inputs=("results_dir",))
    diff_parser = commands.add_parser("diff", help="what differs between two rows (config, environment, figures)")
    diff_parser.add_argument("src", type=Path, help="results directory (searched recursively) or .parquet file")
    diff_parser.add_argument("a", help="a point_id, or a unique prefix of one")
    diff_parser.add_argument("b", help="another point_id, or a unique prefix of one")
    diff_parser.set_defaults(inputs=("src",))
    compare_parser = commands.add_parser(
        "compare", help="A/B verdicts (FAST, SLOW, SAME, AMBIGUOUS) per point paired by workload key"
    )
    compare_parser.add_argument("a", type=Path, help="baseline: results directory, sweep folder or .parquet file")
    compare_parser.add_argument("b", type=Path, help="candidate, as A; the ratio is B/A")
    compare_parser.set_defaults(inputs=("a", "b"))
    compare_parser.add_argument("--metric", default="tpot_ms", help=f"one of {', '.join(compare.METRICS)}")
    compare_parser.add_argument(
        "--threshold", default=str(compare.DEFAULT_THRESHOLD), help="smallest relative change given a verdict"
    )
    compare_parser.add_argument("--confidence", default=str(compare.DEFAULT_CONFIDENCE), help="of the ratio's CI")
    compare_parser.add_argument("--format", default="md", help=f"one of {', '.join(compare.FORMATS)}")
    compare_parser.add_argument("--out", type=Path, help="write the table to this file instead of stdout")
    compare_parser.add_argument(
        "--fail-on", default="0", help="exit 1 only when a SLOW pair is more than this fraction slower (0.05: 5%%)"
    )
    compare_parser.add_argument(
        "--trust-noisy",
        action="store_true",
        help="give a pair with a host_busy or not converged side its plain verdict (default: AMBIGUOUS, with why)",
    )
    args = parser.parse_args(argv)
    # A path that is not there is a typo, not an empty result set: said as argparse says a bad argument (one line
    # on stderr, exit 2), before any file is read. An existing empty folder still reads as no rows.
    missing = [path for path in (getattr(args, name) for name in getattr(args, "inputs", ())) if not path.exists()]
    if missing:
        print(f"{parser.prog} {args.command}: {missing[0]}: no such file or directory", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    try:
        if args.command == "export":
            maintain.export(src=args.src, out=args.out)
        elif args.command == "show":
            df = disk.load(args.src)
            if args.sweep is not None:
                df = df[df["sweep_id"] == args.sweep]
            print(format_summary(df))
        elif args.command == "compact":
            lines = maintain.compact(args.results_dir, sweep=args.sweep)
            for line in lines:
                left = f", {line['unreadable']} unreadable left in place" if line["unreadable"] else ""
                print(
                    f"{line['folder']}: {line['files']} files -> 1, {line['rows']} rows, "
                    f"{line['bytes_before'] / _MIB_BYTES:.2f} -> {line['bytes_after'] / _MIB_BYTES:.2f} MiB{left}"
                )
            if not lines:
                print(f"{args.results_dir}: nothing to compact")
        elif args.command == "compare":
            return compare_command(args)
        elif args.command == "diff":
            indexed = disk.index(args.src)  # only the two rows' files are then read whole
            a, b = (
                diff.read_row(diff.pick_row(indexed, wanted, name)) for wanted, name in ((args.a, "a"), (args.b, "b"))
            )
            print("\n".join(diff.diff_rows(a, b)) or "no differences")
        else:
            print(columns_markdown(), end="")
    except (ValueError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 2
    return 0


def compare_command(args: argparse.Namespace) -> int:
    """`compare A B`: every option checked before any row is read; 1 when a SLOW pair is past --fail-on."""
    options = {name: _fraction(getattr(args, name), f"--{name.replace('_', '-')}") for name in _FRACTIONS}
    compare.check_options(metric=args.metric, **options)
    if args.format not in compare.FORMATS:
        raise ValueError(f"--format: {args.format!r} is not one of {', '.join(compare.FORMATS)}")
    sides = []
    for path, name in ((args.a, "A"), (args.b, "B")):  # both exist: main() checked
        rows = disk.load(path)
        if rows.empty:
            raise ValueError(f"{name}: no result rows under {path}")
        sides.append(rows)
    result = compare.compare(
        *sides,
        metric=args.metric,
        threshold=options["threshold"],
        confidence=options["confidence"],
        trust_noisy=args.trust_noisy,
    )
    if args.format == "md":
        text = compare.to_markdown(result, a_name=str(args.a), b_name=str(args.b))
    else:
        text = compare.to_csv(result)
    if args.out is None:
        print(text, end="")
    else:
        atomic_write(args.out, lambda f: f.write(text.encode()))  # the one atomic writer: never half a table
        print(compare.summary_line(result, a_name=str(args.a), b_name=str(args.b)))
    return 1 if compare.fails(result, fail_on=options["fail_on"]) else 0


_FRACTIONS = ("threshold", "confidence", "fail_on")  # compare's number options, parsed here for a one-line error


def _fraction(text: str, argument: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{argument}: {text!r} is not a number; allowed: a fraction, e.g. 0.02") from None
