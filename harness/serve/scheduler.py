"""The serving engine's scheduling brain: which requests run this iteration, and how many tokens each computes.

Iteration-level scheduling with continuous batching (Orca, Yu et al. OSDI 2022): the batch is rebuilt every
iteration, so a request joins as soon as it fits and leaves as soon as it finishes. Torch-free; the engine loop
executes each SchedulerOutput as one forward on the real model, and `simulate` executes it on a synthetic clock.

After vLLM v1 (vllm/v1/core/sched/scheduler.py `schedule()`), with its knob names:
- There is no prefill or decode phase: each request has num_computed_tokens and num_tokens (prompt plus outputs so
  far), and an iteration lets computed catch up, within max_num_batched_tokens. A decoding request takes 1 token;
  a prefilling one takes min(what is left, budget left): chunked prefill (Sarathi, Agrawal et al. 2024).
- RUNNING requests first, in admission order; then WAITING ones in FCFS order, each admitted while the budget has
  tokens, running < max_num_seqs and the KV manager can allocate its tokens (plus vLLM v0's watermark). The head
  of the queue that does not fit stops admission: no request overtakes it.
- A running request that cannot get a block preempts the last of the running queue (the lowest priority, the
  most recently admitted), itself if it is the last. Recompute (vLLM's default): its blocks are freed, its
  computed tokens reset to 0, and it goes to the FRONT of the waiting queue, to re-prefill prompt plus outputs.
  Swap (vLLM v0's option): the same, but its computed tokens are kept; the output lists the blocks it held in
  swap_out, for the engine to copy to the host, and in swap_in, when it is readmitted, the blocks to copy back:
  only those its readmission took new (a cached prefix block is shared and already holds its K/V), under their
  logical index (a window's table is readmitted from its first kept block, not from its first token).
- No request is admitted in an iteration that preempted one (vLLM v1: `if not preempted_reqs:`).
- The iteration that computes a request's last known token samples its next one; it finishes at output_len.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from harness.errors import ConfigError
from harness.serve.kv_manager import KVCacheBlocks, KVManager, KVUsage, blocks_for
from harness.serve.metrics import RequestRecord
from harness.serve.requests import Request
from harness.serve.tiered import TieredPrefixManager, TierMoves

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    """vLLM's scheduler knobs (vllm/config/scheduler.py; watermark and preemption_mode are v0's). Their defaults
    here are the only ones: the serving config (harness.serve.config) and the planner (harness.serve.budget)
    read them from this class."""

    max_num_seqs: int = 256  # requests running at once (vLLM's SchedulerConfig default)
    # tokens computed per iteration, prefill and decode together (vLLM V1's online-serving default on a GPU under
    # 70 GiB); also the tokens of the planner's profiling forward, whose activation peak the budget leaves room for
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True  # split a long prompt across iterations; False: a prompt goes whole
    watermark: float = 0.01  # fraction of the pool's blocks left free at admission, headroom for growth (v0's)
    preemption_mode: str = "recompute"  # recompute | swap
    max_model_len: int = 4096  # the most tokens one request may hold, prompt plus output

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ConfigError(f"enable_chunked_prefill: must be true or false, got {self.enable_chunked_prefill!r}")
        if (
            isinstance(self.watermark, bool)
            or not isinstance(self.watermark, int | float)
            or not 0 <= self.watermark < 1
        ):
            raise ConfigError(f"watermark: must be a fraction of blocks in [0, 1), got {self.watermark!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(
                f"preemption_mode: must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # vLLM's own check: without chunking a prompt of max_model_len tokens must fit one iteration
            raise ConfigError(
                f"max_num_batched_tokens: must be >= max_model_len={self.max_model_len} without chunked prefill, "
                f"got {self.max_num_batched_tokens}"
            )


@dataclass
class RequestState:
    """A request's progress inside the scheduler (vLLM's v1 Request)."""

    request: Request
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_output_tokens: int = 0  # tokens sampled so far
    num_preemptions: int = 0
    swapped: bool = False  # preempted by swap: its K/V sits on the host, its computed tokens kept
    first_scheduled_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs so far: what the cache must catch up to."""
        return self.request.prompt_len + self.num_output_tokens


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of an iteration: compute tokens [num_computed_tokens, + num_new_tokens)."""

    request_id: int
    num_computed_tokens: int  # the offset: tokens already cached (prefix hits included), positions start here
    num_new_tokens: int
    is_prefill: bool  # False: a decode step (one token after the request's first output)
    samples_token: bool  # this chunk reaches the request's last token, so its logits give the next token
    blocks: KVCacheBlocks  # the request's blocks after allocation (none for contiguous: one slot)


@dataclass(frozen=True)
class SwapBlocks:
    """One request's blocks copied between the pool and the host (vLLM v0's blocks_to_swap_out / _in): logical[i]
    is the index in its block table of the pool block blocks[i]."""

    request_id: int
    logical: tuple[int, ...]
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class SchedulerOutput:
    """What one forward needs, and the per-iteration row's scheduler columns."""

    now_s: float
    scheduled: tuple[ScheduledRequest, ...]  # running requests first, then those admitted, in that order
    preempted_ids: tuple[int, ...]
    # Preempted by swap (also in preempted_ids): every block it held, to the host before the forward reuses them.
    swap_out: tuple[SwapBlocks, ...]
    # Readmitted after a swap: the blocks to fill from the host before the forward. Only those its readmission
    # took new: a prefix block found cached is another's too and already holds its K/V, and a window's slid-off
    # blocks are not taken again.
    swap_in: tuple[SwapBlocks, ...]
    num_running: int
    num_waiting: int
    kv: KVUsage  # after this iteration's allocation
    # The prefix's tier traffic (harness.serve.tiered): blocks evicted, to copy out, and blocks to load, both before
    # the forward; None without tiers.
    tier_moves: TierMoves | None = None

    @property
    def swapped_out_ids(self) -> tuple[int, ...]:
        return tuple(swap.request_id for swap in self.swap_out)

    @property
    def swapped_in_ids(self) -> tuple[int, ...]:
        return tuple(swap.request_id for swap in self.swap_in)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_prefill)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVManager) -> None:
        self.config, self.kv = config, kv_manager
        self.watermark_blocks = int(config.watermark * kv_manager.num_blocks)  # vLLM v0's rounding
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # admission order: the last is preempted first
        self.states: dict[int, RequestState] = {}

    def add_request(self, request: Request) -> None:
        """Queue a request (FCFS by call order); one that could never run is refused before any work."""
        where = f"request {request.request_id}"
        if request.request_id in self.states:
            raise ConfigError(f"{where}: request_id already queued; ids must be unique")
        if request.prompt_len < 1 or request.output_len < 1:
            raise ConfigError(f"{where}: prompt_len and output_len must be >= 1 token")
        total_tokens = request.prompt_len + request.output_len
        if total_tokens > self.config.max_model_len:
            raise ConfigError(
                f"{where}: prompt_len + output_len = {total_tokens} tokens exceeds max_model_len="
                f"{self.config.max_model_len}"
            )
        # K/V is held for every token but the last sampled one
        held_tokens = total_tokens - 1
        fits = self.kv.fits_alone(
            held_tokens, max_chunk_tokens=self.config.max_num_batched_tokens, watermark_blocks=self.watermark_blocks
        )
        if not fits:
            peak = self.kv.peak_blocks(held_tokens, max_chunk_tokens=self.config.max_num_batched_tokens)
            raise ConfigError(
                f"{where}: a budget too small for one request: it needs {peak} blocks of {self.kv.block_size} "
                f"tokens ({held_tokens} tokens) plus a watermark of {self.watermark_blocks}, the pool has "
                f"{self.kv.num_blocks}"
            )
        state = RequestState(request=request)
        self.states[request.request_id] = state
        self.waiting.append(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, state: RequestState) -> SwapBlocks | None:
        """vLLM's _preempt_request: blocks freed, to the front of the waiting queue. Swap: returns the blocks the
        engine copies to the host (every one it held: a shared prefix block may be evicted before it returns)."""
        rid = state.request.request_id
        logical, blocks = self.kv.get_blocks(rid).held()
        self.kv.free(rid)
        state.num_preemptions += 1
        self.waiting.appendleft(state)
        if self.config.preemption_mode != "swap":
            state.num_computed_tokens = 0
            return None
        state.swapped = True
        return SwapBlocks(rid, logical, blocks)

    def _swap_in(self, state: RequestState, allocated: KVCacheBlocks) -> SwapBlocks:
        """The blocks of a readmitted request to fill from the host: those of its table that this readmission took
        new and that hold tokens it had computed (the rest are for the tokens it computes next)."""
        held = blocks_for(state.num_computed_tokens, self.kv.block_size)
        logical, blocks = allocated.held(start=allocated.first_new, stop=held)
        return SwapBlocks(state.request.request_id, logical, blocks)

    def schedule(self, now_s: float) -> SchedulerOutput:
        token_budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[RequestState, int, int]] = []  # (state, offset, new tokens)
        preempted: list[RequestState] = []
        swap_out: list[SwapBlocks] = []
        swap_in: list[SwapBlocks] = []

        # First the RUNNING requests, in admission order.
        index = 0
        while index < len(self.running) and token_budget > 0:
            state = self.running[index]
            num_new = min(state.num_tokens - state.num_computed_tokens, token_budget)
            preempted_itself = False
            while not preempted_itself and not self.kv.can_allocate(state.request, state.num_computed_tokens + num_new):
                victim = self.running.pop()  # never one already scheduled: those sit before index
                if (swap := self._preempt(victim)) is not None:
                    swap_out.append(swap)
                preempted.append(victim)
                preempted_itself = victim is state
            if preempted_itself:
                break  # it was the last one running: nothing after it to schedule
            self.kv.allocate(state.request, state.num_computed_tokens + num_new)
            scheduled.append((state, state.num_computed_tokens, num_new))
            token_budget -= num_new
            index += 1

        # Then the WAITING ones, FCFS, unless this iteration had to preempt.
        while self.waiting and token_budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            state = self.waiting[0]
            num_computed = state.num_computed_tokens
            if not state.swapped:
                num_computed = self.kv.cached_prefix_tokens(state.request, state.num_tokens)
            num_new = state.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > token_budget:
                break
            num_new = min(num_new, token_budget)
            # num_computed_tokens: the tokens it brings (prefix hits, or all it had computed when swapped out), so
            # that a window's readmission takes no block its window has left
            fits = self.kv.can_allocate(state.request, num_computed + num_new, num_computed_tokens=num_computed,
                                        watermark_blocks=self.watermark_blocks)  # fmt: skip
            if not fits:
                break  # head of line: nobody behind it is admitted either
            allocated = self.kv.allocate(state.request, num_computed + num_new, num_computed_tokens=num_computed)
            self.waiting.popleft()
            self.running.append(state)
            state.num_computed_tokens = num_computed
            if state.swapped:
                swap_in.append(self._swap_in(state, allocated))
                state.swapped = False
            if state.first_scheduled_s is None:
                state.first_scheduled_s = now_s
            scheduled.append((state, num_computed, num_new))
            token_budget -= num_new

        return SchedulerOutput(
            now_s=now_s,
            scheduled=tuple(self._entry(state, offset, num_new) for state, offset, num_new in scheduled),
            preempted_ids=tuple(state.request.request_id for state in preempted),
            swap_out=tuple(swap_out),
            swap_in=tuple(swap_in),
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv=self.kv.usage(),
            tier_moves=self.kv.take_tier_moves() if isinstance(self.kv, TieredPrefixManager) else None,
        )

    def _entry(self, state: RequestState, offset: int, num_new: int) -> ScheduledRequest:
        reaches_end = offset + num_new == state.num_tokens
        return ScheduledRequest(
            request_id=state.request.request_id,
            num_computed_tokens=offset,
            num_new_tokens=num_new,
            is_prefill=not (num_new == 1 and reaches_end and state.num_output_tokens > 0),
            samples_token=reaches_end,
            blocks=self.kv.get_blocks(state.request.request_id),
        )

    def update(self, output: SchedulerOutput, now_s: float) -> list[RequestRecord]:
        """The forward of `output` has run, ending at now_s: advance each request; those that reached output_len
        leave, their blocks back in the pool. Returns their records."""
        finished = []
        for entry in output.scheduled:
            state = self.states[entry.request_id]
            state.num_computed_tokens += entry.num_new_tokens
            if not entry.samples_token:
                continue
            state.num_output_tokens += 1
            state.token_times_s.append(now_s)
            if state.num_output_tokens == state.request.output_len:
                finished.append(self._finish(state, now_s))
        return finished

    def _finish(self, state: RequestState, now_s: float) -> RequestRecord:
        rid = state.request.request_id
        self.running.remove(state)
        self.kv.free(rid)
        del self.states[rid]
        return RequestRecord(
            request_id=str(rid),
            arrival_s=state.request.arrival_s,
            first_scheduled_s=state.first_scheduled_s,
            token_times_s=tuple(state.token_times_s),
            finished_s=now_s,
            prompt_len=state.request.prompt_len,
            prefix_hit_tokens=self.kv.prefix_hit_tokens(rid),
            preemptions=state.num_preemptions,
        )


@dataclass(frozen=True)
class Simulation:
    records: list[RequestRecord]  # in finishing order
    iterations: list[SchedulerOutput]


def simulate(
    requests: Iterable[Request], scheduler: Scheduler, step_time_fn: Callable[[SchedulerOutput], float]
) -> Simulation:
    """Run the scheduler on a synthetic clock: each iteration lasts step_time_fn(output) seconds (> 0), requests
    join when the clock passes their arrival_s, and an idle engine jumps to the next arrival. No model, so that
    thousands of requests (and the planner's concurrency) can be checked in a test."""
    pending = deque(sorted(requests, key=lambda request: request.arrival_s))
    now_s, records, iterations = 0.0, [], []
    while pending or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            now_s = max(now_s, pending[0].arrival_s)
        while pending and pending[0].arrival_s <= now_s:
            scheduler.add_request(pending.popleft())
        output = scheduler.schedule(now_s)
        if not output.scheduled:
            raise RuntimeError(f"scheduler stalled at {now_s:.6f} s: nothing scheduled, {output.num_waiting} waiting")
        step_s = step_time_fn(output)
        if not step_s > 0:
            raise ConfigError(f"step_time_fn: must return seconds > 0, got {step_s!r}")
        now_s += step_s
        iterations.append(output)
        records += scheduler.update(output, now_s)
    return Simulation(records=records, iterations=iterations)
