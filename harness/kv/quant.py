"""KV storage formats: the plain float dtypes and the quantized codecs (fp8, int8, int4).

A format name is what `kv_dtype` takes. Plain formats store K/V as that torch dtype; quantized ones store narrow
values plus scales and dequantize on read, into the query's dtype. Scales are computed and stored in fp32
(`SCALE_DTYPE`): one per token and head costs 4 bytes per head_dim values (3% of fp8/int8 at head_dim 128).

Per token (`TokenCodec`, layout-independent, so any strategy can store it wherever a token goes):
    fp8_e4m3, fp8_e5m2  one scale per token and KV head, amax / format max, so values land in the format's range
                        (448 / 57344) and are clamped there before the cast; the scale is "per KV head, computed
                        from the data" at token granularity, which keeps the codec free of any history.
    int8                symmetric, one scale per token and head: amax / 127, round to nearest.

int4 (`Int4Kivi`): KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").
    Asymmetric min/max (a scale and a zero point per group, levels 0..15): at 4 bits a symmetric grid wastes a level
    and half its range on a group whose values sit off zero, which key channels do (KIVI's outlier channels).
    Keys per channel: each channel is grouped over G = kv_group_size consecutive tokens (scale/zero [.., S/G, D]).
    Values per token: groups of G consecutive channels (scale/zero [.., S, D/G]).
    Two 4-bit values per uint8 along head_dim: data [.., S, D/2], low nibble = even channel.
    Full precision tail: a key group is quantized only once complete and older than the `residual` most recent
    tokens; a value, once older than them. Until then tokens stay exact in a per-sequence ring buffer, in the compute
    dtype of the cache's first write (allocated then; lossless for that dtype, and what a real kernel would keep).
    It holds at most residual + G - 1 keys and `residual` values, and counts in kv_bytes_allocated.

A strategy stores every format through the same two calls (`RowStore`): rows of a named part, indexed by position
(or position // G for int4 key scales). The formats below (`TokenFormat`, `Int4Kivi`) hold all the quantization
logic once, so `contiguous` and `paged` run exactly the same math and produce the same tokens. A strategy attends
over what it reads back, the new tokens included: a prefill sees the same quantized K/V that a token-by-token
decode of the same positions would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch.profiler import record_function

from harness.errors import Unsupported
from harness.formats import BITS, COMPUTE_DTYPES

if TYPE_CHECKING:  # base imports this module
    from harness.kv.base import CacheSpec

# The plain formats (harness.formats.PLAIN) by name -> their torch dtypes; the formats' bits live in harness.formats.
PLAIN = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
assert tuple(PLAIN) == COMPUTE_DTYPES

SCALE_DTYPE = torch.float32  # scales and zero points: computed and kept in fp32
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # finfo max: 448, 57344
INT8_MAX = 127  # symmetric: -127..127, so 0 is exact and the grid is the same on both sides
INT4_MAX = 15  # asymmetric: levels 0..15


# --- per-token codecs --------------------------------------------------------------------------------------------


class TokenCodec(Protocol):
    name: str

    def alloc(self, shape: tuple[int, ...], device: torch.device) -> dict[str, torch.Tensor]:
        """shape (..., D), the logical float shape -> zero-filled parts ("data", maybe "scale") with leading dims (...)."""
        ...

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [..., D] float -> parts with the same leading dims."""
        ...

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """-> [..., D] in dtype."""
        ...


@dataclass(frozen=True)
class PlainCodec:
    name: str
    dtype: torch.dtype

    def alloc(self, shape: tuple[int, ...], device: torch.device) -> dict[str, torch.Tensor]:
        return {"data": torch.zeros(shape, dtype=self.dtype, device=device)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"data": x.to(self.dtype)}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return parts["data"].to(dtype)  # no copy when the dtypes agree: a contiguous read stays a view


@dataclass(frozen=True)
class ScaledCodec:
    """fp8 or int8 with one fp32 scale per token and head: x ~ data * scale, scale = amax / max_code."""

    name: str
    dtype: torch.dtype
    max_code: float  # the largest stored magnitude: 448 (e4m3), 57344 (e5m2), 127 (int8)

    def alloc(self, shape: tuple[int, ...], device: torch.device) -> dict[str, torch.Tensor]:
        return {
            "data": torch.zeros(shape, dtype=self.dtype, device=device),  # [..., D]
            "scale": torch.zeros((*shape[:-1], 1), dtype=SCALE_DTYPE, device=device),  # [..., 1]
        }

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x.to(SCALE_DTYPE)
        scale = x.abs().amax(dim=-1, keepdim=True) / self.max_code  # [..., 1]
        scaled = x / torch.where(scale > 0, scale, 1.0)  # an all-zero token keeps scale 0 and stays zero
        if self.dtype.is_floating_point:  # fp8: clamp before the cast (e4m3fn has no inf: it would become nan)
            data = scaled.clamp(-self.max_code, self.max_code).to(self.dtype)
        else:
            data = scaled.round().clamp(-self.max_code, self.max_code).to(self.dtype)
        return {"data": data, "scale": scale}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return (parts["data"].to(SCALE_DTYPE) * parts["scale"]).to(dtype)


def token_codec(name: str) -> TokenCodec:
    """The per-token codec of a format; int4 has none (its keys group across tokens: see Int4Kivi)."""
    if name in PLAIN:
        return PlainCodec(name, PLAIN[name])
    if name in FP8:
        return ScaledCodec(name, FP8[name], torch.finfo(FP8[name]).max)
    if name == "int8":
        return ScaledCodec(name, torch.int8, INT8_MAX)
    if name == "int4":
        raise Unsupported("int4 has no per-token codec: its keys are quantized per channel across token groups")
    raise ValueError(f"kv_dtype: unknown format {name!r}; allowed: {', '.join(BITS)}")


# --- int4 ---------------------------------------------------------------------------------------------------------


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [..., D] uint8 in 0..15 -> [..., D/2] uint8, two values per byte (even index in the low nibble)."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed [..., D/2] uint8 -> [..., D] uint8 in 0..15."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _minmax_int4(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of groups laid along `dim` of x (fp32): x ~ q * scale + zero, q in 0..15."""
    zero = x.amin(dim=dim, keepdim=True)
    scale = (x.amax(dim=dim, keepdim=True) - zero) / INT4_MAX
    q = ((x - zero) / torch.where(scale > 0, scale, 1.0)).round().clamp(0, INT4_MAX).to(torch.uint8)
    return q, scale, zero


def encode_int4_keys(k: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """Per channel: k [..., S, D], S a multiple of group -> data [..., S, D/2], scale and zero [..., S/group, D]."""
    q, scale, zero = _minmax_int4(k.to(SCALE_DTYPE).unflatten(-2, (k.shape[-2] // group, group)), dim=-2)
    return {"data": pack_int4(q.flatten(-3, -2)), "scale": scale.squeeze(-2), "zero": zero.squeeze(-2)}


def decode_int4_keys(parts: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> torch.Tensor:
    q = unpack_int4(parts["data"]).to(SCALE_DTYPE)  # [..., S, D]
    q = q.unflatten(-2, (q.shape[-2] // group, group))  # [..., S/G, G, D]
    return (q * parts["scale"].unsqueeze(-2) + parts["zero"].unsqueeze(-2)).flatten(-3, -2).to(dtype)


def encode_int4_values(v: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """Per token: v [..., S, D] -> data [..., S, D/2], scale and zero [..., S, D/group]."""
    q, scale, zero = _minmax_int4(v.to(SCALE_DTYPE).unflatten(-1, (v.shape[-1] // group, group)), dim=-1)
    return {"data": pack_int4(q.flatten(-2)), "scale": scale.squeeze(-1), "zero": zero.squeeze(-1)}


def decode_int4_values(parts: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> torch.Tensor:
    q = unpack_int4(parts["data"]).to(SCALE_DTYPE)  # [..., S, D]
    q = q.unflatten(-1, (q.shape[-1] // group, group))  # [..., S, D/G, G]
    return (q * parts["scale"].unsqueeze(-1) + parts["zero"].unsqueeze(-1)).flatten(-2).to(dtype)


# --- formats: how a strategy's storage holds one kv_dtype ------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One stored tensor of a format: a row of `width` values per `tokens` consecutive positions."""

    tokens: int  # positions per row: 1, or kv_group_size for int4 key scales
    width: int
    dtype: torch.dtype


class RowStore(Protocol):
    """What a strategy offers a format. Part names: "k" and "v" (the data), "k_scale", "v_zero", ..."""

    def put_rows(self, layer: int, name: str, x: torch.Tensor, first: int) -> None:
        """x [B, H_kv, n, width] becomes rows first..first+n-1 of part `name` of every sequence."""
        ...

    def get_rows(self, layer: int, name: str, n: int) -> torch.Tensor:
        """The first n rows of part `name`: [B, H_kv, n, width]."""
        ...


def _part_name(side: str, part: str) -> str:
    return side if part == "data" else f"{side}_{part}"


def _stored(sides: tuple[str, ...], k: torch.Tensor, v: torch.Tensor | None) -> tuple[tuple[str, torch.Tensor], ...]:
    """(side, tensor) for each stored side: MLA's latent (sides ("k",)) stores K alone, v is None."""
    return (("k", k),) if sides == ("k",) else (("k", k), ("v", v))


class TokenFormat:
    """Plain and per-token formats: every part has a row per token, written as the token arrives.

    latent_v_dim > 0 (MLA's latent, harness.kv.base.CacheSpec): only K is stored, and read returns V as the view
    K[..., :latent_v_dim]."""

    def __init__(self, codec: TokenCodec, head_dim: int, latent_v_dim: int = 0) -> None:
        self.codec, self.latent_v_dim = codec, latent_v_dim
        self.sides = ("k",) if latent_v_dim else ("k", "v")
        self.codec_parts = {  # shapes and dtypes only: the meta device allocates nothing
            name: Part(1, t.shape[-1], t.dtype) for name, t in codec.alloc((1, head_dim), torch.device("meta")).items()
        }

    def parts(self) -> dict[str, Part]:
        """The "data" part is K's and V's alike; the scales are per side ("k_scale", "v_scale")."""
        scales = {
            _part_name(side, p): part for side in self.sides for p, part in self.codec_parts.items() if p != "data"
        }
        return {"data": self.codec_parts["data"], **scales}

    def write(self, store: RowStore, layer: int, k: torch.Tensor, v: torch.Tensor | None, start_pos: int) -> None:
        with record_function("kvbench::kv_write"):  # harness.measure.profile: what runs inside is KV time
            for side, x in _stored(self.sides, k, v):
                for part, rows in self.codec.encode(x).items():
                    store.put_rows(layer, _part_name(side, part), rows, start_pos)

    def read(self, store: RowStore, layer: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        with record_function("kvbench::kv_read"):
            k, *v = (
                self.codec.decode({p: store.get_rows(layer, _part_name(side, p), end) for p in self.codec_parts}, dtype)
                for side in self.sides
            )
            return k, v[0] if v else k[..., : self.latent_v_dim]

    def tensors(self) -> list[torch.Tensor]:
        return []  # everything lives in the strategy's parts


class Int4Kivi:
    """int4 per KIVI: quantized keys per channel and values per token, plus each sequence's full-precision tail."""

    def __init__(self, spec: CacheSpec) -> None:
        self.spec, self.group, self.residual = spec, spec.kv_group_size, spec.kv_residual
        self.sides, self.latent_v_dim = spec.sides, spec.latent_v_dim  # MLA's latent: K alone, V its first channels
        if "v" in self.sides and spec.head_dim % self.group:  # values group channels; keys group tokens
            raise Unsupported(
                f"int4: kv_group_size {self.group} does not divide head_dim {spec.head_dim}; "
                "allowed: a group size dividing head_dim"
            )
        # Ring capacity per side: the most tokens ever waiting in full precision (n - n_quantized(n) at its largest).
        capacity = {"k": min(self.residual + self.group - 1, spec.max_tokens), "v": min(self.residual, spec.max_tokens)}
        self.capacity = {side: capacity[side] for side in self.sides}
        self.tail: dict[str, torch.Tensor] = {}  # side -> [L, B, H_kv, capacity, D]; allocated on the first write

    def parts(self) -> dict[str, Part]:
        d, g = self.spec.head_dim, self.group
        parts = {
            "data": Part(1, d // 2, torch.uint8),
            "k_scale": Part(g, d, SCALE_DTYPE),
            "k_zero": Part(g, d, SCALE_DTYPE),
        }
        if "v" in self.sides:
            parts |= {"v_scale": Part(1, d // g, SCALE_DTYPE), "v_zero": Part(1, d // g, SCALE_DTYPE)}
        return parts

    def n_quantized(self, side: str, n_tokens: int) -> int:
        """Of the first n_tokens, how many are stored quantized; the rest wait in the tail."""
        aged = max(0, n_tokens - self.residual)
        return aged - aged % self.group if side == "k" else aged  # keys: whole groups only

    def _slots(self, side: str, start: int, end: int, device: torch.device) -> torch.Tensor:
        return torch.arange(start, end, device=device) % self.capacity[side]  # the ring: position p at p % capacity

    def write(self, store: RowStore, layer: int, k: torch.Tensor, v: torch.Tensor | None, start_pos: int) -> None:
        if not self.tail:
            spec = self.spec
            self.tail = {
                side: torch.zeros(
                    (spec.n_layers, spec.batch_size, spec.n_kv_heads, self.capacity[side], spec.head_dim),
                    dtype=k.dtype,
                    device=k.device,
                )
                for side in self.sides
            }
        with record_function("kvbench::kv_write"):
            for side, x in _stored(self.sides, k, v):
                self._write_side(store, layer, side, x, start_pos)

    def _write_side(self, store: RowStore, layer: int, side: str, x: torch.Tensor, start: int) -> None:
        end = start + x.shape[2]  # x [B, H_kv, T, D] for positions start..end-1
        old, new = self.n_quantized(side, start), self.n_quantized(side, end)
        # [B, H_kv, capacity, D]. A pass over one sequence standing for all (prefix caching's shared prefix, x is
        # [1, ...]) reads the first row and broadcasts its writes to every sequence's ring: they all hold those tokens.
        tail = self.tail[side][layer]
        if new > old:  # positions old..new-1 age out of the tail: the earlier ones sit in the ring, the rest in x
            from_tail = tail[: x.shape[0], :, self._slots(side, old, min(new, start), x.device)]
            aging = torch.cat((from_tail.to(SCALE_DTYPE), x[:, :, : max(0, new - start)].to(SCALE_DTYPE)), dim=2)
            encoded = encode_int4_keys(aging, self.group) if side == "k" else encode_int4_values(aging, self.group)
            for part, rows in encoded.items():
                store.put_rows(layer, _part_name(side, part), rows, old // self._tokens_per_row(side, part))
        keep = max(start, new)  # positions keep..end-1 of x stay in full precision
        if end > keep:
            tail[:, :, self._slots(side, keep, end, x.device)] = x[:, :, keep - start :].to(tail.dtype)

    def _tokens_per_row(self, side: str, part: str) -> int:
        return self.group if side == "k" and part != "data" else 1  # key scales: a row per group of tokens

    def read(self, store: RowStore, layer: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        with record_function("kvbench::kv_read"):
            k, *v = (self._read_side(store, layer, side, end, dtype) for side in self.sides)
            return k, v[0] if v else k[..., : self.latent_v_dim]

    def _read_side(self, store: RowStore, layer: int, side: str, end: int, dtype: torch.dtype) -> torch.Tensor:
        n = self.n_quantized(side, end)
        rows = {
            part: store.get_rows(layer, _part_name(side, part), n // self._tokens_per_row(side, part))
            for part in ("data", "scale", "zero")
        }
        decode = decode_int4_keys if side == "k" else decode_int4_values
        quantized = decode(rows, self.group, dtype)  # [B, H_kv, n, D]
        tail = self.tail[side][layer][: quantized.shape[0]]  # every row, or the first for a one-sequence pass
        tail = tail[:, :, self._slots(side, n, end, quantized.device)].to(dtype)
        return torch.cat((quantized, tail), dim=2)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.tail.values())  # the full-precision tail: real storage, counted in kv_bytes_allocated


def storage_format(spec: CacheSpec) -> TokenFormat | Int4Kivi:
    """The format object for spec.kv_dtype: one per cache (int4's holds that cache's tail)."""
    if spec.kv_dtype == "int4":
        return Int4Kivi(spec)
    return TokenFormat(token_codec(spec.kv_dtype), spec.head_dim, latent_v_dim=spec.latent_v_dim)
