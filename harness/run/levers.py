"""`make bench`'s levers: what each candidate change to our decode loop does to its step, measured side by side.

At one case (the bench's model in fp32 at batch 1, where decode is a stream of the weights), our bare loop
(harness.run.versus: no probes) runs as a baseline and as one variant per lever, all in the same interleaved rounds
(versus.interleave), so that a neighbour's load on a shared host hits every variant alike. The baseline is what the
harness runs by default: q|k|v and gate|up fused, the step eager, torch's own thread count and affinity.

    fused     the baseline against a model that keeps the checkpoint's separate q, k, v and gate, up projections
              (build_model(fused=False)): five GEMV calls a layer instead of two, the same bytes read
    compile   the decode step under torch.compile(mode=default) (harness.modeling.decode.compile_decode_step), on
              the CPU with inductor's freezing and weight prepacking (the linears become oneDNN/MKL packed linears);
              its compile time, which no TPOT includes, is measured apart (compile_s)
    threads   torch.set_num_threads(physical cores) and the process's threads pinned one per physical core
              (os.sched_setaffinity); on the CPU only, where the GEMVs run on those threads

Each lever's effect is a speedup, the TPOT without it over the TPOT with it (> 1: the lever helps), and it is kept
only where that exceeds the rounds' spread (the larger TPOT cv of the two): a smaller difference is noise on a
shared host. The verdict is per device, from this run's figures; the defaults in the code follow the figures
README.md reports. Every variant's row is the bare loop's, with its `lever` column naming the variant.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import psutil
import torch

from harness import kv
from harness.config import DTYPES, RunConfig
from harness.errors import ConfigError
from harness.measure.timing import Sample
from harness.modeling.decode import compile_decode_step, generate
from harness.modeling.model import Transformer, build_model, weights_bytes
from harness.run import versus, versus_table
from harness.run.point import cache_spec, make_prompts

log = logging.getLogger(__name__)

OFF = "none"  # --levers none: no levers section (a word of the option, not the cache strategy of that name)
LEVERS = ("fused", "compile", "threads")  # what --levers takes
BASELINE = "baseline"  # the `lever` column of the baseline's row: fused, eager, torch's threads
# The `lever` column of each lever's variant: the one thing it changes from the baseline.
VARIANTS = {"fused": "unfused", "compile": "compiled", "threads": "pinned-threads"}
# Whose TPOT is the "lever on" one: fusing is on in the baseline and off in its variant; the others the reverse.
ON_IN_BASELINE = {"fused"}


def check_levers(names: list[str], *, device: torch.device) -> list[str]:
    """The levers to measure on this device, in LEVERS order; ConfigError for one it does not know. threads is a
    CPU lever: on CUDA it is left out (logged), since the step's work is not on those threads."""
    for name in names:
        if name not in LEVERS:
            raise ConfigError(f"levers: unknown lever {name!r}; allowed: {', '.join(LEVERS)} or none")
    if device.type != "cpu" and "threads" in names:
        log.info("levers: threads is a CPU lever; left out on %s", device.type)
        names = [name for name in names if name != "threads"]
    return [name for name in LEVERS if name in names]


# --- threads ------------------------------------------------------------------------------------------------------


def physical_cores() -> int:
    """This host's physical cores (psutil), or its logical CPUs where psutil cannot tell."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def core_cpus() -> list[int]:
    """One logical CPU per physical core among those this process may run on: the lowest-numbered sibling of each
    core (Linux's /sys/devices/system/cpu/cpuN/topology/thread_siblings_list); where the topology cannot be read,
    the first physical_cores() CPUs of the affinity."""
    allowed = sorted(os.sched_getaffinity(0))
    firsts = []
    for cpu in allowed:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        if not siblings.is_file():
            return allowed[: physical_cores()]
        first = siblings.read_text().strip().replace("-", ",").split(",")[0]
        if int(first) == cpu:
            firsts.append(cpu)
    return firsts or allowed[: physical_cores()]


def _set_affinity(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (a thread's affinity is its own: setting pid 0 moves only the caller,
    and the intra-op pool's threads exist already)."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


@contextlib.contextmanager
def pinned_threads() -> Iterator[int]:
    """torch's intra-op threads set to one per physical core, the process pinned to those cores; both restored on
    exit. Yields the thread count."""
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    cpus = core_cpus()
    torch.set_num_threads(len(cpus))
    _set_affinity(set(cpus))
    try:
        yield len(cpus)
    finally:
        torch.set_num_threads(threads)
        _set_affinity(affinity)


# --- the variants -------------------------------------------------------------------------------------------------


def _bare_loop(
    model: Transformer, cache: Any, prompt: torch.Tensor, *, gen_len: int, step=None, threads: bool = False
) -> Callable[[], tuple[torch.Tensor, Sample]]:
    """versus.our_loop's bare loop, with a decode step of its own (a compiled one) and optionally pinned threads."""
    device = prompt.device
    timer = versus.BareTimer(device, n_marks=gen_len)

    def run_once() -> tuple[torch.Tensor, Sample]:
        with pinned_threads() if threads else contextlib.nullcontext():
            generated, sample = generate(model, cache, prompt, gen_len, timer, step=step)
        cache.release()
        return generated, sample

    return run_once


def _wall_s(run_once: Callable[[], Any]) -> float:
    started = time.perf_counter()
    run_once()
    return time.perf_counter() - started


def measure_levers(
    cfg: RunConfig, *, model: Transformer, checkpoint: str | Path, levers: list[str], rounds: int, warmup: int = 1
) -> list[dict]:
    """The baseline and each lever's variant of our bare loop at this case, interleaved; a row per variant, the
    baseline's first. model: ours as the baseline runs it (fused, eager), loaded from `checkpoint`."""
    device = cfg.torch_device()
    prompt = make_prompts(cfg, vocab_size=model.args.vocab_size).ids.to(device)

    def new_cache() -> Any:  # one per variant: a compiled step turns its cache to static-shape attention
        return kv.build(versus.STRATEGY, cache_spec(cfg), {})

    loops = {BASELINE: _bare_loop(model, new_cache(), prompt, gen_len=cfg.gen_len)}
    models = {BASELINE: model}
    compile_s: float | None = None
    if "fused" in levers:
        unfused = build_model(
            model.args,
            weights=str(checkpoint),
            dtype=DTYPES[cfg.dtype],
            device=device,
            seed=cfg.seed,
            n_positions=cfg.prompt_len + cfg.gen_len,
            fused=False,
        )
        models[VARIANTS["fused"]] = unfused
        loops[VARIANTS["fused"]] = _bare_loop(unfused, new_cache(), prompt, gen_len=cfg.gen_len)
    if "compile" in levers:
        cache = new_cache()
        torch._dynamo.reset()  # a fresh compilation, timed below, whatever compiled before in this process
        step = compile_decode_step(model, cache, mode="default", freeze=device.type == "cpu")
        compiled = _bare_loop(model, cache, prompt, gen_len=cfg.gen_len, step=step)
        # Compile time apart from any TPOT: the first generation (which compiles) over an eager one.
        eager_s = _wall_s(loops[BASELINE])
        compile_s = max(0.0, _wall_s(compiled) - eager_s)
        log.info("levers: the decode step compiled in %.1f s", compile_s)
        models[VARIANTS["compile"]] = model
        loops[VARIANTS["compile"]] = compiled
    if "threads" in levers:
        models[VARIANTS["threads"]] = model
        loops[VARIANTS["threads"]] = _bare_loop(model, new_cache(), prompt, gen_len=cfg.gen_len, threads=True)
    measured = versus.interleave(loops, rounds=rounds, warmup=warmup)
    rows = []
    for name, results in measured.items():
        row = versus.loop_row(
            cfg, loop=versus.BARE, samples=[sample for _, sample in results], tokens=results[-1][0], lever=name
        )
        row |= {
            "compile": "default" if name == VARIANTS["compile"] else cfg.compile,
            "compile_s": compile_s if name == VARIANTS["compile"] else None,
            "weights_bytes": weights_bytes(models[name]),
        }
        rows.append(row)
    return rows


# --- the table ----------------------------------------------------------------------------------------------------


def lever_speedup(rows: list[dict], lever: str) -> float:
    """The lever's speedup in these rows: TPOT with the lever off over TPOT with it on (> 1: it helps)."""
    by_lever = {row["lever"]: row for row in rows}
    base, variant = by_lever[BASELINE]["tpot_ms"], by_lever[VARIANTS[lever]]["tpot_ms"]
    return variant / base if lever in ON_IN_BASELINE else base / variant


def lever_verdict(rows: list[dict], lever: str) -> str:
    """keep where the lever's speedup exceeds the rounds' spread (the larger TPOT cv of its two rows), drop where
    its slowdown does; within that spread, noise: the default stays as it is."""
    by_lever = {row["lever"]: row for row in rows}
    noise = max(by_lever[BASELINE].get("tpot_cv") or 0.0, by_lever[VARIANTS[lever]].get("tpot_cv") or 0.0)
    gain = lever_speedup(rows, lever)
    if gain > 1 + noise:
        return "keep"
    if gain < 1 - noise:
        return "drop"
    return "noise"


def read_roof_fraction(row: dict) -> float | None:
    """bytes_per_step (weights + KV read) / TPOT over the measured streaming-read bandwidth (peak_read_bw_gbps)."""
    return versus_table.bw_fraction(
        bytes_per_step=row["bytes_per_step"], tpot_ms=row["tpot_ms"], peak_bw_gbps=row.get("peak_read_bw_gbps")
    )


def levers_table(rows: list[dict]) -> pd.DataFrame:
    """One line per variant: its TPOT and tokens/s, its share of the read roof, its spread; then, on each lever's
    line, the lever's speedup and verdict (and the compile time). As text cells."""
    base = next(row for row in rows if row["lever"] == BASELINE)
    lever_of = {variant: lever for lever, variant in VARIANTS.items()}
    lines = []
    for row in rows:
        lever = lever_of.get(row["lever"])
        same = row["output_digest"] == base["output_digest"]
        lines.append(
            {
                "variant": row["lever"],
                "lever": lever or "-",
                "tok/s": f"{row['decode_tok_s']:.1f}",
                "TPOT ms": f"{row['tpot_ms']:.2f}",
                "read roof": _percent(read_roof_fraction(row)),
                "TPOT cv": _percent(row.get("tpot_cv"), digits=1),
                "lever on/off": "-" if lever is None else f"{lever_speedup(rows, lever):.2f}x",
                "verdict": "-" if lever is None else lever_verdict(rows, lever),
                "compile s": "-" if row.get("compile_s") is None else f"{row['compile_s']:.1f}",
                "same tokens": "-" if lever is None else ("yes" if same else "no"),
            }
        )
    return pd.DataFrame(lines)


def format_levers(rows: list[dict]) -> str:
    """The levers' table with what its columns mean."""
    first = rows[0]
    note = (
        f"levers: {first['model']} {first['dtype']} batch {first['batch_size']}, our bare loop, medians over "
        f"{first.get('repeats')} interleaved rounds; baseline = fused q|k|v and gate|up, eager, torch's threads; "
        "lever on/off = TPOT without the lever / TPOT with it (unfused/baseline for fused, baseline/variant for the "
        "others; > 1: it helps); verdict keep or drop where that is beyond the larger TPOT cv, noise within it; read "
        f"roof = bytes_per_step / TPOT over the streaming read ({_gbps(first.get('peak_read_bw_gbps'))}); compile s: "
        "the compiling generation's wall time over an eager one's, in no TPOT; same tokens: as the baseline's (a "
        "compiled or unfused step sums in another order, so a near-tie may flip a token)"
    )
    return levers_table(rows).to_string(index=False) + "\n" + note


def _percent(fraction: float | None, *, digits: int = 0) -> str:
    return "-" if fraction is None else f"{100 * fraction:.{digits}f}%"


def _gbps(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.1f} GB/s"
