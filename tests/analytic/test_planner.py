"""The capacity planner: published per-token KV figures, exact allocations against the real caches, a ledger whose
limits are consistent, one-line errors, and the OOM frontier it predicts (slow) and the CUDA peak (gpu)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from experiments.capacity import CapacityConfig, find_frontier
from harness import kv
from harness.analytic import activations
from harness.analytic import ledger as planner
from harness.analytic.runtime import GiB
from harness.config import DTYPES, RunConfig, Workload, resolve_model
from harness.errors import ConfigError, Unsupported
from harness.kv.base import CacheSpec
from harness.kv.offload import OffloadCache, SyncTransfers
from harness.kv.offload import Options as OffloadOptions
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate, prefill
from harness.modeling.model import build_model
from harness.modeling.model_args import ModelArgs

ROOT = Path(__file__).parents[2]
CPU = torch.device("cpu")
KiB = 1024
RUNTIME = 300 * 2**20  # a fixed runtime overhead where the test is about arithmetic, not the measured one

# --- published per-token figures ------------------------------------------------------------------------------------

# OPT-13B / LLaMA-13B shapes: 40 layers, hidden 5120, multi-head attention (40 heads of 128).
SHAPES_13B = ModelArgs(name="13b-shapes", dim=5120, n_layers=40, n_heads=40, max_seq_len=2048)
# Llama 3 70B, "The Llama 3 Herd of Models" (Grattafiori et al. 2024), Table 3: 80 layers, model dimension 8192,
# 64 attention heads, 8 key/value heads.
SHAPES_LLAMA3_70B = ModelArgs(name="llama-3-70b-shapes", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8)


@pytest.mark.parametrize(
    ("model", "kv_dtype", "published_bytes"),
    [
        # Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention"
        # (SOSP '23, arXiv:2309.06180), section 3: "the KV cache of a single token in the 13B OPT model demands
        # 800 KB of space, calculated as 2 (key and value vectors) x 5120 (hidden state size) x 40 (number of
        # layers) x 2 (bytes per FP16)". 2 x 5120 x 40 x 2 = 819,200 bytes = 800 KiB.
        pytest.param(SHAPES_13B, "fp16", 800 * KiB, id="opt-13b-pagedattention-paper"),
        # NVIDIA Technical Blog, "Mastering LLM Techniques: Inference Optimization" (2023),
        # https://developer.nvidia.com/blog/mastering-llm-techniques-inference-optimization/ : "with a Llama 2 7B
        # model in 16-bit precision and a batch size of 1, the size of the KV cache will be 1 * 4096 * 2 * 32 * 4096
        # * 2 bytes, which is ~2 GB" for 4096 tokens: per token 2 x 32 layers x 4096 x 2 bytes = 512 KiB.
        pytest.param("llama-2-7b", "fp16", 512 * KiB, id="llama-2-7b-nvidia-blog"),
        # GQA models: the figure derived from the published shapes, 2 x layers x kv_heads x head_dim x 2 bytes.
        # Llama 3 paper, Table 3 (8B: 32 layers, 8 KV heads, dim 4096 / 32 heads = 128): 131,072 B = 128 KiB.
        pytest.param("llama-3.1-8b", "bf16", 128 * KiB, id="llama-3.1-8b-llama3-paper-table3"),
        # ... 70B: 2 x 80 x 8 x 128 x 2 = 327,680 B = 320 KiB.
        pytest.param(SHAPES_LLAMA3_70B, "bf16", 320 * KiB, id="llama-3-70b-llama3-paper-table3"),
        # Jiang et al. 2023, "Mistral 7B" (arXiv:2310.06825), Table 1: n_layers 32, head_dim 128, n_kv_heads 8:
        # 2 x 32 x 8 x 128 x 2 = 128 KiB.
        pytest.param("mistral-7b", "bf16", 128 * KiB, id="mistral-7b-paper-table1"),
        # Qwen2.5 Technical Report (arXiv:2412.15115), Table 1, 7B: 28 layers, 28 / 4 query / KV heads, hidden
        # 3584 / 28 = 128 per head: 2 x 28 x 4 x 128 x 2 = 57,344 B = 56 KiB.
        pytest.param("qwen2.5-7b", "bf16", 56 * KiB, id="qwen2.5-7b-report-table1"),
    ],
)
def test_published_per_token_kv_figures_are_reproduced_exactly(model, kv_dtype, published_bytes):
    assert planner.kv_bytes_per_token(model, kv_dtype) == published_bytes


def test_the_nvidia_blog_llama_2_7b_cache_at_4096_tokens_is_2_gib():
    # The blog's "~2 GB": 1 x 4096 x 2 x 32 x 4096 x 2 bytes = 2 GiB exactly, for the reserved 4096 tokens.
    allocated = planner.kv_bytes_allocated(
        "llama-2-7b", cache="contiguous", kv_dtype="fp16", batch_size=1, prompt_len=4000, gen_len=96, dtype="fp16"
    )
    assert allocated == 2 * GiB


def test_the_vllm_blog_llama_13b_sequence_takes_1_7_gb():
    # vLLM blog, "vLLM: Easy, Fast, and Cheap LLM Serving with PagedAttention" (2023-06-20),
    # https://blog.vllm.ai/2023/06/20/vllm.html : the KV cache "takes up to 1.7GB for a single sequence in
    # LLaMA-13B", at its 2048-token context: 2048 x 800 KiB = 1.68e9 bytes.
    allocated = planner.kv_bytes_allocated(
        SHAPES_13B, cache="contiguous", kv_dtype="fp16", batch_size=1, prompt_len=2047, gen_len=1, dtype="fp16"
    )
    assert round(allocated / 1e9, 1) == 1.7


def test_mistral_rolling_buffer_cuts_the_cache_8x_at_32k_tokens():
    # Mistral 7B paper, section 2 (Rolling Buffer Cache): with a 4096-token window, "on a sequence length of 32k
    # tokens, this reduces the cache memory usage by 8x".
    lengths = dict(batch_size=1, prompt_len=32768 - 1, gen_len=1, kv_dtype="bf16")
    full = planner.kv_bytes_allocated("mistral-7b", cache="contiguous", **lengths)
    rolling = planner.kv_bytes_allocated("mistral-7b", cache="sliding", window=4096, **lengths)
    assert full == 8 * rolling


def test_a_local_hugging_face_config_plans_without_weights(tmp_path):
    config = {  # meta-llama/Llama-3.1-8B's config.json, the fields the planner reads
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert planner.kv_bytes_per_token(tmp_path, "bf16") == 128 * KiB
    assert resolve_model(tmp_path).n_params == ModelArgs.from_name("llama-3.1-8b").n_params


def test_quantized_per_token_figures_carry_their_scales():
    bf16 = planner.kv_bytes_per_token("llama-3.1-8b", "bf16")
    # fp8/int8: 1 byte per value + one fp32 scale per token and head: (128 + 4) / 256 of bf16.
    assert planner.kv_bytes_per_token("llama-3.1-8b", "fp8_e4m3") / bf16 == (128 + 4) / 256
    # int4 (KIVI, group 32): half a byte per value + a scale and a zero per 32 values, on both sides: 0.375 of bf16.
    assert planner.kv_bytes_per_token("llama-3.1-8b", "int4") / bf16 == 0.375


# --- the planner against the real caches ----------------------------------------------------------------------------

# head_dim 64: int4 with groups of 32 and 64 both apply. Two layers, tiny widths: quick on a CPU.
PLANNER_ARGS = ModelArgs(
    name="planner-test", vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=256
)
BATCH, PROMPT, GEN, PREFIX = 3, 45, 5, 33  # 50 tokens: not a multiple of a block or a group


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def planner_model(request):
    dtype = request.param
    model = build_model(
        PLANNER_ARGS, weights="dummy", dtype=DTYPES[dtype], device=CPU, seed=0, n_positions=PROMPT + GEN
    )
    return dtype, model


def measured_allocation(model, dtype: str, *, cache: str, kv_dtype: str, options: dict, quant: dict) -> int:
    """Build the real cache as harness.run.point does, generate (int4 allocates its tail on the first write), and read
    kv_bytes_allocated at the peak."""
    spec = CacheSpec.for_model(
        PLANNER_ARGS,
        batch_size=BATCH,
        max_tokens=PROMPT + GEN,
        kv_dtype=kv_dtype,
        device=CPU,
        prefix_len=PREFIX,
        dtype=dtype,
        **quant,
    )
    if cache == "offload":  # CUDA-only through kv.build; its CPU-testable construction
        real = OffloadCache(spec, OffloadOptions(), transfers=SyncTransfers())
    else:
        real = kv.build(cache, spec, options)
    prompt = torch.randint(PLANNER_ARGS.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    prompt[:, :PREFIX] = prompt[0, :PREFIX].clone()  # every sequence shares the prefix, as bench.make_prompts
    generate(model, real, prompt, GEN, StepTimer(CPU, n_marks=GEN))
    return real.kv_bytes_allocated()


VARIANTS = [  # (cache, options, quant) beyond the defaults: block rounding, fixed pools, windows, int4 layouts
    ("paged", {"block_size": 8}, {}),  # an int4 key group spans 4 blocks: its row sits in the first
    ("paged", {"block_size": 64}, {}),  # 2 key groups per block; one block holds the whole sequence
    ("paged", {"block_size": 12}, {}),  # int4: neither divides the other: unsupported
    ("paged", {"pool_tokens": 1000}, {}),  # a fixed pool, rounded up to whole blocks
    ("prefix", {"block_size": 8}, {}),
    ("prefix", {"pool_tokens": 512}, {}),
    ("prefix", {}, {"kv_residual": 4}),  # int4: the private tail cannot hold a shared prefix: unsupported
    ("sliding", {"window": 16, "sinks": 4}, {}),  # a ring shorter than the sequence
    ("sliding", {"window": 4096}, {}),  # a window longer than the sequence: max_tokens slots
    ("contiguous", {}, {"kv_group_size": 64}),
    ("contiguous", {}, {"kv_residual": 8}),
    ("paged", {}, {"kv_residual": 20, "kv_group_size": 64}),  # a ring longer than the sequence: capped
]
KV_DTYPES = ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
CASES = [(name, {}, {}) for name in kv.strategy_names()] + VARIANTS


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    ("cache", "options", "quant"), CASES, ids=[f"{c}-{o}-{q}".replace(" ", "") for c, o, q in CASES]
)
def test_planner_predicts_every_strategys_allocation_exactly(planner_model, cache, options, quant, kv_dtype):
    dtype, model = planner_model
    try:
        measured = measured_allocation(model, dtype, cache=cache, kv_dtype=kv_dtype, options=options, quant=quant)
    except Unsupported:
        with pytest.raises(ConfigError):  # what the strategy refuses, the planner refuses, naming the field
            planner.kv_bytes_allocated(
                PLANNER_ARGS, cache=cache, kv_dtype=kv_dtype, batch_size=BATCH, prompt_len=PROMPT, gen_len=GEN,
                prefix_len=PREFIX, dtype=dtype, **options, **quant,
            )  # fmt: skip
        return
    predicted = planner.kv_bytes_allocated(
        PLANNER_ARGS, cache=cache, kv_dtype=kv_dtype, batch_size=BATCH, prompt_len=PROMPT, gen_len=GEN,
        prefix_len=PREFIX, dtype=dtype, **options, **quant,
    )  # fmt: skip
    assert predicted == measured


def test_the_int4_tail_is_in_the_compute_dtype(planner_model):
    dtype, model = planner_model
    measured = measured_allocation(model, dtype, cache="contiguous", kv_dtype="int4", options={}, quant={})
    plain = dict(cache="contiguous", batch_size=BATCH, prompt_len=PROMPT, gen_len=GEN)
    fp32 = planner.kv_bytes_allocated(PLANNER_ARGS, kv_dtype="int4", dtype="fp32", **plain)
    bf16 = planner.kv_bytes_allocated(PLANNER_ARGS, kv_dtype="int4", dtype="bf16", **plain)
    assert measured == (fp32 if dtype == "fp32" else bf16) and fp32 > bf16


# --- activations against the tensors a forward really holds ------------------------------------------------------

# Wide enough that activations are tens of MiB (Python's own allocations are noise below that); a 256-token vocab.
ACTIVATION_ARGS = ModelArgs(
    name="activation-test", vocab_size=256, dim=512, n_layers=3, n_heads=8, n_kv_heads=2, intermediate_size=1536
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks")]
    _fields_ += [(name, ctypes.c_size_t) for name in ("fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_live_bytes_probe():
    """glibc's bytes in use (heap chunks + mmapped chunks), or None where there is no mallinfo2 (not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def live() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    return live


class PeakLiveBytes(TorchDispatchMode):
    """The most bytes in use right after any aten op: every op's output counted while its inputs are alive."""

    def __init__(self, live) -> None:
        super().__init__()
        self.live, self.start, self.peak = live, live(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.live() - self.start)
        return out


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "cache", "options", "prompt_len", "gen_len", "attn_impl"),
    [
        ("fp32", "fp32", "contiguous", {}, 256, 4, "sdpa"),
        ("bf16", "bf16", "paged", {"block_size": 16}, 250, 40, "sdpa"),
        ("fp32", "int8", "contiguous", {}, 256, 4, "sdpa"),
        ("fp32", "fp32", "sliding", {"window": 64, "sinks": 4}, 256, 4, "sdpa"),  # the band mask, held through layers
        ("fp32", "fp32", "contiguous", {}, 256, 4, "eager"),  # the scores [B, H, T, S], written out
        ("bf16", "bf16", "paged", {"block_size": 16}, 250, 40, "eager"),
    ],
)
def test_prefill_activations_match_the_tensors_the_forward_holds(
    dtype, kv_dtype, cache, options, prompt_len, gen_len, attn_impl
):
    check_prefill_activations(ACTIVATION_ARGS, dtype, kv_dtype, cache, options, prompt_len, gen_len, attn_impl)


# MLA at the same width: the latent of 128 + 32, 8 heads of 64 + 32 (nope + rope) and values of 64.
MLA_ACTIVATION_ARGS = ModelArgs(
    name="mla-activation-test", vocab_size=256, dim=512, n_layers=3, n_heads=8, intermediate_size=1536,
    kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
)  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "cache", "options", "mla_path"),
    [("fp32", "contiguous", {}, "absorbed"), ("bf16", "paged", {"block_size": 16}, "naive")],
)
def test_an_mla_prefill_holds_what_the_planner_says(dtype, cache, options, mla_path):
    check_prefill_activations(MLA_ACTIVATION_ARGS, dtype, dtype, cache, options, 256, 4, "sdpa", mla_path=mla_path)


def check_prefill_activations(
    args, dtype, kv_dtype, cache, options, prompt_len, gen_len, attn_impl, mla_path="absorbed"
):
    live = malloc_live_bytes_probe()
    if live is None:
        pytest.skip("needs glibc's mallinfo2")
    batch, max_tokens = 4, prompt_len + gen_len
    model = build_model(args, dtype=DTYPES[dtype], device=CPU, seed=0, n_positions=max_tokens, mla_path=mla_path)

    def spec(kv_dtype: str) -> CacheSpec:
        return CacheSpec.for_model(
            args, batch_size=batch, max_tokens=max_tokens, kv_dtype=kv_dtype, device=CPU, dtype=dtype,
            attn_impl=attn_impl,
        )  # fmt: skip

    prompt = torch.randint(args.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prefill(model, kv.build("contiguous", spec(dtype), {}), prompt)  # BLAS buffers, thread pools: runtime
        measured_cache = kv.build(cache, spec(kv_dtype), options)
        with PeakLiveBytes(live) as tracked:
            prefill(model, measured_cache, prompt)
    workload = Workload(
        args, dtype=dtype, kv_dtype=kv_dtype, cache={"name": cache, **options}, prompt_len=prompt_len,
        gen_len=gen_len, batch_size=batch, attn_impl=attn_impl, mla_path=mla_path,
    )  # fmt: skip
    predicted = activations.prefill_activation_bytes(workload)
    assert abs(predicted - tracked.peak) <= 0.02 * tracked.peak + 2**20, (predicted, tracked.peak)


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


def capacity_app(*overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.capacity", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_the_plan_mode_prints_the_ledger_for_a_gpu(tmp_path):
    proc = capacity_app(
        "mode=plan",
        "model=llama-3.1-8b",
        "dtype=bf16",
        "kv_dtype=fp8_e4m3",
        "prompt_len=8192",
        "gen_len=1024",
        "concurrency=32",
        "memory_gb=141",
        "device=cuda",  # planned from any machine: memory_gb and the runtime are given
        "runtime_overhead_gb=1",
        f"results_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "llama-3.1-8b: bf16 weights, fp8_e4m3 KV" in proc.stdout
    assert "max concurrency at 9216 tokens: " in proc.stdout and "max context at 32 concurrent: " in proc.stdout


def test_the_app_rejects_a_weights_overflow_in_one_line(tmp_path):
    proc = capacity_app(
        "mode=plan",
        "model=llama-3.1-8b",
        "memory_gb=4",
        "device=cpu",
        "runtime_overhead_gb=0",
        f"results_dir={tmp_path}",
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("kvbench: bad config: memory_gb: 4.00 GiB cannot hold llama-3.1-8b's")
    assert len(proc.stderr.strip().splitlines()) == 1


# --- against measured memory ----------------------------------------------------------------------------------------


def fake_probe(frontier: int, seen: list[int]):
    """A probe that fits up to `frontier` and records what it was asked."""

    def probe(cfg: RunConfig) -> dict:
        seen.append(cfg.batch_size)
        return {"status": "ok" if cfg.batch_size <= frontier else "oom", "peak_mem_bytes": 1, "mem_baseline_bytes": 0}

    return probe


@pytest.mark.parametrize("predicted", [1, 30, 37, 38, 90, 4096])
def test_the_frontier_search_finds_the_largest_batch_that_fits_from_any_prediction(predicted):
    seen: list[int] = []
    cfg = CapacityConfig(model={"name": "tiny"}, contexts=[256])
    found = find_frontier(cfg, context=256, predicted=predicted, probe=fake_probe(37, seen))
    assert (found["measured_max_batch"], found["first_oom_batch"], found["bisection_step"]) == (37, 38, 1)
    assert found["probes"] == len(seen) == len(set(seen)) and seen[0] == min(predicted, cfg.max_batch)


def test_an_exact_prediction_costs_two_probes():
    seen: list[int] = []
    find_frontier(CapacityConfig(model={"name": "tiny"}), context=512, predicted=37, probe=fake_probe(37, seen))
    assert seen == [37, 38]


def test_a_coarser_resolution_stops_at_a_wider_bracket():
    seen: list[int] = []
    cfg = CapacityConfig(model={"name": "tiny"}, resolution=0.1)
    found = find_frontier(cfg, context=512, predicted=300, probe=fake_probe(371, seen))
    assert found["measured_max_batch"] <= 371 < found["first_oom_batch"]
    assert found["bisection_step"] <= 0.1 * found["measured_max_batch"]


def test_when_nothing_fits_the_frontier_is_zero():
    found = find_frontier(CapacityConfig(model={"name": "tiny"}), context=512, predicted=3, probe=fake_probe(0, []))
    assert (found["measured_max_batch"], found["first_oom_batch"]) == (0, 1)


@pytest.mark.slow
def test_the_oom_frontier_is_within_one_bisection_step_of_the_prediction(tmp_path):
    # The tiny model: each probe is a spawned child that runs or OOMs in seconds. At 8192 tokens one request is
    # 27 MiB, well above the few MiB the runtime's measurement varies by, so one batch is a fair step. One context:
    # each costs a bisection of spawned probes (about a minute here); the planner's tests cover many.
    overrides = ["model=tiny", "dtype=fp32", "contexts=[8192]", "max_memory_gb=0.6", f"results_dir={tmp_path}"]
    proc = capacity_app(*overrides, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (written,) = (tmp_path / "capacity").glob("frontier-*.parquet")
    table = pd.read_parquet(written)
    assert list(table["context"]) == [8192]
    assert (table["measured_max_batch"] > 5).all()  # a real frontier, well above one request
    assert (table["bisection_step"] == 1).all()
    assert (table["first_oom_batch"] - table["measured_max_batch"] == table["bisection_step"]).all()
    assert table["within_step"].all(), table.to_string()


@pytest.mark.gpu
def test_the_planner_is_within_5_percent_of_the_cuda_allocator_peak():
    cfg = RunConfig(
        model={"name": "llama-3.2-1b"},
        device="cuda",
        dtype="bf16",
        batch_size=8,
        prompt_len=1024,
        gen_len=16,
        warmup=0,
        min_repeats=1,
        max_repeats=1,
        accuracy=False,
    )
    from harness.run.runner import run_point

    row = run_point(cfg).row
    assert row["status"] == "ok", row.get("error")
    workload = Workload("llama-3.2-1b", dtype="bf16", prompt_len=1024, gen_len=16, batch_size=8)
    predicted = planner.total_bytes(workload, runtime_overhead_bytes=0)  # what the allocator holds
    assert abs(predicted - row["torch_peak_allocated_bytes"]) <= 0.05 * row["torch_peak_allocated_bytes"]
