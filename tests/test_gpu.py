"""CUDA-only checks of the paths the CPU cannot take: events timing, NVML probes, the allocator cap.

Their logic is covered on the CPU elsewhere (the same strategies, the same timer API); here they run for real.
Skipped cleanly, with a reason, where there is no CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from harness import kv
from harness.config import RunConfig
from harness.decode import generate
from harness.kv.base import CacheSpec
from harness.model import build_model
from harness.runner import run_point
from harness.timing import StepTimer

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
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


def test_a_cuda_point_records_allocator_and_nvml_memory():
    row = run_point(RunConfig(model={"name": "tiny"}, device="cuda", dtype="bf16", prompt_len=64, gen_len=8, warmup=1))
    assert row["status"] == "ok", row.get("error")
    assert row["torch_peak_allocated_bytes"] >= row["weights_bytes"] + row["kv_bytes_allocated"]
    assert row["torch_peak_reserved_bytes"] >= row["torch_peak_allocated_bytes"]
    assert row["nvml_peak_used_bytes"] >= row["mem_baseline_bytes"]
    assert row["device_name"] == torch.cuda.get_device_name()


def test_max_memory_gb_forces_a_cuda_oom_row():
    row = run_point(
        RunConfig(model={"name": "small"}, device="cuda", batch_size=512, prompt_len=4096, gen_len=8, max_memory_gb=2)
    )
    assert row["status"] == "oom", row.get("error")


def test_a_cuda_point_records_energy_clocks_and_throttle_reasons():
    row = run_point(RunConfig(model={"name": "small"}, device="cuda", prompt_len=128, gen_len=32, warmup=1))
    assert row["status"] == "ok", row.get("error")
    assert row["sm_clock_mhz_start"] > 0 and row["mem_clock_mhz_end"] > 0
    assert row["throttle_reasons_start"] >= 0
    if row["energy_j_per_token"] is not None:  # Volta and newer
        assert row["energy_j_per_token"] > 0 and row["mean_power_w"] > 10
