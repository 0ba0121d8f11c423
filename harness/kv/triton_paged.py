"""Decode attention that reads K/V through the block table in place: the custom op around the Triton kernels, and
its pure-torch twin.

One new query token per sequence attends over that sequence's cached keys, wherever the pool put them: position p of
sequence b lives in block `table[b, p // block_size]`, slot `p % block_size`. Nothing is gathered into a contiguous
copy first (which is what `paged` does on the CPU: a full read and write of the context per layer and step).

The kernels themselves, and how they read int8/fp8 codes with their scales, are harness.kv.triton_kernels (after
vLLM's PagedAttention and flash-decoding); this module decides what they are launched with: the checks, the number
of splits of a long context (split_count, _split_plan), and whether the device can run them (kernel_unsupported).

The same layout serves the contiguous cache: its [B, H_kv, S_max, D] buffer is a pool of B blocks of S_max tokens,
and the block table is [[0], [1], ..., [B-1]].

`paged_decode_reference` is the same algorithm in torch, tile by tile over the block table: the test oracle (it runs
anywhere), itself tested against harness.kv.base.attention over the gathered K/V.

The kernels are one torch custom op, `kvbench::paged_decode` (`torch.ops.kvbench.paged_decode`), which
`paged_decode` calls once it has decided the host-side figures (checks, n_splits). Its fake implementation only
allocates the output, so the op traces under FakeTensorMode and torch.compile(fullgraph=True) on any device, with or
without triton: on device="cuda" without a GPU, give n_splits or monkeypatch `_sm_count` (and `_capability` for
`kernel_unsupported`), the only device queries. It is also the CPU op a profile shows around the kernels, and
the op FlopCounterMode counts (harness.measure.profile).

Where this runs: harness.kv.paged (decode steps on CUDA: "triton-paged") and harness.kv.contiguous (int8/fp8 decode
steps on CUDA: "triton-dequant"). Both import this module only on CUDA.
"""

from __future__ import annotations

import functools
import math

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import flop_registry, register_flop_formula

from harness.kv import triton_kernels

MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in its merge than its parallelism buys


# The CUDA device queries, each in one small function: under FakeTensorMode without a GPU they raise, so a test that
# traces on device="cuda" monkeypatches these two.
@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def split_count(*, batch: int, n_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU twice over, none shorter than
    MIN_SPLIT_TOKENS. Batch 1 on 8 KV heads at 8k tokens: 8 programs alone would use 8 of an H200's 132 SMs."""
    wanted = math.ceil(2 * _sm_count(device) / (batch * n_kv_heads))
    return max(1, min(wanted, max_len // MIN_SPLIT_TOKENS))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv, without triton


def _split_plan(*, max_len: int, n_splits: int) -> tuple[int, int]:
    """(positions per split, a multiple of BLOCK_N; the splits that cover max_len) for about n_splits splits."""
    split_tokens = _cdiv(_cdiv(max_len, n_splits), triton_kernels.BLOCK_N) * triton_kernels.BLOCK_N
    return split_tokens, _cdiv(max_len, split_tokens)


def _check(q, k_pool, v_pool, table, lens, k_scale, v_scale) -> tuple[int, int, int, int]:
    batch, n_heads, head_dim = q.shape
    n_kv_heads = k_pool.shape[1]
    assert k_pool.shape == v_pool.shape and k_pool.shape[-1] == head_dim, (q.shape, k_pool.shape, v_pool.shape)
    assert k_pool.stride() == v_pool.stride(), "K and V share one set of strides"
    assert n_heads % n_kv_heads == 0, f"{n_heads} query heads cannot share {n_kv_heads} KV heads"
    assert table.shape[0] == batch and lens.shape == (batch,), (table.shape, lens.shape)
    assert (k_scale is None) == (v_scale is None), "scales come in pairs"
    if k_scale is not None:
        assert k_scale.shape == k_pool.shape[:-1] and k_scale.stride() == v_scale.stride(), k_scale.shape
    return batch, n_heads, n_kv_heads, head_dim


OP_NAME = "kvbench::paged_decode"  # the custom op; also its CPU op name in a profile (harness.measure.profile)


def _paged_decode_impl(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *,
    block_size: int,
    max_len: int,
    n_splits: int,
) -> torch.Tensor:
    """The op's real implementation, arguments as paged_decode's once checked (n_splits decided): the kernels'
    launches (harness.kv.triton_kernels)."""
    split_tokens, n_splits = _split_plan(max_len=max_len, n_splits=n_splits)
    return triton_kernels.launch(
        q=q,
        k_pool=k_pool,
        v_pool=v_pool,
        table=table,
        lens=lens,
        k_scale=k_scale,
        v_scale=v_scale,
        block_size=block_size,
        split_tokens=split_tokens,
        n_splits=n_splits,
    )


# An opaque custom op everywhere, with one fake implementation: the output's shape, dtype and device from q's,
# nothing read, nothing launched, so it traces under FakeTensorMode on any device, with or without triton, and
# torch.compile keeps it as one node (CUDA graphs capture its launches). Not a triton_op: inductor would then trace
# into the kernels and functionalize them, which needs the kernels' TTIR to learn what they mutate (failing that, it
# clones every input, the KV pools included, at every call), and the fake-CUDA tests could not check that path.
_op = torch.library.custom_op(OP_NAME, _paged_decode_impl, mutates_args=())


@_op.register_fake
def _paged_decode_fake(q, k_pool, v_pool, table, lens, k_scale, v_scale, *, block_size, max_len, n_splits):
    return q.new_empty(q.shape)  # [B, H, D], contiguous as the real output


def _paged_decode_flops(q_shape, k_pool_shape, v_pool_shape, *args, max_len, out_shape=None, **kwargs) -> int:
    """Q.K^T and P.V, 2 FLOPs per multiply-add (as torch.utils.flop_counter counts SDPA), over max_len keys for each
    sequence and query head. The lens are data and a formula sees only shapes (and ints), so this is exact when every
    sequence holds max_len tokens, as the harness's batches do (they decode in lockstep), and an upper bound
    otherwise; at static shapes (harness.kv.contiguous) max_len is the whole buffer, as SDPA's masked path counts."""
    batch, n_heads, head_dim = q_shape
    return 2 * batch * n_heads * max_len * (head_dim + v_pool_shape[-1])


if torch.ops.kvbench.paged_decode not in flop_registry:  # FlopCounterMode's formulas; a reload registers once
    register_flop_formula(torch.ops.kvbench.paged_decode)(_paged_decode_flops)


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    *,
    block_size: int,
    max_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    n_splits: int | None = None,
) -> torch.Tensor:
    """One decode query per sequence over its paged K/V, with the Triton kernel: the op `kvbench::paged_decode`.

    q [B, H, D]; k_pool, v_pool [N, H_kv, block_size, D] in any storage dtype (int8/fp8 codes with k_scale, v_scale
    [N, H_kv, block_size] fp32); table [B, max_blocks] block ids; lens [B] tokens held per sequence (at least 1 each,
    at most max_len, a host-side bound that sizes the splits) -> [B, H, D] in q's dtype.

    The host-side figures are decided here, before the op: the checks, and n_splits (by default split_count's, which
    asks the device its SM count). Under FakeTensorMode on CUDA without a GPU, pass n_splits (or monkeypatch
    _sm_count): the op itself then only allocates its fake output.
    """
    _check(q, k_pool, v_pool, table, lens, k_scale, v_scale)
    assert q.stride(-1) == 1 and k_pool.stride(-1) == 1, "the head dimension must be dense"
    if n_splits is None:
        n_splits = split_count(batch=q.shape[0], n_kv_heads=k_pool.shape[1], max_len=max_len, device=q.device)
    # The op's dispatch costs tens of microseconds a call, once per layer per step on an eager decode: only what
    # looks at the op (a trace, fake tensors, a dispatch mode such as FlopCounterMode, the profiler) goes through it.
    call = torch.ops.kvbench.paged_decode if _seen(q) else _paged_decode_impl
    return call(
        q, k_pool, v_pool, table, lens, k_scale, v_scale, block_size=block_size, max_len=max_len, n_splits=n_splits
    )


def _seen(q: torch.Tensor) -> bool:
    """Whether anything watches this call as an op: torch.compile, fake tensors, a dispatch mode, the profiler."""
    return (
        torch.compiler.is_compiling()
        or isinstance(q, FakeTensor)
        or _get_current_dispatch_mode() is not None
        or torch.autograd.profiler._is_profiler_enabled
    )


def paged_decode_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    *,
    block_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tile: int = triton_kernels.BLOCK_N,
) -> torch.Tensor:
    """The kernel's algorithm in torch (same arguments, same result up to rounding), in fp32: the oracle.

    Tile by tile over the block table, never more than `tile` positions of K/V at a time; the scales fold into the
    scores and the probabilities exactly as in the kernel.
    """
    batch, n_heads, n_kv_heads, head_dim = _check(q, k_pool, v_pool, table, lens, k_scale, v_scale)
    group = n_heads // n_kv_heads
    lens = lens.to(torch.long)
    assert bool((lens >= 1).all()), "every sequence holds at least its newest token"
    queries = q.float().view(batch, n_kv_heads, group, head_dim)  # [B, H_kv, G, D]
    m = torch.full((batch, n_kv_heads, group), -math.inf, device=q.device)  # running max, natural log units
    l = torch.zeros((batch, n_kv_heads, group), device=q.device)  # noqa: E741
    acc = torch.zeros((batch, n_kv_heads, group, head_dim), device=q.device)
    for start in range(0, int(lens.max()), tile):
        pos = torch.arange(start, start + tile, device=q.device)  # [n]
        valid = pos[None, :] < lens[:, None]  # [B, n]
        blocks = table[:, torch.clamp(pos // block_size, max=table.shape[1] - 1)].long()  # [B, n]
        slots = (pos % block_size).expand_as(blocks)
        k = k_pool[blocks, :, slots].float().permute(0, 2, 1, 3)  # [B, H_kv, n, D], the stored codes
        v = v_pool[blocks, :, slots].float().permute(0, 2, 1, 3)
        scores = queries @ k.transpose(-1, -2)  # [B, H_kv, G, n]
        if k_scale is not None:
            scores = scores * k_scale[blocks, :, slots].permute(0, 2, 1)[:, :, None, :]
        scores = (scores / math.sqrt(head_dim)).masked_fill(~valid[:, None, None, :], -math.inf)
        m_new = torch.maximum(m, scores.amax(dim=-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new[..., None])
        l = l * alpha + p.sum(dim=-1)  # noqa: E741
        if v_scale is not None:
            p = p * v_scale[blocks, :, slots].permute(0, 2, 1)[:, :, None, :]
        acc = acc * alpha[..., None] + p @ v
        m = m_new
    return (acc / l[..., None]).to(q.dtype).view(batch, n_heads, head_dim)


def kernel_unsupported(kv_dtype: str, device: torch.device) -> str | None:
    """Why the kernel cannot serve this storage format on this device, or None when it can."""
    if device.type != "cuda":
        return f"the kernel runs on CUDA, not {device.type}"
    if triton_kernels.UNAVAILABLE is not None:
        return triton_kernels.UNAVAILABLE
    if kv_dtype == "int4":
        return "int4 (KIVI) groups keys across tokens and keeps a full-precision tail: no fused path"
    if kv_dtype.startswith("fp8") and _capability(device) < (8, 9):
        return "Triton converts fp8 in registers on compute capability 8.9+ only"
    return None
