"""KV storage formats: the plain float dtypes and the quantized codecs (fp8, int8, int4).

A format name is what `kv_dtype` takes. Plain formats store K/V as that torch dtype; quantized ones store packed
values plus scales and dequantize on read.
"""

from __future__ import annotations

import torch

# Bits per stored K or V value, scales excluded: the payload of the seed notes' formula.
BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4}
PLAIN = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANTIZED = tuple(name for name in BITS if name not in PLAIN)
