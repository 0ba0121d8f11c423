"""CUDA-only checks of the paths the CPU cannot take: events timing, NVML probes, the allocator cap.

Their logic is covered on the CPU elsewhere (the same strategies, the same timer API); here they run for real.
Skipped cleanly, with a reason, where there is no CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from harness import kv
from harness.config import RunConfig
from harness.kv.base import CacheSpec
from harness.measure.nvml import device_handle, load_nvml
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate
from harness.modeling.model import build_model
from harness.run.runner import run_point
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens, greedy_with_logits

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def test_every_strategy_generates_the_same_tokens_on_cuda_in_fp32(tiny_args):
    model = build_model(tiny_args, weights="dummy", dtype=torch.float32, device=CUDA, seed=0, n_positions=64)
    prompt = torch.randint(tiny_args.vocab_size, (3, 23), generator=torch.Generator().manual_seed(0)).to(CUDA)
    outputs = []
    for name in ("none", "contiguous", "paged", "offload"):
        spec = CacheSpec.for_model(tiny_args, batch_size=3, max_tokens=23 + 17, kv_dtype="fp32", device=CUDA)
        tokens, sample = generate(model, kv.build(name, spec, {}), prompt, 17, StepTimer(CUDA, n_marks=17))
        assert len(sample.step_ms) == 16 and all(ms > 0 for ms in sample.step_ms)
        outputs.append(tokens.cpu())
    spec = CacheSpec.for_model(tiny_args, batch_size=3, max_tokens=23 + 17, kv_dtype="fp32", device=CUDA)
    expected, logits = greedy_with_logits(model, kv.build("contiguous", spec, {}), prompt, 17)
    for other in outputs:  # other GEMM shapes and kernels: the same tokens up to a near-tie (tests/greedy.py)
        assert_same_greedy_tokens(other, expected, logits, tol=LOGIT_TOL["fp32"])


def test_a_cuda_point_records_allocator_and_nvml_memory():
    row = run_point(
        RunConfig(model={"name": "tiny"}, device="cuda", dtype="bf16", prompt_len=64, gen_len=8, warmup=1)
    ).row
    assert row["status"] == "ok", row.get("error")
    assert row["torch_peak_allocated_bytes"] >= row["weights_bytes"] + row["kv_bytes_allocated"]
    assert row["torch_peak_reserved_bytes"] >= row["torch_peak_allocated_bytes"]
    assert row["nvml_peak_used_bytes"] >= row["mem_baseline_bytes"]
    assert row["device_name"] == torch.cuda.get_device_name()
    if row["peak_mem_source"] == "nvml_process":  # NVML's view holds the context besides what the allocator reserved
        assert row["peak_mem_bytes"] == row["nvml_process_peak_bytes"] > row["torch_peak_reserved_bytes"]
    else:  # NVML does not list this PID (a container): the allocator's figure, never silently
        assert row["peak_mem_source"] == "torch_reserved"
        assert row["peak_mem_bytes"] == row["torch_peak_reserved_bytes"]


def test_max_memory_gb_forces_a_cuda_oom_row():
    row = run_point(
        RunConfig(model={"name": "small"}, device="cuda", batch_size=512, prompt_len=4096, gen_len=8, max_memory_gb=2)
    ).row
    assert row["status"] == "oom", row.get("error")


def test_a_cuda_point_records_energy_clocks_and_throttle_reasons():
    row = run_point(RunConfig(model={"name": "small"}, device="cuda", prompt_len=128, gen_len=32, warmup=1)).row
    assert row["status"] == "ok", row.get("error")
    assert row["nvml_error"] is None
    assert row["nvml_timed_samples"] > 0
    nvml = load_nvml()
    nvml.nvmlInit()
    try:  # the GPU torch runs on, found as the probe finds it; its boost clock bounds the SM clock from above
        handle = device_handle(nvml, torch.cuda.get_device_properties(CUDA))
        assert nvml.nvmlDeviceGetUUID(handle).removeprefix("GPU-") == str(torch.cuda.get_device_properties(CUDA).uuid)
        max_sm_mhz = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)
    finally:
        nvml.nvmlShutdown()
    # Sampled under load: near boost, far above the few hundred MHz an idle GPU reads right after a synchronize.
    assert max_sm_mhz / 2 < row["sm_clock_mhz_max"] <= max_sm_mhz
    assert 0 < row["sm_clock_mhz_min"] <= row["sm_clock_mhz_max"]
    assert 0 < row["mem_clock_mhz_min"] <= row["mem_clock_mhz_max"]
    assert row["throttle_reasons"] >= 0
    if row["energy_j_per_token"] is not None:  # Volta and newer
        assert row["energy_j_per_token"] > 0 and row["mean_power_w"] > 10


# --- the in-place decode kernels and compile, on CUDA --------------------------------------------------------------


def _random_pool(*, kv_dtype, batch, n_kv_heads, group, head_dim, lens, block_size, compute, seed=0):
    """A shuffled block table over a pool holding random K/V in kv_dtype (int8/fp8 with their scales), on CUDA."""
    from harness.kv.quant import token_codec

    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-max(lens) // block_size)
    n_blocks = batch * blocks_per_seq + 5
    codec = token_codec(kv_dtype)
    pool = {}
    for side in "kv":
        parts = codec.encode(torch.randn(n_blocks, n_kv_heads, block_size, head_dim, generator=gen))
        pool[side] = {name: t.to(CUDA) for name, t in parts.items()}
    table = torch.randperm(n_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    inputs = dict(
        q=torch.randn(batch, n_kv_heads * group, head_dim, generator=gen).to(CUDA, compute),
        k_pool=pool["k"]["data"],
        v_pool=pool["v"]["data"],
        table=table.to(CUDA),
        lens=torch.tensor(lens, dtype=torch.int32, device=CUDA),
        block_size=block_size,
    )
    if "scale" in pool["k"]:
        inputs |= {"k_scale": pool["k"]["scale"][..., 0], "v_scale": pool["v"]["scale"][..., 0]}
    return inputs


@pytest.mark.parametrize(
    ("kv_dtype", "compute", "tolerance"),
    [("bf16", torch.bfloat16, 2e-2), ("fp16", torch.float16, 2e-3), ("fp32", torch.float32, 1e-4),
     ("int8", torch.bfloat16, 2e-2), ("fp8_e4m3", torch.bfloat16, 2e-2), ("fp8_e5m2", torch.float16, 2e-3)],
)  # fmt: skip
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("n_splits", [1, None])  # None: as many as the split heuristic wants on this GPU
def test_the_compiled_kernel_matches_its_reference_on_cuda(kv_dtype, compute, tolerance, group, n_splits):
    from harness.kv import triton_paged

    if reason := triton_paged.kernel_unsupported(kv_dtype, CUDA):
        pytest.skip(reason)
    lens = [1, 300, 2049, 4096]
    inputs = _random_pool(
        kv_dtype=kv_dtype, batch=4, n_kv_heads=8, group=group, head_dim=128, lens=lens, block_size=16, compute=compute
    )
    expected = triton_paged.paged_decode_reference(**inputs)
    actual = triton_paged.paged_decode(**inputs, max_len=max(lens), n_splits=n_splits)
    # Relative to each sequence's own largest output: the 1-token sequence's output is a V row (largest ~3), the
    # 4096-token one a softmax average of many (largest ~0.1), so against the batch's largest output a long
    # context's errors would hide. fp8_e5m2 with fp16 queries is held to plain fp16's 2e-3: before the kernel prescaled its value
    # scales (p * amax / 57344 fell into fp16's subnormals) it sat at 3.5e-3 to 1.2e-2 on these sequences, yet
    # under 9e-4 against the batch's largest output (Triton's interpreter on these inputs; 8e-4 now, either way).
    for seq in range(len(lens)):
        error = (actual[seq].float() - expected[seq].float()).abs().max().item()
        assert error <= tolerance * expected[seq].float().abs().max().item(), (seq, lens[seq], error)


@pytest.mark.parametrize(
    ("cache", "kv_dtype", "backend"),
    [("paged", "bf16", ("triton-paged", "flashinfer")), ("paged", "fp8_e4m3", ("triton-paged",)),
     ("prefix", "int8", ("triton-paged",)), ("contiguous", "bf16", ("sdpa",)),
     ("contiguous", "fp8_e4m3", ("triton-dequant",))],
)  # fmt: skip
def test_a_cuda_row_names_the_decode_attention_that_ran(cache, kv_dtype, backend):
    row = run_point(
        RunConfig(
            model={"name": "tiny"}, cache={"name": cache}, device="cuda", dtype="bf16", kv_dtype=kv_dtype,
            prompt_len=100, gen_len=8, prefix_len=32 if cache == "prefix" else 0, warmup=1,
            min_repeats=1, max_repeats=1, profile=False, roofline=False, isolate=False,
        )
    ).row  # fmt: skip
    assert row["status"] == "ok", row.get("error")
    assert row["attn_backend"] in backend


def test_int4_has_no_fused_path_and_says_so(tiny_args):
    spec = CacheSpec.for_model(
        tiny_args, batch_size=1, max_tokens=64, kv_dtype="int4", device=CUDA, kv_group_size=8
    )  # tiny's head_dim of 16 needs groups smaller than the harness's 32 and 64
    assert kv.build("paged", spec, {"block_size": 8}).attn_backend == "sdpa-gather"
    assert kv.build("contiguous", spec, {}).attn_backend == "sdpa"


def test_the_paged_and_contiguous_kernels_generate_the_eager_gather_tokens_in_fp32(tiny_args):
    model = build_model(tiny_args, weights="dummy", dtype=torch.float32, device=CUDA, seed=0, n_positions=128)
    prompt = torch.randint(tiny_args.vocab_size, (3, 70), generator=torch.Generator().manual_seed(0)).to(CUDA)
    outputs, logits = {}, {}
    for name, kv_dtype in (("contiguous", "fp32"), ("paged", "fp32"), ("prefix", "fp32")):
        spec = CacheSpec.for_model(tiny_args, batch_size=3, max_tokens=70 + 20, kv_dtype=kv_dtype, device=CUDA)
        cache = kv.build(name, spec, {})
        outputs[name], logits[name] = greedy_with_logits(model, cache, prompt, 20)
    for name in ("paged", "prefix"):  # their kernels sum in other orders: the same tokens up to a near-tie
        assert_same_greedy_tokens(outputs[name], outputs["contiguous"], logits["contiguous"], tol=LOGIT_TOL["fp32"])


@pytest.mark.parametrize(
    ("cache_name", "mode", "kv_dtype", "backend"),
    [("contiguous", "default", "fp32", "sdpa-masked"), ("contiguous", "reduce-overhead", "fp8_e4m3", "triton-dequant"),
     ("paged", "reduce-overhead", "fp32", "triton-paged"), ("paged", "reduce-overhead", "int8", "triton-paged")],
)  # fmt: skip
def test_a_compiled_decode_on_cuda_generates_the_eager_tokens(tiny_args, cache_name, mode, kv_dtype, backend):
    from harness.modeling.decode import compile_decode_step, cudagraph_skips

    model = build_model(tiny_args, weights="dummy", dtype=torch.float32, device=CUDA, seed=0, n_positions=64)
    prompt = torch.randint(tiny_args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0)).to(CUDA)
    spec = CacheSpec.for_model(tiny_args, batch_size=2, max_tokens=20 + 12, kv_dtype=kv_dtype, device=CUDA)
    eager, logits = greedy_with_logits(model, kv.build(cache_name, spec, {}), prompt, 12)
    cache = kv.build(cache_name, spec, {})
    step = compile_decode_step(model, cache, mode=mode)
    skips = cudagraph_skips()
    for _ in range(2):  # the first generation compiles (and records the graph), the second replays it
        compiled, sample = generate(model, cache, prompt, 12, StepTimer(CUDA, n_marks=12), step=step)
        cache.release()
        # Compiled kernels (and the static split count) sum in other orders: eager's tokens up to a near-tie.
        assert_same_greedy_tokens(compiled, eager, logits, tol=LOGIT_TOL[kv_dtype])
    assert cache.attn_backend == backend
    assert cudagraph_skips() == skips, "inductor skipped CUDA graphs for this step"


def test_a_reduce_overhead_point_on_cuda_captures_its_graphs():
    """Whether graphs make a step faster is a benchmark's question (scripts/gpu_check.sh); here: were they captured."""
    point = dict(model={"name": "tiny"}, device="cuda", dtype="bf16", prompt_len=64, gen_len=32, warmup=1,
                 min_repeats=3, max_repeats=3, profile=False, roofline=False, isolate=False)  # fmt: skip
    graphs = run_point(RunConfig(**point, compile="reduce-overhead")).row
    assert graphs["status"] == "ok", graphs.get("error")
    assert graphs["compile"] == "reduce-overhead" and graphs["attn_backend"] == "sdpa-masked"
    assert graphs["cudagraph_skips"] == 0
