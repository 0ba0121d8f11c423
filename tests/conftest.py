"""Shared fixtures: the run's GGUF conversion cache, the tiny preset in fp32 on the CPU, and a skip marker for CUDA-only
tests; under pytest-xdist, each worker's share of the cores for torch's threads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from harness.modeling.model import build_model
from harness.modeling.model_args import ModelArgs

# Without a GPU the Triton kernels run in Triton's interpreter, which must be on when triton itself is first
# imported: triton.language's own @jit helpers are built then, and torch.compile (tests/modeling/test_compile.py) imports
# triton before tests/kv/test_triton_paged.py runs. On a GPU machine the kernels compile for the device instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under xdist (make test: TEST_WORKERS processes), each worker and every process it spawns (sweep workers, entry
# points: they inherit os.environ) gets its share of the cores for torch's intra-op threads, unless OMP_NUM_THREADS
# is set already. Otherwise every process runs one OpenMP thread per core and, with two workers on two cores, their
# threads spin waiting on each other: the suite took 9:58 on 2 cores with the default and 7:34 with one thread each.
if (workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1 and "OMP_NUM_THREADS" not in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # Linux: usable
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    # Files holding a slow test first, each file's own order kept: `make test`'s workers (--dist loadfile) then start
    # on the long files and finish on the short ones, instead of one worker running a long file alone at the end.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: False (slow files) first
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def kvbench_cache(tmp_path_factory) -> Path:
    """$KVBENCH_CACHE for the whole run, never ~/.cache: one folder per test run, shared by xdist's workers (their
    base temps' common parent), so a GGUF is converted once per run and a second worker waits on its lock."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "kvbench-cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVBENCH_CACHE", str(root))  # os.environ: spawned sweep workers inherit it
        yield root


@pytest.fixture(scope="session")
def tiny_args() -> ModelArgs:
    return ModelArgs.from_name("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_args):
    return build_model(
        tiny_args, weights="dummy", dtype=torch.float32, device=torch.device("cpu"), seed=0, n_positions=512
    )


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    """A real Hugging Face checkpoint made here: transformers' own LlamaForCausalLM, trained for a few steps on a
    repetitive text so its attention is not uniform, saved with save_pretrained, plus a word-level tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("llama-ckpt")
    words = [f"w{i}" for i in range(120)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    text = " ".join(words[(i * 7) % 97 + (i % 3)] for i in range(4000))
    (directory / "eval.txt").write_text(text)

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        head_dim=32,
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.tensor(tokenizer.encode(text).ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(60):  # a few steps: enough for sharp, position-dependent attention
        start = (step * 37) % (len(ids) - 65)
        batch = ids[start : start + 64][None]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    return directory
