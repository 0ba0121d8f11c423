"""The cache protocol is whole (issue #28 item 3): every strategy's cache subclasses harness.kv.base.KVCache, says
what it can do, and the harness asks the declaration instead of probing the cache for a method."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

from harness import kv
from harness.decode import generate
from harness.errors import Unsupported
from harness.kv.base import CacheSpec, KVCache
from harness.timing import StepTimer

ROOT = Path(__file__).resolve().parents[1]
# getattr(cache, ...), hasattr(self.cache, ...), getattr(getattr(cache, "spec", None), ...): a capability probed
PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:getattr\(\s*)?[\w.]*cache\b")
CPU = torch.device("cpu")
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


# --- the strategy's own row columns: asked of every cache, answered by the prefix cache ------------------------------


def prefix_point(tiny_args, *, prefix_len: int):
    """A prefix cache (block_size 8) for 2 sequences of a 24-token prompt, its first prefix_len tokens shared."""
    spec = CacheSpec.for_model(
        tiny_args, batch_size=2, max_tokens=28, kv_dtype="fp32", device=CPU, prefix_len=prefix_len
    )
    prompt = torch.randint(tiny_args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    prompt[1, :prefix_len] = prompt[0, :prefix_len]
    return kv.build("prefix", spec, {"block_size": 8}), prompt


def generation(model, cache, prompt, ttfts: list[float]):
    """ttft_ms for row_columns: one more generation through the cache, then the next of the given TTFTs."""

    def ttft_ms() -> float:
        generate(model, cache, prompt, 4, StepTimer(CPU, n_marks=4))
        cache.release()
        return ttfts.pop(0)

    return ttft_ms


def no_generation() -> float:
    raise AssertionError("a cache without figures of its own runs no generation")


@pytest.mark.parametrize(
    ("name", "options"), [("contiguous", {}), ("paged", {"block_size": 8}), ("sliding", {"window": 8})]
)
def test_a_strategy_without_figures_of_its_own_reports_no_row_columns(tiny_args, name, options):
    spec = CacheSpec.for_model(tiny_args, batch_size=2, max_tokens=28, kv_dtype="fp32", device=CPU, prefix_len=16)
    assert kv.build(name, spec, options).row_columns(no_generation, n=2) == {}


def test_the_prefix_cache_reports_where_its_prefix_came_from_and_the_median_ttft_of_a_miss(tiny_model, tiny_args):
    cache, prompt = prefix_point(tiny_args, prefix_len=16)
    generation(tiny_model, cache, prompt, [0.0])()  # the point's first generation: the prefix computed
    columns = cache.row_columns(generation(tiny_model, cache, prompt, [3.0, 1.0, 2.0]), n=3)
    assert columns == {"prefix_hit": False, "prefix_source": "computed", "ttft_miss_ms": 2.0}
    assert cache.prefix_sources == ["computed"] * 4  # each miss forgot the prefix first, so each recomputed it


@pytest.mark.parametrize("prefix_len", [0, 5])  # none at all, and less than one whole block
def test_a_prefix_cache_with_no_whole_block_to_share_reports_no_row_columns(tiny_model, tiny_args, prefix_len):
    """Issue #27 item 1: nothing shared, nothing to report (it measures as paged)."""
    cache, prompt = prefix_point(tiny_args, prefix_len=prefix_len)
    generation(tiny_model, cache, prompt, [0.0])()
    assert cache.row_columns(no_generation, n=2) == {}
