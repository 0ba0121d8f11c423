"""attn_impl=eager|sdpa: eager attention writes the scores out, SDPA's fused kernels do not; both compute the same."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from harness import kv
from harness.analytic import activations
from harness.analytic.roofline import decode_step_cost, eager_score_bytes_per_pair, prefill_cost
from harness.config import ConfigError, RunConfig, Workload
from harness.kv.base import CacheSpec, attention
from harness.kv.shape import KVShape
from harness.measure import profile
from harness.modeling.model import build_model
from harness.modeling.model_args import ModelArgs
from harness.store import disk
from tests.analytic.test_planner import PeakLiveBytes, malloc_live_bytes_probe
from tests.greedy import assert_same_greedy_tokens, greedy_with_logits

CPU = torch.device("cpu")
TINY = ModelArgs.from_name("tiny")


def qkv(batch: int, n_heads: int, n_kv_heads: int, n_new: int, n_keys: int, head_dim: int = 32):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, n_heads, n_new, head_dim, generator=generator)
    k, v = (torch.randn(batch, n_kv_heads, n_keys, head_dim, generator=generator) for _ in "kv")
    return q, k, v


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (8, 2), (8, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize(("n_new", "n_keys"), [(1, 37), (37, 37), (12, 50)])  # decode, prefill, a chunk mid-sequence
def test_eager_attention_equals_sdpa_in_fp32(n_heads, n_kv_heads, n_new, n_keys):
    q, k, v = qkv(2, n_heads, n_kv_heads, n_new, n_keys)
    start_pos = n_keys - n_new
    eager = attention(q, k, v, start_pos, impl="eager")
    fused = attention(q, k, v, start_pos, impl="sdpa")
    # Same math in a different order (a materialized softmax against an online one): fp32 rounding, ~1e-7 relative.
    torch.testing.assert_close(eager, fused, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("cache", "options"), [("contiguous", {}), ("paged", {"block_size": 16}), ("sliding", {"window": 24, "sinks": 2})]
)
def test_a_generation_with_eager_attention_makes_the_same_tokens_as_sdpa(cache, options):
    model = build_model(TINY, dtype=torch.float32, device=CPU, seed=0, n_positions=96)
    prompt = torch.randint(TINY.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    spec = CacheSpec.for_model(TINY, batch_size=2, max_tokens=72, kv_dtype="fp32", device=CPU, dtype="fp32")
    with torch.inference_mode():
        expected, logits = greedy_with_logits(model, kv.build(cache, spec, options), prompt, 32)
        eager_cache = kv.build(cache, dataclasses.replace(spec, attn_impl="eager"), options)
        actual, _ = greedy_with_logits(model, eager_cache, prompt, 32)
    assert_same_greedy_tokens(actual, expected, logits, tol=1e-4)  # fp32: the logits agree to ~1e-6


def attention_peak_bytes(impl: str, n_tokens: int) -> int:
    """Bytes live at the peak of one prefill attention over n_tokens (4 sequences, 8 heads), beyond its inputs."""
    live = malloc_live_bytes_probe()
    if live is None:
        pytest.skip("needs glibc's mallinfo2")
    q, k, v = qkv(4, 8, 2, n_tokens, n_tokens, head_dim=64)
    with torch.inference_mode(), PeakLiveBytes(live) as tracked:
        attention(q, k, v, 0, impl=impl)
    return tracked.peak


def test_eager_peak_memory_grows_with_the_square_of_the_context_and_sdpa_does_not():
    eager = [attention_peak_bytes("eager", n) for n in (512, 1024)]
    fused = [attention_peak_bytes("sdpa", n) for n in (512, 1024)]
    # Eager: scores + softmax's output, 4·8·S² · 8 bytes (fp32), 67 MB at 1024 against q's 2 MB: doubling S nearly
    # quadruples it. SDPA: its output and row statistics, linear in S (the flash CPU kernel's tiles are fixed).
    assert eager[1] / eager[0] > 3.5, eager
    assert fused[1] / fused[0] < 2.5, fused
    assert eager[1] > 10 * fused[1], (eager, fused)


def test_the_planner_predicts_eager_prefill_quadratic_and_sdpa_linear():
    def prefill_bytes(impl: str, prompt_len: int) -> int:
        w = Workload("small", dtype="bf16", prompt_len=prompt_len, gen_len=2, attn_impl=impl)
        return activations.prefill_activation_bytes(w)

    eager = prefill_bytes("eager", 4096) - prefill_bytes("eager", 2048)
    fused = prefill_bytes("sdpa", 4096) - prefill_bytes("sdpa", 2048)
    scores = 16 * (4096**2 - 2048**2) * (2 + 4 + 2)  # small: 16 heads; bf16 scores, fp32 softmax, its bf16 cast
    assert eager - fused >= scores * 0.9, (eager, fused, scores)


def test_the_roofline_counts_eager_score_traffic_and_sdpa_none():
    args = ModelArgs.from_name("small")
    shape = dict(model=args, batch_size=2, dtype="bf16", kv_dtype="bf16")
    fused, eager = (decode_step_cost(KVShape(**shape, attn_impl=impl), context_len=1000) for impl in ("sdpa", "eager"))
    assert fused.score_bytes == 0
    assert eager.score_bytes == 2 * 1000 * args.n_layers * args.n_heads * 16  # bf16: 2+2+4+4+2+2 bytes a pair
    assert eager.bytes - fused.bytes == eager.score_bytes and eager.flops == fused.flops
    assert eager_score_bytes_per_pair("fp32", masked=False) == 16  # scores written and read twice, no cast
    prefill = {impl: prefill_cost(KVShape(model=args, prompt_len=512, dtype="bf16", kv_dtype="bf16", attn_impl=impl))
               for impl in ("sdpa", "eager")}  # fmt: skip
    # Eager computes the whole [T, S] rectangle, the masked half included: twice the causal pairs, roughly.
    attention_flops = {impl: cost.flops - prefill["sdpa"].flops for impl, cost in prefill.items()}
    causal_pairs, rectangle = 512 * 513 // 2, 512 * 512
    per_pair = 4 * args.n_layers * args.n_heads * args.head_dim
    assert attention_flops["eager"] == (rectangle - causal_pairs) * per_pair
    assert prefill["eager"].score_bytes == rectangle * args.n_layers * args.n_heads * (16 + 4)  # + the mask's pass


def test_the_profiler_counts_eager_attention_as_attention():
    model = build_model(TINY, dtype=torch.float32, device=CPU, seed=0, n_positions=128)
    spec = CacheSpec.for_model(TINY, batch_size=2, max_tokens=128, kv_dtype="fp32", device=CPU, attn_impl="eager")
    prompt = torch.randint(TINY.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _, top_ops = profile.profile_decode(model, kv.build("contiguous", spec, {}), prompt, n_steps=2, device=CPU)
    # q·kᵀ and p·v run as bmm, under aten::matmul; the layers' matmuls are aten::mm under aten::linear.
    scores = top_ops[top_ops["op"] == "aten::bmm"]
    assert len(scores) and set(scores["category"]) == {"attention"}, top_ops


def test_attn_impl_is_a_checked_choice_and_sdpa_keeps_older_point_ids():
    with pytest.raises(ConfigError, match=r"^attn_impl: .*allowed: sdpa, eager"):
        Workload("tiny", attn_impl="flash3")
    base = RunConfig(model={"name": "tiny"})
    assert RunConfig(model={"name": "tiny"}, attn_impl="sdpa").point_id() == base.point_id()
    assert RunConfig(model={"name": "tiny"}, attn_impl="eager").point_id() != base.point_id()


def test_rows_recorded_before_attn_impl_existed_load_as_sdpa(tmp_path):
    row = {"point_id": "p", "sweep_id": "s", "status": "ok", "schema_version": 3}
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    assert disk.conform(pq.read_table(path), path).column("attn_impl").to_pylist() == ["sdpa"]
