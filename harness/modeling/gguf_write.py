"""A Hugging Face Llama checkpoint -> a GGUF file of F32 or F16 tensors that llama.cpp runs (`make bench-llamacpp`).

The other direction of harness.modeling.gguf_checkpoint: there a GGUF is dequantized into a checkpoint that our
model loads; here such a checkpoint (or any local Llama checkpoint) is written back as GGUF, so that llama.cpp and
our loop multiply the very same numbers. F32 keeps every value bit for bit; F16 rounds the matrices and keeps the
norms in F32, as llama.cpp's own converter (convert_hf_to_gguf.py) does.

What the file holds, as that converter writes it:
    llama.*       the hyperparameters, from the checkpoint's config.json
    tokenizer.*   the vocabulary, merges and special tokens, copied from a template GGUF (the one the checkpoint
                  came from): llama.cpp needs them to load, and a config.json does not hold them
    general.*     the template's, with general.file_type set to what was written (0 all F32, 1 mostly F16)
    tensors       llama.cpp's names, q and k rows permuted into its RoPE layout (interleaved pairs; Hugging Face's
                  checkpoints hold rotate_half's halves), tied embeddings stored once as token_embd

A file is written beside its target under a temporary name and renamed once whole, so a killed run never leaves a
half file that a later one loads.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np

from harness.errors import ConfigError

TENSOR_TYPES = ("F32", "F16")  # what write_gguf writes; general.file_type: LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_F16
FILE_TYPE = {"F32": 0, "F16": 1}

# Hugging Face's tensor names -> llama.cpp's (gguf.constants' MODEL_TENSOR names for LLM_ARCH_LLAMA)
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face Llama tensor: model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    prefix, _, rest = hf_name.partition(".layers.")
    layer, _, suffix = rest.partition(".")
    if prefix != "model" or not layer.isdigit() or suffix not in LAYER_NAMES:
        raise ConfigError(f"weights: tensor {hf_name!r} has no llama.cpp name; allowed: a Llama checkpoint's tensors")
    return f"blk.{layer}.{LAYER_NAMES[suffix]}"


def permute_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """A q or k projection's rows [n_heads * head_dim, in] from rotate_half's order (each head's first half, then its
    second) into llama.cpp's interleaved pairs; convert_hf_to_gguf.py's LlamaModel.permute."""
    head_dim = weight.shape[0] // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """permute_rope's inverse: llama.cpp's interleaved rows back into rotate_half's halves."""
    head_dim = weight.shape[0] // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hyperparameters(config: dict) -> dict:
    """The llama.* keys of a Llama config.json, as llama.cpp's converter writes them."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    keys = {
        "llama.block_count": config["num_hidden_layers"],
        "llama.context_length": config.get("max_position_embeddings", 4096),
        "llama.embedding_length": config["hidden_size"],
        "llama.feed_forward_length": config["intermediate_size"],
        "llama.attention.head_count": config["num_attention_heads"],
        "llama.attention.head_count_kv": config.get("num_key_value_heads") or config["num_attention_heads"],
        "llama.rope.freq_base": float(config.get("rope_theta") or _rope_parameters(config).get("rope_theta", 10000.0)),
        "llama.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-5)),
        "llama.vocab_size": config["vocab_size"],
        "llama.rope.dimension_count": head_dim,
    }
    if config.get("head_dim"):
        keys["llama.attention.key_length"] = keys["llama.attention.value_length"] = head_dim
    return keys


def _rope_parameters(config: dict) -> dict:
    """transformers 5 moves rope_theta into rope_parameters; older configs keep it at the top."""
    return config.get("rope_parameters") or {}


def write_gguf(checkpoint: str | Path, template: str | Path, target: str | Path, *, tensor_type: str) -> Path:
    """Write the Llama checkpoint directory `checkpoint` (config.json, *.safetensors) as the GGUF file `target`,
    its tensors in `tensor_type` (F32 or F16), its tokenizer from the GGUF `template`. Returns target."""
    import gguf
    from safetensors.numpy import load_file

    if tensor_type not in TENSOR_TYPES:
        raise ConfigError(f"tensor_type: unknown value {tensor_type!r}; allowed: {', '.join(TENSOR_TYPES)}")
    checkpoint, target = Path(checkpoint), Path(target)
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type") not in ("llama", "mistral"):
        raise ConfigError(
            f"weights: {checkpoint} is a {config.get('model_type')!r} checkpoint; allowed: llama, mistral"
        )
    if config.get("rope_scaling") or _rope_parameters(config).get("rope_type", "default") != "default":
        raise ConfigError(f"weights: {checkpoint} scales RoPE, which write_gguf does not carry; allowed: plain RoPE")
    reader = gguf.GGUFReader(str(template))
    n_heads = config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads

    partial = target.with_name(f".{target.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(partial), arch="llama")
    try:
        for field in reader.fields.values():  # general.* and tokenizer.* from the template, as they are
            if field.name.startswith(("GGUF.", "llama.")) or field.name in (
                "general.architecture",
                "general.file_type",
            ):
                continue
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
        for key, value in hyperparameters(config).items():
            writer.add_key_value(
                key, value, gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
            )
        writer.add_file_type(FILE_TYPE[tensor_type])
        state: dict[str, np.ndarray] = {}
        for file in sorted(checkpoint.glob("*.safetensors")):
            state |= load_file(str(file))
        if not state:
            raise ConfigError(f"weights: {checkpoint} holds no .safetensors file; allowed: a safetensors checkpoint")
        for hf_name, tensor in state.items():
            if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
                continue  # tied: llama.cpp multiplies by token_embd when the file has no output.weight
            tensor = tensor.astype(np.float32)
            if hf_name.endswith("q_proj.weight"):
                tensor = permute_rope(tensor, n_heads)
            elif hf_name.endswith("k_proj.weight"):
                tensor = permute_rope(tensor, n_kv_heads)
            if tensor_type == "F16" and tensor.ndim > 1:  # norms stay F32: llama.cpp's converter keeps 1-D in F32
                tensor = tensor.astype(np.float16)
            writer.add_tensor(gguf_name(hf_name), np.ascontiguousarray(tensor))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, target)  # atomic: from here on the file is whole
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return target
