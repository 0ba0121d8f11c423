"""KV-cache strategies: one module each, found by name.

A strategy module defines `Options` (a frozen dataclass of its settings, validated in `__post_init__`), `STRATEGY`
(its class, built as `STRATEGY(spec, options)`) and `LAYOUT` (a harness.kv.base.Layout: what it allocates, reads and
cannot run for a workload, asked by the planner, the roofline and the sweep without building it), and `SERVING` (a
harness.kv.serve_mode.Serving: how harness.serve serves a stream from it, or why it does not; a module without one does
not serve). Adding one costs that file plus `conf/cache/NAME.yaml`; a module outside this package (a test's, a
plugin's) joins with `register`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from types import ModuleType
from typing import Any

from harness.kv.base import CacheSpec, KVCache, Layout
from harness.kv.serve_mode import Serving
from harness.kv.shape import KVShape

__all__ = [
    "CacheSpec",
    "KVCache",
    "KVShape",
    "Layout",
    "Serving",
    "build",
    "later_option_defaults",
    "layout",
    "option_names",
    "parse_options",
    "register",
    "serving",
    "serving_cache",
    "serving_names",
    "serving_options",
    "static_decode_names",
    "strategy_names",
]

_NOT_STRATEGIES = {
    "base",
    "block_file",
    "evict_paged",
    "footprint",
    "host",
    "paged_attend",
    "quant",
    "serve_mode",
    "shape",
    "tiers",
    "triton_kernels",
    "triton_paged",
    "varlen",
}  # shared code, not strategies
_REGISTERED: dict[str, ModuleType] = {}  # name -> a strategy module from outside the package (register)


def register(name: str, module: ModuleType) -> None:
    """Make `module` (with Options, STRATEGY and LAYOUT, and SERVING if it serves) the strategy called `name`, beside
    the package's own."""
    for attribute in ("Options", "STRATEGY", "LAYOUT"):
        if not hasattr(module, attribute):
            raise TypeError(f"strategy {name!r}: module {module.__name__} defines no {attribute}")
    _REGISTERED[name] = module


def unregister(name: str) -> None:
    _REGISTERED.pop(name, None)


@functools.cache
def _package_names() -> tuple[str, ...]:
    return tuple(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_STRATEGIES)  # scanned once


def strategy_names() -> list[str]:
    return sorted({*_package_names(), *_REGISTERED})


def _module(name: str) -> ModuleType:
    if name in _REGISTERED:
        return _REGISTERED[name]
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


def option_names(name: str) -> tuple[str, ...]:
    """The strategy's option fields: the row columns (and conf/cache keys) that configure it."""
    return tuple(f.name for f in dataclasses.fields(_module(name).Options))


LATER_DEFAULT = "later_default"  # an Options field's metadata key: harness.config's, for strategy options


def later_option_defaults(name: str) -> dict[str, Any]:
    """Options added to the strategy after rows were recorded, with the default those rows ran at: at that value an
    option stays out of point_id, so the rows recorded before it keep theirs (harness.config.RunConfig.point_id)."""
    return {
        f.name: f.metadata[LATER_DEFAULT]
        for f in dataclasses.fields(_module(name).Options)
        if LATER_DEFAULT in f.metadata
    }


def build(name: str, spec: CacheSpec, options: dict[str, Any]) -> KVCache:
    return _module(name).STRATEGY(spec, parse_options(name, options))


def layout(name: str, options: dict[str, Any]) -> Layout:
    """The strategy's knowledge of a workload (harness.kv.base.Layout), with these options."""
    return _module(name).LAYOUT(name, parse_options(name, options))


def serving(name: str) -> Serving:
    """How the strategy serves a request stream (harness.kv.serve_mode.Serving); a module declaring none does not."""
    declared = getattr(_module(name), "SERVING", None)
    return declared if declared is not None else Serving.refused(f"{name} declares no SERVING")


def serving_options(name: str, options: dict[str, Any]) -> Any:
    """A budgeted strategy's Options as a serving run takes them (Serving.budgeted): parsed, then what serving refuses
    of them (its module's check_serving), each a one-line error naming the option."""
    parsed = parse_options(name, options)
    check = getattr(_module(name), "check_serving", None)
    if check is not None:
        check(parsed)
    return parsed


def serving_cache(name: str, spec: CacheSpec, *, block_size: int, num_blocks: int, options: dict[str, Any]) -> KVCache:
    """A budgeted strategy's serving cache (Serving.budgeted): its module's serving_cache over a pool of num_blocks
    blocks of block_size tokens, whose block tables the scheduler keeps."""
    parsed = serving_options(name, options)
    return _module(name).serving_cache(spec, block_size=block_size, num_blocks=num_blocks, options=parsed)


def serving_names() -> list[str]:
    """The strategies that serve, by their own SERVING."""
    return [name for name in strategy_names() if serving(name).serves]


def static_decode_names() -> list[str]:
    """The strategies whose cache has a decode step at static shapes (KVCache.supports_static_decode): the ones
    compile=default or reduce-overhead can capture."""
    return [name for name in strategy_names() if _module(name).STRATEGY.supports_static_decode]
