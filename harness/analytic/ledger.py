"""The capacity planner's ledger: what a decode point needs in memory, and how many requests or tokens fit.

The formula, with concurrency in it (leaving it out is the usual cause of production OOMs):

    total   = static + dynamic
    static  = weights + model buffers + runtime overhead               # paid once, whatever the load
    dynamic = KV(B requests) + activations(B requests)                 # grows with every concurrent request
    KV      ~ B × (prompt_len + gen_len) × kv_bytes_per_token          # the strategy's exact allocation below
    kv_bytes_per_token = 2 (K and V) × n_layers × n_kv_heads × head_dim × bytes(kv_dtype) (+ scales)
                       MLA: n_layers × (kv_lora_rank + qk_rope_head_dim) × bytes: one latent row (DeepSeek-V2)

Each term, and where it comes from:

    weights            n_params × bytes(dtype): every parameter, a tied lm_head once (ModelArgs.n_params).
    model buffers      RoPE's cos and sin tables, fp32 [n_positions, head_dim] each (Transformer.setup_rope);
                       MLA rotates only qk_rope_head_dim channels of each head.
    runtime overhead   what the process holds before the model loads (harness.analytic.runtime), or as given.
    KV                 exactly what the strategy's kv_bytes_allocated() reports at the peak: its layout's answer
                       (harness/kv/<name>.py: LAYOUT.allocation, checked against the real caches by the tests):
                       payload, scales, int4's full-precision tail, paged block rounding, the prefix held once.
    activations        the peak of the transient tensors of one generation (harness.analytic.activations).

Limits: max_concurrency is the largest batch_size whose total fits the memory; max_context the longest prompt_len +
gen_len (gen_len held) at the given batch. Both search the exact ledger (`largest`), so block rounding and a fixed
pool count.

Not counted: the accuracy pass of lossy points (bench builds an exact contiguous cache beside the lossy one: run
the frontier with accuracy=false), allocator fragmentation (CUDA's caching allocator rounds and keeps freed blocks;
glibc keeps freed activations in its heap unless its mmap threshold is pinned: see experiments/capacity.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.analytic.activations import activation_bytes
from harness.analytic.runtime import GiB, default_runtime_overhead_bytes, detected_memory_bytes
from harness.config import Workload, check_choice, device_type
from harness.errors import ConfigError
from harness.formats import BITS, DTYPE_BYTES, PER_TOKEN_SCALED, SCALE_BYTES
from harness.modeling.model_args import ModelArgs
from harness.modeling.resolve import resolve_model

SEARCH_LIMIT = 2**40  # no batch or context is searched beyond this


def kv_bytes_per_token(model: str | Path | dict | ModelArgs, kv_dtype: str, *, kv_group_size: int = 32) -> int:
    """K and V of one token of one sequence over all layers, in bytes, scales included (int4's full-precision tail
    excluded: it is per sequence, not per token).

        plain        2 × n_layers × n_kv_heads × head_dim × bytes
        fp8, int8    2 × n_layers × n_kv_heads × (head_dim × 1 + 4): one fp32 scale per token and head
        int4         2 × n_layers × n_kv_heads × (head_dim / 2 + 8 × head_dim / kv_group_size): packed nibbles,
                     plus a scale and a zero point per key channel per group of G tokens (amortized over the
                     group) and per G value channels of each token (KIVI, harness.kv.quant.Int4Kivi)

    The cache geometry is the model's (ModelArgs.cache_sides, cache_heads, cache_head_dim): for MLA one side of one
    head of kv_lora_rank + qk_rope_head_dim values (the latent c_kv and the shared RoPE key), so the same rows with
    2 × n_kv_heads × head_dim read 1 × 1 × (R + P): DeepSeek-V2-Lite in bf16 27 × 576 × 2 = 31,104 bytes a token.
    """
    args = resolve_model(model)
    check_choice("kv_dtype", kv_dtype, BITS)
    head_dim = args.cache_head_dim
    per_head = head_dim * BITS[kv_dtype] // 8
    if kv_dtype in PER_TOKEN_SCALED:
        per_head += SCALE_BYTES
    elif kv_dtype == "int4":
        if head_dim % kv_group_size:
            raise ConfigError(
                f"kv_group_size: {args.name}'s head_dim {head_dim} is not a multiple of {kv_group_size}; "
                f"allowed: a group size dividing {head_dim}"
            )
        per_head += 2 * SCALE_BYTES * head_dim // kv_group_size
    return args.cache_sides * args.n_layers * args.cache_heads * per_head


def kv_bytes_allocated(
    model: str | Path | dict | ModelArgs,
    *,
    cache: str,
    kv_dtype: str,
    batch_size: int,
    prompt_len: int,
    gen_len: int,
    prefix_len: int = 0,
    kv_group_size: int = 32,
    kv_residual: int = 0,
    dtype: str = "bf16",
    **options,
) -> int:
    """Exactly what `cache`'s kv_bytes_allocated() reports at the peak of a generation (after its first write,
    when int4 allocates its full-precision tail), for CacheSpec.for_model(args, batch_size, max_tokens=prompt_len +
    gen_len, ...). `options`: the strategy's own (block_size=..., window=...). `dtype` is the compute dtype: int4's
    tail is stored in it."""
    workload = Workload(
        model=model,
        cache={"name": cache, **options},
        dtype=dtype,
        kv_dtype=kv_dtype,
        prefix_len=prefix_len,
        kv_group_size=kv_group_size,
        kv_residual=kv_residual,
        prompt_len=prompt_len,
        gen_len=gen_len,
        batch_size=batch_size,
    )
    return workload_kv_bytes(workload)


def workload_kv_bytes(workload: Workload) -> int:
    """kv_bytes_allocated for a workload already built (a RunConfig's .workload(): the point runner's row)."""
    return workload.layout().allocation(workload.kv_shape()).total_bytes


def weights_bytes(args: ModelArgs, dtype: str) -> int:
    """Every parameter at the compute dtype (harness.modeling.model.build_model casts the whole model, norms included)."""
    return args.n_params * DTYPE_BYTES[dtype]


def buffers_bytes(args: ModelArgs, n_positions: int) -> int:
    """RoPE's cos and sin tables, fp32 [n_positions, head_dim] each (Transformer.setup_rope); MLA's are
    [n_positions, qk_rope_head_dim], the only channels it rotates (DeepSeek-V2 section 2.1.3)."""
    rotated = args.qk_rope_head_dim if args.is_mla else args.head_dim
    return 2 * n_positions * rotated * 4


@dataclass(frozen=True)
class Ledger:
    """Where the memory of a workload goes, in bytes, and the limits it implies. The batch multiplies the dynamic
    part (KV and activations), never the static one."""

    workload: Workload
    device: str
    memory_bytes: int  # the budget: memory_gb, or the device's total
    # static
    weights_bytes: int
    buffers_bytes: int  # RoPE tables
    runtime_overhead_bytes: int
    # dynamic
    kv_bytes_per_token: int  # scales included, int4's tail excluded
    kv_bytes_per_request: int  # the strategy's allocation for one request at this length, on the device
    kv_bytes: int  # ... for the whole batch, on the device
    kv_bytes_host: int  # what the strategy keeps in host memory (offload's store; not in total_bytes)
    activation_bytes: int  # peak transient of one generation, for the whole batch
    # limits
    max_concurrency: int  # at prompt_len + gen_len; 0: not even one request fits
    max_context: int  # prompt_len + gen_len (gen_len held) at this batch; 0: none fits
    max_context_by: str  # what bounds max_context: "memory" or "model" (its positions)

    @property
    def static_bytes(self) -> int:
        return self.weights_bytes + self.buffers_bytes + self.runtime_overhead_bytes

    @property
    def dynamic_bytes(self) -> int:
        return self.kv_bytes + self.activation_bytes

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.dynamic_bytes

    @property
    def free_bytes(self) -> int:
        return self.memory_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.free_bytes >= 0 and self.workload.layout().pool_fits(self.workload.kv_shape())


def ledger(
    workload: Workload,
    *,
    memory_gb: float | None = None,
    device: str = "auto",
    runtime_overhead_bytes: int | None = None,
) -> Ledger:
    """The memory ledger of `workload` on `device` with `memory_gb` (None: the detected device's memory).

    runtime_overhead_bytes None: measured (harness.analytic.runtime.default_runtime_overhead_bytes). A ConfigError names
    the field when the static part alone does not fit, or when the strategy cannot run on the device.
    """
    device = device_type(device)
    layout = workload.layout()
    layout.check_device(device)
    memory_bytes = _memory_bytes(memory_gb, device)
    if runtime_overhead_bytes is None:
        runtime_overhead_bytes = default_runtime_overhead_bytes(device, workload)
    if runtime_overhead_bytes < 0:
        raise ConfigError(f"runtime_overhead_bytes: must be 0 or more, got {runtime_overhead_bytes}")
    args = workload.model_args()
    static = weights_bytes(args, workload.dtype) + runtime_overhead_bytes
    if static + buffers_bytes(args, workload.max_tokens) > memory_bytes:
        raise ConfigError(
            f"memory_gb: {memory_bytes / GiB:.2f} GiB cannot hold {args.name}'s {workload.dtype} weights "
            f"({weights_bytes(args, workload.dtype) / GiB:.2f} GiB) and the runtime ({runtime_overhead_bytes / GiB:.2f} "
            f"GiB); allowed: more than {static / GiB:.2f} GiB"
        )
    allocation = layout.allocation(workload.kv_shape())
    one_request = workload.replace(batch_size=1)
    one = layout.allocation(one_request.kv_shape())
    limits = dict(memory_bytes=memory_bytes, runtime_overhead_bytes=runtime_overhead_bytes)
    context, context_by = _max_context(workload, **limits)
    return Ledger(
        workload=workload,
        device=device,
        memory_bytes=memory_bytes,
        weights_bytes=weights_bytes(args, workload.dtype),
        buffers_bytes=buffers_bytes(args, workload.max_tokens),
        runtime_overhead_bytes=runtime_overhead_bytes,
        kv_bytes_per_token=kv_bytes_per_token(args, workload.kv_dtype_name, kv_group_size=workload.kv_group_size),
        kv_bytes_per_request=one.total_bytes - one.host_bytes,
        kv_bytes=allocation.total_bytes - allocation.host_bytes,
        kv_bytes_host=allocation.host_bytes,
        activation_bytes=activation_bytes(workload),
        max_concurrency=_max_concurrency(workload, **limits),
        max_context=context,
        max_context_by=context_by,
    )


def _memory_bytes(memory_gb: float | None, device: str) -> int:
    if memory_gb is None:
        return detected_memory_bytes(device)
    if memory_gb <= 0:
        raise ConfigError(f"memory_gb: must be positive, got {memory_gb}")
    return int(memory_gb * GiB)


def total_bytes(workload: Workload, *, runtime_overhead_bytes: int) -> int:
    """static + dynamic of the ledger, on the device (host-held KV excluded): the quantity that must fit."""
    args, allocation = workload.model_args(), workload.layout().allocation(workload.kv_shape())
    return (
        weights_bytes(args, workload.dtype)
        + buffers_bytes(args, workload.max_tokens)
        + runtime_overhead_bytes
        + allocation.total_bytes
        - allocation.host_bytes
        + activation_bytes(workload)
    )


def fits(workload: Workload, *, memory_bytes: int, runtime_overhead_bytes: int) -> bool:
    """The pool holds the batch and the total fits memory_bytes."""
    return workload.layout().pool_fits(workload.kv_shape()) and (
        total_bytes(workload, runtime_overhead_bytes=runtime_overhead_bytes) <= memory_bytes
    )


def bracket(
    fits: Callable[[int], bool], *, low: int, high: int, start: int, width: Callable[[int], int] = lambda n: 1
) -> tuple[int, int]:
    """(the largest n in [low, high] known to fit, or low - 1; the smallest known not to, or high + 1), fits
    monotone (true then false), each n asked at most once: fits may be a real OOM probe (experiments/capacity.py).

    From `start`, gallops up (start + w, + 2w, + 4w, ...) or down until the edge is bracketed, then bisects until
    the bracket is at most width(n) wide, n the largest that fits (1: exact).
    """
    if fits(start):  # gallop up until one does not fit, or the cap fits
        ok, fail, stride = start, None, width(start)
        while fail is None and ok < high:
            candidate = min(ok + stride, high)
            if fits(candidate):
                ok, stride = candidate, stride * 2
            else:
                fail = candidate
        fail = fail if fail is not None else high + 1
    else:  # gallop down until one fits, or the floor does not
        ok, fail, stride = low - 1, start, width(start)
        while fail > low:
            candidate = max(low, fail - stride)
            if fits(candidate):
                ok = candidate
                break
            fail, stride = candidate, stride * 2
    while fail - ok > width(ok) and ok >= low:  # bisect
        middle = (ok + fail) // 2
        if fits(middle):
            ok = middle
        else:
            fail = middle
    return ok, fail


def largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), exactly; low - 1 if none (bracket from low)."""
    return bracket(fits, low=low, high=high, start=low)[0]


def _max_concurrency(workload: Workload, *, memory_bytes: int, runtime_overhead_bytes: int) -> int:
    def fits_at(batch: int) -> bool:
        return fits(
            workload.replace(batch_size=batch),
            memory_bytes=memory_bytes,
            runtime_overhead_bytes=runtime_overhead_bytes,
        )

    return largest(fits_at, 1, SEARCH_LIMIT)


def _max_context(workload: Workload, *, memory_bytes: int, runtime_overhead_bytes: int) -> tuple[int, str]:
    """The longest prompt_len + gen_len that fits at this batch, gen_len (and prefix_len) held."""
    first, last = workload.prefix_len + 1, workload.model_args().max_seq_len - workload.gen_len
    if last < first:
        return 0, "model"

    def fits_at(prompt_len: int) -> bool:
        return fits(
            workload.replace(prompt_len=prompt_len),
            memory_bytes=memory_bytes,
            runtime_overhead_bytes=runtime_overhead_bytes,
        )

    prompt_len = largest(fits_at, first, last)
    if prompt_len < first:
        return 0, "memory"
    return prompt_len + workload.gen_len, "model" if prompt_len == last else "memory"


def format_ledger(book: Ledger) -> str:
    """The ledger as a table a person reads: bytes and GiB per line, static then dynamic, then the limits."""
    w = book.workload

    def line(label: str, value: int) -> str:
        return f"  {label:<44} {value:>18,} B {value / GiB:>10.3f} GiB"

    header = (
        f"{w.model_args().name}: {w.dtype} weights, {w.kv_dtype_name} KV, cache={w.cache_name}, prompt "
        f"{w.prompt_len} + gen {w.gen_len} tokens, {w.batch_size} concurrent, {book.device} with "
        f"{book.memory_bytes / GiB:.2f} GiB"
    )
    rows = [
        header,
        "static",
        line("weights", book.weights_bytes),
        line("model buffers (RoPE tables)", book.buffers_bytes),
        line("runtime overhead", book.runtime_overhead_bytes),
        "dynamic",
        f"  {'KV per token (scales included)':<44} {book.kv_bytes_per_token:>18,} B",
        line("KV per request", book.kv_bytes_per_request),
        line(f"KV for {w.batch_size} concurrent", book.kv_bytes),
        line("activations (peak transient)", book.activation_bytes),
    ]
    if book.kv_bytes_host:
        rows.append(line(f"KV in host memory ({w.cache_name}, not counted)", book.kv_bytes_host))
    rows += [
        line("total", book.total_bytes),
        line("free" if book.fits else "SHORT (does not fit)", abs(book.free_bytes)),
        "limits",
        f"  max concurrency at {w.max_tokens} tokens: {book.max_concurrency}",
        f"  max context at {w.batch_size} concurrent: {book.max_context} tokens"
        + (" (the model's positions)" if book.max_context_by == "model" else ""),
    ]
    if not w.layout().pool_fits(w.kv_shape()):
        rows.append(f"  the {w.cache_name} pool cannot hold {w.batch_size} requests: KV pool exhausted")
    return "\n".join(rows)
