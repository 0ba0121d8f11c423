"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2) in plain PyTorch, after gpt-fast's `model.py`.

The model computes q, k, v and applies RoPE; the KV-cache strategy (`harness.kv`) stores K/V and runs attention.
Weights are either seeded random values at the real shapes ("dummy", like vLLM's `--load-format dummy`: a
benchmark of memory and speed needs the shapes, not the knowledge) or a local Hugging Face checkpoint, read with
safetensors and mapped into a fused layout (one q|k|v matmul, one gate|up matmul), or, with fused=False, kept as the
checkpoint's separate projections (`make bench` measures the one against the other: harness.run.levers).

Conventions follow Hugging Face's `modeling_llama.py` so its checkpoints load without permutation: rotate_half
RoPE, RMSNorm computed in fp32 and cast back before the weight multiplies. The shapes it builds (ModelArgs, the
presets, a checkpoint's config.json) are described in `harness.modeling.model_args`, which does not import torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from harness.kv import varlen
from harness.kv.base import KVCache
from harness.modeling.model_args import ModelArgs


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 and cast back as HF's LlamaRMSNorm does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x_fp32.to(x.dtype)


def rope_inv_freq(args: ModelArgs, device: torch.device) -> torch.Tensor:
    """Inverse frequencies [D / 2] in fp32 (D = args.rope_dim): theta^(-2i/D), Llama-3- or YaRN-scaled when asked.

    Mirrors transformers' `_compute_default_rope_parameters` and `_compute_llama3_parameters`: wavelengths
    longer than original_max / low_freq_factor are stretched by `factor`, shorter than original_max /
    high_freq_factor are kept, and the band between is interpolated smoothly.
    """
    head_dim = args.rope_dim
    inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    if args.rope_scaling is None:
        return inv_freq
    if args.rope_scaling["rope_type"] == "yarn":
        return yarn_inv_freq(args.rope_scaling, base=args.rope_theta, dim=head_dim, device=device)
    factor = args.rope_scaling["factor"]
    low_freq_factor = args.rope_scaling["low_freq_factor"]
    high_freq_factor = args.rope_scaling["high_freq_factor"]
    old_context_len = args.rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def yarn_inv_freq(rope: dict, *, base: float, dim: int, device: torch.device) -> torch.Tensor:
    """YaRN's inverse frequencies [dim / 2] (Peng et al. 2023, section 3.2 "NTK-by-parts"), as transformers'
    `_compute_yarn_parameters`: frequencies that turn more than beta_fast times over the original context are kept
    (extrapolated), fewer than beta_slow times divided by `factor` (interpolated), a linear ramp between."""
    factor, original = rope["factor"], rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(n_rotations: float) -> float:  # the channel pair that turns n_rotations times over `original`
        return dim * math.log(original / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: no singular ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by factor
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim: HF's layout pairs dim i with i + D/2, not 2i with 2i+1."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos, sin [T, D] in fp32, cast to x's dtype first as HF does."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, fused: bool = True) -> None:
        """fused: one q|k|v matmul (wqkv); False: three (wq, wk, wv), as the checkpoint stores them."""
        super().__init__()
        self.layer_index = layer_index  # the cache keys its storage by layer
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # One fused matmul for q, k and v (gpt-fast): one GEMV call instead of three on the decode step's critical path.
        self.fused = fused
        if fused:
            self.wqkv = nn.Linear(args.dim, args.q_dim + 2 * args.kv_dim, bias=args.qkv_bias)
        else:
            self.wq = nn.Linear(args.dim, args.q_dim, bias=args.qkv_bias)
            self.wk = nn.Linear(args.dim, args.kv_dim, bias=args.qkv_bias)
            self.wv = nn.Linear(args.dim, args.kv_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.q_dim, args.dim, bias=False)
        self.split_sizes = [args.q_dim, args.kv_dim, args.kv_dim]

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, dim] -> q [B, T, H * D], k and v [B, T, H_kv * D]."""
        if self.fused:
            return self.wqkv(x).split(self.split_sizes, dim=-1)
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int, cache: KVCache
    ) -> torch.Tensor:
        batch_size, n_new, _ = x.shape  # [B, T, dim]
        q, k, v = self.qkv(x)
        q = q.view(batch_size, n_new, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(batch_size, n_new, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        v = v.view(batch_size, n_new, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = cache.attend(self.layer_index, q, k, v, start_pos)  # [B, H, T, D]
        y = y.transpose(1, 2).reshape(batch_size, n_new, self.n_heads * self.head_dim)  # [B, T, H * D]
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(x @ gate) * (x @ up)), gate and up fused into one matmul `w13`, or with
    fused=False two (w1 the gate, w3 the up projection, Llama's names)."""

    def __init__(self, args: ModelArgs, fused: bool = True) -> None:
        super().__init__()
        self.fused = fused
        if fused:
            self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        else:
            self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)
            self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.w13(x).chunk(2, dim=-1)  # [B, T, ffn] each
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, args: ModelArgs, layer_index: int, mla_path: str = "absorbed", fused: bool = True) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        if args.is_mla:
            from harness.modeling.mla import MLAttention  # it builds on this module's RMSNorm and apply_rope

            self.attention = MLAttention(args, layer_index=layer_index, path=mla_path)
        else:
            self.attention = Attention(args, layer_index=layer_index, fused=fused)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args, fused=fused)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int, cache: KVCache
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos=cos, sin=sin, start_pos=start_pos, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, mla_path: str = "absorbed", fused: bool = True) -> None:
        """mla_path: how an MLA model decodes (harness.modeling.mla: absorbed or naive); ignored by any other.
        fused: q|k|v and gate|up each one matmul (the default), or the checkpoint's separate projections."""
        super().__init__()
        self.args = args
        self.fused = fused
        # Built on the meta device (build_model fills every parameter): given its weight, nn.Embedding skips its
        # normal_ init, which on meta tensors imports torch._dynamo (~1 s of every process's start).
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim))
        self.layers = nn.ModuleList(
            TransformerBlock(args, layer_index=i, mla_path=mla_path, fused=fused) for i in range(args.n_layers)
        )
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.n_positions = 0  # RoPE tables not built yet: see setup_rope

    def tie_weights(self) -> None:
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def setup_rope(self, n_positions: int) -> None:
        """Build cos/sin tables [n_positions, D] in fp32 for positions 0..n_positions-1, on the weights' device.

        Non-persistent buffers: never saved, never loaded. Build only what a run needs: 131072 positions of
        head_dim 128 are 64 MiB per table.
        """
        if not 0 < n_positions <= self.args.max_seq_len:
            raise ValueError(
                f"model: n_positions {n_positions} is outside 1..{self.args.max_seq_len} for {self.args.name!r}"
            )
        device = self.tok_embeddings.weight.device
        inv_freq = rope_inv_freq(self.args, device=device)  # [D / 2]
        positions = torch.arange(n_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [S, D / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [S, D], rotate_half layout
        # YaRN scales cos and sin by its attention factor (1 otherwise), as transformers' rotary embeddings do.
        factor = self.args.rope_attention_factor
        self.register_buffer("rope_cos", angles.cos() * factor, persistent=False)
        self.register_buffer("rope_sin", angles.sin() * factor, persistent=False)
        self.n_positions = n_positions

    def forward(
        self, tokens: torch.Tensor, start_pos: int | varlen.SeqBatch, cache: KVCache, last_only: bool = False
    ) -> torch.Tensor:
        """tokens [B, T] at positions start_pos..start_pos+T-1 -> logits [B, T, V], or [B, 1, V] if last_only.

        `last_only` skips the vocabulary matmul for all but the last prompt token in prefill: only it is sampled.
        start_pos a harness.kv.varlen.SeqBatch: tokens [1, N] of sequences at their own positions, flattened ->
        [1, N, V], or [1, n, V] if last_only (each sequence's last token, in the batch's order).
        """
        if isinstance(start_pos, varlen.SeqBatch):
            return self._forward_varlen(tokens, start_pos, cache, last_only)
        n_new = tokens.shape[1]
        assert start_pos + n_new <= self.n_positions, (
            f"positions up to {start_pos + n_new} asked, RoPE tables hold {self.n_positions}: call setup_rope"
        )
        cache.prepare(start_pos, n_new)
        cos = self.rope_cos[start_pos : start_pos + n_new]  # [T, D]
        sin = self.rope_sin[start_pos : start_pos + n_new]  # [T, D]
        x = self.tok_embeddings(tokens)  # [B, T, dim]
        for layer in self.layers:
            x = layer(x, cos=cos, sin=sin, start_pos=start_pos, cache=cache)
        if last_only:
            x = x[:, -1:]  # [B, 1, dim]
        return self.output(self.norm(x))  # [B, T or 1, V]

    def _forward_varlen(
        self, tokens: torch.Tensor, batch: varlen.SeqBatch, cache: KVCache, last_only: bool
    ) -> torch.Tensor:
        assert tokens.shape == (1, batch.n_tokens), f"tokens {tuple(tokens.shape)} for a batch of {batch.n_tokens}"
        assert max(batch.ends) <= self.n_positions, (
            f"positions up to {max(batch.ends)} asked, RoPE tables hold {self.n_positions}: call setup_rope"
        )
        positions, last_rows = varlen.to_device([batch.positions, batch.last_rows], self.rope_cos.device)
        cache.prepare(batch)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [N, D]: each token at its own position
        x = self.tok_embeddings(tokens)  # [1, N, dim]
        for layer in self.layers:
            x = layer(x, cos=cos, sin=sin, start_pos=batch, cache=cache)
        if last_only:
            x = x[:, last_rows]  # [1, n, dim]
        return self.output(self.norm(x))


@torch.no_grad()
def _fill_dummy(model: Transformer, seed: int, device: torch.device) -> None:
    """Seeded random weights whose activations stay finite in bf16/fp16 across many layers.

    std 0.02 as GPT-2 and HF's initializer_range; the projections that write into the residual stream (wo, w2)
    are scaled by 1/sqrt(2 * n_layers) so the residual's variance does not grow with depth (Radford et al. 2019,
    section 2.3). Generated on the target device: same seed and device give the same weights.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.args.n_layers)
    for name, param in model.named_parameters():  # a tied weight appears once
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(("wo.weight", "w2.weight")):
            param.normal_(mean=0.0, std=residual_std, generator=generator)
        elif name.endswith(".bias"):
            param.normal_(mean=0.0, std=0.002, generator=generator)  # small: exercised, never dominant
        else:
            param.normal_(mean=0.0, std=0.02, generator=generator)


def _safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's files: those the shard index names, else model.safetensors, else every *.safetensors.

    The index matters: Mistral's repositories also ship `consolidated.safetensors` in Mistral's own layout.
    """
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    return sorted(directory.glob("*.safetensors"))


def _read_hf_state_dict(
    directory: Path, args: ModelArgs, dtype: torch.dtype, device: torch.device, fused: bool = True
) -> dict[str, torch.Tensor]:
    """HF tensor names -> this model's fused layout (or, fused=False, its separate projections), cast to dtype on
    device."""
    hf: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                hf[key] = f.get_tensor(key).to(device=device, dtype=dtype)

    def take(key: str) -> torch.Tensor:
        if key not in hf:
            raise ValueError(f"weights: tensor {key!r} is missing from {directory}")
        return hf.pop(key)

    state = {"tok_embeddings.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    for i in range(args.n_layers):
        hf_prefix, prefix = f"model.layers.{i}.", f"layers.{i}."
        if args.is_mla:
            state |= _mla_attention_state(take, hf_prefix=hf_prefix + "self_attn.", prefix=prefix + "attention.",
                                          q_lora=args.q_lora_rank is not None)  # fmt: skip
        elif not fused:
            for p in "qkv":
                state[f"{prefix}attention.w{p}.weight"] = take(f"{hf_prefix}self_attn.{p}_proj.weight")
                if args.qkv_bias:
                    state[f"{prefix}attention.w{p}.bias"] = take(f"{hf_prefix}self_attn.{p}_proj.bias")
        else:
            qkv = [take(f"{hf_prefix}self_attn.{p}_proj.weight") for p in "qkv"]
            state[prefix + "attention.wqkv.weight"] = torch.cat(qkv, dim=0)  # [H*D + 2*H_kv*D, dim]
            if args.qkv_bias:
                qkv_bias = [take(f"{hf_prefix}self_attn.{p}_proj.bias") for p in "qkv"]
                state[prefix + "attention.wqkv.bias"] = torch.cat(qkv_bias, dim=0)
        state[prefix + "attention.wo.weight"] = take(f"{hf_prefix}self_attn.o_proj.weight")
        gate_up = [take(f"{hf_prefix}mlp.{p}_proj.weight") for p in ("gate", "up")]
        if fused:
            state[prefix + "feed_forward.w13.weight"] = torch.cat(gate_up, dim=0)  # [2 * ffn, dim]
        else:
            state[prefix + "feed_forward.w1.weight"], state[prefix + "feed_forward.w3.weight"] = gate_up
        state[prefix + "feed_forward.w2.weight"] = take(f"{hf_prefix}mlp.down_proj.weight")
        state[prefix + "attention_norm.weight"] = take(f"{hf_prefix}input_layernorm.weight")
        state[prefix + "ffn_norm.weight"] = take(f"{hf_prefix}post_attention_layernorm.weight")
    if args.tie_embeddings:
        hf.pop("lm_head.weight", None)  # some tied checkpoints store a copy; the embedding is the one used
        state["output.weight"] = state["tok_embeddings.weight"]
    else:
        state["output.weight"] = take("lm_head.weight")
    # Old checkpoints saved RoPE's inv_freq; it is recomputed here.
    leftover = sorted(key for key in hf if not key.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise ValueError(f"weights: {len(leftover)} tensors this model does not use, e.g. {leftover[0]!r}")
    return state


def _mla_attention_state(take, *, hf_prefix: str, prefix: str, q_lora: bool) -> dict[str, torch.Tensor]:
    """DeepseekV2/V3Attention's tensors -> harness.modeling.mla.MLAttention's, one to one (o_proj is the caller's)."""
    names = {"kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b"}
    names |= {"q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b"} if q_lora else {"q_proj": "wq"}
    return {f"{prefix}{ours}.weight": take(f"{hf_prefix}{theirs}.weight") for theirs, ours in names.items()}


def build_model(
    args: ModelArgs,
    *,
    weights: str = "dummy",
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    n_positions: int,
    mla_path: str = "absorbed",
    fused: bool = True,
) -> Transformer:
    """The model in eval mode with RoPE tables for n_positions, weights "dummy" (seeded) or a HF directory.
    mla_path: an MLA model's decode path (harness.modeling.mla.MLA_PATHS); ignored by any other model.
    fused: q|k|v and gate|up each one matmul; False keeps them apart (a checkpoint's only: dummy weights draw per
    tensor, so fused and unfused dummies would differ)."""
    device = torch.device(device)
    if not fused and weights == "dummy":
        raise ValueError("fused: False needs a checkpoint (weights=DIR); dummy weights are drawn in the fused layout")
    with torch.device("meta"):  # shapes only: no memory until the weights arrive
        model = Transformer(args, mla_path=mla_path, fused=fused)
    model = model.to(dtype=dtype)
    if weights == "dummy":
        model.to_empty(device=device)
        model.tie_weights()  # to_empty materializes each module's parameter separately
        _fill_dummy(model, seed=seed, device=device)
    else:
        state = _read_hf_state_dict(Path(weights), args=args, dtype=dtype, device=device, fused=fused)
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()  # assign=True wraps each entry in its own Parameter
    model.setup_rope(n_positions)
    # Inference only: no autograd bookkeeping even if a caller forgets torch.inference_mode.
    return model.eval().requires_grad_(False)


def weights_bytes(model: nn.Module) -> int:
    """Bytes of all parameters; `parameters()` yields a tied tensor once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
