"""Token eviction: exactly contiguous within the budget, flat memory beyond it, and each policy keeping what its
paper says it keeps, checked on hand-made keys and queries where the answer is known."""

from __future__ import annotations

import pytest
import torch

from harness import kv
from harness.analytic import ledger
from harness.config import RunConfig
from harness.errors import ConfigError, Unsupported
from harness.kv import varlen
from harness.kv.base import CacheSpec
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate
from harness.modeling.model import build_model
from harness.modeling.model_args import ModelArgs
from harness.run import runner
from harness.run.point import config_columns, run_point
from tests.greedy import LogitRecorder

CPU = torch.device("cpu")
FAST = dict(warmup=0, min_repeats=1, max_repeats=1, isolate=False)


def spec_for(args, *, max_tokens: int, kv_dtype: str = "fp32", batch_size: int = 2) -> CacheSpec:
    return CacheSpec.for_model(args, batch_size=batch_size, max_tokens=max_tokens, kv_dtype=kv_dtype, device=CPU)


def greedy(model, args, name: str, options: dict, *, prompt_len: int, gen_len: int, kv_dtype: str = "fp32"):
    """generate() through `name`: (tokens [B, gen_len], logits [B, gen_len, V], the cache)."""
    cache = kv.build(name, spec_for(args, max_tokens=prompt_len + gen_len, kv_dtype=kv_dtype), options)
    prompt = torch.randint(args.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    recorder = LogitRecorder(model)
    tokens, _ = generate(recorder, cache, prompt, gen_len, StepTimer(CPU, n_marks=gen_len))
    return tokens, recorder.logits(gen_len), cache


class Toy:
    """A one-layer cache of one sequence, fed hand-made q, k, v: q [1, H, T, D], k and v [1, H_kv, T, D]."""

    def __init__(self, policy: str, *, budget: int, window: int, max_tokens: int = 64, n_heads: int = 1, dim=4):
        self.spec = CacheSpec(
            n_layers=1, n_kv_heads=1, head_dim=dim, batch_size=1, max_tokens=max_tokens, kv_dtype="fp32", device=CPU
        )
        self.n_heads = n_heads
        self.cache = kv.build("evict", self.spec, {"policy": policy, "budget": budget, "window": window})

    def feed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        start = self.cache.n_tokens
        self.cache.prepare(start, k.shape[2])
        return self.cache.attend(0, q, k, torch.randn_like(k) if v is None else v, start)

    def kept(self) -> list[int]:
        """The positions held, in increasing order (sequence 0, KV head 0)."""
        n_held = min(self.cache.n_tokens, self.cache.n_slots)
        return sorted(self.cache.positions[0, 0, 0, :n_held].tolist())


def keys_with_norms(norms: list[float], dim: int = 4) -> torch.Tensor:
    """[1, 1, T, dim]: key t is a random direction of length norms[t]."""
    directions = torch.randn(len(norms), dim, generator=torch.Generator().manual_seed(0))
    keys = directions / directions.norm(dim=-1, keepdim=True) * torch.tensor(norms)[:, None]
    return keys[None, None]


# --- exact within the budget --------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "knorm", "random"])
@pytest.mark.parametrize("extra", [0, 1000])  # the budget just holds the sequence, and far more
def test_a_budget_holding_the_whole_sequence_is_contiguous_token_for_token_in_fp32(
    tiny_model, tiny_args, policy, extra
):
    prompt_len, gen_len = 11, 9
    options = {"policy": policy, "budget": prompt_len + gen_len + extra, "window": 4}
    tokens, logits, cache = greedy(tiny_model, tiny_args, "evict", options, prompt_len=prompt_len, gen_len=gen_len)
    exact_tokens, exact_logits, contiguous = greedy(
        tiny_model, tiny_args, "contiguous", {}, prompt_len=prompt_len, gen_len=gen_len
    )
    # Like with like: contiguous's very writes, read-backs and attention calls over the same K/V, bit for bit.
    assert torch.equal(tokens, exact_tokens)
    assert torch.equal(logits, exact_logits)
    assert cache.kv_bytes_allocated() == contiguous.kv_bytes_allocated()


def test_a_budget_holding_the_whole_sequence_is_contiguous_token_for_token_in_bf16(tiny_args):
    model = build_model(tiny_args, weights="dummy", dtype=torch.bfloat16, device=CPU, seed=0, n_positions=64)
    prompt_len, gen_len = 13, 10
    options = {"policy": "h2o", "budget": prompt_len + gen_len, "window": 2}
    tokens, logits, _ = greedy(
        model, tiny_args, "evict", options, prompt_len=prompt_len, gen_len=gen_len, kv_dtype="bf16"
    )
    exact_tokens, exact_logits, _ = greedy(
        model, tiny_args, "contiguous", {}, prompt_len=prompt_len, gen_len=gen_len, kv_dtype="bf16"
    )
    assert torch.equal(tokens, exact_tokens)
    assert torch.equal(logits, exact_logits)


def test_a_budget_below_the_length_changes_what_is_computed(tiny_model, tiny_args):
    """The equality above is not blindness: evicting changes the logits."""
    options = {"policy": "knorm", "budget": 8, "window": 2}
    _, logits, _ = greedy(tiny_model, tiny_args, "evict", options, prompt_len=11, gen_len=9)
    _, exact_logits, _ = greedy(tiny_model, tiny_args, "contiguous", {}, prompt_len=11, gen_len=9)
    assert not torch.allclose(logits, exact_logits, atol=1e-4)


# --- memory ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_allocation_is_flat_at_the_budget_whatever_the_generation_length(tiny_args, kv_dtype):
    budget = 24
    caches = [
        kv.build("evict", spec_for(tiny_args, max_tokens=n, kv_dtype=kv_dtype), {"budget": budget, "window": 4})
        for n in (40, 10_000)
    ]
    assert caches[0].kv_bytes_allocated() == caches[1].kv_bytes_allocated()
    per_token = spec_for(tiny_args, max_tokens=40, kv_dtype=kv_dtype).bytes_per_token
    scales = 2 * tiny_args.n_layers * 2 * tiny_args.n_kv_heads * budget * 4 if kv_dtype == "int8" else 0
    assert caches[0].kv_bytes_allocated() == budget * 2 * per_token + scales
    assert caches[0].kv_scale_bytes() == scales
    for gen_len in (16, 1000):  # the planner agrees, and its figure does not grow with gen_len either
        planned = ledger.kv_bytes_allocated(
            tiny_args,
            cache="evict",
            kv_dtype=kv_dtype,
            batch_size=2,
            prompt_len=24,
            gen_len=gen_len,
            budget=budget,
            window=4,
        )
        assert planned == caches[0].kv_bytes_allocated()


def test_live_bytes_cap_at_the_budget_after_a_generation(tiny_model, tiny_args):
    options = {"policy": "h2o", "budget": 12, "window": 3}
    _, _, cache = greedy(tiny_model, tiny_args, "evict", options, prompt_len=20, gen_len=10)
    assert cache.kv_bytes_live() == 12 * 2 * cache.spec.bytes_per_token


def test_the_layout_tells_the_planner_and_the_roofline_what_it_reads_and_writes():
    layout = kv.layout("evict", {"policy": "snapkv", "budget": 100, "window": 8})
    assert layout.lossy
    assert (layout.keys_attended(50), layout.keys_attended(5000)) == (50, 100)  # a decode query: the held keys
    assert layout.tokens_written(300) == 100  # a long prompt keeps its budget
    assert layout.causal_pairs(1, 300) == 300 * 301 // 2  # prefill is exact over the whole prompt
    assert layout.option_columns() == {"policy": "snapkv", "budget": 100, "obs_window": 8}


# --- what each policy keeps ------------------------------------------------------------------------------------


def test_knorm_keeps_the_lowest_norm_keys_beside_the_window():
    norms = [5.0, 1.0, 4.0, 2.0, 3.0, 0.5, 6.0, 7.0]
    toy = Toy("knorm", budget=4, window=1)
    toy.feed(torch.randn(1, 1, 8, 4), keys_with_norms(norms))
    assert toy.kept() == [1, 3, 5, 7]  # the 3 lowest norms (0.5, 1, 2), and position 7, the window
    toy.feed(torch.randn(1, 1, 1, 4), keys_with_norms([0.1]))  # full: the new token evicts the largest norm held
    assert toy.kept() == [1, 3, 5, 8]  # 7 (norm 7) left the window and had the largest norm


def test_h2o_keeps_the_keys_with_the_heaviest_attention_summed_over_the_group():
    # Two query heads share the KV head. Every query's head 0 looks at key 2, head 1 at key 5; the others get little.
    n, dim = 12, 4
    keys = 0.01 * torch.randn(1, 1, n, dim, generator=torch.Generator().manual_seed(3))
    keys[0, 0, 2, 0] = keys[0, 0, 5, 1] = 8.0
    q = torch.zeros(1, 2, n, dim)
    q[0, 0, :, 0] = q[0, 1, :, 1] = 4.0  # logits 16 against the key each head looks at
    toy = Toy("h2o", budget=4, window=2, n_heads=2)
    toy.feed(q, keys)
    assert toy.kept() == [2, 5, 10, 11]  # the two heavy hitters, and the window
    # In decode the accumulation goes on: a heavy hitter survives every step, the others turn over.
    for step in range(6):
        toy.feed(q[:, :, :1], 0.01 * torch.randn(1, 1, 1, dim, generator=torch.Generator().manual_seed(step)))
    assert toy.kept() == [2, 5, 16, 17]


def test_h2o_scores_are_the_accumulated_attention_of_every_prompt_query():
    n, dim = 9, 4
    generator = torch.Generator().manual_seed(5)
    q, keys = torch.randn(1, 2, n, dim, generator=generator), torch.randn(1, 1, n, dim, generator=generator)
    toy = Toy("h2o", budget=n, window=0, max_tokens=n + 1, n_heads=2)  # nothing evicted yet: every score kept
    toy.feed(q, keys)
    logits = q @ keys.transpose(-1, -2) / dim**0.5  # [1, 2, n, n]: the whole matrix, written out
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    expected = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1).sum(dim=(1, 2))  # over heads and queries
    torch.testing.assert_close(toy.cache.scores[0, 0, 0], expected[0])


def test_snapkv_keeps_what_the_observation_window_votes_for_and_its_neighbours():
    n, window, dim = 24, 4, 4
    keys = 0.01 * torch.randn(1, 1, n, dim, generator=torch.Generator().manual_seed(2))
    keys[0, 0, 10, 0] = keys[0, 0, 2, 1] = 10.0
    q = torch.zeros(1, 1, n, dim)
    q[0, 0, : n - window, 1] = 5.0  # the early queries look at key 2 (H2O would keep it)
    q[0, 0, n - window :, 0] = 5.0  # the window looks at key 10
    toy = Toy("snapkv", budget=window + 7, window=window)
    toy.feed(q, keys)
    # Key 10's vote, max-pooled over 7 positions, covers 7..13; then the window 20..23. Key 2 had no vote.
    assert toy.kept() == [*range(7, 14), *range(20, 24)]
    # Decode keeps the prompt's selection; generated tokens stay while among the window most recent, then go first.
    for _ in range(6):
        toy.feed(q[:, :, :1], 0.01 * torch.randn(1, 1, 1, dim))
    assert toy.kept() == [*range(7, 14), *range(26, 30)]


def test_random_is_seeded_reproducible_and_keeps_the_window():
    kept = []
    for _ in range(2):
        toy = Toy("random", budget=10, window=3)
        toy.feed(torch.randn(1, 1, 40, 4), torch.randn(1, 1, 40, 4))
        kept.append(toy.kept())
    assert kept[0] == kept[1]  # other inputs, the same choice: it depends on positions only
    assert kept[0][-3:] == [37, 38, 39] and len(kept[0]) == 10
    assert kept[0] != list(range(30, 40))  # not a sliding window in disguise


def test_random_draws_differently_for_each_layer_and_head(tiny_args):
    cache = kv.build("evict", spec_for(tiny_args, max_tokens=64), {"policy": "random", "budget": 8, "window": 0})
    scores = cache._hash(0, torch.arange(64)), cache._hash(1, torch.arange(64))  # [B, H_kv, 64] each
    assert not torch.equal(scores[0], scores[1])
    assert not torch.equal(scores[0][0, 0], scores[0][0, 1]) and not torch.equal(scores[0][0], scores[0][1])
    assert scores[0].min() >= 0 and scores[0].max() < 1


# --- lossy: measured ------------------------------------------------------------------------------------------------


def test_a_budget_below_the_length_fills_the_accuracy_columns_of_a_point():
    common = dict(model={"name": "tiny"}, dtype="fp32", prompt_len=24, gen_len=8, **FAST)
    lossy = run_point(RunConfig(cache={"name": "evict", "policy": "h2o", "budget": 12, "window": 4}, **common)).row
    exact = run_point(RunConfig(cache={"name": "evict", "budget": 64, "window": 4}, **common)).row
    assert lossy["status"] == exact["status"] == "ok"
    assert lossy["kl_mean"] > 0 and 0 <= lossy["top1_agreement"] <= 1 and lossy["logit_max_abs_err"] > 0
    assert (lossy["policy"], lossy["budget"], lossy["obs_window"], lossy["window"]) == ("h2o", 12, 4, None)
    assert exact["kl_mean"] == 0 and exact["top1_agreement"] == 1  # lossy in kind, exact at this budget
    assert lossy["kv_bytes_allocated"] == exact["kv_bytes_allocated"] * 12 // 32


# --- what it cannot run -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"policy": "lru"}, r"^cache\.policy: must be one of h2o, snapkv, knorm, random, got 'lru'$"),
        ({"budget": 0}, r"^cache\.budget: must be a positive number of tokens, got 0$"),
        ({"budget": 8, "window": 8}, r"^cache\.window: must be in 0\.\.cache\.budget-1=7, got 8$"),
        ({"window": -1}, r"^cache\.window: must be in 0\.\.cache\.budget-1=1023, got -1$"),
        ({"policy": "snapkv", "window": 0}, r"^cache\.window: snapkv needs an observation window of at least 1 token"),
    ],
)
def test_bad_options_give_one_line_errors_naming_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        kv.parse_options("evict", options)


def test_int4_is_unsupported_for_the_cache_the_planner_and_as_a_row(tiny_args):
    with pytest.raises(Unsupported, match="int4"):
        kv.build("evict", spec_for(tiny_args, max_tokens=64, kv_dtype="int4"), {"budget": 16, "window": 4})
    with pytest.raises(ConfigError, match=r"^kv_dtype: evict cannot store int4; allowed: "):
        ledger.kv_bytes_allocated(
            "small", cache="evict", kv_dtype="int4", kv_group_size=64, batch_size=1, prompt_len=8, gen_len=8, window=2
        )
    cfg = RunConfig(
        model={"name": "small"},
        cache={"name": "evict", "budget": 8, "window": 2},
        kv_dtype="int4",
        kv_group_size=64,
        prompt_len=8,
        gen_len=4,
        roofline=False,
        **FAST,
    )
    row = runner.run_point(cfg).row  # the cache is built first: refused before the model is
    assert row["status"] == "unsupported" and "int4" in row["error"]


def test_per_sequence_lengths_are_unsupported_with_the_reason(tiny_args):
    cache = kv.build("evict", spec_for(tiny_args, max_tokens=64), {"budget": 16, "window": 4})
    batch = varlen.SeqBatch(slots=(0, 1), start_pos=(0, 0), n_new=(4, 3))
    with pytest.raises(Unsupported, match=r"^per-sequence lengths: evict does not take them"):
        cache.prepare(batch)


def test_a_prefill_in_chunks_is_unsupported_with_the_reason(tiny_args):
    cache = kv.build("evict", spec_for(tiny_args, max_tokens=64), {"budget": 16, "window": 4})
    cache.prepare(0, 8)
    with pytest.raises(Unsupported, match=r"^cache\.evict: a forward of 4 tokens at position 8"):
        cache.prepare(8, 4)


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "knorm", "random"])
def test_with_real_weights_a_budget_under_the_length_fills_the_perplexity_delta_and_top1(llama_checkpoint, policy):
    row = run_point(
        RunConfig(
            weights=str(llama_checkpoint),
            prompt_source="text",  # the text it was trained on
            prompt_text=str(llama_checkpoint / "eval.txt"),
            dtype="fp32",
            cache={"name": "evict", "policy": policy, "budget": 24, "window": 4},
            batch_size=2,
            prompt_len=48,
            gen_len=16,
            eval_text=str(llama_checkpoint / "eval.txt"),
            **FAST,
        )
    ).row
    assert row["status"] == "ok", row.get("error")
    assert row["ppl"] > 1 and row["ppl_delta"] != 0  # 24 of 64 tokens kept: the text's perplexity moves
    assert 0 <= row["top1_agreement"] <= 1 and row["kl_mean"] > 0


def test_an_eviction_points_planner_figure_uses_its_observation_window():
    cfg = RunConfig(model={"name": "tiny"}, dtype="fp32", kv_dtype="fp32", batch_size=1, prompt_len=64, gen_len=8,
                    cache={"name": "evict", "policy": "h2o", "budget": 16, "window": 4}, **FAST)  # fmt: skip
    row = config_columns(cfg)
    expected = ledger.kv_bytes_allocated(
        ModelArgs.from_name("tiny"),
        cache="evict", kv_dtype="fp32", dtype="fp32", batch_size=1, prompt_len=64, gen_len=8, policy="h2o",
        budget=16, window=4,
    )  # fmt: skip
    assert row["obs_window"] == 4 and row["window"] is None  # the option `window` is the column obs_window
    assert row["kv_bytes_planner"] == expected  # not the default window 32 > budget
