"""The named phases of generation: prefill, then one decode step per output token, greedy and fixed-length.

With a cache, a decode step feeds only the newest token and attends over the stored K/V. Without one (`none`),
it feeds the whole sequence so far, which is what the cache saves.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from harness.kv.base import KVCache
from harness.timing import Sample, StepTimer


def prefill_logits(model: torch.nn.Module, cache: KVCache, prompt: torch.Tensor) -> torch.Tensor:
    """prompt [B, P] -> the logits [B, V] of the token after it."""
    # Optional hook `prefill_prefix(model, prompt) -> int` (harness.kv.prefix): the cache fills the prefix every
    # sequence shares (or finds it cached) and says how many leading tokens it holds; only the rest runs here.
    prefill_prefix = getattr(cache, "prefill_prefix", None)
    cached = prefill_prefix(model, prompt) if prefill_prefix is not None else 0
    return model(prompt[:, cached:], start_pos=cached, cache=cache, last_only=True)[:, -1]  # [B, V]


def decode_logits(model: torch.nn.Module, cache: KVCache, tokens: torch.Tensor, pos: int) -> torch.Tensor:
    """tokens [B, S] holds the sequences so far, the newest at `pos` -> the logits [B, V] of the token after it."""
    if cache.recomputes_prefix:
        return model(tokens[:, : pos + 1], start_pos=0, cache=cache, last_only=True)[:, -1]
    return model(tokens[:, pos : pos + 1], start_pos=pos, cache=cache, last_only=True)[:, -1]


def prefill(model: torch.nn.Module, cache: KVCache, prompt: torch.Tensor) -> torch.Tensor:
    """prompt [B, P] -> the first generated token [B]."""
    logits = prefill_logits(model, cache, prompt)
    with record_function("kvbench::sampling"):  # harness.profile: what runs inside is sampling time
        return logits.argmax(dim=-1)


def decode_step(model: torch.nn.Module, cache: KVCache, tokens: torch.Tensor, pos: int) -> torch.Tensor:
    """tokens [B, S] holds the sequences so far; the newest token sits at `pos`. Returns the next token [B]."""
    logits = decode_logits(model, cache, tokens, pos)
    with record_function("kvbench::sampling"):
        return logits.argmax(dim=-1)


@torch.inference_mode()
def generate(
    model: torch.nn.Module, cache: KVCache, prompt: torch.Tensor, gen_len: int, timer: StepTimer
) -> tuple[torch.Tensor, Sample]:
    """Greedy decoding of gen_len tokens after prompt [B, P]. Returns (generated ids [B, gen_len], timing)."""
    batch, prompt_len = prompt.shape
    # One buffer for the whole sequence: no per-step concatenation on the hot path.
    tokens = torch.empty((batch, prompt_len + gen_len), dtype=torch.long, device=prompt.device)
    tokens[:, :prompt_len] = prompt
    timer.start()
    tokens[:, prompt_len] = prefill(model, cache, prompt)
    timer.mark()
    for pos in range(prompt_len, prompt_len + gen_len - 1):
        tokens[:, pos + 1] = decode_step(model, cache, tokens, pos)
        timer.mark()
    intervals = timer.intervals_ms()  # the only host sync of the generation
    return tokens[:, prompt_len:], Sample(ttft_ms=intervals[0], step_ms=intervals[1:])
