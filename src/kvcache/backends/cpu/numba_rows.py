"""One stored key or value row as the kernels' attention scores, sums and writes it: a float row
(float32, bfloat16 bits, float16 bits: `numba_values`) element by element, a packed row (uint8:
a quantized paged cache's row, codes then float16 scale and zero, `kvcache.cache.paged.packed`)
through its codes, x̂ = code · scale + zero, never widened into a copy. Imported with the kernels.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from kvcache.backends.cpu.numba_values import FLAGS, float16_rounded, float16_widened, narrowed, widened
from kvcache.memory import PACKED_SCALE_BYTES  # (bytes after a packed row's codes: scale, zero)

_INLINE = dict(inline="always", jit_options=dict(fastmath=FLAGS, error_model="numpy"))


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
    """The float16 stored little-endian at bytes at, at + 1 of a uint8 row, as float32."""
    return float16_widened(np.uint16(np.uint16(row[at]) | np.uint16(np.uint16(row[at + 1]) << np.uint16(8))))


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
    """value's code: round((value - zero) / scale) within 0 .. levels."""
    return np.uint8(min(max(np.floor((value - zero) / scale + np.float32(0.5)), np.float32(0.0)), levels))


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


@overload(scored, **_INLINE)
def _scored(queries, row, query_sums, scores, work):  # pragma: no cover (compiled)
    if row.dtype != numba.types.uint8:

        def float_row(queries, row, query_sums, scores, work):
            for g in range(queries.shape[0]):
                score = np.float32(0.0)
                for d in range(queries.shape[1]):
                    score += queries[g, d] * widened(row[d])
                scores[g] = score

        return float_row

    def packed_row(queries, row, query_sums, scores, work):
        codes = row.shape[0] - PACKED_SCALE_BYTES
        scale, zero = _half_at(row, codes), _half_at(row, codes + 2)
        _codes_into(row, work)  # (once for the group's queries)
        for g in range(queries.shape[0]):
            total = np.float32(0.0)
            for d in range(work.shape[0]):
                total += queries[g, d] * work[d]
            scores[g] = scale * total + zero * query_sums[g]

    return packed_row


@overload(accumulated, **_INLINE)
def _accumulated(summed, weights, row, work):  # pragma: no cover (compiled)
    if row.dtype != numba.types.uint8:

        def float_row(summed, weights, row, work):
            for g in range(summed.shape[0]):
                weight = weights[g]
                if weight != 0.0:
                    for d in range(summed.shape[1]):
                        summed[g, d] += weight * widened(row[d])

        return float_row

    def packed_row(summed, weights, row, work):
        codes = row.shape[0] - PACKED_SCALE_BYTES
        scale, zero = _half_at(row, codes), _half_at(row, codes + 2)
        _codes_into(row, work)
        for g in range(summed.shape[0]):
            weight = weights[g]
            if weight != 0.0:
                scaled, shift = weight * scale, weight * zero
                for d in range(work.shape[0]):
                    summed[g, d] += scaled * work[d] + shift

    return packed_row


@overload(stored, **_INLINE)
def _stored(source, row):  # pragma: no cover (compiled)
    if row.dtype != numba.types.uint8:

        def float_row(source, row):
            for d in range(source.shape[0]):
                row[d] = narrowed(source[d], row[0])

        return float_row

    def packed_row(source, row):
        dim, codes = source.shape[0], row.shape[0] - PACKED_SCALE_BYTES
        levels = np.float32(255.0) if codes == dim else np.float32(15.0)
        low, high = source[0], source[0]
        for d in range(dim):
            low, high = min(low, source[d]), max(high, source[d])
        zero_bits = _half_toward(low, False)
        zero = float16_widened(zero_bits)
        scale_bits = _half_toward((high - zero) / levels, True)
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
