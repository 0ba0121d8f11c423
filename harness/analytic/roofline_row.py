"""The roofline verdict of a sweep point: its ridge point, critical batch and context, and its row's columns.

The cost model (FLOPs and bytes of each step) is harness.analytic.roofline; this module compares it with a device's ceilings
(Williams, Waterman & Patterson 2009, "Roofline"):

    predicted step time = max(flops / peak_flops, bytes / peak_bandwidth)
    ridge point         = peak_flops / peak_bandwidth   # FLOPs per byte; above it a step is compute-bound

Which bandwidth: decode is judged against the streaming-read roof (harness/device/bandwidth.py; bw_roof "read"). A decode
step is GEMVs over the weights and a read of the KV cache: it reads each byte once and writes little (one token's K
and V, the activations), so a copy, which counts read + write and on CPUs often reaches half of a streaming read's
GB/s, is not its ceiling: against it bw_util could pass 1 and predicted_tpot_ms come out too slow. Ceilings stored before the read roof
give the copy instead, and bw_roof says "copy". A row that beats its roofs (bw_util or flops_util over 1) marks them
stale: ceilings_stale.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import fields
from typing import TYPE_CHECKING

from harness.analytic.roofline import DENSE, StepCost, decode_step_cost, mean_decode_cost, prefill_cost
from harness.kv.base import Layout

if TYPE_CHECKING:
    from harness.config import Workload
    from harness.kv.shape import KVShape


def ridge_point(*, peak_bw_gbps: float, peak_tflops: float) -> float:
    """FLOPs per byte at which the compute and the bandwidth ceilings meet."""
    return peak_tflops * 1e12 / (peak_bw_gbps * 1e9)


def _critical_batch_from(one: StepCost, two: StepCost, ridge: float) -> int | None:
    """The smallest B whose intensity reaches the ridge, a step's cost being affine in B: fixed + B·per_sequence."""
    per_flops, per_bytes = two.flops - one.flops, two.bytes - one.bytes
    fixed_flops, fixed_bytes = one.flops - per_flops, one.bytes - per_bytes

    def reaches(batch: int) -> bool:
        return fixed_flops + batch * per_flops >= ridge * (fixed_bytes + batch * per_bytes)

    if per_flops <= ridge * per_bytes:  # the intensity tends to per_flops / per_bytes: never reaches the ridge
        return 1 if reaches(1) else None
    batch = max(1, math.ceil((ridge * fixed_bytes - fixed_flops) / (per_flops - ridge * per_bytes)))
    while batch > 1 and reaches(batch - 1):  # float rounding at the root: settle on the exact smallest batch
        batch -= 1
    while not reaches(batch):
        batch += 1
    return batch


def _at_batches(shape: KVShape, *, context_len: float, layout: Layout) -> tuple[StepCost, StepCost]:
    """The decode step at context_len of one sequence and of two: a step's cost is affine in B."""
    one, two = (dataclasses.replace(shape, batch_size=batch_size) for batch_size in (1, 2))
    return tuple(decode_step_cost(s, context_len=context_len, layout=layout) for s in (one, two))


def critical_batch(
    shape: KVShape, *, context_len: float, peak_bw_gbps: float, peak_tflops: float, layout: Layout = DENSE
) -> int | None:
    """B*: the smallest batch whose decode step at context_len reaches the ridge point; None if no batch does.

    A decode step costs W + B·b bytes (W the weights, b a sequence's KV read and write, activations and embedding
    row) and B·f FLOPs, so its intensity B·f / (W + B·b) rises with B towards f / b:
        B* = ridge·W / (f - ridge·b),   None when f <= ridge·b (the context is past critical_context).
    With b = 0 and bf16 weights this is ≈ the ridge point itself, the JAX scaling book's B ≈ 240-300.
    """
    costs = _at_batches(shape, context_len=context_len, layout=layout)  # the shape's batch_size unused
    return _critical_batch_from(*costs, ridge=ridge_point(peak_bw_gbps=peak_bw_gbps, peak_tflops=peak_tflops))


def critical_context(shape: KVShape, *, peak_bw_gbps: float, peak_tflops: float, layout: Layout = DENSE) -> float:
    """S*: the context beyond which decode cannot reach the ridge point at any batch; math.inf if it never binds.

    As B → ∞ the intensity tends to a sequence's own f(S) / b(S) = (f0 + a·S) / (b0 + k·S): f0 the matmul and
    lm_head FLOPs, a = 4·L·H·D, b0 the KV write, activations and embedding row, k = kv_bytes_per_token_read. It
    falls with S while attention's own intensity a / k is below the ridge, and equals it at
        S* = (f0 - ridge·b0) / (ridge·k - a)
    0.0 when even the first token cannot reach it; math.inf when a >= ridge·k, when the layout caps the keys read
    below S* (a window), and for a layout that recomputes (`none`: it gains intensity with the context, never binds).
    """
    if layout.recomputes_prefix:
        return math.inf
    ridge = ridge_point(peak_bw_gbps=peak_bw_gbps, peak_tflops=peak_tflops)

    def per_sequence(context_len: int) -> StepCost:
        one, two = _at_batches(shape, context_len=context_len, layout=layout)
        return StepCost(*(getattr(two, f.name) - getattr(one, f.name) for f in fields(StepCost)))

    at_1, at_2 = per_sequence(1), per_sequence(2)
    slope_flops, slope_bytes = at_2.flops - at_1.flops, at_2.bytes - at_1.bytes
    base_flops, base_bytes = at_1.flops - slope_flops, at_1.bytes - slope_bytes
    if slope_flops >= ridge * slope_bytes:
        return math.inf
    context = (base_flops - ridge * base_bytes) / (ridge * slope_bytes - slope_flops)
    if layout.keys_attended(math.inf) <= context:  # no query reads more keys than that
        return math.inf
    return max(0.0, context)


def _known(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0  # None, NaN (a null cell) and 0 are unknown


def roofline_columns(
    w: Workload,
    *,
    tpot_ms: float | None = None,
    ttft_ms: float | None = None,
    peak_bw_gbps: float | None = None,
    peak_tflops: float | None = None,
) -> dict[str, float | int | str | None]:
    """The analytic, achieved, verdict and ceiling columns of one row.

    Decode figures are the mean over the timed decode steps (mean_decode_cost; context prompt_len + gen_len / 2,
    capped by the window); the prefill figure is the measured prefill, a prefix hit where the strategy holds one
    (its layout's prefix_tokens).
        flops_per_step, bytes_per_step     one decode step of the whole batch
        arithmetic_intensity               flops_per_step / bytes_per_step, FLOPs per byte
        prefill_arithmetic_intensity       the same for the prefill
        prefill_flops                      FLOPs of the prefill of the whole batch
        prefill_achieved_tflops            prefill_flops / ttft (TTFT also holds the first token's sampling)
        achieved_bw_gbps, achieved_tflops  bytes_per_step / tpot, flops_per_step / tpot
        bw_util, flops_util                achieved / peak (peak_bw_gbps: the roof the caller chose, bw_roof)
        ceilings_stale                     bw_util > 1 or flops_util > 1: the row beat its ceilings, so they are
                                           stale or wrong; None when neither utilisation is known
        bound                              "compute" if arithmetic_intensity >= the ridge point, else "memory"
        predicted_tpot_ms                  max(flops / peak_flops, bytes / peak_bw) · 1e3
        critical_batch                     B* at this row's decode steps (critical_batch); None if no batch
        critical_context                   S* for this model, format and strategy (critical_context); inf if none
        peak_bw_gbps, peak_tflops          the ceilings, as given
    Columns that need tpot_ms or the peaks are None when those are missing (None, NaN or 0).
    """
    shape, layout = w.kv_shape(), w.layout()
    decode = mean_decode_cost(shape, layout=layout)
    prefill = prefill_cost(shape, layout=layout, prefix_cached=layout.prefix_tokens(shape))
    columns: dict[str, float | int | str | None] = {
        "flops_per_step": decode.flops,
        "bytes_per_step": decode.bytes,
        "arithmetic_intensity": decode.arithmetic_intensity,
        "prefill_arithmetic_intensity": prefill.arithmetic_intensity,
        "prefill_flops": prefill.flops,
        "prefill_achieved_tflops": prefill.flops / (ttft_ms * 1e-3) / 1e12 if _known(ttft_ms) else None,
        "peak_bw_gbps": peak_bw_gbps if _known(peak_bw_gbps) else None,
        "peak_tflops": peak_tflops if _known(peak_tflops) else None,
    }
    timed, peaks = _known(tpot_ms), _known(peak_bw_gbps) and _known(peak_tflops)
    achieved_bw = decode.bytes / (tpot_ms * 1e-3) / 1e9 if timed else None
    achieved_tflops = decode.flops / (tpot_ms * 1e-3) / 1e12 if timed else None
    bw_util = achieved_bw / peak_bw_gbps if timed and _known(peak_bw_gbps) else None
    flops_util = achieved_tflops / peak_tflops if timed and _known(peak_tflops) else None
    utils = [util for util in (bw_util, flops_util) if util is not None]
    columns |= {
        "achieved_bw_gbps": achieved_bw,
        "achieved_tflops": achieved_tflops,
        "bw_util": bw_util,
        "flops_util": flops_util,
        "ceilings_stale": any(util > 1 for util in utils) if utils else None,
    }
    if not peaks:
        return columns | dict.fromkeys(("bound", "predicted_tpot_ms", "critical_batch", "critical_context"))
    ridge = ridge_point(peak_bw_gbps=peak_bw_gbps, peak_tflops=peak_tflops)
    decode_one, decode_two = (
        mean_decode_cost(dataclasses.replace(shape, batch_size=batch_size), layout=layout) for batch_size in (1, 2)
    )
    return columns | {
        "bound": "compute" if decode.arithmetic_intensity >= ridge else "memory",
        "predicted_tpot_ms": max(decode.flops / (peak_tflops * 1e12), decode.bytes / (peak_bw_gbps * 1e9)) * 1e3,
        "critical_batch": _critical_batch_from(decode_one, decode_two, ridge),
        "critical_context": critical_context(shape, peak_bw_gbps=peak_bw_gbps, peak_tflops=peak_tflops, layout=layout),
    }
