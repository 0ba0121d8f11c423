"""Fake CUDA (see tests/cuda/test_cuda_trace.py): a generation of an MLA model traced on device="cuda" with no GPU, both
decode paths, in contiguous and paged, bf16 and fp8, at DeepSeek-V2-Lite's and V3's attention shapes (2 layers); and
one serving forward (decodes and a prefill chunk flattened) over the pool the serving engine builds.

It catches host syncs inside a decode step, device mismatches, wrong shapes, a latent cache that reaches for the
in-place kernels (they read a V buffer the latent has not got), and one that allocates other than L x B x S x (R + P)
values plus K's scales."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from harness import kv
from harness.kv.base import CacheSpec
from harness.kv.quant import BITS
from harness.measure.timing import Sample
from harness.modeling.decode import generate
from harness.modeling.model import Transformer
from harness.modeling.model_args import ModelArgs
from tests.cuda.test_cuda_trace import (
    CUDA,
    H200_CAPABILITY,
    H200_SMS,
    FakeEvent,
    FakeStream,
    FakeTimer,
    HostSyncs,
    _is_cuda_build,
    watched_step,
)

pytestmark = pytest.mark.cuda_trace
if not _is_cuda_build():
    pytestmark = [
        pytest.mark.cuda_trace,
        pytest.mark.skip(reason="fake CUDA needs the CUDA build of torch: run `make test-cuda-trace` (.venv-cuda)"),
    ]

BATCH, PROMPT_LEN, GEN_LEN, LAYERS = 2, 40, 4, 2  # a fake op costs the same at any shape: 2 layers trace the rest
BLOCK_SIZE = 16  # 44 tokens: the last block partly filled
PRESETS = ("deepseek-v2-lite", "deepseek-v3")  # q as one projection, and q's low-rank pair


@pytest.fixture(scope="module")
def fake_cuda():
    """FakeTensorMode on CUDA with the seams an H200 would answer (as tests/cuda/conftest.py's fake_cuda)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.kv import host, triton_paged

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_paged, "_sm_count", lambda device: H200_SMS)
        patch.setattr(torch.cuda, "get_device_capability", lambda device=None: H200_CAPABILITY)
        patch.setattr(host, "pinned", lambda tensor: tensor)
        patch.setattr(torch.cuda, "Stream", FakeStream)
        patch.setattr(torch.cuda, "Event", FakeEvent)
        patch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
        patch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        yield FakeTensorMode(allow_non_fake_inputs=True)


def fake_model(args: ModelArgs, mla_path: str) -> Transformer:
    """build_model's MLA model in bf16 on fake CUDA (fake parameters cannot be cast: made bf16 by default)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(CUDA):
            model = Transformer(args, mla_path=mla_path)
    finally:
        torch.set_default_dtype(default)
    model.setup_rope(PROMPT_LEN + GEN_LEN)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("cache_name", ["contiguous", "paged"])
@pytest.mark.parametrize("mla_path", ["absorbed", "naive"])
@pytest.mark.parametrize("preset", PRESETS)
def test_an_mla_generation_traces_on_fake_cuda_without_host_syncs(fake_cuda, preset, mla_path, cache_name, kv_dtype):
    args = dataclasses.replace(ModelArgs.from_name(preset), n_layers=LAYERS)
    prompt_ids = torch.randint(args.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    spec = CacheSpec.for_model(args, batch_size=BATCH, max_tokens=PROMPT_LEN + GEN_LEN, kv_dtype=kv_dtype,
                               device=CUDA, dtype="bf16")  # fmt: skip
    options = {"block_size": BLOCK_SIZE} if cache_name == "paged" else {}
    with fake_cuda:
        model = fake_model(args, mla_path)
        cache = kv.build(cache_name, spec, options)
        step, syncs, steps = watched_step(model, cache)

        generated, sample = generate(model, cache, prompt_ids.to(CUDA), GEN_LEN, FakeTimer(), step=step,
                                     prompt_ids=prompt_ids.tolist())  # fmt: skip

        assert syncs.found == [], f"host syncs inside a decode step: {sorted(set(syncs.found))}"
        assert generated.shape == (BATCH, GEN_LEN) and generated.device.type == "cuda"
        assert len(steps) == GEN_LEN - 1 and isinstance(sample, Sample)
        assert cache.attn_backend in ("sdpa", "sdpa-gather")  # never a kernel that reads a V buffer
        rows = BATCH * (PROMPT_LEN + GEN_LEN) if cache_name == "contiguous" else cache.n_blocks * BLOCK_SIZE
        latent = args.kv_lora_rank + args.qk_rope_head_dim
        scale_bytes = 4 if kv_dtype == "fp8_e4m3" else 0  # one fp32 scale per token for K alone
        assert cache.kv_bytes_allocated() == LAYERS * rows * (latent * BITS[kv_dtype] // 8 + scale_bytes)


SERVE_POINTS = [(c, k) for c in ("contiguous", "paged") for k in ("bf16", "fp8_e4m3", "int8")]


@pytest.mark.parametrize(("cache_name", "kv_dtype"), SERVE_POINTS, ids=["-".join(p) for p in SERVE_POINTS])
@pytest.mark.parametrize("mla_path", ["absorbed", "naive"])
def test_an_mla_serving_forward_traces_on_fake_cuda_without_a_host_sync(fake_cuda, mla_path, cache_name, kv_dtype):
    """One serving iteration of an MLA model (harness.modeling.mla.MLAttention._attend_varlen) through the pool the
    engine builds: three decodes at their own positions and a prefill chunk mid-prompt, flattened, at V2-Lite's
    attention shapes; as tests/cuda/test_cuda_trace_forward.py's serving forward for K/V heads."""
    from harness.kv.varlen import SeqBatch
    from harness.serve.engine import build_cache

    args = dataclasses.replace(ModelArgs.from_name("deepseek-v2-lite"), n_layers=LAYERS)
    starts, n_new = (37, 20, 9, 16), (1, 1, 1, 24)  # three decodes, one chunk of positions 16..39
    with fake_cuda:
        model = fake_model(args, mla_path)
        cache, num_slots = build_cache(cache_name, args, kv_dtype=kv_dtype, num_blocks=16, block_size=BLOCK_SIZE,
                                       max_model_len=PROMPT_LEN + GEN_LEN, device=CUDA, dtype="bf16")  # fmt: skip
        tables = tuple(tuple(range(i * 3, i * 3 + 3)) for i in range(4)) if num_slots is None else ()
        batch = SeqBatch(slots=(0, 1, 2, 3) if num_slots else (0,) * 4, start_pos=starts, n_new=n_new,
                         block_tables=tables)  # fmt: skip
        tokens = torch.zeros((1, sum(n_new)), dtype=torch.long).to(CUDA, non_blocking=True)
        syncs = HostSyncs()
        with syncs:
            logits = model(tokens, batch, cache, last_only=True)
        assert syncs.found == [], f"host syncs inside a serving forward: {sorted(set(syncs.found))}"
        assert logits.shape == (1, 4, args.vocab_size) and logits.device.type == "cuda"
        assert "v" not in cache.format.sides  # the latent alone: no V pool to read
