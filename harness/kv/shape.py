"""KVShape: what a strategy's layout and the roofline know of a workload, and nothing above this package.

The model's geometry, the formats, the batch and the lengths, frozen. harness.config.Workload builds one
(Workload.kv_shape, its kv_dtype resolved); so harness/kv/ reads a workload without importing harness.config, which
imports it (issue #28 item 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.modeling.model_args import ModelArgs


@dataclass(frozen=True)
class KVShape:
    """One workload as the layouts (harness.kv.base.Layout) and the roofline (harness.analytic.roofline) see it. Token counts
    are per sequence; the roofline's one-step costs take their own varying length (context_len, prefix_cached)."""

    model: ModelArgs  # the geometry: layers, heads, widths (MLA's cache_heads and cache_head_dim)
    dtype: str  # the compute dtype's name (harness.formats.PLAIN)
    kv_dtype: str  # the KV storage format, resolved (harness.formats.BITS): never "auto"
    batch_size: int = 1  # concurrent sequences
    prompt_len: int = 1  # tokens per prompt
    gen_len: int = 1  # tokens generated per sequence
    kv_group_size: int = 32  # int4: values per quantization group
    kv_residual: int = 0  # int4: the most recent tokens kept in full precision (KIVI's residual)
    prefix_len: int = 0  # leading prompt tokens every sequence of the batch shares (a system prompt)
    attn_impl: str = "sdpa"  # harness.formats.ATTN_IMPLS
    mla_path: str = "absorbed"  # MLA's decode path (harness.modeling.mla.MLA_PATHS)

    def __post_init__(self) -> None:
        if self.kv_dtype == "auto":
            raise ValueError("KVShape.kv_dtype: a resolved format, not 'auto' (Workload.kv_dtype_name resolves it)")

    @property
    def max_tokens(self) -> int:
        """The longest a sequence gets: prompt_len + gen_len."""
        return self.prompt_len + self.gen_len
