"""One stored key or value row as the kernels' attention scores, sums and writes it: a float row
(float32, bfloat16 bits, float16 bits: `numba_values`) element by element, a packed row (a
quantized paged cache's row, codes then float16 scale and zero, `kvcache.cache.paged.formats`:
uint8 integer codes, int8 fp8 e4m3 codes) through its codes, x̂ = code · scale + zero, never
widened into a copy. Imported with the kernels.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from kvcache.backends.cpu.numba_values import (
    FLAGS,
    float16_rounded,
    float16_widened,
    narrowed,
    quotient,
    widened,
)
from kvcache.memory import PACKED_SCALE_BYTES  # (bytes after a packed row's codes: scale, zero)

_INLINE = dict(inline="always", jit_options=dict(fastmath=FLAGS, error_model="numpy"))
_PACKED = (numba.types.uint8, numba.types.int8)  # integer codes, fp8 codes
_FP8_MAX, _FP8_SMALLEST_NORMAL = np.float32(448.0), np.float32(2.0**-6)


def _fp8_values() -> np.ndarray:
    """(256,) float32: the e4m3fn value of each code (sign, 4 exponent bits of bias 7, 3 mantissa
    bits; exponent 0 subnormal); the NaN codes 0x7F, 0xFF (never stored) as NaN."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 15, (codes & 7).astype(np.float32)
    normal = (1 + mantissa / 8) * np.exp2(exponent.astype(np.float32) - 7)
    values = np.where(exponent == 0, mantissa / 8 * np.float32(2.0**-6), normal).astype(np.float32)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return np.where(codes >= 128, -values, values).astype(np.float32)


_FP8_VALUES = _fp8_values()


def scored(queries, row, query_sums, scores, work):  # typed by the overload below
    """scores (G,) = queries (G, D) · the row's D values; query_sums (G,): each query's sum (a
    packed row's zero point multiplies it); work (D,) float32: scratch for a packed row's codes."""
    raise NotImplementedError


def accumulated(summed, weights, row, work):  # typed by the overload below
    """summed (G, D) += weights (G,)[:, None] · the row's D values (rows of weight 0 are skipped:
    an unwritten masked row is never read); work (D,) float32: scratch, as `scored`'s."""
    raise NotImplementedError


def stored(source, row):  # typed by the overload below
    """Write source (D,) float32 into the row: rounded to a float row's dtype, or quantized as
    one group into a packed row."""
    raise NotImplementedError


@numba.njit(inline="always")
def _half_at(row, at):  # pragma: no cover (compiled)
    """The float16 stored little-endian at bytes at, at + 1 of a packed row, as float32."""
    low, high = np.uint16(np.uint8(row[at])), np.uint16(np.uint8(row[at + 1]))  # (fp8 rows' bytes are int8)
    return float16_widened(np.uint16(low | np.uint16(high << np.uint16(8))))


@numba.njit(inline="always")
def _put_half(row, at, bits):  # pragma: no cover (compiled)
    row[at] = np.uint8(bits & np.uint16(0xFF))
    row[at + 1] = np.uint8(bits >> np.uint16(8))


@numba.njit(inline="always")
def _half_toward(value, up):  # pragma: no cover (compiled)
    """float32 value as float16 bits rounded up (or down) instead of to nearest."""
    bits = float16_rounded(np.float32(value))
    got = float16_widened(bits)
    negative = (bits & np.uint16(0x8000)) != 0
    if up and got < value:  # one step toward +inf
        if bits == np.uint16(0x8000):
            return np.uint16(1)
        return np.uint16(bits - 1) if negative else np.uint16(bits + 1)
    if not up and got > value:  # one step toward -inf
        if bits == np.uint16(0):
            return np.uint16(0x8001)
        return np.uint16(bits + 1) if negative else np.uint16(bits - 1)
    return bits


@numba.njit(inline="always")
def _code(value, zero, scale, levels):  # pragma: no cover (compiled)
    """value's code: round((value - zero) / scale), ties to even as torch rounds, within 0 .. levels."""
    return np.uint8(min(max(np.rint(quotient(value - zero, scale)), np.float32(0.0)), levels))


@numba.njit(inline="always")
def _codes_into(row, work):  # pragma: no cover (compiled)
    """work (D,) = a packed row's codes as float32 (int8: one a byte; int4: two, low nibble first)."""
    codes = row.shape[0] - PACKED_SCALE_BYTES
    if codes == work.shape[0]:
        for d in range(codes):
            work[d] = np.float32(row[d])
    else:
        for j in range(codes):
            byte = row[j]
            work[2 * j] = np.float32(byte & np.uint8(15))
            work[2 * j + 1] = np.float32(byte >> np.uint8(4))


@numba.njit(inline="always")
def _fp8_codes_into(row, work):  # pragma: no cover (compiled)
    """work (D,) = an fp8 row's codes (int8 bytes) as their e4m3 values, float32."""
    for d in range(work.shape[0]):
        work[d] = _FP8_VALUES[np.int64(row[d]) & 255]


@numba.njit(inline="always")
def _fp8_code(value):  # pragma: no cover (compiled)
    """float32 value (|value| <= 448 after clamping) as its nearest e4m3fn code (ties to even), int8;
    NaN as e4m3fn's NaN code, so a model that produced one is seen (as torch's cast keeps it)."""
    if value != value:
        return np.int8(0x7F)
    magnitude = min(abs(value), _FP8_MAX)
    if magnitude < _FP8_SMALLEST_NORMAL:  # subnormal: steps of 2^-9 (code 8 is 2^-6, the first normal)
        code = np.uint32(np.rint(magnitude * np.float32(512.0)))
    else:  # round the float32's 23 mantissa bits to 3, the carry moving into the exponent
        bits = np.float32(magnitude).view(np.uint32)
        bits = (bits + np.uint32(0x7FFFF) + ((bits >> np.uint32(20)) & np.uint32(1))) & np.uint32(0xFFF00000)
        exponent = (bits >> np.uint32(23)) - np.uint32(120)  # (float32's bias 127, e4m3's 7)
        code = exponent << np.uint32(3) | ((bits >> np.uint32(20)) & np.uint32(7))
    if np.float32(value).view(np.uint32) >> np.uint32(31):  # the sign bit, as torch keeps it (-0 too)
        code |= np.uint32(0x80)
    return np.int8(np.int32(code) - np.int32(256) if code >= 128 else np.int32(code))


@overload(scored, **_INLINE)
def _scored(queries, row, query_sums, scores, work):  # pragma: no cover (compiled)
    if row.dtype not in _PACKED:

        def float_row(queries, row, query_sums, scores, work):
            for g in range(queries.shape[0]):
                score = np.float32(0.0)
                for d in range(queries.shape[1]):
                    score += queries[g, d] * widened(row[d])
                scores[g] = score

        return float_row
    codes_into = _fp8_codes_into if row.dtype == numba.types.int8 else _codes_into

    def packed_row(queries, row, query_sums, scores, work):
        codes = row.shape[0] - PACKED_SCALE_BYTES
        scale, zero = _half_at(row, codes), _half_at(row, codes + 2)
        codes_into(row, work)  # (once for the group's queries)
        for g in range(queries.shape[0]):
            total = np.float32(0.0)
            for d in range(work.shape[0]):
                total += queries[g, d] * work[d]
            scores[g] = scale * total + zero * query_sums[g]

    return packed_row


@overload(accumulated, **_INLINE)
def _accumulated(summed, weights, row, work):  # pragma: no cover (compiled)
    if row.dtype not in _PACKED:

        def float_row(summed, weights, row, work):
            for g in range(summed.shape[0]):
                weight = weights[g]
                if weight != 0.0:
                    for d in range(summed.shape[1]):
                        summed[g, d] += weight * widened(row[d])

        return float_row
    codes_into = _fp8_codes_into if row.dtype == numba.types.int8 else _codes_into

    def packed_row(summed, weights, row, work):
        codes = row.shape[0] - PACKED_SCALE_BYTES
        scale, zero = _half_at(row, codes), _half_at(row, codes + 2)
        codes_into(row, work)
        for g in range(summed.shape[0]):
            weight = weights[g]
            if weight != 0.0:
                scaled, shift = weight * scale, weight * zero
                for d in range(work.shape[0]):
                    summed[g, d] += scaled * work[d] + shift

    return packed_row


@overload(stored, **_INLINE)
def _stored(source, row):  # pragma: no cover (compiled)
    if row.dtype not in _PACKED:

        def float_row(source, row):
            for d in range(source.shape[0]):
                row[d] = narrowed(source[d], row[0])

        return float_row
    if row.dtype == numba.types.int8:
        return _stored_fp8

    def packed_row(source, row):
        dim, codes = source.shape[0], row.shape[0] - PACKED_SCALE_BYTES
        levels = np.float32(255.0) if codes == dim else np.float32(15.0)
        low, high = source[0], source[0]
        for d in range(dim):
            low, high = min(low, source[d]), max(high, source[d])
        zero_bits = _half_toward(low, False)
        zero = float16_widened(zero_bits)
        scale_bits = _half_toward(quotient(high - zero, levels), True)
        scale = float16_widened(scale_bits)
        if not scale > 0:  # a constant row: codes 0, scale 1 (as `quantize`)
            scale_bits, scale = np.uint16(0x3C00), np.float32(1.0)
        if codes == dim:
            for d in range(dim):
                row[d] = _code(source[d], zero, scale, levels)
        else:
            for j in range(codes):
                low = _code(source[2 * j], zero, scale, levels)
                high = _code(source[2 * j + 1], zero, scale, levels)
                row[j] = np.uint8(low | np.uint8(high << np.uint8(4)))
        _put_half(row, codes, scale_bits)
        _put_half(row, codes + 2, zero_bits)

    return packed_row


def _stored_fp8(source, row):  # pragma: no cover (compiled: `stored` of an fp8 row)
    """source (D,) float32 into an fp8 row: scale = max|x| / 448 rounded up to a float16 (1 for
    a row of zeros), codes e4m3(x / scale), zero 0 (as `kvcache.cache.quantize`'s fp8)."""
    dim = source.shape[0]
    largest = np.float32(0.0)
    for d in range(dim):
        largest = max(largest, abs(source[d]))
    scale_bits = _half_toward(quotient(largest, _FP8_MAX), True)
    scale = float16_widened(scale_bits)
    if not scale > 0:
        scale_bits, scale = np.uint16(0x3C00), np.float32(1.0)
    for d in range(dim):
        row[d] = _fp8_code(quotient(source[d], scale))
    _put_half(row, dim, scale_bits)
    _put_half(row, dim + 2, np.uint16(0))
