"""`make bench`'s levers (harness/run/levers.py): each variant computes what the baseline does, each lever's ratio
and verdict come from the rows' TPOTs, and the threads lever sets and restores what it says."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from harness import kv
from harness.errors import ConfigError
from harness.kv.base import CacheSpec
from harness.measure.timing import StepTimer
from harness.modeling.decode import compile_decode_step, generate
from harness.modeling.model import build_model, weights_bytes
from harness.modeling.model_args import ModelArgs
from harness.run import levers, versus
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens, greedy_with_logits
from tests.run.test_versus import GEN_LEN, PROMPT_LEN, tiny_case

pytest.importorskip("transformers")

CPU = torch.device("cpu")
has_cxx = pytest.mark.skipif(
    not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")),
    reason="torch.compile on the CPU needs a C++ compiler (g++, c++ or clang++) on PATH",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return versus.save_checkpoint(ModelArgs.from_name("tiny"), tmp_path_factory.mktemp("hf-tiny"), seed=0)


def load(checkpoint, *, fused: bool):
    args = ModelArgs.from_name("tiny")
    return build_model(
        args, weights=str(checkpoint), dtype=torch.float32, device=CPU, seed=0, n_positions=PROMPT_LEN + GEN_LEN,
        fused=fused,
    )  # fmt: skip


def tiny_prompt(batch_size: int = 2) -> torch.Tensor:
    return torch.randint(
        ModelArgs.from_name("tiny").vocab_size, (batch_size, PROMPT_LEN), generator=torch.Generator().manual_seed(1)
    )


def tiny_cache(batch_size: int = 2):
    spec = CacheSpec.for_model(
        ModelArgs.from_name("tiny"), batch_size=batch_size, max_tokens=PROMPT_LEN + GEN_LEN, kv_dtype="fp32", device=CPU
    )
    return kv.build("contiguous", spec, {})


# --- fused and unfused projections --------------------------------------------------------------------------------


def test_the_unfused_model_keeps_the_checkpoints_separate_projections_and_the_same_bytes(checkpoint):
    fused, unfused = load(checkpoint, fused=True), load(checkpoint, fused=False)
    names = {name for name, _ in unfused.named_parameters()}
    assert {"layers.0.attention.wq.weight", "layers.0.attention.wk.weight", "layers.0.attention.wv.weight"} <= names
    assert {"layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w3.weight"} <= names
    assert not any("wqkv" in name or "w13" in name for name in names)
    assert weights_bytes(unfused) == weights_bytes(fused)


def test_the_unfused_model_computes_the_fused_ones_logits_and_greedy_tokens(checkpoint):
    fused, unfused = load(checkpoint, fused=True), load(checkpoint, fused=False)
    prompt = tiny_prompt()
    with torch.inference_mode():
        expected = fused(prompt, start_pos=0, cache=tiny_cache())
        actual = unfused(prompt, start_pos=0, cache=tiny_cache())
    # Three GEMVs instead of one over the same rows: only the summation order may differ.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    reference, logits = greedy_with_logits(fused, tiny_cache(), prompt, GEN_LEN)
    tokens, _ = greedy_with_logits(unfused, tiny_cache(), prompt, GEN_LEN)
    assert_same_greedy_tokens(tokens, reference, logits, tol=LOGIT_TOL["fp32"])


def test_unfused_dummy_weights_are_refused_in_one_line():
    with pytest.raises(ValueError, match="^fused: False needs a checkpoint"):
        build_model(ModelArgs.from_name("tiny"), dtype=torch.float32, device=CPU, seed=0, n_positions=8, fused=False)


# --- the compiled, frozen step ------------------------------------------------------------------------------------


def test_freezing_is_refused_outside_compile_default():
    model = build_model(ModelArgs.from_name("tiny"), dtype=torch.float32, device=CPU, seed=0, n_positions=8)
    with pytest.raises(ValueError, match="^freeze: inductor's freezing needs compile=default"):
        compile_decode_step(model, tiny_cache(), mode="default", backend="eager", freeze=True)


@pytest.mark.slow
@has_cxx
def test_the_frozen_compiled_step_packs_its_linears_and_generates_the_eager_tokens(checkpoint):
    model, prompt = load(checkpoint, fused=True), tiny_prompt()
    eager, logits = greedy_with_logits(model, tiny_cache(), prompt, GEN_LEN)
    cache = tiny_cache()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = compile_decode_step(model, cache, mode="default", freeze=True)
    compiled, _ = generate(model, cache, prompt, GEN_LEN, StepTimer(CPU, n_marks=GEN_LEN), step=step)
    # Inductor's weight prepacking replaced the linears by packed ones (MKL's for fp32 on x86): 4 per tiny layer.
    packed = torch._dynamo.utils.counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
    assert packed >= 4 * model.args.n_layers
    assert_same_greedy_tokens(compiled, eager, logits, tol=LOGIT_TOL["fp32"])


# --- threads ------------------------------------------------------------------------------------------------------


def test_core_cpus_are_one_allowed_cpu_per_physical_core():
    cpus = levers.core_cpus()
    assert cpus and set(cpus) <= os.sched_getaffinity(0)
    assert len(cpus) <= levers.physical_cores()


def test_pinned_threads_sets_one_thread_per_core_and_restores_the_threads_and_affinity():
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    with levers.pinned_threads() as n:
        assert n == len(levers.core_cpus()) == torch.get_num_threads()
        assert os.sched_getaffinity(0) == set(levers.core_cpus())
    assert torch.get_num_threads() == threads and os.sched_getaffinity(0) == affinity


def test_the_threads_lever_is_left_out_on_cuda_and_an_unknown_lever_refused():
    assert levers.check_levers(["threads", "fused"], device=torch.device("cuda")) == ["fused"]
    assert levers.check_levers(["threads", "fused"], device=CPU) == ["fused", "threads"]
    with pytest.raises(ConfigError, match="^levers: unknown lever 'turbo'; allowed: fused, compile, threads or none"):
        levers.check_levers(["turbo"], device=CPU)


# --- the rows and the table ---------------------------------------------------------------------------------------


def test_measure_levers_gives_a_row_per_variant_with_the_baselines_tokens(checkpoint):
    cfg = tiny_case(batch_size=1)
    rows = levers.measure_levers(
        cfg, model=load(checkpoint, fused=True), checkpoint=checkpoint, levers=["fused", "threads"], rounds=2
    )
    assert [row["lever"] for row in rows] == ["baseline", "unfused", "pinned-threads"]
    assert {row["loop"] for row in rows} == {versus.BARE} and len({row["point_id"] for row in rows}) == 3
    assert all(row["status"] == "ok" and row["tpot_ms"] > 0 for row in rows)
    assert len({row["output_digest"] for row in rows}) == 1  # tiny's margins are far above any rounding here


def fake_levers(tpot_ms: dict[str, float], cv: float = 0.01) -> list[dict]:
    return [
        {
            "lever": lever, "model": "tiny", "dtype": "fp32", "batch_size": 1, "repeats": 5, "tpot_ms": ms,
            "tpot_cv": cv, "decode_tok_s": 1000 / ms, "bytes_per_step": 1e8, "peak_read_bw_gbps": 20.0,
            "output_digest": "same", "compile_s": 30.0 if lever == "compiled" else None,
        }
        for lever, ms in tpot_ms.items()
    ]  # fmt: skip


def test_each_levers_ratio_is_its_tpot_off_over_on_and_its_verdict_beyond_the_spread():
    rows = fake_levers({"baseline": 10.0, "unfused": 12.0, "compiled": 8.0, "pinned-threads": 10.05})
    assert levers.lever_speedup(rows, "fused") == pytest.approx(1.2)  # fusing is on in the baseline
    assert levers.lever_speedup(rows, "compile") == pytest.approx(1.25)
    assert levers.lever_verdict(rows, "fused") == "keep" and levers.lever_verdict(rows, "threads") == "noise"
    slower = fake_levers({"baseline": 10.0, "compiled": 12.0})
    assert levers.lever_verdict(slower, "compile") == "drop"
    assert levers.lever_verdict(fake_levers({"baseline": 10.0, "compiled": 9.0}, cv=0.2), "compile") == "noise"


def test_the_levers_table_has_each_levers_ratio_read_roof_and_compile_time():
    rows = fake_levers({"baseline": 10.0, "unfused": 12.0, "compiled": 8.0, "pinned-threads": 10.05})
    table = levers.levers_table(rows)
    assert list(table["variant"]) == ["baseline", "unfused", "compiled", "pinned-threads"]
    assert list(table["lever on/off"]) == ["-", "1.20x", "1.25x", "1.00x"]
    assert list(table["read roof"]) == ["50%", "42%", "62%", "50%"]  # 1e8 B / 10 ms = 10 GB/s of 20
    assert list(table["compile s"]) == ["-", "-", "30.0", "-"]
    assert levers.format_levers(rows).startswith(table.to_string(index=False) + "\nlevers: tiny fp32 batch 1")
