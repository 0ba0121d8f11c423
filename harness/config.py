"""The run configuration: one dataclass schema, and the one place where input is validated.

Hydra composes `conf/` onto these dataclasses (registered in its ConfigStore by `experiments/decode.py`); the
harness only ever sees a validated `RunConfig`. Every check here is cheap and runs before a model is built, so bad
input fails in a second with one line naming the field and what it allows, and nothing is recorded.
"""

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness import kv
from harness.errors import ConfigError
from harness.kv.quant import BITS
from harness.model import ModelArgs, load_args

# Compute dtypes by name, and KV storage formats: "auto" stores K/V in the compute dtype, as vLLM's default does;
# the quantized formats are codecs (harness/kv/quant.py).
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KV_DTYPES = ("auto", *BITS)
KV_GROUP_SIZES = (32, 64)
DEVICES = ("auto", "cpu", "cuda")
LENGTHS = ("fixed", "mixed")
COMPILE_MODES = ("none", "default", "reduce-overhead")  # torch.compile modes of the decode step
# Fields added after results were first recorded: at their default they stay out of point_id, so older points keep
# their ids (a rerun finds them) and only points that use the new field hash differently.
_LATER_DEFAULTS = {"compile": "none"}
# How and where a point runs, not what it measures: left out of point_id, so they never make a point "new".
NOT_MEASURED = ("results_dir", "isolate", "ceilings_dir", "profile_trace", "reuse_worker", "force", "oom_backstop")


@dataclass
class ModelConfig:
    name: str = "small"  # a preset of harness.model.PRESETS; a local checkpoint in `weights` overrides its shapes
    # Resize the preset's KV heads: 1 = MQA, n_heads = MHA, between = GQA (dummy weights only). None: as the preset.
    n_kv_heads: int | None = None


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    # The strategy's name plus its own options (see harness/kv/<name>.py: Options), e.g. {name: paged, block_size: 16}
    cache: dict[str, Any] = field(default_factory=lambda: {"name": "contiguous"})
    weights: str = "dummy"  # "dummy": seeded random at the preset's shapes; or a local HF checkpoint directory
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "bf16"  # compute dtype of weights and activations
    kv_dtype: str = "auto"  # storage format of the KV cache: auto (= dtype), a float dtype, fp8_e4m3/e5m2, int8, int4
    kv_group_size: int = 32  # int4: values per quantization group (32 or 64)
    kv_residual: int = 0  # int4: the most recent tokens kept in full precision (KIVI's residual window)
    batch_size: int = 1  # concurrent sequences
    prompt_len: int = 128  # tokens per prompt (random ids, seeded)
    gen_len: int = 32  # tokens generated per sequence, greedy, no EOS
    prefix_len: int = 0  # leading prompt tokens shared by every sequence of the batch (a system prompt)
    # fixed: every sequence is prompt_len + gen_len. mixed: each request's lengths drawn uniformly from
    # [min_len_frac, 1] of them, to measure allocation waste (harness/fragmentation.py; no timing).
    lengths: str = "fixed"
    min_len_frac: float = 0.1
    warmup: int = 1  # whole generations run before measuring, excluded from every figure
    min_repeats: int = 3
    max_repeats: int = 20
    max_time_s: float = 60.0  # wall budget for the measured repeats of one point
    target_rse: float = 0.02  # stop repeating once the median TPOT's relative standard error is below this
    accuracy: bool = True  # lossy points (quantized KV, sliding past its window): teacher-forced error vs exact
    eval_text: str | None = None  # a local text file: perplexity with and without the lossy cache (real weights)
    roofline: bool = True  # analytic FLOPs/bytes beside the measured ceilings of this device (harness/roofline.py)
    ceilings_dir: str | None = None  # where measured ceilings are stored and reused; null: results_dir
    ceilings_quick: bool = False  # a quick, rough ceilings measurement (tests); a full one replaces it when asked
    profile: bool = True  # a separate torch.profiler pass over a few decode steps: where the time goes
    profile_steps: int = 4
    profile_trace: bool = False  # also export a Chrome trace next to the row
    compile: str = "none"  # torch.compile the decode step: none, default, reduce-overhead (CUDA graphs)
    max_memory_gb: float | None = None  # cap on the measuring process: RLIMIT on CPU, memory fraction on CUDA
    results_dir: str = "results"
    seed: int = 0
    isolate: bool = True  # measure each point in a spawned process, never in the sweep's; false only for debugging
    # Reuse that process for the next point while isolation allows it: the last point was ok or unsupported, no
    # max_memory_gb cap, and its peak RSS can be reset (Linux). False: a fresh process per point.
    reuse_worker: bool = True
    force: bool = False  # measure again a point already recorded (ok, oom, unsupported, skipped_oom) in results_dir
    # Record a point as skipped_oom, unmeasured, when the capacity planner says it needs at least as much memory as
    # an OOM point of the same sweep (same model, strategy, dtypes, options); false: measure it anyway.
    oom_backstop: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelConfig(**self.model)
        self.cache = dict(self.cache)
        try:
            self._validate()
        except ConfigError:
            raise
        except ValueError as exc:  # the strategy's and the model loader's own one-line checks
            raise ConfigError(str(exc)) from None

    def _validate(self) -> None:
        _check_choice("device", self.device, DEVICES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        for name in ("batch_size", "prompt_len", "gen_len", "min_repeats", "max_repeats", "max_time_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.gen_len < 2:
            raise ConfigError(f"gen_len: must be at least 2 (TPOT excludes the first token), got {self.gen_len}")
        if self.profile_steps <= 0:
            raise ConfigError(f"profile_steps: must be positive, got {self.profile_steps}")
        if self.warmup < 0:
            raise ConfigError(f"warmup: must be 0 or more, got {self.warmup}")
        if self.max_repeats < self.min_repeats:
            raise ConfigError(f"max_repeats: must be at least min_repeats={self.min_repeats}, got {self.max_repeats}")
        if not 0 < self.target_rse < 1:
            raise ConfigError(f"target_rse: must be in (0, 1), got {self.target_rse}")
        if self.max_memory_gb is not None and self.max_memory_gb <= 0:
            raise ConfigError(f"max_memory_gb: must be positive or null, got {self.max_memory_gb}")
        _check_choice("lengths", self.lengths, LENGTHS)
        _check_choice("compile", self.compile, COMPILE_MODES)
        if not 0 < self.min_len_frac <= 1:
            raise ConfigError(f"min_len_frac: must be in (0, 1], got {self.min_len_frac}")
        check_kv_layout(
            kv_group_size=self.kv_group_size,
            kv_residual=self.kv_residual,
            prefix_len=self.prefix_len,
            prompt_len=self.prompt_len,
        )
        if self.eval_text is not None and not Path(self.eval_text).is_file():
            raise ConfigError(f"eval_text: {self.eval_text!r} is not a file; allowed: a local text file, or null")
        if self.eval_text is not None and self.weights == "dummy":
            raise ConfigError("eval_text: perplexity needs a real checkpoint; allowed: weights=<checkpoint dir>")
        if "name" not in self.cache:
            raise ConfigError(f"cache.name: missing; allowed: {', '.join(kv.strategy_names())}")
        kv.parse_options(self.cache["name"], self.cache_options)
        args = self.model_args()
        if self.kv_dtype_name == "int4" and args.head_dim % self.kv_group_size:
            raise ConfigError(
                f"kv_group_size: {args.name}'s head_dim {args.head_dim} is not a multiple of {self.kv_group_size}; "
                f"allowed: a group size dividing {args.head_dim}"
            )
        if self.prompt_len + self.gen_len > args.max_seq_len:
            raise ConfigError(
                f"prompt_len + gen_len: {self.prompt_len + self.gen_len} exceeds {args.name}'s "
                f"{args.max_seq_len} positions; allowed: at most {args.max_seq_len}"
            )
        device = self.torch_device()
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        check_storable("dtype", self.dtype, device, capability)
        check_storable("kv_dtype", self.kv_dtype_name, device, capability)

    # --- resolved views of the fields -------------------------------------------------------------------------
    @property
    def cache_options(self) -> dict[str, Any]:
        return {key: value for key, value in self.cache.items() if key != "name"}

    @property
    def kv_dtype_name(self) -> str:
        return self.dtype if self.kv_dtype == "auto" else self.kv_dtype

    def torch_device(self) -> torch.device:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device: cuda requested but no CUDA device is available; allowed here: auto, cpu")
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def model_args(self) -> ModelArgs:
        args = load_args(self.weights, self.model.name)
        if self.model.n_kv_heads is None or self.model.n_kv_heads == args.n_kv_heads:
            return args
        if self.weights != "dummy":
            raise ConfigError(
                "model.n_kv_heads: a checkpoint's heads cannot be resized; allowed: null with weights=<dir>"
            )
        if self.model.n_kv_heads <= 0 or args.n_heads % self.model.n_kv_heads:
            divisors = [str(d) for d in range(1, args.n_heads + 1) if args.n_heads % d == 0]
            raise ConfigError(
                f"model.n_kv_heads: must divide {args.name}'s {args.n_heads} query heads, got "
                f"{self.model.n_kv_heads}; allowed: {', '.join(divisors)}"
            )
        # Same preset, other KV heads: the dummy weights follow the shapes (the n_kv_heads and n_params columns say so).
        return dataclasses.replace(args, n_kv_heads=self.model.n_kv_heads)

    def point_id(self) -> str:
        """A stable hash of what is measured: resolved device and dtypes included, output location excluded."""
        measured = dataclasses.asdict(self)
        for key in NOT_MEASURED:
            measured.pop(key)
        for key, default in _LATER_DEFAULTS.items():
            if measured[key] == default:
                measured.pop(key)
        measured.update(device=self.torch_device().type, kv_dtype=self.kv_dtype_name)
        blob = json.dumps(measured, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _check_choice(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: unknown value {value!r}; allowed: {', '.join(allowed)}")


def check_kv_layout(*, kv_group_size: int, kv_residual: int, prefix_len: int, prompt_len: int) -> None:
    """The KV-storage fields both the decode runs and the capacity planner take."""
    if kv_group_size not in KV_GROUP_SIZES:
        raise ConfigError(f"kv_group_size: must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {kv_group_size}")
    if kv_residual < 0:
        raise ConfigError(f"kv_residual: must be 0 or more tokens, got {kv_residual}")
    if not 0 <= prefix_len < prompt_len:
        raise ConfigError(
            f"prefix_len: must be in 0..prompt_len-1 (each sequence keeps a suffix of its own), got {prefix_len} "
            f"with prompt_len={prompt_len}"
        )


def check_storable(field_name: str, dtype_name: str, device: torch.device, capability: tuple[int, int] | None) -> None:
    """bf16 needs native support: every CPU torch build has it; on CUDA, compute capability 8.0 (Ampere) and up."""
    if device.type == "cuda" and dtype_name == "bf16" and capability is not None and capability < (8, 0):
        raise ConfigError(
            f"{field_name}: bf16 needs compute capability 8.0+, this GPU has {capability[0]}.{capability[1]}; "
            "allowed here: fp32, fp16"
        )
