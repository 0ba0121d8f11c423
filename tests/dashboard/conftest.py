"""Fixtures the dashboard's tests share."""

from __future__ import annotations

import pandas as pd
import pytest

from dashboard import data
from harness.store import disk


@pytest.fixture(scope="session")
def reference() -> pd.DataFrame:
    """The committed reference rows (results/reference), loaded once for the folder (seconds); no test modifies
    them."""
    return disk.load(data.REFERENCE_DIR)
