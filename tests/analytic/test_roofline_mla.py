"""The roofline of MLA (harness.analytic.roofline_mla): its weights, its KV read, and the two decode paths' FLOPs and bytes.

Attention's own intensity is the slope of a decode step in the context: one key more adds its FLOPs (every query
head against it) and its bytes (the cached row, and naive's decompressed K/V), whatever the matmuls and weights do.
"""

import dataclasses

import pytest

from harness.analytic.roofline import decode_step_cost, kv_bytes_per_token_read, prefill_cost
from harness.analytic.roofline_row import roofline_columns
from harness.config import Workload
from harness.kv.shape import KVShape
from harness.modeling.model_args import ModelArgs

V2_LITE = ModelArgs.from_name("deepseek-v2-lite")
V3 = ModelArgs.from_name("deepseek-v3")
LLAMA = ModelArgs.from_name("llama-3.1-8b")
BF16 = 2  # bytes


def per_key(args: ModelArgs, mla_path: str = "absorbed", context_len: int = 4096) -> tuple[float, float]:
    """(FLOPs, bytes) one more attended key adds to a decode step of one sequence."""
    shape = KVShape(model=args, batch_size=1, dtype="bf16", kv_dtype="bf16", mla_path=mla_path)
    before = decode_step_cost(shape, context_len=context_len)
    after = decode_step_cost(shape, context_len=context_len + 1)
    return after.flops - before.flops, after.bytes - before.bytes


def test_mla_reads_one_latent_row_a_token_and_layer():
    assert kv_bytes_per_token_read(V2_LITE, "bf16") == 27 * (512 + 64) * BF16
    assert kv_bytes_per_token_read(V3, "bf16") == 61 * (512 + 64) * BF16
    assert kv_bytes_per_token_read(V2_LITE, "int8") == 27 * (576 + 4)  # one fp32 scale per token and row
    assert kv_bytes_per_token_read(V2_LITE, "int4") == 27 * (576 / 2 + 8 * 576 / 32)  # keys' KIVI layout


def test_absorbed_attention_intensity_is_2h_2r_plus_p_over_r_plus_p_bytes():
    heads, rank, rope = V2_LITE.n_heads, V2_LITE.kv_lora_rank, V2_LITE.qk_rope_head_dim
    flops, moved = per_key(V2_LITE, "absorbed")
    assert flops == V2_LITE.n_layers * 2 * heads * (2 * rank + rope)  # q·k over R + P, p·v over R, H heads
    assert moved == V2_LITE.n_layers * (rank + rope) * BF16  # the latent row, nothing decompressed
    assert flops / moved == pytest.approx(2 * heads * (2 * rank + rope) / ((rank + rope) * BF16), rel=1e-12)
    assert flops / moved == pytest.approx(30.22, abs=0.01)


def test_gqa_attention_intensity_is_2_group_over_bytes():
    flops, moved = per_key(LLAMA)
    assert flops / moved == pytest.approx(2 * (LLAMA.n_heads / LLAMA.n_kv_heads) / BF16, rel=1e-12)  # = 4


def test_mla_absorbed_attention_intensity_is_far_above_gqa():
    lite, v3, llama = (per_key(args) for args in (V2_LITE, V3, LLAMA))
    assert lite[0] / lite[1] > 7 * llama[0] / llama[1]  # 30.2 against 4
    assert v3[0] / v3[1] > 60 * llama[0] / llama[1]  # 242: 128 heads share each latent byte


def test_naive_decompresses_every_key_it_attends_each_step():
    heads, rank = V2_LITE.n_heads, V2_LITE.kv_lora_rank
    nope, rope, v = V2_LITE.qk_nope_head_dim, V2_LITE.qk_rope_head_dim, V2_LITE.v_head_dim
    flops, moved = per_key(V2_LITE, "naive")
    decompress = 2 * rank * heads * (nope + v)  # kv_b_proj over the key's latent
    attend = 2 * heads * (nope + rope) + 2 * heads * v  # multi-head attention over the decompressed K and V
    assert flops == V2_LITE.n_layers * (decompress + attend)
    kv_activations = 2 * heads * (nope + rope + v) * BF16  # K and V written, then read by attention
    assert moved == V2_LITE.n_layers * ((rank + rope) * BF16 + kv_activations)
    absorbed_flops, absorbed_bytes = per_key(V2_LITE, "absorbed")
    assert flops > 100 * absorbed_flops and moved > 18 * absorbed_bytes


def test_absorbed_pays_the_absorption_once_per_token_instead_of_per_key():
    """At the first token (one key), the two paths differ by the absorption (per query) minus the decompression of
    that one key, both 2·R·H·(n + v) per layer, and by attention's per-pair cost."""
    shape = dict(model=V2_LITE, batch_size=1, dtype="bf16", kv_dtype="bf16")
    absorbed = decode_step_cost(KVShape(mla_path="absorbed", **shape), context_len=1).flops
    naive = decode_step_cost(KVShape(mla_path="naive", **shape), context_len=1).flops
    heads, rank, rope = V2_LITE.n_heads, V2_LITE.kv_lora_rank, V2_LITE.qk_rope_head_dim
    pair_absorbed = 2 * heads * (2 * rank + rope)
    pair_naive = 2 * heads * (V2_LITE.qk_nope_head_dim + rope + V2_LITE.v_head_dim)
    assert absorbed - naive == V2_LITE.n_layers * (pair_absorbed - pair_naive)


def test_mla_weights_are_the_deepseek_v2_lite_projections():
    """DeepSeek-V2-Lite's config.json: q_proj 2048 -> 16·192, kv_a_proj_with_mqa 2048 -> 576, kv_a_layernorm 512,
    kv_b_proj 512 -> 16·256, o_proj 16·128 -> 2048; the dense FFN 3·2048·11264, two norms."""
    per_layer = 2048 * 3072 + 2048 * 576 + 512 * 4096 + 2048 * 2048 + 3 * 2048 * 11264 + 2 * 2048 + 512
    params = 27 * per_layer + 2048 + 102400 * 2048 + 1 * 2048  # final norm, lm_head, one embedding row
    cost = decode_step_cost(KVShape(model=V2_LITE, batch_size=1, dtype="bf16", kv_dtype="bf16"), context_len=10)
    assert cost.weight_bytes == params * BF16


def test_q_compression_adds_q_a_q_b_and_their_norm():
    q_plain = dataclasses.replace(V3, q_lora_rank=None)
    shape = dict(batch_size=1, dtype="bf16", kv_dtype="bf16")
    low_rank = decode_step_cost(KVShape(model=V3, **shape), context_len=10).weight_bytes
    plain = decode_step_cost(KVShape(model=q_plain, **shape), context_len=10).weight_bytes
    q_out = 128 * 192
    assert low_rank - plain == 61 * (7168 * 1536 + 1536 * q_out + 1536 - 7168 * q_out) * BF16


def test_a_prefill_runs_decompressed_whatever_the_decode_path():
    heads, rank = V2_LITE.n_heads, V2_LITE.kv_lora_rank
    nope, rope, v = V2_LITE.qk_nope_head_dim, V2_LITE.qk_rope_head_dim, V2_LITE.v_head_dim
    shape = dict(model=V2_LITE, batch_size=2, prompt_len=64, dtype="bf16", kv_dtype="bf16")
    naive, absorbed = (prefill_cost(KVShape(mla_path=path, **shape)) for path in ("naive", "absorbed"))
    assert (
        naive == absorbed
    )  # harness.modeling.mla: a forward of several tokens decompresses, as vLLM's MLA prefill does
    pairs = 64 * 65 // 2  # causal (query, key) pairs of one prompt
    kv_b = 2 * rank * heads * (nope + v)  # kv_b_proj over one latent
    naive_layer = 64 * kv_b + pairs * 2 * heads * (nope + rope + v)  # 64 visible keys decompressed once
    absorbed_layer = 64 * kv_b + pairs * 2 * heads * (2 * rank + rope)  # what the absorbed form would have cost
    assert absorbed_layer > 1.15 * naive_layer  # why: the latent's 2R + P = 1088 against n + r + v = 320 per pair
    one_token = dict(model=V2_LITE, batch_size=2, prompt_len=1, dtype="bf16", kv_dtype="bf16")
    assert prefill_cost(KVShape(mla_path="naive", **one_token)) != prefill_cost(KVShape(**one_token))


def test_gqa_ignores_the_mla_path():
    shape = dict(model=LLAMA, batch_size=4, dtype="bf16", kv_dtype="bf16")
    assert decode_step_cost(KVShape(mla_path="naive", **shape), context_len=1000) == decode_step_cost(
        KVShape(**shape), context_len=1000
    )


def test_an_unknown_mla_path_is_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"^mla_path: 'fused' is not a decode path; allowed: absorbed, naive$"):
        decode_step_cost(KVShape(model=V2_LITE, dtype="bf16", kv_dtype="bf16", mla_path="fused"), context_len=8)


def test_a_rows_roofline_takes_the_workloads_mla_path():
    """roofline_columns reads w.mla_path (absorbed when the config has no such field)."""
    workload = Workload(model={"name": "deepseek-v2-lite"}, prompt_len=512, gen_len=8)
    absorbed = roofline_columns(workload, tpot_ms=10.0, peak_bw_gbps=3350.0, peak_tflops=989.0)
    workload.mla_path = "naive"
    naive = roofline_columns(workload, tpot_ms=10.0, peak_bw_gbps=3350.0, peak_tflops=989.0)
    assert naive["flops_per_step"] > 10 * absorbed["flops_per_step"]  # 512 keys decompressed, 27 layers
    assert naive["arithmetic_intensity"] > absorbed["arithmetic_intensity"]
