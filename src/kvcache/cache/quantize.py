"""Pure quantize/dequantize of key/value rows in groups: asymmetric int8/int4, or fp8 e4m3.

A tensor x (B, H, T, D) is cut into groups that each get their own scale:
    axis="token":   each token's D channels in groups of `group_size` (a group never spans
                    tokens), scales (B, H, T, D / group_size);
    axis="channel": each channel over `group_size` consecutive tokens, scales
                    (B, H, T / group_size, D); T must be a multiple of group_size.
int (bits 8 or 4), per group: zero = min rounded down, scale = (max - zero) / (2^bits - 1)
rounded up (both in `scale_dtype`), q = round((x - zero) / scale) in [0, 2^bits - 1], so
|x - dequantize(q)| <= scale / 2 and nothing is clipped. int4 packs two codes per byte
(channel 2j in the low nibble, 2j + 1 in the high one).
fp8 (kind="fp8"): symmetric, scale = max|x| / 448 rounded up, y = x / scale stored as
torch.float8_e4m3fn; |x - x̂| <= max(|x| / 16, scale / 1024) (half a step of 3 mantissa bits,
or of the smallest subnormal).
Every group's scale comes from that group alone, so a later outlier is never clipped by a scale
fixed earlier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import CacheConfigError

KINDS = ("int", "fp8")
AXES = ("token", "channel")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class QuantSpec:
    """How rows are quantized: kind "int" (bits 8 or 4) or "fp8" (bits 8), groups along `axis`."""

    kind: str = "int"
    bits: int = 8
    group_size: int = 64
    axis: str = "token"
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CacheConfigError(f"quantization kind must be one of {KINDS}, got {self.kind!r}")
        allowed = (8, 4) if self.kind == "int" else (8,)
        if self.bits not in allowed:
            raise CacheConfigError(f"{self.kind} quantization takes bits in {allowed}, got {self.bits!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise CacheConfigError(f"group_size must be an int >= 1, got {self.group_size!r}")
        if self.axis not in AXES:
            raise CacheConfigError(f"axis must be one of {AXES}, got {self.axis!r}")
        if not self.scale_dtype.is_floating_point or self.scale_dtype.itemsize < 2:
            raise CacheConfigError(
                f"scale_dtype must be float16, bfloat16, float32 or float64, got {self.scale_dtype}"
            )

    @property
    def levels(self) -> int:
        """Largest integer code, 2^bits - 1 (int kinds)."""
        return (1 << self.bits) - 1

    @property
    def has_zero(self) -> bool:
        """Whether groups store a zero point (asymmetric int) besides the scale."""
        return self.kind == "int"

    def channel_group(self, head_dim: int) -> int:
        """Channels per group for axis="token": group_size, or the whole head if it is smaller."""
        group = min(self.group_size, head_dim)
        if head_dim % group:
            raise CacheConfigError(
                f"head_dim {head_dim} is not a multiple of group_size {group}: per-token groups "
                f"must tile the head (choose a group_size that divides {head_dim})"
            )
        return group

    def check_head_dim(self, head_dim: int) -> None:
        """Raise `CacheConfigError` unless rows of `head_dim` channels can be stored."""
        if self.kind == "int" and self.bits == 4 and head_dim % 2:
            raise CacheConfigError(f"int4 packs two channels per byte: head_dim must be even, got {head_dim}")
        if self.axis == "token":
            self.channel_group(head_dim)


@dataclass
class QuantizedRows:
    """Quantized rows of x (B, H, T, D): codes and per-group scale (and zero point for int).

    data: int8 → (B, H, T, D) uint8; int4 → (B, H, T, D / 2) uint8; fp8 → (B, H, T, D) e4m3.
    scale, zero: (B, H, T, D / g) for axis "token", (B, H, T / g, D) for axis "channel";
    zero is None for fp8.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None


def _round_toward(value: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """float32 `value` converted to `dtype`, rounded up (or down) instead of to nearest."""
    stored = value.to(dtype)
    if dtype == value.dtype:
        return stored
    limit = torch.full_like(stored, float("inf") if up else float("-inf"))
    wrong = stored.float() < value if up else stored.float() > value
    return torch.where(wrong, torch.nextafter(stored, limit), stored)


def _grouped(x: torch.Tensor, spec: QuantSpec, view: bool = False) -> tuple[torch.Tensor, int]:
    """x (B, H, T, D) reshaped with the members of a group along one dim, and that dim:
    (B, H, T, D/g, g) and 4 for "token"; (B, H, T/g, g, D) and 3 for "channel".
    view=True: a view of x or an error, never a copy (the caller writes through it)."""
    batch, heads, tokens, dim = x.shape
    shape_as = x.view if view else x.reshape
    if spec.axis == "token":
        group = spec.channel_group(dim)
        return shape_as(batch, heads, tokens, dim // group, group), 4
    if tokens % spec.group_size:
        raise CacheConfigError(
            f"per-channel groups need a multiple of group_size={spec.group_size} tokens, got {tokens}"
        )
    return shape_as(batch, heads, tokens // spec.group_size, spec.group_size, dim), 3


def quantize(x: torch.Tensor, spec: QuantSpec) -> QuantizedRows:
    """Quantize x (B, H, T, D) group by group; see the module docstring for the bounds."""
    spec.check_head_dim(x.shape[-1])
    groups, member = _grouped(x.float(), spec)  # float32, members of a group along `member`
    if spec.kind == "fp8":
        amax = groups.abs().amax(dim=member)  # (B, H, T, D/g) or (B, H, T/g, D)
        scale = _round_toward(amax / FP8_MAX, spec.scale_dtype, up=True)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
        scaled = (groups / scale.float().unsqueeze(member)).clamp_(-FP8_MAX, FP8_MAX)
        return QuantizedRows(scaled.reshape(x.shape).to(FP8), scale, None)
    low = groups.amin(dim=member)  # (B, H, T, D/g) or (B, H, T/g, D)
    high = groups.amax(dim=member)
    zero = _round_toward(low, spec.scale_dtype, up=False)
    scale = _round_toward((high - zero.float()) / spec.levels, spec.scale_dtype, up=True)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0
    codes = ((groups - zero.float().unsqueeze(member)) / scale.float().unsqueeze(member)).round_()
    codes = codes.clamp_(0, spec.levels).reshape(x.shape).to(torch.uint8)  # (B, H, T, D)
    if spec.bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)  # (B, H, T, D / 2)
    return QuantizedRows(codes, scale, zero)


def fp8_as_float16(data: torch.Tensor) -> torch.Tensor:
    """e4m3 values × 2^-8, exactly, as float16, by moving bits (CPU casts from float8 are slow).

    e4m3fn (sign, 4 exponent bits with bias 7, 3 mantissa bits) laid into float16's (sign, 5
    exponent bits with bias 15, 10 mantissa bits) with a leading 0 exponent bit is the same
    number scaled by 2^(7 - 15), subnormals included; NaN codes are never stored.
    """
    widened = data.view(torch.int8).to(torch.int16) << 7  # sign fills bits 15..14
    return (widened & -16385).view(torch.float16)  # clear bit 14 (0xBFFF)


def dequantize(rows: QuantizedRows, spec: QuantSpec, dtype: torch.dtype, out: torch.Tensor | None = None):
    """x̂ = code · scale (+ zero) as (B, H, T, D) in `dtype`, written into `out` if given (a
    (B, H, T, D) tensor of `dtype`, e.g. a view of a larger buffer).

    The arithmetic runs in float32, in place in `out` for a float32 cache (codes copied in, then
    scaled), else in a float32 workspace copied into `out` once, so a bf16/fp16 cache rounds
    each value once, like the unquantized cache it stands in for.
    """
    shape = (*rows.data.shape[:3], rows.data.shape[3] * (2 if spec.kind == "int" and spec.bits == 4 else 1))
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=rows.data.device)
    work = out if out.dtype == torch.float32 else torch.empty(shape, device=out.device)  # float32
    scale = rows.scale
    if spec.kind == "fp8":
        work.copy_(fp8_as_float16(rows.data))
        scale = scale.float() * 256.0
    elif spec.bits == 4:
        work[..., 0::2].copy_(rows.data & 0x0F)
        work[..., 1::2].copy_(rows.data >> 4)
    else:
        work.copy_(rows.data)
    groups, member = _grouped(work, spec, view=True)
    groups.mul_(scale.unsqueeze(member))
    if rows.zero is not None:
        groups.add_(rows.zero.unsqueeze(member))
    if work is not out:
        out.copy_(work)
    return out


def error_bound(x: torch.Tensor, rows: QuantizedRows, spec: QuantSpec) -> torch.Tensor:
    """The analytic bound on |x - dequantize(quantize(x))| per element, (B, H, T, D) float32:
    half a step of each element's group (int), or half a mantissa step (fp8)."""
    groups, member = _grouped(x, spec)
    step = rows.scale.float().unsqueeze(member).expand(groups.shape).reshape(x.shape)
    if spec.kind == "int":
        return step / 2
    return torch.maximum(x.float().abs() / 16, step / 1024)
