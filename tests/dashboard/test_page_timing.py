"""The dashboard's page timing (dashboard/page_timing.py): the synthetic rows it renders and the table it prints.

The timing itself is a benchmark (make bench-dashboard), never asserted on here."""

from __future__ import annotations

from dashboard import page_timing
from harness.store import disk, schema


def timing_lines() -> list[dict]:
    return [
        dict(page="overview", cold_s=2.678, warm_s=0.59, errors=[], browser_s=7.8, floor_s=4.34),
        dict(page="roofline", cold_s=3.5, warm_s=1.0, errors=[]),  # not timed in a browser
        dict(page="memory", cold_s=0.5, warm_s=0.4, errors=["KeyError: 'x'", "a second error"]),
    ]


def test_the_timing_table_has_a_header_and_one_line_per_page():
    lines = page_timing.timing_table(timing_lines()).splitlines()
    assert lines[0].split() == [
        "page",
        "cold",
        "s",
        "warm",
        "s",
        "browser",
        "s",
        "floor",
        "s",
        "server",
        "under",
        "3",
        "s",
    ]
    assert [line.split()[0] for line in lines[1:]] == ["overview", "roofline", "memory"]


def test_the_timing_table_gives_seconds_to_two_decimals_and_a_dash_where_not_measured():
    overview, roofline, _ = page_timing.timing_table(timing_lines()).splitlines()[1:]
    assert overview.split() == ["overview", "2.68", "0.59", "7.80", "4.34", "yes"]
    assert roofline.split() == ["roofline", "3.50", "1.00", "-", "-", "NO"]  # the slower run is over 3 s


def test_the_timing_table_without_a_browser_run_has_dashes_in_the_browser_columns():
    lines = [
        {key: value for key, value in line.items() if key not in ("browser_s", "floor_s")} for line in timing_lines()
    ]
    overview = page_timing.timing_table(lines).splitlines()[1]
    assert overview.split() == ["overview", "2.68", "0.59", "-", "-", "yes"]


def test_the_timing_table_names_a_pages_first_error_instead_of_a_verdict():
    memory = page_timing.timing_table(timing_lines()).splitlines()[-1]
    assert memory.rstrip().endswith("error: KeyError: 'x'") and "a second error" not in memory


def test_the_synthetic_rows_are_distinct_points_in_sweeps_of_a_thousand():
    rows = page_timing.synthetic_rows(2500)
    assert len(rows) == 2500 and rows["point_id"].is_unique
    assert rows["sweep_id"].nunique() == 3 and set(rows["status"]) == {"ok"}
    assert rows["tpot_ms"].nunique() > 2000  # each copy's timings scaled by its own factor: points that differ


def test_the_synthetic_rows_write_as_one_file_in_the_current_schema(tmp_path):
    # The reference rows load with columns of older schemas too; the file holds the current schema's alone.
    path = page_timing.write_rows(page_timing.synthetic_rows(50), tmp_path)
    back = disk.load(path)
    assert len(back) == 50 and list(back.columns) == schema.arrow_schema().names
