"""The dashboard in a real browser: serve it headless on a free loopback port, visit its pages, take screenshots.

The end-to-end test (tests/dashboard/test_browser.py) and the README's screenshot both go through here, driving Debian's
chromium (`apt-get install -y chromium`) through Playwright; Playwright's own browser download is not needed.

    python -m dashboard.browser --page roofline --out dashboard/roofline.png     # the README's screenshot
    python -m dashboard.browser --results results/reference                      # visit every page, report

Every page is shot whole: Streamlit scrolls inside its own container, so the viewport is grown to the content first.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from dashboard import app_pages

log = logging.getLogger(__name__)

APP = Path(__file__).with_name("app.py")
REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path(os.environ.get("KVBENCH_CHROMIUM", "/usr/bin/chromium"))
PAGES = tuple(app_pages.PAGES)  # url paths, from the app's own page registry
DEFAULT_PAGE = app_pages.DEFAULT_PAGE  # st.navigation serves the default page at "/", not at its url path
# Streamlit's DOM contract (data-testid attributes, stable across 1.3x-1.6x releases)
EXCEPTION = '[data-testid="stException"]'
PLOTLY = '[data-testid="stPlotlyChart"] .js-plotly-plot'
RUNNING = '[data-testid="stStatusWidget"]'  # present while the script runs ("Running...")
# Streamlit scrolls the page inside <main> (the window never scrolls), so a full-page screenshot would stop at the
# first screen: the shot grows the viewport to the main block's height instead (content_height_px).
MAIN_BLOCK = '[data-testid="stMainBlockContainer"]'
CHROMIUM_FLAGS = os.environ.get("KVBENCH_CHROMIUM_FLAGS", "--disable-gpu").split()
VIEWPORT = {"width": 1400, "height": 1000}
MAX_SHOT_HEIGHT_PX = 16_384  # Chromium's largest texture side: a taller viewport captures blank or fails
INSTALL_CHROMIUM = "apt-get install -y chromium"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(results_dir: str | Path, *, app: Path = APP, timeout_s: float = 90.0) -> Iterator[str]:
    """Run `streamlit run app` headless on 127.0.0.1 with KVBENCH_RESULTS=results_dir; yield its base URL."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app),
        "--server.headless=true",
        "--server.address=127.0.0.1",
        f"--server.port={port}",
        "--server.fileWatcherType=none",
        "--browser.gatherUsageStats=false",
    ]
    env = os.environ | {"KVBENCH_RESULTS": str(Path(results_dir).resolve())}
    with tempfile.TemporaryFile() as output:
        server = subprocess.Popen(command, env=env, cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, server=server, output=output, timeout_s=timeout_s)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _wait_healthy(url: str, *, server: subprocess.Popen, output, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            output.seek(0)
            raise RuntimeError(f"streamlit exited ({server.returncode}): {output.read().decode(errors='replace')}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
            if response.read().strip() == b"ok":
                return
        time.sleep(0.25)
    raise TimeoutError(f"streamlit did not answer {url}/_stcore/health within {timeout_s:.0f} s")


@dataclass
class PageReport:
    name: str
    charts: int  # rendered plotly charts
    errors: list[str] = field(default_factory=list)  # the text of every Streamlit exception element
    screenshot: Path | None = None
    seconds: float = 0.0  # navigation until the script had finished and its charts had drawn

    @property
    def ok(self) -> bool:
        return self.charts > 0 and not self.errors


def chromium_missing(executable: Path) -> str:
    """What to do when there is no chromium at `executable`, in one line."""
    return f"chromium not found at {executable}; install it with: {INSTALL_CHROMIUM}"


@contextlib.contextmanager
def chromium(executable: Path = CHROMIUM) -> Iterator[object]:
    """A headless Debian chromium driven by Playwright (root in a container needs --no-sandbox)."""
    from playwright.sync_api import sync_playwright

    if not executable.exists():
        raise FileNotFoundError(chromium_missing(executable))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(executable), args=["--no-sandbox", "--disable-dev-shm-usage", *CHROMIUM_FLAGS]
        )
        try:
            yield browser
        finally:
            browser.close()


def visit(browser, url: str, name: str, *, screenshot: Path | None = None, timeout_s: float = 60.0) -> PageReport:
    """Open one page, wait until Streamlit has finished running it and its charts have drawn, and report."""
    page = browser.new_page(viewport=VIEWPORT)
    started = time.monotonic()
    try:
        page.goto(f"{url}/{'' if name == DEFAULT_PAGE else name}", wait_until="domcontentloaded")
        page.wait_for_selector('[data-testid="stApp"]', timeout=timeout_s * 1000)
        deadline = started + timeout_s
        settled_since = None
        while time.monotonic() < deadline:  # settled: not running, and charts or an exception, for 1 s
            running = page.locator(RUNNING).count() > 0
            done = page.locator(PLOTLY).count() > 0 or page.locator(EXCEPTION).count() > 0
            if not running and done:
                settled_since = settled_since or time.monotonic()
                if time.monotonic() - settled_since > 1.0:
                    break
            else:
                settled_since = None
            page.wait_for_timeout(200)
        # Rendered: when the page first settled (the second of confirmation after it is not part of its time).
        seconds = (settled_since or time.monotonic()) - started
        errors = [text.strip() for text in page.locator(EXCEPTION).all_inner_texts()]
        report = PageReport(name=name, charts=page.locator(PLOTLY).count(), errors=errors, seconds=seconds)
        if screenshot is not None:
            grow_to_content(page)
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
            report.screenshot = screenshot
        return report
    finally:
        page.close()


def shot_height_px(*, content_px: float, viewport_px: int) -> int:
    """The viewport height that shows the whole page: the content's, never under the first screen, at most
    MAX_SHOT_HEIGHT_PX."""
    return min(max(viewport_px, math.ceil(content_px)), MAX_SHOT_HEIGHT_PX)


def content_height_px(page) -> float:
    """The bottom of the page's content in CSS pixels: the main block's top (the header above it) plus its whole
    scroll height, the part below the first screen included."""
    return page.evaluate(
        "(selector) => { const block = document.querySelector(selector);"
        " return block ? block.getBoundingClientRect().top + block.scrollHeight : 0; }",
        MAIN_BLOCK,
    )


def grow_to_content(page, *, rounds: int = 3) -> None:
    """Make the viewport as tall as the content, so that a screenshot holds the whole page. Re-measured until it
    holds still: a taller viewport can reflow the page (charts sized to it)."""
    for _ in range(rounds):
        height = shot_height_px(content_px=content_height_px(page), viewport_px=VIEWPORT["height"])
        if height == page.viewport_size["height"]:
            return
        page.set_viewport_size({"width": VIEWPORT["width"], "height": height})
        page.wait_for_timeout(500)  # plotly redraws on the resize event


def visit_all(
    results_dir: str | Path,
    *,
    pages=PAGES,
    screenshots: Path | None = None,
    app: Path = APP,
    executable: Path = CHROMIUM,
):
    """Serve the app over results_dir and visit every page; screenshots go to `screenshots/<page>.png` if given."""
    with serve(results_dir, app=app) as url, chromium(executable) as browser:
        return [
            visit(browser, url, name, screenshot=screenshots / f"{name}.png" if screenshots else None) for name in pages
        ]


def report_table(reports: list[PageReport]) -> str:
    """One line per page visited: ok or FAIL, the plotly charts drawn, the seconds to draw them, the errors shown."""
    table = pd.DataFrame(
        {
            "page": [report.name for report in reports],
            "status": ["ok" if report.ok else "FAIL" for report in reports],
            "charts": [report.charts for report in reports],
            "seconds": [report.seconds for report in reports],
            "errors": [str(report.errors) for report in reports],
        }
    )
    return table.to_string(index=False, float_format="{:.1f}".format)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dashboard.browser", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results",
        default=str(REPO / "results" / "reference"),
        help="results directory to show (default: %(default)s)",
    )
    parser.add_argument("--page", choices=PAGES, help="only this page (default: every page)")
    parser.add_argument("--out", type=Path, help="with --page: write its screenshot here (PNG)")
    parser.add_argument(
        "--chromium",
        type=Path,
        default=CHROMIUM,
        help="the chromium executable (default: %(default)s; KVBENCH_CHROMIUM)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out and not args.page:
        parser.error("--out needs --page (the screenshot of one page)")
    if not args.chromium.exists():  # before streamlit starts: one line, no traceback
        print(f"dashboard.browser: {chromium_missing(args.chromium)}", file=sys.stderr)
        return 2
    pages = (args.page,) if args.page else PAGES
    with tempfile.TemporaryDirectory() as shots:
        reports = visit_all(args.results, pages=pages, screenshots=Path(shots), executable=args.chromium)
        print(report_table(reports))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_bytes(reports[0].screenshot.read_bytes())
            print(f"screenshot -> {args.out}")
    return 0 if all(report.ok for report in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
