"""The dashboard end to end in a real browser (Debian's chromium through Playwright), on the committed results.

`.ci/run` installs chromium, so CI always runs these; elsewhere they skip, saying what to install.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dashboard import browser
from tests.serve.serve_runs import write_run, write_sweep

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not browser.CHROMIUM.exists(), reason=f"{browser.CHROMIUM} missing: apt-get install -y chromium"
    ),
]
playwright = pytest.importorskip("playwright", reason="pip install playwright (the dev extra)")

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference"
# The Serving page reads <results>/serve/: beside the committed reference's runs (one rate each), the fixture adds a
# small simulated qps sweep (2 strategies × 2 rates, a killed run and a multi-turn one), which takes a second, so the
# qps and by-turn charts draw.
PAGES = browser.PAGES


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every page visited once over a copy of the committed reference results plus simulated serving runs;
    screenshots in a temp dir."""
    results = tmp_path_factory.mktemp("results")
    shutil.copytree(REFERENCE, results / "reference")
    write_sweep(results, qps_values=(4.0, 64.0))
    write_run(results, run_id="killed", finished=False)
    write_run(results, run_id="chat", qps=8.0, turns=4)  # chat sessions: the by-turn charts draw too
    shots = tmp_path_factory.mktemp("screenshots")
    return {report.name: report for report in browser.visit_all(results, pages=PAGES, screenshots=shots)}


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_a_plotly_chart_and_no_exception(reports, page):
    report = reports[page]
    assert report.errors == [], f"{page} shows a Streamlit exception: {report.errors}"
    assert report.charts > 0, f"{page} rendered no plotly chart"
    assert report.screenshot.stat().st_size > 10_000  # a real PNG of a drawn page


def test_a_page_that_raises_is_reported_as_failed(tmp_path):
    """The guard of the test above: an app whose script raises yields an error, not a pass."""
    app = tmp_path / "broken_app.py"
    app.write_text(
        "import plotly.graph_objects as go\nimport streamlit as st\n"
        "st.plotly_chart(go.Figure(go.Scatter(x=[1, 2], y=[1, 2])))\n"
        "raise RuntimeError('page exploded')\n"
    )
    with browser.serve(tmp_path, app=app) as url, browser.chromium() as chrome:
        report = browser.visit(chrome, url, "")

    assert not report.ok
    assert any("page exploded" in error for error in report.errors)


def png_height_px(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[20:24], "big")  # the IHDR chunk: width, then height, big-endian


def test_a_long_page_is_shot_whole_not_cut_at_the_first_screen(reports):
    """Streamlit scrolls inside <main>, so Playwright's full_page alone stops at the viewport; the roofline page
    (three charts and a table) is longer than one screen."""
    assert png_height_px(reports["roofline"].screenshot) > browser.VIEWPORT["height"]
