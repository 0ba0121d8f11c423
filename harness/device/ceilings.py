"""Measured device ceilings: peak memory bandwidth and matmul throughput per dtype, stored once per device.

A roofline needs two ceilings, and here they are measured, not looked up (nanoGPT's bench.py hard-codes A100's
312 TFLOP/s; that is the one thing not to copy from it). Bandwidth is measured twice over a buffer several times the
last-level cache (harness/device/bandwidth.py): a streaming read, the roof of a decode step (a GEMV only reads), and a copy
(read + write, STREAM's Copy), kept for comparison. Throughput comes from a square matmul on random data at a size
that fills the device. All follow bench.py's discipline (harness/device/ceiling_timing.py): warm-up excluded, the device
synchronized at both ends, the median of several repeats with its spread; a bandwidth whose spread is wide is
measured again.

The figures depend on the device and little else, so they are stored per device fingerprint as
<results_dir>/ceilings/<fingerprint>.json and reused: `load_or_measure` measures only the first time. Published
spec peaks (harness/device/spec_peaks.csv, one citation per row) sit beside them for comparison, never in their place.
What a stored Ceilings reports (a decode row's roof and columns, the printed table) is harness/device/ceiling_report.py.

Units: GB = 1e9 bytes, TFLOP = 1e12 floating-point operations.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from harness.config import device_type
from harness.device import bandwidth
from harness.device.ceiling_timing import median_seconds, one_call_seconds
from harness.device.spec import SPEC_PEAKS_CSV, spec_for, spec_peaks  # noqa: F401 (part of this module's API)
from harness.kv.quant import FP8, PLAIN
from harness.measure.environment import device_name  # the CUDA device's or the CPU's name
from harness.store.atomic import atomic_write

log = logging.getLogger(__name__)

# Bump when the method changes (sizes, counting, dtypes): it is part of the fingerprint, so stored ceilings measured
# the old way are not reused.
# 2: warm-up by time (Plan.warmup_s), not by a fixed count of calls. 3: a streaming-read roof beside the copy, each
# measured again while its spread is wide; the spread is harness.measure.stats' bootstrap.
METHOD_VERSION = 3
# The matmuls timed, in this order, by name -> torch dtype, from the one table (harness.kv.quant's PLAIN and FP8).
# fp8_e4m3: torch._scaled_mm, CUDA compute capability >= 8.9 (Ada, Hopper and newer).
MATMUL_DTYPES = {name: PLAIN[name] for name in ("fp32", "bf16", "fp16")} | {"fp8_e4m3": FP8["fp8_e4m3"]}
FP8_MIN_CAPABILITY = (8, 9)  # the first with FP8 tensor cores: Ada (sm_89), per the CUDA C Programming Guide
CPU_MATMUL_N_MIN = 256  # the CPU size search starts here and doubles


@dataclass(frozen=True)
class Plan:
    """How hard to measure. FULL for figures to quote; QUICK for tests (small sizes, few repeats)."""

    copy_cache_multiple: float  # the copy and read buffers are this many times the last-level cache: from memory
    warmup: int  # at least this many untimed calls before the repeats (allocator, first touch, cuBLAS heuristics)
    warmup_s: float  # ... and untimed calls until this many seconds have passed (clocks ramping up from idle)
    repeats: int  # timed calls; the figure is their median
    cuda_matmul_n: int  # m = n = k on CUDA: 8192^3 keeps every SM busy on an H100/H200
    cpu_matmul_n_max: int  # CPU: n doubles from CPU_MATMUL_N_MIN up to this ...
    cpu_matmul_target_s: float  # ... while the next size's predicted time (8x: n^3) stays under this
    cpu_dtype_budget_s: float  # CPU: fewer repeats (never under 3) when one product is slow (fp16 without AVX512-FP16)


# A GPU coming from idle raises its clocks over the first few hundred milliseconds of load, and a few untimed
# calls (a copy takes well under a millisecond) end long before that: the warm-up lasts half a second, a tenth of
# a second for QUICK, whose figures are not for quoting.
FULL = Plan(
    copy_cache_multiple=8,
    warmup=2,
    warmup_s=0.5,
    repeats=10,
    cuda_matmul_n=8192,
    cpu_matmul_n_max=4096,
    cpu_matmul_target_s=0.25,
    cpu_dtype_budget_s=2.0,
)
# QUICK's buffers are just past the last-level cache (a sequential stream through an LRU cache smaller than it misses
# every line): its figures are not for quoting, and a test or a SLURM job on a machine whose shared L3 is large (480
# MiB seen here) must not hold two buffers of 4x that (3.8 GB, past `make slurm-check`'s 4 GB job).
QUICK = Plan(
    copy_cache_multiple=1.25,
    warmup=1,
    warmup_s=0.1,
    repeats=3,
    cuda_matmul_n=2048,
    cpu_matmul_n_max=512,
    cpu_matmul_target_s=0.02,
    cpu_dtype_budget_s=0.2,
)


@dataclass(frozen=True)
class Ceilings:
    """What one device sustains, measured: the roofs of its roofline."""

    fingerprint: str  # device_fingerprint(): the key these figures are stored and reused under
    device: str  # "cpu" or "cuda"
    device_name: str
    n_threads: int | None  # CPU: torch.get_num_threads() while measuring; None on CUDA
    n_sms: int | None  # CUDA: streaming multiprocessors; None on CPU
    total_memory_bytes: int
    # The copy's GB/s, bytes read + written, GB = 1e9. The name predates the read roof and is kept: stored JSON and
    # callers that build a Ceilings use it. A row's peak_bw_gbps is ceiling_report.row_columns()' roof, not
    # necessarily this.
    peak_bw_gbps: float
    peak_tflops: dict[str, float]  # dtype name -> dense matmul TFLOP/s (2*m*n*k, T = 1e12); unsupported dtypes absent
    skipped: dict[str, str]  # dtype name -> why it was not measured on this device
    median_rse: dict[str, float]  # "copy", "read" and each dtype -> relative standard error of the median (spread)
    copy_bytes: int  # size of one copy buffer (each copy reads and writes this many); the read streams as many
    matmul_n: dict[str, int]  # dtype name -> m = n = k used
    repeats: dict[str, int]  # "copy", "read" and each dtype -> timed repeats behind the median
    quick: bool  # measured with the QUICK plan: fine for tests, not for quoting
    fp32_matmul_precision: str  # torch.get_float32_matmul_precision(): "highest" = true fp32, else TF32 is allowed
    measured_at: str  # ISO 8601, UTC
    torch_version: str
    method_version: int = METHOD_VERSION
    # Since METHOD_VERSION 3; the defaults let stored version-2 JSON load (and load_or_measure then measures again).
    read_bw_gbps: float | None = None  # streaming read (a float32 sum), bytes read only, GB = 1e9: the decode roof
    tries: dict[str, int] = field(default_factory=dict)  # "copy", "read" -> measurements taken, the tightest kept
    # The tiers experiment's figures (harness/movement/tier_bandwidth.py), measured on this device at its largest block:
    # "d2h", "h2d" (device <-> host tier), "disk_write", "disk_read" -> GB/s, GB = 1e9. Stored beside the roofs
    # without a METHOD_VERSION bump (the roofs are unchanged); the defaults let JSON stored before them load.
    tier_gbps: dict[str, float] = field(default_factory=dict)
    tier_block_bytes: int | None = None  # bytes of one block behind tier_gbps
    tier_disk_dir: str | None = None  # where the disk figures' block files were written
    tier_direct_io: bool | None = None  # the disk figures bypassed the page cache (O_DIRECT)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Ceilings:
        return cls(**json.loads(text))


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device for a config value: auto is cuda when available, else cpu."""
    if isinstance(device, torch.device):
        return device
    return torch.device(device_type(device))


def device_identity(device: torch.device) -> dict:
    """What determines the ceilings. Anything else (host name, clocks, load) is noise, not identity."""
    torch_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    identity = {"device": device.type, "name": device_name(device), "torch": torch_minor, "method": METHOD_VERSION}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return identity | {
            "n_sms": props.multi_processor_count,
            "total_memory_bytes": props.total_memory,
            "cuda": torch.version.cuda,  # the cuBLAS that runs the matmuls comes with it
        }
    return identity | {
        "n_cores": os.cpu_count(),
        "n_threads": torch.get_num_threads(),
        "total_memory_bytes": psutil.virtual_memory().total,
    }


def device_fingerprint(device: str | torch.device) -> str:
    """A short stable hash of device_identity(), prefixed with the device type: e.g. "cpu-3f2a9c01b7de"."""
    device = resolve_device(device)
    blob = json.dumps(device_identity(device), sort_keys=True).encode()
    return f"{device.type}-{hashlib.sha256(blob).hexdigest()[:12]}"


def unsupported_reason(device: torch.device, dtype_name: str) -> str | None:
    """Why this device cannot run a dense matmul in this dtype, or None when it can."""
    if dtype_name == "fp8_e4m3":
        if device.type != "cuda":
            return "fp8 matmul (torch._scaled_mm) needs CUDA compute capability >= 8.9; not measured on cpu"
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            return f"fp8 matmul needs compute capability >= 8.9; this device has {capability[0]}.{capability[1]}"
    if dtype_name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "bf16 matmul needs compute capability >= 8.0 (Ampere)"
    return None


def matmul_call(device: torch.device, dtype_name: str, n: int) -> Callable[[], torch.Tensor]:
    """One n x n x n product on seeded random data, its output preallocated so that no allocation is timed."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((n, n), generator=generator, device=device)  # [n, n] fp32, cast below
    b = torch.randn((n, n), generator=generator, device=device)
    if dtype_name == "fp8_e4m3":
        a8 = a.to(torch.float8_e4m3fn)  # randn stays well inside e4m3's range (+-448)
        b8 = b.to(torch.float8_e4m3fn).t()  # _scaled_mm wants the second operand column-major
        scale = torch.ones((), device=device)  # per-tensor fp32 scales
        out = torch.empty((n, n), dtype=torch.bfloat16, device=device)
        # Fast accumulation, as torchao's float8 forward GEMM uses: the path inference takes.
        return lambda: torch._scaled_mm(
            a8, b8, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16, use_fast_accum=True, out=out
        )
    dtype = MATMUL_DTYPES[dtype_name]
    a, b = a.to(dtype), b.to(dtype)
    out = torch.empty((n, n), dtype=dtype, device=device)
    return lambda: torch.mm(a, b, out=out)


def matmul_throughput(device: torch.device, dtype_name: str, plan: Plan) -> tuple[float, float, int, int]:
    """TFLOP/s of a square matmul at a size that fills the device. Returns (TFLOP/s, median rse, n, repeats).

    CUDA: plan.cuda_matmul_n. CPU: n doubles while the next size is predicted to stay under the plan's target, so a
    dtype without native support (fp16 on most x86) settles on a small n instead of taking a minute per product.
    """
    repeats = plan.repeats
    if device.type == "cuda":
        n = plan.cuda_matmul_n
        fn = matmul_call(device, dtype_name, n)
    else:
        n = CPU_MATMUL_N_MIN
        fn = matmul_call(device, dtype_name, n)
        seconds = one_call_seconds(fn, device)
        while n < plan.cpu_matmul_n_max and 8 * seconds <= plan.cpu_matmul_target_s:  # 2n: 8x the FLOPs
            n *= 2
            fn = matmul_call(device, dtype_name, n)
            seconds = one_call_seconds(fn, device)
        repeats = min(plan.repeats, max(3, int(plan.cpu_dtype_budget_s / max(seconds, 1e-9))))
    seconds, rse = median_seconds(fn, device, warmup=plan.warmup, warmup_s=plan.warmup_s, repeats=repeats)
    return 2 * n**3 / seconds / 1e12, rse, n, repeats


def measure(device: str | torch.device, *, quick: bool = False) -> Ceilings:
    """Measure this device's ceilings now (a few seconds on a CPU, about as long on a GPU)."""
    device = resolve_device(device)
    plan = QUICK if quick else FULL
    identity = device_identity(device)
    copy = bandwidth.copy_bandwidth(device, plan)
    read = bandwidth.read_bandwidth(device, plan)
    peak_tflops: dict[str, float] = {}
    skipped: dict[str, str] = {}
    rse: dict[str, float] = {"copy": copy.rse, "read": read.rse}
    matmul_n: dict[str, int] = {}
    repeats: dict[str, int] = {"copy": copy.repeats, "read": read.repeats}
    for dtype_name in MATMUL_DTYPES:
        reason = unsupported_reason(device, dtype_name)
        if reason is not None:
            skipped[dtype_name] = reason
            continue
        try:
            tflops, rse[dtype_name], matmul_n[dtype_name], repeats[dtype_name] = matmul_throughput(
                device, dtype_name, plan
            )
        except (RuntimeError, NotImplementedError) as exc:  # a build or driver without this kernel: record why
            skipped[dtype_name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            continue
        peak_tflops[dtype_name] = tflops
    log.info(
        "ceilings measured on %s: read %.1f GB/s, copy %.1f GB/s, %s TFLOP/s",
        identity["name"],
        read.gbps,
        copy.gbps,
        peak_tflops,
    )
    return Ceilings(
        fingerprint=device_fingerprint(device),
        device=device.type,
        device_name=identity["name"],
        n_threads=identity.get("n_threads"),
        n_sms=identity.get("n_sms"),
        total_memory_bytes=identity["total_memory_bytes"],
        peak_bw_gbps=copy.gbps,
        read_bw_gbps=read.gbps,
        tries={"copy": copy.tries, "read": read.tries},
        peak_tflops=peak_tflops,
        skipped=skipped,
        median_rse=rse,
        copy_bytes=copy.n_bytes,
        matmul_n=matmul_n,
        repeats=repeats,
        quick=quick,
        fp32_matmul_precision=torch.get_float32_matmul_precision(),
        measured_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__,
    )


def ceilings_path(device: str | torch.device, results_dir: str | Path) -> Path:
    return Path(results_dir) / "ceilings" / f"{device_fingerprint(device)}.json"


def read_stored(path: Path) -> Ceilings | None:
    """The stored ceilings at `path`, or None when there are none or they cannot be read (then: measure again)."""
    if not path.exists():
        return None
    try:
        return Ceilings.from_json(path.read_text())
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ceilings: cannot read %s (%s); measuring again", path, exc)
        return None


def load_or_measure(
    device: str | torch.device, results_dir: str | Path, quick: bool = False, *, force: bool = False
) -> Ceilings:
    """This device's stored ceilings, measured and stored first if there are none for its fingerprint.

    A quick measurement never stands in for a full one: asking for full figures replaces stored quick ones. Nor does
    one measured by another METHOD_VERSION (a version-2 file has no read roof), should one sit under this
    fingerprint. `force` measures again regardless.
    """
    device = resolve_device(device)
    path = ceilings_path(device, results_dir)
    stored = None if force else read_stored(path)
    if stored is not None and stored.method_version != METHOD_VERSION:
        log.info(
            "ceilings: %s was measured by method %d, not %d; measuring again",
            path,
            stored.method_version,
            METHOD_VERSION,
        )
    elif stored is not None and (quick or not stored.quick):
        log.info("ceilings: reusing %s (measured %s)", path, stored.measured_at)
        return stored
    ceilings = measure(device, quick=quick)
    previous = stored if stored is not None else read_stored(path) if force else None
    if previous is not None and previous.tier_gbps:  # the same device's tier figures stay valid: keep them
        ceilings = dataclasses.replace(ceilings, **tier_fields(previous))
    text = ceilings.to_json()
    atomic_write(path, lambda f: f.write(text.encode()))  # a reader sees the old file or the new one
    log.info("ceilings: stored %s", path)
    return ceilings


TIER_FIGURES = ("d2h", "h2d", "disk_write", "disk_read")  # the keys of Ceilings.tier_gbps


def tier_fields(ceilings: Ceilings) -> dict:
    return {
        name: getattr(ceilings, name) for name in ("tier_gbps", "tier_block_bytes", "tier_disk_dir", "tier_direct_io")
    }


def store_tier_figures(
    path: str | Path,
    ceilings: Ceilings,
    *,
    gbps: dict[str, float],
    block_bytes: int,
    disk_dir: str | Path,
    direct_io: bool,
) -> Ceilings:
    """`ceilings` with the tiers experiment's figures, rewritten atomically to `path`; every other field is kept."""
    unknown = sorted(set(gbps) - set(TIER_FIGURES))
    if unknown:
        raise ValueError(f"tier_gbps: unknown figure {unknown[0]!r}; allowed: {', '.join(TIER_FIGURES)}")
    updated = dataclasses.replace(
        ceilings,
        tier_gbps={name: float(value) for name, value in gbps.items()},
        tier_block_bytes=int(block_bytes),
        tier_disk_dir=str(disk_dir),
        tier_direct_io=bool(direct_io),
    )
    text = updated.to_json()
    atomic_write(path, lambda f: f.write(text.encode()))
    return updated


def tier_gbps(ceilings: Ceilings, name: str) -> float | None:
    """A stored tier figure in GB/s ("d2h", "h2d", "disk_write", "disk_read"), or None when not measured."""
    if name not in TIER_FIGURES:
        raise ValueError(f"tier: unknown figure {name!r}; allowed: {', '.join(TIER_FIGURES)}")
    value = ceilings.tier_gbps.get(name)
    return float(value) if value is not None and math.isfinite(value) and value > 0 else None
