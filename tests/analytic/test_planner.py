"""The capacity planner (harness.analytic.ledger, activations) against what it models: published per-token KV
figures, exact allocations against the real caches, and prefill activations against the tensors a forward holds."""

from __future__ import annotations

import ctypes
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness import kv
from harness.analytic import activations
from harness.analytic import ledger as planner
from harness.analytic.runtime import GiB
from harness.config import DTYPES, Workload, resolve_model
from harness.errors import ConfigError, Unsupported
from harness.kv.base import CacheSpec
from harness.kv.offload import OffloadCache, SyncTransfers
from harness.kv.offload import Options as OffloadOptions
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate, prefill
from harness.modeling.model import build_model
from harness.modeling.model_args import ModelArgs

CPU = torch.device("cpu")
KiB = 1024


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
