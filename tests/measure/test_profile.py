"""The profiled pass: shares that partition a step's time, the rules behind them, FLOPs, memory, and no side effects."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from harness import kv
from harness.kv.base import CacheSpec
from harness.measure.profile import (
    CATEGORIES,
    OPS,
    TOP_OPS_COLUMNS,
    _count_flops,
    _cpu_times,
    _cuda_times,
    classify,
    profile_decode,
)
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate
from harness.modeling.model import weights_bytes

CPU = torch.device("cpu")
BATCH, PROMPT_LEN, N_STEPS = 2, 8, 3


def build_cache(args, kv_dtype: str):
    spec = CacheSpec.for_model(
        args, batch_size=BATCH, max_tokens=PROMPT_LEN + N_STEPS + 4, kv_dtype=kv_dtype, device=CPU
    )
    return kv.build("contiguous", spec, {})


def make_prompt(args) -> torch.Tensor:
    return torch.randint(args.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", params=["fp32", "int8"])
def profiled(request, tiny_model, tiny_args, tmp_path_factory):
    """(columns, top_ops, cache, trace_path) of one profiled pass per storage format."""
    cache = build_cache(tiny_args, request.param)
    trace_path = tmp_path_factory.mktemp(f"prof-{request.param}") / "trace.json"
    columns, top_ops = profile_decode(
        tiny_model, cache, make_prompt(tiny_args), n_steps=N_STEPS, device=CPU, trace_path=trace_path
    )
    return columns, top_ops, cache, trace_path


def test_shares_lie_in_0_1_and_sum_to_1(profiled):
    columns, *_ = profiled
    shares = [columns[f"prof_{category}_frac"] for category in CATEGORIES]
    assert all(0.0 <= share <= 1.0 for share in shares)
    assert math.isclose(sum(shares), 1.0, abs_tol=1e-6)


def test_kv_writes_and_reads_take_a_share(profiled):
    columns, *_ = profiled
    assert columns["prof_kv_frac"] > 0
    assert columns["prof_gemm_frac"] > 0 and columns["prof_attention_frac"] > 0


@pytest.mark.parametrize(
    ("op_name", "category"),
    [
        ("aten::mm", "gemm"),
        ("aten::addmm", "gemm"),
        ("aten::linear", "gemm"),
        ("aten::matmul", "gemm"),
        ("aten::scaled_dot_product_attention", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::argmax", "sampling"),
        ("aten::rsqrt", "norm_elementwise"),
        ("aten::mul", "norm_elementwise"),
        ("aten::mean", "norm_elementwise"),
        ("aten::silu", "norm_elementwise"),
        ("aten::copy_", "norm_elementwise"),
        ("aten::view", "other"),
        ("aten::embedding", "other"),
        ("kvbench::paged_decode", "attention"),  # the Triton decode kernels' custom op
    ],
)
def test_classify_maps_cpu_ops_by_name(op_name, category):
    assert classify(op_name) == category


@pytest.mark.parametrize(
    ("kernel_name", "category"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn", "gemm"),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "gemm"),
        ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false>", "gemm"),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, false, true>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "norm_elementwise"),
        ("void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps<float>>>", "norm_elementwise"),
        ("void at::native::reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float>>>", "sampling"),
        ("Memset (Device)", "other"),
        ("_paged_decode_kernel", "attention"),  # harness.kv.triton_kernels' kernels, as Triton names them
        ("_merge_splits_kernel", "attention"),
    ],
)
def test_classify_maps_cuda_kernels_by_name(kernel_name, category):
    assert classify(kernel_name) == category


@pytest.mark.parametrize(
    ("op_name", "context", "category"),
    [
        ("aten::mul", ("aten::mul", "kvbench::kv_write", "kvbench::decode_step"), "kv"),  # quantizing K
        ("aten::copy_", ("aten::_to_copy", "aten::to", "kvbench::kv_read"), "kv"),  # dequantizing
        ("aten::bmm", ("aten::_scaled_dot_product_attention_math", "aten::scaled_dot_product_attention"), "attention"),
        ("aten::t", ("aten::linear",), "gemm"),  # a view inside the op it serves
        ("Memcpy DtoD (Device -> Device)", ("aten::copy_", "kvbench::kv_write"), "kv"),
        ("aten::empty", ("kvbench::decode_step",), "other"),  # an unknown label claims nothing
        ("aten::copy_", ("kvbench::paged_decode", "kvbench::decode_step"), "attention"),  # inside the kernels' op
        ("Memset (Device)", ("kvbench::paged_decode",), "attention"),  # launched by it
    ],
)
def test_classify_lets_enclosing_labels_and_ops_decide(op_name, context, category):
    assert classify(op_name, context) == category


def test_top_ops_table_has_its_columns_and_shares_summing_to_at_most_1(profiled):
    _, top_ops, *_ = profiled
    assert tuple(top_ops.columns) == TOP_OPS_COLUMNS
    assert len(top_ops) > 0
    assert set(top_ops["category"]) <= set(CATEGORIES)
    assert (top_ops["self_time_ms"] >= 0).all() and (top_ops["calls"] >= 1).all()
    assert top_ops["share"].sum() <= 1.0 + 1e-9


def test_trace_file_is_written_when_asked(profiled):
    columns, _, _, trace_path = profiled
    assert columns["prof_trace_path"] == str(trace_path)
    assert trace_path.stat().st_size > 0
    assert "kvbench::kv_write" in trace_path.read_text()


def test_attention_flops_per_decode_step_match_the_formula(profiled, tiny_args):
    columns, *_ = profiled
    context = PROMPT_LEN + 1  # the counted step attends over the prompt and its own token
    formula = 2 * 2 * tiny_args.n_layers * tiny_args.n_heads * tiny_args.head_dim * context * BATCH
    assert columns["prof_attention_flops"] == pytest.approx(formula, rel=0.1)
    assert columns["prof_total_flops"] > columns["prof_attention_flops"]


def test_memory_columns_count_weights_kv_and_temporaries(profiled, tiny_model):
    columns, _, cache, _ = profiled
    assert columns["prof_mem_weights_bytes"] == weights_bytes(tiny_model)
    assert columns["prof_mem_kv_bytes"] == cache.kv_bytes_allocated()
    assert columns["prof_mem_activations_bytes"] > 0  # at least the logits [B, V] of a step
    assert columns["prof_steps"] == N_STEPS


def test_profiling_leaves_no_profiler_running_and_later_tokens_unchanged(tiny_model, tiny_args):
    gen_len = 6
    fresh = build_cache(tiny_args, "fp32")
    expected, _ = generate(tiny_model, fresh, make_prompt(tiny_args), gen_len, StepTimer(CPU, n_marks=gen_len))
    cache = build_cache(tiny_args, "fp32")
    profile_decode(tiny_model, cache, make_prompt(tiny_args), n_steps=N_STEPS, device=CPU)
    assert not torch.autograd.profiler._is_profiler_enabled
    assert not torch._C._autograd._profiler_enabled()
    tokens, _ = generate(tiny_model, cache, make_prompt(tiny_args), gen_len, StepTimer(CPU, n_marks=gen_len))
    assert torch.equal(tokens, expected)


def test_too_many_steps_for_the_cache_fail_before_anything_runs(tiny_model, tiny_args):
    cache = build_cache(tiny_args, "fp32")  # holds PROMPT_LEN + N_STEPS + 4 positions
    with pytest.raises(ValueError, match="positions"):
        profile_decode(tiny_model, cache, make_prompt(tiny_args), n_steps=N_STEPS + 4, device=CPU)


def test_cuda_time_is_kernel_time_classified_through_the_launching_op():
    """Events as the profiler reports them on CUDA: each kernel links to the innermost op that launched it."""

    def cpu(id, name, parent=None):
        made = FunctionEvent(id, name, thread=0, start_us=0, end_us=10, is_user_annotation=name.startswith("kvbench"))
        if parent is not None:
            made.set_cpu_parent(parent)
        return made

    def gpu(name, launcher, duration_us, activity="kernel"):
        return FunctionEvent(
            0,
            name,
            thread=0,
            start_us=0,
            end_us=duration_us,
            device_type=DeviceType.CUDA,
            activity_type=activity,
            linked_correlation_id=launcher.id,
            is_user_annotation=activity == "gpu_user_annotation",
        )

    label = cpu(1, "kvbench::kv_write")
    quantize, matmul = cpu(2, "aten::mul", parent=label), cpu(3, "aten::mm")
    kernels = [gpu("elementwise_kernel", quantize, 5), gpu("nvjet_tst_64x8", matmul, 20)]
    label_span = gpu("kvbench::kv_write", label, 5, activity="gpu_user_annotation")  # a label on the device: not work
    times = list(_cuda_times([label, quantize, matmul, *kernels, label_span]))
    assert times == [("elementwise_kernel", "kv", 5), ("nvjet_tst_64x8", "gemm", 20)]


def _event(id, name, *, parent=None, is_user_annotation=False, self_us=10):
    made = FunctionEvent(id, name, thread=0, start_us=0, end_us=self_us, is_user_annotation=is_user_annotation)
    if parent is not None:
        made.set_cpu_parent(parent)
    return made


def test_the_decode_kernels_on_cuda_are_attention_time():
    """harness.kv.triton_kernels' kernels, launched by the custom op (a CPU op, not a label), inside a decode step."""
    step = _event(1, "kvbench::decode_step", is_user_annotation=True)
    op = _event(2, "kvbench::paged_decode", parent=step)
    kernels = [
        FunctionEvent(0, name, thread=0, start_us=0, end_us=us, device_type=DeviceType.CUDA,
                      activity_type="kernel", linked_correlation_id=op.id)
        for name, us in (("_paged_decode_kernel", 30), ("_merge_splits_kernel", 4))
    ]  # fmt: skip
    times = list(_cuda_times([step, op, *kernels]))
    assert times == [("_paged_decode_kernel", "attention", 30), ("_merge_splits_kernel", "attention", 4)]


def test_the_decode_kernels_op_is_cpu_attention_time_not_a_label():
    step = _event(1, "kvbench::decode_step", is_user_annotation=True)
    op = _event(2, "kvbench::paged_decode", parent=step, self_us=25)
    inside = _event(3, "aten::empty", parent=op, self_us=2)
    op.append_cpu_child(inside)
    assert list(_cpu_times([step, op, inside])) == [
        ("kvbench::paged_decode", "attention", 23),  # self time: its child's 2 µs are the child's
        ("aten::empty", "attention", 2),
    ]


def test_the_profile_knows_the_custom_op_the_kernels_register():
    from harness.kv import triton_paged

    assert triton_paged.OP_NAME in OPS


def test_the_decode_kernels_flops_count_as_attention():
    """FlopCounterMode through the op's registered formula: 2 FLOPs per multiply-add of Q.K^T and P.V over max_len
    keys per sequence and head; traced with fake tensors, so nothing runs (nor needs triton)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.kv import triton_paged

    batch, n_heads, n_kv_heads, head_dim, block_size, max_len = 3, 8, 2, 64, 16, 70
    with FakeTensorMode():
        q = torch.empty(batch, n_heads, head_dim)
        pool = torch.empty(12, n_kv_heads, block_size, head_dim, dtype=torch.int8)
        scales = torch.empty(12, n_kv_heads, block_size)
        table, lens = torch.zeros(batch, 5, dtype=torch.long), torch.full((batch,), max_len, dtype=torch.int32)

        def step():
            triton_paged.paged_decode(
                q, pool, pool, table, lens, block_size=block_size, max_len=max_len, k_scale=scales, v_scale=scales
            )

        attention_flops, total_flops = _count_flops(step)
    assert attention_flops == total_flops == 2 * batch * n_heads * max_len * 2 * head_dim


def test_a_profiled_decode_through_the_kernel_counts_its_time_and_flops_as_attention(tiny_model, tiny_args):
    """The contiguous cache's int8 decode through the kernel (CUDA's path; here in Triton's interpreter)."""
    triton_kernels = pytest.importorskip("harness.kv.triton_kernels")
    if not triton_kernels.available() or not triton_kernels.INTERPRETED:
        pytest.skip(triton_kernels.UNAVAILABLE or "the kernels were not built for Triton's interpreter")
    from harness.kv import triton_paged

    cache = build_cache(tiny_args, "int8")
    cache.fused_dequant = True  # what CUDA decides (kernel_unsupported is None there)
    columns, top_ops = profile_decode(tiny_model, cache, make_prompt(tiny_args), n_steps=N_STEPS, device=CPU)
    context = PROMPT_LEN + 1
    formula = 2 * 2 * tiny_args.n_layers * tiny_args.n_heads * tiny_args.head_dim * context * BATCH
    assert columns["prof_attention_flops"] == formula  # every sequence holds the step's context: exact
    op = top_ops[top_ops["op"] == triton_paged.OP_NAME]
    assert list(op["category"]) == ["attention"] and columns["prof_attention_frac"] > 0
