"""How a paged cache stores one row (one slot's one kv head: D channels) in its KV dtype
(`PagedCache(kv_dtype=)`): a float row as D values of its dtype, or a quantized row packed into
bytes, its codes and then its scale and zero:

    float32, bfloat16, float16: D values                                      D × 4 or D × 2 bytes
    fp8:  D e4m3 codes (x / scale)                            | scale | 0       D + 4 bytes
    int8: D codes (uint8)                                     | scale | zero    D + 4 bytes
    int4: D / 2 bytes (channel 2j low nibble, 2j + 1 high)    | scale | zero    D / 2 + 4 bytes

scale and zero are float16, little-endian; a packed row is one group of `kvcache.cache.quantize`:
int x̂ = code · scale + zero (zero rounded down, scale up: nothing clipped, |x - x̂| <= scale / 2),
fp8 x̂ = e4m3(code) · scale (scale = max|x| / 448 rounded up, zero kept 0). Keys and values are both
grouped per token (a row is written once, when its token is): per-channel groups, as KIVI keeps
keys, span tokens and would be re-quantized as a block fills. fp8 rows are held as int8 bytes and
integer codes as uint8, so the kernels tell them apart by dtype (as float16 bits are int16 and
bfloat16's uint16).

A block is then plain storage (blocks, S, H_kv, width): copy on write, prefix sharing, a row read
out (prompt-cache files) or a block sent to the KV store tiers move it as stored, and a kernel
finds a row's codes and its scale in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcache.memory import (
    PACKED_KV_DTYPES,
    PACKED_SCALE_BYTES,
    PAGED_KV_DTYPES,
    kv_dtype_name,
    kv_dtype_pair,
    paged_kv_dtype,
)

from ..errors import CacheConfigError
from ..quantize import QuantizedRows, QuantSpec, dequantize, quantize

_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FP8_NAN = 0x7F  # e4m3fn's only non-finite code (either sign): never written, refused on read


def checked_kv_dtype(kv_dtype: str) -> str:
    """`kv_dtype` as its one name ("int8/int8" is "int8", "bf16" is "bfloat16"); CacheConfigError
    unless it is one of PAGED_KV_DTYPES or a keys/values pair of them."""
    if not paged_kv_dtype(kv_dtype):
        raise CacheConfigError(
            f"kv_dtype must be one of {PAGED_KV_DTYPES} or a keys/values pair of them such as "
            f"'int8/int4', got {kv_dtype!r}"
        )
    return kv_dtype_name(*kv_dtype_pair(kv_dtype))


def scales_of(packed: torch.Tensor) -> torch.Tensor:
    """Packed rows (..., width) uint8 or int8 → each row's scale and zero (..., 2) float16 (a copy)."""
    return packed[..., -PACKED_SCALE_BYTES:].contiguous().view(torch.float16)


@dataclass(frozen=True)
class FloatRows:
    """Rows of `dim` channels stored as values of `dtype` (a cast each way)."""

    dtype: torch.dtype
    dim: int

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def width(self) -> int:
        """Elements of one stored row."""
        return self.dim

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.dtype

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) float → stored rows (..., D) of `dtype` (rounded to nearest)."""
        return x.to(self.dtype)

    def unpack(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows (..., D) → (..., D) in `dtype`."""
        return rows.to(dtype)

    def valid(self, rows: torch.Tensor) -> bool:
        """Whether stored rows (as `pack` gives them; read back from a stranger's file or store)
        hold finite numbers only: one pass, nothing allocated, as a float64 sum of float32 or half
        values cannot overflow and is finite exactly when each is."""
        return math.isfinite(float(rows.sum(dtype=torch.float64)))


@dataclass(frozen=True)
class PackedRows:
    """How rows of `dim` channels are quantized to `name` ("fp8", "int8", "int4") and packed
    (module docstring)."""

    name: str
    dim: int

    def __post_init__(self) -> None:
        if self.name not in PACKED_KV_DTYPES:
            raise CacheConfigError(f"a packed row is one of {PACKED_KV_DTYPES}, got {self.name!r}")
        self.spec.check_head_dim(self.dim)

    @property
    def code_bytes(self) -> int:
        """Bytes of one row's codes."""
        return self.dim // 2 if self.name == "int4" else self.dim

    @property
    def width(self) -> int:
        """Bytes of one packed row, codes and scale and zero."""
        return self.code_bytes + PACKED_SCALE_BYTES

    @property
    def storage_dtype(self) -> torch.dtype:
        """int8 bytes for fp8 codes, uint8 for integer codes (module docstring)."""
        return torch.int8 if self.name == "fp8" else torch.uint8

    @property
    def spec(self) -> QuantSpec:
        """The quantization of one row: one group of its `dim` channels, float16 scale (and zero)."""
        kind, bits = ("fp8", 8) if self.name == "fp8" else ("int", int(self.name.removeprefix("int")))
        return QuantSpec(kind, bits, group_size=self.dim, axis="token", scale_dtype=torch.float16)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) float → packed rows (..., width) of `storage_dtype`."""
        quantized = quantize(x.reshape(1, 1, -1, self.dim), self.spec)  # data (1, 1, N, code_bytes)
        data = quantized.data.reshape(-1, self.code_bytes).view(self.storage_dtype)
        scale = quantized.scale.reshape(-1, 1)  # (N, 1) float16
        zero = quantized.zero.reshape(-1, 1) if quantized.zero is not None else torch.zeros_like(scale)
        trailer = torch.cat((scale, zero), dim=1).view(self.storage_dtype)  # (N, 4) bytes
        return torch.cat((data, trailer), dim=1).reshape(*x.shape[:-1], self.width)

    def unpack(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Packed rows (..., width) → x̂ (..., D) in `dtype` (float32 arithmetic, rounded once)."""
        if packed.shape[-1] != self.width or packed.dtype != self.storage_dtype:
            raise CacheConfigError(
                f"packed {self.name} rows of dim {self.dim} are (..., {self.width}) {self.storage_dtype}, "
                f"got {tuple(packed.shape)} {packed.dtype}"
            )
        flat = packed.reshape(-1, self.width)
        data = flat[:, : self.code_bytes].reshape(1, 1, -1, self.code_bytes)
        scale, zero = scales_of(flat).reshape(1, 1, -1, 2).unbind(-1)  # (1, 1, N) each
        rows = QuantizedRows(data, scale.unsqueeze(-1), zero.unsqueeze(-1) if self.name != "fp8" else None)
        return dequantize(rows, self.spec, dtype).reshape(*packed.shape[:-1], self.dim)

    def valid(self, packed: torch.Tensor) -> bool:
        """Whether packed rows (read back from a stranger's file or store) are rows `pack` could
        write: finite scales and zeros; for fp8, no NaN code and every zero 0 (the kernels add
        zero · Σq, the seam ignores it: a nonzero one would decode two ways)."""
        scales = scales_of(packed)
        if not bool(torch.isfinite(scales).all()):
            return False
        if self.name != "fp8":
            return True
        codes = packed[..., : self.code_bytes]
        return not bool((codes.bitwise_and(_FP8_NAN) == _FP8_NAN).any()) and not bool(scales[..., 1].any())


RowFormat = FloatRows | PackedRows


def row_format(kv_dtype: str, dim: int) -> RowFormat:
    """How rows of `dim` channels are stored in one side's KV dtype (a PAGED_KV_DTYPES name)."""
    if kv_dtype in _FLOATS:
        return FloatRows(_FLOATS[kv_dtype], dim)
    return PackedRows(kv_dtype, dim)


def row_formats(kv_dtype: str, key_dim: int, value_dim: int) -> tuple[RowFormat, RowFormat]:
    """The keys' and values' formats of a KV dtype name ("int8", "bfloat16", or "int8/int4":
    int8 keys, int4 values)."""
    keys, values = kv_dtype_pair(checked_kv_dtype(kv_dtype))
    return row_format(keys, key_dim), row_format(values, value_dim)
