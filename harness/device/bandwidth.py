"""Memory bandwidth, measured two ways: a copy (bytes read + written) and a streaming read (bytes read only).

A decode step's weight read is a GEMV: every weight byte is read once and almost nothing is written (the output is a
[B, out] vector, about 1/dim of the weights). The roofline's memory roof is therefore a read roof. The copy is kept
beside it because it is what STREAM's Copy kernel reports and what the rows before METHOD_VERSION 3 were compared
with. It is not a read roof: on CPUs a copy often reaches as little as half of a streaming read's GB/s (the write
allocates each line before filling it, and the read and write streams share the memory controllers; on the machine
of issue #14, x.sum() reached twice the copy's figure), so a decode row measured against it can exceed 1 in bw_util.

Both stream a buffer several times the last-level cache, so that it comes from memory, and follow the same discipline
(harness/device/ceiling_timing.py): warm-up by count and by time, then the median of repeats and its spread. A spread wider
than MAX_RSE is measured again, up to MAX_TRIES times, and the tightest measurement is kept.

Units: GB = 1e9 bytes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch

from harness.device.ceiling_timing import median_seconds

if TYPE_CHECKING:
    from harness.device.ceilings import Plan

log = logging.getLogger(__name__)

# When the cache size cannot be read: 32 MiB is a common server L3 per socket (AMD EPYC CCD, many Xeons) and 50 MB
# is H100's L2 (NVIDIA H100 Tensor Core GPU Architecture whitepaper); both only scale the buffer.
FALLBACK_LLC_BYTES = 32 * 2**20
FALLBACK_L2_BYTES = 50 * 2**20
# The roof divides every row's bw_util, so it should be no noisier than the rows' own medians: a decode point stops
# repeating at target_rse = 0.02 (harness/config.py), and a roof measured at the same spread adds no more than that.
MAX_RSE = 0.02
# A spread still wide after three measurements is the host's (another process on the cores), not bad luck: keep the
# tightest and record how many were taken, rather than spend the run measuring.
MAX_TRIES = 3


@dataclass(frozen=True)
class Bandwidth:
    """One bandwidth figure: the median of `repeats` timed calls, its spread, and how many measurements it took."""

    gbps: float  # GB/s, GB = 1e9 bytes; what counts as a byte is the measuring function's (copy: read + written)
    rse: float  # relative standard error of the median seconds (harness.measure.stats.median_rse)
    n_bytes: int  # the buffer streamed by one call
    repeats: int  # timed calls behind the median
    tries: int = 1  # measurements taken (each with its own warm-up and repeats); this is the tightest of them


def last_level_cache_bytes(device: torch.device) -> int:
    """CUDA: the L2. CPU: the highest-level data or unified cache that sysfs lists for cpu0 (usually the L3)."""
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or FALLBACK_L2_BYTES
    best_level, best_bytes = -1, 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()  # e.g. "32768K"
        except (OSError, ValueError):
            continue
        match = re.fullmatch(r"(\d+)([KMG]?)", size)
        if kind in ("Data", "Unified") and match and level > best_level:
            best_level = level
            best_bytes = int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2)]
    return best_bytes or FALLBACK_LLC_BYTES


def buffer_bytes_for(device: torch.device, plan: Plan) -> int:
    """Several times the last-level cache, so that a call streams from memory; at most a quarter of what is free
    (the copy holds two such buffers). A multiple of 4 bytes, so that the read's float32 view covers all of it."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
    else:
        free_bytes = psutil.virtual_memory().available
    return min(int(plan.copy_cache_multiple * last_level_cache_bytes(device)), free_bytes // 4) // 4 * 4


def copy_once(device: torch.device, plan: Plan) -> Bandwidth:
    """GB/s of a device-to-device copy, counting bytes read plus written (2 x size per copy, as STREAM's Copy
    kernel counts them; McCalpin, STREAM benchmark)."""
    n_bytes = buffer_bytes_for(device, plan)
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(1)  # touched: no page faults while timed
    dst = torch.empty_like(src)
    seconds, rse = median_seconds(
        lambda: dst.copy_(src), device, warmup=plan.warmup, warmup_s=plan.warmup_s, repeats=plan.repeats
    )
    return Bandwidth(gbps=2 * n_bytes / seconds / 1e9, rse=rse, n_bytes=n_bytes, repeats=plan.repeats)


def read_once(device: torch.device, plan: Plan) -> Bandwidth:
    """GB/s of a streaming read: the sum of a float32 buffer into one preallocated scalar, counting bytes read only.

    Why a reduction and not torch.mv: the roof is the memory's, not one kernel's. A reduction has a GEMV's traffic
    (each byte read once, a negligible output) without its arithmetic, so it shows what the memory delivers to a
    read stream; a GEMV that falls short of it is a kernel below the roof, which is what bw_util is there to show.
    (On the 2-core CPU this was written on, fp32 torch.mv reached about 0.7 of the sum's GB/s.) float32: every
    device sums it at full vector width, where bf16 on a CPU without AVX512-BF16 is converted and may bind on the
    arithmetic.
    """
    n_bytes = buffer_bytes_for(device, plan)
    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)  # [n_bytes / 4], written: no page faults later
    total = torch.empty((), dtype=torch.float32, device=device)
    seconds, rse = median_seconds(
        lambda: torch.sum(x, dim=0, out=total), device, warmup=plan.warmup, warmup_s=plan.warmup_s, repeats=plan.repeats
    )
    return Bandwidth(gbps=n_bytes / seconds / 1e9, rse=rse, n_bytes=n_bytes, repeats=plan.repeats)


def tightest(
    measure_once: Callable[[], Bandwidth], *, max_rse: float = MAX_RSE, max_tries: int = MAX_TRIES
) -> Bandwidth:
    """measure_once() until its spread is at most max_rse or max_tries measurements were taken; the one with the
    smallest spread, with `tries` set to how many were taken."""
    best = measure_once()
    tries = 1
    while best.rse > max_rse and tries < max_tries:
        again = measure_once()
        tries += 1
        log.info("bandwidth: spread %.3f over %.3f, measured again (try %d): %.3f", best.rse, max_rse, tries, again.rse)
        if again.rse < best.rse:
            best = again
    return replace(best, tries=tries)


def copy_bandwidth(device: torch.device, plan: Plan) -> Bandwidth:
    """The copy roof (bytes read + written), measured again while its spread is wide."""
    return tightest(lambda: copy_once(device, plan))


def read_bandwidth(device: torch.device, plan: Plan) -> Bandwidth:
    """The read roof (bytes read), measured again while its spread is wide: the roofline's roof for decode."""
    return tightest(lambda: read_once(device, plan))
