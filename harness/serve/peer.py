"""The peer of our serving engine: transformers' own continuous batching, replaying the same requests on the same
checkpoint and KV budget, timed on one clock (issue #16 item 9, `make bench-serve`).

transformers >= 5 ships an engine with a paged KV pool (transformers/generation/continuous_batching/:
ContinuousBatchingManager, PagedAttentionCache, FIFOScheduler and PrefillFirstScheduler); `run_transformers_cb`
drives it as a client drives a server: it submits each request at its arrival_s on the wall clock from the run's
start, and reads every token back as it is produced. Our knobs (vLLM's names) map onto its ContinuousBatchingConfig:
    num_blocks              num_blocks: whole-model blocks, each page_size tokens of K and V for every layer, as ours
    block_size              page_size (its tokens per block)
    max_num_batched_tokens  max_batch_tokens: tokens per forward pass, prefill chunks and decode tokens together
    max_num_seqs            max_requests_per_batch: requests per forward pass. Its scheduler puts the decoding
                            requests first in every batch, so this caps the running requests too, except those it
                            left starved of a block for a step
    scheduler               scheduler_type: "fifo" (decoding requests first, then prefills; stops admitting new
                            prompts below `safety_margin` of free KV, 0.15 by default) or "prefill_first"
                            (split prefills first, no margin)
Fixed here, so that the peer does what ours does: greedy (do_sample=False), exactly output_len new tokens (eos -1:
never stops early), no prefix sharing (allow_block_sharing=False; prefix_hit_tokens is 0), preemption by recompute
(cpu_offload_space=0: a request starved of blocks is "soft reset", its prompt and tokens re-prefilled later, as vLLM's
default), the attention asked for and no silent switch to flash (auto_switch_to_flash=False). On the CPU it runs
eager ("sdpa" or "paged|eager"): each forward attends over all the batch's K/V in one packed sequence under a
block-diagonal mask [1, 1, M, N + M] (M batch tokens, N cached tokens read), its non-flash design.

What each timestamp of a RequestRecord is, in seconds from the run's start (time.perf_counter, the clock transformers
stamps with too):
    arrival_s          the request's own arrival_s (its trace or Poisson time); it is submitted at the first moment
                       the client loop sees the clock past it (PeerRun.max_submit_lag_s says how late that was)
    first_scheduled_s  when its scheduler first took it out of the waiting queue (RequestState.lifespan[0])
    token_times_s      for every output token, when its engine thread had it on the host, after the forward that
                       made it (record_timestamps=True); read from the streamed outputs, one per token, because a
                       request it preempts is rebuilt with an empty timestamp list and the final output alone would
                       lose the times before the preemption
    finished_s         when it marked the request finished (lifespan[1]), right after the last token; its blocks are
                       freed just after
preemptions counts the times its lifespan restarted (a soft reset then readmission); one that struck before the first
token is not seen, and first_scheduled_s is then the readmission.

Requests due at the same moment (all of them at qps=inf) are submitted under one pause of its loop, so that its next
step drains them together: its schedule then does not depend on the clock, and neither do its tokens (two runs of
the same stream at qps=inf gave the same ids). Before the clock starts, one warm-up request (the first prompt, two
tokens) runs a prefill and a decode, so that one-time costs (the first forward's allocations, lazy inits) stay out
of the figures: warm-up excluded, as every kvbench figure.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.config import DTYPES
from harness.errors import ConfigError
from harness.serve.metrics import RequestRecord
from harness.serve.requests import Request

ENGINE = "transformers-cb"
SCHEDULERS = ("fifo", "prefill_first")  # transformers' SCHEDULER_MAPPING keys
ATTN_IMPLEMENTATIONS = ("sdpa", "paged|eager")  # what its CB runs without flash-attn (the CPU's)
DEVICES = ("cpu", "cuda")
MIN_BLOCK_SIZE = 4  # transformers' BOUNDS["page_size"] (continuous_batching/initialization.py)
# The ContinuousBatchingConfig fields this module sets: a transformers without them has no engine to compare with.
CB_FIELDS = ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "allow_block_sharing")
NO_EOS = -1  # an eos id no token has: RequestState drops negative ids, so the request runs to max_new_tokens
WARMUP_ID = "__kvbench_warmup__"
WARMUP_TOKENS = 2  # one prefill and one decode step
POLL_S = 0.5  # how long the client waits for a result before checking that the engine thread is alive
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PeerRun:
    """One run of transformers' engine: per-request records and output ids, in the order of the requests given."""

    records: tuple[RequestRecord, ...]
    output_token_ids: tuple[tuple[int, ...], ...]  # [num_requests][output_len]
    duration_s: float  # first arrival to last finish (metrics.run_metrics' duration_s)
    max_submit_lag_s: float  # the latest submission after its arrival_s: the client loop's own delay
    transformers_version: str
    attn_implementation: str
    scheduler: str
    num_blocks: int  # as its cache was built: num_blocks rounded up to whole cache sectors
    block_size: int  # tokens per block
    max_num_batched_tokens: int
    max_num_seqs: int


def _check_positive_int(name: str, value: object, *, low: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name}: must be an integer >= {low}, got {value!r}")


def _check_inputs(
    requests: Sequence[Request],
    token_ids: Sequence[Sequence[int]],
    *,
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    dtype: str,
    scheduler: str,
    attn_implementation: str,
    device: str,
) -> None:
    if not requests:
        raise ConfigError("requests: the stream is empty")
    _check_positive_int("num_blocks", num_blocks)
    _check_positive_int("block_size", block_size, low=MIN_BLOCK_SIZE)
    _check_positive_int("max_num_seqs", max_num_seqs)
    _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"scheduler: {scheduler!r} is not one of {', '.join(SCHEDULERS)}")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"attn_implementation: {attn_implementation!r} is not one of {', '.join(ATTN_IMPLEMENTATIONS)}"
        )
    if device not in DEVICES:
        raise ConfigError(f"device: {device!r} is not one of {', '.join(DEVICES)}")
    request_ids = [request.request_id for request in requests]
    if len(set(request_ids)) != len(request_ids):
        repeated = sorted({rid for rid in request_ids if request_ids.count(rid) > 1})
        raise ConfigError(f"requests: request_id must be unique; repeated: {', '.join(map(str, repeated))}")
    if len(token_ids) != len(requests):
        raise ConfigError(f"token_ids: {len(token_ids)} prompts for {len(requests)} requests; give one per request")
    pool_tokens = num_blocks * block_size
    for request, ids in zip(requests, token_ids, strict=True):
        if len(ids) != request.prompt_len:
            raise ConfigError(
                f"token_ids: request {request.request_id} has {len(ids)} ids, its prompt_len is {request.prompt_len}"
            )
        needed = request.prompt_len + request.output_len
        if needed > pool_tokens:
            raise ConfigError(
                f"num_blocks: the pool holds {num_blocks} x {block_size} = {pool_tokens} tokens, too small for request "
                f"{request.request_id} ({request.prompt_len} + {request.output_len} = {needed} tokens)"
            )


def _import_engine():
    """transformers and its ContinuousBatchingConfig, or a ConfigError naming what is missing."""
    try:
        import transformers
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching import ContinuousBatchingManager  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"engine: {ENGINE} needs transformers >= 5 with continuous batching "
            f"(transformers.generation.continuous_batching; tested with 5.24), and importing it failed: {exc}"
        ) from None
    fields = {field.name for field in dataclasses.fields(ContinuousBatchingConfig)}
    missing = [name for name in CB_FIELDS if name not in fields]
    if missing:
        raise ConfigError(
            f"engine: {ENGINE} needs transformers >= 5 with continuous batching; transformers "
            f"{transformers.__version__}'s ContinuousBatchingConfig lacks {', '.join(missing)} (tested with 5.24)"
        )
    return transformers, ContinuousBatchingConfig


class _Stream:
    """What the client has seen of one request's streamed outputs: token ids and times, first admission, restarts."""

    def __init__(self, request: Request, t0: float) -> None:
        self.request, self.t0 = request, t0
        self.token_ids: list[int] = []
        self.token_times_s: list[float] = []
        self.admissions: list[float] = []  # distinct lifespan[0] values, seconds on the run's clock
        self.submitted_s = self.finished_s = None

    def update(self, output) -> None:
        """One streamed GenerationOutput: its tokens past those seen, stamped with its own timestamps."""
        if output.error is not None:
            raise RuntimeError(f"{ENGINE}: request {self.request.request_id} failed: {output.error}")
        if self.submitted_s is None:
            self.submitted_s = output.created_time - self.t0
        admitted_s = output.lifespan[0] - self.t0
        if not self.admissions or admitted_s != self.admissions[-1]:
            self.admissions.append(admitted_s)
        new = len(output.generated_tokens) - len(self.token_ids)
        stamps = output.timestamps or []
        # One stamp per token, the newest last; a preempted request's list restarts empty, so the new tokens' stamps
        # are always its last ones.
        if new > len(stamps):
            raise RuntimeError(
                f"{ENGINE}: request {self.request.request_id} streamed {new} new tokens with {len(stamps)} timestamps"
            )
        if new > 0:
            self.token_ids.extend(output.generated_tokens[-new:])
            self.token_times_s.extend(stamp - self.t0 for stamp in stamps[-new:])
        if output.is_finished():
            self.finished_s = output.lifespan[1] - self.t0

    def record(self) -> RequestRecord:
        request = self.request
        if len(self.token_ids) != request.output_len:
            raise RuntimeError(
                f"{ENGINE}: request {request.request_id} produced {len(self.token_ids)} tokens, "
                f"asked for {request.output_len}"
            )
        return RequestRecord(
            request_id=str(request.request_id),
            arrival_s=request.arrival_s,
            first_scheduled_s=self.admissions[0],
            token_times_s=tuple(self.token_times_s),
            finished_s=self.finished_s,
            prompt_len=request.prompt_len,
            prefix_hit_tokens=0,
            preemptions=len(self.admissions) - 1,
        )


def _add(manager, request: Request, ids: list[int]) -> None:
    manager.add_request(
        ids,
        request_id=str(request.request_id),
        max_new_tokens=request.output_len,
        streaming=True,
        record_timestamps=True,
        eos_token_id=NO_EOS,
    )


def _submit(manager, due: list[tuple[Request, list[int]]]) -> None:
    """Submit the requests now due. Several at once go in under one pause of the engine loop, so that its next step
    drains them all from its queue together: requests arriving together are batched together, every run alike."""
    if len(due) == 1:
        _add(manager, *due[0])
        return
    with manager.pause():
        for request, ids in due:
            _add(manager, request, ids)


def _warm_up(manager, ids: list[int]) -> None:
    manager.add_request(ids, request_id=WARMUP_ID, max_new_tokens=WARMUP_TOKENS, eos_token_id=NO_EOS)
    while True:
        output = manager.get_result(request_id=WARMUP_ID, timeout=POLL_S)
        if output is not None and output.is_finished():
            if output.error is not None:
                raise RuntimeError(f"{ENGINE}: the warm-up request failed: {output.error}")
            return
        _check_alive(manager)


def _check_alive(manager) -> None:
    if not manager.is_running():
        error = manager.background_thread_status.fatal_error
        raise RuntimeError(f"{ENGINE}: its generation thread stopped before every request finished: {error!r}")


def _replay(manager, requests: Sequence[Request], token_ids: Sequence[Sequence[int]]) -> tuple[dict, float]:
    """Submit every request at its arrival and stream every token back: ({request_id: _Stream}, the run's start)."""
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    pending = deque((requests[i], list(token_ids[i])) for i in order)
    t0 = time.perf_counter()
    streams = {str(request.request_id): _Stream(request, t0) for request in requests}
    unfinished = set(streams)
    while unfinished:
        now_s = time.perf_counter() - t0
        due = []
        while pending and pending[0][0].arrival_s <= now_s:
            due.append(pending.popleft())
        if due:
            _submit(manager, due)
        wait_s = min(POLL_S, pending[0][0].arrival_s - now_s) if pending else POLL_S
        output = manager.get_result(timeout=max(wait_s, 0.0))
        if output is None:
            _check_alive(manager)
            continue
        stream = streams.get(output.request_id)
        if stream is None:  # not ours (a late warm-up output): nothing to record
            continue
        stream.update(output)
        if output.is_finished():
            unfinished.discard(output.request_id)
    return streams, t0


def run_transformers_cb(
    model_dir: str | Path,
    requests: Sequence[Request],
    *,
    token_ids: Sequence[Sequence[int]],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    dtype: str,
    scheduler: str = "fifo",
    attn_implementation: str = "sdpa",
    safety_margin: float | None = None,
    device: str = "cpu",
) -> PeerRun:
    """Replay `requests` through transformers' continuous batching on the checkpoint in model_dir.

    token_ids[i] is requests[i]'s prompt ([prompt_len] ints, e.g. requests.prompt_token_ids). The KV pool is
    num_blocks x block_size tokens at the model's dtype (transformers' cache has no dtype of its own). safety_margin:
    the free-KV fraction under which its scheduler admits no new prompt; None keeps the scheduler's default.
    Bad input raises ConfigError before the model loads; an engine failure raises RuntimeError.
    """
    _check_inputs(
        requests,
        token_ids,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        dtype=dtype,
        scheduler=scheduler,
        attn_implementation=attn_implementation,
        device=device,
    )
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"model_dir: {model_dir} has no config.json (expected a Hugging Face checkpoint directory)")
    transformers, ContinuousBatchingConfig = _import_engine()

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=DTYPES[dtype], attn_implementation=attn_implementation
    )
    model = model.to(device).eval().requires_grad_(False)
    generation_config = transformers.GenerationConfig(
        do_sample=False, eos_token_id=NO_EOS, bos_token_id=None, pad_token_id=None
    )
    cb_config = ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_num_batched_tokens,
        max_requests_per_batch=max_num_seqs,
        allow_block_sharing=False,
        scheduler_type=scheduler,
        safety_margin=safety_margin,
        cpu_offload_space=0.0,
        auto_switch_to_flash=False,
    )
    manager = model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=cb_config)
    with torch.inference_mode():  # the engine thread runs in its starter's mode
        manager.warmup()  # captures CUDA graphs where it uses them; a no-op on the CPU
        manager.start()
    try:
        _warm_up(manager, list(token_ids[0]))
        streams, t0 = _replay(manager, requests, token_ids)
    finally:  # hard: every request has finished by now, or the run failed and what is left would only be waited on
        manager.stop(block=True, timeout=STOP_TIMEOUT_S, hard_stop=True)
        manager.destroy()
    resolved = manager.continuous_batching_config  # filled with the cache's own figures when it was built
    ordered = [streams[str(request.request_id)] for request in requests]
    records = tuple(stream.record() for stream in ordered)
    return PeerRun(
        records=records,
        output_token_ids=tuple(tuple(stream.token_ids) for stream in ordered),
        duration_s=max(r.finished_s for r in records) - min(r.arrival_s for r in records),
        max_submit_lag_s=max(stream.submitted_s - stream.request.arrival_s for stream in ordered),
        transformers_version=transformers.__version__,
        attn_implementation=attn_implementation,
        scheduler=scheduler,
        num_blocks=int(resolved.num_blocks),
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )
