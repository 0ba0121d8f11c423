"""`compile`: the decode step under torch.compile at static shapes, and the combinations it refuses.

The static-shape attention (the whole buffer or block table under a length mask, the position a tensor) is checked
eagerly against the sliced one; the compiled step itself needs a C++ compiler on the CPU (inductor's code generator),
so that test is skipped, with the reason, where none is found. What CUDA graph trees decide (every mutated input must
be static) is decided by AOTAutograd before any device code exists, so it is checked here through tests/cuda/graphs.py;
the graphs themselves (reduce-overhead) run in tests/device/test_gpu.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from harness import kv
from harness.config import RunConfig
from harness.kv.base import CacheSpec
from harness.measure.timing import StepTimer
from harness.modeling.decode import compile_decode_step, generate
from harness.run.point import run_point
from harness.run.runner import _guarded
from tests.cuda.graphs import recording_backend
from tests.greedy import LOGIT_TOL, assert_no_near_tie, assert_same_greedy_tokens, greedy_with_logits, point_logits

CPU = torch.device("cpu")
FAST = dict(warmup=1, min_repeats=1, max_repeats=1, isolate=False, roofline=False, profile=False, accuracy=False)
has_cxx = pytest.mark.skipif(
    not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")),
    reason="torch.compile on the CPU needs a C++ compiler (g++, c++ or clang++) on PATH",
)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize(("cache_name", "options"), [("contiguous", {}), ("paged", {"block_size": 4})])
def test_static_shape_attention_over_the_masked_buffer_equals_the_sliced_one(tiny_args, kv_dtype, cache_name, options):
    spec = CacheSpec.for_model(tiny_args, batch_size=2, max_tokens=24, kv_dtype=kv_dtype, device=CPU)
    sliced, static = kv.build(cache_name, spec, options), kv.build(cache_name, spec, options)
    static.enable_static_decode()
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = tiny_args.n_heads, tiny_args.n_kv_heads, tiny_args.head_dim
    prompt = {
        name: torch.randn(2, h, 10, dim, generator=gen) for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads))
    }
    for cache in (sliced, static):
        cache.prepare(0, 10)
        cache.attend(0, prompt["q"], prompt["k"], prompt["v"], 0)
    for pos in range(10, 14):
        q, k, v = (torch.randn(2, h, 1, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
        sliced.prepare(pos, 1)
        expected = sliced.attend(0, q, k, v, pos)
        static.prepare(pos, 1)
        actual = static.attend(0, q, k, v, torch.tensor([pos]))
        # Same stored values, one SDPA over more (masked) keys than the other: fp32 summation order differs.
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    masked = {"contiguous": ("sdpa-masked", "sdpa"), "paged": ("sdpa-gather-masked", "sdpa-gather")}[cache_name]
    assert (static.attn_backend, sliced.attn_backend) == masked


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "fp8_e4m3"])
@pytest.mark.parametrize(("cache_name", "prefix_len"), [("contiguous", 0), ("paged", 0), ("prefix", 8)])
def test_every_input_a_compiled_decode_step_mutates_is_a_static_input(
    tiny_model, tiny_args, kv_dtype, cache_name, prefix_len
):
    """CUDA graph trees skip a graph that mutates a non-static input; K and V as two views of one buffer made
    AOTAutograd merge them into one synthetic base, which was not static (and mode=reduce-overhead ran eagerly)."""
    backend, graphs = recording_backend()
    spec = CacheSpec.for_model(
        tiny_args, batch_size=2, max_tokens=16 + 4, kv_dtype=kv_dtype, device=CPU, prefix_len=prefix_len
    )
    cache = kv.build(cache_name, spec, {"block_size": 4} if cache_name != "contiguous" else {})
    prompt = torch.randint(tiny_args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    prompt[1, :prefix_len] = prompt[0, :prefix_len]
    torch._dynamo.reset()
    step = compile_decode_step(tiny_model, cache, mode="default", backend=backend)
    generate(tiny_model, cache, prompt, 4, StepTimer(CPU, n_marks=4), step=step, prompt_ids=prompt.tolist())
    assert len(graphs) == 1, "one graph for every decode step"
    assert graphs[0].mutated, "the step writes the new token's K and V into the cache"
    assert graphs[0].mutated_not_static == []


@pytest.mark.slow
@has_cxx
@pytest.mark.parametrize("cache_name", ["contiguous", "paged"])
def test_compile_default_generates_the_same_tokens_as_eager(tiny_model, tiny_args, cache_name):
    spec = CacheSpec.for_model(tiny_args, batch_size=2, max_tokens=16 + 4, kv_dtype="fp32", device=CPU)
    prompt = torch.randint(tiny_args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    eager, logits = greedy_with_logits(tiny_model, kv.build(cache_name, spec, {}), prompt, 4)
    cache = kv.build(cache_name, spec, {})
    step = compile_decode_step(tiny_model, cache, mode="default")
    torch._dynamo.reset()  # count this step's compilations alone (reset keeps the counters: clear them too)
    torch._dynamo.utils.counters.clear()
    compiled, _ = generate(tiny_model, cache, prompt, 4, StepTimer(CPU, n_marks=4), step=step)
    cache.release()
    again, _ = generate(tiny_model, cache, prompt, 4, StepTimer(CPU, n_marks=4), step=step)
    # Inductor's kernels sum in their own order: the eager tokens up to a near-tie (tests/greedy.py).
    assert_same_greedy_tokens(compiled, eager, logits, tol=LOGIT_TOL["fp32"])
    assert torch.equal(again, compiled)  # the same compiled graph twice: like with like
    # Static shapes: one graph for every step of both generations, never a recompile per position.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
@has_cxx
def test_a_compiled_point_records_its_mode_and_backend_and_the_eager_tokens():
    point = dict(model={"name": "tiny"}, device="cpu", dtype="fp32", prompt_len=8, gen_len=4, **FAST)
    eager = run_point(RunConfig(**point)).row
    compiled = run_point(RunConfig(**point, compile="default")).row
    assert compiled["status"] == "ok" and compiled["compile"] == "default"
    assert compiled["attn_backend"] == "sdpa-masked" and eager["attn_backend"] == "sdpa"
    assert_no_near_tie(point_logits(RunConfig(**point)), tol=LOGIT_TOL["fp32"])  # so rounding cannot flip a token
    assert compiled["output_digest"] == eager["output_digest"]


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"cache": {"name": "sliding", "window": 8}}, "no static-shape decode step"),
        ({"cache": {"name": "none"}}, "no static-shape decode step"),
        (
            {
                "cache": {"name": "paged", "block_size": 4},
                "kv_dtype": "int4",
                "kv_group_size": 32,
                "model": {"name": "small"},
            },
            "int4",
        ),
        ({"kv_dtype": "int4", "kv_group_size": 32, "model": {"name": "small"}}, "int4"),
        ({"compile": "reduce-overhead"}, "CUDA graphs"),
        ({"warmup": 0}, "fewer than the 3"),
        ({"gen_len": 3}, "fewer than the 3"),  # one warm-up generation of 2 decode steps
    ],
)
def test_a_combination_compile_cannot_run_is_an_unsupported_row(overrides, reason):
    point = dict(model={"name": "tiny"}, device="cpu", prompt_len=8, gen_len=4, compile="default") | FAST | overrides
    row = _guarded(RunConfig(**point)).row
    assert row["status"] == "unsupported" and reason in row["error"], row.get("error")


def test_a_reduce_overhead_point_whose_graphs_were_skipped_is_an_error_row_that_says_so(monkeypatch):
    """The counter inductor bumps for every skipped graph decides: the figures of a step run without graphs must not
    pass for CUDA-graph figures. (reduce-overhead needs CUDA, so the compile step is stood in for here.)"""
    from harness.modeling.decode import decode_step
    from harness.run import point

    def skipping_step(model, cache, *, mode):
        calls = []

        def step(tokens, pos):
            if not calls:  # the first call compiles: cudagraph trees decide then, and count a skip
                torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] += 1
            calls.append(pos)
            return decode_step(model, cache, tokens, pos)

        return step

    monkeypatch.setattr(point, "check_compilable", lambda cache, *, mode, device: None)
    monkeypatch.setattr(point, "compile_decode_step", skipping_step)
    point = dict(model={"name": "tiny"}, device="cpu", dtype="fp32", prompt_len=8, gen_len=4, compile="reduce-overhead")
    row = run_point(RunConfig(**point, **FAST)).row
    assert row["cudagraph_skips"] == 1
    assert row["status"] == "error" and "skipped CUDA graphs 1 time" in row["error"]
    assert run_point(RunConfig(**{**point, "compile": "none"}, **FAST)).row.get("cudagraph_skips") is None
