"""The planner's answer for a serving setup: how large the KV budget is (kv_budget, as vLLM sizes it) and whether
the pool fits the device now; how many requests of a mix each strategy runs at once in it is
harness.serve.concurrency's (predict_concurrency, the `predicted_` fields, which a serving run's measured maximum
concurrency is checked against: issue #16, item 7).

The budget comes from the planner's own terms (harness.analytic.ledger and harness.analytic.activations): nothing
here re-derives KV bytes per token.

Also the fleet formulas of the saturation sweep (item 8, `mode=fleet`): replicas_needed and concurrency_needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.analytic.activations import forward_bytes
from harness.analytic.ledger import buffers_bytes, weights_bytes
from harness.analytic.runtime import GiB, default_runtime_overhead_bytes, detected_memory_bytes, free_memory_bytes
from harness.config import Workload, device_type
from harness.errors import ConfigError
from harness.formats import TOKEN_ID_BYTES
from harness.serve.concurrency import (  # noqa: F401  (bytes_per_block: run.py and the tests import it here)
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    bytes_per_block,
    check_holds_one,
    check_int,
    is_number,
    one_request,
    pool_of,
    units_of,
)

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


def profile_forward_bytes(
    workload: Workload, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int | None = None
) -> int:
    """Peak activation bytes of vLLM's profiling forward: max_num_batched_tokens tokens spread evenly over
    min(max_num_batched_tokens, max_num_seqs) fresh sequences (gpu_model_runner.py, profile_run -> _dummy_run),
    each attending to its own tokens; plus their int64 ids. The planner's forward_bytes (the strategy's write
    transients included), rounded up to whole tokens per sequence.

    attn_impl=eager (max_model_len given): also the serving forwards whose score matrices are largest, counted as
    the static path counts a forward (harness.analytic.activations.forward_bytes: eager's scores, fp32 softmax and
    probabilities [.., q, keys] per layer, and its masks), whichever peaks higher: the largest prefill chunk,
    min(max_num_batched_tokens, max_model_len − 1) queries of one sequence over max_model_len − 1 keys, and the
    decode batch, min(max_num_seqs, max_num_batched_tokens) queries over max_model_len − 1 keys each (the gather
    pads every decode to the longest, harness.kv.varlen). vLLM's profile run needs neither: its kernels never
    hold the scores. The read-back of those keys is left out as it is for sdpa (see kv_budget)."""
    n_seqs = min(max_num_batched_tokens, max_num_seqs)
    n_new = math.ceil(max_num_batched_tokens / n_seqs)
    peak = TOKEN_ID_BYTES * n_seqs * n_new + forward_bytes(workload, n_seqs=n_seqs, n_new=n_new, n_keys=n_new)
    if workload.attn_impl != "eager" or max_model_len is None:
        return peak
    keys = max_model_len - 1  # the last token sampled is never computed: at most max_model_len − 1 keys
    chunk = min(max_num_batched_tokens, keys)
    largest = max(
        TOKEN_ID_BYTES * chunk + forward_bytes(workload, n_seqs=1, n_new=chunk, n_keys=keys, read_back=False),
        TOKEN_ID_BYTES * n_seqs + forward_bytes(workload, n_seqs=n_seqs, n_new=1, n_keys=keys, read_back=False),
    )
    return max(peak, largest)


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
    pool = pool_of(workload, max_model_len=max_model_len)
    check_int("max_num_batched_tokens", max_num_batched_tokens, low=1)
    check_int("max_num_seqs", max_num_seqs, low=1)
    if kv_memory_gb is not None:
        if not is_number(kv_memory_gb) or not 0 < kv_memory_gb < math.inf:
            raise ConfigError(f"kv_memory_gb: must be a number of GiB > 0, got {kv_memory_gb!r}")
        budget = KVBudget(source="kv_memory_gb", kv_bytes=int(kv_memory_gb * GiB))
    else:
        if not is_number(gpu_memory_utilization) or not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization!r}")
        if memory_gb is not None and (not is_number(memory_gb) or not 0 < memory_gb < math.inf):
            raise ConfigError(f"memory_gb: must be a number of GiB > 0, or null (the device's), got {memory_gb!r}")
        device = device_type(device)
        memory = detected_memory_bytes(device) if memory_gb is None else int(memory_gb * GiB)
        if runtime_overhead_bytes is None:
            runtime_overhead_bytes = default_runtime_overhead_bytes(device, workload)
        check_int("runtime_overhead_bytes", runtime_overhead_bytes, low=0)
        args = workload.model_args()
        terms = dict(
            weights_bytes=weights_bytes(args, workload.dtype),
            buffers_bytes=buffers_bytes(args, max_model_len),
            activation_bytes=profile_forward_bytes(
                workload,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
            ),  # fmt: skip
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
    one = one_request(workload, prompt_len=max_model_len - 1, output_len=1, prefix_len=0)
    check_holds_one(pool, budget.kv_bytes, units_of(pool, one)[1], tokens=max_model_len, field=budget.source)
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


# --- the fleet: the seed's concurrency formula ----------------------------------------------------------------


def replicas_needed(target_qps: float, per_replica_max_qps: float) -> int:
    """Replicas that serve target_qps when one serves per_replica_max_qps within the SLO (the saturation sweep's
    knee): ceil(target / per_replica), each replica loaded at or below its knee. The ratio is rounded to 9 decimals
    first, so that float noise (2.1 / 0.3 = 7.000000000000001) does not add a replica."""
    for name, value in (("target_qps", target_qps), ("per_replica_max_qps", per_replica_max_qps)):
        if not is_number(value) or not 0 < value < math.inf:
            raise ConfigError(f"{name}: must be a finite number of requests/s > 0, got {value!r}")
    return math.ceil(round(target_qps / per_replica_max_qps, 9))


def concurrency_needed(qps: float, mean_e2e_s: float) -> float:
    """Requests in flight at once, on average, when requests arrive at qps and each stays mean_e2e_s (arrival to
    last token): Little's law, L = λ W (Little 1961), true of any stable system in steady state whatever the
    distributions. The mean only: the peak a server must hold is above it, by the arrivals' burstiness."""
    if not is_number(qps) or not 0 < qps < math.inf:
        raise ConfigError(f"qps: must be a finite number of requests/s > 0, got {qps!r}")
    if not is_number(mean_e2e_s) or not 0 < mean_e2e_s < math.inf:
        raise ConfigError(f"mean_e2e_s: must be a finite number of seconds > 0, got {mean_e2e_s!r}")
    return qps * mean_e2e_s
