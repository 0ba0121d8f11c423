"""What `python -m dashboard.browser` prints about the pages it visited (no browser needed: tests/test_browser.py
drives chromium)."""

from __future__ import annotations

from dashboard.browser import PageReport, report_table


def test_the_report_table_has_one_line_per_page_with_status_charts_seconds_and_errors():
    reports = [PageReport("overview", 3, seconds=4.26), PageReport("roofline", 0, errors=["boom"], seconds=12.0)]
    header, overview, roofline = report_table(reports).splitlines()
    assert header.split() == ["page", "status", "charts", "seconds", "errors"]
    assert overview.split() == ["overview", "ok", "3", "4.3", "[]"]
    assert roofline.split() == ["roofline", "FAIL", "0", "12.0", "['boom']"]  # no chart, an exception: failed
