"""A model's description: ModelArgs (shapes and constants), a preset by name (the table is `harness.modeling.presets`), and
the reading of a Hugging Face checkpoint's config.json.

Plain data, so this module does not import torch (tests/modeling/test_model.py checks it); the torch modules that compute
with these shapes are in `harness.modeling.model`.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.modeling.presets import PRESETS

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "deepseek_v2", "deepseek_v3")
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
# YaRN (Peng et al. 2023) as DeepSeek-V2/V3 configure it: the keys transformers' _compute_yarn_parameters reads.
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate")  # fmt: skip


@dataclass
class ModelArgs:
    """Shapes and constants of one model. The defaults are Llama-2-7B's, as in gpt-fast."""

    name: str
    vocab_size: int = 32000
    dim: int = 4096  # hidden size
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None -> n_heads (multi-head attention); fewer -> GQA (Ainslie et al. 2023)
    head_dim: int | None = None  # None -> dim // n_heads; Llama-3.2 and Mistral state it explicitly
    intermediate_size: int = 11008  # SwiGLU hidden width
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # RoPE base (Su et al. 2021)
    # Llama-3 frequency scaling: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; or YaRN (MLA models): {"rope_type": "yarn", "factor",
    # "original_max_position_embeddings", optional "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    # "attention_factor", "truncate"}; None -> plain RoPE.
    rope_scaling: dict | None = None
    max_seq_len: int = 4096  # the most positions the model supports
    qkv_bias: bool = False  # Qwen2 adds biases to the q, k, v projections (Qwen2 technical report, 2.1)
    tie_embeddings: bool = False  # lm_head shares the token embedding matrix
    # MLA, multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024, section 2.1): each token's K and V are
    # decompressed from one latent c_kv of kv_lora_rank values, plus one RoPE key of qk_rope_head_dim shared by every
    # head; only those two are cached. None: not MLA (K/V heads as above).
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None  # MLA: None -> q is one projection (V2-Lite); else a low-rank pair (V2, V3)
    qk_rope_head_dim: int = 0  # MLA: the RoPE part of each query/key head (64 in V2 and V3)
    qk_nope_head_dim: int = 0  # MLA: the part without position (128), decompressed from c_kv
    v_head_dim: int = 0  # MLA: each head's value width (128), decompressed from c_kv
    # The feed-forward is a dense SwiGLU of the MoE's active width (routed experts per token + shared experts, times
    # their width), standing in for DeepSeek's MoE: the same FLOPs per token, not the same weights.
    moe_as_dense: bool = False
    # MLA: RoPE rotates pairs (2i, 2i+1) (DeepSeek's layout: V2 always, V3's rope_interleave) rather than (i, i + D/2).
    rope_interleave: bool = False

    def __post_init__(self) -> None:
        if self.kv_lora_rank is not None:
            # MLA's query/key heads are nope + rope wide; every head attends (MHA) once K/V are decompressed.
            self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"model: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"model: head_dim {self.head_dim} must be even for RoPE")
        if self.is_mla and min(self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim) <= 0:
            raise ValueError(
                f"model: MLA needs positive kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim and v_head_dim, got "
                f"{self.kv_lora_rank}, {self.qk_rope_head_dim}, {self.qk_nope_head_dim}, {self.v_head_dim}"
            )
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, is_mla=self.is_mla)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    # What the cache stores per token and layer (CacheSpec.for_model, the planner, the roofline): `cache_sides` rows
    # (K and V; MLA: one latent row, its first kv_lora_rank values serving as V too) of `cache_heads` heads of
    # `cache_head_dim` values. GQA: 2 x H_kv x D; MLA: 1 x 1 x (kv_lora_rank + qk_rope_head_dim).
    @property
    def cache_sides(self) -> int:
        return 1 if self.is_mla else 2

    @property
    def cache_heads(self) -> int:
        return 1 if self.is_mla else self.n_kv_heads

    @property
    def cache_head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Channels RoPE rotates per head: MLA's qk_rope_head_dim, else the whole head."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def rope_attention_factor(self) -> float:
        """YaRN's factor on cos and sin (so on q·k twice over), as transformers' _compute_yarn_parameters sets it:
        `attention_factor` if given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set,
        else mscale(factor). 1 for any other RoPE."""
        rope = self.rope_scaling
        if rope is None or rope["rope_type"] != "yarn":
            return 1.0
        if rope.get("attention_factor") is not None:
            return float(rope["attention_factor"])
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            return yarn_mscale(rope["factor"], rope["mscale"]) / yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        return yarn_mscale(rope["factor"])

    @property
    def softmax_scale(self) -> float:
        """The factor on q·k before the softmax: 1 / sqrt(q's head width), times YaRN's mscale(factor,
        mscale_all_dim)^2 when it sets mscale_all_dim (transformers' DeepseekV2/V3Attention: yarn_apply_mscale; the
        DeepSeek-V2 reference code does the same). MLA's head width is nope + rope, whichever path attends."""
        scale = self.head_dim**-0.5
        rope = self.rope_scaling
        if rope is not None and rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):
            scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
        return scale

    @property
    def n_params(self) -> int:
        """Parameters of the built model, counted analytically (a tied lm_head counts once)."""
        if self.is_mla:
            attention = self.mla_attention_params
        else:
            qkv_out = self.q_dim + 2 * self.kv_dim
            attention = self.dim * qkv_out + (qkv_out if self.qkv_bias else 0) + self.q_dim * self.dim
        feed_forward = 3 * self.dim * self.intermediate_size  # gate, up, down
        norms = 2 * self.dim
        embeddings = self.vocab_size * self.dim
        lm_head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return embeddings + self.n_layers * (attention + feed_forward + norms) + self.dim + lm_head

    @property
    def mla_attention_params(self) -> int:
        """One MLA layer's attention weights (harness.modeling.mla): q (one projection, or the low-rank pair with its norm),
        kv_a (dim -> latent + rope key), its norm, kv_b (latent -> every head's nope key and value), o."""
        q_out = self.n_heads * self.head_dim
        if self.q_lora_rank is None:
            q = self.dim * q_out
        else:
            q = self.dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q_out
        kv_a = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv_b = self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_a + kv_b + self.n_heads * self.v_head_dim * self.dim

    @classmethod
    def from_name(cls, name: str) -> ModelArgs:
        if name not in PRESETS:
            raise ValueError(f"model: unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
        return cls(name=name, **copy.deepcopy(PRESETS[name]))  # no instance shares the preset's rope dict

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str) -> ModelArgs:
        """From a Hugging Face `config.json` of a llama, mistral, qwen2, deepseek_v2 or deepseek_v3 model.

        Reads both layouts: `rope_theta` + `rope_scaling` (transformers 4.x, the files on the Hub) and
        `rope_parameters` (transformers 5.x, which folds rope_theta in).
        """
        model_type = config.get("model_type")
        is_mla = model_type in MLA_MODEL_TYPES
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            rope_scaling = None
        elif rope_type == "llama3" and not is_mla:
            rope_scaling = {**rope, "rope_type": "llama3"}
        elif rope_type == "yarn" and is_mla:
            rope_scaling = {key: rope[key] for key in YARN_KEYS if rope.get(key) is not None} | {"rope_type": "yarn"}
            if rope_scaling.get("factor") is None:  # transformers: the ratio of the two context lengths
                rope_scaling["factor"] = config["max_position_embeddings"] / rope["original_max_position_embeddings"]
        else:
            allowed = "default, yarn" if is_mla else "default, llama3"
            raise ValueError(f"weights: rope_type {rope_type!r} is not supported for {model_type}; allowed: {allowed}")
        max_seq_len = config["max_position_embeddings"]
        # Mistral v0.1 (and Qwen2 with use_sliding_window) attend over a window. Within the window that is full
        # causal attention, so capping the supported positions keeps this model exact without a window mask.
        uses_window = model_type != "qwen2" or config.get("use_sliding_window", False)
        if uses_window and config.get("sliding_window"):
            max_seq_len = min(max_seq_len, config["sliding_window"])
        mla = _mla_fields(config, name) if is_mla else {}
        return cls(
            name=name,
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"],
            n_kv_heads=config.get("num_key_value_heads"),
            head_dim=config.get("head_dim"),  # MLA: replaced by nope + rope (transformers stores the rope width here)
            intermediate_size=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_seq_len=max_seq_len,
            qkv_bias=model_type == "qwen2",
            tie_embeddings=config.get("tie_word_embeddings", False),
            **mla,
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (Peng et al. 2023, eq. 22; 1 without stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _check_rope_scaling(rope: dict, *, is_mla: bool) -> None:
    rope_type = rope.get("rope_type")
    allowed = "yarn" if is_mla else "llama3"
    if rope_type != allowed:
        raise ValueError(f"model: rope_scaling type {rope_type!r} is not supported here; allowed: {allowed}")
    if rope_type == "yarn":
        unknown = sorted(set(rope) - {"rope_type", *YARN_KEYS})
        if unknown:
            raise ValueError(f"model: rope_scaling key {unknown[0]!r} is not YaRN's; allowed: {', '.join(YARN_KEYS)}")
        for key in ("factor", "original_max_position_embeddings"):
            if not isinstance(rope.get(key), (int, float)) or rope[key] <= 0:
                raise ValueError(f"model: rope_scaling.{key} must be a positive number for YaRN, got {rope.get(key)!r}")


def _mla_fields(config: dict[str, Any], name: str) -> dict[str, Any]:
    """A DeepSeek-V2/V3 config's attention shapes; its checkpoint must be dense, as this model is."""
    n_layers, n_experts = config["num_hidden_layers"], config.get("n_routed_experts")
    first_dense = config.get("first_k_dense_replace", 0)
    if n_experts and first_dense < n_layers:
        raise ValueError(
            f"weights: {name} has MoE layers ({n_experts} routed experts from layer {first_dense} of {n_layers}), "
            "which this dense model cannot load; allowed: a dense checkpoint (first_k_dense_replace >= "
            "num_hidden_layers)"
        )
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"weights: {name} sets {key}; allowed: {key} false (DeepSeek's checkpoints)")
    return dict(
        kv_lora_rank=config["kv_lora_rank"],
        q_lora_rank=config.get("q_lora_rank"),
        qk_rope_head_dim=config["qk_rope_head_dim"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        v_head_dim=config["v_head_dim"],
        # V2's complex RoPE rotates interleaved pairs; V3 does when rope_interleave (its default) is set.
        rope_interleave=config.get("model_type") == "deepseek_v2" or config.get("rope_interleave", True),
    )


def load_args(weights: str, preset: str) -> ModelArgs:
    """The model's ModelArgs without reading a tensor: the preset for "dummy", else the checkpoint's config.json.

    For a checkpoint the preset is ignored and the model is named after its directory.
    """
    if weights == "dummy":
        return ModelArgs.from_name(preset)
    directory = Path(weights)
    if not directory.is_dir():
        raise ValueError(f"weights: {weights!r} is neither 'dummy' nor an existing directory")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"weights: {weights!r} has no config.json (expected a Hugging Face checkpoint)")
    if not any(directory.glob("*.safetensors")):
        raise ValueError(f"weights: {weights!r} has no *.safetensors files (pickled .bin checkpoints are not read)")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"weights: {weights!r} has model_type {model_type!r}; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return ModelArgs.from_hf_config(config, name=directory.resolve().name)
