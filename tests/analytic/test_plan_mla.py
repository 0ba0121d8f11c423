"""The planner knows MLA: bytes per token, each layout's allocation, the ledger's and the serving planner's
concurrency, and the forward's transients on each decode path.

Bytes per token = layers × (kv_lora_rank + qk_rope_head_dim) × bytes (DeepSeek-V2, DeepSeek-AI 2024, section
2.1.2), against GQA's 2 × layers × kv_heads × head_dim × bytes.
"""

import pytest

from harness.analytic.activations import forward_bytes
from harness.analytic.ledger import kv_bytes_allocated, kv_bytes_per_token, ledger
from harness.config import Workload
from harness.serve.budget import kv_budget
from harness.serve.concurrency import predict_concurrency
from harness.serve.requests import Request

LATENT_ROW = 512 + 64  # kv_lora_rank + qk_rope_head_dim: c_kv and the shared RoPE key


def test_deepseek_v2_lite_caches_31104_bytes_a_token_in_bf16():
    assert kv_bytes_per_token("deepseek-v2-lite", "bf16") == 27 * LATENT_ROW * 2 == 31104


def test_deepseek_v3_caches_70272_bytes_a_token_in_bf16():
    assert kv_bytes_per_token("deepseek-v3", "bf16") == 61 * LATENT_ROW * 2 == 70272


def test_mla_caches_a_quarter_of_llama_3_1_8bs_bytes_a_token():
    assert kv_bytes_per_token("llama-3.1-8b", "bf16") == 2 * 32 * 8 * 128 * 2  # 131072
    assert kv_bytes_per_token("llama-3.1-8b", "bf16") / kv_bytes_per_token("deepseek-v2-lite", "bf16") > 4


@pytest.mark.parametrize(
    "kv_dtype, per_layer",
    [
        ("fp8_e4m3", LATENT_ROW + 4),  # one fp32 scale per token and row
        ("int8", LATENT_ROW + 4),
        ("int4", LATENT_ROW // 2 + 8 * LATENT_ROW // 32),  # keys' KIVI: a scale and a zero per channel per 32 tokens
    ],
)
def test_quantized_latent_rows_carry_one_sides_scales(kv_dtype, per_layer):
    assert kv_bytes_per_token("deepseek-v2-lite", kv_dtype) == 27 * per_layer


@pytest.mark.parametrize("cache", [{"name": "contiguous"}, {"name": "paged", "block_size": 16}])
def test_each_layout_allocates_one_latent_row_per_token_and_layer(cache):
    allocated = kv_bytes_allocated(
        "deepseek-v2-lite",
        cache=cache["name"],
        kv_dtype="bf16",
        batch_size=3,
        prompt_len=250,
        gen_len=6,
        **{k: v for k, v in cache.items() if k != "name"},
    )
    assert allocated == 3 * 256 * 27 * LATENT_ROW * 2  # 256 tokens: whole blocks of 16


def test_an_fp8_latent_allocates_one_scale_per_token_and_layer():
    w = Workload(model={"name": "deepseek-v2-lite"}, kv_dtype="fp8_e4m3", batch_size=2, prompt_len=100, gen_len=4)
    allocation = w.layout().allocation(w.kv_shape())
    assert allocation.data_bytes == 2 * 104 * 27 * LATENT_ROW
    assert allocation.scale_bytes == 2 * 104 * 27 * 4


def test_an_int4_latent_keeps_a_tail_for_its_key_groups_only():
    """Keys wait for a whole group of 32 (residual + 31 tokens); MLA has no separate values to wait for."""
    w = Workload(model={"name": "deepseek-v2-lite"}, kv_dtype="int4", kv_residual=16, prompt_len=200, gen_len=8)
    assert w.layout().allocation(w.kv_shape()).tail_bytes == 27 * 1 * (16 + 31) * LATENT_ROW * 2


def test_a_latent_read_back_decodes_one_side():
    """fp8 read back: the row's values decoded to the compute dtype, not K and V."""
    w = Workload(model={"name": "deepseek-v2-lite"}, kv_dtype="fp8_e4m3", prompt_len=100, gen_len=4)
    _, _, result = w.layout().transients(w.kv_shape(), n_seqs=2, n_new=1, n_keys=100)
    assert result == 2 * 100 * LATENT_ROW * 2


def test_the_ledger_fits_more_32k_requests_of_deepseek_v2_lite_than_of_llama_in_80_gib():
    def concurrency(model: str) -> int:
        w = Workload(model={"name": model}, prompt_len=32768 - 256, gen_len=256)
        return ledger(w, memory_gb=80, device="cuda", runtime_overhead_bytes=0).max_concurrency

    assert concurrency("deepseek-v2-lite") > 2 * concurrency("llama-3.1-8b")


@pytest.mark.parametrize("model, expected", [("deepseek-v2-lite", 67), ("llama-3.1-8b", 16)])
def test_a_64_gib_kv_budget_holds_4x_the_32k_requests_under_mla(model, expected):
    """floor(64 GiB / (32768 tokens × bytes a token)): 64 × 2^30 / (32768 × 31104) = 67.4, / (32768 × 131072) = 16."""
    w = Workload(model={"name": model}, cache={"name": "paged", "block_size": 16})
    budget = kv_budget(w, max_model_len=32768, kv_memory_gb=64)
    requests = [Request(request_id=i, arrival_s=0.0, prompt_len=32768 - 256, output_len=256) for i in range(128)]
    predicted = predict_concurrency(w, requests, kv_budget_bytes=budget.kv_bytes, max_model_len=32768)
    assert predicted.predicted_max_running_at_peak == expected


def test_naive_decode_holds_every_keys_decompressed_k_and_v():
    """At decode, naive's transient is at least one layer's K [H, S, n + r] and kv_b's output [H·(n + v)] per key."""
    absorbed = Workload(model={"name": "deepseek-v2-lite"}, prompt_len=4096, gen_len=4)
    naive = absorbed.replace()
    naive.mla_path = "naive"  # the config's field, when it lands; the planner reads it by getattr
    sizes = {
        name: forward_bytes(w, n_seqs=2, n_new=1, n_keys=4096) for name, w in (("absorbed", absorbed), ("naive", naive))
    }
    decompressed = 2 * 4096 * 16 * ((128 + 128) + (128 + 64)) * 2  # bytes: B × S × H × (kv_b out + K) × bf16
    assert sizes["naive"] >= decompressed
    assert sizes["absorbed"] < decompressed / 100  # the latent is read in place: the logits are its peak


def test_an_unknown_mla_path_is_one_line_naming_the_field():
    w = Workload(model={"name": "deepseek-v2-lite"}, prompt_len=64, gen_len=4)
    w.mla_path = "fused"
    with pytest.raises(ValueError, match=r"^mla_path: 'fused' is not a decode path; allowed: absorbed, naive$"):
        forward_bytes(w, n_seqs=1, n_new=1, n_keys=64)
