"""Quantized paged blocks: each stored row of a paged cache (one slot's one kv head, D channels)
quantized as one group and packed into bytes, its codes and then its scale and zero:

    int8: D codes (uint8)                                   | scale | zero     D + 4 bytes
    int4: D / 2 bytes (channel 2j low nibble, 2j + 1 high)   | scale | zero     D / 2 + 4 bytes

scale and zero are float16, little-endian; x̂ = code · scale + zero, `kvcache.cache.quantize`'s
asymmetric arithmetic (zero rounded down, scale up, so nothing is clipped and |x - x̂| <= scale / 2).
Keys and values are both grouped per token (a row is written once, when its token is): per-channel
groups, as KIVI keeps keys, span tokens and would be re-quantized as a block fills.

A block is then plain bytes (blocks, S, H_kv, width): copy on write, prefix sharing, a row read
out (prompt-cache files) or a block sent to the KV store tiers move it quantized as they move
float blocks, and a kernel finds a row's codes and its scale in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.memory import PACKED_KV_DTYPES, PACKED_SCALE_BYTES, kv_dtype_name, kv_dtype_pair, packed_kv_dtype

from ..errors import CacheConfigError
from ..quantize import QuantizedRows, QuantSpec, dequantize, quantize

#: the quantized KV dtypes of a paged cache (`kvcache.memory` counts their bytes), and the bits of each
KV_DTYPE_BITS = {name: int(name.removeprefix("int")) for name in PACKED_KV_DTYPES}


def checked_kv_dtype(kv_dtype: str) -> str:
    """`kv_dtype` as its one name ("int8/int8" is "int8"); CacheConfigError unless it is one of
    PACKED_KV_DTYPES or a keys/values pair of them."""
    if not packed_kv_dtype(kv_dtype):
        raise CacheConfigError(
            f"kv_dtype must be one of {PACKED_KV_DTYPES} or a keys/values pair of them such as "
            f"'int8/int4', got {kv_dtype!r}"
        )
    return kv_dtype_name(*kv_dtype_pair(kv_dtype))


def scales_of(packed: torch.Tensor) -> torch.Tensor:
    """Packed rows (..., width) uint8 → each row's scale and zero (..., 2) float16 (a copy)."""
    return packed[..., -PACKED_SCALE_BYTES:].contiguous().view(torch.float16)


@dataclass(frozen=True)
class PackedRows:
    """How rows of `dim` channels are quantized to `bits` and packed (module docstring)."""

    bits: int
    dim: int

    def __post_init__(self) -> None:
        self.spec.check_head_dim(self.dim)

    @classmethod
    def of(cls, kv_dtype: str, dim: int) -> PackedRows:
        """The packing of `kv_dtype` ("int8", "int4") for rows of `dim` channels."""
        if kv_dtype not in KV_DTYPE_BITS:
            raise CacheConfigError(f"kv_dtype must be one of {tuple(KV_DTYPE_BITS)}, got {kv_dtype!r}")
        return cls(KV_DTYPE_BITS[kv_dtype], dim)

    @classmethod
    def pair(cls, kv_dtype: str, key_dim: int, value_dim: int) -> tuple[PackedRows, PackedRows]:
        """The keys' and values' packings of a KV dtype name ("int8", "int4", or "int8/int4":
        int8 keys, int4 values)."""
        keys, values = kv_dtype_pair(checked_kv_dtype(kv_dtype))
        return cls.of(keys, key_dim), cls.of(values, value_dim)

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def code_bytes(self) -> int:
        """Bytes of one row's codes."""
        return self.dim * self.bits // 8

    @property
    def width(self) -> int:
        """Bytes of one packed row, codes and scale and zero."""
        return self.code_bytes + PACKED_SCALE_BYTES

    @property
    def spec(self) -> QuantSpec:
        """The quantization of one row: one group of its `dim` channels, float16 scale and zero."""
        return QuantSpec("int", self.bits, group_size=self.dim, axis="token", scale_dtype=torch.float16)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) float → packed rows (..., width) uint8."""
        rows = x.reshape(1, 1, -1, self.dim)
        quantized = quantize(rows, self.spec)  # data (1, 1, N, code_bytes); scale, zero (1, 1, N, 1)
        data = quantized.data.reshape(-1, self.code_bytes)
        assert quantized.zero is not None
        scale = quantized.scale.reshape(-1, 1).view(torch.uint8)  # (N, 2)
        zero = quantized.zero.reshape(-1, 1).view(torch.uint8)
        return torch.cat((data, scale, zero), dim=1).reshape(*x.shape[:-1], self.width)

    def unpack(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Packed rows (..., width) uint8 → x̂ (..., D) in `dtype` (float32 arithmetic, rounded once)."""
        if packed.shape[-1] != self.width or packed.dtype != torch.uint8:
            raise CacheConfigError(
                f"packed {self.name} rows of dim {self.dim} are (..., {self.width}) uint8, got "
                f"{tuple(packed.shape)} {packed.dtype}"
            )
        flat = packed.reshape(-1, self.width)
        data = flat[:, : self.code_bytes].reshape(1, 1, -1, self.code_bytes)
        scale, zero = scales_of(flat).reshape(1, 1, -1, 2).unbind(-1)  # (1, 1, N) each
        rows = QuantizedRows(data, scale.unsqueeze(-1), zero.unsqueeze(-1))
        return dequantize(rows, self.spec, dtype).reshape(*packed.shape[:-1], self.dim)
