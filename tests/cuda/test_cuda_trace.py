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
events (monkeypatched below), and the device's SM count and compute capability (an H200's: 132 SMs, 9.0).
"""

from __future__ import annotations

import contextlib
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


@pytest.fixture(scope="module")
def fake_cuda():
    """A FakeTensorMode on CUDA, with the seams that reach the CUDA runtime replaced by what an H200 would answer,
    and the two fake models every test shares (built once: initializing 8B parameters costs seconds even fake)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.kv import host, triton_paged

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_paged, "_sm_count", lambda device: H200_SMS)
        patch.setattr(torch.cuda, "get_device_capability", lambda device=None: H200_CAPABILITY)
        patch.setattr(host, "pinned", lambda tensor: tensor)  # page-locking is a driver call: nothing to fake
        patch.setattr(host, "page_locked_zeros", lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        patch.setattr(torch.cuda, "Stream", FakeStream)
        patch.setattr(torch.cuda, "Event", FakeEvent)
        patch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
        patch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        args = ModelArgs.from_name("llama-3.1-8b")
        with mode:
            models = {
                "deep": fake_model(args),
                "shallow": fake_model(dataclasses.replace(args, n_layers=SHALLOW_LAYERS)),
            }
        yield mode, models


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
