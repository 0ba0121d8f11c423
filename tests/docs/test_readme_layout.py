"""The README's Layout section is the newcomer's map: every module of the library, the entry points and the
dashboard is named there, so a file added without a line in it fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("harness", "experiments", "dashboard")
NOT_NAMED = {"__init__.py", "__main__.py"}  # a package's marker, python -m's hook


def layout_block() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"^## Layout\n.*?^```\n(.*?)^```$", readme, flags=re.S | re.M)
    assert match, "README.md has no ## Layout section with a code block"
    return match.group(1)


def test_every_module_is_named_in_the_readme_layout():
    block = layout_block()
    missing = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name not in NOT_NAMED and not re.search(rf"(?<![\w/]){re.escape(path.name)}", block)
    ]
    assert not missing, f"not in README.md's Layout: {', '.join(missing)}"


def test_every_file_the_layout_names_exists():
    named = set(re.findall(r"(?<![\w./])([a-z_]+\.py)\b", layout_block()))
    present = {path.name for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    present |= {path.name for path in (ROOT / "tests").rglob("*.py")}
    assert named <= present, f"named in the Layout but not in the tree: {', '.join(sorted(named - present))}"
