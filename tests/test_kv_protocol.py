"""The cache protocol is whole (issue #28 item 3): every strategy's cache subclasses harness.kv.base.KVCache, says
what it can do, and the harness asks the declaration instead of probing the cache for a method."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from harness import kv
from harness.errors import Unsupported
from harness.kv.base import KVCache

ROOT = Path(__file__).resolve().parents[1]
# getattr(cache, ...), hasattr(self.cache, ...), getattr(getattr(cache, "spec", None), ...): a capability probed
PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:getattr\(\s*)?[\w.]*cache\b")
STATIC_DECODE = {"contiguous", "paged", "prefix"}  # check_compilable's message names them: the allowed list


def strategy_class(name: str) -> type:
    return importlib.import_module(f"harness.kv.{name}").STRATEGY


def overrides(cls: type, method: str) -> bool:
    return getattr(cls, method) is not getattr(KVCache, method)


def test_no_caller_outside_the_strategies_probes_a_cache_with_getattr_or_hasattr():
    probes = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "harness").rglob("*.py"))
        if (ROOT / "harness" / "kv") not in path.parents
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if PROBE.search(line)
    ]
    assert not probes, "capabilities are declared on harness.kv.base.KVCache, not probed:\n" + "\n".join(probes)


@pytest.mark.parametrize("name", kv.strategy_names())
def test_every_strategy_cache_subclasses_the_base(name):
    assert issubclass(strategy_class(name), KVCache)


@pytest.mark.parametrize("name", kv.strategy_names())
def test_a_strategy_declares_static_decode_exactly_when_it_has_a_static_decode_step(name):
    cls = strategy_class(name)
    assert cls.supports_static_decode == overrides(cls, "enable_static_decode") == (name in STATIC_DECODE)


@pytest.mark.parametrize("name", kv.strategy_names())
def test_only_the_prefix_cache_fills_a_shared_prefix(name):
    assert overrides(strategy_class(name), "prefill_prefix") == (name == "prefix")


def test_the_base_holds_no_prefix_and_has_no_static_decode_step():
    class Plain(KVCache):
        name = "plain"

    cache = Plain()
    assert cache.prefill_prefix(None, None) == 0  # the whole prompt runs
    assert cache.peak_columns() == {}
    with pytest.raises(Unsupported, match="static-shape"):
        cache.enable_static_decode()
