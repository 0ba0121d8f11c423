"""The offload strategy's bookkeeping on the CPU (synchronous copies); the CUDA streams run in tests/device/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from harness import kv
from harness.errors import Unsupported
from harness.kv.base import CacheSpec
from harness.kv.offload import OffloadCache, Options, SyncTransfers
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens, greedy_with_logits

CPU = torch.device("cpu")


def spec_for(args, *, batch_size: int, max_tokens: int) -> CacheSpec:
    return CacheSpec.for_model(args, batch_size=batch_size, max_tokens=max_tokens, kv_dtype="fp32", device=CPU)


def run(model, cache, prompt, gen_len):
    return generate(model, cache, prompt, gen_len, StepTimer(CPU, n_marks=gen_len))[0]


def test_offload_on_a_cpu_device_is_unsupported_with_a_reason(tiny_args):
    with pytest.raises(Unsupported, match="offload streams K/V .* to a CUDA device; this point runs on cpu"):
        kv.build("offload", spec_for(tiny_args, batch_size=1, max_tokens=8), {})


def test_offloaded_decoding_matches_contiguous(tiny_model, tiny_args):
    prompt = torch.randint(tiny_args.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))
    spec = spec_for(tiny_args, batch_size=2, max_tokens=13 + 9)
    offloaded = run(tiny_model, OffloadCache(spec, Options(), transfers=SyncTransfers()), prompt, 9)
    contiguous, logits = greedy_with_logits(tiny_model, kv.build("contiguous", spec, {}), prompt, 9)
    # Offload attends over token-major views (another row stride into SDPA's GEMMs; on CUDA, maybe another SDPA
    # kernel): the same tokens up to a near-tie (tests/greedy.py).
    assert_same_greedy_tokens(offloaded, contiguous, logits, tol=LOGIT_TOL["fp32"])


def test_every_token_is_written_back_to_the_host_store(tiny_model, tiny_args):
    spec = spec_for(tiny_args, batch_size=1, max_tokens=12)
    offload = OffloadCache(spec, Options(), transfers=SyncTransfers())
    contiguous = kv.build("contiguous", spec, {})
    prompt = torch.randint(tiny_args.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    run(tiny_model, offload, prompt, 5)
    run(tiny_model, contiguous, prompt, 5)
    present = 7 + 5 - 1
    host = offload.host[:, :present].permute(0, 2, 3, 4, 1, 5)  # [L, K|V, B, H, S, D]
    torch.testing.assert_close(host, torch.stack((contiguous.k, contiguous.v), dim=1)[:, :, :, :, :present])


def test_the_device_holds_two_layers_and_the_next_layer_is_prefetched(tiny_args):
    spec = spec_for(tiny_args, batch_size=1, max_tokens=8)
    cache = OffloadCache(spec, Options(), transfers=SyncTransfers())
    assert cache.staging.shape[0] == 2
    per_layer = cache.host.numel() // tiny_args.n_layers * cache.host.element_size()
    assert cache.kv_bytes_allocated() == cache.kv_bytes_host() + 2 * per_layer
    cache.prepare(0, 3)
    assert cache.slot_layer == [0, -1]
    q = torch.zeros(1, tiny_args.n_heads, 3, tiny_args.head_dim)
    k = torch.zeros(1, tiny_args.n_kv_heads, 3, tiny_args.head_dim)
    cache.attend(0, q, k, k, 0)
    assert cache.slot_layer == [0, 1]  # layer 1 is on its way while layer 0 computes


def test_offload_of_a_quantized_format_is_unsupported(tiny_args):
    spec = CacheSpec.for_model(tiny_args, batch_size=1, max_tokens=8, kv_dtype="int8", device=CPU)
    with pytest.raises(Unsupported, match="int8"):
        OffloadCache(spec, Options(), transfers=SyncTransfers())


def test_the_host_store_locks_exactly_its_bytes_not_the_next_power_of_two(monkeypatch):
    """torch's pin_memory=True rounds a block up to a power of two (CachingHostAllocator): the store is registered."""
    import gc

    from harness.kv import host
    from harness.kv.offload import CudaTransfers

    calls = []

    class FakeCudart:  # what harness.kv.host calls of the CUDA runtime
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(host, "cudart", FakeCudart)
    store = CudaTransfers.host_zeros((3, 5, 7, 9), torch.bfloat16)  # 1890 bytes: no power of two
    assert calls == [("register", store.data_ptr(), 3 * 5 * 7 * 9 * 2)] and not bool(store.any())
    address = store.data_ptr()
    del store
    gc.collect()
    assert calls[-1] == ("unregister", address)  # unregistered when the store goes
