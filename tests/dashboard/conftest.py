"""Fixtures the dashboard's tests share."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from tests.dashboard.test_dashboard import reference_rows, write_rows


@pytest.fixture(scope="session")
def reference() -> pd.DataFrame:
    """The committed reference rows (results/reference), loaded once for the folder (seconds; the same read as
    reference_rows()'s); no test modifies them."""
    return reference_rows()


@pytest.fixture
def corrupt_dir(tmp_path) -> Path:
    """Two good rows, a file of garbage and a truncated parquet."""
    rows = reference_rows().head(2)
    write_rows(rows, tmp_path)
    whole = next(tmp_path.rglob("*.parquet")).read_bytes()  # a good row's file
    (tmp_path / "truncated.parquet").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "x.parquet").write_bytes(b"this is not a parquet file" * 10)
    return tmp_path
