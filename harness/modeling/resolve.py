"""Where a model's shapes come from: a preset by name, a local Hugging Face config.json (a directory or the file), a
config dict, or ModelArgs as they are. Only the config is read: no weights are needed to plan."""

from __future__ import annotations

import json
from pathlib import Path

from harness.errors import ConfigError
from harness.modeling.gguf_checkpoint import resolve_weights
from harness.modeling.model_args import SUPPORTED_MODEL_TYPES, ModelArgs
from harness.modeling.presets import PRESETS, WHEEL_WEIGHTS


def resolve_model(model: str | Path | dict | ModelArgs) -> ModelArgs:
    """A preset name, a local directory holding a Hugging Face config.json (or the file), a config dict, or
    ModelArgs -> ModelArgs. Only the config is read: no weights are needed to plan (a wheel model or a GGUF file is
    converted once first, harness.modeling.gguf_checkpoint, since its config is that checkpoint's)."""
    if isinstance(model, ModelArgs):
        return model
    if isinstance(model, dict):
        return _from_hf_config(model, name=str(model.get("_name_or_path") or "hf-config"))
    name = str(model)
    if name in PRESETS:
        return ModelArgs.from_name(name)
    if name in WHEEL_WEIGHTS or name.lower().endswith(".gguf"):  # its converted checkpoint's config.json
        name = resolve_weights(name, "dummy") if name in WHEEL_WEIGHTS else resolve_weights("", name)
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file() and path.suffix == ".json":
        return _from_hf_config(json.loads(path.read_text()), name=path.resolve().parent.name)
    raise ConfigError(
        f"model: unknown preset {name!r}; allowed: {', '.join([*PRESETS, *WHEEL_WEIGHTS])}, a local directory with a "
        "config.json, or a .gguf file"
    )


def _from_hf_config(config: dict, *, name: str) -> ModelArgs:
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model: {name} has model_type {config.get('model_type')!r}; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        return ModelArgs.from_hf_config(config, name=name)
    except KeyError as exc:
        raise ConfigError(f"model: {name}'s config.json lacks {exc.args[0]!r}") from None
