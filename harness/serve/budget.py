"""The planner's answer for a serving setup: how large the KV budget is, how many blocks it holds, and how many
requests of a length mix each strategy runs at once in it. These are predictions (the `predicted_` fields): a
serving run's measured maximum concurrency is checked against them (issue #16, item 7).

The budget is sized as vLLM sizes it (below: kv_budget), from the planner's own terms (harness.analytic.ledger and
harness.analytic.activations): nothing here re-derives KV bytes per token. Then each strategy is a pool of units:

    paged, prefix   blocks of block_size tokens, taken as a request grows, returned when it ends
                    (a harness.kv.paged.PagedLayout); a prefix cache holds the shared prefix's whole blocks once
    contiguous, sliding, ...
                    slots, one per running request, each reserved whole at admission and sized for the longest
                    request a slot may hold: the strategy's allocation for one sequence of max_model_len tokens
                    (contiguous: max_model_len tokens; sliding: its ring of min(window, max_model_len) tokens, flat
                    in length beyond the window), as these caches allocate one max_tokens for the whole batch

Also the fleet formulas of the saturation sweep (item 8, `mode=fleet`): replicas_needed and concurrency_needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harness.analytic.activations import forward_bytes
from harness.analytic.ledger import buffers_bytes, weights_bytes
from harness.analytic.runtime import GiB, default_runtime_overhead_bytes, detected_memory_bytes, free_memory_bytes
from harness.config import Workload, device_type
from harness.errors import ConfigError
from harness.formats import TOKEN_ID_BYTES
from harness.kv.base import blocks_for
from harness.kv.paged import PagedLayout
from harness.serve.requests import Request
from harness.serve.scheduler import SchedulerConfig

# The scheduler's caps, at its defaults (vLLM's: harness.serve.scheduler.SchedulerConfig), and the tokens of the
# profiling forward whose activation peak the budget leaves room for.
MAX_NUM_SEQS = SchedulerConfig.max_num_seqs
MAX_NUM_BATCHED_TOKENS = SchedulerConfig.max_num_batched_tokens
# Free blocks an admission must leave: vLLM's BlockSpaceManager watermark (0.01 of the blocks), which keeps the
# running requests' next blocks from being taken by an arrival and so avoids preempting at once.
WATERMARK = SchedulerConfig.watermark


# --- the budget ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVBudget:
    """The KV budget in bytes and, when it came from gpu_memory_utilization, the terms subtracted to get it."""

    source: str  # "kv_memory_gb" or "gpu_memory_utilization": the knob it was sized from
    kv_bytes: int  # what the KV pool may hold
    memory_bytes: int | None = None  # the device's total memory; None for kv_memory_gb
    requested_bytes: int | None = None  # ceil(gpu_memory_utilization × memory_bytes): what the process may use
    weights_bytes: int | None = None
    buffers_bytes: int | None = None  # RoPE tables for max_model_len positions
    activation_bytes: int | None = None  # the peak of one forward of max_num_batched_tokens tokens
    runtime_overhead_bytes: int | None = None  # CUDA context and workspaces (harness.analytic.runtime)


def profile_forward_bytes(workload: Workload, *, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Peak activation bytes of vLLM's profiling forward: max_num_batched_tokens tokens spread evenly over
    min(max_num_batched_tokens, max_num_seqs) fresh sequences (gpu_model_runner.py, profile_run -> _dummy_run),
    each attending to its own tokens; plus their int64 ids. The planner's forward_bytes (the strategy's write
    transients included), rounded up to whole tokens per sequence."""
    n_seqs = min(max_num_batched_tokens, max_num_seqs)
    n_new = math.ceil(max_num_batched_tokens / n_seqs)
    return TOKEN_ID_BYTES * n_seqs * n_new + forward_bytes(workload, n_seqs=n_seqs, n_new=n_new, n_keys=n_new)


def kv_budget(
    workload: Workload,
    *,
    max_model_len: int,
    kv_memory_gb: float | None = None,
    gpu_memory_utilization: float | None = None,
    memory_gb: float | None = None,
    device: str = "auto",
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = MAX_NUM_SEQS,
    runtime_overhead_bytes: int | None = None,
) -> KVBudget:
    """The KV budget of `workload` (its model, formats and strategy; its lengths and batch are not read), from
    exactly one of kv_memory_gb (GiB of KV, as vLLM's kv_cache_memory_bytes: no profiling) or gpu_memory_utilization
    (the fraction of the device's memory the process may use, memory_gb or the detected device's):

        budget = ceil(utilization × memory) − weights − model buffers − activations − runtime overhead

    vLLM's determine_available_memory (vllm/v1/worker/gpu_worker.py): available_kv_cache_memory_bytes =
    requested_memory − non_kv_cache_memory, where requested_memory = ceil(total × gpu_memory_utilization)
    (vllm/v1/worker/utils.py) and non_kv_cache_memory = weights + the torch peak increase of the profiling forward
    + the non-torch increase (vllm/utils/mem_utils.py, memory_profiling). Here each is the planner's figure, not a
    measurement: weights_bytes, buffers_bytes at max_model_len positions, profile_forward_bytes, and the runtime
    overhead (measured, or as given). Not counted, as vLLM does not by default: CUDA graphs' pools; nor the
    read-back transients of a decode step over long contexts (vLLM's kernels read in place; a CPU gather does not).

    A budget that cannot hold one request of max_model_len tokens is a one-line ConfigError, as vLLM's
    check_enough_kv_cache_memory (vllm/v1/core/kv_cache_utils.py) refuses to start.
    """
    if (kv_memory_gb is None) == (gpu_memory_utilization is None):
        given = "both" if kv_memory_gb is not None else "neither"
        raise ConfigError(
            "kv_memory_gb, gpu_memory_utilization: give exactly one (kv_memory_gb: GiB of KV > 0; "
            f"gpu_memory_utilization: a fraction of the device's memory in (0, 1]), got {given}"
        )
    pool = _pool(workload, max_model_len=max_model_len)
    _check_int("max_num_batched_tokens", max_num_batched_tokens, low=1)
    _check_int("max_num_seqs", max_num_seqs, low=1)
    if kv_memory_gb is not None:
        if not _is_number(kv_memory_gb) or not 0 < kv_memory_gb < math.inf:
            raise ConfigError(f"kv_memory_gb: must be a number of GiB > 0, got {kv_memory_gb!r}")
        budget = KVBudget(source="kv_memory_gb", kv_bytes=int(kv_memory_gb * GiB))
    else:
        if not _is_number(gpu_memory_utilization) or not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization!r}")
        if memory_gb is not None and (not _is_number(memory_gb) or not 0 < memory_gb < math.inf):
            raise ConfigError(f"memory_gb: must be a number of GiB > 0, or null (the device's), got {memory_gb!r}")
        device = device_type(device)
        memory = detected_memory_bytes(device) if memory_gb is None else int(memory_gb * GiB)
        if runtime_overhead_bytes is None:
            runtime_overhead_bytes = default_runtime_overhead_bytes(device, workload)
        _check_int("runtime_overhead_bytes", runtime_overhead_bytes, low=0)
        args = workload.model_args()
        terms = dict(
            weights_bytes=weights_bytes(args, workload.dtype),
            buffers_bytes=buffers_bytes(args, max_model_len),
            activation_bytes=profile_forward_bytes(
                workload, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs
            ),
            runtime_overhead_bytes=runtime_overhead_bytes,
        )
        requested = math.ceil(gpu_memory_utilization * memory)
        kv_bytes = requested - sum(terms.values())
        if kv_bytes <= 0:
            raise ConfigError(
                f"gpu_memory_utilization: {gpu_memory_utilization} of {memory / GiB:.3g} GiB is {requested / GiB:.3g} "
                f"GiB, not more than {args.name}'s weights, buffers, runtime and the activations of "
                f"{max_num_batched_tokens} batched tokens ({sum(terms.values()) / GiB:.3g} GiB): raise it, or lower "
                "max_num_batched_tokens"
            )
        budget = KVBudget(
            source="gpu_memory_utilization", kv_bytes=kv_bytes, memory_bytes=memory, requested_bytes=requested, **terms
        )
    one = _one_request(workload, prompt_len=max_model_len - 1, output_len=1, prefix_len=0)
    _check_holds_one(pool, budget.kv_bytes, _units_of(pool, one)[1], tokens=max_model_len, field=budget.source)
    return budget


def check_pool_fits(pool_bytes: int, *, field: str, device: str, free_bytes: int | None = None) -> None:
    """A KV pool of `pool_bytes` must fit in what `device` has free now (harness.analytic.runtime.free_memory_bytes,
    or `free_bytes` as given): else a one-line ConfigError naming `field` and both figures, before the pool is
    allocated. vLLM refuses the same way at start (its gpu_worker checks the requested memory against the free
    memory, "Free memory on device ... is less than desired GPU memory utilization"); a CPU pool larger than the
    host's memory would otherwise be grown page by page until the kernel's OOM killer ends the process, and may
    take others on the host with it."""
    free = free_memory_bytes(device_type(device)) if free_bytes is None else free_bytes
    if pool_bytes > free:
        where = "free device memory (cudaMemGetInfo)" if device_type(device) == "cuda" else "available host memory"
        raise ConfigError(
            f"{field}: a KV pool of {_gib(pool_bytes)} GiB is more than the {_gib(free)} GiB of {where} here now; "
            "allowed: a pool smaller than that"
        )


def _gib(n_bytes: int) -> str:
    gib = n_bytes / GiB
    return f"{gib:.3g}" if gib < 1000 else f"{gib:,.0f}"  # 0.0625, 22.4, 100,000


def kv_budget_bytes(workload: Workload, **knobs) -> int:
    """kv_budget(workload, **knobs).kv_bytes: the bytes the KV pool may hold."""
    return kv_budget(workload, **knobs).kv_bytes


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
class _Pool:
    paged: bool  # blocks taken as a request grows; else a slot per request, reserved whole at admission
    unit_tokens: int  # block_size, or the max_model_len a slot is sized for
    bytes_per_unit: int

    @property
    def unit(self) -> str:
        return "block" if self.paged else "slot"


def _one_request(workload: Workload, *, prompt_len: int, output_len: int, prefix_len: int) -> Workload:
    cache = {key: value for key, value in workload.cache.items() if key != "pool_tokens"}  # sized by the budget
    return workload.workload(
        cache=cache, batch_size=1, prompt_len=prompt_len, gen_len=output_len, prefix_len=prefix_len
    )


def _pool(workload: Workload, *, max_model_len: int) -> _Pool:
    _check_int("max_model_len", max_model_len, low=2)
    positions = workload.model_args().max_seq_len
    if max_model_len > positions:
        raise ConfigError(f"max_model_len: must be at most the model's {positions} positions, got {max_model_len}")
    layout = workload.layout()
    if layout.recomputes_prefix:
        raise ConfigError(f"cache: {workload.cache_name} keeps no KV to serve from; allowed: a caching strategy")
    if isinstance(layout, PagedLayout):
        return _Pool(True, layout.options.block_size, bytes_per_block(workload))
    slot = _one_request(workload, prompt_len=max_model_len - 1, output_len=1, prefix_len=0)
    allocation = layout.allocation(slot.kv_shape())
    return _Pool(False, max_model_len, allocation.total_bytes - allocation.host_bytes)


def _units_of(pool: _Pool, w: Workload) -> tuple[int, int, int]:
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


def _check_holds_one(pool: _Pool, budget_bytes: int, units_needed: int, *, tokens: int, field: str) -> None:
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

    A slot strategy reserves one whole slot per request at admission, so both figures are floor(budget / slot)
    (contiguous: max_model_len × kv_bytes_per_token), capped by max_num_seqs and the mix. A budget that cannot hold
    the mix's longest request alone is a one-line ConfigError.
    """
    _check_int("kv_budget_bytes", kv_budget_bytes, low=1)
    pool = _pool(workload, max_model_len=max_model_len)
    _check_int("max_num_seqs", max_num_seqs, low=1)
    if not _is_number(watermark) or not 0 <= watermark < 1:
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
    by_shape: dict[tuple[int, int, int], tuple[int, int, int]] = {}  # (prompt, output, prefix) -> units
    for request in requests:
        shape = (request.prompt_len, request.output_len, request.prefix_len)
        if shape not in by_shape:
            one = _one_request(workload, prompt_len=shape[0], output_len=shape[1], prefix_len=shape[2])
            by_shape[shape] = _units_of(pool, one)
    units = np.array([by_shape[(r.prompt_len, r.output_len, r.prefix_len)] for r in requests], dtype=np.int64)
    admitted, peak, shared = units[:, 0], units[:, 1], int(units[:, 2].max())
    num_units = kv_budget_bytes // pool.bytes_per_unit
    _check_holds_one(pool, kv_budget_bytes, shared + int(peak.max()), tokens=max(totals), field="kv_budget_bytes")
    reserve = int(watermark * num_units) if pool.paged else 0  # vLLM V0: int(watermark × num_gpu_blocks)
    by_kv = int(np.searchsorted(shared + np.cumsum(admitted), num_units - reserve, side="right"))
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


# --- the fleet: the seed's concurrency formula ----------------------------------------------------------------


def replicas_needed(target_qps: float, per_replica_max_qps: float) -> int:
    """Replicas that serve target_qps when one serves per_replica_max_qps within the SLO (the saturation sweep's
    knee): ceil(target / per_replica), each replica loaded at or below its knee. The ratio is rounded to 9 decimals
    first, so that float noise (2.1 / 0.3 = 7.000000000000001) does not add a replica."""
    for name, value in (("target_qps", target_qps), ("per_replica_max_qps", per_replica_max_qps)):
        if not _is_number(value) or not 0 < value < math.inf:
            raise ConfigError(f"{name}: must be a finite number of requests/s > 0, got {value!r}")
    return math.ceil(round(target_qps / per_replica_max_qps, 9))


def concurrency_needed(qps: float, mean_e2e_s: float) -> float:
    """Requests in flight at once, on average, when requests arrive at qps and each stays mean_e2e_s (arrival to
    last token): Little's law, L = λ W (Little 1961), true of any stable system in steady state whatever the
    distributions. The mean only: the peak a server must hold is above it, by the arrivals' burstiness."""
    if not _is_number(qps) or not 0 < qps < math.inf:
        raise ConfigError(f"qps: must be a finite number of requests/s > 0, got {qps!r}")
    if not _is_number(mean_e2e_s) or not 0 < mean_e2e_s < math.inf:
        raise ConfigError(f"mean_e2e_s: must be a finite number of seconds > 0, got {mean_e2e_s!r}")
    return qps * mean_e2e_s


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(name: str, value: object, *, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name}: must be an integer >= {low}, got {value!r}")
