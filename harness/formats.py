"""Storage and compute formats by name, torch-free: what a format costs in bytes, for the planner, the roofline, the
config's checks and the dashboard. harness.kv.quant maps these names to torch dtypes and holds the codecs.

A KV format is what `kv_dtype` takes: a plain float dtype (K/V stored as is) or a quantized codec (narrow values plus
fp32 scales, harness.kv.quant). "auto" stores K/V in the compute dtype, as vLLM's default does.
"""

from __future__ import annotations

# Bits per stored K or V value, scales excluded: the payload of the seed notes' formula.
BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4}
COMPUTE_DTYPES = ("fp32", "fp16", "bf16")  # weights and activations; also the plain KV formats
PLAIN = COMPUTE_DTYPES  # KV formats stored as a torch float dtype, with no scales
QUANTIZED = tuple(name for name in BITS if name not in PLAIN)  # codecs: narrow values plus fp32 scales
PER_TOKEN_SCALED = ("fp8_e4m3", "fp8_e5m2", "int8")  # one fp32 scale per token and KV head
DTYPE_BYTES = {name: BITS[name] // 8 for name in COMPUTE_DTYPES}  # bytes of one value of a compute dtype
SCALE_BYTES = 4  # quantization scales and zero points are fp32 (harness.kv.quant.SCALE_DTYPE)
TOKEN_ID_BYTES = 8  # prompts and generated ids are int64
KV_DTYPES = ("auto", *BITS)
KV_GROUP_SIZES = (32, 64)  # int4: values per quantization group
# How attention runs (harness.kv.base.attention): SDPA's fused kernels (flash or memory-efficient on CUDA, the flash
# kernel on the CPU), or eager, which writes the scores [B, H, T, S] out as attention did before FlashAttention.
ATTN_IMPLS = ("sdpa", "eager")
COMPILE_MODES = ("default", "reduce-overhead")  # torch.compile's modes a decode step can take here ("none": eager)

# The strategy whose K/V are exact at the compute dtype: a lossy point's accuracy reference (harness.run.point) and
# the dashboard's baseline, in the same workload, for ratios between strategies and formats. Here, torch-free, so
# that the dashboard names it without importing harness.kv.
EXACT_REFERENCE = "contiguous"
