"""Per-sequence lengths in the cache protocol (harness.kv.varlen): a static batch written as a SeqBatch gives the
static path's logits, for every strategy and per-token format that takes one; the others refuse in one line."""

from __future__ import annotations

import pytest
import torch

from harness import kv
from harness.errors import Unsupported
from harness.kv.base import CacheSpec
from harness.kv.varlen import SeqBatch
from harness.modeling.model import build_model
from harness.modeling.model_args import ModelArgs
from tests.greedy import LOGIT_TOL

CPU = torch.device("cpu")
ARGS = ModelArgs.from_name("tiny")
BATCH, PROMPT, STEPS, BLOCK = 3, 11, 4, 4


def paged_tables(batch: int, max_tokens: int) -> tuple[tuple[int, ...], ...]:
    """Disjoint tables over a shuffled pool: block ids far from table order, as a server's are."""
    per_seq = -(-max_tokens // BLOCK)
    ids = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(0)).tolist()
    return tuple(tuple(ids[i * per_seq : (i + 1) * per_seq]) for i in range(batch))


def logits_both_ways(strategy: str, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[STEPS + 1, B, V] last-token logits of a prefill and STEPS decode steps: static, then flattened."""
    model = build_model(ARGS, dtype=torch.float32, device=CPU, seed=0, n_positions=64)
    max_tokens = PROMPT + STEPS + 1
    prompt = torch.randint(0, ARGS.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    options = {"block_size": BLOCK} if strategy != "contiguous" else {}
    spec = CacheSpec.for_model(ARGS, batch_size=BATCH, max_tokens=max_tokens, kv_dtype=kv_dtype, device=CPU)
    static, flat = kv.build(strategy, spec, options), kv.build(strategy, spec, {**options})
    tables = paged_tables(BATCH, max_tokens) if strategy != "contiguous" else ()
    outs = ([], [])
    tokens, pos = prompt, 0
    for _ in range(STEPS + 1):
        outs[0].append(model(tokens, pos, static, last_only=True)[:, -1])
        n = tokens.shape[1]
        batch = SeqBatch(tuple(range(BATCH)), (pos,) * BATCH, (n,) * BATCH, block_tables=tables)
        outs[1].append(model(tokens.reshape(1, -1), batch, flat, last_only=True)[0])
        pos += n
        tokens = outs[0][-1].argmax(-1, keepdim=True)  # [B, 1]: the static path's choice feeds both
    return torch.stack(outs[0]), torch.stack(outs[1])


@pytest.mark.parametrize("strategy", ["contiguous", "paged", "prefix"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "fp8_e4m3"])
def test_a_static_batch_as_a_seqbatch_gives_the_static_logits(strategy, kv_dtype):
    static, flat = logits_both_ways(strategy, kv_dtype)
    # Different shapes (a masked gather, a flattened GEMM): rounding apart, never more than the format's tolerance.
    torch.testing.assert_close(flat, static, rtol=0, atol=LOGIT_TOL[kv_dtype])


@pytest.mark.parametrize(("strategy", "options"), [("sliding", {"window": 8}), ("none", {})])
def test_strategies_without_per_sequence_lengths_refuse_in_one_line(strategy, options):
    spec = CacheSpec.for_model(ARGS, batch_size=1, max_tokens=8, kv_dtype="fp32", device=CPU)
    cache = kv.build(strategy, spec, options)
    with pytest.raises(Unsupported, match="per-sequence lengths: .*allowed: contiguous, paged, prefix"):
        cache.prepare(SeqBatch((0,), (0,), (4,)))


@pytest.mark.parametrize("strategy", ["contiguous", "paged"])
def test_int4_refuses_per_sequence_lengths(strategy):
    spec = CacheSpec.for_model(ARGS, batch_size=1, max_tokens=64, kv_dtype="int4", device=CPU, kv_group_size=8)
    cache = kv.build(strategy, spec, {"block_size": 8} if strategy == "paged" else {})
    with pytest.raises(Unsupported, match="int4 groups tokens across positions"):
        cache.prepare(SeqBatch((0,), (0,), (4,), block_tables=((0, 1),)))


def test_a_block_table_too_short_for_its_positions_is_refused():
    spec = CacheSpec.for_model(ARGS, batch_size=1, max_tokens=16, kv_dtype="fp32", device=CPU)
    cache = kv.build("paged", spec, {"block_size": BLOCK})
    with pytest.raises(ValueError, match="block table of 1 blocks cannot hold positions 0..5"):
        cache.prepare(SeqBatch((0,), (0,), (6,), block_tables=((0,),)))
