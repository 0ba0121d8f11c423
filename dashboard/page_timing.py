"""How fast each dashboard page renders over many rows (the target: 100k rows, every page under 3 s).

A benchmark, not a test: it prints figures and never fails on time alone. The rows are the committed reference rows
replicated to --rows (distinct point and sweep ids, so filters and tables see them all; each copy's timings scaled by
its own random factor, so the charts draw 100k distinct points), written as one parquet file.
Each page is timed twice through Streamlit's AppTest (the script run: loading, filtering, building every figure):
cold (the first page also pays for reading the file; the loaders are cached after that) and warm (a rerun, as when
a filter changes). With --browser, each page is also timed in headless chromium, until its charts have drawn, and
again over 100 rows: that floor (page load, websocket, first run) is what any page costs in that browser here.

    python -m dashboard.page_timing                    # = make bench-dashboard
    python -m dashboard.page_timing --rows 20000 --browser
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dashboard import browser
from harness.store import disk, schema

TARGET_S = 3.0  # the budget per page at 100k rows
FLOOR_ROWS = 100  # the browser's floor: the same page over this many rows (page load, websocket, first script run)
JITTERED = (  # measured columns the synthetic copies vary (TPOT and throughput stay consistent: both scale)
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "achieved_tflops",
    "achieved_bw_gbps",
    "prefill_achieved_tflops",
)


def synthetic_rows(n_rows: int, *, source: Path = browser.REPO / "results" / "reference") -> pd.DataFrame:
    """The reference rows repeated to n_rows, each copy a distinct point in one of n_rows // 1000 + 1 sweeps."""
    base = disk.load(source)
    base = base[base["status"] == "ok"].reset_index(drop=True)
    if base.empty:
        raise SystemExit(f"no ok rows under {source} to replicate")
    copies = -(-n_rows // len(base))  # ceil
    rows = pd.concat([base] * copies, ignore_index=True).iloc[:n_rows].copy()
    index = pd.Series(range(n_rows), index=rows.index)
    rows["point_id"] = "bench" + index.astype(str).str.zfill(7)
    rows["sweep_id"] = "bench-sweep-" + (index // 1000).astype(str).str.zfill(3)
    # Each copy's measurements scaled by its own factor in [0.8, 1.2): 100k distinct points for the charts to draw,
    # not 70 points drawn on top of each other a thousand times.
    factor = np.random.default_rng(0).uniform(0.8, 1.2, size=n_rows)
    for column in JITTERED:
        if column in rows.columns:
            rows[column] = rows[column] * factor
    return rows


def write_rows(rows: pd.DataFrame, directory: Path) -> Path:
    """The rows as one parquet file in the current schema. Only its columns: the reference rows load with the
    columns older schemas had too (sm_clock_mhz_start, ...), which the schema's cast would refuse."""
    path = directory / "bench-rows.parquet"
    arrow = schema.arrow_schema()
    table = pa.Table.from_pandas(rows[arrow.names], preserve_index=False)
    pq.write_table(table.cast(arrow), path)
    return path


def time_pages(results_dir: Path) -> list[dict]:
    from streamlit.testing.v1 import AppTest

    os.environ["KVBENCH_RESULTS"] = str(results_dir)
    lines = []
    for page in browser.PAGES:
        app = AppTest.from_file(str(browser.APP), default_timeout=600)
        app.switch_page(f"app_pages/{page}.py")
        timings = []
        for _ in range(2):  # cold, then warm
            started = time.perf_counter()
            app.run()
            timings.append(time.perf_counter() - started)
        errors = [str(exc.value) for exc in app.exception]
        lines.append({"page": page, "cold_s": timings[0], "warm_s": timings[1], "errors": errors})
    return lines


def timing_table(lines: list[dict]) -> str:
    """time_pages' lines (with browser_s and floor_s where measured) as a table: seconds to 2 decimals, "-" where
    not measured, and whether the server's slower run stays under TARGET_S (or the page's first error)."""
    verdict_column = f"server under {TARGET_S:.0f} s"
    table = pd.DataFrame(
        {
            "page": [line["page"] for line in lines],
            "cold s": [line["cold_s"] for line in lines],
            "warm s": [line["warm_s"] for line in lines],
            # float64 even when no page was timed there: a null is NaN, which prints as na_rep
            "browser s": pd.Series([line.get("browser_s") for line in lines], dtype="float64"),
            "floor s": pd.Series([line.get("floor_s") for line in lines], dtype="float64"),
            verdict_column: [_verdict(line) for line in lines],
        }
    )
    return table.to_string(index=False, float_format="{:.2f}".format, na_rep="-")


def _verdict(line: dict) -> str:
    if line["errors"]:
        return "error: " + line["errors"][0]
    return "yes" if max(line["cold_s"], line["warm_s"]) < TARGET_S else "NO"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboard.page_timing", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows to render (default 100000)")
    parser.add_argument("--browser", action="store_true", help="also time each page in headless chromium")
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error(f"--rows must be a positive integer, got {args.rows}")
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        path = write_rows(synthetic_rows(args.rows), Path(tmp))
        size_mib = path.stat().st_size / 2**20
        print(f"{args.rows} rows -> {path.name} ({size_mib:.1f} MiB) in {time.perf_counter() - started:.1f} s")
        lines = time_pages(Path(tmp))
        if args.browser:
            for report in browser.visit_all(tmp):
                next(line for line in lines if line["page"] == report.name)["browser_s"] = report.seconds
    if args.browser:
        with tempfile.TemporaryDirectory() as tmp:
            write_rows(synthetic_rows(FLOOR_ROWS), Path(tmp))
            for report in browser.visit_all(tmp):
                next(line for line in lines if line["page"] == report.name)["floor_s"] = report.seconds
    print("\n" + timing_table(lines))
    print(
        "cold: the page's first script run (the first page also reads the file); warm: a rerun, as on a filter "
        "change.\nbrowser: headless chromium, from navigation until the script has finished and every chart has "
        f"drawn; floor: the same over {FLOOR_ROWS} rows (page load, websocket, first run): what the rows add is "
        "browser - floor."
    )
    return 1 if any(line["errors"] for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
