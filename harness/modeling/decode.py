"""The named phases of generation: prefill, then one decode step per output token, greedy and fixed-length.

With a cache, a decode step feeds only the newest token and attends over the stored K/V. Without one (`none`),
it feeds the whole sequence so far, which is what the cache saves.

`compile` (gpt-fast's recipe): `compile_decode_step` wraps the decode step, `decode_one_token`, in torch.compile.
Every step then runs at the same shapes: the token and its position are device tensors the step reads (a position
that is a Python int would be a new constant, so a recompile, at every step), and the cache attends over its whole
preallocated buffer under a length mask. With mode="reduce-overhead" the compiled step is captured once in a CUDA
graph and replayed, which removes the per-kernel launch cost that dominates a small model's step. Compilation (and
the graph's recording) happens in the first calls, inside the warm-up generations (harness.run.point makes sure they run
enough steps), never in a timed one. Prefill stays eager: it runs once per generation, at a shape of its own.

`freeze` (the CPU): inductor's freezing takes the weights as constants of the graph, so that its weight prepacking
(`torch._inductor.config.cpp.weight_prepack`, on by default) turns each linear into oneDNN's or MKL's packed linear
over a pre-laid-out copy of the weight (the graph holds those copies: the weights' bytes twice). It needs weights
that never change (inference, no autograd), which is what the decode step has. `make bench` measures it against the eager step and the plain compiled one (harness.run.levers).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch.profiler import record_function

from harness import kv
from harness.errors import Unsupported
from harness.formats import COMPILE_MODES
from harness.kv.base import KVCache
from harness.measure.timing import Sample, StepTimer

# step(tokens [B, S], pos) -> the next token [B], for the sequences in `tokens` whose newest token sits at pos.
DecodeStep = Callable[[torch.Tensor, int], torch.Tensor]


def prefill_logits(
    model: torch.nn.Module, cache: KVCache, prompt: torch.Tensor, *, prompt_ids: list[list[int]] | None = None
) -> torch.Tensor:
    """prompt [B, P] on the model's device -> the logits [B, V] of the token after it.

    prompt_ids: the same ids on the host as lists of ints, where a server keeps them; a prefix cache hashes them
    there, so that looking a prefix up never copies the prompt back from the device (a sync). Without them the cache
    copies the prompt itself."""
    # The cache fills the prefix every sequence shares (or finds it cached) and says how many leading tokens it holds
    # (harness.kv.prefix; 0 for a strategy that shares none); only the rest runs here.
    cached = cache.prefill_prefix(model, prompt, prompt_ids=prompt_ids)
    return model(prompt[:, cached:], start_pos=cached, cache=cache, last_only=True)[:, -1]  # [B, V]


def decode_logits(model: torch.nn.Module, cache: KVCache, tokens: torch.Tensor, pos: int) -> torch.Tensor:
    """tokens [B, S] holds the sequences so far, the newest at `pos` -> the logits [B, V] of the token after it."""
    if cache.recomputes_prefix:
        return model(tokens[:, : pos + 1], start_pos=0, cache=cache, last_only=True)[:, -1]
    return model(tokens[:, pos : pos + 1], start_pos=pos, cache=cache, last_only=True)[:, -1]


def prefill(
    model: torch.nn.Module, cache: KVCache, prompt: torch.Tensor, *, prompt_ids: list[list[int]] | None = None
) -> torch.Tensor:
    """prompt [B, P] -> the first generated token [B] (prompt_ids: as in prefill_logits)."""
    logits = prefill_logits(model, cache, prompt, prompt_ids=prompt_ids)
    with record_function("kvbench::sampling"):  # harness.measure.profile: what runs inside is sampling time
        return logits.argmax(dim=-1)


def decode_step(model: torch.nn.Module, cache: KVCache, tokens: torch.Tensor, pos: int) -> torch.Tensor:
    """tokens [B, S] holds the sequences so far; the newest token sits at `pos`. Returns the next token [B]."""
    logits = decode_logits(model, cache, tokens, pos)
    with record_function("kvbench::sampling"):
        return logits.argmax(dim=-1)


def decode_one_token(model: torch.nn.Module, cache: KVCache, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The decode step at static shapes, what torch.compile captures: token [B, 1] at position pos [1] (both on the
    device) -> the next token [B]. The model's own forward with the position as a tensor: RoPE rows are indexed,
    not sliced, and the cache receives the tensor (harness.kv.contiguous attends under a length mask)."""
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]  # [1, D]
    x = model.tok_embeddings(token)  # [B, 1, dim]
    for layer in model.layers:
        x = layer(x, cos=cos, sin=sin, start_pos=pos, cache=cache)
    return model.output(model.norm(x))[:, -1].argmax(dim=-1)  # [B]


def check_compilable(cache: KVCache, *, mode: str, device: torch.device) -> None:
    """Unsupported, before anything is built, for a combination that cannot compile to static shapes here."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile: unknown mode {mode!r}; allowed: none, {', '.join(COMPILE_MODES)}")
    if mode == "reduce-overhead" and device.type != "cuda":
        raise Unsupported(f"compile: reduce-overhead captures CUDA graphs, and this point runs on {device.type}")
    if not cache.supports_static_decode:
        raise Unsupported(
            f"compile: cache {cache.name} has no static-shape decode step (its K/V move by ring, stream or "
            f"recomputation); allowed: {', '.join(kv.static_decode_names())}"
        )
    if cache.spec.kv_dtype == "int4":
        raise Unsupported("compile: int4 (KIVI) quantizes key groups as they complete, a data-dependent write")


def cudagraph_skips() -> int:
    """How many times inductor has skipped CUDA graphs in this process (for a mutated non-static input, a CPU
    tensor, a dynamic shape, ...): cudagraph trees count each skip here and log its reason under TORCH_LOGS=perf_hints."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled in this process (and importing dynamo takes ~1 s)
        return 0
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


def compile_decode_step(
    model: torch.nn.Module, cache: KVCache, *, mode: str, backend=None, freeze: bool = False
) -> DecodeStep:
    """decode_one_token under torch.compile(mode), as a DecodeStep: the cache's bookkeeping (prepare) stays eager
    and on the host; the token and the position reach the graph through two device buffers, updated by device
    copies, so no step waits on the host.

    Every tensor the step mutates must be a static input, its own tensor and marked static (the cache's
    `static_tensors`, the token and position buffers): CUDA graph trees skip the graph for a mutated input that is
    not, and say so only in `torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]` (harness.run.point records it).

    backend: a torch.compile backend other than inductor, for tests that trace the step where inductor cannot
    generate code (fake CUDA tensors, tests/cuda/test_cuda_trace.py); `mode` then still decides the step's protocol.

    freeze: mode=default only, inductor's freezing and weight prepacking (oneDNN/MKL packed linears on the CPU)."""
    device = model.tok_embeddings.weight.device
    check_compilable(cache, mode=mode, device=device)
    cache.enable_static_decode()  # Unsupported for a format without a static-shape write (int4)
    if freeze and (mode != "default" or backend is not None):
        raise ValueError(f"freeze: inductor's freezing needs compile=default and inductor, got mode {mode!r}")
    options = {"backend": backend} if backend is not None else {"mode": mode}
    # Inductor reads its config when it compiles, inside the first call: patched around every call, so that nothing
    # else in the process compiles frozen. (torch.compile(options={"freezing": True}) did not freeze, torch 2.13.)
    frozen = {"freezing": True, "cpp.weight_prepack": True}
    if freeze:  # imported here, not at the top: torch._inductor brings torch._dynamo, ~1 s of every process's start
        import torch._inductor.config as inductor_config
    compiled = torch.compile(decode_one_token, fullgraph=True, dynamic=False, **options)
    batch = cache.spec.batch_size
    token = torch.zeros((batch, 1), dtype=torch.long, device=device)  # [B, 1]
    pos = torch.zeros(1, dtype=torch.long, device=device)  # [1]
    # CUDA graphs read them where they are, instead of copying them in. Never when frozen: freezing folds every static
    # input the graph does not mutate into a constant, and these two change between calls (by copies outside it).
    for buffer in () if freeze else (token, pos):
        torch._dynamo.mark_static_address(buffer)

    def step(tokens: torch.Tensor, at: int) -> torch.Tensor:
        cache.prepare(at, 1)
        token.copy_(tokens[:, at : at + 1])
        pos.fill_(at)
        if mode == "reduce-overhead":  # a new step: the graph's previous outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        if not freeze:  # the config patch only where it changes something: this is the decode step's hot path
            return compiled(model, cache, token, pos)
        with inductor_config.patch(frozen):
            return compiled(model, cache, token, pos)

    return step


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    cache: KVCache,
    prompt: torch.Tensor,
    gen_len: int,
    timer: StepTimer,
    step: DecodeStep | None = None,
    *,
    prompt_ids: list[list[int]] | None = None,
) -> tuple[torch.Tensor, Sample]:
    """Greedy decoding of gen_len tokens after prompt [B, P]. Returns (generated ids [B, gen_len], timing).

    step: how each decode step runs (compile_decode_step's); by default decode_step, eager.
    prompt_ids: the prompt's ids on the host as lists of ints, where a prefix cache looks them up (prefill_logits)."""
    step = step or functools.partial(decode_step, model, cache)
    batch, prompt_len = prompt.shape
    # One buffer for the whole sequence: no per-step concatenation on the hot path.
    tokens = torch.empty((batch, prompt_len + gen_len), dtype=torch.long, device=prompt.device)
    tokens[:, :prompt_len] = prompt
    timer.start()
    tokens[:, prompt_len] = prefill(model, cache, prompt, prompt_ids=prompt_ids)
    timer.mark()
    for pos in range(prompt_len, prompt_len + gen_len - 1):
        tokens[:, pos + 1] = step(tokens, pos)
        timer.mark()
    intervals = timer.intervals_ms()  # the only host sync of the generation
    return tokens[:, prompt_len:], Sample(ttft_ms=intervals[0], step_ms=intervals[1:])
