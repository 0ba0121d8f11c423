"""The README's first screen is what a newcomer reads before deciding anything: what kvbench is, the two commands,
how long they take, where the results go and how to look at them. And the dashboard section counts the app's
pages from the app's own registry (dashboard/app_pages/__init__.py), so a new page cannot leave it behind."""

from __future__ import annotations

import re
from pathlib import Path

from dashboard import app_pages

ROOT = Path(__file__).resolve().parents[2]
FIRST_SCREEN_LINES = 30  # a terminal or an editor's first screen
FIRST_LINES = 12  # the commands come right after the one-paragraph introduction
NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"
DURATION = r"\d+(?: to \d+)? min"  # "about 2 min", "2 to 4 min", "about 15 min"


def readme() -> str:
    return (ROOT / "README.md").read_text()


def first_screen() -> str:
    return "\n".join(readme().splitlines()[:FIRST_SCREEN_LINES])


def prose(text: str) -> str:
    """The text outside code blocks, its lines joined (a sentence may wrap)."""
    return " ".join(re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M).split())


def test_a_sentence_says_what_kvbench_is_before_the_first_code_block():
    before_code = readme().split("\n```", 1)[0]
    text = " ".join(line for line in before_code.splitlines() if not line.startswith("#"))
    assert re.search(r"\bkvbench is\b[^.]+\.", text), f"no sentence before the first code block: {text!r}"


def test_make_run_and_make_test_are_in_the_first_lines():
    first = "\n".join(readme().splitlines()[:FIRST_LINES])
    assert re.search(r"^make run\b", first, flags=re.M) and re.search(r"^make test\b", first, flags=re.M)


def test_the_first_screen_gives_the_set_up_run_and_suite_times():
    text = prose(first_screen())
    for target in ("make setup", "make run", "make test"):
        assert re.search(rf"`{target}`[^.]*?\b{DURATION}", text), f"no time for `{target}` on the first screen"


def test_the_first_screen_says_where_results_go_and_how_to_look_at_them():
    screen = first_screen()
    assert "results/<sweep_id>/<point_id>.parquet" in screen
    assert re.search(r"^make dashboard\b", screen, flags=re.M)
    assert re.search(r"kvbench-results show results/", screen)
    assert (
        "next: make dashboard" in screen
    )  # what make run and make serve-quick end with (tests/experiments/test_entry_points.py)


def dashboard_section() -> str:
    match = re.search(r"^## The dashboard\n(.*?)^## ", readme(), flags=re.S | re.M)
    assert match, "README.md has no ## The dashboard section"
    return match.group(1)


def test_the_dashboard_section_counts_the_registered_pages():
    (count,) = re.findall(r"\b(\w+) pages:", dashboard_section())
    assert NUMBER_WORDS.split().index(count.lower()) == len(app_pages.PAGES), (
        f"{count} pages, {len(app_pages.PAGES)} registered"
    )


def test_the_dashboard_sections_page_table_is_the_registered_pages_in_order():
    table = re.search(r"^\| Page \| What it shows \|\n\|---\|---\|\n((?:\|.*\n)+)", dashboard_section(), flags=re.M)
    assert table, "the dashboard section has no | Page | What it shows | table"
    pages = [row.split("|")[1].strip() for row in table.group(1).splitlines()]
    assert pages == list(app_pages.PAGES.values())
