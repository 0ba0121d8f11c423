"""The KV-cache strategies: same tokens as recomputation, honest byte counts, and the paged pool's bookkeeping."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from harness import kv
from harness.errors import KVPoolExhausted
from harness.kv.base import CacheSpec
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate
from tests.greedy import LOGIT_TOL, LogitRecorder, assert_same_greedy_tokens

CPU = torch.device("cpu")
CONF_CACHE = Path(__file__).parents[2] / "conf" / "cache"


def spec_for(args, *, batch_size: int, max_tokens: int, kv_dtype="fp32") -> CacheSpec:
    return CacheSpec.for_model(args, batch_size=batch_size, max_tokens=max_tokens, kv_dtype=kv_dtype, device=CPU)


def greedy(model, args, name: str, *, batch_size: int, prompt_len: int, gen_len: int, options=None, kv_dtype="fp32"):
    spec = spec_for(args, batch_size=batch_size, max_tokens=prompt_len + gen_len, kv_dtype=kv_dtype)
    cache = kv.build(name, spec, options or {})
    prompt = torch.randint(args.vocab_size, (batch_size, prompt_len), generator=torch.Generator().manual_seed(1))
    tokens, sample = generate(model, cache, prompt, gen_len, StepTimer(CPU, n_marks=gen_len))
    return tokens, cache, sample


@pytest.mark.parametrize(
    ("batch_size", "prompt_len", "gen_len"),
    [(1, 5, 12), (3, 16, 9), (2, 23, 20), (4, 1, 17)],  # 23 + 20 and 1 + 17: not multiples of the block size
)
def test_every_strategy_generates_the_same_greedy_tokens_in_fp32(
    tiny_model, tiny_args, batch_size, prompt_len, gen_len
):
    recorder = LogitRecorder(tiny_model)  # contiguous's logits, to tell a near-tie from a wrong token
    outputs = {
        name: greedy(model, tiny_args, name, batch_size=batch_size, prompt_len=prompt_len, gen_len=gen_len)[0]
        for name, model in (("contiguous", recorder), ("none", tiny_model), ("paged", tiny_model))
    }
    assert outputs["none"].shape == (batch_size, gen_len)
    # Recomputation runs each step's GEMMs over the whole sequence, a cache over one token: other shapes, so the same
    # tokens up to a near-tie (tests/greedy.py). Paged runs contiguous's very ops over the same K/V: bit for bit.
    assert_same_greedy_tokens(outputs["none"], outputs["contiguous"], recorder.logits(gen_len), tol=LOGIT_TOL["fp32"])
    assert torch.equal(outputs["paged"], outputs["contiguous"])


def test_paged_with_small_blocks_matches_contiguous(tiny_model, tiny_args):
    contiguous, *_ = greedy(tiny_model, tiny_args, "contiguous", batch_size=2, prompt_len=7, gen_len=10)
    paged, *_ = greedy(
        tiny_model, tiny_args, "paged", batch_size=2, prompt_len=7, gen_len=10, options={"block_size": 3}
    )
    assert torch.equal(contiguous, paged)  # like with like: the same GEMMs and SDPA calls over the same K/V


def test_timer_reports_ttft_and_one_interval_per_decode_step(tiny_model, tiny_args):
    _, _, sample = greedy(tiny_model, tiny_args, "contiguous", batch_size=1, prompt_len=4, gen_len=6)
    assert len(sample.step_ms) == 5
    assert sample.ttft_ms > 0 and all(ms > 0 for ms in sample.step_ms)


def test_contiguous_allocates_exactly_the_formula_for_the_full_length(tiny_args):
    batch_size, max_tokens = 3, 40
    cache = kv.build("contiguous", spec_for(tiny_args, batch_size=batch_size, max_tokens=max_tokens), {})
    formula = 2 * tiny_args.n_layers * max_tokens * tiny_args.n_kv_heads * tiny_args.head_dim * 4 * batch_size
    assert cache.kv_bytes_allocated() == formula


def test_live_bytes_follow_the_tokens_present_for_both_caches(tiny_model, tiny_args):
    batch_size, prompt_len, gen_len = 2, 21, 6
    present = prompt_len + gen_len - 1  # the last generated token is never fed back
    formula = 2 * tiny_args.n_layers * present * tiny_args.n_kv_heads * tiny_args.head_dim * 4 * batch_size
    for name in ("contiguous", "paged"):
        spec = spec_for(tiny_args, batch_size=batch_size, max_tokens=prompt_len + gen_len)
        cache = kv.build(name, spec, {})
        prompt = torch.zeros((batch_size, prompt_len), dtype=torch.long)
        generate(tiny_model, cache, prompt, gen_len, StepTimer(CPU, n_marks=gen_len))
        assert cache.kv_bytes_live() == formula, name


def test_storage_dtype_is_independent_of_compute_dtype(tiny_model, tiny_args):
    fp32, fp32_cache, _ = greedy(tiny_model, tiny_args, "contiguous", batch_size=2, prompt_len=8, gen_len=5)
    bf16, bf16_cache, _ = greedy(tiny_model, tiny_args, "paged", batch_size=2, prompt_len=8, gen_len=5, kv_dtype="bf16")
    assert bf16_cache.k_pool.dtype == bf16_cache.v_pool.dtype == torch.bfloat16
    assert bf16_cache.kv_bytes_live() * 2 == fp32_cache.kv_bytes_live()
    assert bf16.shape == fp32.shape


def test_paged_takes_blocks_on_demand_and_returns_them_on_completion(tiny_model, tiny_args):
    spec = spec_for(tiny_args, batch_size=2, max_tokens=40)
    cache = kv.build("paged", spec, {"block_size": 16})
    assert cache.blocks_in_use() == 0
    cache.prepare(0, 17)  # 17 tokens need 2 blocks per sequence
    assert cache.blocks_in_use() == 4
    cache.prepare(17, 1)  # still inside the second block
    assert cache.blocks_in_use() == 4
    cache.prepare(32, 1)  # token 33 opens a third block
    assert cache.blocks_in_use() == 6
    cache.release()
    assert cache.blocks_in_use() == 0 and len(cache.free_blocks) == 6


def test_paged_pool_sized_by_pool_tokens(tiny_args):
    cache = kv.build("paged", spec_for(tiny_args, batch_size=1, max_tokens=8), {"block_size": 4, "pool_tokens": 100})
    assert cache.n_blocks == cache.k_pool.shape[1] == 25  # ceil(100 / 4) blocks
    assert cache.kv_bytes_allocated() == 25 * 4 * spec_for(tiny_args, batch_size=1, max_tokens=8).bytes_per_token


def test_an_exhausted_pool_is_an_out_of_memory_error(tiny_args):
    cache = kv.build("paged", spec_for(tiny_args, batch_size=2, max_tokens=64), {"block_size": 16, "pool_tokens": 48})
    cache.prepare(0, 16)
    with pytest.raises(KVPoolExhausted, match="exhausted"):
        cache.prepare(16, 16)  # 2 sequences x 2 blocks > 3 blocks
    assert isinstance(KVPoolExhausted("x"), MemoryError)


def test_released_blocks_are_reused_by_the_next_batch(tiny_model, tiny_args):
    spec = spec_for(tiny_args, batch_size=2, max_tokens=30)
    cache = kv.build("paged", spec, {"block_size": 8})
    prompt = torch.randint(tiny_args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    first, _ = generate(tiny_model, cache, prompt, 10, StepTimer(CPU, n_marks=10))
    cache.release()
    second, _ = generate(tiny_model, cache, prompt, 10, StepTimer(CPU, n_marks=10))
    assert torch.equal(first, second)


def test_strategies_are_discovered_and_each_has_a_config_file():
    names = kv.strategy_names()
    assert {"none", "contiguous", "paged", "sliding", "prefix", "offload"} <= set(names)
    assert set(names) <= {p.stem for p in CONF_CACHE.glob("*.yaml")}


def test_every_strategy_declares_whether_it_serves_and_those_that_do_not_say_why():
    declared = {name: kv.serving(name) for name in kv.strategy_names()}
    assert all("declares no SERVING" not in serving.refusal for serving in declared.values()), declared
    assert kv.serving_names() == ["contiguous", "evict", "paged", "prefix", "sliding"]  # evict: issue #30 item 1b
    assert all(serving.refusal for name, serving in declared.items() if name not in kv.serving_names())


def test_every_cache_config_names_a_strategy():
    for path in CONF_CACHE.glob("*.yaml"):
        text = path.read_text()
        named = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("name:")]
        included = [line.strip(" -") for line in text.splitlines() if line.startswith("  - ")]
        assert named or included, path
        assert all(name in kv.strategy_names() for name in named + included), path


def test_unknown_strategy_and_unknown_option_name_the_field_and_allowed_values():
    with pytest.raises(ValueError, match=r"^cache: unknown strategy 'lru'; allowed: .*contiguous.*paged"):
        kv.parse_options("lru", {})
    with pytest.raises(ValueError, match=r"^cache\.window: not an option of cache 'paged'; allowed: block_size"):
        kv.parse_options("paged", {"window": 4})
    with pytest.raises(ValueError, match=r"^cache\.block_size: must be a positive"):
        kv.parse_options("paged", {"block_size": 0})


def test_none_has_nothing_to_store_in_another_format(tiny_args):
    from harness.errors import Unsupported

    for kv_dtype, dtype in (("int8", None), ("bf16", "fp32")):
        spec = CacheSpec.for_model(tiny_args, batch_size=1, max_tokens=8, kv_dtype=kv_dtype, device=CPU)
        with pytest.raises(Unsupported, match=f"nothing to store as {kv_dtype}"):
            kv.build("none", dataclasses.replace(spec, dtype=dtype), {})
    kv.build("none", spec_for(tiny_args, batch_size=1, max_tokens=8), {})  # fp32 with fp32 compute: fine


# --- paged decode on CUDA: which kernel, and FlashInfer's plan from the host ----------------------------------------


def cuda_spec(args, *, kv_dtype: str, dtype: str | None) -> CacheSpec:
    """A paged spec for a CUDA device: only its `.type` is read here, so no GPU is needed."""
    return dataclasses.replace(
        spec_for(args, batch_size=2, max_tokens=40, kv_dtype=kv_dtype), device=torch.device("cuda"), dtype=dtype
    )


@pytest.mark.parametrize(
    ("kv_dtype", "dtype", "static", "expected"),
    [
        ("bf16", "bf16", False, "flashinfer"),
        ("fp16", "fp16", False, "flashinfer"),
        ("bf16", "fp32", False, "triton-paged"),  # FlashInfer decodes with queries of the pages' dtype only
        ("fp16", "bf16", False, "triton-paged"),
        ("bf16", None, False, "triton-paged"),  # compute dtype unknown: never guess that they agree
        ("int8", "bf16", False, "triton-paged"),
        ("bf16", "bf16", True, "triton-paged"),  # a compiled step: FlashInfer plans on the host every step
    ],
)
def test_flashinfer_is_chosen_only_for_queries_of_the_pages_dtype_and_never_in_a_compiled_step(
    tiny_args, monkeypatch, kv_dtype, dtype, static, expected
):
    from harness.kv import paged_attend, triton_kernels

    if triton_kernels.UNAVAILABLE is not None:
        pytest.skip(triton_kernels.UNAVAILABLE)
    monkeypatch.setattr(paged_attend, "flashinfer_installed", lambda: True)
    assert paged_attend.decode_backend(cuda_spec(tiny_args, kv_dtype=kv_dtype, dtype=dtype), static=static) == expected


def test_flashinfer_page_lists_are_the_host_tables_in_csr_form():
    from harness.kv.paged_attend import flashinfer_page_lists

    indptr, indices, last_page_len = flashinfer_page_lists([[7, 2, 5], [0, 4, 1]], n_tokens=9, block_size=4)
    assert indptr.tolist() == [0, 3, 6] and indices.tolist() == [7, 2, 5, 0, 4, 1] and last_page_len.tolist() == [1, 1]
    assert all(t.device.type == "cpu" and t.dtype == torch.int32 for t in (indptr, indices, last_page_len))


def test_flashinfer_is_planned_from_the_host_tables_never_from_the_device_table(tiny_args, monkeypatch):
    """On a GPU, reading the device table back (.to("cpu") inside plan) is a host sync every decode step."""
    import sys
    import types

    from harness.kv import host

    plans = []

    class Wrapper:  # flashinfer.BatchDecodeWithPagedKVCacheWrapper, as much of it as the cache calls
        def __init__(self, workspace, kv_layout, use_tensor_cores):
            assert kv_layout == "HND"

        def plan(self, indptr, indices, last_page_len, n_heads, n_kv_heads, head_dim, page_size, **dtypes):
            plans.append((indptr.tolist(), indices.tolist(), last_page_len.tolist(), page_size))

        def run(self, q, kv_pages):
            return torch.zeros_like(q)

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Wrapper))
    monkeypatch.setattr(host, "pinned", lambda tensor: tensor)  # the CPU has nothing to pin
    spec = dataclasses.replace(spec_for(tiny_args, batch_size=2, max_tokens=40), dtype="fp32")
    cache = kv.build("paged", spec, {"block_size": 4})
    cache.attn_backend = "flashinfer"  # as decode_backend picks on a GPU with flashinfer installed
    heads, kv_heads, dim = tiny_args.n_heads, tiny_args.n_kv_heads, tiny_args.head_dim
    cache.prepare(0, 9)
    cache.attend(
        0, torch.zeros(2, heads, 9, dim), torch.zeros(2, kv_heads, 9, dim), torch.zeros(2, kv_heads, 9, dim), 0
    )
    cache.prepare(9, 1)
    cache.table.fill_(-1)  # the device copy of the tables: plan must not read it
    cache.attend(
        0, torch.zeros(2, heads, 1, dim), torch.zeros(2, kv_heads, 1, dim), torch.zeros(2, kv_heads, 1, dim), 9
    )
    indices = [block for blocks in cache.tables for block in blocks]
    assert plans == [([0, 3, 6], indices, [2, 2], 4)] and -1 not in indices
