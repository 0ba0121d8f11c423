"""The serving engine: the scheduler's iterations executed on the real model, one flattened forward each.

Orca's iteration-level scheduling (Yu et al. OSDI 2022) over vLLM's paged pool (Kwon et al. 2023): every iteration
`Scheduler.schedule` says which requests compute which tokens (decodes and prefill chunks together, under
max_num_batched_tokens) and where their K/V go (block tables); `Engine.execute` runs that as one forward of
harness.modeling.model over a harness.kv.varlen.SeqBatch, samples greedily the requests that reached their last known token,
and `Scheduler.update` advances them, finishing those at output_len and returning their blocks.

The KV tensors are the storage a strategy's SERVING names (harness.kv.base.Serving): a slots pool (`contiguous`:
a slot of max_model_len tokens per running request, the engine choosing the slot) or a blocks pool (`paged`) whose
block tables come from the scheduler's KV manager (harness.serve.kv_manager), which also decides prefix sharing
(`prefix`) and what a window frees (`sliding`, read under the window's mask). Preemption by recompute needs
nothing here: the request's blocks are gone, and it re-prefills its prompt and outputs. Swap copies a victim's
blocks to host memory before the forward that reuses them, and back into its new blocks when it is readmitted
(vLLM v0's swap_out / swap_in). A prefix pool with tiers (harness.serve.tiered) copies the blocks its manager
evicted into the host and disk tiers before the forward, and the tiers' hits into their new blocks: before it too,
or with tier_overlap layer by layer during it (harness.serve.tier_loader), a request's disk blocks prefetched from
its arrival.

`serve` is the loop on the wall clock: requests join when the clock passes their arrival_s, an idle engine sleeps
until the next arrival, and every iteration's host times are taken apart: `scheduler_s` (schedule and update) and
`step_s` (building the batch, the forward, sampling; one host sync, reading the sampled ids back).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from harness import kv
from harness.errors import ConfigError
from harness.kv import paged
from harness.kv.base import CacheSpec
from harness.kv.varlen import SeqBatch, to_device
from harness.serve.kv_manager import serving
from harness.serve.metrics import RequestRecord
from harness.serve.requests import Request
from harness.serve.scheduler import Scheduler, SchedulerOutput

SERVE_KV_DTYPES = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")  # per-token formats (not int4)


def check_servable(args, *, attn_impl: str = "sdpa", windowed: bool = False) -> None:
    """What serving's per-sequence attention cannot run for this model, one ConfigError line before anything is
    built, not an Unsupported mid-run: MLA's latent (harness.modeling.mla.MLAttention._attend_varlen) is read by SDPA only, and without a
    window."""
    if args.is_mla and attn_impl != "sdpa":
        raise ConfigError(f"attn_impl: {args.name} is MLA, whose served latent attention runs SDPA only; allowed: sdpa")
    if args.is_mla and windowed:
        raise ConfigError(f"strategy: {args.name} is MLA, whose served latent attention reads no sliding window; "
                          "allowed: contiguous, paged")  # fmt: skip


def build_cache(
    strategy: str,
    args,
    *,
    kv_dtype: str,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    device: torch.device,
    dtype: str | None = None,
    attn_impl: str = "sdpa",
    options: dict | None = None,
):
    """The KV tensors of a serving pool of num_blocks blocks of block_size tokens, at kv_dtype, in the cache of the
    strategy's Serving.storage. (cache, num_slots): a slots pool cuts the same tokens into num_slots =
    num_blocks·block_size // max_model_len slots of max_model_len (None for a blocks pool). args: the model's
    harness.modeling.model_args.ModelArgs; attn_impl: its spec's, which harness.kv.varlen.attend runs. options: a
    budgeted strategy's (cache.budget, ...), its own serving cache over the blocks (harness.kv.serving_cache)."""
    declared = serving(strategy)
    if kv_dtype not in SERVE_KV_DTYPES:
        raise ConfigError(f"kv_dtype: serving stores per-token formats; allowed: {', '.join(SERVE_KV_DTYPES)}, "
                          f"got {kv_dtype!r}")  # fmt: skip
    storage = declared.storage or strategy
    if not declared.paged:
        num_slots = num_blocks * block_size // max_model_len
        if num_slots < 1:
            raise ConfigError(f"kv budget: {num_blocks * block_size} tokens hold no slot of max_model_len="
                              f"{max_model_len} tokens")  # fmt: skip
        spec = CacheSpec.for_model(args, batch_size=num_slots, max_tokens=max_model_len, kv_dtype=kv_dtype,
                                   device=device, dtype=dtype, attn_impl=attn_impl)  # fmt: skip
        return kv.build(storage, spec, {}), num_slots
    # One pool for every blocks strategy (its storage, a harness.kv.paged pool): sharing and what a window frees are
    # the scheduler's block tables, the only ones, which each forward's SeqBatch brings (for_scheduler).
    spec = CacheSpec.for_model(args, batch_size=1, max_tokens=block_size, kv_dtype=kv_dtype, device=device,
                               dtype=dtype, attn_impl=attn_impl)  # fmt: skip
    if declared.budgeted:
        cache = kv.serving_cache(storage, spec, block_size=block_size, num_blocks=num_blocks, options=options or {})
        return cache, None
    options = kv.parse_options(storage, {"block_size": block_size, "pool_tokens": num_blocks * block_size})
    return paged.PagedCache.for_scheduler(spec, options), None


class Engine:
    """Executes SchedulerOutputs on `model` over `cache` (a harness.kv strategy built for serving, `build_cache`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache,
        *,
        num_slots: int | None = None,
        window: int | None = None,
        tiers=None,
        forced: dict[int, Sequence[int]] | None = None,
        on_logprobs: Callable[[int, int, torch.Tensor], None] | None = None,
    ):
        self.model, self.cache, self.window = model, cache, window
        self.tiers = tiers  # a prefix pool's host and disk tiers (harness.serve.tier_store.ServeTiers), or None
        # Teacher forcing (harness.serve.accuracy): request id -> the output tokens appended instead of the sampled
        # ones, and on_logprobs(request id, output index, log-probabilities [V] fp32 on the host) at each sampling
        # position; both None in a timed run, which then pays nothing for them.
        self.forced = forced or {}
        self.on_logprobs = on_logprobs
        self.device = next(model.parameters()).device
        self.paged = num_slots is None  # else a slot per running request (contiguous)
        self.free_slots = list(range(num_slots or 0))[::-1]  # a stack: slot 0 first
        self.slot_of: dict[int, int] = {}
        self.token_ids: dict[int, list[int]] = {}  # request id -> prompt ids + outputs sampled so far
        self.prompt_len: dict[int, int] = {}
        # request id -> ({logical block index: its position in the rows}, {part name: its blocks' rows, on the host})
        self.swapped: dict[int, tuple[dict[int, int], dict[str, torch.Tensor]]] = {}
        self.prefetched: dict[int, list[bytes]] = {}  # request id -> its disk blocks read ahead (tier_overlap)

    def add_request(self, request: Request, prompt_ids: Sequence[int]) -> None:
        if len(prompt_ids) != request.prompt_len:
            raise ValueError(f"request {request.request_id}: {len(prompt_ids)} prompt ids for prompt_len "
                             f"{request.prompt_len}")  # fmt: skip
        forced = self.forced.get(request.request_id)
        if forced is not None and len(forced) != request.output_len:
            raise ValueError(f"request {request.request_id}: {len(forced)} forced tokens for output_len "
                             f"{request.output_len}")  # fmt: skip
        self.token_ids[request.request_id] = list(prompt_ids)
        self.prompt_len[request.request_id] = request.prompt_len
        if self.tiers is not None:  # its disk blocks read while it waits (none without tier_overlap)
            self.prefetched[request.request_id] = self.tiers.prefetch(request.block_hashes)

    def outputs(self, request_id: int) -> list[int]:
        """The tokens sampled for a request so far."""
        return self.token_ids[request_id][self.prompt_len[request_id] :]

    def finish(self, request_id: int) -> list[int]:
        """A finished request leaves: its slot back, its state dropped; returns its output tokens."""
        out = self.outputs(request_id)
        self._drop(request_id)
        del self.token_ids[request_id], self.prompt_len[request_id]
        return out

    def _drop(self, request_id: int) -> None:
        if request_id in self.slot_of:
            self.free_slots.append(self.slot_of.pop(request_id))

    def _slot(self, request_id: int) -> int:
        if self.paged:
            return 0
        if request_id not in self.slot_of:
            self.slot_of[request_id] = self.free_slots.pop()  # the scheduler admitted it: a slot is free
        return self.slot_of[request_id]

    def _swap(self, output: SchedulerOutput) -> None:
        """vLLM v0's swap, by the scheduler's block lists: the victims' blocks to the host before this forward
        reuses them, and back into the blocks a readmission took new, through the pool's own block read and write
        (harness.kv.paged.PagedCache.read_blocks / write_blocks: every part, K, V and a format's scales). Each is
        saved under its logical index, so a window's rows return to their place in the table. Blocks, not slots: a
        slot is never preempted."""
        for swap in output.swap_out:
            rows = {name: part.to("cpu") for name, part in self.cache.read_blocks(list(swap.blocks)).items()}
            self.swapped[swap.request_id] = ({logical: i for i, logical in enumerate(swap.logical)}, rows)
        for swap in output.swap_in:
            position, rows = self.swapped.pop(swap.request_id)
            if not swap.blocks:  # all its blocks were found cached (prefix hits): nothing to copy
                continue
            saved = torch.tensor([position[logical] for logical in swap.logical], dtype=torch.long)
            self.cache.write_blocks(list(swap.blocks), {name: part[:, saved] for name, part in rows.items()})

    def execute(self, output: SchedulerOutput) -> None:
        """Run one iteration's forward; append the sampled token of each request whose chunk reached its end."""
        for rid in output.preempted_ids:
            if rid not in output.swapped_out_ids:
                self._drop(rid)
        if output.tier_moves is not None:
            self.tiers.apply(self.cache, output.tier_moves)  # evicted blocks out, then the tiers' hits in
            for entry in output.scheduled:  # admitted: its lookup has taken what it needed of its prefetches
                self.tiers.release(self.prefetched.pop(entry.request_id, []))
        if output.swap_out or output.swap_in:
            self._swap(output)
        entries = output.scheduled
        ids: list[int] = []
        for entry in entries:
            start = entry.num_computed_tokens
            ids += self.token_ids[entry.request_id][start : start + entry.num_new_tokens]
        batch = SeqBatch(
            slots=tuple(self._slot(entry.request_id) for entry in entries),
            start_pos=tuple(entry.num_computed_tokens for entry in entries),
            n_new=tuple(entry.num_new_tokens for entry in entries),
            block_tables=tuple(entry.blocks.get_block_ids() for entry in entries) if self.paged else (),
            window=self.window,
        )
        tokens = to_device([ids], self.device)[0][None]  # [1, N], pinned and non-blocking on CUDA
        with torch.inference_mode():
            logits = self.model(tokens, batch, self.cache, last_only=True)  # [1, n, V]
        if self.tiers is not None:
            self.tiers.finish(self.cache)  # the layer loads all in before the next iteration's offloads read blocks
        sampled = logits[0].argmax(dim=-1).tolist()  # greedy; the iteration's one host sync
        if self.on_logprobs is not None:
            self._hand_logprobs(entries, logits[0])
        for entry, token in zip(entries, sampled, strict=True):
            if entry.samples_token:
                rid = entry.request_id
                if rid in self.forced:  # teacher-forced: the given token, whatever this forward would sample
                    token = self.forced[rid][len(self.token_ids[rid]) - self.prompt_len[rid]]
                self.token_ids[rid].append(token)

    def _hand_logprobs(self, entries, logits: torch.Tensor) -> None:
        """logits [n, V], a row per entry: the sampling entries' log-softmax in fp32, to the host, to on_logprobs
        with the output index each row predicts (the outputs appended so far)."""
        rows = [i for i, entry in enumerate(entries) if entry.samples_token]
        if not rows:
            return
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1).cpu()  # [len(rows), V]
        for row, i in zip(logprobs, rows, strict=True):
            rid = entries[i].request_id
            self.on_logprobs(rid, len(self.token_ids[rid]) - self.prompt_len[rid], row)


@dataclass
class ServeResult:
    records: list[RequestRecord]  # in finishing order
    outputs: dict[int, list[int]]  # request id -> its output tokens
    duration_s: float  # the run's wall time: its start to the last request's finish
    num_iterations: int


def serve(
    requests: Sequence[Request],
    prompt_ids: Sequence[Sequence[int]],
    *,
    scheduler: Scheduler,
    engine: Engine,
    on_iteration: Callable[[int, SchedulerOutput, float, float], None] | None = None,
    on_finish: Callable[[RequestRecord], None] | None = None,
    next_turn: Callable[[RequestRecord], tuple[Request, Sequence[int]] | None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> ServeResult:
    """Serve `requests` (prompt_ids[i] for requests[i]) on the wall clock until every one has finished.

    on_iteration(index, output, step_s, scheduler_s) after each iteration, on_finish(record) as each request ends:
    a run's rows are written as it goes (harness.serve.rows.ServeRunWriter), so a run killed midway keeps them.
    next_turn(record), the closed loop of chat sessions (harness.serve.multiturn.Sessions.next_turn): the request
    that follows a finished one, with its prompt ids and an arrival_s no earlier than record.finished_s, or None;
    it joins the pending arrivals in order. Without it the stream is the open loop given up front.
    """
    by_id = {request.request_id: ids for request, ids in zip(requests, prompt_ids, strict=True)}
    pending = deque(sorted(requests, key=lambda request: request.arrival_s))
    records, outputs = [], {}
    index = 0
    start = clock()
    while pending or scheduler.has_unfinished_requests():
        now = clock() - start
        if not scheduler.has_unfinished_requests() and pending[0].arrival_s > now:
            time.sleep(pending[0].arrival_s - now)  # idle: nothing to compute before the next arrival
            now = clock() - start
        while pending and pending[0].arrival_s <= now:
            request = pending.popleft()
            scheduler.add_request(request)
            engine.add_request(request, by_id[request.request_id])
        t0 = clock()
        output = scheduler.schedule(t0 - start)
        t1 = clock()
        if not output.scheduled:
            raise RuntimeError(
                f"scheduler stalled at {t1 - start:.3f} s: nothing scheduled, {output.num_waiting} waiting"
            )
        engine.execute(output)
        t2 = clock()
        finished = scheduler.update(output, t2 - start)
        t3 = clock()
        for record in finished:
            outputs[int(record.request_id)] = engine.finish(int(record.request_id))
            records.append(record)
            if on_finish is not None:
                on_finish(record)
            if next_turn is not None and (follow := next_turn(record)) is not None:
                request, ids = follow
                assert request.arrival_s >= record.finished_s, "a turn cannot arrive before the one it follows ends"
                by_id[request.request_id] = ids
                bisect.insort(pending, request, key=lambda pending_request: pending_request.arrival_s)
        if on_iteration is not None:
            on_iteration(index, output, t2 - t1, (t1 - t0) + (t3 - t2))
        index += 1
    duration_s = max(record.finished_s for record in records) if records else 0.0
    return ServeResult(records=records, outputs=outputs, duration_s=duration_s, num_iterations=index)
