"""The observed knee of a batch sweep."""

from __future__ import annotations

import pandas as pd

from harness.analytic.crossover import knee_batch, knee_table


def sweep(tpots: dict[int, float], prompt_len: int = 128, critical_batch: float | None = 48.0) -> pd.DataFrame:
    return pd.DataFrame(
        [
            dict(
                model="small",
                device="cpu",
                dtype="bf16",
                kv_dtype="bf16",
                cache="contiguous",
                prompt_len=prompt_len,
                status="ok",
                batch_size=batch,
                tpot_ms=tpot,
                critical_batch=critical_batch,
            )
            for batch, tpot in tpots.items()
        ]
    )


def test_the_knee_is_the_first_batch_whose_tpot_rises_25_percent_above_batch_1():
    table = knee_table(sweep({1: 10.0, 2: 10.2, 4: 11.0, 8: 12.4, 16: 13.0, 32: 20.0}))
    assert table.loc[0, "knee_batch"] == 16 and table.loc[0, "critical_batch"] == 48.0
    assert table.loc[0, "tpot_b1_ms"] == 10.0 and table.loc[0, "batches"] == 6


def test_a_sweep_that_never_rises_has_no_knee():
    table = knee_table(sweep({1: 10.0, 2: 10.1, 4: 10.3}))
    assert pd.isna(table.loc[0, "knee_batch"])


def test_each_prompt_length_is_its_own_sweep_and_failed_points_are_ignored():
    rows = pd.concat([sweep({1: 10.0, 2: 30.0}, prompt_len=128), sweep({1: 10.0, 2: 11.0}, prompt_len=1024)])
    rows.loc[len(rows)] = rows.iloc[0].to_dict() | {"batch_size": 4, "status": "oom", "tpot_ms": None}
    table = knee_table(rows).set_index("prompt_len")
    assert table.loc[128, "knee_batch"] == 2 and pd.isna(table.loc[1024, "knee_batch"])


def test_rows_without_a_batch_sweep_give_an_empty_table():
    assert knee_table(sweep({1: 10.0})).empty


def test_knee_batch_is_the_first_batch_past_the_rise():
    assert knee_batch([1, 2, 4, 8], [10.0, 10.5, 12.6, 20.0]) == 4  # 12.6 > 1.25 x 10
    assert knee_batch([1, 2, 4], [10.0, 11.0, 12.5]) is None  # 12.5 is not above 12.5
    assert knee_batch([2, 4, 8], [10.0, 20.0, 40.0]) is None  # no batch-1 reference
    assert knee_batch([1], [10.0]) is None


def test_knee_table_takes_the_median_of_a_batch_measured_twice():
    rows = pd.DataFrame(
        {
            "model": "small", "device": "cpu", "dtype": "bf16", "kv_dtype": "bf16", "cache": "contiguous",
            "prompt_len": 32, "status": "ok",
            "batch_size": [1, 1, 1, 4],
            "tpot_ms": [10.0, 11.0, 30.0, 13.0],  # batch 1's median is 11: 13 is not a knee, 1.25 x 11 = 13.75
        }
    )  # fmt: skip
    line = knee_table(rows).iloc[0]
    assert line["tpot_b1_ms"] == 11.0 and line["batches"] == 2 and pd.isna(line["knee_batch"])


def test_sweeps_of_different_workloads_are_never_read_as_one():
    # Same model, formats, cache and prompt; only gen_len (or a strategy option) differs: two sweeps, two knees.
    short, long = sweep({1: 10.0, 2: 30.0}), sweep({1: 10.0, 2: 10.5, 4: 11.0})
    short["gen_len"], long["gen_len"] = 8, 256
    table = knee_table(pd.concat([short, long], ignore_index=True)).set_index("gen_len")
    assert table.loc[8, "knee_batch"] == 2 and pd.isna(table.loc[256, "knee_batch"])
    assert table.loc[256, "batches"] == 3
