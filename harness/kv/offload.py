"""Offloaded KV cache: K/V live in pinned host memory and stream to the GPU one layer at a time.

The device holds only two layers' worth of K/V (double buffering): while layer i attends over its slot, layer i+1's
past is already copying into the other slot on a side stream, and each step's new K/V copy back to the host on
that same stream. GPU memory for KV drops from n_layers to 2 layers' worth; the price is PCIe (or NVLink-C2C)
bandwidth per step, which this strategy exists to measure (FlexGen, Sheng et al. 2023, streams KV the same way).

CUDA only: on any other device the point is `unsupported`, since there is no separate host memory to offload to.
The bookkeeping (which slot holds which layer, what is copied when) runs unchanged on the CPU in tests through
`SyncTransfers`, so only the streams themselves need a GPU.

The host store is page-locked exactly (harness.kv.host.page_locked_zeros): torch's pin_memory=True would round it up
to the next power of two, so a 9 GiB store would lock 16 GiB, and kv_bytes_host would understate what it costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness import kv
from harness.errors import ConfigError, Unsupported
from harness.formats import BITS, DTYPE_BYTES, QUANTIZED
from harness.formats import PLAIN as PLAIN_NAMES
from harness.kv import host, varlen
from harness.kv.base import CacheSpec, KVAllocation, Layout, Serving, attention, cache_width


@dataclass(frozen=True)
class Options:
    """`offload` takes no options: the host store is sized for prompt_len + gen_len, the device for two layers."""


class CudaTransfers:
    """Host<->device copies on one side stream, ordered against the compute stream with events."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.fetched = [torch.cuda.Event(), torch.cuda.Event()]  # per staging slot: its layer has arrived

    def fetch(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        # The slot was last read by the layer before; wait for the compute stream's work so far.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            self.fetched[slot].record()

    def wait(self, slot: int) -> None:
        torch.cuda.current_stream().wait_event(self.fetched[slot])

    def write_back(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())  # src was just written by the compute stream
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        self.stream.synchronize()

    @staticmethod
    def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The host store: page-locked, so that the copies above run asynchronously, and exactly its size."""
        return host.page_locked_zeros(shape, dtype)


class SyncTransfers:
    """The same calls as plain synchronous copies: the offload bookkeeping on a CPU, for tests."""

    def fetch(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def wait(self, slot: int) -> None:
        pass

    def write_back(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def synchronize(self) -> None:
        pass

    @staticmethod
    def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)


class OffloadCache(kv.KVCache):
    name: ClassVar[str] = "offload"
    recomputes_prefix: ClassVar[bool] = False
    attn_backend: ClassVar[str] = "sdpa"
    prefix_hit: ClassVar[None] = None

    def __init__(self, spec: CacheSpec, options: Options, transfers: CudaTransfers | SyncTransfers | None = None):
        if transfers is None:
            if spec.device.type != "cuda":
                raise Unsupported(
                    f"offload streams K/V from pinned host memory to a CUDA device; this point runs on "
                    f"{spec.device.type}, where the cache already lives in host memory"
                )
            transfers = CudaTransfers(spec.device)
        dtype = spec.plain_dtype  # quantized offload: Unsupported, raised by plain_dtype
        self.spec, self.transfers = spec, transfers
        # Token-major layouts, so that one step's tokens and one layer's past are each one contiguous copy.
        token_shape = (2, spec.batch_size, spec.n_kv_heads, spec.head_dim)  # K|V, B, H_kv, D
        self.host = transfers.host_zeros(
            (spec.n_layers, spec.max_tokens, *token_shape), dtype
        )  # [L, S, K|V, B, H_kv, D]
        self.staging = torch.zeros((2, spec.max_tokens, *token_shape), dtype=dtype, device=spec.device)
        self.slot_layer = [-1, -1]  # which layer each staging slot holds: bookkeeping the tests check
        self.n_tokens = 0

    def prepare(self, start_pos: int, n_new: int | None = None) -> None:
        if isinstance(start_pos, varlen.SeqBatch):  # serving
            raise Unsupported(
                "per-sequence lengths: offload does not take them (its two device slots stream one static batch's layers); allowed: contiguous, paged, prefix"
            )
        if start_pos + n_new > self.spec.max_tokens:
            raise ValueError(f"offload cache holds {self.spec.max_tokens} tokens, asked for {start_pos + n_new}")
        self.n_tokens = start_pos + n_new
        self._fetch(layer=0, n_past=start_pos)

    def _fetch(self, layer: int, n_past: int) -> None:
        """Start copying layer's past tokens into its slot (layer % 2)."""
        slot = layer % 2
        if n_past:
            self.transfers.fetch(slot, self.staging[slot, :n_past], self.host[layer, :n_past])
        self.slot_layer[slot] = layer

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        slot, end = layer % 2, start_pos + k.shape[2]
        assert self.slot_layer[slot] == layer, f"slot {slot} holds layer {self.slot_layer[slot]}, not {layer}"
        self.transfers.wait(slot)
        staged = self.staging[slot]  # [S, K|V, B, H_kv, D]
        staged[start_pos:end] = torch.stack((k, v)).permute(3, 0, 1, 2, 4)  # [2, B, H, T, D] -> [T, 2, B, H, D]
        self.transfers.write_back(self.host[layer, start_pos:end], staged[start_pos:end])
        if layer + 1 < self.spec.n_layers:
            self._fetch(layer + 1, n_past=start_pos)  # overlaps with this layer's attention and MLP
        kv = staged[:end].permute(1, 2, 3, 0, 4)  # [K|V, B, H_kv, S, D]
        return attention(q, kv[0], kv[1], start_pos, impl=self.spec.attn_impl)

    def release(self) -> None:
        self.transfers.synchronize()
        self.n_tokens = 0
        self.slot_layer = [-1, -1]

    def kv_bytes_host(self) -> int:
        return self.host.numel() * self.host.element_size()

    def data_tensors(self) -> list[torch.Tensor]:
        """Host store plus the two device slots; kv_bytes_host() tells them apart."""
        return [self.host, self.staging]

    def peak_columns(self) -> dict[str, int]:
        return {"kv_bytes_host": self.kv_bytes_host()}  # how much of it sits in host memory


class OffloadLayout(Layout):
    """The host store of every layer, and two device slots; the device slot is read in place."""

    def allocation(self, shape) -> KVAllocation:
        """host [L, S, K|V, B, H_kv, D] + staging [2, S, K|V, B, H_kv, D] (MLA: one latent side of one head),
        plain dtypes only."""
        args = shape.model
        per_token = args.cache_sides * shape.batch_size * cache_width(shape) * DTYPE_BYTES[shape.kv_dtype]
        per_layer = shape.max_tokens * per_token
        return KVAllocation(data_bytes=(args.n_layers + 2) * per_layer, host_bytes=args.n_layers * per_layer)

    def transients(self, shape, *, n_seqs: int, n_new: int, n_keys: int) -> tuple[int, int, int]:
        """torch.stack((k, v)) of the new tokens (MLA: its one side), at the compute dtype."""
        return shape.model.cache_sides * n_seqs * n_new * cache_width(shape) * DTYPE_BYTES[shape.dtype], 0, 0

    def check(self, shape) -> None:
        if shape.kv_dtype == "int4":
            raise ConfigError(
                f"kv_dtype: {self.name} cannot store int4; allowed: {', '.join(k for k in BITS if k != 'int4')}"
            )
        if shape.kv_dtype in QUANTIZED:
            raise ConfigError(f"kv_dtype: {self.name} stores plain dtypes only; allowed: {', '.join(PLAIN_NAMES)}")

    def check_device(self, device: str) -> None:
        if device != "cuda":
            raise ConfigError(
                f"cache: {self.name} streams K/V from host memory to a CUDA device; allowed here: device=cuda"
            )


STRATEGY = OffloadCache
LAYOUT = OffloadLayout
SERVING = Serving.refused(
    "its two device slots stream the layers of one static batch, not sequences at their own lengths"
)
