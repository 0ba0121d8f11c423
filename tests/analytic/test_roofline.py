"""The analytic step model against hand arithmetic, the real caches' storage, and the roofline's limits."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness import kv
from harness.analytic.roofline import DENSE, decode_step_cost, kv_bytes_per_token_read, mean_decode_cost, prefill_cost
from harness.analytic.roofline_row import critical_batch, critical_context, ridge_point, roofline_columns
from harness.config import RunConfig, Workload
from harness.device import ceilings
from harness.kv.base import CacheSpec
from harness.kv.shape import KVShape
from harness.modeling.model_args import ModelArgs
from harness.run import point

BF16 = dict(dtype="bf16", kv_dtype="bf16")
H100 = dict(peak_bw_gbps=3350.0, peak_tflops=989.0)  # H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16
RIDGE_H100 = 989e12 / 3350e9  # 295.2 FLOPs per byte

# Hand arithmetic from the presets' Hugging Face shapes, bf16 (2 bytes), decode at context 1024.
# Llama-3.1-8B: dim 4096, 32 layers, 32 query heads and 8 KV heads of 128, SwiGLU 14336, vocab 128256.
LAYER_MATMULS_8B = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336  # wqkv, wo, w13, w2: 218,103,808
LLAMA_31_8B = dict(
    # layers (+ 2 norms each), final norm, lm_head, and only the embedding rows looked up
    weights_fixed=(32 * (LAYER_MATMULS_8B + 2 * 4096) + 4096 + 128256 * 4096) * 2,  # 15,009,849,344
    weights_per_sequence=4096 * 2,
    kv_per_sequence=1024 * (2 * 32 * 8 * 128 * 2),  # K and V, 32 layers, 8 KV heads: 128 KiB a token
    # matmuls + lm_head on the last position + attention over 1024 keys with all 32 query heads
    flops_per_sequence=2 * 32 * LAYER_MATMULS_8B + 2 * 4096 * 128256 + 4 * 32 * 32 * 128 * 1024,  # 15,546,187,776
    # embedding out, then per layer 4·dim + 4·q_dim + 2·kv_dim + 3·ffn, then lm_head in and logits out
    activations_per_sequence=(4096 + 32 * (4 * 4096 + 4 * 4096 + 2 * 1024 + 3 * 14336) + 4096 + 128256) * 2,
    kv_write_per_sequence=2 * 32 * 8 * 128 * 2,
)
# Llama-2-7B: dim 4096, 32 layers, 32 heads, all of them KV heads (MHA), SwiGLU 11008, vocab 32000.
LAYER_MATMULS_7B = 4096 * (3 * 4096) + 4096 * 4096 + 3 * 4096 * 11008  # 202,375,168
LLAMA_2_7B = dict(
    weights_fixed=(32 * (LAYER_MATMULS_7B + 2 * 4096) + 4096 + 32000 * 4096) * 2,  # 13,214,687,232
    weights_per_sequence=4096 * 2,
    kv_per_sequence=1024 * (2 * 32 * 32 * 128 * 2),  # 512 KiB a token: 4x Llama-3.1-8B's
    flops_per_sequence=2 * 32 * LAYER_MATMULS_7B + 2 * 4096 * 32000 + 4 * 32 * 32 * 128 * 1024,  # 13,751,025,664
    activations_per_sequence=(4096 + 32 * (4 * 4096 + 4 * 4096 + 2 * 4096 + 3 * 11008) + 4096 + 32000) * 2,
    kv_write_per_sequence=2 * 32 * 32 * 128 * 2,
)


def shaped(args: ModelArgs, **fields) -> KVShape:
    """The roofline's shape of args, bf16 unless `fields` say otherwise."""
    return KVShape(model=args, **(BF16 | fields))


def decode(args: ModelArgs, batch_size: int = 1, context_len: int = 1024, layout=DENSE, **fields):
    return decode_step_cost(shaped(args, batch_size=batch_size, **fields), context_len=context_len, layout=layout)


@pytest.mark.parametrize("preset, hand", [("llama-3.1-8b", LLAMA_31_8B), ("llama-2-7b", LLAMA_2_7B)])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_decode_cost_matches_the_hand_arithmetic(preset, hand, batch_size):
    cost = decode(ModelArgs.from_name(preset), batch_size=batch_size)
    assert cost.weight_bytes == hand["weights_fixed"] + batch_size * hand["weights_per_sequence"]
    assert cost.kv_read_bytes == batch_size * hand["kv_per_sequence"]
    assert cost.flops == batch_size * hand["flops_per_sequence"]
    total_bytes = hand["weights_fixed"] + batch_size * (
        hand["weights_per_sequence"]
        + hand["kv_per_sequence"]
        + hand["kv_write_per_sequence"]
        + hand["activations_per_sequence"]
    )
    assert cost.arithmetic_intensity == pytest.approx(batch_size * hand["flops_per_sequence"] / total_bytes, rel=1e-12)


def test_hand_figures_for_llama_31_8b_at_batch_1():
    """The same case as plain numbers: ~15 GB of weights and 128 MiB of KV for ~15.5 GFLOP, one FLOP per byte."""
    cost = decode(ModelArgs.from_name("llama-3.1-8b"))
    assert (cost.weight_bytes, cost.kv_read_bytes, cost.flops) == (15_009_857_536, 134_217_728, 15_546_187_776)
    assert cost.arithmetic_intensity == pytest.approx(1.0262, abs=1e-4)


def test_weights_read_are_the_parameters_less_the_embedding_table_plus_the_rows_looked_up():
    args = ModelArgs.from_name("llama-3.1-8b")
    embedding = args.vocab_size * args.dim
    assert decode(args, batch_size=4).weight_bytes == (args.n_params - embedding + 4 * args.dim) * 2


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
def test_kv_bytes_per_token_are_what_the_real_cache_stores(tiny_args, kv_dtype):
    """Payload and scales per token, against the contiguous cache's own buffers (int4 before its tail exists)."""
    batch_size, max_tokens, group = 2, 64, 8  # tiny's head_dim 16 takes groups of 8
    spec = CacheSpec.for_model(
        tiny_args,
        batch_size=batch_size,
        max_tokens=max_tokens,
        kv_dtype=kv_dtype,
        device=torch.device("cpu"),
        kv_group_size=group,
    )
    cache = kv.build("contiguous", spec, {})
    per_token = kv_bytes_per_token_read(tiny_args, kv_dtype, kv_group_size=group)
    assert per_token == cache.kv_bytes_allocated() / (batch_size * max_tokens)


def test_kv_read_stops_growing_past_the_window():
    args = ModelArgs.from_name("llama-3.1-8b")
    reads = [
        decode(args, context_len=n, layout=kv.layout("sliding", {"window": 4096})).kv_read_bytes
        for n in (1024, 4096, 16384)
    ]
    assert reads[0] < reads[1] == reads[2]
    assert reads[1] == 4096 * kv_bytes_per_token_read(args, "bf16")


def test_kv_traffic_scales_with_the_kv_heads_not_the_query_heads():
    gqa = ModelArgs.from_name("llama-3.1-8b")  # 8 KV heads
    mqa = dataclasses.replace(gqa, n_kv_heads=1)
    assert decode(mqa).kv_read_bytes * 8 == decode(gqa).kv_read_bytes
    assert decode(mqa).kv_write_bytes * 8 == decode(gqa).kv_write_bytes


def test_attention_flops_count_every_query_head():
    """GQA shrinks the KV, not the dot products: 4·L·H·D FLOPs per key whatever H_kv."""
    gqa = ModelArgs.from_name("llama-3.1-8b")
    mqa = dataclasses.replace(gqa, n_kv_heads=1)
    for args in (gqa, mqa):
        assert decode(args, context_len=2048).flops - decode(args, context_len=1024).flops == 4 * 32 * 32 * 128 * 1024


def test_none_reads_no_kv_and_its_flops_grow_with_the_context():
    args = ModelArgs.from_name("llama-3.1-8b")
    short, long = (decode(args, context_len=n, layout=kv.layout("none", {})) for n in (1024, 2048))
    assert short.kv_read_bytes == long.kv_read_bytes == short.kv_write_bytes == 0
    assert (
        long.flops > 2 * short.flops - decode(args, context_len=1, layout=kv.layout("none", {})).flops
    )  # superlinear: O(S²)
    assert short == prefill_cost(shaped(args, batch_size=1, prompt_len=1024), layout=kv.layout("none", {}))
    assert short.flops > 500 * decode(args, context_len=1024).flops  # a cache saves ~S times the matmuls


@pytest.mark.parametrize("kv_dtype, ratio", [("int8", 0.515625), ("fp8_e4m3", 0.515625), ("int4", 0.375)])
def test_quantized_kv_reads_a_fraction_of_bf16_plus_scales(kv_dtype, ratio):
    """head_dim 128: int8/fp8 (128 + 4 scale bytes) / 256 = 0.5 + 1/64; int4 (64 + 32) / 256 at groups of 32."""
    args = ModelArgs.from_name("llama-3.1-8b")
    assert decode(args, kv_dtype=kv_dtype).kv_read_bytes == ratio * decode(args).kv_read_bytes


def test_a_prefix_hit_computes_only_the_suffix_but_reads_the_whole_prefix_for_every_sequence():
    args = ModelArgs.from_name("llama-3.1-8b")
    miss = prefill_cost(shaped(args, batch_size=4, prompt_len=1024), layout=kv.layout("prefix", {}))
    hit = prefill_cost(shaped(args, batch_size=4, prompt_len=1024), layout=kv.layout("prefix", {}), prefix_cached=768)
    assert hit.kv_read_bytes == miss.kv_read_bytes == 4 * 1024 * kv_bytes_per_token_read(args, "bf16")
    assert hit.kv_write_bytes == miss.kv_write_bytes / 4
    assert hit.flops < miss.flops / 3


def test_a_window_caps_the_keys_each_prefill_query_sees():
    """10 queries: 1 + 2 + ... + 10 = 55 causal pairs, 1 + 2 + 3 + 4·7 = 34 with a window of 4."""
    args = ModelArgs.from_name("tiny")
    full, windowed = (
        prefill_cost(shaped(args, batch_size=3, prompt_len=10), layout=kv.layout(*strategy))
        for strategy in (("contiguous", {}), ("sliding", {"window": 4}))
    )
    per_key = 4 * args.n_layers * args.n_heads * args.head_dim
    assert full.flops - windowed.flops == 3 * (55 - 34) * per_key


def test_intensity_grows_with_batch_and_saturates_at_the_per_sequence_limit():
    args = ModelArgs.from_name("llama-3.1-8b")
    intensities = [decode(args, batch_size=b, context_len=8192).arithmetic_intensity for b in (1, 4, 16, 64, 256)]
    assert intensities == sorted(intensities)
    one, two = decode(args, context_len=8192), decode(args, batch_size=2, context_len=8192)
    limit = (two.flops - one.flops) / (two.bytes - one.bytes)  # a sequence's own FLOPs per byte
    assert decode(args, batch_size=10**7, context_len=8192).arithmetic_intensity == pytest.approx(limit, rel=1e-3)
    assert limit < RIDGE_H100 / 10  # ~18: a long context's KV keeps every batch memory-bound
    # Longer still, it falls towards attention's own 2·(H / H_kv) / bytes = 2·4 / 2 = 4 FLOPs a byte (4.9 at 128k)
    one, two = decode(args, context_len=131072), decode(args, batch_size=2, context_len=131072)
    assert 4 < (two.flops - one.flops) / (two.bytes - one.bytes) < 5


def test_critical_batch_at_short_context_is_in_the_low_hundreds_and_reaches_the_ridge():
    """The JAX scaling book's weights-only B ≈ ridge = 295 on an H100; a short context's KV and the activations add
    a few percent of bytes per sequence, so B* lands a little above it."""
    args = ModelArgs.from_name("llama-3.1-8b")
    batch = critical_batch(shaped(args), context_len=16, **H100)
    assert RIDGE_H100 < batch < 400
    assert decode(args, batch_size=batch, context_len=16).arithmetic_intensity >= RIDGE_H100
    assert decode(args, batch_size=batch - 1, context_len=16).arithmetic_intensity < RIDGE_H100


def test_beyond_the_critical_context_no_batch_reaches_the_ridge():
    args = ModelArgs.from_name("llama-3.1-8b")
    context = critical_context(shaped(args), **H100)
    assert 100 < context < 1000  # 128 KiB of bf16 KV per token: a few hundred tokens outweigh the FLOPs' reach
    assert critical_batch(shaped(args), context_len=math.ceil(context * 1.05), **H100) is None
    assert decode(args, batch_size=10**8, context_len=math.ceil(context * 1.05)).arithmetic_intensity < RIDGE_H100
    assert critical_batch(shaped(args), context_len=math.floor(context * 0.95), **H100) is not None


def test_a_window_shorter_than_the_critical_context_never_binds():
    args = ModelArgs.from_name("llama-3.1-8b")
    assert critical_context(shaped(args), layout=kv.layout("sliding", {"window": 128}), **H100) == math.inf
    assert critical_context(shaped(args), layout=kv.layout("none", {}), **H100) == math.inf


def columns(batch_size: int, **overrides):
    point = dict(batch_size=batch_size, prompt_len=16, gen_len=8, cache="contiguous", tpot_ms=20.0) | BF16 | H100
    point |= overrides
    measured = {key: point.pop(key) for key in ("tpot_ms", "ttft_ms", "peak_bw_gbps", "peak_tflops") if key in point}
    return roofline_columns(Workload(model="llama-3.1-8b", **point), **measured)


def test_bound_flips_from_memory_to_compute_as_batch_grows_at_short_context():
    assert columns(1)["bound"] == "memory"
    assert columns(columns(1)["critical_batch"])["bound"] == "compute"
    assert columns(columns(1)["critical_batch"] - 1)["bound"] == "memory"


def test_decode_columns_are_the_mean_over_the_timed_steps():
    """Steps at context 17..23 (prompt 16, 8 tokens, the first from the prefill): mean 20 = 16 + 8 / 2."""
    args = ModelArgs.from_name("llama-3.1-8b")
    mean = mean_decode_cost(shaped(args, batch_size=4, prompt_len=16, gen_len=8))
    assert columns(4)["flops_per_step"] == mean.flops == decode(args, batch_size=4, context_len=20).flops
    assert columns(4)["bytes_per_step"] == pytest.approx(decode(args, batch_size=4, context_len=20).bytes)


def test_bw_util_is_achieved_over_peak():
    row = columns(1, tpot_ms=5.0)
    assert row["achieved_bw_gbps"] == pytest.approx(row["bytes_per_step"] / 5e-3 / 1e9)
    assert row["achieved_tflops"] == pytest.approx(row["flops_per_step"] / 5e-3 / 1e12)
    assert row["bw_util"] == pytest.approx(row["achieved_bw_gbps"] / 3350)
    assert row["flops_util"] == pytest.approx(row["achieved_tflops"] / 989)
    # ~15.0 GB in 5 ms is ~3.0 TB/s: 90% of the H100's HBM
    assert row["bw_util"] == pytest.approx(0.90, abs=0.01)


def test_predicted_tpot_is_the_slower_of_compute_and_memory():
    small, large = columns(1), columns(1024)
    assert small["predicted_tpot_ms"] == pytest.approx(small["bytes_per_step"] / 3350e9 * 1e3)  # ~4.5 ms
    assert large["predicted_tpot_ms"] == pytest.approx(large["flops_per_step"] / 989e12 * 1e3)
    assert small["predicted_tpot_ms"] == pytest.approx(4.48, abs=0.01)


def test_columns_that_need_a_time_or_ceilings_are_null_without_them():
    untimed, unpeaked = columns(1, tpot_ms=None), columns(1, peak_bw_gbps=None, peak_tflops=float("nan"))
    assert untimed["achieved_bw_gbps"] is None and untimed["bw_util"] is None and untimed["bound"] == "memory"
    assert unpeaked["achieved_bw_gbps"] is not None
    for name in ("bw_util", "flops_util", "bound", "predicted_tpot_ms", "critical_batch", "critical_context"):
        assert unpeaked[name] is None
    assert unpeaked["arithmetic_intensity"] == untimed["arithmetic_intensity"]


def test_a_prefix_row_reports_the_prefill_of_a_hit():
    """prefix_len 100 with 16-token blocks shares 96 tokens: the measured prefill computes the last 32 of 128."""
    args = ModelArgs.from_name("llama-3.1-8b")
    row = columns(4, cache="prefix", prefix_len=100, prompt_len=128)
    hit = prefill_cost(shaped(args, batch_size=4, prompt_len=128), layout=kv.layout("prefix", {}), prefix_cached=96)
    assert row["prefill_arithmetic_intensity"] == hit.arithmetic_intensity


def test_ridge_point_is_flops_per_byte():
    assert ridge_point(**H100) == pytest.approx(RIDGE_H100)


def test_prefill_achieved_tflops_is_the_prefill_flops_over_ttft():
    args = ModelArgs.from_name("llama-3.1-8b")
    row = columns(4, prompt_len=128, ttft_ms=40.0)
    assert row["prefill_flops"] == prefill_cost(shaped(args, batch_size=4, prompt_len=128)).flops
    assert row["prefill_achieved_tflops"] == pytest.approx(row["prefill_flops"] / 40e-3 / 1e12)
    assert columns(4)["prefill_achieved_tflops"] is None  # no TTFT measured


def test_a_row_faster_than_its_bandwidth_roof_marks_its_ceilings_stale():
    assert columns(1, tpot_ms=5.0)["bw_util"] < 1 and columns(1, tpot_ms=5.0)["ceilings_stale"] is False
    beaten = columns(1, tpot_ms=4.0)  # ~15.0 GB in 4 ms is ~3.75 TB/s, over the 3.35 TB/s roof
    assert beaten["bw_util"] > 1 and beaten["ceilings_stale"] is True


def test_a_row_faster_than_its_compute_roof_marks_its_ceilings_stale():
    beaten = columns(1024, tpot_ms=1.0)  # batch 1024: ~16 PFLOP a step in 1 ms, 16x the 989 TFLOP/s roof
    assert beaten["flops_util"] > 1 and beaten["ceilings_stale"] is True


def test_ceilings_stale_is_unknown_without_a_time_or_roofs_not_false():
    assert columns(1, tpot_ms=None)["ceilings_stale"] is None
    assert columns(1, peak_bw_gbps=None, peak_tflops=None)["ceilings_stale"] is None
    assert columns(1, peak_tflops=None)["ceilings_stale"] is False  # the bandwidth alone is known, and within its roof


def stored_ceilings(results_dir: Path, *, copy_gbps: float, read_gbps: float | None) -> None:
    """A quick-plan-shaped Ceilings for this CPU under results_dir, with the given roofs (no measuring)."""
    measured = ceilings.Ceilings(
        fingerprint=ceilings.device_fingerprint("cpu"),
        device="cpu",
        device_name="test cpu",
        n_threads=torch.get_num_threads(),
        n_sms=None,
        total_memory_bytes=2**34,
        peak_bw_gbps=copy_gbps,
        peak_tflops={"fp32": 1.0},
        skipped={},
        median_rse={},
        copy_bytes=2**28,
        matmul_n={},
        repeats={},
        quick=True,
        fp32_matmul_precision="highest",
        measured_at="2026-12-01T00:00:00+00:00",
        torch_version=torch.__version__,
        read_bw_gbps=read_gbps,
    )
    path = ceilings.ceilings_path("cpu", results_dir)
    path.parent.mkdir(parents=True)
    path.write_text(measured.to_json())


def bench_columns(results_dir: Path, tpot_ms: float = 20.0) -> dict:
    cfg = RunConfig(
        model={"name": "small"}, device="cpu", dtype="fp32", prompt_len=16, gen_len=4, results_dir=str(results_dir)
    )
    return point.roofline_columns(cfg, args=cfg.model_args(), tpot_ms=tpot_ms)


def test_a_row_is_judged_against_the_read_roof_and_carries_both(tmp_path):
    stored_ceilings(tmp_path, copy_gbps=10.0, read_gbps=20.0)
    row = bench_columns(tmp_path)
    assert row["peak_bw_gbps"] == 20.0 and row["bw_roof"] == "read"
    assert row["peak_read_bw_gbps"] == 20.0 and row["peak_copy_bw_gbps"] == 10.0
    assert row["bw_util"] == pytest.approx(row["achieved_bw_gbps"] / 20.0)
    assert row["bound"] == "memory"  # fp32 decode at batch 1: under 1 FLOP a byte, the ridge is 1e12 / 20e9 = 50
    assert row["predicted_tpot_ms"] == pytest.approx(row["bytes_per_step"] / 20e9 * 1e3)


def test_a_row_on_ceilings_without_a_read_roof_uses_the_copy_and_says_so(tmp_path):
    stored_ceilings(tmp_path, copy_gbps=10.0, read_gbps=None)
    row = bench_columns(tmp_path)
    assert row["peak_bw_gbps"] == 10.0 and row["bw_roof"] == "copy"
    assert row["peak_read_bw_gbps"] is None and row["peak_copy_bw_gbps"] == 10.0


def test_a_row_without_stored_ceilings_has_no_roof_and_no_stale_verdict(tmp_path):
    row = bench_columns(tmp_path)
    assert row["peak_bw_gbps"] is None and row["bw_roof"] is None and row["ceilings_stale"] is None


REFERENCE = Path(__file__).parents[2] / "results" / "reference"


def reference_rows() -> pd.DataFrame:
    """Every committed reference row that has a bw_util column (the top-ops tables beside them are not rows)."""
    files = [p for p in sorted(REFERENCE.rglob("*.parquet")) if not p.name.endswith(".ops.parquet")]
    frames = [pd.read_parquet(p).assign(file=str(p.relative_to(REFERENCE))) for p in files]
    return pd.concat([f for f in frames if "bw_util" in f.columns], ignore_index=True)


def test_no_committed_reference_row_beats_its_bandwidth_or_compute_roof():
    rows = reference_rows()
    assert rows["bw_util"].notna().sum() > 10  # the check has rows to hold to it, not just nulls
    for util in ("bw_util", "flops_util"):
        over = rows.loc[rows[util].notna() & (rows[util] > 1), ["file", util]]  # a null is "not recorded": skipped
        assert over.empty, f"{util} over 1 (stale ceilings):\n{over.to_string()}"
    if "ceilings_stale" in rows.columns:
        assert not rows["ceilings_stale"].eq(True).any()
