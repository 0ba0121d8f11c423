"""Fake CUDA: every supported strategy x kv_dtype x compile mode traced at Llama-3.1-8B shapes, with no GPU.

torch's FakeTensorMode runs tensor programs on device="cuda" without a device or any memory: every op computes only
its output's shape, dtype and device. That needs the CUDA build of torch (the CPU build refuses elementwise ops on
fake CUDA tensors), so this layer runs in its own environment, `make test-cuda-trace` (.venv-cuda), and is skipped,
with that reason, by the CPU build's `make test`. It catches, before any GPU time is spent:
  - device mismatches (a CPU tensor meeting a CUDA one raises under fake tensors);
  - data-dependent ops inside a decode step (`nonzero`, `.item()`, `_local_scalar_dense`, a boolean mask, a CPU
    index into a CUDA tensor, a blocking copy between host and device): each one is a host sync on a real GPU;
  - wrong output shapes;
  - a cache that allocates other than the capacity planner says (harness.analytic.ledger.kv_bytes_allocated);
  - a compiled step that breaks its graph (fullgraph) or mutates an input that is not static (what makes CUDA graph
    trees skip the graph: tests/cuda/graphs.py).
What cannot run without a GPU is replaced through small seams: the Triton kernels are custom ops with fake
implementations (harness.kv.triton_paged), pinned memory and page-locked stores (harness.kv.host), CUDA streams and
events (monkeypatched by the fake_cuda fixture, tests/cuda/conftest.py), and the device's SM count and compute
capability (an H200's: 132 SMs, 9.0). The allocations at 8B scale and a serving forward: test_cuda_trace_forward.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness import kv
from harness.analytic import ledger
from harness.errors import Unsupported
from harness.kv.base import CacheSpec
from harness.kv.quant import BITS
from harness.measure.timing import Sample
from harness.modeling.decode import COMPILE_MODES, compile_decode_step, decode_step, generate
from harness.modeling.model import Transformer
from harness.modeling.model_args import ModelArgs
from tests.cuda.graphs import recording_backend

pytestmark = pytest.mark.cuda_trace
CUDA = torch.device("cuda")
H200_SMS, H200_CAPABILITY = 132, (9, 0)

# One point: prompts long enough that the sliding window slides in prefill (banded) and in decode (its ring), and the
# prefix spans whole blocks plus a partial one.
BATCH, PROMPT_LEN, GEN_LEN, PREFIX_LEN = 2, 200, 4, 72
DTYPE = "bf16"  # the GPU presets' compute dtype
OPTIONS = {
    "paged": {"block_size": 16},
    "prefix": {"block_size": 16},
    "sliding": {"window": 128, "sinks": 4},
    # evicts in prefill and in decode; the other policies: tests/cuda/test_cuda_trace_evict.py
    "evict": {"policy": "h2o", "budget": 128, "window": 16},
}
# Every layer runs the same ops at the same shapes, and a fake op costs the same whatever its shape, so a trace costs
# what its layers do (~10 s per generation at 32 layers on 2 cores). The compute dtype's generation of each strategy
# is traced through all 32 layers; every other case, with 2 of them, the real shapes otherwise. What the depth changes,
# the bytes allocated, is checked at full depth and a long context in test_every_cache_allocates_what_the_planner_says.
SHALLOW_LAYERS = 2

# Ops that read a device value on the host, or whose output shape depends on data: a host sync on a GPU.
SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::is_nonzero",
    "aten::equal",
    "aten::allclose",
}
INDEX_OPS = {"aten::index.Tensor", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}
COPY_OPS = {"aten::_to_copy", "aten::copy_"}


def _is_cuda_build() -> bool:
    return torch.version.cuda is not None


if not _is_cuda_build():
    pytestmark = [
        pytest.mark.cuda_trace,
        pytest.mark.skip(reason="fake CUDA needs the CUDA build of torch: run `make test-cuda-trace` (.venv-cuda)"),
    ]


def supported_points() -> list[tuple[str, str, str]]:
    """(cache, kv_dtype, compile) for every combination the harness runs on CUDA, by the strategies' own rules."""
    points = []
    for cache in kv.strategy_names():
        for kv_dtype in BITS:
            for mode in ("none", *COMPILE_MODES):
                if cache == "none" and kv_dtype != DTYPE:
                    continue  # nothing is stored: Unsupported
                if cache in ("offload",) and kv_dtype not in ("fp32", "fp16", "bf16"):
                    continue  # plain dtypes only: Unsupported
                if cache in ("sliding", "evict") and kv_dtype == "int4":
                    continue  # a ring, an evicting cache cannot hold key groups: Unsupported
                if mode != "none" and (cache not in ("contiguous", "paged", "prefix") or kv_dtype == "int4"):
                    continue  # no static-shape decode step: Unsupported (tests/modeling/test_compile.py checks each refusal)
                points.append((cache, kv_dtype, mode))
    return points


POINTS = supported_points()


class FakeStream:
    """torch.cuda.Stream, as much of it as harness.kv.offload.CudaTransfers calls."""

    def __init__(self, device=None) -> None:
        self.waited: list[object] = []

    def wait_stream(self, stream) -> None:
        self.waited.append(stream)

    def wait_event(self, event) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        pass


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded = 0

    def record(self, stream=None) -> None:
        self.recorded += 1


class FakeTimer:
    """harness.measure.timing.StepTimer's interface with no CUDA events: the trace needs the marks, not the times."""

    def __init__(self) -> None:
        self.n = 0

    def start(self) -> None:
        self.n = 1

    def mark(self) -> None:
        self.n += 1

    def intervals_ms(self) -> list[float]:
        return [0.0] * (self.n - 1)


class HostSyncs(TorchDispatchMode):
    """Records every op that would make the host wait for the GPU, with what made it one."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name + ("." + func._overloadname if func._overloadname != "default" else "")
        base = func._schema.name
        if base in SYNC_OPS:
            self.found.append(f"{name}: reads device data on the host")
        elif name in INDEX_OPS or base in INDEX_OPS:
            target = args[0]
            for index in args[1] if len(args) > 1 else ():
                if isinstance(index, torch.Tensor) and index.device != target.device:
                    self.found.append(f"{name}: a {index.device} index into a {target.device} tensor")
                if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                    self.found.append(f"{name}: a boolean mask (a nonzero)")
        elif base in COPY_OPS:
            source = args[1] if base == "aten::copy_" else args[0]
            destination = args[0].device if base == "aten::copy_" else kwargs.get("device", source.device)
            crosses = isinstance(source, torch.Tensor) and torch.device(destination).type != source.device.type
            if crosses and not kwargs.get("non_blocking", len(args) > 2 and args[2]):
                self.found.append(f"{name}: a blocking copy from {source.device} to {destination}")
        return func(*args, **kwargs)


def watched_step(model, cache):
    """(step, syncs, outputs): a decode step for generate(step=) that records every host sync it would make, and
    the step's outputs."""
    syncs, outputs = HostSyncs(), []

    def step(tokens, pos):
        with syncs:
            out = decode_step(model, cache, tokens, pos)
        outputs.append(out)
        return out

    return step, syncs, outputs


def fake_model(args: ModelArgs) -> Transformer:
    """harness.modeling.model.build_model's model in bf16 on fake CUDA, as initialized (fake tensors hold no values)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # Module.to(dtype) cannot swap fake parameters: make them bf16
    try:
        with torch.device(CUDA):
            model = Transformer(args)
    finally:
        torch.set_default_dtype(default)
    model.setup_rope(PROMPT_LEN + GEN_LEN)
    return model.eval().requires_grad_(False)


def spec_for(args: ModelArgs, kv_dtype: str, prefix_len: int) -> CacheSpec:
    return CacheSpec.for_model(
        args,
        batch_size=BATCH,
        max_tokens=PROMPT_LEN + GEN_LEN,
        kv_dtype=kv_dtype,
        device=CUDA,
        prefix_len=prefix_len,
        dtype=DTYPE,
    )


def planned_kv_bytes(args: ModelArgs, cache_name: str, kv_dtype: str, **lengths: int) -> int:
    """harness.analytic's figure for this cache at these lengths (batch_size, prompt_len, gen_len, prefix_len)."""
    return ledger.kv_bytes_allocated(
        args, cache=cache_name, kv_dtype=kv_dtype, dtype=DTYPE, **OPTIONS.get(cache_name, {}), **lengths
    )


def host_prompt(args: ModelArgs, prefix_len: int) -> torch.Tensor:
    """[B, P] real ids on the host (made before fake mode starts), the first prefix_len shared."""
    prompt = torch.randint(args.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    prompt[:, :prefix_len] = prompt[0, :prefix_len].clone()
    return prompt


@pytest.mark.parametrize(("cache_name", "kv_dtype", "mode"), POINTS, ids=["-".join(point) for point in POINTS])
def test_a_generation_traces_on_fake_cuda_at_llama_3_1_8b_shapes(fake_cuda, cache_name, kv_dtype, mode):
    fake_mode, models = fake_cuda
    model = models["deep" if (kv_dtype, mode) == (DTYPE, "none") else "shallow"]
    args = model.args
    prefix_len = PREFIX_LEN if cache_name == "prefix" else 0
    prompt_ids = host_prompt(args, prefix_len)  # real, made before fake mode
    host_ids = prompt_ids.tolist()  # the host's lists (tolist of a real tensor fails under fake and inference mode)
    options = OPTIONS.get(cache_name, {})
    with fake_mode:
        cache = kv.build(cache_name, spec_for(args, kv_dtype, prefix_len), options)
        prompt = prompt_ids.to(CUDA)
        syncs = HostSyncs()
        steps: list[torch.Tensor] = []
        if mode == "none":

            def step(tokens, pos):
                with syncs:
                    out = decode_step(model, cache, tokens, pos)
                steps.append(out)
                return out

        else:
            backend, graphs = recording_backend()
            torch._dynamo.reset()
            compiled = compile_decode_step(model, cache, mode=mode, backend=backend)

            def step(tokens, pos):
                out = compiled(tokens, pos)
                steps.append(out)
                return out

        generated, sample = generate(model, cache, prompt, GEN_LEN, FakeTimer(), step=step, prompt_ids=host_ids)

        assert syncs.found == [], f"host syncs inside a decode step: {sorted(set(syncs.found))}"
        assert generated.shape == (BATCH, GEN_LEN) and generated.device.type == "cuda"
        assert generated.dtype == torch.long
        assert all(out.shape == (BATCH,) and out.device.type == "cuda" for out in steps)
        assert len(steps) == GEN_LEN - 1 and isinstance(sample, Sample)
        if mode != "none":
            assert len(graphs) == 1, f"{len(graphs)} graphs: a decode step recompiled"
            assert graphs[0].mutated_not_static == [], "CUDA graph trees would skip this graph"
        assert cache.kv_bytes_allocated() == planned_kv_bytes(
            args, cache_name, kv_dtype, batch_size=BATCH, prompt_len=PROMPT_LEN, gen_len=GEN_LEN, prefix_len=prefix_len
        )


def test_the_matrix_covers_every_strategy_and_format_and_skips_only_what_is_unsupported():
    """The list above is the strategies' own rules: each combination left out is one that harness refuses."""
    covered = {(cache, kv_dtype) for cache, kv_dtype, _ in POINTS}
    assert {cache for cache, _ in covered} == set(kv.strategy_names())
    assert {kv_dtype for _, kv_dtype in covered} == set(BITS)
    args = ModelArgs.from_name("llama-3.1-8b")
    for cache in kv.strategy_names():
        for kv_dtype in BITS:
            spec = dataclasses.replace(spec_for(args, kv_dtype, 0), device=torch.device("meta"))
            try:
                with torch.device("meta"):
                    kv.build(cache, spec, OPTIONS.get(cache, {}))
                builds = True
            except Unsupported:
                builds = False
            if cache == "offload":
                builds = kv_dtype in ("fp32", "fp16", "bf16")  # Unsupported off CUDA whatever the format
            assert ((cache, kv_dtype) in covered) == builds, (cache, kv_dtype)
