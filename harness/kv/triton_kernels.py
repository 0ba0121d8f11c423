"""The Triton kernels of the paged decode attention (harness.kv.triton_paged's op), and their launch.

One new query token per sequence over that sequence's cached keys, read in place through the block table: position
p of sequence b lives in block `table[b, p // block_size]`, slot `p % block_size`. After vLLM's PagedAttention (Kwon
et al. 2023) and flash-decoding (Dao et al. 2023):
    - one program per (sequence, KV head, split): the G = n_heads / n_kv_heads query heads of a GQA group ride in
      one [G, D] tile, so every K/V tile is loaded once for the whole group (Ainslie et al. 2023);
    - online softmax over tiles of BLOCK_N positions (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022),
      in fp32, with exp2 and the 1/sqrt(D) scale folded into log2(e);
    - split-K: a long context with few (sequence, head) pairs is cut into splits that run in parallel, each writes its
      normalized partial output and log-sum-exp, and a second small kernel merges them;
    - fused dequantization for int8 and fp8 storage (harness.kv.quant: one fp32 scale per token and KV head). The
      narrow codes enter the dot products as they are, cast to the query's dtype (exact: int8 and fp8 values are
      representable in fp16 and bf16); the key scale multiplies the scores, the value scale the probabilities,
      times a power of two that keeps them out of fp16's subnormals (`_v_prescale`), divided out at the end.
      No full-precision copy of K or V exists at any time.

The kernels keep their leading underscores: Triton names a kernel after its function, and harness.measure.profile classifies
the kernels of a profile by those names. `launch` is their only caller; harness.kv.triton_paged decides its figures
(checks, splits) and wraps it in the custom op.

Triton's interpreter runs the kernels on CPU tensors, which is how the tests check their logic without a GPU: it
needs TRITON_INTERPRET=1 when this module is imported (the decorators read it) and while the kernels run. Its numpy
dot has no bf16, so there (and only there) bf16 dot operands are widened to fp32: the values are the same, only the
products' accumulation order differs.

triton is optional: without it this module still imports (UNAVAILABLE says why), defines no kernel, and `launch`
raises that reason.
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # an optional dependency: the CPU build and the tests without it never need it
    triton = tl = None
    UNAVAILABLE = f"triton is not importable ({exc})"
else:
    UNAVAILABLE = None

# Whether the kernels below were built for Triton's interpreter: decided when this module is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): exp2 is the fast path on the GPU
BLOCK_N = 64  # positions per tile: a 64 x 128 bf16 K or V tile is 16 KiB; pipelined stages fit in shared memory
DOT_FP32, DOT_FP16, DOT_BF16 = 0, 1, 2


def available() -> bool:
    return UNAVAILABLE is None


def _dot_kind(dtype: torch.dtype) -> int:
    if dtype == torch.float16:
        return DOT_FP16
    if dtype == torch.bfloat16 and not INTERPRETED:  # the interpreter's numpy has no bf16 matmul
        return DOT_BF16
    return DOT_FP32  # fp32 queries (exact: IEEE, never TF32), and bf16 under the interpreter


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,  # [B, H, D]
        k_ptr,  # [N, H_kv, bs, D] (contiguous cache: [B, H_kv, S_max, D])
        v_ptr,
        k_scale_ptr,  # [N, H_kv, bs] fp32 (scaled formats only)
        v_scale_ptr,
        table_ptr,  # [B, max_blocks] block ids
        lens_ptr,  # [B] tokens cached per sequence
        out_ptr,  # [B, H, D] (one split) or [B, H, n_splits, D] fp32 (several)
        lse_ptr,  # [B, H, n_splits] fp32, log2 units (several splits only)
        stride_qb,
        stride_qh,
        stride_kn,
        stride_kh,
        stride_ks,
        stride_sn,
        stride_sh,
        stride_ss,
        stride_tb,
        stride_ob,
        stride_oh,
        stride_os,
        block_size,
        split_tokens,  # positions per split, a multiple of BLOCK_N
        qk_scale,  # 1/sqrt(D) * log2(e)
        v_prescale,  # a power of two the value scales are multiplied by (1 for plain formats): see _v_prescale
        group,  # query heads per KV head (a runtime value: groups 2..16 share one compiled kernel)
        GROUP_PAD: tl.constexpr,  # >= 16: tl.dot's smallest tile
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SCALED: tl.constexpr,  # int8/fp8 codes with per-token scales
        DOT_KIND: tl.constexpr,
        SPLIT: tl.constexpr,  # write a partial (output, lse) per split
    ):
        seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        seq_len = tl.load(lens_ptr + seq)
        first = split * split_tokens
        last = tl.minimum(first + split_tokens, seq_len)

        rows = tl.arange(0, GROUP_PAD)  # the group's query heads
        dims = tl.arange(0, HEAD_DIM_PAD)
        row_ok, dim_ok = rows < group, dims < HEAD_DIM
        heads = kv_head * group + rows
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [G, D]
        if DOT_KIND == 1:
            q = q.to(tl.float16)
        elif DOT_KIND == 2:
            q = q.to(tl.bfloat16)
        else:
            q = q.to(tl.float32)

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores, log2 units
        l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)  # noqa: E741
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        for start in range(first, last, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < last
            block = tl.load(table_ptr + seq * stride_tb + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
            slot = pos % block_size
            kv_offsets = block[:, None] * stride_kn + kv_head * stride_kh + slot[:, None] * stride_ks + dims[None, :]
            kv_mask = pos_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, D], the stored codes
            if DOT_KIND == 1:
                scores = tl.dot(q, tl.trans(k.to(tl.float16)))
            elif DOT_KIND == 2:
                scores = tl.dot(q, tl.trans(k.to(tl.bfloat16)))
            else:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")  # [G, BLOCK_N] fp32
            scale_offsets = block * stride_sn + kv_head * stride_sh + slot * stride_ss
            if SCALED:  # q . (codes * s) = (q . codes) * s: one multiply per score, none per element
                scores = scores * tl.load(k_scale_ptr + scale_offsets, mask=pos_ok, other=0.0)[None, :]
            scores = tl.where(pos_ok[None, :], scores * qk_scale, float("-inf"))

            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.math.exp2(m - m_new)  # rescales what was accumulated under the old max
            p = tl.math.exp2(scores - m_new[:, None])  # [G, BLOCK_N]
            l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
            if SCALED:  # sum_t p_t * (codes_t * s_t) = sum_t (p_t * s_t * 2^k) * codes_t / 2^k, 2^k = v_prescale
                v_scale = tl.load(v_scale_ptr + scale_offsets, mask=pos_ok, other=0.0) * v_prescale
                p = p * v_scale[None, :]
            if DOT_KIND == 1:
                pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
            elif DOT_KIND == 2:
                pv = tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
            else:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            acc = acc * alpha[:, None] + pv
            m = m_new

        has_keys = l > 0  # a split past the end of a short sequence saw no key
        # Normalized, the prescale undone (exact: a power of two; 1 for plain formats). l, hence the lse, never saw
        # it, so each split's partial output is in the values' units and the merge weighs them as before.
        out = acc / (tl.where(has_keys, l, 1.0) * v_prescale)[:, None]
        out_offsets = seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
        out_mask = row_ok[:, None] & dim_ok[None, :]
        if SPLIT:
            tl.store(out_ptr + out_offsets, out, mask=out_mask)
            lse = tl.where(has_keys, m + tl.math.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
            n_splits = tl.num_programs(2)
            tl.store(lse_ptr + (seq * tl.num_programs(1) * group + heads) * n_splits + split, lse, mask=row_ok)
        else:
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _merge_splits_kernel(
        part_ptr,  # [B * H, n_splits, D] fp32, each split's normalized output
        lse_ptr,  # [B * H, n_splits] fp32, log2 units; -inf for a split without keys
        out_ptr,  # [B, H, D]
        n_splits,
        n_heads,
        stride_ob,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        row = tl.program_id(0)  # one (sequence, query head)
        splits, dims = tl.arange(0, SPLITS_PAD), tl.arange(0, HEAD_DIM_PAD)
        split_ok, dim_ok = splits < n_splits, dims < HEAD_DIM
        lse = tl.load(lse_ptr + row * n_splits + splits, mask=split_ok, other=float("-inf"))
        weight = tl.math.exp2(lse - tl.max(lse, axis=0))  # split 0 always holds keys: the max is finite
        part = tl.load(
            part_ptr + (row * n_splits + splits[:, None]) * HEAD_DIM + dims[None, :],
            mask=split_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        out = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        seq, head = row // n_heads, row % n_heads
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def _v_prescale(code_dtype: torch.dtype) -> float:
    """The power of two the kernel multiplies the value scales by, and divides the output by: the largest one not
    above the format's largest code (int8 127 -> 64, fp8 e4m3 448 -> 256, fp8 e5m2 57344 -> 32768); 1 for plain
    storage.

    Why: a value scale is amax / max_code (harness.kv.quant), so p * s, the probability operand of the P.V dot, lies
    max_code times below the values it weighs. With fp16 queries that operand is cast to fp16, whose normals end at
    6.1e-5 (2^-14): with e5m2 and values under 3.5, every p * s is subnormal, with fewer significant bits the smaller
    it is (values under 0.01: p * s < 1.8e-7, 3 steps of 2^-24, 2 of fp16's 11 bits), and the output loses as many
    (tests/kv/test_triton_paged.py measured 0.9 relative error at |v| ~ 1e-3). Times 2^k <= max_code, p * s * 2^k <=
    p * amax: the operand lands where the values themselves would (never past fp16's max when they came from fp16),
    the products add up in fp32, and the output is divided by 2^k. Powers of two round nothing: in fp32, bf16 and
    the fp32 accumulator this changes no bit; in fp16 it only keeps bits the subnormals would drop.
    """
    if code_dtype == torch.int8:
        max_code = torch.iinfo(code_dtype).max
    elif code_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        max_code = torch.finfo(code_dtype).max
    else:
        return 1.0
    return 2.0 ** math.floor(math.log2(max_code))


def launch(
    *,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_size: int,
    split_tokens: int,
    n_splits: int,
) -> torch.Tensor:
    """The kernels' launches: q [B, H, D] over the paged K/V (as harness.kv.triton_paged.paged_decode's arguments,
    checked) in n_splits splits of split_tokens positions (a multiple of BLOCK_N) -> [B, H, D] in q's dtype. With one
    split the decode kernel writes the output; with several it writes fp32 partials and their lse, and the merge
    kernel the output. Outside a trace torch.library.wrap_triton hands back the kernel as it is."""
    if triton is None:
        raise RuntimeError(UNAVAILABLE)
    batch, n_heads, head_dim = q.shape
    n_kv_heads = k_pool.shape[1]
    group = n_heads // n_kv_heads
    out = torch.empty((batch, n_heads, head_dim), dtype=q.dtype, device=q.device)
    if n_splits > 1:
        partial = torch.empty((batch, n_heads, n_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, n_heads, n_splits), dtype=torch.float32, device=q.device)
    else:
        partial, lse = out.unsqueeze(2), out  # [B, H, 1, D]; lse is never written with one split
    scaled = k_scale is not None
    k_scale = k_scale if scaled else lens  # any tensor: a pointer the kernel never reads
    v_scale = v_scale if scaled else lens
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    torch.library.wrap_triton(_paged_decode_kernel)[(batch, n_kv_heads, n_splits)](
        q,
        k_pool,
        v_pool,
        k_scale,
        v_scale,
        table,
        lens,
        partial,
        lse,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        k_scale.stride(0) if scaled else 0,
        k_scale.stride(1) if scaled else 0,
        k_scale.stride(2) if scaled else 0,
        table.stride(0),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        block_size,
        split_tokens,
        LOG2_E / math.sqrt(head_dim),
        _v_prescale(v_pool.dtype) if scaled else 1.0,
        group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_N=BLOCK_N,
        SCALED=scaled,
        DOT_KIND=_dot_kind(q.dtype),
        SPLIT=n_splits > 1,
        num_warps=4,
    )
    if n_splits > 1:
        torch.library.wrap_triton(_merge_splits_kernel)[(batch * n_heads,)](
            partial,
            lse,
            out,
            n_splits,
            n_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(n_splits),
        )
    return out
