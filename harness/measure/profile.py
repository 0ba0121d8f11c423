"""A profiled pass over a few decode steps: where a step's time goes, its FLOPs, and its memory by kind.

It runs apart from the timing pass, so the profiler's overhead never reaches `tpot_ms`. Prefill and one warm-up
decode step run unprofiled (the warm-up step is the one whose FLOPs are counted, under FlopCounterMode); then
`n_steps` decode steps run under `torch.profiler` with memory events on.

What time is classified, and why it is never counted twice:
    CPU device   the self time of every profiled op: an op's time minus its child ops', so `aten::linear` keeps only
                 its own dispatch and `aten::mm` the matmul; the self times of all ops partition the ops' total.
                 Python time between ops (and inside a label but outside any op) is not an op's and is left out;
                 the trace shows it.
    CUDA device  the device time of every kernel, memcpy and memset, summed over streams. Host time is left out: a
                 launch-bound step shows as `prof_step_classified_ms` well under `tpot_ms`.

How a CPU op or a CUDA kernel (seen through the CPU op that launched it) gets its category, by `classify`:
    1. scope: the innermost enclosing `kvbench::` label (`LABELS`, placed in harness.kv.quant, harness.kv.base and harness.modeling.decode)
       or attention op (`aten::scaled_dot_product_attention` and its backends, or the Triton decode kernels' custom
       op `kvbench::paged_decode`) claims everything inside it, so a `mul` that quantizes K is KV time and a `bmm`
       in SDPA's math fallback is attention time;
    2. the op's or kernel's own name (`NAME_RULES`);
    3. an op that only reshapes or allocates (`aten::t`, `aten::empty`) counts with its nearest enclosing op that
       rules 1-2 classify (`aten::t` in `aten::linear` is GEMM); failing that, "other".

Memory, in bytes (`prof_mem_*`): weights from the parameters, KV from `cache.kv_bytes_allocated()` at the last
profiled step; activations/temporaries are the peak, over the profiled steps, of the bytes allocated on the model's
device since they began (a running sum of the profiler's allocation and free events). That is the transient memory
a decode step needs on top of what was already resident (weights, KV, RoPE tables, token buffers), measured the same
way on CPU and CUDA and without resetting the allocator's peak counters, which the point's memory probe reads.

Only a strategy's work inside `harness.kv.quant` (every format's write and read, the paged gather included) is
labelled as KV: a strategy that moves K/V by other code (sliding's ring, offload's host copies) shows that work as
elementwise or other.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.flop_counter import FlopCounterMode

from harness.kv.base import KVCache
from harness.modeling.decode import decode_step, prefill
from harness.modeling.model import weights_bytes
from harness.store.schema import PROFILE_CATEGORIES

CATEGORIES = PROFILE_CATEGORIES  # the row has a prof_<category>_frac column for each (harness.store.schema)
TOP_OPS_COLUMNS = ("op", "category", "self_time_ms", "calls", "share")

# The record_function labels on the hot path and what they claim. Each costs a few µs per call even with no profiler
# running, so there are few: 2 per layer (KV write, KV read) and 1 per step (sampling).
# harness.kv.base.eager_attention adds one per layer, only when attn_impl=eager: its matmuls are attention's.
LABELS = {
    "kvbench::kv_write": "kv",
    "kvbench::kv_read": "kv",
    "kvbench::sampling": "sampling",
    "kvbench::attention": "attention",
}
# The torch custom ops the harness registers in the same namespace (harness.kv.triton_paged.OP_NAME): the profiler
# records them as ops, not labels, and NAME_RULES classify them.
OPS = ("kvbench::paged_decode",)

# On the lowercased CPU op name or CUDA kernel name; the first match wins. Sampling comes before the reductions
# (argmax runs as a reduce_kernel on CUDA), attention before GEMM (fmha_cutlass*, flash kernels built on CUTLASS),
# GEMM before elementwise (CUTLASS epilogues name elementwise functors). cuBLAS on Hopper names its kernels nvjet_*.
# Triton names a kernel after its function: harness.kv.triton_kernels' are _paged_decode_kernel and
# _merge_splits_kernel, inside the op kvbench::paged_decode.
NAME_RULES = (
    ("sampling", re.compile(r"argmax|argmin|topk|multinomial|sort")),
    ("attention", re.compile(r"attention|attn|flash|fmha|sdpa|softmax|paged_decode|merge_splits")),
    (
        "gemm",
        re.compile(
            r"^aten::(?:mm|addmm|bmm|baddbmm|linear|matmul|mv|addmv|dot|_addmm_activation|_int_mm|_scaled_mm|einsum)$"
            r"|gemm|gemv|cutlass|xmma|cublas|nvjet|s16816|s1688|hmma|wgmma|splitk|dot_kernel"
        ),
    ),
    (
        "norm_elementwise",
        re.compile(
            r"^aten::(?:add|sub|rsub|mul|div|neg|pow|rsqrt|sqrt|exp|log|silu|gelu|relu|sigmoid|tanh|mean|sum|amax|amin"
            r"|max|min|maximum|minimum|abs|clamp|clamp_min|clamp_max|round|floor|ceil|trunc|sign|where|cat|stack|copy"
            r"|to|_to_copy|fill|zero|cos|sin|square|erf|reciprocal|remainder|fmod|lt|le|gt|ge|eq|ne|bitwise_\w+|__\w+__"
            r"|clone|contiguous|masked_fill|addcmul|addcdiv|lerp)_?$"
            r"|norm|elementwise|reduce_kernel|pointwise|vectorized|unrolled|silu|catarray|copy_kernel|fill_kernel"
            r"|triton_(?:poi|red|per)"
        ),
    ),
)


def _by_name(name: str) -> str:
    lowered = name.lower()
    for category, pattern in NAME_RULES:
        if pattern.search(lowered):
            return category
    return "other"


def classify(op_name: str, context: Sequence[str] = ()) -> str:
    """The category of a CPU op or CUDA kernel; `context` names what encloses it (its launching op for a kernel,
    then the enclosing ops and labels), innermost first. Rules: see the module docstring."""
    for name in context:
        if name in LABELS:
            return LABELS[name]
        if (name.startswith("aten::") or name in OPS) and _by_name(name) == "attention":
            return "attention"
    own = _by_name(op_name)
    if own != "other":
        return own
    return next((category for name in context if (category := _by_name(name)) != "other"), "other")


def _is_label(event) -> bool:
    if event.name in OPS:
        return False
    return bool(event.is_user_annotation) or event.name.startswith(("kvbench::", "ProfilerStep"))


def _context(event) -> tuple[str, ...]:
    names = []
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return tuple(names)


def _cpu_times(events) -> Iterator[tuple[str, str, float]]:
    """(op, category, self time µs) of every profiled CPU op."""
    for event in events:
        if event.device_type != DeviceType.CPU or _is_label(event) or event.is_python_function:
            continue
        if event.name.startswith("["):  # [memory], [OutOfMemory]: instants, not ops
            continue
        yield event.name, classify(event.name, _context(event)), event.self_cpu_time_total


# Kineto's activity types of device work; the device also shows each label as a span (gpu_user_annotation).
_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def _cuda_times(events) -> Iterator[tuple[str, str, float]]:
    """(kernel, category, device time µs) of every kernel, memcpy and memset, seen through its launching op."""
    launchers = {  # a kernel's linked correlation id is the id of the innermost op (or label) that launched it
        event.id: event for event in events if event.device_type == DeviceType.CPU and event.linked_correlation_id == 0
    }
    for event in events:
        if event.device_type != DeviceType.CUDA or _is_label(event):
            continue
        activity = getattr(event, "activity_type", None)  # None where this torch does not say: keep the event
        if activity is not None and activity not in _DEVICE_WORK:
            continue
        op = launchers.get(event.linked_correlation_id)
        context = (op.name, *_context(op)) if op is not None else ()
        yield event.name, classify(event.name, context), event.time_range.elapsed_us()


def _breakdown(times: list[tuple[str, str, float]], n_steps: int, top_k: int) -> tuple[dict, pd.DataFrame]:
    total_us = sum(us for _, _, us in times)
    if total_us <= 0:
        raise RuntimeError("profile: the profiled decode steps recorded no op time")
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    for _, category, us in times:
        per_category[category] += us
    columns = {f"prof_{category}_frac": us / total_us for category, us in per_category.items()}
    columns["prof_step_classified_ms"] = total_us / 1e3 / n_steps
    table = pd.DataFrame(times, columns=["op", "category", "us"])
    table = table.groupby(["op", "category"], as_index=False).agg(self_us=("us", "sum"), calls=("us", "size"))
    table = table.sort_values("self_us", ascending=False, kind="stable").head(top_k).reset_index(drop=True)
    table["self_time_ms"] = table["self_us"] / 1e3  # over all n_steps profiled steps
    table["share"] = table["self_us"] / total_us  # of all classified time, so the kept rows sum to <= 1
    return columns, table[list(TOP_OPS_COLUMNS)]


def _transient_peak_bytes(prof: profile, device: torch.device) -> int:
    """Peak of (bytes allocated - bytes freed) on `device` since profiling began, from the [memory] events."""
    device_type = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    records = [
        (record.start_ns(), record.nbytes())
        for record in prof.profiler.kineto_results.events()
        if record.name() == "[memory]" and record.device_type() == device_type
    ]
    running = peak = 0
    for _, nbytes in sorted(records, key=lambda record: record[0]):  # frees report negative nbytes
        running += nbytes
        peak = max(peak, running)
    return peak


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Q @ K^T and P @ V, 2 FLOPs per multiply-add, as torch.utils.flop_counter counts the CUDA SDPA backends."""
    batch, n_heads, n_queries, head_dim = query_shape
    n_keys = key_shape[-2]
    return 2 * batch * n_heads * n_queries * n_keys * (head_dim + value_shape[-1])


# SDPA's backends; bmm and baddbmm only run in SDPA's math fallback: the model's projections are mm and addmm.
# kvbench.paged_decode: the Triton decode kernels' op, its formula registered in harness.kv.triton_paged.
_ATTENTION_FLOP_OPS = re.compile(r"attention|bmm|paged_decode")


def _count_flops(step) -> tuple[int, int]:
    """(attention FLOPs, all FLOPs) of one call of `step`. FlopCounterMode has no formula for the CPU's SDPA
    backend, so one is given here."""
    counter = FlopCounterMode(
        display=False, custom_mapping={torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops}
    )
    with counter:
        step()
    by_op = counter.get_flop_counts()["Global"]
    attention = sum(flops for op, flops in by_op.items() if _ATTENTION_FLOP_OPS.search(str(op)))
    return int(attention), int(counter.get_total_flops())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def profile_decode(
    model: torch.nn.Module,
    cache: KVCache,
    prompt: torch.Tensor,
    *,
    n_steps: int = 4,
    device: torch.device | str,
    trace_path: Path | None = None,
    top_k: int = 20,
) -> tuple[dict, pd.DataFrame]:
    """Prefill prompt [B, P] and one warm-up decode step unprofiled, then n_steps decode steps under the profiler.

    The cache needs room for P + n_steps + 1 positions (n_steps <= gen_len - 1 at a sweep point); it is released
    at the end. Returns the columns (`prof_*`: shares of classified time by category, classified ms per step, FLOPs
    of the warm-up step, whose context is P + 1 tokens, memory by kind, `prof_steps`, and `prof_trace_path` when
    traced) and the `top_k` ops or kernels by self time (TOP_OPS_COLUMNS; times summed over the profiled steps).

    trace_path: write a Chrome trace there (open in ui.perfetto.dev). On CUDA also a memory snapshot beside it,
    `<stem>.memory.pickle`, for pytorch.org/memory_viz, as `prof_memory_snapshot_path`.
    """
    device = torch.device(device)
    batch, prompt_len = prompt.shape
    n_positions = prompt_len + 1 + n_steps  # prompt, warm-up step, profiled steps
    capacity = min(model.n_positions, cache.spec.max_tokens)
    if n_steps < 1 or n_positions > capacity:
        raise ValueError(
            f"profile: n_steps {n_steps} after a {prompt_len}-token prompt needs {n_positions} positions "
            f"and at least one step; the model and cache hold {capacity}"
        )
    tokens = torch.empty((batch, n_positions + 1), dtype=torch.long, device=prompt.device)
    tokens[:, :prompt_len] = prompt
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    snapshot_path = trace_path.with_name(f"{trace_path.stem}.memory.pickle") if trace_path is not None else None
    record_snapshot = snapshot_path is not None and device.type == "cuda"
    try:
        tokens[:, prompt_len] = prefill(model, cache, prompt)

        def warm_up_step() -> None:
            tokens[:, prompt_len + 1] = decode_step(model, cache, tokens, prompt_len)

        attention_flops, total_flops = _count_flops(warm_up_step)
        _synchronize(device)
        if record_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        with profile(activities=activities, profile_memory=True) as prof:
            for pos in range(prompt_len + 1, prompt_len + 1 + n_steps):
                with record_function("kvbench::decode_step"):
                    tokens[:, pos + 1] = decode_step(model, cache, tokens, pos)
            _synchronize(device)  # every kernel of the steps ends inside the profiled window
        if record_snapshot:
            snapshot_path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(snapshot_path))
        kv_bytes = cache.kv_bytes_allocated()  # at the last step, before the release gives blocks back
    finally:
        if record_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
        cache.release()

    events = prof.events()
    times = list(_cuda_times(events) if device.type == "cuda" else _cpu_times(events))
    columns, top_ops = _breakdown(times, n_steps=n_steps, top_k=top_k)
    columns |= {
        "prof_attention_flops": attention_flops,
        "prof_total_flops": total_flops,
        "prof_mem_weights_bytes": weights_bytes(model),
        "prof_mem_kv_bytes": kv_bytes,
        "prof_mem_activations_bytes": _transient_peak_bytes(prof, device),
        "prof_steps": n_steps,
    }
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
        columns["prof_trace_path"] = str(trace_path)
        if record_snapshot:
            columns["prof_memory_snapshot_path"] = str(snapshot_path)
    return columns, top_ops
