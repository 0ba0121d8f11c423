"""`make bench`: our loop beside transformers' generate(), same weights, interleaved; the table's formulas."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from harness import kv
from harness.config import RunConfig
from harness.kv.base import CacheSpec
from harness.modeling.model_args import ModelArgs
from harness.run import versus, versus_table
from harness.store import disk
from tests.greedy import LOGIT_TOL, assert_no_near_tie, assert_same_greedy_tokens, greedy_with_logits, point_logits

pytest.importorskip("transformers")

CPU = torch.device("cpu")
PROMPT_LEN, GEN_LEN = 16, 4


def tiny_case(**overrides) -> RunConfig:
    fields = dict(
        model={"name": "tiny"},
        device="cpu",
        dtype="fp32",
        batch_size=2,
        prompt_len=PROMPT_LEN,
        gen_len=GEN_LEN,
        accuracy=False,
        profile=False,
        isolate=False,
    )
    return RunConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return versus.save_checkpoint(ModelArgs.from_name("tiny"), tmp_path_factory.mktemp("hf-tiny"), seed=0)


@pytest.fixture(scope="module")
def models(checkpoint):
    args = ModelArgs.from_name("tiny")
    ours = versus.load_our_model(checkpoint, args=args, dtype="fp32", device=CPU, n_positions=PROMPT_LEN + GEN_LEN)
    return ours, versus.load_hf_model(checkpoint, dtype="fp32", device=CPU)


# --- same config, same weights --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"qkv_bias": True},  # Qwen2Config
        {
            "tie_embeddings": True,
            "rope_theta": 500000.0,
            "rope_scaling": dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        },
    ],
    ids=["llama", "qwen2-biases", "llama3-rope-tied"],
)
def test_the_transformers_config_reads_back_as_the_same_model_args(changes):
    args = dataclasses.replace(ModelArgs.from_name("tiny"), **changes)
    config = json.loads(versus.hf_config(args).to_json_string())
    assert dataclasses.replace(ModelArgs.from_hf_config(config, name="tiny"), name=args.name) == args


def test_transformers_and_our_loop_generate_the_same_greedy_tokens_from_one_checkpoint(models):
    ours, hf = models
    prompt = torch.randint(256, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    cache = kv.build(
        versus.STRATEGY,
        CacheSpec.for_model(ours.args, batch_size=2, max_tokens=PROMPT_LEN + GEN_LEN, kv_dtype="fp32", device=CPU),
        {},
    )
    expected, logits = greedy_with_logits(ours, cache, prompt, GEN_LEN)
    for implementation in versus.HF_LOOPS.values():
        tokens, sample = versus.hf_generate(hf, prompt, gen_len=GEN_LEN, cache_implementation=implementation)
        # Another implementation of the same math (its own op order; measured 1.6e-7 apart on these logits): the
        # same tokens up to a near-tie (tests/greedy.py).
        assert_same_greedy_tokens(tokens, expected, logits, tol=LOGIT_TOL["fp32"])
        assert len(sample.step_ms) == GEN_LEN - 1 and sample.ttft_ms > 0


# --- rows ------------------------------------------------------------------------------------------------------------


def test_a_case_gives_one_row_per_loop_each_with_its_runner_loop_cache_and_a_positive_tpot(models, tmp_path):
    ours, hf = models
    case = tiny_case(results_dir=str(tmp_path))
    rows = versus.measure_case(case, our_model=ours, hf_model=hf, rounds=2, warmup=0)
    # `cache` is always a kvbench strategy, or null where transformers' own cache ran; `loop` says which loop.
    assert [(row["runner"], row["loop"], row["cache"]) for row in rows] == [
        ("kvbench", "kvbench", "contiguous"),
        ("transformers", "hf-dynamic", None),
        ("transformers", "hf-static", None),
        ("kvbench", "kvbench-bare", "contiguous"),
    ]
    assert all(row["tpot_ms"] > 0 and row["repeats"] == 2 and row["status"] == "ok" for row in rows)
    assert len({row["point_id"] for row in rows}) == len(rows)
    assert_no_near_tie(point_logits(case, model=ours), tol=LOGIT_TOL["fp32"])  # so rounding cannot flip a token
    assert len({row["output_digest"] for row in rows}) == 1  # fp32: every loop made the same tokens
    assert len({row["bytes_per_step"] for row in rows}) == 1  # one analytic step for every loop
    for row in rows:  # the row contract accepts them
        disk.write_point(row | {"sweep_id": "bench-test"}, tmp_path)


def test_rounds_run_every_loop_once_alternating_the_order_after_a_warm_up_each():
    calls = []

    def loop(name):
        return lambda: calls.append(name) or f"{name}{len(calls)}"

    measured = versus.interleave({name: loop(name) for name in "ABC"}, rounds=3, warmup=1)
    assert "".join(calls) == "ABC" + "ABC" + "CBA" + "ABC"  # no loop always first: position effects cancel
    assert measured == {"A": ["A4", "A9", "A10"], "B": ["B5", "B8", "B11"], "C": ["C6", "C7", "C12"]}


# --- timing ---------------------------------------------------------------------------------------------------------


def test_the_streamer_clock_makes_ttft_from_the_prompt_put_and_a_step_per_later_token(monkeypatch):
    stamps = iter([10.0, 10.5, 10.6, 10.8])  # seconds: prompt, token 1, 2, 3
    monkeypatch.setattr(versus.time, "perf_counter", lambda: next(stamps))
    clock = versus.StreamerClock()
    for _ in range(4):
        clock.put(torch.zeros(1))
    sample = clock.sample(gen_len=3)
    assert sample.ttft_ms == pytest.approx(500) and sample.step_ms == pytest.approx([100, 200])


def test_the_bare_timer_stamps_only_prefill_and_decode_and_spreads_decode_over_the_steps(monkeypatch):
    stamps = iter([1.0, 1.2, 2.0])  # start, end of prefill, end of the last step
    monkeypatch.setattr(versus.time, "perf_counter", lambda: next(stamps))
    timer = versus.BareTimer(CPU, n_marks=5)
    timer.start()
    for _ in range(5):  # the prefill's mark, then four steps': only the first and the last read the clock
        timer.mark()
    intervals = timer.intervals_ms()
    assert intervals[0] == pytest.approx(200) and intervals[1:] == pytest.approx([200] * 4)


# --- the table's formulas -------------------------------------------------------------------------------------------


def test_bandwidth_fraction_is_bytes_per_step_over_tpot_over_the_memory_roof():
    # 3 GB a step in 100 ms is 30 GB/s: three quarters of 40 GB/s
    assert versus_table.bw_fraction(bytes_per_step=3e9, tpot_ms=100, peak_bw_gbps=40) == pytest.approx(0.75)
    assert versus_table.bw_fraction(bytes_per_step=3e9, tpot_ms=100, peak_bw_gbps=None) is None


def test_speedup_is_their_tpot_over_ours_and_overhead_is_probed_over_bare_minus_one():
    assert versus_table.speedup(ours_tpot_ms=10, theirs_tpot_ms=15) == pytest.approx(1.5)
    assert versus_table.overhead_fraction(probed_tpot_ms=10.2, bare_tpot_ms=10) == pytest.approx(0.02)


def fake_rows(*, batch_size: int, tpot_ms: dict[str, float]) -> list[dict]:
    return [
        {
            "loop": loop,
            "cache": None if loop in versus.HF_LOOPS else versus.STRATEGY,
            "runner": "transformers" if loop in versus.HF_LOOPS else "kvbench",
            "model": "tiny",
            "dtype": "fp32",
            "batch_size": batch_size,
            "prompt_len": PROMPT_LEN,
            "gen_len": GEN_LEN,
            "tpot_ms": tpot_ms[loop],
            "ttft_ms": 1.0,
            "decode_tok_s": batch_size * 1e3 / tpot_ms[loop],
            "bytes_per_step": 8e8,  # 8e8 bytes in 10 ms is 80 GB/s
            "peak_bw_gbps": 100.0,
            "output_digest": "same",
            "repeats": 5,
        }
        for loop in versus.LOOPS
    ]


def test_the_verdict_compares_with_the_faster_transformers_cache_and_holds_only_batch_one_to_bandwidth():
    tpot_ms = {"kvbench": 10.0, "hf-dynamic": 20.0, "hf-static": 16.0, "kvbench-bare": 9.9}
    verdict = versus_table.case_verdict(fake_rows(batch_size=1, tpot_ms=tpot_ms))
    assert verdict["best_hf"] == "hf-static" and verdict["speedup_vs_best"] == pytest.approx(1.6)
    assert verdict["ours_bw_fraction"] == pytest.approx(0.8) and verdict["meets_bw"] is True
    assert verdict["overhead"] == pytest.approx(0.1 / 9.9) and verdict["meets_overhead"] is True
    assert versus_table.case_verdict(fake_rows(batch_size=8, tpot_ms=tpot_ms))["meets_bw"] is None


def test_the_table_has_a_line_per_loop_and_a_verdict_per_case():
    table = versus_table.format_table(
        fake_rows(batch_size=1, tpot_ms={"kvbench": 10.0, "hf-dynamic": 12.0, "hf-static": 14.0, "kvbench-bare": 10.5})
    )
    lines = table.splitlines()
    assert sum("transformers" in line for line in lines) == 2 and "1.20x" in table and "80%" in table
    assert lines[-1].split()[3:] == ["yes", "(80%)", "no", "(1.20x", "hf-dynamic)", "yes", "(-4.8%)", "yes"]


def test_the_tables_are_data_frames_printed_whole_with_runner_loop_and_cache_apart():
    rows = fake_rows(
        batch_size=1, tpot_ms={"kvbench": 10.0, "hf-dynamic": 12.0, "hf-static": 14.0, "kvbench-bare": 10.5}
    )
    loops = versus_table.loops_table(rows)
    assert list(loops[["runner", "loop", "cache"]].itertuples(index=False, name=None)) == [
        ("kvbench", "kvbench", "contiguous"),
        ("transformers", "hf-dynamic", "-"),  # transformers' own cache: no kvbench strategy ran
        ("transformers", "hf-static", "-"),
        ("kvbench", "kvbench-bare", "contiguous"),
    ]
    table = versus_table.format_table(rows)
    assert table.startswith(loops.to_string(index=False) + "\n")
    assert table.endswith("\n" + versus_table.verdicts_table(rows).to_string(index=False))


def test_the_floor_table_prints_the_floors_run_returned_it():
    from experiments import versus as versus_cli

    rows = [row | {"tpot_ms": 10.0} for row in fake_rows(batch_size=1, tpot_ms=dict.fromkeys(versus.LOOPS, 10.0))]
    floor = versus_cli.Floor(case=tiny_case(batch_size=1), linear_ms=4.0, linear_bytes=200_000_000)  # 50 GB/s
    (header, line, _) = versus_cli.floor_table(rows, [floor]).splitlines()
    assert header.split()[:3] == ["model", "dtype", "batch"]
    assert line.split() == ["tiny", "fp32", "1", "4.00", "50.0", "50%", "10.00", "40%"]
    assert not hasattr(versus_cli, "floors")  # returned by run(), not kept in the module


@pytest.mark.parametrize(("raised", "status"), [(RuntimeError("boom"), "error"), (MemoryError("no room"), "oom")])
def test_a_failed_case_is_a_row_per_loop_whose_cache_is_a_strategy_or_null(raised, status):
    from experiments import versus as versus_cli

    rows = versus_cli.failure_rows(tiny_case(), raised)
    assert [(row["runner"], row["loop"], row["cache"]) for row in rows] == [
        ("kvbench", "kvbench", "contiguous"),
        ("transformers", "hf-dynamic", None),
        ("transformers", "hf-static", None),
        ("kvbench", "kvbench-bare", "contiguous"),
    ]
    assert all(row["status"] == status and str(raised) in row["error"] for row in rows)
    assert len({row["point_id"] for row in rows}) == len(rows)


# --- the command line -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "fp32,fp64"], "dtype: unknown value 'fp64'; allowed: fp32, fp16, bf16"),
        (["--batch", "1,x"], "batch: 'x' is not a positive integer"),
        (["--model", "gpt-5"], "model: unknown preset 'gpt-5'"),
        (["--rounds", "0"], "rounds: must be at least 1"),
        (["--model", "small", "--prompt-len", "8190"], "prompt_len + gen_len: 8222 exceeds small's 8192 positions"),
        (["--model", "small", "--levers", "fused,turbo"], "levers: unknown value 'turbo'; allowed: fused, compile"),
    ],
)
def test_bad_input_stops_with_one_line_naming_the_field_before_anything_runs(argv, message, tmp_path, capsys):
    from experiments import versus as versus_cli

    with pytest.raises(SystemExit) as stopped:
        versus_cli.main([*argv, "--results-dir", str(tmp_path)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written


@pytest.mark.slow
def test_the_quick_bench_writes_a_row_per_loop_and_case_and_prints_the_table_last(tmp_path, capsys):
    from experiments import versus as versus_cli

    assert versus_cli.main(["--quick", "--batch", "1", "--results-dir", str(tmp_path)]) == 0
    (folder,) = tmp_path.glob("bench-*")
    rows = disk.load(folder)
    side = rows[rows["lever"].isna()]  # the side-by-side's loops; the levers' rows follow
    assert sorted(side["loop"]) == sorted(versus.LOOPS) and set(rows["sweep_id"]) == {folder.name}
    assert set(rows["cache"].dropna()) == {versus.STRATEGY} and rows["cache"].isna().sum() == len(versus.HF_LOOPS)
    assert (rows["status"] == "ok").all() and rows["peak_bw_gbps"].notna().all()  # quick ceilings were measured
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].split()[:3] == ["tiny", "fp32", "1"]
    # The quick levers (no compile: inductor's build is slow), in rows of the bare loop, each variant's ratio printed.
    lever_rows = rows[rows["lever"].notna()]
    assert list(lever_rows["lever"].sort_values()) == ["baseline", "pinned-threads", "unfused"]
    assert set(lever_rows["loop"]) == {versus.BARE} and lever_rows["peak_read_bw_gbps"].notna().all()
    ratios = {
        line.split()[1]: line.split()[6]
        for line in out.splitlines()
        if line.split()[:1] in (["unfused"], ["pinned-threads"])
    }
    assert set(ratios) == {"fused", "threads"} and all(ratio.endswith("x") for ratio in ratios.values())
