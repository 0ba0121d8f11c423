"""KV-cache strategies: one module each, found by name.

A strategy module defines `Options` (a frozen dataclass of its settings, validated in `__post_init__`) and
`STRATEGY` (its class, built as `STRATEGY(spec, options)`). Adding one costs that file plus `conf/cache/NAME.yaml`.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from types import ModuleType
from typing import Any

from harness.kv.base import CacheSpec, KVCache

_NOT_STRATEGIES = {"base", "host", "quant", "triton_paged"}  # shared code, not strategies


def strategy_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_STRATEGIES)


def _module(name: str) -> ModuleType:
    names = strategy_names()
    if name not in names:
        raise ValueError(f"cache: unknown strategy {name!r}; allowed: {', '.join(names)}")
    return importlib.import_module(f"{__name__}.{name}")


def parse_options(name: str, options: dict[str, Any]) -> Any:
    """The strategy's Options from a plain dict; a one-line ValueError names any unknown or bad field."""
    options_cls = _module(name).Options
    allowed = [f.name for f in dataclasses.fields(options_cls)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"cache.{unknown[0]}: not an option of cache {name!r}; allowed: {', '.join(allowed) or '(none)'}"
        )
    return options_cls(**options)


def build(name: str, spec: CacheSpec, options: dict[str, Any]) -> KVCache:
    return _module(name).STRATEGY(spec, parse_options(name, options))
