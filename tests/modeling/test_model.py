"""harness/modeling/model.py and harness/modeling/model_args.py: the decoder matches Hugging Face's, presets have the real models'
sizes, the description imports without torch, and bad input fails with one line naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.kv.base import CacheSpec
from harness.kv.contiguous import ContiguousCache
from harness.kv.contiguous import Options as ContiguousOptions
from harness.kv.none import NoCache, Options
from harness.modeling.model import Transformer, build_model, weights_bytes
from harness.modeling.model_args import ModelArgs, load_args
from harness.modeling.presets import PRESETS

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
BATCH_SIZE, PROMPT_LEN = 2, 20

# A small HF config shared by the oracles: GQA (4 query heads per 2 K/V heads), 2 layers.
SMALL_HF = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    intermediate_size=128,
    max_position_embeddings=256,
)


def no_cache(args: ModelArgs, batch_size: int, max_tokens: int, kv_dtype: str = "fp32") -> NoCache:
    spec = CacheSpec.for_model(args, batch_size=batch_size, max_tokens=max_tokens, kv_dtype=kv_dtype, device=CPU)
    return NoCache(spec, Options())


def prompt(vocab_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (BATCH_SIZE, PROMPT_LEN), generator=generator)  # [B, T]


def logits_of(model: Transformer, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
    cache = no_cache(model.args, batch_size=tokens.shape[0], max_tokens=tokens.shape[1])
    with torch.inference_mode():
        return model(tokens, start_pos=0, cache=cache, last_only=last_only)


def save_hf_model(model_cls: type, config, directory: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    hf_model = model_cls(config).eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: randomize so the test sees them
        for name, param in hf_model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                param.add_(torch.randn_like(param) * 0.1)
    hf_model.save_pretrained(directory, safe_serialization=True)
    return hf_model


HF_ORACLES = {
    "llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            # original_max 64 < prompt-scale wavelengths, so all three llama3 bands (kept, smoothed, stretched) occur
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            rms_norm_eps=1e-5,
        ),
    ),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(rope_theta=1000000.0, sliding_window=None)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("model_type", sorted(HF_ORACLES))
def test_logits_match_hugging_face_in_fp32(model_type: str, tmp_path: Path) -> None:
    model_name, config_name, extra = HF_ORACLES[model_type]
    config = getattr(transformers, config_name)(**SMALL_HF, **extra, attn_implementation="eager")
    hf_model = save_hf_model(getattr(transformers, model_name), config=config, directory=tmp_path)
    args = load_args(str(tmp_path), preset="tiny")
    model = build_model(args, weights=str(tmp_path), dtype=torch.float32, device=CPU, seed=0, n_positions=PROMPT_LEN)
    tokens = prompt(vocab_size=args.vocab_size)

    with torch.inference_mode():
        expected = hf_model(input_ids=tokens).logits  # [B, T, V]
    actual = logits_of(model, tokens)

    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= 1e-4


def test_sharded_checkpoint_loads_through_its_index(tmp_path: Path) -> None:
    model_name, config_name, extra = HF_ORACLES["llama"]
    config = getattr(transformers, config_name)(**SMALL_HF, **extra, attn_implementation="eager")
    hf_model = getattr(transformers, model_name)(config).eval()
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")  # the embeddings alone are 32 KiB
    assert (tmp_path / "model.safetensors.index.json").is_file()

    args = load_args(str(tmp_path), preset="tiny")
    model = build_model(args, weights=str(tmp_path), dtype=torch.float32, device=CPU, seed=0, n_positions=PROMPT_LEN)
    tokens = prompt(vocab_size=args.vocab_size)
    with torch.inference_mode():
        expected = hf_model(input_ids=tokens).logits
    assert (logits_of(model, tokens) - expected).abs().max().item() <= 1e-4


def test_checkpoint_with_tensors_the_model_does_not_use_is_refused(tmp_path: Path) -> None:
    # Llama with attention_bias also biases o_proj, which this layout has no place for.
    config = transformers.LlamaConfig(**SMALL_HF, attention_bias=True)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    args = load_args(str(tmp_path), preset="tiny")
    with pytest.raises(ValueError, match=r"^weights: \d+ tensors this model does not use") as error:
        build_model(args, weights=str(tmp_path), dtype=torch.float32, device=CPU, seed=0, n_positions=8)
    assert "\n" not in str(error.value)


def test_decoding_one_token_at_a_time_with_a_cache_matches_one_full_forward() -> None:
    # Checks the RoPE offset at start_pos > 0: each new token is rotated by its own position.
    args = ModelArgs.from_name("tiny")
    model = build_model(args, dtype=torch.float32, device=CPU, seed=0, n_positions=PROMPT_LEN)
    tokens = prompt(vocab_size=args.vocab_size)
    spec = CacheSpec.for_model(args, batch_size=BATCH_SIZE, max_tokens=PROMPT_LEN, kv_dtype="fp32", device=CPU)
    cache = ContiguousCache(spec, ContiguousOptions())
    prefill_len = PROMPT_LEN // 2
    with torch.inference_mode():
        steps = [model(tokens[:, :prefill_len], start_pos=0, cache=cache)]
        for pos in range(prefill_len, PROMPT_LEN):
            steps.append(model(tokens[:, pos : pos + 1], start_pos=pos, cache=cache))

    torch.testing.assert_close(torch.cat(steps, dim=1), logits_of(model, tokens), rtol=0, atol=1e-5)


def test_llama3_rope_scaling_is_read_from_the_checkpoint(tmp_path: Path) -> None:
    _, config_name, extra = HF_ORACLES["llama"]
    getattr(transformers, config_name)(**SMALL_HF, **extra).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").touch()  # load_args reads no tensors: an empty file is enough

    args = load_args(str(tmp_path), preset="tiny")

    assert args.rope_theta == 500000.0
    assert args.rope_scaling is not None and args.rope_scaling["factor"] == 8.0
    assert args.rope_scaling["original_max_position_embeddings"] == 64
    assert args.name == tmp_path.name


def test_hub_style_config_with_rope_theta_and_rope_scaling_is_read() -> None:
    # The Hub's config.json files (transformers 4.x) keep rope_theta beside rope_scaling, not inside.
    config = dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=PRESETS["llama-3.1-8b"]["rope_scaling"],
        tie_word_embeddings=False,
    )
    assert ModelArgs.from_hf_config(config, name="llama-3.1-8b") == ModelArgs.from_name("llama-3.1-8b")


def test_mistral_sliding_window_caps_the_supported_positions() -> None:
    config = dict(
        model_type="mistral",
        vocab_size=32000,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        max_position_embeddings=32768,
        sliding_window=4096,
    )
    assert ModelArgs.from_hf_config(config, name="mistral-7b-v0.1").max_seq_len == 4096


PUBLISHED_N_PARAMS = {  # safetensors metadata of each model's Hugging Face repository
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "llama-2-7b": 6_738_415_616,
    "mistral-7b": 7_248_023_552,
    "qwen2.5-7b": 7_615_616_512,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_N_PARAMS))
def test_preset_has_the_published_parameter_count(name: str) -> None:
    args = ModelArgs.from_name(name)
    with torch.device("meta"):  # shapes only, no memory
        model = Transformer(args)

    assert args.n_params == sum(p.numel() for p in model.parameters())
    assert args.n_params == PUBLISHED_N_PARAMS[name]


@pytest.mark.parametrize("name", ["small", "tiny"])
def test_cpu_presets_build_with_their_analytic_parameter_count(name: str) -> None:
    args = ModelArgs.from_name(name)
    with torch.device("meta"):
        model = Transformer(args)
    assert args.n_params == sum(p.numel() for p in model.parameters())


def test_small_preset_is_about_200m_parameters() -> None:
    assert 150e6 <= ModelArgs.from_name("small").n_params <= 250e6


@pytest.mark.parametrize("name", ["small", "tiny"])
def test_cpu_presets_support_8192_positions(name: str) -> None:
    assert ModelArgs.from_name(name).max_seq_len >= 8192


def test_unknown_preset_is_a_one_line_error_naming_model() -> None:
    with pytest.raises(ValueError, match=r"^model: unknown preset 'gpt-5'; allowed: .*tiny") as error:
        ModelArgs.from_name("gpt-5")
    assert "\n" not in str(error.value)


def test_the_model_description_imports_without_torch() -> None:
    # A fresh interpreter: this one has torch already (tests/conftest.py). A model's shapes, presets and config.json
    # are plain data; reading them should not cost torch's seconds of start-up.
    probe = "import sys, harness.modeling.model_args; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def write_checkpoint_dir(directory: Path, *, config: dict | None, safetensors: bool) -> Path:
    directory.mkdir()
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    if safetensors:
        (directory / "model.safetensors").touch()
    return directory


@pytest.mark.parametrize(
    ("case", "config", "safetensors", "message"),
    [
        ("missing", None, False, "neither 'dummy' nor an existing directory"),
        ("no-config", None, True, "no config.json"),
        ("no-safetensors", {"model_type": "llama"}, False, r"no \*\.safetensors"),
        ("gpt2", {"model_type": "gpt2"}, True, "model_type 'gpt2'; allowed: llama, mistral, qwen2"),
    ],
)
def test_bad_weights_path_is_a_one_line_error_naming_weights(
    case: str, config: dict | None, safetensors: bool, message: str, tmp_path: Path
) -> None:
    directory = tmp_path / case
    if case != "missing":
        write_checkpoint_dir(directory, config=config, safetensors=safetensors)
    with pytest.raises(ValueError, match=rf"^weights: .*{message}") as error:
        load_args(str(directory), preset="tiny")
    assert "\n" not in str(error.value)


def test_dummy_weights_with_the_same_seed_give_identical_logits() -> None:
    args = ModelArgs.from_name("tiny")
    tokens = prompt(vocab_size=args.vocab_size)
    logits = [
        logits_of(build_model(args, dtype=torch.float32, device=CPU, seed=7, n_positions=PROMPT_LEN), tokens)
        for _ in range(2)
    ]
    assert torch.equal(logits[0], logits[1])


def test_dummy_weights_with_another_seed_differ() -> None:
    args = ModelArgs.from_name("tiny")
    first, second = (build_model(args, dtype=torch.float32, device=CPU, seed=s, n_positions=8) for s in (0, 1))
    assert not torch.equal(first.tok_embeddings.weight, second.tok_embeddings.weight)


def test_tiny_dummy_model_gives_finite_logits_in_bf16() -> None:
    args = ModelArgs.from_name("tiny")
    model = build_model(args, dtype=torch.bfloat16, device=CPU, seed=0, n_positions=PROMPT_LEN)
    tokens = prompt(vocab_size=args.vocab_size)
    cache = no_cache(args, batch_size=BATCH_SIZE, max_tokens=PROMPT_LEN, kv_dtype="bf16")
    with torch.inference_mode():
        logits = model(tokens, start_pos=0, cache=cache)
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()


def test_last_only_logits_equal_the_last_row_of_full_logits() -> None:
    args = ModelArgs.from_name("tiny")
    model = build_model(args, dtype=torch.float32, device=CPU, seed=0, n_positions=PROMPT_LEN)
    tokens = prompt(vocab_size=args.vocab_size)

    full = logits_of(model, tokens)  # [B, T, V]
    last = logits_of(model, tokens, last_only=True)  # [B, 1, V]

    assert last.shape == (BATCH_SIZE, 1, args.vocab_size)
    # The output GEMM runs over B rows instead of B x T: another shape, another summation order (measured <= 1.8e-7
    # on logits below 1), so a tolerance, as for the cached steps above.
    torch.testing.assert_close(last, full[:, -1:], rtol=0, atol=1e-5)


def test_tied_model_counts_the_shared_matrix_once() -> None:
    args = ModelArgs(name="tied", **{**PRESETS["tiny"], "tie_embeddings": True})
    model = build_model(args, dtype=torch.bfloat16, device=CPU, seed=0, n_positions=8)

    assert model.output.weight is model.tok_embeddings.weight
    assert weights_bytes(model) == 2 * args.n_params  # bf16: 2 bytes a parameter


def test_rope_tables_cover_only_the_positions_asked_for() -> None:
    args = ModelArgs.from_name("tiny")
    model = build_model(args, dtype=torch.bfloat16, device=CPU, seed=0, n_positions=100)
    assert model.rope_cos.shape == (100, args.head_dim)
    assert model.rope_cos.dtype == torch.float32  # built in fp32 whatever the weights' dtype


def test_rope_tables_beyond_max_seq_len_are_refused() -> None:
    args = ModelArgs.from_name("tiny")
    with pytest.raises(ValueError, match=r"^model: n_positions 8193 is outside 1\.\.8192"):
        build_model(args, dtype=torch.float32, device=CPU, seed=0, n_positions=args.max_seq_len + 1)
