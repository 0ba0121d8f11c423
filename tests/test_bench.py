"""One point measured in-process: the row's columns, whatever the device."""

from __future__ import annotations

from harness.bench import run_point
from harness.config import RunConfig
from harness.results import COLUMNS

FAST = dict(warmup=0, min_repeats=1, max_repeats=1, isolate=False)


def test_every_key_of_a_row_is_a_column_of_the_contract():
    row = run_point(RunConfig(model={"name": "tiny"}, device="cpu", prompt_len=8, gen_len=4, **FAST))
    assert set(row) <= {column.name for column in COLUMNS}


def test_energy_and_clock_columns_are_null_on_the_cpu():
    row = run_point(RunConfig(model={"name": "tiny"}, device="cpu", prompt_len=8, gen_len=4, **FAST))
    for column in ("energy_j_per_token", "mean_power_w", "sm_clock_mhz_start", "throttle_reasons_end"):
        assert column in row and row[column] is None
