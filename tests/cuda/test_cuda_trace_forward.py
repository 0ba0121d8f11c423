"""Fake CUDA (see tests/cuda/test_cuda_trace.py): every cache's allocation at Llama-3.1-8B scale after its first write
against the capacity planner, the host-sync recorder itself, and a serving forward traced without a host sync."""

from __future__ import annotations

import pytest
import torch

from harness import kv
from harness.kv.base import CacheSpec
from harness.modeling.model_args import ModelArgs
from tests.cuda.test_cuda_trace import (
    CUDA,
    DTYPE,
    OPTIONS,
    POINTS,
    PROMPT_LEN,
    HostSyncs,
    planned_kv_bytes,
    pytestmark,  # noqa: F401 (cuda_trace, and the skip on a CPU build of torch)
)

# The allocation check's point: a long chat at a server's batch, where a planner error would cost gigabytes.
ALLOCATION = dict(batch_size=8, prompt_len=8192, gen_len=128, prefix_len=4096)


@pytest.mark.parametrize(("cache_name", "kv_dtype"), sorted({(cache, kv_dtype) for cache, kv_dtype, _ in POINTS}))
def test_every_cache_allocates_what_the_planner_says_at_llama_3_1_8b_scale(fake_cuda, cache_name, kv_dtype):
    """All 32 layers, batch 8 x 8320 tokens (about 35 GB of bf16 KV): the cache's own kv_bytes_allocated, after its
    first write (when int4 allocates its full-precision tail), against harness.analytic's figure."""
    fake_mode, _ = fake_cuda
    args = ModelArgs.from_name("llama-3.1-8b")
    prefix_len = ALLOCATION["prefix_len"] if cache_name == "prefix" else 0
    batch, max_tokens = ALLOCATION["batch_size"], ALLOCATION["prompt_len"] + ALLOCATION["gen_len"]
    spec = CacheSpec.for_model(
        args,
        batch_size=batch,
        max_tokens=max_tokens,
        kv_dtype=kv_dtype,
        device=CUDA,
        prefix_len=prefix_len,
        dtype=DTYPE,
    )
    with fake_mode:
        cache = kv.build(cache_name, spec, OPTIONS.get(cache_name, {}))
        q = torch.empty((batch, args.n_heads, 1, args.head_dim), dtype=torch.bfloat16, device=CUDA)
        k = torch.empty((batch, args.n_kv_heads, 1, args.head_dim), dtype=torch.bfloat16, device=CUDA)
        cache.prepare(0, 1)
        out = cache.attend(0, q, k, k, 0)
        assert out.shape == q.shape and out.device.type == "cuda"
        allocated = cache.kv_bytes_allocated()
    planned = planned_kv_bytes(
        args,
        cache_name,
        kv_dtype,
        batch_size=batch,
        prompt_len=ALLOCATION["prompt_len"],
        gen_len=ALLOCATION["gen_len"],
        prefix_len=prefix_len,
    )
    assert allocated == planned
    if cache_name == "contiguous" and kv_dtype == DTYPE:  # the seed notes' formula: 2 x L x S x H_kv x D x bytes x B
        assert allocated == 2 * 32 * max_tokens * 8 * 128 * 2 * batch


def test_the_sync_recorder_catches_what_would_make_the_host_wait(fake_cuda):
    """The recorder itself: ops fake tensors let through but a GPU would sync on, each named."""
    fake_mode, _ = fake_cuda
    with fake_mode:
        x = torch.zeros(8, 4, device=CUDA)
        host_index = torch.tensor([1, 2])  # made on the host
        syncs = HostSyncs()
        with syncs:
            x[host_index]  # indexing a CUDA tensor with a CPU index copies it over first
            x.to("cpu")  # a blocking copy back to the host
            x.to("cpu", non_blocking=True)  # not one: the copy is queued
            x[torch.arange(2, device=CUDA)]  # not one: the index is on the device
    assert syncs.found == [
        "aten::index.Tensor: a cpu index into a cuda:0 tensor",
        "aten::_to_copy: a blocking copy from cuda:0 to cpu",
    ]


SERVE_POINTS = [(s, k) for s in ("contiguous", "paged") for k in (DTYPE, "fp8_e4m3", "int8")] + [("sliding", DTYPE)]


@pytest.mark.parametrize(("strategy", "kv_dtype"), SERVE_POINTS, ids=["-".join(p) for p in SERVE_POINTS])
def test_a_serving_forward_traces_on_fake_cuda_without_a_host_sync(fake_cuda, strategy, kv_dtype):
    """One serving iteration (harness.serve.engine): three decodes at their own positions and a prefill chunk in
    the middle of its prompt, flattened, through the pool the engine builds; the sampled ids' read-back, the
    iteration's one sync, comes after."""
    from harness.kv.varlen import SeqBatch
    from harness.serve.engine import build_cache

    fake_mode, models = fake_cuda
    model = models["shallow"]
    window = 64 if strategy == "sliding" else None
    starts, n_new = (37, 150, 90, 48), (1, 1, 1, 40)  # three decodes, one chunk of positions 48..87
    with fake_mode:
        cache, num_slots = build_cache(strategy, model.args, kv_dtype=kv_dtype, num_blocks=64, block_size=16,
                                       max_model_len=PROMPT_LEN, device=CUDA, dtype=DTYPE)  # fmt: skip
        tables = tuple(tuple(range(i * 12, i * 12 + 12)) for i in range(4)) if num_slots is None else ()
        batch = SeqBatch(slots=(0, 1, 2, 3) if num_slots else (0,) * 4, start_pos=starts, n_new=n_new,
                         block_tables=tables, window=window)  # fmt: skip
        tokens = torch.zeros((1, sum(n_new)), dtype=torch.long).to(CUDA, non_blocking=True)
        if num_slots is None:  # the decodes go through the Triton kernel's op (its fake implementation here)
            assert cache.attn_backend == "triton-paged"
        syncs = HostSyncs()
        with syncs:
            logits = model(tokens, batch, cache, last_only=True)
        assert syncs.found == [], f"host syncs inside a serving forward: {sorted(set(syncs.found))}"
        assert logits.shape == (1, 4, model.args.vocab_size) and logits.device.type == "cuda"
