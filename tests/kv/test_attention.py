"""The shared attention (harness.kv.base.attention) and the sliding window's banded prefill hand SDPA a call that a
fused kernel can take: GQA folded into the query axis, never a mask together with enable_gqa (on CUDA, up to torch
2.13, that pair leaves only the math backend, which repeats K/V per group), and never repeated K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from harness import kv
from harness.kv.base import CacheSpec, attention

CPU = torch.device("cpu")
HEAD_DIM = 16
# (query heads, K/V heads): MHA, GQA with groups of 2 and 4, and MQA.
GROUPINGS = [(4, 4), (4, 2), (8, 2), (6, 1)]


def new_tokens(*, n_heads: int, n_kv_heads: int, n_new: int, n_keys: int, seed: int = 0):
    """q [B, H, T, D] as the model makes it (a transposed view of [B, T, H, D]); k, v [B, H_kv, S, D]."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n_new, n_heads, HEAD_DIM, generator=generator).transpose(1, 2)
    k, v = (torch.randn(2, n_kv_heads, n_keys, HEAD_DIM, generator=generator) for _ in range(2))
    return q, k, v


def masked_gqa_reference(q, k, v, start_pos: int) -> torch.Tensor:
    """The formulation attention() used before (a lower-right causal mask with enable_gqa): right, but the math
    backend on CUDA up to torch 2.13."""
    n_keys = k.shape[2]
    q_pos = torch.arange(start_pos, n_keys)[:, None]
    k_pos = torch.arange(n_keys)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=k_pos <= q_pos, enable_gqa=q.shape[1] != k.shape[1])


class SdpaCalls(TorchFunctionMode):
    """Records, for each F.scaled_dot_product_attention call: whether it had a mask, its enable_gqa, and the query
    and K/V head counts it was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, key = args[0], args[1]
            has_mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None) is not None
            self.calls.append(
                {
                    "mask": has_mask,
                    "enable_gqa": bool(kwargs.get("enable_gqa", False)),
                    "q_heads": query.shape[1],
                    "kv_heads": key.shape[1],
                }
            )
        return func(*args, **kwargs)


class AtenOps(TorchDispatchMode):
    """The aten ops that run, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


CPU_FLASH, MATH = "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), GROUPINGS)
@pytest.mark.parametrize(("start_pos", "n_new"), [(0, 7), (5, 7), (9, 1), (3, 2)])
def test_attention_equals_the_masked_gqa_formulation(n_heads, n_kv_heads, start_pos, n_new):
    q, k, v = new_tokens(n_heads=n_heads, n_kv_heads=n_kv_heads, n_new=n_new, n_keys=start_pos + n_new)
    # Same sums, other shapes: the folded call runs G*T query rows per K/V head where the reference runs T per
    # query head, so the CPU kernel may block and accumulate them in another order. In fp32 a reordered sum of n
    # terms differs by at most ~n * 2^-24 of the sum of magnitudes: with D = 16 and S <= 12 terms of magnitude
    # ~1 (softmax weights sum to 1, values ~N(0, 1)), ~1e-6; 1e-5 leaves a margin and still catches any wrong key
    # or group (those move outputs by ~0.1).
    torch.testing.assert_close(
        attention(q, k, v, start_pos), masked_gqa_reference(q, k, v, start_pos), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), GROUPINGS)
@pytest.mark.parametrize(("start_pos", "n_new"), [(0, 7), (5, 7), (9, 1)])
def test_attention_never_gives_sdpa_a_mask_with_enable_gqa_nor_repeated_kv(n_heads, n_kv_heads, start_pos, n_new):
    q, k, v = new_tokens(n_heads=n_heads, n_kv_heads=n_kv_heads, n_new=n_new, n_keys=start_pos + n_new)
    with SdpaCalls() as recorded:
        attention(q, k, v, start_pos)
    assert len(recorded.calls) == 1
    call = recorded.calls[0]
    assert not (call["mask"] and call["enable_gqa"]), call
    assert call["kv_heads"] == n_kv_heads, call  # K/V as stored, one head per group: never repeated
    assert call["enable_gqa"] or call["q_heads"] == call["kv_heads"], call  # GQA folded where not enabled


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), GROUPINGS)
@pytest.mark.parametrize(("start_pos", "n_new"), [(0, 7), (5, 7), (9, 1)])
def test_on_the_cpu_attention_runs_the_flash_kernel_never_math(n_heads, n_kv_heads, start_pos, n_new):
    # Deterministic on any CPU: the CPU's choice (select_sdp_backend_cpp in aten's sdp_utils_cpp.cpp) checks
    # dtypes, shapes, strides and dropout, never the instruction set; the ISA only picks code inside the kernel.
    q, k, v = new_tokens(n_heads=n_heads, n_kv_heads=n_kv_heads, n_new=n_new, n_keys=start_pos + n_new)
    with AtenOps() as ops:
        attention(q, k, v, start_pos)
    assert ops.names.count(CPU_FLASH) == 1
    assert MATH not in ops.names


def sliding_cache(*, n_heads: int, n_kv_heads: int, window: int, sinks: int, max_tokens: int):
    spec = CacheSpec(
        n_layers=1,
        n_kv_heads=n_kv_heads,
        head_dim=HEAD_DIM,
        batch_size=2,
        max_tokens=max_tokens,
        kv_dtype="fp32",
        device=CPU,
    )
    return kv.build("sliding", spec, {"window": window, "sinks": sinks})


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), GROUPINGS)
def test_sliding_banded_prefill_never_gives_sdpa_a_mask_with_enable_gqa_nor_repeated_kv(n_heads, n_kv_heads):
    window, sinks, chunks = 8, 2, [11, 6, 1]  # a prefill past the window, a banded chunk after it, a decode step
    cache = sliding_cache(n_heads=n_heads, n_kv_heads=n_kv_heads, window=window, sinks=sinks, max_tokens=sum(chunks))
    start_pos = 0
    with SdpaCalls() as recorded:
        for n_new in chunks:
            q, k, v = new_tokens(n_heads=n_heads, n_kv_heads=n_kv_heads, n_new=n_new, n_keys=n_new, seed=start_pos)
            cache.prepare(start_pos, n_new)
            cache.attend(0, q, k, v, start_pos)
            start_pos += n_new
    assert len(recorded.calls) == len(chunks)
    for call in recorded.calls:
        assert not (call["mask"] and call["enable_gqa"]), call
        assert call["kv_heads"] == n_kv_heads, call
        assert call["q_heads"] == call["kv_heads"], call  # every sliding call is folded


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(8, 2), (8, 1)])
def test_on_cuda_prefill_after_a_prefix_needs_no_math_backend(dtype, n_heads, n_kv_heads):
    # With the math backend switched off, SDPA raises "No available kernel" for any call only math could take
    # (a mask with enable_gqa, up to torch 2.13). D = 64 meets every fused kernel's alignment.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device("cuda")
    start_pos, n_new = 40, 24
    q = torch.randn(2, n_heads, n_new, 64, device=device, dtype=dtype)
    k, v = (torch.randn(2, n_kv_heads, start_pos + n_new, 64, device=device, dtype=dtype) for _ in range(2))
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):
        out = attention(q, k, v, start_pos)
    reference = masked_gqa_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), start_pos)
    # fp16/bf16 inputs rounded once, fp32 accumulation in the kernels: a few ulps of bf16 (2^-8) on outputs ~1.
    torch.testing.assert_close(out.float().cpu(), reference, rtol=2e-2, atol=2e-2)
