"""The cache protocol is whole (issue #28 item 3): every strategy's cache subclasses harness.kv.base.KVCache, says
what it can do, and the harness asks the declaration instead of probing the cache for a method."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import types
from pathlib import Path

import pytest
import torch

from harness import kv
from harness.config import Workload
from harness.errors import ConfigError, Unsupported
from harness.kv.base import CacheSpec, KVCache, Layout
from harness.kv.offload import OffloadCache, SyncTransfers
from harness.measure.timing import StepTimer
from harness.modeling.decode import check_compilable, generate

ROOT = Path(__file__).resolve().parents[2]
# getattr(cache, ...), hasattr(self.cache, ...), getattr(getattr(cache, "spec", None), ...): a capability probed
PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:getattr\(\s*)?[\w.]*cache\b")
CPU = torch.device("cpu")
STATIC_DECODE = {"contiguous", "paged", "prefix"}  # check_compilable's message names them: the allowed list
LATENT = {"contiguous", "paged"}  # MLA's latent: contiguous and paged only (harness.config.check_mla's message)


def strategy_class(name: str) -> type:
    return importlib.import_module(f"harness.kv.{name}").STRATEGY


def overrides(cls: type, method: str) -> bool:
    return getattr(cls, method) is not getattr(KVCache, method)


# Words a strategy's name shares with another vocabulary: compile="none" is a mode and marks="none" a row's marks.
OTHER_VOCABULARIES = ("compile", "marks")
COMPARING_CALLS = {"eq", "ne", "isin", "startswith", "endswith"}  # pandas' and str's comparisons by call


def names_a_strategy(node: ast.AST, names: set[str]) -> bool:
    """A string literal that is a strategy's name, alone or in a tuple, list or set literal."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(names_a_strategy(e, names) for e in node.elts)


def strategy_name_comparisons(root: Path, names: set[str]) -> list[str]:
    """Every comparison (==, !=, in, not in, .eq(, .ne(, .isin(, .startswith(, .endswith() of a strategy's name as
    a string literal in harness/ (but harness/kv/), experiments/ and dashboard/, as "path:line: code"."""
    found = []
    for folder in ("harness", "experiments", "dashboard"):
        for path in sorted((root / folder).rglob("*.py")):
            if root / "harness" / "kv" in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and any(
                    isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops
                ):
                    operands = [node.left, *node.comparators]
                elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in COMPARING_CALLS:
                    operands = [node.func.value, *node.args]
                else:
                    continue
                code = ast.unparse(node)
                if any(names_a_strategy(n, names) for n in operands) and not any(w in code for w in OTHER_VOCABULARIES):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {code}")
    return found


def test_no_code_outside_the_strategies_compares_a_strategy_s_name():
    """Issue #28: the harness, the experiments and the dashboard ask a strategy's declaration (Layout, Serving,
    KVCache) and never test its name; only harness/kv/, conf/ and the tests name strategies."""
    found = strategy_name_comparisons(ROOT, set(kv.strategy_names()))
    assert not found, "ask the strategy's declaration instead of its name:\n" + "\n".join(found)


def test_the_name_scan_finds_a_name_compared_every_way(tmp_path):
    (tmp_path / "dashboard").mkdir()
    compared = ['cache == "paged"', 'c.eq("prefix")', 'name in ("a", "evict")', 'f.startswith("evict")']
    ignored = ['rows["compile"].eq("none")', 'cfg.compile != "none"', 'marks != "none"', 'x = "paged"']
    lines = [f"a{i} = {code}" for i, code in enumerate(compared + ignored)]
    (tmp_path / "dashboard" / "chart.py").write_text("\n".join(lines) + "\n")
    found = strategy_name_comparisons(tmp_path, {"paged", "prefix", "evict", "none"})
    assert [line.split(": ", 1)[0] for line in found] == [f"dashboard/chart.py:{i + 1}" for i in range(4)]


# What harness/kv/ may import of the harness (issue #28 item 4): itself and the torch-free leaves below it. Any other
# module is above it (harness.config imports harness.kv), so importing one, even for types, inverts the layering.
# harness.store.atomic is the one atomic writer (harness.kv.block_file's files), a leaf like the others.
BELOW_KV = {
    "harness.errors",
    "harness.formats",
    "harness.modeling.model_args",
    "harness.modeling.presets",
    "harness.store.atomic",
}


def harness_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every harness module the file imports, anywhere in it: TYPE_CHECKING blocks and function
    bodies included. `from harness import kv` imports harness.kv."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "harness":
                found += [(node.lineno, f"harness.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, module) for line, module in found if module == "harness" or module.startswith("harness.")]


def test_harness_kv_imports_nothing_above_it_not_even_for_types():
    above = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sorted((ROOT / "harness" / "kv").glob("*.py"))
        for line, module in harness_imports(path)
        if not (module == "harness.kv" or module.startswith("harness.kv.") or module in BELOW_KV)
    ]
    assert not above, "harness/kv/ imports a module above it (pass it a KVShape instead):\n" + "\n".join(above)


@pytest.mark.parametrize("module", sorted(BELOW_KV))
def test_what_harness_kv_may_import_imports_nothing_else_of_harness(module):
    """Each leaf below harness/kv/ imports only other such leaves (model_args reads its presets' table)."""
    path = ROOT / Path(*module.split(".")).with_suffix(".py")
    assert [name for _, name in harness_imports(path) if name not in BELOW_KV] == []


def test_the_import_scan_sees_type_checking_blocks_and_from_harness_imports(tmp_path):
    code = "from typing import TYPE_CHECKING\nfrom harness import kv, analytic\nif TYPE_CHECKING:\n    import harness.config\n"
    (tmp_path / "m.py").write_text(code)
    assert harness_imports(tmp_path / "m.py") == [(2, "harness.kv"), (2, "harness.analytic"), (4, "harness.config")]


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


class Ring(KVCache):
    name = "ring"  # a cache without a static-shape decode step (the base declares none)


def test_a_strategy_without_a_static_decode_step_is_refused_compile_by_a_message_listing_those_with_one():
    with pytest.raises(Unsupported, match=r"^compile: cache ring .*; allowed: contiguous, paged, prefix$"):
        check_compilable(Ring(), mode="default", device=CPU)


def test_a_plugged_in_strategy_that_declares_a_static_decode_step_joins_the_compile_message(monkeypatch):
    class Static(KVCache):
        name = "static"
        supports_static_decode = True

    @dataclasses.dataclass(frozen=True)
    class Options:
        pass

    plugin = types.ModuleType("plugin_static")
    plugin.Options, plugin.STRATEGY, plugin.LAYOUT = Options, Static, Layout
    kv.register("static", plugin)
    try:
        assert "static" in kv.static_decode_names()
        with pytest.raises(Unsupported, match=r"allowed: contiguous, paged, prefix, static$"):
            check_compilable(Ring(), mode="default", device=CPU)
    finally:
        kv.unregister("static")


@pytest.mark.parametrize("name", kv.strategy_names())
def test_only_the_prefix_cache_fills_a_shared_prefix(name):
    assert overrides(strategy_class(name), "prefill_prefix") == (name == "prefix")


@pytest.mark.parametrize("name", kv.strategy_names())
def test_a_strategy_declares_whether_it_stores_mla_s_latent_and_a_workload_asks_the_declaration(name):
    stores = kv.layout(name, {}).stores_latent
    assert stores == (name in LATENT)
    if not stores:
        with pytest.raises(ConfigError, match=rf"^cache.name: {name} does not store .*allowed: contiguous, paged$"):
            Workload(model={"name": "mla-tiny"}, cache={"name": name}, dtype="fp32")


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


# --- bytes: counted once, by the base, from what each strategy says it stores ---------------------------------------


@pytest.mark.parametrize("name", kv.strategy_names())
def test_no_strategy_copies_the_byte_accounting_it_parametrizes_the_base_with_what_it_stores(name):
    own = {method for cls in strategy_class(name).__mro__[:-2] for method in vars(cls)}  # below KVCache and object
    assert not own & {"kv_bytes_allocated", "kv_scale_bytes", "kv_tail_bytes"}
    # kv_bytes_live: the prefix cache counts a shared block once, its own rule
    assert ("kv_bytes_live" in own) == (name == "prefix")


# (kv_bytes_allocated, kv_bytes_live, kv_scale_bytes, kv_tail_bytes, peak_columns()) at the peak of a generation of 2
# sequences, 12 prompt tokens (the first 8 shared) + 4 generated, on the tiny model in fp32: each strategy's own
# accounting, recorded before the base took it over.
PEAK_BYTES = {
    ("contiguous", "fp32"): (16384, 15360, 0, 0, {}),
    ("contiguous", "bf16"): (8192, 7680, 0, 0, {}),
    ("contiguous", "int8"): (5120, 3840, 1024, 0, {}),
    ("contiguous", "int4"): (15872, 1920, 8192, 5632, {}),
    ("paged", "fp32"): (16384, 15360, 0, 0, {}),
    ("paged", "bf16"): (8192, 7680, 0, 0, {}),
    ("paged", "int8"): (5120, 3840, 1024, 0, {}),
    ("paged", "int4"): (15872, 1920, 8192, 5632, {}),
    ("prefix", "fp32"): (12288, 11264, 0, 0, {"kv_bytes_shared": 4096}),
    ("prefix", "bf16"): (6144, 5632, 0, 0, {"kv_bytes_shared": 2048}),
    ("prefix", "int8"): (3840, 2816, 768, 0, {"kv_bytes_shared": 1024}),
    ("prefix", "int4"): (9216, 1408, 6144, 1536, {"kv_bytes_shared": 512}),
    ("sliding", "fp32"): (8192, 8192, 0, 0, {}),
    ("sliding", "bf16"): (4096, 4096, 0, 0, {}),
    ("sliding", "int8"): (2560, 2048, 512, 0, {}),
    ("evict", "fp32"): (8192, 8192, 0, 0, {}),
    ("evict", "bf16"): (4096, 4096, 0, 0, {}),
    ("evict", "int8"): (2560, 2048, 512, 0, {}),
    ("none", "fp32"): (0, 0, 0, 0, {}),
    ("offload", "fp32"): (32768, 15360, 0, 0, {"kv_bytes_host": 16384}),
    ("offload", "bf16"): (16384, 7680, 0, 0, {"kv_bytes_host": 8192}),
}
OPTIONS = {"paged": {"block_size": 4}, "prefix": {"block_size": 4}, "sliding": {"window": 8, "sinks": 2},
           "evict": {"policy": "h2o", "budget": 8, "window": 2}}  # fmt: skip


@pytest.mark.parametrize(("name", "kv_dtype"), list(PEAK_BYTES))
def test_the_base_counts_each_strategy_s_bytes_at_its_peak_as_the_strategy_did(tiny_model, tiny_args, name, kv_dtype):
    # int4: groups of 4 tokens, a residual of 4 (prefix shares none of a private tail: kv_residual=0)
    spec = CacheSpec.for_model(tiny_args, batch_size=2, max_tokens=16, kv_dtype=kv_dtype, device=CPU, prefix_len=8,
                               kv_residual=0 if name == "prefix" else 4, kv_group_size=4, dtype="fp32")  # fmt: skip
    if name == "offload":  # its host store on the CPU, copied synchronously
        cache = OffloadCache(spec, kv.parse_options(name, {}), transfers=SyncTransfers())
    else:
        cache = kv.build(name, spec, OPTIONS.get(name, {}))
    prompt = torch.randint(tiny_args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    prompt[1, :8] = prompt[0, :8]
    generate(tiny_model, cache, prompt, 4, StepTimer(CPU, n_marks=4))
    figures = (cache.kv_bytes_allocated(), cache.kv_bytes_live(), cache.kv_scale_bytes(), cache.kv_tail_bytes())
    assert (*figures, cache.peak_columns()) == PEAK_BYTES[name, kv_dtype]
