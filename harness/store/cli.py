"""kvbench-results: look at, merge and compare the result rows under a folder.

    kvbench-results show results/ --sweep 2024-06-01_12-00
    kvbench-results export results/ all.csv
    kvbench-results columns          # the Markdown table the README embeds
    kvbench-results compact results/ # one file per sweep folder instead of one per point
    kvbench-results diff results/ 3f2a 9c1e   # what changed between two rows (config, environment)

`python -m harness.store ...` is the same command without the installed console script.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from harness.store import diff, disk, maintain
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
    show_parser = commands.add_parser("show", help="print a summary table of the rows under SRC")
    show_parser.add_argument("src", type=Path, help="results directory (searched recursively) or .parquet file")
    show_parser.add_argument("--sweep", metavar="ID", help="only rows whose sweep_id is ID")
    commands.add_parser("columns", help="print the column contract as a Markdown table")
    compact_parser = commands.add_parser("compact", help="merge each sweep folder's point files into one file")
    compact_parser.add_argument("results_dir", type=Path, help="results directory (every sweep folder under it)")
    compact_parser.add_argument("--sweep", metavar="ID", help="only the sweep folder named ID")
    diff_parser = commands.add_parser("diff", help="what differs between two rows (config, environment, figures)")
    diff_parser.add_argument("src", type=Path, help="results directory (searched recursively) or .parquet file")
    diff_parser.add_argument("a", help="a point_id, or a unique prefix of one")
    diff_parser.add_argument("b", help="another point_id, or a unique prefix of one")
    args = parser.parse_args(argv)
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
