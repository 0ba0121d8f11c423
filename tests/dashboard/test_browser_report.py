"""What `python -m dashboard.browser` offers and prints: its pages, its help, the report of the pages it visited,
a missing chromium, and how tall a whole-page shot is (no browser needed: tests/dashboard/test_browser.py drives chromium)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dashboard import app_pages, browser
from dashboard.browser import PageReport, report_table

ROOT = Path(__file__).resolve().parents[2]
MISSING_CHROMIUM = "/nonexistent/bin/chromium"


def test_the_report_table_has_one_line_per_page_with_status_charts_seconds_and_errors():
    reports = [PageReport("overview", 3, seconds=4.26), PageReport("roofline", 0, errors=["boom"], seconds=12.0)]
    header, overview, roofline = report_table(reports).splitlines()
    assert header.split() == ["page", "status", "charts", "seconds", "errors"]
    assert overview.split() == ["overview", "ok", "3", "4.3", "[]"]
    assert roofline.split() == ["roofline", "FAIL", "0", "12.0", "['boom']"]  # no chart, an exception: failed


def test_every_file_in_app_pages_is_a_registered_page():
    files = {path.stem for path in (ROOT / "dashboard" / "app_pages").glob("*.py") if path.name != "__init__.py"}
    assert set(app_pages.PAGES) == files


def test_the_page_choices_are_the_apps_registered_pages():
    (page,) = [action for action in browser.build_parser()._actions if action.dest == "page"]
    assert tuple(page.choices) == tuple(app_pages.PAGES)
    assert "tiers" in page.choices


def test_help_shows_the_default_results_folder(capsys):
    with pytest.raises(SystemExit) as stopped:
        browser.main(["--help"])
    assert stopped.value.code == 0
    unwrapped = "".join(capsys.readouterr().out.split())  # argparse wraps a long path at its hyphens
    assert f"(default:{ROOT / 'results' / 'reference'})" in unwrapped


def test_a_missing_chromium_is_one_line_with_the_install_command_and_exit_2():
    """The real command line, KVBENCH_CHROMIUM pointing at nothing: no traceback, and no dashboard started first."""
    done = subprocess.run(
        [sys.executable, "-m", "dashboard.browser", "--page", "roofline"],
        env=os.environ | {"KVBENCH_CHROMIUM": MISSING_CHROMIUM},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"dashboard.browser: chromium not found at {MISSING_CHROMIUM}; install it with: apt-get install -y chromium"
    ]


def test_the_chromium_option_names_the_executable(capsys):
    assert browser.main(["--chromium", MISSING_CHROMIUM]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"chromium not found at {MISSING_CHROMIUM}" in line


@pytest.mark.parametrize(
    ("content_px", "height_px"),
    [
        (2339.4, 2340),  # a long page: all of it, rounded up
        (600.0, 1000),  # a short one: the first screen
        (0.0, 1000),  # no main block found: the first screen
        (50_000.0, browser.MAX_SHOT_HEIGHT_PX),  # longer than chromium can capture: capped
    ],
)
def test_a_whole_page_shot_is_as_tall_as_the_content(content_px, height_px):
    assert browser.shot_height_px(content_px=content_px, viewport_px=1000) == height_px
