"""MLA (harness.modeling.mla, harness.modeling.model_args, the latent cache of harness.kv): both decode paths equal transformers'
DeepseekV2/V3 logits in fp32, the cache holds the latent alone in every layout and format, and bad checkpoints fail
with one line naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import kv
from harness.errors import ConfigError
from harness.kv.base import CacheSpec
from harness.modeling.model import Transformer, build_model
from harness.modeling.model_args import ModelArgs, load_args
from harness.modeling.presets import PRESETS

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
BATCH_SIZE, PROMPT_LEN, DECODE_STEPS = 2, 11, 5  # 11 + 5 tokens: paged blocks of 4 end mid-block at every step
BLOCK_SIZE = 4
# fp32 end to end; transformers and this model sum in other orders (the absorbed path multiplies q_nope by W_UK
# before the latent, a different association of the same products), so logits of magnitude ~2.4 differ by ~2e-6
# (measured on each ORACLES config). 1e-4 leaves that a fiftyfold margin and stays far below what a wrong RoPE layout
# (~0.7-1.0, test_the_oracle_detects_a_wrong_rope_layout) or YaRN left out (~0.4-0.5) costs.
ATOL = 1e-4

# Small dense configs at shapes no other test names: q as one projection or a low-rank pair, other ranks and head
# widths, YaRN on (mscale != mscale_all_dim, so both of its factors are exercised) and off, both RoPE layouts of V3.
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=0.8)  # fmt: skip
ORACLES = {
    "v2-lite-yarn": (
        "DeepseekV2",
        dict(
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=12,
            v_head_dim=10,
            rope_parameters=YARN,
        ),
    ),  # fmt: skip
    "v2-qlora": (
        "DeepseekV2",
        dict(q_lora_rank=20, kv_lora_rank=16, qk_rope_head_dim=6, qk_nope_head_dim=10, v_head_dim=14),
    ),  # fmt: skip
    "v3-yarn": (
        "DeepseekV3",
        dict(
            q_lora_rank=28,
            kv_lora_rank=20,
            qk_rope_head_dim=10,
            qk_nope_head_dim=8,
            v_head_dim=12,
            rope_parameters={**YARN, "mscale": 0.9, "mscale_all_dim": 0.9},
        ),
    ),  # fmt: skip
    "v3-halves": (
        "DeepseekV3",
        dict(
            q_lora_rank=None,
            kv_lora_rank=18,
            qk_rope_head_dim=8,
            qk_nope_head_dim=6,
            v_head_dim=8,
            rope_interleave=False,
        ),
    ),  # fmt: skip
}


def hf_config(family: str, **extra):
    n_layers = 2
    return getattr(transformers, f"{family}Config")(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=n_layers, num_attention_heads=3,
        num_key_value_heads=3,  # V3's default is its 128 heads
        first_k_dense_replace=n_layers,  # every layer dense: the model this harness builds
        max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.1,  # peaked attention: a test that can fail
        attn_implementation="eager", **extra,
    )  # fmt: skip


def save_hf_model(config, directory: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    family = type(config).__name__.removesuffix("Config")
    hf_model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # HF ones-inits norms: randomize so the test sees which norm goes where
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    hf_model.save_pretrained(directory, safe_serialization=True)
    return hf_model


def tokens_for(vocab_size: int, n_tokens: int = PROMPT_LEN + DECODE_STEPS) -> torch.Tensor:
    return torch.randint(vocab_size, (BATCH_SIZE, n_tokens), generator=torch.Generator().manual_seed(0))


def make_cache(args: ModelArgs, cache: str = "contiguous", kv_dtype: str = "fp32", max_tokens: int = 32):
    spec = CacheSpec.for_model(args, batch_size=BATCH_SIZE, max_tokens=max_tokens, kv_dtype=kv_dtype, device=CPU)
    return kv.build(cache, spec, {"block_size": BLOCK_SIZE} if cache == "paged" else {})


def prefill_then_decode(model: Transformer, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Logits [B, T, V] of a prefill of PROMPT_LEN tokens, then one decode step per remaining token (teacher-forced)."""
    with torch.inference_mode():
        steps = [model(tokens[:, :PROMPT_LEN], start_pos=0, cache=cache)]
        for pos in range(PROMPT_LEN, tokens.shape[1]):
            steps.append(model(tokens[:, pos : pos + 1], start_pos=pos, cache=cache))
    return torch.cat(steps, dim=1)


@pytest.fixture(scope="module", params=sorted(ORACLES))
def oracle(request, tmp_path_factory):
    """(checkpoint dir, transformers' logits over the whole sequence) for one ORACLES config."""
    family, extra = ORACLES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = save_hf_model(hf_config(family, **extra), directory)
    tokens = tokens_for(hf_model.config.vocab_size)
    with torch.inference_mode():
        expected = hf_model(input_ids=tokens).logits  # [B, T, V]
    return directory, tokens, expected, hf_model


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("mla_path", ["absorbed", "naive"])
def test_prefill_and_decode_logits_match_transformers_in_fp32(oracle, mla_path: str, cache: str) -> None:
    directory, tokens, expected, _ = oracle
    args = load_args(str(directory), preset="mla-tiny")
    model = build_model(args, weights=str(directory), dtype=torch.float32, device=CPU, seed=0, n_positions=32,
                        mla_path=mla_path)  # fmt: skip
    actual = prefill_then_decode(model, tokens, make_cache(args, cache))
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= ATOL


def test_the_oracle_detects_a_wrong_rope_layout(tmp_path: Path) -> None:
    family, extra = ORACLES["v3-yarn"]
    hf_model = save_hf_model(hf_config(family, **extra), tmp_path)
    tokens = tokens_for(hf_model.config.vocab_size)
    args = load_args(str(tmp_path), preset="mla-tiny")
    args.rope_interleave = not args.rope_interleave
    model = build_model(args, weights=str(tmp_path), dtype=torch.float32, device=CPU, seed=0, n_positions=32)
    with torch.inference_mode():
        expected = hf_model(input_ids=tokens).logits
    assert (prefill_then_decode(model, tokens, make_cache(args)) - expected).abs().max().item() > 100 * ATOL


def test_softmax_scale_and_parameter_count_are_transformers(oracle) -> None:
    directory, _, _, hf_model = oracle
    args = load_args(str(directory), preset="mla-tiny")
    assert args.softmax_scale == pytest.approx(hf_model.model.layers[0].self_attn.scaling, rel=1e-12)
    assert args.n_params == sum(p.numel() for p in hf_model.parameters())


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3", "mla-small", "mla-tiny"])
def test_mla_presets_build_with_their_analytic_parameter_count(name: str) -> None:
    args = ModelArgs.from_name(name)
    with torch.device("meta"):
        model = Transformer(args)
    assert args.n_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "config_name"), [("deepseek-v2-lite", "DeepseekV2Config"), ("deepseek-v3", "DeepseekV3Config")]
)
def test_deepseek_presets_have_the_attention_shapes_of_transformers_configs(name: str, config_name: str) -> None:
    # transformers' defaults are the published attention shapes (DeepseekV2Config's are V2-Lite's, q aside).
    config = getattr(transformers, config_name)()
    args = ModelArgs.from_name(name)
    for field in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        assert getattr(args, field) == getattr(config, field), field
    assert args.q_lora_rank == (None if name == "deepseek-v2-lite" else config.q_lora_rank)
    if name == "deepseek-v3":
        assert (args.dim, args.n_layers, args.n_heads, args.vocab_size) == (
            config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.vocab_size
        )  # fmt: skip
        # The dense stand-in for V3's MoE: (8 routed + 1 shared experts) x 2048, the dense layers' width too.
        assert args.intermediate_size == 9 * config.moe_intermediate_size == config.intermediate_size


@pytest.mark.parametrize(("name", "family"), [("deepseek-v2-lite", "DeepseekV2"), ("deepseek-v3", "DeepseekV3")])
def test_a_deepseek_preset_counts_the_parameters_of_transformers_dense_model_at_its_shapes(name, family) -> None:
    args = ModelArgs.from_name(name)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
        first_k_dense_replace=args.n_layers, kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank,
        qk_rope_head_dim=args.qk_rope_head_dim, qk_nope_head_dim=args.qk_nope_head_dim, v_head_dim=args.v_head_dim,
    )  # fmt: skip
    with torch.device("meta"):  # shapes only: 37 B parameters cost nothing
        hf_model = getattr(transformers, f"{family}ForCausalLM")(config)
    assert args.n_params == sum(p.numel() for p in hf_model.parameters())


def test_the_cache_stores_layers_times_latent_width_bytes_per_token() -> None:
    args = ModelArgs.from_name("mla-tiny")
    cache = make_cache(args, kv_dtype="bf16", max_tokens=32)
    latent = args.kv_lora_rank + args.qk_rope_head_dim
    assert cache.spec.bytes_per_token == args.n_layers * latent * 2  # no V: 1 x layers x (R + P) x bytes
    assert cache.kv_bytes_allocated() == BATCH_SIZE * 32 * cache.spec.bytes_per_token


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_a_scaled_latent_stores_one_scale_per_token_and_layer(kv_dtype: str) -> None:
    args = ModelArgs.from_name("mla-tiny")
    cache = make_cache(args, "paged", kv_dtype=kv_dtype, max_tokens=32)
    latent = args.kv_lora_rank + args.qk_rope_head_dim
    assert cache.kv_scale_bytes() == args.n_layers * BATCH_SIZE * 32 * 4  # K's fp32 scale alone, no V's
    assert cache.kv_bytes_allocated() == args.n_layers * BATCH_SIZE * 32 * (latent + 4)


def dummy_logits(mla_path: str, cache: str = "contiguous", kv_dtype: str = "fp32") -> torch.Tensor:
    args = ModelArgs.from_name("mla-tiny")
    model = build_model(args, dtype=torch.float32, device=CPU, seed=0, n_positions=32, mla_path=mla_path)
    return prefill_then_decode(model, tokens_for(args.vocab_size), make_cache(args, cache, kv_dtype=kv_dtype))


def test_naive_and_absorbed_paths_agree_in_fp32() -> None:
    absorbed, naive = dummy_logits("absorbed"), dummy_logits("naive")
    assert not torch.equal(absorbed, torch.zeros_like(absorbed))
    assert (absorbed - naive).abs().max().item() <= ATOL


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3", "int8", "int4"])
@pytest.mark.parametrize("mla_path", ["absorbed", "naive"])
def test_a_quantized_latent_runs_in_both_layouts_and_stays_close(kv_dtype: str, mla_path: str) -> None:
    exact = dummy_logits(mla_path)
    contiguous, paged = (dummy_logits(mla_path, cache, kv_dtype=kv_dtype) for cache in ("contiguous", "paged"))
    # The same codec on the same tokens: the layouts differ only in where the rows live.
    torch.testing.assert_close(paged, contiguous, rtol=0, atol=1e-5)
    # Dummy logits spread ~0.3; int4 (16 levels over each channel's range) moves them by ~1e-2, bf16 by ~1e-3.
    assert (contiguous - exact).abs().max().item() <= 0.05 * exact.abs().max().item()


def test_a_checkpoint_with_moe_layers_is_refused_in_one_line_naming_weights(tmp_path: Path) -> None:
    config = hf_config("DeepseekV3", q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                       v_head_dim=8).to_dict()  # fmt: skip
    config |= {"first_k_dense_replace": 1, "n_routed_experts": 4}
    with pytest.raises(ValueError, match=r"^weights: .* MoE layers .*allowed: a dense checkpoint") as exc:
        ModelArgs.from_hf_config(config, name="moe")
    assert "\n" not in str(exc.value)


def test_an_unknown_yarn_key_is_refused_in_one_line() -> None:
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "wobble": 1}
    with pytest.raises(ValueError, match=r"^model: rope_scaling key 'wobble' .*allowed: factor"):
        ModelArgs(name="x", **{**PRESETS["mla-tiny"], "rope_scaling": rope})


def test_yarn_reaches_the_rope_tables_and_the_softmax_scale() -> None:
    plain = ModelArgs.from_name("deepseek-v2-lite")
    assert plain.rope_attention_factor == pytest.approx(1.0)  # mscale == mscale_all_dim: their ratio
    assert plain.softmax_scale == pytest.approx(
        (0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1) ** 2 / 192**0.5
    )


def test_a_workload_refuses_mla_on_a_strategy_without_latent_storage() -> None:
    from harness.config import Workload

    with pytest.raises(ConfigError, match=r"^cache.name: .*mla-tiny.*allowed: contiguous, paged"):
        Workload(model={"name": "mla-tiny"}, cache={"name": "sliding", "window": 8}, dtype="fp32")


def test_mla_path_is_validated_and_only_for_mla_models() -> None:
    from harness.config import Workload

    assert Workload(model={"name": "mla-tiny"}, mla_path="naive").mla_path == "naive"
    with pytest.raises(ConfigError, match=r"^mla_path: unknown value 'fused'; allowed: absorbed, naive"):
        Workload(model={"name": "mla-tiny"}, mla_path="fused")
    with pytest.raises(ConfigError, match=r"^mla_path: .*tiny.* not MLA; allowed: absorbed"):
        Workload(model={"name": "tiny"}, mla_path="naive")


@pytest.mark.parametrize("path", ["absorbed", "naive"])
def test_a_flattened_forward_over_the_latent_equals_the_static_batch(path) -> None:
    """Serving's per-sequence lengths (harness.kv.varlen.SeqBatch) over a contiguous latent cache: a static batch
    written as a SeqBatch gives the static path's logits, prefill then decode steps."""
    from harness.kv.varlen import SeqBatch

    args = ModelArgs.from_name("mla-tiny")
    model = build_model(args, dtype=torch.float32, device=CPU, seed=0, n_positions=32, mla_path=path)
    tokens = torch.randint(
        0, args.vocab_size, (BATCH_SIZE, PROMPT_LEN + DECODE_STEPS), generator=torch.Generator().manual_seed(0)
    )
    static, flat = make_cache(args), make_cache(args)
    expected = prefill_then_decode(model, tokens, static)  # [B, T, V]
    with torch.inference_mode():
        batch = SeqBatch.uniform(batch_size=BATCH_SIZE, start_pos=0, n_new=PROMPT_LEN)
        steps = [
            model(tokens[:, :PROMPT_LEN].reshape(1, -1), start_pos=batch, cache=flat).view(BATCH_SIZE, PROMPT_LEN, -1)
        ]
        for t in range(PROMPT_LEN, tokens.shape[1]):
            batch = SeqBatch.uniform(batch_size=BATCH_SIZE, start_pos=t, n_new=1)
            steps.append(model(tokens[:, t].reshape(1, -1), start_pos=batch, cache=flat).view(BATCH_SIZE, 1, -1))
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=1e-5)
