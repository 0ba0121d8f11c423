"""When loading a stored prefix beats recomputing it: the measured crossover interpolates a sweep's TTFTs, the
analytic one solves the load and prefill models from the ceilings."""

from __future__ import annotations

import types

import pandas as pd
import pytest

from harness.analytic import reuse
from harness.modeling.model_args import ModelArgs

LLAMA = ModelArgs.from_name("llama-3.1-8b")
H200ISH = dict(peak_tflops=900.0)  # a round figure: only the relations below matter
BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K|V x layers x KV heads x head_dim x bf16


def sweep(contexts, disk_ms, miss_ms) -> pd.DataFrame:
    n = len(contexts)
    return pd.DataFrame(
        {
            "status": ["ok"] * n,
            "model": ["llama-3.1-8b"] * n,
            "weights": ["dummy"] * n,
            "device": ["cuda"] * n,
            "dtype": ["bf16"] * n,
            "kv_dtype": ["bf16"] * n,
            "batch_size": [1] * n,
            "gen_len": [8] * n,
            "block_size": [16] * n,
            "disk_dir": ["/kv"] * n,
            "prefix_len": contexts,
            "prompt_len": [c + 64 for c in contexts],  # a 64-token question after each prefix
            "ttft_disk_ms": disk_ms,
            "ttft_miss_ms": miss_ms,
            "prefix_bytes_stored": [c * BYTES_PER_TOKEN for c in contexts],
            "peak_tflops": [H200ISH["peak_tflops"]] * n,
        }
    )


def test_the_measured_crossover_interpolates_between_the_points_either_side():
    rows = sweep([512, 1024, 2048, 4096], disk_ms=[10.0, 14.0, 22.0, 38.0], miss_ms=[4.0, 10.0, 26.0, 70.0])
    crossing, note = reuse.measured_crossover(rows)
    # gain = miss - disk: -4 at 1024, +4 at 2048: halfway
    assert note == "measured" and crossing == pytest.approx(1536.0)


@pytest.mark.parametrize(
    ("disk_ms", "miss_ms", "note"),
    [
        ([1.0, 2.0], [5.0, 9.0], "loading won at every measured context (from 512)"),
        ([9.0, 12.0], [5.0, 9.0], "recompute won at every measured context (up to 1024)"),
    ],
)
def test_no_crossing_inside_the_sweep_says_which_side_won(disk_ms, miss_ms, note):
    assert reuse.measured_crossover(sweep([512, 1024], disk_ms=disk_ms, miss_ms=miss_ms)) == (None, note)


def analytic(disk_read_gbps: float) -> int | None:
    return reuse.analytic_crossover(
        LLAMA, bytes_per_token=BYTES_PER_TOKEN, dtype="bf16", kv_dtype="bf16", disk_read_gbps=disk_read_gbps, **H200ISH
    )


def test_the_analytic_crossover_is_where_the_load_and_prefill_models_meet():
    crossing = analytic(5.0)
    assert crossing is not None and 1_000 < crossing < 1_000_000  # long contexts: attention outgrows the load

    def gap_ms(n: int) -> float:  # compute - load: negative below the crossing, positive at it
        compute = reuse.predicted_compute_ms(LLAMA, n_tokens=n, dtype="bf16", kv_dtype="bf16", **H200ISH)
        return compute - n * BYTES_PER_TOKEN / 5e9 * 1e3

    assert gap_ms(crossing - 1) <= 0 < gap_ms(crossing)


def test_a_faster_disk_lowers_the_analytic_crossover_and_an_endless_one_always_loads():
    assert analytic(25.0) < analytic(5.0)
    assert analytic(1e9) == 1
    assert analytic(1e-6) is None  # a disk this slow never beats a prefill below MAX_CONTEXT


def test_the_crossover_table_puts_measured_and_analytic_side_by_side():
    rows = sweep([512, 1024, 2048, 4096], disk_ms=[10.0, 14.0, 22.0, 38.0], miss_ms=[4.0, 10.0, 26.0, 70.0])
    stored = types.SimpleNamespace(tier_gbps={"disk_read": 5.0})
    table = reuse.crossover_table(rows, ceilings=stored)
    assert table["measured crossover (tokens)"].tolist() == [1536]
    assert table["analytic crossover (tokens)"].tolist() == [analytic(5.0)]
    without = reuse.crossover_table(rows, ceilings=types.SimpleNamespace(tier_gbps={}))
    assert without["analytic crossover (tokens)"].iloc[0].startswith("no stored disk GB/s")


def test_a_fixed_prompt_sweep_is_one_curve_and_rows_varying_in_prompt_and_suffix_are_split():
    rows = sweep([512, 1024, 2048, 4096], disk_ms=[10.0, 14.0, 22.0, 38.0], miss_ms=[4.0, 10.0, 26.0, 70.0])
    stored = types.SimpleNamespace(tier_gbps={"disk_read": 5.0})
    fixed_prompt = rows.assign(prompt_len=4160)  # the prefix grows into one prompt: experiment=prefix-reuse
    assert reuse.crossover_table(fixed_prompt, ceilings=stored)["measured crossover (tokens)"].tolist() == [1536]
    fixed_suffix = rows.assign(prompt_len=rows["prefix_len"] + 64)
    mixed = pd.concat([fixed_prompt, fixed_suffix], ignore_index=True)
    # one curve per suffix length: 3648, 3136 and 2112 tokens alone, and 64 (the fixed-suffix four, and 4096 + 64)
    assert len(reuse.crossover_table(mixed, ceilings=stored)) == 4


def test_predicted_columns_need_their_ceilings():
    peaks = {"peak_tflops": 900.0}
    columns = reuse.predicted_columns(
        LLAMA, n_tokens=1024, prefix_bytes=1024 * BYTES_PER_TOKEN, dtype="bf16", kv_dtype="bf16", peaks=peaks,
        disk_read_gbps=5.0,
    )  # fmt: skip
    assert columns["predicted_prefix_load_ms"] == pytest.approx(1024 * BYTES_PER_TOKEN / 5e9 * 1e3)
    assert columns["predicted_prefix_compute_ms"] > 0
    bare = reuse.predicted_columns(
        LLAMA, n_tokens=1024, prefix_bytes=1, dtype="bf16", kv_dtype="bf16", peaks={}, disk_read_gbps=None
    )
    assert bare == {"predicted_prefix_load_ms": None, "predicted_prefix_compute_ms": None}
