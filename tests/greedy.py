"""Greedy tokens from two computations that round differently: equal, except from a near-tie of the reference on.

Two computations of the same logits round differently as soon as their accumulation order differs: a GEMM at another
shape (batch 1 against batch B, a prefill against token-by-token decoding, recomputation against a cache), another
attention kernel, compiled code against eager, or the very same call on another CPU (MKL and oneDNN pick their
kernels by AVX2, AVX-512 or AMX). Their fp32 logits then differ by ~1e-6 relative, and bit-equal greedy tokens would be
luck: where the reference's top-1 logit leads the runner-up by less than that, either may win, and from there on the
two sequences have different histories and rightly go apart.

So each sequence must equal the reference's up to its first difference, and that step must be a near-tie of the
reference: its top-1 margin below the tolerance. A cache that stores or reads wrong K/V moves logits by far more and
changes tokens at clear margins, which still fails. Like with like (same shapes, same kernels, same inputs) stays
bit-exact, with torch.equal, in the tests themselves.
"""

from __future__ import annotations

import dataclasses

import torch

from harness import kv
from harness.config import DTYPES, RunConfig
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate
from harness.modeling.model import build_model
from harness.run.point import cache_spec, make_prompts

# How far two computations' logits may sit apart, by the format the K/V are stored in; absolute, for logits of at most
# a few units (the tiny preset's with dummy weights are below 1, the small preset's below 3).
LOGIT_TOL = {
    # Accumulation order only: measured at most 1.2e-7 (2 ulps) between recomputation, contiguous, paged, prefix,
    # offload and the Triton kernel, and 1.6e-7 against transformers' Llama, here (AVX2) and under
    # ATEN_CPU_CAPABILITY=default, MKL_CBWR=COMPATIBLE or one thread; ~1e-6 relative is the usual bound for a change
    # of summation order. 1e-5 leaves room for other CPUs and GPUs and stays far below the tests' smallest top-1
    # margins (~5e-4), so nearly every step is held to equality.
    "fp32": 1e-5,
    # A narrow format adds one more way apart: a value within rounding of a code boundary lands on neighbouring codes
    # in the two computations. One stored value moved by one code moved the tiny model's logits by at most 3e-5
    # (bf16), 6e-5 (int8), 5e-4 (fp8_e4m3) and 9e-4 (fp8_e5m2), over 40 random positions; these are twice that.
    "bf16": 6e-5,
    "int8": 1.2e-4,
    "fp8_e4m3": 1e-3,
    "fp8_e5m2": 2e-3,
}


class LogitRecorder:
    """The model, keeping the last position's logits [B, V] of every forward pass: generate's prefill, then each
    decode step (prefix caching's batch-1 pass over the prefix adds one entry first; `logits` keeps the last N)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.steps = model, []

    def __call__(self, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
        out = self.model(tokens, **kwargs)
        self.steps.append(out[:, -1].float())
        return out

    def logits(self, n_steps: int) -> torch.Tensor:
        """[B, n_steps, V]: the logits that chose the last n_steps generated tokens."""
        return torch.stack(self.steps[-n_steps:], dim=1)


def greedy_with_logits(model, cache, prompt: torch.Tensor, gen_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """generate(), eager, and the logits behind its tokens: ([B, gen_len] ids, [B, gen_len, V] fp32)."""
    recorder = LogitRecorder(model)
    tokens, _ = generate(recorder, cache, prompt, gen_len, StepTimer(prompt.device, n_marks=gen_len))
    return tokens, recorder.logits(gen_len)


def top1_margins(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: how far the greedy choice leads the runner-up."""
    best, runner_up = logits.float().topk(2, dim=-1).values.unbind(-1)
    return best - runner_up


def assert_same_greedy_tokens(actual: torch.Tensor, expected: torch.Tensor, logits: torch.Tensor, *, tol: float):
    """actual, expected [B, N] greedy ids; logits [B, N, V]: the reference's, the ones that chose `expected`.

    Every sequence equals the reference up to its first difference, which must be a near-tie (margin < tol)."""
    actual, expected, logits = actual.cpu(), expected.cpu(), logits.float().cpu()
    assert actual.shape == expected.shape == logits.shape[:2], (actual.shape, expected.shape, logits.shape)
    assert torch.equal(logits.argmax(dim=-1), expected), "the logits given are not the ones that chose `expected`"
    margins = top1_margins(logits)
    for row in range(actual.shape[0]):
        differ = (actual[row] != expected[row]).nonzero()
        if len(differ):
            step = differ[0].item()
            assert margins[row, step] < tol, (
                f"sequence {row} leaves the reference at step {step}, where its top-1 margin is "
                f"{margins[row, step].item():.2e}, no near-tie (< {tol:.0e}): {actual[row].tolist()} vs "
                f"{expected[row].tolist()}"
            )


def assert_no_near_tie(logits: torch.Tensor, *, tol: float) -> None:
    """For comparisons that see only digests: every greedy choice of the reference leads by more than tol, so no
    rounding difference can flip a token, and computations that differ only in rounding owe the same digest."""
    margin = top1_margins(logits).min().item()
    assert margin > tol, f"the reference has a near-tie (top-1 margin {margin:.2e} <= {tol:.0e}): pick another seed"


def point_logits(cfg: RunConfig, *, model: torch.nn.Module | None = None) -> torch.Tensor:
    """[B, gen_len, V]: the greedy logits of a sweep point's workload (its model, weights, seed, prompts and kv_dtype),
    through `contiguous`, eager, on the CPU: the reference for its output_digest. model: one already loaded (CPU)."""
    cpu, args = torch.device("cpu"), cfg.model_args()
    if model is None:
        model = build_model(
            args,
            weights=cfg.weights,
            dtype=DTYPES[cfg.dtype],
            device=cpu,
            seed=cfg.seed,
            n_positions=cfg.prompt_len + cfg.gen_len,
        )
    cache = kv.build("contiguous", dataclasses.replace(cache_spec(cfg), device=cpu), {})
    return greedy_with_logits(model, cache, make_prompts(cfg, vocab_size=args.vocab_size).ids, cfg.gen_len)[1]
