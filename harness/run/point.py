"""One sweep point, measured in this process: the only place where model, cache, timer and probes meet."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

from harness import kv
from harness.analytic import ledger, reuse, roofline_row
from harness.config import DTYPES, RunConfig
from harness.device import ceiling_report, ceilings
from harness.errors import Unsupported
from harness.formats import EXACT_REFERENCE
from harness.kv.base import CacheSpec
from harness.measure import accuracy, fragmentation, profile
from harness.measure.environment import environment_columns
from harness.measure.host_noise import HostNoiseWindow
from harness.measure.probes import MemoryProbe
from harness.measure.timing import Measurement, RepeatPolicy, Sample, StepTimer, convergence_columns, measure, summarize
from harness.modeling.decode import check_compilable, compile_decode_step, cudagraph_skips, generate
from harness.modeling.model import build_model, weights_bytes
from harness.run import prompts as prompt_sources
from harness.run.point_result import PointResult
from harness.store.schema import OPTION_COLUMNS

log = logging.getLogger(__name__)
# Decode steps the warm-up must run for a compiled step: torch.compile traces at the first call; CUDA graph trees
# (reduce-overhead) run the second as their own warm-up and record at the third. Only replays are timed.
COMPILE_WARMUP_STEPS = 3


def run_point(cfg: RunConfig) -> PointResult:
    """Build, warm up, measure; return the row (without sweep_id, which the caller knows) and the profiler's top ops."""
    device = cfg.torch_device()
    args = cfg.model_args()
    row = config_columns(cfg) | environment_columns(device)

    spec = cache_spec(cfg)
    if cfg.lengths == "mixed":  # an allocation measurement: no model, no timing
        return PointResult(row=row | fragmentation.waste_columns(cfg, spec) | {"status": "ok"})
    probe = MemoryProbe(device)
    probe.baseline()  # before the model loads
    with probe:
        # The cache first: a combination this device cannot run is `unsupported` before the model costs anything.
        cache = kv.build(cfg.cache["name"], spec, cfg.cache_options)
        if cfg.compile != "none":
            check_compilable(cache, mode=cfg.compile, device=device)
            if cfg.warmup * (cfg.gen_len - 1) < COMPILE_WARMUP_STEPS:  # compiling must not land in a timed run
                raise Unsupported(
                    f"compile: the warm-up generations run {cfg.warmup * (cfg.gen_len - 1)} decode steps, fewer than "
                    f"the {COMPILE_WARMUP_STEPS} that compile, warm up and record the step; raise warmup or gen_len"
                )
        model = build_model(
            args,
            weights=cfg.weights,
            dtype=DTYPES[cfg.dtype],
            device=device,
            seed=cfg.seed,
            n_positions=cfg.prompt_len + cfg.gen_len,
            mla_path=cfg.mla_path,
        )
        prompts = make_prompts(cfg, vocab_size=args.vocab_size)
        row["prompt_sha256"] = prompts.sha256
        prompt = prompts.ids
        prompt_ids = prompt.tolist()  # the ids on the host, where a prefix cache looks them up (as a server's are)
        prompt = prompt.to(device)
        step = compile_decode_step(model, cache, mode=cfg.compile) if cfg.compile != "none" else None
        skips_before = cudagraph_skips()  # a process-wide counter: this point's skips are its increase
        timer = StepTimer(device, n_marks=cfg.gen_len)
        outputs: list[torch.Tensor] = []
        kv_figures: dict[str, int] = {}

        def run_once():
            generated, sample = generate(model, cache, prompt, cfg.gen_len, timer, step=step, prompt_ids=prompt_ids)
            # Read at the peak, just before the sequences complete and give their storage back.
            kv_figures.update(
                kv_bytes_allocated=cache.kv_bytes_allocated(),
                kv_bytes_live=cache.kv_bytes_live(),
                kv_scale_bytes=cache.kv_scale_bytes(),
                kv_tail_bytes=cache.kv_tail_bytes(),
            )
            kv_figures.update(cache.peak_columns())  # the strategy's own: offload's kv_bytes_host, ...
            cache.release()
            outputs.append(generated)
            return sample

        policy = RepeatPolicy(
            warmup=cfg.warmup,
            min_repeats=cfg.min_repeats,
            max_repeats=cfg.max_repeats,
            max_time_s=cfg.max_time_s,
            target_rse=cfg.target_rse,
        )
        # The energy, clock and host-noise windows open after the warm-up (compilation included) and cover the kept
        # attempt's measured generations only.
        measurement, host_columns, retries = measure_with_retry(
            run_once, policy=policy, retry_noisy=cfg.retry_noisy, probe=probe
        )
        samples = measurement.samples
        probe.end_timed(n_tokens=len(samples) * cfg.batch_size * cfg.gen_len)
        # The strategy's own figures measured by more generations (a prefix cache: TTFT by where its prefix comes from)
        row |= cache.row_columns(lambda: run_once().ttft_ms, n=cfg.min_repeats)

    row |= summarize(samples, batch_size=cfg.batch_size, prompt_len=cfg.prompt_len)
    row |= convergence_columns(measurement) | host_columns | {"retries": retries}
    row |= kv_figures
    row["kv_waste_fraction"] = fragmentation.waste_fraction(
        allocated=row["kv_bytes_allocated"],
        overhead=row["kv_scale_bytes"] + row["kv_tail_bytes"],
        live=row["kv_bytes_live"],
    )
    row |= probe.columns()  # read before the accuracy pass, whose reference cache is not part of the point
    row |= probe.validity_columns()
    if cfg.roofline:
        row |= roofline_columns(cfg, args=args, tpot_ms=row["tpot_ms"], ttft_ms=row["ttft_ms"])
        if row.get("prefix_bytes_stored") is not None:
            row |= prefix_prediction_columns(cfg, args=args, prefix_bytes=row["prefix_bytes_stored"])
    top_ops = None
    # A separate pass: the timing above stays clean. It profiles eager decode steps, so a compiled point skips it
    # rather than attribute eager kernels to a compiled row.
    if cfg.profile and cfg.gen_len > 2 and cfg.compile == "none":
        trace = Path(cfg.results_dir) / "traces" / f"{row['point_id']}.json" if cfg.profile_trace else None
        prof_columns, top_ops = profile.profile_decode(
            model, cache, prompt, n_steps=min(cfg.profile_steps, cfg.gen_len - 2), device=device, trace_path=trace
        )
        row |= prof_columns
    if (cfg.accuracy and is_lossy(cfg)) or cfg.eval_text:
        row |= accuracy_columns(cfg, model=model, cache=cache, spec=spec, prompts=prompts)
    row["weights_bytes"] = weights_bytes(model)
    # The seed notes' formula, for the full length this point reserves: 2 x layers x tokens x kv_heads x head_dim
    # x bytes x batch. Contiguous storage must equal it exactly; the test suite holds it to that.
    row["kv_bytes_predicted"] = int(spec.batch_size * spec.max_tokens * spec.bytes_per_token)
    # The decode attention that ran: a strategy with its own kernel says which. Eager replaces SDPA wherever the
    # strategy calls it (and turns its kernels off): "sdpa-gather" ran as "eager-gather".
    backend = cache.attn_backend
    row["attn_backend"] = backend.replace("sdpa", "eager", 1) if cfg.attn_impl == "eager" else backend
    row["output_digest"] = digest(outputs[-1])
    row["status"] = "ok"
    if cfg.compile == "reduce-overhead":
        row["cudagraph_skips"] = skips = cudagraph_skips() - skips_before
        if skips:  # the figures are those of a compiled step without graphs: not what the row's compile column says
            row["status"] = "error"
            row["error"] = (
                f"compile=reduce-overhead: inductor skipped CUDA graphs {skips} time(s), so the step ran without "
                "them; TORCH_LOGS=perf_hints logs the reason"
            )
    return PointResult(row=row, ops=top_ops)


def measure_with_retry(
    run_once: Callable[[], Sample], *, policy: RepeatPolicy, retry_noisy: bool, probe: MemoryProbe
) -> tuple[Measurement, dict, int]:
    """The measured repeats the row keeps, the host noise over them, and how many attempts were retried (0 or 1).

    A first attempt that did not converge was disturbed (another process, a clock change) or is noisier than its
    budget allows: with retry_noisy it is measured once more with twice the budget (RepeatPolicy.retry: no warm-up,
    the model is warm), and only the retry's repeats are kept. Each attempt opens its own windows after its
    warm-up: the host noise window, and the probe's energy and clock window (NvmlSampler.open_window starts afresh),
    which the caller's probe.end_timed closes after the kept attempt, so that both cover the kept repeats alone.
    """
    host = HostNoiseWindow()

    def open_windows() -> None:
        probe.begin_timed()
        host.open()

    measurement = measure(run_once, policy, on_measure_start=open_windows)
    host_columns = host.columns()
    if measurement.converged or not retry_noisy:
        return measurement, host_columns, 0
    log.info(
        "not converged (%s after %d repeats): measuring again with twice the budget",
        measurement.stop_reason,
        len(measurement),
    )
    measurement = measure(run_once, policy.retry(), on_measure_start=open_windows)
    return measurement, host.columns(), 1


def cache_spec(cfg: RunConfig) -> CacheSpec:
    """The cache a point needs: its model's KV layout for batch_size sequences of prompt_len + gen_len tokens."""
    return CacheSpec.for_model(
        cfg.model_args(),
        batch_size=cfg.batch_size,
        max_tokens=cfg.prompt_len + cfg.gen_len,
        kv_dtype=cfg.kv_dtype_name,
        device=cfg.torch_device(),
        kv_group_size=cfg.kv_group_size,
        kv_residual=cfg.kv_residual,
        prefix_len=cfg.prefix_len,
        dtype=cfg.dtype,
        attn_impl=cfg.attn_impl,
        model_id=model_id(cfg),
    )


def model_id(cfg: RunConfig) -> str:
    """16 hex digits naming the weights whose K/V a point computes: the model's shape, its checkpoint (each file's
    name, size and mtime) or the seed of its random weights, and the compute dtype. A stored block of another
    model_id is never used (harness.kv.tiers)."""
    identity = {"args": dataclasses.asdict(cfg.model_args()), "dtype": cfg.dtype}
    if cfg.weights != "dummy":
        files = sorted(p for p in Path(cfg.weights).iterdir() if p.is_file())
        identity["weights"] = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    else:
        identity["seed"] = cfg.seed
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def roofline_columns(cfg: RunConfig, *, args, tpot_ms: float | None, ttft_ms: float | None = None) -> dict:
    """The analytic step model of this point beside this device's measured ceilings (null peaks if not measured).

    The memory roof is ceiling_report.row_columns()' choice (the read, or the copy for ceilings without one); bw_roof
    names it, and both measured bandwidths ride along."""
    stored = ceilings.read_stored(ceilings.ceilings_path(cfg.torch_device(), cfg.ceilings_dir or cfg.results_dir))
    peaks = ceiling_report.row_columns(stored, cfg.dtype) if stored else {}
    passed = ("ceilings_fingerprint", "bw_roof", "peak_read_bw_gbps", "peak_copy_bw_gbps")
    return roofline_row.roofline_columns(
        cfg,
        tpot_ms=tpot_ms,
        ttft_ms=ttft_ms,
        peak_bw_gbps=peaks.get("peak_bw_gbps"),
        peak_tflops=peaks.get("peak_tflops"),
    ) | {name: peaks.get(name) for name in passed}


def prefix_prediction_columns(cfg: RunConfig, *, args, prefix_bytes: int) -> dict:
    """The analytic load and compute times of the point's stored prefix, from this device's stored ceilings."""
    stored = ceilings.read_stored(ceilings.ceilings_path(cfg.torch_device(), cfg.ceilings_dir or cfg.results_dir))
    return reuse.predicted_columns(
        args,
        n_tokens=cfg.layout().prefix_tokens(cfg.kv_shape()),
        prefix_bytes=prefix_bytes,
        dtype=cfg.dtype,
        kv_dtype=cfg.kv_dtype_name,
        peaks=ceiling_report.row_columns(stored, cfg.dtype) if stored else {},
        disk_read_gbps=ceilings.tier_gbps(stored, "disk_read") if stored else None,
    )


def make_prompts(cfg: RunConfig, *, vocab_size: int) -> prompt_sources.Prompts:
    """The point's [B, prompt_len] prompts on the host, from its prompt_source (harness.run.prompts); the first
    prefix_len tokens shared by every sequence (a system prompt)."""
    if cfg.prompt_source_name == "random" and cfg.weights != "dummy":
        log.warning(
            "prompt_source=random on the checkpoint %s: its accuracy columns are taught on random ids, not on text",
            cfg.weights,
        )
    return prompt_sources.make_prompts(
        cfg.prompt_source,
        weights=cfg.weights,
        vocab_size=vocab_size,
        batch_size=cfg.batch_size,
        prompt_len=cfg.prompt_len,
        gen_len=cfg.gen_len,
        prefix_len=cfg.prefix_len,
        seed=cfg.seed,
        prompt_text=cfg.prompt_text,
        dataset_path=cfg.dataset_path,
    )


def is_lossy(cfg: RunConfig) -> bool:
    """K/V stored narrower than they are computed, or dropped (a sliding window): accuracy is then measured."""
    return cfg.kv_dtype_name != cfg.dtype or cfg.layout().lossy


def accuracy_columns(cfg: RunConfig, *, model, cache, spec: CacheSpec, prompts: prompt_sources.Prompts) -> dict:
    """Teacher-forced logits through this point's cache against the exact cache (contiguous at the compute dtype).

    The forced history is the prompts' own text where they have one (a real continuation: ShareGPT's reply, the
    text file's next tokens), else the exact cache's greedy continuation. With a real continuation the perplexity of
    that text is measured from the same logits (ppl_source names the prompt source); eval_text, when given, is the
    perplexity's text instead."""
    exact_spec = dataclasses.replace(spec, kv_dtype=cfg.dtype)
    exact = kv.build(EXACT_REFERENCE, exact_spec, {})
    prompt = prompts.ids.to(spec.device)
    columns = {}
    if cfg.accuracy and is_lossy(cfg):
        if prompts.continuation is not None:
            forced = prompts.continuation.to(spec.device)
        else:  # random ids have no text after them: the exact cache's own greedy continuation
            forced, _ = generate(model, exact, prompt, cfg.gen_len, StepTimer(spec.device, n_marks=cfg.gen_len))
            exact.release()
        exact_logits = accuracy.teacher_forced_logits(model, exact, prompt, forced)
        lossy_logits = accuracy.teacher_forced_logits(model, cache, prompt, forced)
        columns |= accuracy.compare(exact_logits, lossy_logits)
        if prompts.continuation is not None and not cfg.eval_text:
            columns |= ppl_columns(lossy_logits, exact_logits, forced, source=prompts.source)
    if cfg.eval_text:
        windows = accuracy.text_windows(
            cfg.eval_text, cfg.weights, batch_size=cfg.batch_size, length=cfg.prompt_len + cfg.gen_len
        ).to(spec.device)
        text_prompt, targets = windows[:, : cfg.prompt_len], windows[:, cfg.prompt_len :]
        lossy_logits = accuracy.teacher_forced_logits(model, cache, text_prompt, targets)
        exact_logits = accuracy.teacher_forced_logits(model, exact, text_prompt, targets)
        columns |= ppl_columns(lossy_logits, exact_logits, targets, source="eval_text")
    return columns


def ppl_columns(lossy_logits, exact_logits, targets, *, source: str) -> dict:
    """The perplexity of `targets` through the point's cache, its delta to the exact cache's, and the text's source."""
    ppl = accuracy.perplexity(lossy_logits, targets)
    return {"ppl": ppl, "ppl_delta": ppl - accuracy.perplexity(exact_logits, targets), "ppl_source": source}


def digest(token_ids: torch.Tensor) -> str:
    """sha256 of the generated ids, so that runs can be compared for equality across strategies and devices."""
    return hashlib.sha256(token_ids.to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()


def config_columns(cfg: RunConfig) -> dict:
    """The identity and config columns, known before anything runs (a failed point records these too)."""
    args = cfg.model_args()
    return {
        "point_id": cfg.point_id(),
        "model": args.name,
        "n_params": args.n_params,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "dtype": cfg.dtype,
        "kv_dtype": cfg.kv_dtype_name,
        "cache": cfg.cache["name"],
        # Strategy options that are columns of their own (harness.store.schema); null for strategies without them.
        **dict.fromkeys(OPTION_COLUMNS),
        **cfg.layout().option_columns(),
        "kv_group_size": cfg.kv_group_size if cfg.kv_dtype_name == "int4" else None,
        "kv_residual": cfg.kv_residual if cfg.kv_dtype_name == "int4" else None,
        "prefix_len": cfg.prefix_len,
        "lengths": cfg.lengths,
        "min_len_frac": cfg.min_len_frac if cfg.lengths == "mixed" else None,
        "eval_text": cfg.eval_text,
        "prompt_source": cfg.prompt_source_name,
        "prompt_text": cfg.prompt_text,
        "batch_size": cfg.batch_size,
        "prompt_len": cfg.prompt_len,
        "gen_len": cfg.gen_len,
        "device": cfg.torch_device().type,
        "weights": cfg.weights,
        "runner": "kvbench",
        "compile": cfg.compile,
        "attn_impl": cfg.attn_impl,
        "mla_path": cfg.mla_path if args.is_mla else None,
        "kv_lora_rank": args.kv_lora_rank,
        "moe_as_dense": args.moe_as_dense,
        "seed": cfg.seed,
        "max_memory_gb": cfg.max_memory_gb,
        "kv_bytes_planner": planner_kv_bytes(cfg),
        # Everything, as resolved: `kvbench-results diff` lists what changed between two rows.
        "config_json": config_json(cfg),
    }


def planner_kv_bytes(cfg: RunConfig) -> int | None:
    """The planner's KV bytes for the point (harness.analytic.ledger, analytic: what its strategy allocates at the peak
    of a generation of prompt_len + gen_len tokens), or None where it cannot stand for the point: mixed lengths (the
    pool holds the drawn lengths) or a workload the planner refuses."""
    if cfg.lengths == "mixed":
        return None
    try:
        return ledger.workload_kv_bytes(cfg.workload())
    except (ValueError, Unsupported) as exc:  # ConfigError included: a workload the planner refuses
        log.info("no planner figure for %s: %s", cfg.point_id(), exc)
        return None


def config_json(cfg: RunConfig) -> str:
    """The whole RunConfig as strict JSON (sorted keys), readable by any JSON parser: a non-finite float (say
    max_time_s=inf) is written as its string, and anything JSON has no type for (a Path) as str()."""
    return json.dumps(_json_safe(dataclasses.asdict(cfg)), sort_keys=True, allow_nan=False, default=str)


def _json_safe(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan": json.dumps would write Infinity/NaN, which is not JSON
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value
