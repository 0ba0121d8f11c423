"""The paged decode kernels (harness.kv.triton_kernels, launched through harness.kv.triton_paged's op): their torch
reference against attention over the gathered K/V, and the Triton kernels against both, on random block tables,
ragged lengths, GQA groups 1/4/8, head_dim 64/128, and every storage format the kernels read (plain, int8, fp8 with
their per-token scales).

Without a GPU the kernel runs in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 must be set when triton is
first imported (triton.language's own helpers are built then), when the kernel module is imported, and while it runs.
tests/conftest.py sets it for the whole session when there is no GPU; here it is set again around the import and, by
a fixture, around each test, for a run of this file alone. With a GPU it is never set, and the same tests run the
compiled kernel on CUDA tensors. Skipped, with the reason, where triton is not installed.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import kv
from harness.kv.base import CacheSpec, attention
from harness.kv.quant import token_codec
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate
from harness.modeling.model import build_model
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens, greedy_with_logits

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _import_kernel_modules():
    if CUDA:
        from harness.kv import triton_kernels, triton_paged

        return triton_kernels, triton_paged
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from harness.kv import triton_kernels, triton_paged

        if not triton_kernels.INTERPRETED:  # imported earlier in this session (harness.kv does): decorate again
            triton_kernels = importlib.reload(triton_kernels)  # triton_paged looks the kernels up there at each call
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return triton_kernels, triton_paged


triton_kernels, triton_paged = _import_kernel_modules()


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


needs_triton = pytest.mark.skipif(not triton_kernels.available(), reason=triton_kernels.UNAVAILABLE or "")
needs_kernel_here = pytest.mark.skipif(
    not CUDA and not triton_kernels.INTERPRETED,
    reason="harness.kv.triton_kernels was imported before TRITON_INTERPRET=1 was set: run this module on its own",
)

# Storage formats and how far the kernel may sit from attention over the dequantized K/V, relative to the output's
# scale. fp32: accumulation order only. fp16/bf16: the dot operands and the probabilities are rounded to 11 and 8
# significant bits. int8/fp8: besides that, the reference dequantizes into the query's dtype before its dot products,
# the kernel scales fp32 scores instead.
TOLERANCE = {"fp32": 1e-5, "fp16": 4e-3, "bf16": 3e-2, "int8": 1e-5, "fp8_e4m3": 1e-5, "fp8_e5m2": 1e-5}
COMPUTE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def paged_case(*, batch, n_kv_heads, group, head_dim, lens, block_size, kv_dtype, compute, seed=0, v_magnitude=1.0):
    """Random K/V stored in `kv_dtype` into a pool through a shuffled block table, a query per sequence, and the
    oracle's answer: harness.kv.base.attention over each sequence's K/V gathered and decoded. V is standard normal
    times `v_magnitude`."""
    gen = torch.Generator().manual_seed(seed)
    max_len = max(lens)
    blocks_per_seq = math.ceil(max_len / block_size)
    n_blocks = batch * blocks_per_seq + 3  # a few spare blocks nobody owns
    table = torch.randperm(n_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    codec = token_codec(kv_dtype)
    pool = {side: codec.alloc((n_blocks, n_kv_heads, block_size, head_dim), torch.device("cpu")) for side in "kv"}
    q = torch.randn(batch, n_kv_heads * group, head_dim, generator=gen).to(compute)
    expected = []
    for b, n in enumerate(lens):
        kv = {side: torch.randn(n_kv_heads, n, head_dim, generator=gen) for side in "kv"}
        kv["v"] = kv["v"] * v_magnitude
        pos = torch.arange(n)
        blocks, slots = table[b, pos // block_size], pos % block_size
        for side in "kv":
            for part, rows in codec.encode(kv[side]).items():  # rows [H_kv, n, width]
                pool[side][part][blocks, :, slots] = rows.transpose(0, 1)
        stored = {  # what the cache would read back: [1, H_kv, n, D] in the compute dtype
            side: codec.decode(
                {part: t[blocks, :, slots].transpose(0, 1) for part, t in pool[side].items()}, compute
            ).unsqueeze(0)
            for side in "kv"
        }
        expected.append(attention(q[b, None, :, None], stored["k"], stored["v"], start_pos=n - 1)[0, :, 0])
    scales = {}
    if "scale" in pool["k"]:
        scales = {"k_scale": pool["k"]["scale"][..., 0].to(DEVICE), "v_scale": pool["v"]["scale"][..., 0].to(DEVICE)}
    inputs = dict(
        q=q.to(DEVICE),
        k_pool=pool["k"]["data"].to(DEVICE),
        v_pool=pool["v"]["data"].to(DEVICE),
        table=table.to(DEVICE),
        lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        block_size=block_size,
        **scales,
    )
    return inputs, torch.stack(expected).to(DEVICE)


def assert_close(actual, expected, kv_dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    error = (actual.float() - expected.float()).abs().max().item()
    assert error <= TOLERANCE[kv_dtype] * expected.float().abs().max().item() + 1e-6, error


FORMATS = [("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"), ("int8", "fp32"), ("fp8_e4m3", "fp32")]


@pytest.mark.parametrize(("kv_dtype", "compute"), [*FORMATS, ("int8", "bf16"), ("fp8_e5m2", "fp16")])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_the_reference_matches_attention_over_the_gathered_kv(kv_dtype, compute, group):
    inputs, expected = paged_case(
        batch=3, n_kv_heads=2, group=group, head_dim=64, lens=[37, 1, 70], block_size=16,
        kv_dtype=kv_dtype, compute=COMPUTE[compute],
    )  # fmt: skip
    tolerance = kv_dtype if compute == "fp32" else compute
    assert_close(triton_paged.paged_decode_reference(**inputs), expected, tolerance)


@needs_triton
@needs_kernel_here
@pytest.mark.parametrize(("kv_dtype", "compute"), FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_the_kernel_matches_attention_over_the_gathered_kv(kv_dtype, compute, head_dim, group):
    inputs, expected = paged_case(
        batch=3, n_kv_heads=2, group=group, head_dim=head_dim, lens=[37, 1, 70], block_size=16,
        kv_dtype=kv_dtype, compute=COMPUTE[compute],
    )  # fmt: skip
    assert_close(triton_paged.paged_decode(**inputs, max_len=70, n_splits=1), expected, kv_dtype)


@needs_triton
@needs_kernel_here
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "fp8_e4m3"])
def test_split_k_merges_to_the_same_output_even_with_splits_past_a_short_sequence(kv_dtype):
    inputs, expected = paged_case(
        batch=2, n_kv_heads=2, group=4, head_dim=64, lens=[150, 20], block_size=16, kv_dtype=kv_dtype,
        compute=torch.float32,
    )  # fmt: skip
    # max_len 200 in 4 splits of 64 positions: split 3 is past sequence 0 (150 tokens), splits 1-3 past sequence 1.
    assert_close(triton_paged.paged_decode(**inputs, max_len=200, n_splits=4), expected, kv_dtype)


@needs_triton
@needs_kernel_here
def test_the_kernel_reads_a_contiguous_buffer_as_one_block_per_sequence():
    inputs, expected = paged_case(
        batch=2, n_kv_heads=2, group=4, head_dim=64, lens=[45, 45], block_size=45, kv_dtype="int8",
        compute=torch.float32,
    )  # fmt: skip
    # A [B, H_kv, S_max, D] buffer is a pool of B blocks of S_max tokens; the table is [[0], [1]].
    order = inputs["table"][:, 0].long()
    contiguous = {name: inputs[name][order] for name in ("k_pool", "v_pool", "k_scale", "v_scale")}
    table = torch.arange(2, device=DEVICE)[:, None]
    out = triton_paged.paged_decode(
        inputs["q"], **contiguous, table=table, lens=inputs["lens"], block_size=45, max_len=45, n_splits=1
    )
    assert_close(out, expected, "int8")


@needs_triton
@needs_kernel_here
def test_the_kernel_agrees_with_the_reference_on_bf16_storage_with_fp32_queries():
    inputs, _ = paged_case(
        batch=2, n_kv_heads=1, group=8, head_dim=64, lens=[33, 64], block_size=8, kv_dtype="bf16",
        compute=torch.bfloat16,
    )  # fmt: skip
    inputs["q"] = inputs["q"].float()  # an fp32 model over bf16 K/V: the dot runs in fp32
    reference = triton_paged.paged_decode_reference(**inputs)
    assert_close(triton_paged.paged_decode(**inputs, max_len=64, n_splits=2), reference, "fp32")


@needs_triton
@needs_kernel_here
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("v_magnitude", [1e-3, 1.0, 1e4])
@pytest.mark.parametrize("n_splits", [1, 3])
def test_fp16_queries_over_scaled_values_keep_fp16_precision_at_any_value_magnitude(kv_dtype, v_magnitude, n_splits):
    """The P.V operand p * v_scale is cast to fp16: a value scale is amax / max_code (57344 for e5m2), so unscaled
    it sinks into fp16's subnormals (below 6.1e-5) and loses bits; the kernel prescales it by a power of two."""
    inputs, _ = paged_case(
        batch=3, n_kv_heads=2, group=4, head_dim=64, lens=[37, 1, 150], block_size=16, kv_dtype=kv_dtype,
        compute=torch.float16, v_magnitude=v_magnitude,
    )  # fmt: skip
    reference = triton_paged.paged_decode_reference(**inputs)  # fp32 throughout, rounded to fp16 once
    actual = triton_paged.paged_decode(**inputs, max_len=150, n_splits=n_splits)  # 3 splits of 64 positions
    # Both are fp16 roundings of nearly the same value, so at most about an ulp apart: 2^-10 of it. 2e-3 of each
    # sequence's largest output leaves a second ulp for the kernel's fp16 probabilities. Without the prescale the
    # error at v_magnitude 1e-3 is 4.5e-3 (int8), 1.5e-2 (e4m3), 0.9 (e5m2); at 1.0, 1.9e-3 to 2.6e-3 for e5m2.
    for seq in range(3):
        error = (actual[seq].float() - reference[seq].float()).abs().max().item()
        assert error <= 2e-3 * reference[seq].float().abs().max().item(), (seq, error)


# --- the custom op: what tracing sees (FakeTensorMode, torch.compile) --------------------------------------------


def small_case(kv_dtype="int8"):
    return paged_case(
        batch=3, n_kv_heads=2, group=4, head_dim=64, lens=[37, 1, 70], block_size=16, kv_dtype=kv_dtype,
        compute=torch.float16,
    )[0]  # fmt: skip


class _NotLaunched:
    """Stands in for a kernel: launching it (or wrapping it with torch.library.wrap_triton) fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("a kernel was launched")


@pytest.mark.parametrize("n_splits", [None, 1, 2])
def test_under_fake_tensor_mode_paged_decode_returns_a_fake_output_and_launches_nothing(monkeypatch, n_splits):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    monkeypatch.setattr(triton_kernels, "_paged_decode_kernel", _NotLaunched(), raising=False)
    monkeypatch.setattr(triton_kernels, "_merge_splits_kernel", _NotLaunched(), raising=False)
    inputs = small_case()
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
        out = triton_paged.paged_decode(**fake, max_len=70, n_splits=n_splits)
    assert isinstance(out, FakeTensor)
    assert (out.shape, out.dtype, out.device) == ((3, 8, 64), torch.float16, inputs["q"].device)


@needs_triton
@needs_kernel_here
def test_the_op_passes_torch_library_opcheck():
    """Schema, fake against real implementation, and AOT dispatch: torch's own checks for a custom op."""
    inputs = small_case("int8")  # opcheck's schema check does arithmetic on the inputs: none on fp8 on the CPU
    args = [inputs.pop(name) for name in ("q", "k_pool", "v_pool", "table", "lens", "k_scale", "v_scale")]
    kwargs = dict(block_size=inputs["block_size"], max_len=70, n_splits=2)
    torch.library.opcheck(torch.ops.kvbench.paged_decode.default, args, kwargs)


@needs_triton
@needs_kernel_here
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_paged_decode_compiles_in_one_graph_and_matches_eager(backend):
    def scaled_attention(inputs):  # a little work around the op, as in a decode step
        return triton_paged.paged_decode(**inputs, max_len=70, n_splits=2) * 2.0

    inputs = small_case()
    torch._dynamo.reset()  # compile afresh: a graph break is an error (fullgraph), never a cached success
    compiled = torch.compile(scaled_attention, fullgraph=True, backend=backend)(inputs)
    assert torch.equal(compiled, scaled_attention(inputs))  # the same kernel on the same inputs


def test_without_triton_the_module_imports_traces_and_says_why_it_cannot_run():
    """In a fresh interpreter where `import triton` fails: the op is registered, its fake output traces, and the
    real call raises the reason."""
    script = """
import sys
sys.modules["triton"] = None  # import triton raises ImportError
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from harness.kv import triton_kernels, triton_paged
assert not triton_kernels.available()
args = (torch.zeros(2, 4, 16), torch.zeros(3, 2, 8, 16), torch.zeros(3, 2, 8, 16), torch.zeros(2, 1, dtype=torch.long),
        torch.ones(2, dtype=torch.int32))
with FakeTensorMode(allow_non_fake_inputs=True):
    assert triton_paged.paged_decode(*args, block_size=8, max_len=1).shape == (2, 4, 16)
try:
    triton_paged.paged_decode(*args, block_size=8, max_len=1)
except RuntimeError as exc:
    print(exc)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("triton is not importable"), done.stdout


def test_split_count_fills_the_device_but_keeps_splits_long():
    cpu = torch.device("cpu")  # one "SM": a single split
    assert triton_paged.split_count(batch=1, n_kv_heads=8, max_len=8192, device=cpu) == 1
    assert triton_paged.split_count(batch=1, n_kv_heads=1, max_len=100, device=cpu) == 1


# --- the caches wired to the kernel: what CUDA runs (without a GPU, through the interpreter) ----------------------


@pytest.fixture(scope="module")
def model(tiny_args):
    return build_model(tiny_args, weights="dummy", dtype=torch.float32, device=DEVICE, seed=0, n_positions=64)


def tiny_prompt(vocab_size: int) -> torch.Tensor:
    return torch.randint(vocab_size, (2, 21), generator=torch.Generator().manual_seed(2)).to(DEVICE)


@needs_triton
@needs_kernel_here
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "fp8_e4m3"])
def test_the_paged_cache_reading_blocks_in_place_generates_the_gather_tokens(model, tiny_args, kv_dtype):
    spec = CacheSpec.for_model(tiny_args, batch_size=2, max_tokens=21 + 6, kv_dtype=kv_dtype, device=DEVICE)
    prompt = tiny_prompt(tiny_args.vocab_size)
    gathered = kv.build("paged", spec, {"block_size": 4})
    in_place = kv.build("paged", spec, {"block_size": 4})
    gathered.attn_backend = "sdpa-gather"  # what the CPU runs
    in_place.attn_backend = "triton-paged"  # what CUDA runs: decode steps go to the kernel
    expected, logits = greedy_with_logits(model, gathered, prompt, 6)
    actual, _ = generate(model, in_place, prompt, 6, StepTimer(DEVICE, n_marks=6))
    # Another kernel sums in another order: the same tokens up to a near-tie (tests/greedy.py).
    assert_same_greedy_tokens(actual, expected, logits, tol=LOGIT_TOL[kv_dtype])


@needs_triton
@needs_kernel_here
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e5m2"])
def test_the_contiguous_cache_dequantizing_in_the_kernel_generates_the_sdpa_tokens(model, tiny_args, kv_dtype):
    spec = CacheSpec.for_model(tiny_args, batch_size=2, max_tokens=21 + 6, kv_dtype=kv_dtype, device=DEVICE)
    prompt = tiny_prompt(tiny_args.vocab_size)
    sliced, fused = kv.build("contiguous", spec, {}), kv.build("contiguous", spec, {})
    sliced.fused_dequant, fused.fused_dequant = False, True  # the CPU's dequantize-then-SDPA, and CUDA's kernel
    expected, logits = greedy_with_logits(model, sliced, prompt, 6)
    actual, _ = generate(model, fused, prompt, 6, StepTimer(DEVICE, n_marks=6))
    assert_same_greedy_tokens(actual, expected, logits, tol=LOGIT_TOL[kv_dtype])  # another kernel, as above


@needs_triton
@needs_kernel_here
def test_static_shape_decode_through_the_kernel_reads_its_length_from_the_position_tensor(tiny_args):
    spec = CacheSpec.for_model(tiny_args, batch_size=2, max_tokens=40, kv_dtype="int8", device=DEVICE)
    sliced, fused = kv.build("contiguous", spec, {}), kv.build("contiguous", spec, {})
    sliced.fused_dequant, fused.fused_dequant = False, True
    fused.enable_static_decode()
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = tiny_args.n_heads, tiny_args.n_kv_heads, tiny_args.head_dim
    for pos in range(0, 12):
        q, k, v = (torch.randn(2, h, 1, dim, generator=gen).to(DEVICE) for h in (heads, kv_heads, kv_heads))
        sliced.prepare(pos, 1)
        expected = sliced.attend(0, q, k, v, pos)
        fused.prepare(pos, 1)
        actual = fused.attend(0, q, k, v, torch.tensor([pos], device=DEVICE))
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_an_eager_call_skips_the_op_dispatch_and_anything_watching_goes_through_the_op():
    """The op's dispatch costs tens of microseconds a call: only a trace, fake tensors, a dispatch mode or the
    profiler need to see it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.profiler import profile
    from torch.utils.flop_counter import FlopCounterMode

    from harness.kv import triton_paged

    q = torch.zeros(2, 4, 16)
    assert not triton_paged._seen(q)
    with FlopCounterMode(display=False):
        assert triton_paged._seen(q)
    with profile():
        assert triton_paged._seen(q)
    with FakeTensorMode():
        assert triton_paged._seen(torch.zeros(2, 4, 16))
    assert torch.compile(lambda x: x + triton_paged._seen(x), backend="eager", fullgraph=True)(q).eq(1).all()
