"""The capacity planner's ledger (harness.analytic.ledger): limits that fill memory and are consistent, the terms
concurrency, a paged pool, prefix sharing and offload change, its text, and bad input as one line naming the field."""

from __future__ import annotations

import pytest

from harness.analytic import ledger as planner
from harness.analytic.runtime import GiB
from harness.config import Workload
from harness.errors import ConfigError
from harness.modeling.model_args import ModelArgs

RUNTIME = 300 * 2**20  # a fixed runtime overhead where the test is about arithmetic, not the measured one


# --- the ledger -----------------------------------------------------------------------------------------------------


def plan(memory_gb: float, **fields) -> planner.Ledger:
    return planner.ledger(Workload(**fields), memory_gb=memory_gb, device="cpu", runtime_overhead_bytes=RUNTIME)


def total(workload: Workload) -> int:
    return planner.total_bytes(workload, runtime_overhead_bytes=RUNTIME)


@pytest.mark.parametrize(
    "fields",
    [
        dict(model="small", dtype="fp32", prompt_len=510, gen_len=2),
        dict(model="small", dtype="bf16", kv_dtype="int4", cache="paged", prompt_len=1000, gen_len=24),
        dict(model="small", dtype="bf16", cache="prefix", prefix_len=512, prompt_len=1000, gen_len=24),
        dict(model="small", dtype="bf16", cache={"name": "sliding", "window": 128}, prompt_len=4000, gen_len=96),
    ],
)
def test_max_concurrency_fills_memory_and_one_more_request_would_not(fields):
    book = plan(3.0, **fields)
    workload = Workload(**fields)
    assert book.max_concurrency > 1
    assert total(workload.replace(batch_size=book.max_concurrency)) <= book.memory_bytes
    assert total(workload.replace(batch_size=book.max_concurrency + 1)) > book.memory_bytes


def test_max_context_fills_memory_and_one_more_token_would_not():
    book = plan(2.0, model="small", dtype="fp32", prompt_len=510, gen_len=2, batch_size=8)
    workload = Workload(model="small", dtype="fp32", prompt_len=510, gen_len=2, batch_size=8)
    assert book.max_context_by == "memory" and 512 < book.max_context < workload.model_args().max_seq_len
    assert total(workload.replace(prompt_len=book.max_context - 2)) <= book.memory_bytes
    assert total(workload.replace(prompt_len=book.max_context - 1)) > book.memory_bytes


def test_max_context_says_when_the_models_positions_bound_it():
    book = plan(20.0, model="small", dtype="bf16", prompt_len=100, gen_len=28)
    assert (book.max_context, book.max_context_by) == (8192, "model")


def test_concurrency_multiplies_the_dynamic_part_and_not_the_static_one():
    one = plan(64.0, model="small", dtype="bf16", prompt_len=1000, gen_len=24, batch_size=1)
    eight = plan(64.0, model="small", dtype="bf16", prompt_len=1000, gen_len=24, batch_size=8)
    assert eight.kv_bytes == 8 * one.kv_bytes and eight.activation_bytes == 8 * one.activation_bytes
    assert eight.dynamic_bytes == 8 * one.dynamic_bytes and eight.static_bytes == one.static_bytes
    assert eight.kv_bytes_per_request == one.kv_bytes_per_request == one.kv_bytes


def test_the_ledger_adds_up():
    book = plan(4.0, model="small", dtype="bf16", kv_dtype="fp8_e4m3", prompt_len=2000, gen_len=48, batch_size=4)
    assert book.static_bytes == book.weights_bytes + book.buffers_bytes + RUNTIME
    assert book.total_bytes == book.static_bytes + book.kv_bytes + book.activation_bytes
    assert book.free_bytes == 4 * GiB - book.total_bytes and book.fits
    assert book.weights_bytes == ModelArgs.from_name("small").n_params * 2


def test_a_fixed_paged_pool_bounds_concurrency_by_its_blocks():
    # 4096 tokens of pool at 528 tokens per request (33 blocks of 16): 7 requests, however much memory is free.
    book = plan(
        16.0, model="small", dtype="bf16", cache={"name": "paged", "pool_tokens": 4096}, prompt_len=500, gen_len=28
    )
    assert book.max_concurrency == 4096 // 16 // 33


def test_prefix_caching_holds_the_shared_prefix_once():
    lengths = dict(kv_dtype="bf16", batch_size=8, prompt_len=1000, gen_len=24, prefix_len=500)
    paged = planner.kv_bytes_allocated("small", cache="paged", **lengths)
    prefix = planner.kv_bytes_allocated("small", cache="prefix", **lengths)
    shared_tokens = 500 // 16 * 16  # whole blocks only
    assert paged - prefix == 7 * shared_tokens * planner.kv_bytes_per_token("small", "bf16")


def test_offload_keeps_its_host_store_out_of_the_device_total():
    book = planner.ledger(
        Workload("small", cache="offload", prompt_len=1000, gen_len=24, batch_size=4),
        memory_gb=8,
        device="cuda",
        runtime_overhead_bytes=RUNTIME,
    )
    per_layer = book.kv_bytes_host // ModelArgs.from_name("small").n_layers
    assert book.kv_bytes == 2 * per_layer and book.kv_bytes_host > book.kv_bytes


def test_format_ledger_shows_every_term_and_both_limits():
    text = planner.format_ledger(plan(4.0, model="small", prompt_len=2000, gen_len=48, batch_size=4))
    for label in ("weights", "runtime overhead", "KV per token", "KV for 4 concurrent", "activations", "total"):
        assert label in text
    assert "max concurrency at 2048 tokens:" in text and "max context at 4 concurrent:" in text


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Workload("gpt-5"), r"^model: unknown preset 'gpt-5'; allowed: "),
        (lambda: Workload("small", prompt_len=0), r"^prompt_len: must be a positive integer, got 0$"),
        (lambda: Workload("small", gen_len=-3), r"^gen_len: must be a positive integer, got -3$"),
        (lambda: Workload("small", batch_size=0), r"^batch_size: must be a positive integer, got 0$"),
        (
            lambda: Workload("small", cache={"name": "paged", "block_size": 0}),
            r"^cache\.block_size: must be a positive",
        ),
        (lambda: Workload("small", dtype="fp64"), r"^dtype: unknown value 'fp64'; allowed: fp32, fp16, bf16$"),
        (lambda: Workload("small", prompt_len=8192, gen_len=1), r"^prompt_len \+ gen_len: 8193 exceeds small's"),
        (
            lambda: Workload("tiny", kv_dtype="int4"),
            r"^kv_group_size: tiny's cached row of 16 values is not a multiple of 32",
        ),
        (lambda: Workload("small", cache="sliding", kv_dtype="int4"), r"^kv_dtype: sliding cannot store int4"),
        (lambda: planner.kv_bytes_per_token("small", "fp64"), r"^kv_dtype: unknown value 'fp64'"),
        (
            lambda: planner.ledger(Workload("llama-3.1-8b"), memory_gb=8, device="cuda", runtime_overhead_bytes=0),
            r"^memory_gb: 8\.00 GiB cannot hold llama-3\.1-8b's bf16 weights \(14\.96 GiB\)",
        ),
        (
            lambda: planner.ledger(Workload("small"), memory_gb=0, device="cpu", runtime_overhead_bytes=0),
            r"^memory_gb: must be positive, got 0$",
        ),
        (
            lambda: planner.ledger(Workload("small", cache="offload"), memory_gb=8, device="cpu"),
            r"^cache: offload streams K/V from host memory to a CUDA device",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_field(make, message):
    with pytest.raises(ConfigError, match=message) as error:
        make()
    assert "\n" not in str(error.value)
