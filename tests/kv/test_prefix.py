"""Prefix caching: the same tokens as computing each sequence in full, the prefix computed and stored once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import kv
from harness.errors import Unsupported
from harness.kv.base import CacheSpec
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate, prefill
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens, greedy_with_logits

CPU = torch.device("cpu")
BATCH, PROMPT_LEN, PREFIX_LEN, GEN_LEN = 3, 29, 20, 10


def spec_for(args, *, prefix_len=PREFIX_LEN, kv_dtype="fp32", **quant) -> CacheSpec:
    return CacheSpec.for_model(
        args,
        batch_size=BATCH,
        max_tokens=PROMPT_LEN + GEN_LEN,
        kv_dtype=kv_dtype,
        device=CPU,
        prefix_len=prefix_len,
        **quant,
    )


def prompts(args, *, seed: int, prefix_seed: int = 0, batch_size=BATCH, prefix_len=PREFIX_LEN) -> torch.Tensor:
    """[B, PROMPT_LEN]: one prefix (from prefix_seed) shared by every row, then a suffix of each row's own."""
    prompt = torch.randint(args.vocab_size, (batch_size, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
    prefix = torch.randint(args.vocab_size, (prefix_len,), generator=torch.Generator().manual_seed(prefix_seed))
    prompt[:, :prefix_len] = prefix
    return prompt


def run(model, cache, prompt) -> torch.Tensor:
    tokens, _ = generate(model, cache, prompt, GEN_LEN, StepTimer(CPU, n_marks=GEN_LEN))
    return tokens


class CountingModel:
    """The model, recording the shape of every token batch a forward pass receives."""

    def __init__(self, model) -> None:
        self.model, self.shapes = model, []

    def __call__(self, tokens, **kwargs):
        self.shapes.append(tuple(tokens.shape))
        return self.model(tokens, **kwargs)


@pytest.mark.parametrize("block_size", [4, 8])  # 20 = 5 whole blocks of 4; 2 blocks of 8 and 4 tokens left over
def test_prefix_generates_the_same_greedy_tokens_as_contiguous_on_a_miss_and_a_hit(tiny_model, tiny_args, block_size):
    prompt = prompts(tiny_args, seed=1)
    expected, logits = greedy_with_logits(tiny_model, kv.build("contiguous", spec_for(tiny_args), {}), prompt, GEN_LEN)
    cache = kv.build("prefix", spec_for(tiny_args), {"block_size": block_size})
    miss = run(tiny_model, cache, prompt)
    assert not cache.prefix_hit
    cache.release()
    hit = run(tiny_model, cache, prompt)
    assert cache.prefix_hit
    # The prefix runs at batch 1, the suffixes at batch B: other GEMM shapes than contiguous's, so the same tokens
    # up to a near-tie (tests/greedy.py). A hit and a miss run the very same passes: bit for bit.
    assert_same_greedy_tokens(miss, expected, logits, tol=LOGIT_TOL["fp32"])
    assert torch.equal(hit, miss)


def test_a_hit_prefills_only_the_suffixes(tiny_model, tiny_args):
    cache = kv.build("prefix", spec_for(tiny_args), {"block_size": 8})  # 16 of the 20 prefix tokens are shared
    model = CountingModel(tiny_model)
    with torch.inference_mode():
        prefill(model, cache, prompts(tiny_args, seed=1))
        assert model.shapes == [(1, 16), (BATCH, PROMPT_LEN - 16)]  # the prefix once, then every suffix
        cache.release()
        model.shapes.clear()
        prefill(model, cache, prompts(tiny_args, seed=2))  # other suffixes, same prefix
        assert model.shapes == [(BATCH, PROMPT_LEN - 16)]
    assert cache.prefix_hit


def test_every_sequence_table_points_at_the_same_prefix_blocks(tiny_model, tiny_args):
    cache = kv.build("prefix", spec_for(tiny_args), {"block_size": 4})
    with torch.inference_mode():
        prefill(tiny_model, cache, prompts(tiny_args, seed=1))
    prefix = cache.prefix_blocks
    assert len(prefix) == PREFIX_LEN // 4
    assert all(blocks[: len(prefix)] == prefix for blocks in cache.tables)
    assert all(torch.equal(row[: len(prefix)], torch.tensor(prefix)) for row in cache.table)  # the device copy too
    assert cache.refs == {block: BATCH + 1 for block in prefix}  # each table, plus the cache's own
    own = [block for blocks in cache.tables for block in blocks[len(prefix) :]]
    assert len(set(own)) == len(own) and not set(own) & set(prefix)  # the rest is each sequence's own


def test_release_keeps_the_prefix_blocks_and_forget_prefix_frees_them(tiny_model, tiny_args):
    cache = kv.build("prefix", spec_for(tiny_args), {"block_size": 4})
    n_blocks = len(cache.free_blocks)
    run(tiny_model, cache, prompts(tiny_args, seed=1))
    prefix = list(cache.prefix_blocks)
    cache.release()
    assert cache.refs == {block: 1 for block in prefix}
    assert cache.blocks_in_use() == len(prefix) and len(cache.free_blocks) == n_blocks - len(prefix)
    cache.forget_prefix()
    assert cache.refs == {} and cache.blocks_in_use() == 0 and sorted(cache.free_blocks) == list(range(n_blocks))
    run(tiny_model, cache, prompts(tiny_args, seed=1))
    assert not cache.prefix_hit


def test_a_different_prefix_is_a_miss_and_replaces_the_cached_one(tiny_model, tiny_args):
    cache = kv.build("prefix", spec_for(tiny_args), {"block_size": 4})
    run(tiny_model, cache, prompts(tiny_args, seed=1, prefix_seed=0))
    cache.release()
    first_key = cache.prefix_key
    other = prompts(tiny_args, seed=1, prefix_seed=1)
    tokens = run(tiny_model, cache, other)
    assert not cache.prefix_hit and cache.prefix_key != first_key
    assert cache.blocks_in_use() == BATCH * len(cache.tables[0]) - (BATCH - 1) * len(cache.prefix_blocks)
    expected, logits = greedy_with_logits(tiny_model, kv.build("contiguous", spec_for(tiny_args), {}), other, GEN_LEN)
    assert_same_greedy_tokens(tokens, expected, logits, tol=LOGIT_TOL["fp32"])  # batch 1, then B: as above


def test_kv_bytes_shared_is_the_prefix_held_once_instead_of_batch_times(tiny_model, tiny_args):
    spec = spec_for(tiny_args)
    cache = kv.build("prefix", spec, {"block_size": 8})
    paged = kv.build("paged", spec, {"block_size": 8})
    prompt = prompts(tiny_args, seed=1)
    run(tiny_model, cache, prompt)
    run(tiny_model, paged, prompt)
    shared = (BATCH - 1) * 16 * spec.bytes_per_token  # 16: the whole blocks of the 20-token prefix
    assert cache.kv_bytes_shared() == shared
    assert cache.kv_bytes_live() == paged.kv_bytes_live() - shared
    assert cache.kv_bytes_allocated() == paged.kv_bytes_allocated() - shared  # the pool is sized for one copy
    assert cache.kv_scale_bytes() == 0


def test_without_a_prefix_it_behaves_like_paged(tiny_model, tiny_args):
    spec = spec_for(tiny_args, prefix_len=0)
    cache, paged = kv.build("prefix", spec, {"block_size": 4}), kv.build("paged", spec, {"block_size": 4})
    prompt = prompts(tiny_args, seed=1, prefix_len=0)
    model = CountingModel(tiny_model)
    assert torch.equal(run(model, cache, prompt), run(tiny_model, paged, prompt))  # like with like: paged's passes
    assert model.shapes[0] == (BATCH, PROMPT_LEN)  # one ordinary prefill from position 0
    assert not cache.prefix_hit and cache.kv_bytes_shared() == 0
    assert cache.kv_bytes_allocated() == paged.kv_bytes_allocated()
    assert cache.kv_bytes_live() == paged.kv_bytes_live()


def code_step(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """The widest step between neighbouring codes anywhere in x [B, H_kv, P, D] stored as kv_dtype (harness.kv.quant):
    int8's scale is a token's amax / 127, int4's a group's (max - min) / 15, neither wider than the whole tensor's."""
    return x.abs().amax() / 127 if kv_dtype == "int8" else (x.amax() - x.amin()) / 15


@pytest.mark.parametrize(
    ("kv_dtype", "quant"),
    [("int8", {}), ("int4", {"kv_group_size": 8, "kv_residual": 0})],  # int4 groups of 8: 16 prefix tokens shared
)
def test_a_hit_reads_back_exactly_the_quantized_kv_paged_stores(tiny_model, tiny_args, kv_dtype, quant):
    spec = spec_for(tiny_args, kv_dtype=kv_dtype, **quant)
    paged, cache = kv.build("paged", spec, {"block_size": 4}), kv.build("prefix", spec, {"block_size": 4})
    # The shared prefix is computed as one sequence, [1, n] tokens: its like is paged storing that one sequence.
    lone = kv.build("paged", dataclasses.replace(spec, batch_size=1), {"block_size": 4})
    prompt = prompts(tiny_args, seed=2)
    run(tiny_model, cache, prompts(tiny_args, seed=1))  # the miss, and a decode that runs past the prefix
    cache.release()
    with torch.inference_mode():
        prefill(tiny_model, paged, prompt)
        prefill(tiny_model, cache, prompt)
        assert cache.prefix_hit
        n_shared = cache.n_shared_tokens  # 20 (int8), 16 (int4: whole key groups)
        prefill(tiny_model, lone, prompt[:1, :n_shared])  # the very pass a miss runs over the prefix
        for layer in range(tiny_args.n_layers):
            expected_k, expected_v = paged._gather(layer, PROMPT_LEN, torch.float32)  # [B, H_kv, P, D] each
            lone_k, lone_v = lone._gather(layer, n_shared, torch.float32)  # [1, H_kv, n_shared, D]
            k, v = cache._gather(layer, PROMPT_LEN, torch.float32)
            for stored, alone, expected in ((k, lone_k, expected_k), (v, lone_v, expected_v)):
                # Every sequence reads back the shared blocks: bit for bit what paged stores for that one sequence.
                assert torch.equal(stored[:, :, :n_shared], alone.expand(BATCH, -1, -1, -1))
                # Paged's batch-B prefill of whole prompts runs other GEMM shapes, so its quantizer sees values that
                # differ by rounding (~1e-7 relative), far less than a code step: a value may sit one code away from
                # it, never more (its scale's own rounding adds ~1e-7 relative). Wrong K/V would be far off.
                tolerance = code_step(expected, kv_dtype) + 1e-5 * expected.abs().amax()
                assert (stored - expected).abs().max() <= tolerance


def test_int4_with_a_full_precision_tail_is_unsupported(tiny_args):
    spec = spec_for(tiny_args, kv_dtype="int4", kv_group_size=8, kv_residual=4)
    with pytest.raises(Unsupported, match=r"^prefix: int4 keeps each sequence's newest 4 tokens .*kv_residual=0"):
        kv.build("prefix", spec, {"block_size": 4})


def test_prompts_that_differ_within_the_prefix_are_rejected(tiny_model, tiny_args):
    cache = kv.build("prefix", spec_for(tiny_args), {"block_size": 4})
    prompt = prompts(tiny_args, seed=1)
    prompt[2, 3] = (prompt[0, 3] + 1) % tiny_args.vocab_size
    with pytest.raises(ValueError, match=r"^prefix_len: the batch's prompts differ within their first 20 tokens"):
        run(tiny_model, cache, prompt)


def test_prefix_options_are_paged_options_validated_by_name():
    with pytest.raises(ValueError, match=r"^cache\.block_size: must be a positive"):
        kv.parse_options("prefix", {"block_size": 0})
    with pytest.raises(ValueError, match=r"^cache\.window: not an option of cache 'prefix'; allowed: block_size"):
        kv.parse_options("prefix", {"window": 4})


def test_a_prefix_point_records_the_hit_the_miss_and_the_bytes_shared():
    from harness.config import RunConfig
    from harness.run.point import run_point

    row = run_point(
        RunConfig(
            model={"name": "tiny"},
            dtype="fp32",
            cache={"name": "prefix", "block_size": 8},
            batch_size=3,
            prompt_len=40,
            prefix_len=32,
            gen_len=4,
            warmup=1,
            min_repeats=2,
            max_repeats=2,
            isolate=False,
        )
    ).row
    assert row["status"] == "ok" and row["prefix_hit"] is True
    assert row["ttft_miss_ms"] > 0 and row["ttft_ms"] > 0
    per_token = 2 * 2 * 2 * 16 * 4  # K|V x layers x kv_heads x head_dim x fp32 bytes
    assert row["kv_bytes_shared"] == (3 - 1) * 32 * per_token


@pytest.mark.parametrize("prefix_len", [0, 5])  # none at all, and less than one whole block (block_size=8)
def test_a_prefix_point_without_a_shared_block_measures_as_paged(prefix_len):
    """Issue #27 item 1: cache=prefix with nothing to share was an `error` row (IndexError in prefix_columns)."""
    from harness.config import RunConfig
    from harness.run.point import run_point

    config = dict(model={"name": "tiny"}, dtype="fp32", batch_size=2, prompt_len=24, prefix_len=prefix_len, gen_len=4,
                  warmup=1, min_repeats=2, max_repeats=2, isolate=False)  # fmt: skip
    row = run_point(RunConfig(cache={"name": "prefix", "block_size": 8}, **config)).row
    paged = run_point(RunConfig(cache={"name": "paged", "block_size": 8}, **config)).row
    assert row["status"] == "ok", row.get("error")
    assert row.get("prefix_hit") is None and row.get("prefix_source") is None  # no prefix: nothing to report
    assert row["kv_bytes_shared"] == 0
    assert row["kv_bytes_allocated"] == paged["kv_bytes_allocated"]
    assert row["output_digest"] == paged["output_digest"]  # the same blocks, the same kernel: the same tokens
