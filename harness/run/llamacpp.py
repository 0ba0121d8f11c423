"""llama.cpp's decode loop beside ours on the same weights (`make bench-llamacpp`, experiments/llamacpp.py).

llama.cpp runs through llama-cpp-python (its ctypes binding; `make bench-llamacpp` builds it into .venv once). Its
loop is the one llama.cpp's own examples run: one llama_decode of the whole prompt, then one llama_decode per token,
the next token the argmax of the last logits (greedy, no sampler chain), on `threads` threads, flash attention on
(llama.cpp needs it to store V quantized) except with an f32 cache, which flash attention would cast to f16
(flash_attn). Timing matches harness.measure.timing.Sample: TTFT is the prompt's decode
plus the first argmax, then one interval per later token, each ending when its argmax is known on the host.

What llama.cpp's rows are measured against (the columns a kvbench row has, computed the same way):
    bytes_per_step     every tensor of the GGUF as stored (the tied head reads token_embd whole) plus the KV cache
                       at the mean decode context (prompt_len + gen_len / 2) in the KV type's bytes per element
                       (q8_0: 34 bytes per 32, q4_0: 18 per 32): analytic, as our rows' are
    achieved_bw_gbps   bytes_per_step / tpot; bw_util over this machine's measured read roof (peak_bw_gbps)
    kl_mean, top1      teacher-forced on the same text, against llama.cpp's own run with an f32 KV cache
                       (accuracy_reference); our formats against our exact cache (contiguous fp32)

Its KV types and ours side by side (KV_PEERS): f16 beside bf16 (16 bits), q8_0 beside int8 (8-bit codes with a
scale per group), q4_0 beside int4. Teacher-forced, llama.cpp evaluates the prompt and the forced text in one batch:
each position's attention reads the cache it just wrote, in its KV type, as a decode step would.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from harness.errors import ConfigError
from harness.measure.timing import Sample

VERSION = "0.3.36"  # what make bench-llamacpp installs
PIP = f"llama-cpp-python=={VERSION}"
# ggml_type of each KV type (ggml.h), and its bytes per element as stored (a q8_0 block: 32 int8 and an fp16 scale)
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2}
KV_BYTES_PER_ELEMENT = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
EXACT_KV = "f32"  # the reference of llama.cpp's accuracy columns: its own cache at full precision
KV_PEERS = {"f32": "fp32", "f16": "bf16", "q8_0": "int8", "q4_0": "int4"}  # llama.cpp's type -> our kv_dtype


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def require():
    """The llama_cpp module, or one ConfigError line saying how to install it."""
    if not available():
        raise ConfigError(
            f"llama_cpp: llama-cpp-python is not installed; allowed: make bench-llamacpp (builds {PIP} into .venv "
            "once, several minutes on 2 cores)"
        )
    return importlib.import_module("llama_cpp")


def load(path: str | Path, *, kv_type: str, n_ctx: int, threads: int, logits_all: bool = False):
    """A llama.cpp model and context on the CPU: K and V stored as kv_type, the prompt in one batch, flash attention
    for every type but f32 (flash_attn(kv_type))."""
    llama_cpp = require()
    if kv_type not in KV_TYPES:
        raise ConfigError(f"kv_type: unknown value {kv_type!r}; allowed: {', '.join(KV_TYPES)}")
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,  # the whole prompt in one llama_decode, as our prefill
        n_ubatch=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        n_gpu_layers=0,
        type_k=KV_TYPES[kv_type],
        type_v=KV_TYPES[kv_type],
        flash_attn=flash_attn(kv_type),
        logits_all=logits_all,
        seed=0,
        verbose=False,
    )


def flash_attn(kv_type: str) -> bool:
    """Whether llama.cpp attends with flash attention: it must to read V quantized (q8_0, q4_0), and f16 runs it too;
    but its flash-attention graph casts an f32 cache to f16 first (llama-graph.cpp, build_attn_mha), so f32 K/V stay
    f32 only in the plain path (mul_mat over the cache, softmax, mul_mat): measured, f32 with flash attention gives
    logits bit-identical to f16's."""
    return kv_type != "f32"


def last_logits(llm) -> np.ndarray:
    """The logits [V] of the last position the last llama_decode computed (a view into llama.cpp's buffer)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))


def greedy_loop(llm, prompt: Sequence[int], *, gen_len: int) -> Callable[[], tuple[list[int], Sample]]:
    """One greedy generation of gen_len tokens per call, from an empty cache: (tokens, Sample)."""
    prompt = [int(t) for t in prompt]

    def run_once() -> tuple[list[int], Sample]:
        llm.reset()  # n_tokens = 0: the next eval drops every cached position first
        started = time.perf_counter()
        llm.eval(prompt)
        token = int(np.argmax(last_logits(llm)))
        mark = time.perf_counter()
        ttft_ms, tokens, steps = 1000 * (mark - started), [token], []
        for _ in range(gen_len - 1):
            llm.eval([token])
            token = int(np.argmax(last_logits(llm)))
            now = time.perf_counter()
            steps.append(1000 * (now - mark))
            mark = now
            tokens.append(token)
        return tokens, Sample(ttft_ms=ttft_ms, step_ms=steps)

    return run_once


def teacher_forced_logits(llm, prompt: Sequence[int], forced: Sequence[int]) -> np.ndarray:
    """Logits [N, V] (fp32) predicting forced[0..N-1] given the prompt and the forced tokens before each; llm must
    have been loaded with logits_all."""
    prompt, forced = [int(t) for t in prompt], [int(t) for t in forced]
    llm.reset()
    llm.eval(prompt + forced[:-1])
    start = len(prompt) - 1
    return np.array(llm.scores[start : start + len(forced)], dtype=np.float32)


def weight_bytes(path: str | Path) -> int:
    """Every tensor's bytes as the GGUF stores them: what one decode step reads of the weights."""
    import gguf

    return int(sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors))


def kv_bytes(*, n_layers: int, n_kv_heads: int, head_dim: int, context: float, kv_type: str) -> float:
    """The bytes of K and V one decode step reads at `context` tokens, stored as kv_type."""
    return 2 * n_layers * n_kv_heads * head_dim * context * KV_BYTES_PER_ELEMENT[kv_type]
