"""How many requests of a mix a strategy runs at once in a KV budget (the planner's `predicted_` concurrency), and
the pools of blocks or slots it counts them in. A serving run's measured maximum concurrency is checked against it
(issue #16, item 7); the budget itself is harness.serve.budget's.

Each strategy is a pool of units:

    paged, prefix   blocks of block_size tokens, taken as a request grows, returned when it ends
                    (a harness.kv.paged.PagedLayout); a prefix cache holds the shared prefix's whole blocks once
    contiguous, ... slots, one per running request, each reserved whole at admission and sized for the longest
                    request a slot may hold: the strategy's allocation for one sequence of max_model_len tokens
    sliding, ...    blocks of its serving pool (its Serving.storage's layout prices one), a request's counts asked
                    of the serving KV manager itself (harness.serve.kv_manager.KVManager: admission_blocks,
                    peak_blocks), since that manager caps what a request holds (Serving.caps_blocks: a window frees
                    the blocks it has left), which no static layout models. Without a manager given, the static
                    layout's answer (sliding: a ring of min(window, max_model_len) tokens per request, as a slot).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harness.analytic.runtime import GiB
from harness.config import Workload
from harness.errors import ConfigError
from harness.kv.base import blocks_for
from harness.kv.paged import PagedLayout
from harness.serve.kv_manager import KVManager, serving
from harness.serve.requests import Request
from harness.serve.scheduler import SchedulerConfig

# The scheduler's caps, at its defaults (vLLM's: harness.serve.scheduler.SchedulerConfig).
MAX_NUM_SEQS = SchedulerConfig.max_num_seqs
MAX_NUM_BATCHED_TOKENS = SchedulerConfig.max_num_batched_tokens
# Free blocks an admission must leave: vLLM's BlockSpaceManager watermark (0.01 of the blocks), which keeps the
# running requests' next blocks from being taken by an arrival and so avoids preempting at once.
WATERMARK = SchedulerConfig.watermark


# --- pools of blocks or slots ---------------------------------------------------------------------------------


def bytes_per_block(workload: Workload) -> int:
    """Bytes of one block of `workload`'s paged strategy at its kv_dtype and block_size: the strategy's allocation
    for a pool of one block (harness.kv.paged.PagedLayout.allocation), K and V over all layers, scales included.
    bf16: block_size × kv_bytes_per_token; fp8/int8 likewise with their fp32 scale per token and head; int4 with
    its group scales in the block's rows (a key group longer than the block keeps its row in its first block,
    so a block smaller than kv_group_size costs more than its tokens' share). int4's full-precision tail is per
    request, not per block (predict_concurrency adds it to each request)."""
    layout = workload.layout()
    if not isinstance(layout, PagedLayout):
        raise ConfigError(f"cache: {workload.cache_name} has no blocks; allowed: a paged strategy (paged, prefix)")
    block_size = layout.options.block_size
    one_block = workload.workload(
        cache={**workload.cache, "pool_tokens": block_size}, batch_size=1, prompt_len=1, gen_len=1, prefix_len=0
    )
    allocation = one_block.layout().allocation(one_block.kv_shape())
    return allocation.data_bytes + allocation.scale_bytes


@dataclass(frozen=True)
class Pool:
    paged: bool  # blocks taken as a request grows; else a slot per request, reserved whole at admission
    unit_tokens: int  # block_size, or the max_model_len a slot is sized for
    bytes_per_unit: int

    @property
    def unit(self) -> str:
        return "block" if self.paged else "slot"


def one_request(workload: Workload, *, prompt_len: int, output_len: int, prefix_len: int) -> Workload:
    cache = {key: value for key, value in workload.cache.items() if key != "pool_tokens"}  # sized by the budget
    return workload.workload(
        cache=cache, batch_size=1, prompt_len=prompt_len, gen_len=output_len, prefix_len=prefix_len
    )


def pool_of(workload: Workload, *, max_model_len: int) -> Pool:
    check_int("max_model_len", max_model_len, low=2)
    positions = workload.model_args().max_seq_len
    if max_model_len > positions:
        raise ConfigError(f"max_model_len: must be at most the model's {positions} positions, got {max_model_len}")
    layout = workload.layout()
    if layout.recomputes_prefix:
        raise ConfigError(f"cache: {workload.cache_name} keeps no KV to serve from; allowed: a caching strategy")
    if isinstance(layout, PagedLayout):
        return Pool(True, layout.options.block_size, bytes_per_block(workload))
    slot = one_request(workload, prompt_len=max_model_len - 1, output_len=1, prefix_len=0)
    allocation = layout.allocation(slot.kv_shape())
    return Pool(False, max_model_len, allocation.total_bytes - allocation.host_bytes)


def units_of(pool: Pool, w: Workload) -> tuple[int, int, int]:
    """(units at admission, units at its peak, shared units held once) of the one request `w` describes. A block
    request takes its prompt's blocks to be admitted and its whole length's at its peak, its shared prefix's whole
    blocks excluded, plus int4's per-request tail rounded up to blocks; a slot request takes one slot throughout."""
    if not pool.paged:
        return 1, 1, 0
    layout, shape = w.layout(), w.kv_shape()
    shared = layout.shared_blocks(shape)
    tail = math.ceil(layout.allocation(shape).tail_bytes / pool.bytes_per_unit)
    admitted = blocks_for(w.prompt_len, pool.unit_tokens) - shared + tail
    return admitted, layout.blocks_needed(shape) - shared + tail, shared


def check_holds_one(pool: Pool, budget_bytes: int, units_needed: int, *, tokens: int, field: str) -> None:
    units = budget_bytes // pool.bytes_per_unit
    if units < units_needed:
        raise ConfigError(
            f"{field}: {budget_bytes / GiB:.3g} GiB holds {units} {pool.unit}s of {pool.unit_tokens} tokens; one "
            f"request of {tokens} tokens needs {units_needed}: raise it or lower max_model_len"
        )


# --- predicted concurrency ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PredictedConcurrency:
    """One strategy's predicted concurrency for a request mix at a KV budget: the inputs, the pool, the figures."""

    cache: str
    kv_dtype: str
    kv_budget_bytes: int
    max_model_len: int
    max_num_seqs: int
    num_requests: int
    mean_total_len: float  # tokens, prompt + output, over the mix
    unit: str  # "block" (taken as a request grows) or "slot" (one per request, sized for max_model_len)
    unit_tokens: int  # block_size, or max_model_len
    bytes_per_unit: int
    num_units: int  # kv_budget_bytes // bytes_per_unit
    shared_units: int  # a prefix cache's shared blocks, held once
    predicted_max_running: int  # most requests running at once when all arrive at once (qps=inf)
    predicted_max_running_at_peak: int  # most that fit with every one at its full length: never a preemption
    limited_by: str  # what bounds predicted_max_running: "kv", "max_num_seqs" or "requests" (all of them fit)


def predict_concurrency(
    workload: Workload,
    requests: Sequence[Request],
    *,
    kv_budget_bytes: int,
    max_model_len: int,
    max_num_seqs: int = MAX_NUM_SEQS,
    watermark: float = WATERMARK,
    kv_manager: KVManager | None = None,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
) -> PredictedConcurrency:
    """How many of `requests` (FCFS, in their order) `workload`'s strategy runs at once in kv_budget_bytes.

    The model is that of the engine the measurement runs (issue #16, item 2): FCFS admission when the pool has the
    prompt's blocks and leaves `watermark` of them free, blocks taken as a request grows, preemption by recompute
    when the pool runs out. With every request waiting at t = 0 (qps=inf), admission takes requests in order until
    the next one's prompt does not fit, before their decodes have grown: that first burst is the most ever running,
    since the decodes then grow into the pool and preempt until the running ones fit at their peak. So

        predicted_max_running          the largest k <= max_num_seqs with
                                       shared + Σ_{i<k} prompt_blocks_i <= num_blocks − watermark·num_blocks
        predicted_max_running_at_peak  the largest k <= max_num_seqs with shared + Σ_{i<k} peak_blocks_i <= num_blocks

    peak_blocks_i = ceil((prompt_len_i + output_len_i) / block_size), a prefix cache's shared whole blocks counted
    once (`shared`), int4's tail rounded up to blocks. For a fixed mix the second is floor((num_blocks − shared) /
    peak_blocks), the count that runs with no preemption: the figure to match for an engine that reserves a
    request's whole length at admission. The prefix sums use the mix as given (not a mean of ceil(len / bs)): the
    burst is those first requests, so a seeded mix has one exact answer. Why not Little's law's mean occupancy
    (blocks held over a request's life, about (prompt + output / 2) / bs each): it describes a steady state of
    staggered requests at a finite rate, which a burst at qps=inf never reaches. Error of the burst figure: the
    decodes that start while later prompts are still prefilling (chunked under max_num_batched_tokens) hold ~R/2
    tokens more each, R the ramp's iterations: a few percent while R is well under block_size.

    A request whose serving manager caps what it holds (its strategy's Serving.caps_blocks, `kv_manager` given:
    the run's own, num_blocks of its storage's blocks) may shrink once admitted: a window frees the blocks its
    decodes have left. Its counts are the manager's, through the KVManager protocol: admitted_i =
    admission_blocks(prompt_len_i) (its first chunk's, as the scheduler's admission takes them), decode_i =
    peak_blocks(held_i, max_chunk_tokens=1) (the most it holds while decoding: a window's ceil(W / bs) + 1) and
    peak_i = peak_blocks(held_i, max_chunk_tokens=max_num_batched_tokens), held_i = prompt + output − 1 (the last
    token sampled holds no K/V). The requests admitted before request k then hold min(admitted_i, decode_i) each
    once their prefill is done (a request that grows past its admission holds its admission at the burst, as above),
    so the first refused admission is the first k with

        shared + Σ_{i<k} min(admitted_i, decode_i) + admitted_k > num_blocks − watermark·num_blocks

    which is the burst above whenever no request shrinks (paged: decode_i >= admitted_i). Error: a window's decodes
    hold decode_i or one block fewer as they cross block boundaries (ceil(W / bs) + 1 most of the time when W is a
    multiple of bs; about half the time otherwise, ~1 / (2·decode_i) fewer held), and the requests admitted in the
    same iteration as k still hold their whole first chunk. Not modelled: a ramp that outlasts the requests. Each
    iteration admits at most max_num_batched_tokens / prompt_len of them, so where the pool's bound needs more
    iterations of admissions than a request lives (a small window, long prompts, a small max_num_batched_tokens),
    fewer run at once than predicted (the scheduler at 600 requests of ~600 prompt and ~64 output tokens, window
    64, 512 tokens per iteration: 60 against 265 predicted; ~1% apart at 2048 tokens and ~192-token prompts).

    A slot strategy reserves one whole slot per request at admission, so both figures are floor(budget / slot)
    (contiguous: max_model_len × kv_bytes_per_token), capped by max_num_seqs and the mix. A budget that cannot hold
    the mix's longest request alone is a one-line ConfigError.
    """
    check_int("kv_budget_bytes", kv_budget_bytes, low=1)
    check_int("max_num_seqs", max_num_seqs, low=1)
    check_int("max_num_batched_tokens", max_num_batched_tokens, low=1)
    if not is_number(watermark) or not 0 <= watermark < 1:
        raise ConfigError(f"watermark: must be a fraction of the blocks in [0, 1), got {watermark!r}")
    if not requests:
        raise ConfigError("requests: the mix is empty; allowed: one request or more")
    totals = [request.prompt_len + request.output_len for request in requests]
    longest = int(np.argmax(totals))
    if totals[longest] > max_model_len:
        raise ConfigError(
            f"requests: request {requests[longest].request_id} holds {totals[longest]} tokens, over "
            f"max_model_len={max_model_len}"
        )
    by_manager = kv_manager is not None and serving(workload.cache_name).caps_blocks
    if by_manager:
        pool, units = _manager_units(workload, requests, kv_manager, max_model_len=max_model_len,
                                     max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
    else:
        pool, units = _layout_units(workload, requests, max_model_len=max_model_len)
    admitted, peak, decode, shared = units[:, 0], units[:, 1], units[:, 2], int(units[:, 3].max())
    num_units = kv_budget_bytes // pool.bytes_per_unit
    if by_manager and num_units != kv_manager.num_blocks:
        raise ValueError(f"kv_manager: {kv_manager.num_blocks} blocks, but the budget holds {num_units}")
    check_holds_one(pool, kv_budget_bytes, shared + int(peak.max()), tokens=max(totals), field="kv_budget_bytes")
    reserve = int(watermark * num_units) if pool.paged else 0  # vLLM V0: int(watermark × num_gpu_blocks)
    # What the pool holds when request k is admitted: those before it past their prefill, then k's first chunk.
    before = np.concatenate(([0], np.cumsum(np.minimum(admitted, decode))[:-1]))
    refused = np.flatnonzero(shared + before + admitted > num_units - reserve)
    by_kv = int(refused[0]) if refused.size else len(requests)
    at_peak = int(np.searchsorted(shared + np.cumsum(peak), num_units, side="right"))
    running = min(by_kv, max_num_seqs)
    if running == len(requests):
        limited_by = "requests"
    elif running == max_num_seqs:
        limited_by = "max_num_seqs"
    else:
        limited_by = "kv"
    return PredictedConcurrency(
        cache=workload.cache_name,
        kv_dtype=workload.kv_dtype_name,
        kv_budget_bytes=kv_budget_bytes,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        num_requests=len(requests),
        mean_total_len=float(np.mean(totals)),
        unit=pool.unit,
        unit_tokens=pool.unit_tokens,
        bytes_per_unit=pool.bytes_per_unit,
        num_units=num_units,
        shared_units=shared,
        predicted_max_running=running,
        predicted_max_running_at_peak=min(at_peak, max_num_seqs),
        limited_by=limited_by,
    )


def _layout_units(workload: Workload, requests: Sequence[Request], *, max_model_len: int) -> tuple[Pool, np.ndarray]:
    """The pool and [n, 4] (admitted, peak, decode, shared) units per request from the strategy's own layout; a
    request never holds less than its admission, so decode is its peak."""
    pool = pool_of(workload, max_model_len=max_model_len)
    by_shape: dict[tuple[int, int, int], tuple[int, int, int]] = {}  # (prompt, output, prefix) -> units
    for request in requests:
        shape = (request.prompt_len, request.output_len, request.prefix_len)
        if shape not in by_shape:
            one = one_request(workload, prompt_len=shape[0], output_len=shape[1], prefix_len=shape[2])
            by_shape[shape] = units_of(pool, one)
    rows = [by_shape[(r.prompt_len, r.output_len, r.prefix_len)] for r in requests]
    return pool, np.array([(a, p, p, s) for a, p, s in rows], dtype=np.int64)


def _manager_units(
    workload: Workload, requests: Sequence[Request], kv: KVManager, *, max_model_len: int, max_num_batched_tokens: int
) -> tuple[Pool, np.ndarray]:
    """The pool (a block of the strategy's serving storage, priced by its layout at the workload's kv_dtype) and
    [n, 4] (admitted, peak, decode, shared = 0) blocks per request, each asked of the serving manager `kv`."""
    # A budgeted strategy's own serving cache is a paged pool too (harness.kv.evict_paged: its positions and scores
    # beside the blocks are bookkeeping, not priced), as harness.serve.run.plan sizes every blocks pool.
    storage = serving(workload.cache_name).storage or "paged"
    priced = workload.workload(cache={"name": storage, "block_size": kv.block_size})
    pool = pool_of(priced, max_model_len=max_model_len)
    if not pool.paged:
        raise ConfigError(f"cache: {workload.cache_name} serves from {storage}, which has no blocks")
    rows = []
    for request in requests:
        held = request.prompt_len + request.output_len - 1  # the last token sampled holds no K/V
        rows.append((
            kv.admission_blocks(request.prompt_len, max_chunk_tokens=max_num_batched_tokens),
            kv.peak_blocks(held, max_chunk_tokens=max_num_batched_tokens),
            kv.peak_blocks(held, max_chunk_tokens=1),
            0,
        ))  # fmt: skip
    return pool, np.array(rows, dtype=np.int64)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_int(name: str, value: object, *, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name}: must be an integer >= {low}, got {value!r}")
