"""The numba kernels' products with weights kept as ggml blocks (`kvcache.model.quantized`): each
weight row's blocks read from their stored bytes (scales widened from float16 bits, the K-quants'
6-bit scales unpacked), four weight rows dotted with one activation row in one pass, the
activations float32 (the dequantized weight's product, summed in another order); or, for a
code past Q8_READS, the activations quantized as llama.cpp's products read them (integer dots,
`numba_q8`). Imported only with the kernels.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
numba_blocks.py.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

# numba's disk cache keys a kernel on its own file only: the kernels here carry compiled copies of
# `numba_q8`'s dots, so a change there needs a change here (and in numba_kernels.py) for a
# checkout to recompile them (the last such change: one K-quant integer sum for one row or two)
from kvcache.backends.cpu.numba_q8 import (
    q2_k_rows,
    q2_k_tile,
    q2_k_unpack,
    q3_k_rows,
    q3_k_tile,
    q3_k_unpack,
    q4_0_rows,
    q4_0_tile,
    q4_0_unpack,
    q4_1_rows,
    q4_1_tile,
    q4_1_unpack,
    q4_k_rows,
    q4_k_tile,
    q4_k_unpack,
    q5_0_rows,
    q5_0_tile,
    q5_0_unpack,
    q5_1_rows,
    q5_1_tile,
    q5_1_unpack,
    q5_k_rows,
    q5_k_tile,
    q5_k_unpack,
    q6_k_rows,
    q6_k_tile,
    q6_k_unpack,
    q8_0_rows,
    q8_0_tile,
    q8_0_unpack,
    q8_activations,
    q8_k_activations,
)
from kvcache.backends.cpu.numba_values import FLAGS, float16_widened, prefetch
from kvcache.model.quantized import STORED_KINDS

#: the block formats' codes, as a product's part carries them: (blocks, code)
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K = range(10)
CODES = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q4_K": Q4_K, "Q5_K": Q5_K,
         "Q6_K": Q6_K, "Q2_K": Q2_K, "Q3_K": Q3_K}
#: added to a format's code: its products read the activations quantized as llama.cpp's
#: (`numba_q8`) instead of float32 (every code past it a K-quant from Q8_READS + Q4_K)
Q8_READS = 10
#: added to a format's code instead: read as past Q8_READS, on the CPU's matrix unit from
#: `numba_kernels.TILE_ROWS` activation rows (`numba_amx`: the same sums to the bit)
TILE_READS = 20
#: by code: a block's bytes (`quantized.STORED_KINDS`), and where its q bytes start (after d, m
#: and the fifth bits' word as the format has them; the K-quants': after d, dmin, the 12 bytes of
#: scales and Q5_K's 32 bytes of fifth bits; Q6_K's low bits come first; Q2_K's 2-bit q after its
#: 16 bytes of scales, Q3_K's after its 32 bytes of high bits); constants to the kernels
BLOCK_BYTES = tuple(STORED_KINDS[kind][1] for kind in CODES)
QUANTS_AT = (2, 2, 4, 6, 8, 16, 48, 0, 16, 32)
_INLINE = dict(inline="always", fastmath=FLAGS, error_model="numpy")
#: the K-quants' row loops are called, not inlined: inlined into every format branch of
#: `blocks_product` (compiled again for each of its callers' signatures) they doubled its compile
#: time; a call per 4 rows and activation row costs nothing beside the loop it runs
_CALLED = dict(fastmath=FLAGS, error_model="numpy", cache=True, boundscheck=False, nogil=True)
#: tasks ahead whose weight rows a task asks the CPU to fetch (four rows a task: without it, the
#: four interleaved streams of rows defeat the hardware's prefetching once a weight is not cached)
AHEAD = 2
_LINE = 64


@numba.njit(**_INLINE)
def half_at(w, i, at):  # pragma: no cover (compiled)
    """The float16 stored at bytes at, at + 1 of weight row i, as float32."""
    return float16_widened(np.uint16(np.uint32(w[i, at]) | (np.uint32(w[i, at + 1]) << np.uint32(8))))


@numba.njit(**_INLINE)
def word_at(w, i, at):  # pragma: no cover (compiled)
    """The little-endian uint32 stored at bytes at .. at + 3 of weight row i."""
    word = np.uint32(0)
    for byte in range(4):
        word |= np.uint32(w[i, at + byte]) << np.uint32(8 * byte)
    return word


@numba.njit(**_INLINE)
def int8_sums(w, i0, i1, i2, i3, at, x, n, xo):  # pragma: no cover (compiled)
    """Σ q·x over 32 int8 at byte `at` of rows i0..i3, x row n from column xo: four sums."""
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for k in range(32):
        xv = x[n, xo + k]
        s0 += np.float32(np.int8(w[i0, at + k])) * xv
        s1 += np.float32(np.int8(w[i1, at + k])) * xv
        s2 += np.float32(np.int8(w[i2, at + k])) * xv
        s3 += np.float32(np.int8(w[i3, at + k])) * xv
    return s0, s1, s2, s3


@numba.njit(**_INLINE)
def nibble_sums(w, i0, i1, i2, i3, at, x, n, xo):  # pragma: no cover (compiled)
    """Σ q·x over 32 4-bit q in 16 bytes at `at` (value j the low nibble of byte j, value j + 16
    its high one) of rows i0..i3: four sums."""
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for k in range(16):
        low, high = x[n, xo + k], x[n, xo + 16 + k]
        v0, v1 = np.int32(w[i0, at + k]), np.int32(w[i1, at + k])
        v2, v3 = np.int32(w[i2, at + k]), np.int32(w[i3, at + k])
        s0 += np.float32(v0 & 15) * low + np.float32(v0 >> 4) * high
        s1 += np.float32(v1 & 15) * low + np.float32(v1 >> 4) * high
        s2 += np.float32(v2 & 15) * low + np.float32(v2 >> 4) * high
        s3 += np.float32(v3 & 15) * low + np.float32(v3 >> 4) * high
    return s0, s1, s2, s3


@numba.njit(**_INLINE)
def fifth_bit_sums(w, i0, i1, i2, i3, at, x, n, xo):  # pragma: no cover (compiled)
    """Σ 16·(fifth bit)·x over 32 values of rows i0..i3, the bits a uint32 at `at` (bit j value
    j's): what Q5 formats add to their nibbles' sums."""
    h0, h1, h2, h3 = word_at(w, i0, at), word_at(w, i1, at), word_at(w, i2, at), word_at(w, i3, at)
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for k in range(32):
        xv = x[n, xo + k] * np.float32(16.0)
        shift = np.uint32(k)
        s0 += np.float32((h0 >> shift) & np.uint32(1)) * xv
        s1 += np.float32((h1 >> shift) & np.uint32(1)) * xv
        s2 += np.float32((h2 >> shift) & np.uint32(1)) * xv
        s3 += np.float32((h3 >> shift) & np.uint32(1)) * xv
    return s0, s1, s2, s3


@numba.njit(**_INLINE)
def scaled(w, i, at, sum_qx, sum_x, kind):  # pragma: no cover (compiled)
    """One block's share of row i's dot product, from its Σq·x and Σx: Q8_0 d·Σq·x; Q4_0
    d·(Σq·x - 8Σx); Q4_1 and Q5_1 d·Σq·x + m·Σx; Q5_0 d·(Σq·x - 16Σx)."""
    if kind == Q4_1 or kind == Q5_1:
        return half_at(w, i, at) * sum_qx + half_at(w, i, at + 2) * sum_x
    offset = np.float32(8.0) if kind == Q4_0 else np.float32(16.0) if kind == Q5_0 else np.float32(0.0)
    return half_at(w, i, at) * (sum_qx - offset * sum_x)


@numba.njit(**_INLINE)
def block_rows(w, kind, i0, i1, i2, i3, x, n, sums):  # pragma: no cover (compiled)
    """Rows i0..i3 of a weight of `kind` dotted with x row n (sums (N, blocks): each block's Σx):
    four float32 results (each block's part as `scaled` says; q's fifth bit included in Q5's)."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    size, quants = BLOCK_BYTES[kind], QUANTS_AT[kind]
    for b in range(sums.shape[1]):
        at, xo = b * size, b * 32
        if kind == Q8_0:
            s0, s1, s2, s3 = int8_sums(w, i0, i1, i2, i3, at + quants, x, n, xo)
        else:
            s0, s1, s2, s3 = nibble_sums(w, i0, i1, i2, i3, at + quants, x, n, xo)
            if kind >= Q5_0:
                h0, h1, h2, h3 = fifth_bit_sums(w, i0, i1, i2, i3, at + quants - 4, x, n, xo)
                s0, s1, s2, s3 = s0 + h0, s1 + h1, s2 + h2, s3 + h3
        total = sums[n, b]
        a0 += scaled(w, i0, at, s0, total, kind)
        a1 += scaled(w, i1, at, s1, total, kind)
        a2 += scaled(w, i2, at, s2, total, kind)
        a3 += scaled(w, i3, at, s3, total, kind)
    return a0, a1, a2, a3


@numba.njit(**_INLINE)
def k_scale_min(w, i, at, s):  # pragma: no cover (compiled)
    """Q4_K's and Q5_K's sub-block s (0..7) scale and minimum, 6-bit integers packed in the 12
    bytes at `at` of row i (s < 4: the low 6 bits of bytes s and s + 4; else 4 bits of byte s + 4
    and the top 2 of bytes s - 4 and s), as float32."""
    if s < 4:
        return np.float32(w[i, at + s] & 63), np.float32(w[i, at + s + 4] & 63)
    packed = np.int32(w[i, at + s + 4])
    scale = (packed & 15) | ((np.int32(w[i, at + s - 4]) >> 6) << 4)
    low = (packed >> 4) | ((np.int32(w[i, at + s]) >> 6) << 4)
    return np.float32(scale), np.float32(low)


@numba.njit(**_INLINE)
def k_bits_sums(w, i0, i1, i2, i3, at, shift, mask, weight, x, n, xo):  # pragma: no cover (compiled)
    """Σ weight·q·x[n, xo + k] over k < 32 for rows i0..i3, q = (byte at + k >> shift) & mask: a
    K-quant's nibbles (mask 15, weight 1) or Q5_K's fifth bits of sub-block `shift` (mask 1,
    weight 16)."""
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for k in range(32):
        xv = x[n, xo + k] * weight
        s0 += np.float32((np.int32(w[i0, at + k]) >> shift) & mask) * xv
        s1 += np.float32((np.int32(w[i1, at + k]) >> shift) & mask) * xv
        s2 += np.float32((np.int32(w[i2, at + k]) >> shift) & mask) * xv
        s3 += np.float32((np.int32(w[i3, at + k]) >> shift) & mask) * xv
    return s0, s1, s2, s3


@numba.njit(**_INLINE)
def k_part(w, i, at, s, sum_qx, sum_x):  # pragma: no cover (compiled)
    """Sub-block s's share of row i's dot product in the Q4_K/Q5_K block at `at`:
    d·scale·Σq·x - dmin·min·Σx."""
    scale, low = k_scale_min(w, i, at + 4, s)
    return half_at(w, i, at) * scale * sum_qx - half_at(w, i, at + 2) * low * sum_x


@numba.njit(**_CALLED)
def k_block_rows(w, kind, i0, i1, i2, i3, x, n, sums):  # pragma: no cover (compiled)
    """Rows i0..i3 of a Q4_K or Q5_K weight dotted with x row n (sums (N, in / 32): Σx of each 32
    values): 256 values a block, 8 sub-blocks of 32, sub-block s the low (s even) or high nibbles
    of the block's 32 q bytes s // 2 (and Q5_K's fifth bits bit s of its 32 qh bytes)."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    size, quants = BLOCK_BYTES[kind], QUANTS_AT[kind]
    for b in range(sums.shape[1] // 8):
        at = b * size
        for s in range(8):
            xo, q_at = b * 256 + s * 32, at + quants + (s // 2) * 32
            s0, s1, s2, s3 = k_bits_sums(w, i0, i1, i2, i3, q_at, (s % 2) * 4, 15, np.float32(1.0), x, n, xo)
            if kind == Q5_K:
                h0, h1, h2, h3 = k_bits_sums(w, i0, i1, i2, i3, at + 16, s, 1, np.float32(16.0), x, n, xo)
                s0, s1, s2, s3 = s0 + h0, s1 + h1, s2 + h2, s3 + h3
            total = sums[n, b * 8 + s]
            a0 += k_part(w, i0, at, s, s0, total)
            a1 += k_part(w, i1, at, s, s1, total)
            a2 += k_part(w, i2, at, s, s2, total)
            a3 += k_part(w, i3, at, s, s3, total)
    return a0, a1, a2, a3


@numba.njit(**_INLINE)
def q6_value(w, i, at, g, k):  # pragma: no cover (compiled)
    """Value k (0..31) of 32-value group g (0..7) of the Q6_K block at `at` of row i, before its
    scale: (low 4 bits | high 2 bits << 4) - 32. Group g = 4·half + t: the low bits are nibble
    t // 2 of byte 64·half + 32·(t % 2) + k, the high ones bits 2t, 2t + 1 of byte 128 + 32·half + k."""
    half, t = g // 4, g % 4
    low = (np.int32(w[i, at + 64 * half + 32 * (t % 2) + k]) >> (4 * (t // 2))) & 15
    high = (np.int32(w[i, at + 128 + 32 * half + k]) >> (2 * t)) & 3
    return np.float32((low | (high << 4)) - 32)


@numba.njit(**_CALLED)
def q6_block_rows(w, i0, i1, i2, i3, x, n):  # pragma: no cover (compiled)
    """Rows i0..i3 of a Q6_K weight dotted with x row n: 256 values a block (210 bytes: 128 of low
    bits, 64 of high bits, 16 int8 scales, d), scale j for values 16j .. 16j + 15."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    size = BLOCK_BYTES[Q6_K]
    for b in range(x.shape[1] // 256):
        at = b * size
        for g in range(8):
            for part in range(2):
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for k in range(part * 16, part * 16 + 16):
                    xv = x[n, b * 256 + g * 32 + k]
                    s0 += q6_value(w, i0, at, g, k) * xv
                    s1 += q6_value(w, i1, at, g, k) * xv
                    s2 += q6_value(w, i2, at, g, k) * xv
                    s3 += q6_value(w, i3, at, g, k) * xv
                scale = at + 192 + 2 * g + part
                a0 += half_at(w, i0, at + 208) * np.float32(np.int8(w[i0, scale])) * s0
                a1 += half_at(w, i1, at + 208) * np.float32(np.int8(w[i1, scale])) * s1
                a2 += half_at(w, i2, at + 208) * np.float32(np.int8(w[i2, scale])) * s2
                a3 += half_at(w, i3, at + 208) * np.float32(np.int8(w[i3, scale])) * s3
    return a0, a1, a2, a3


@numba.njit(**_INLINE)
def two_bit_value(w, kind, i, at, g, k):  # pragma: no cover (compiled)
    """Value k (0..31) of 32-value group g (0..7) of the Q2_K or Q3_K block at `at` of row i,
    before its scale: bits 2t, 2t + 1 of q byte 32·half + k (g = 4·half + t); Q3_K's plus 4·(bit g
    of high-bits byte k) - 4."""
    half, t = g // 4, g % 4
    q = (np.int32(w[i, at + QUANTS_AT[kind] + 32 * half + k]) >> (2 * t)) & 3
    if kind == Q3_K:
        q += 4 * ((np.int32(w[i, at + k]) >> g) & 1) - 4
    return np.float32(q)


@numba.njit(**_INLINE)
def two_bit_scale_min(w, kind, i, at, j):  # pragma: no cover (compiled)
    """Scale j (values 16j .. 16j + 15) of the Q2_K or Q3_K block at `at` of row i and its
    minimum (Q3_K's 0), float32: Q2_K's the low and high nibbles of byte j; Q3_K's 6 bits (the
    low 4 nibble j // 8 of byte 96 + j % 8, the top 2 bits 2·(j // 4) of byte 104 + j % 4) less 32."""
    if kind == Q2_K:
        byte = np.int32(w[i, at + j])
        return np.float32(byte & 15), np.float32(byte >> 4)
    low = (np.int32(w[i, at + 96 + j % 8]) >> (4 * (j // 8))) & 15
    high = (np.int32(w[i, at + 104 + j % 4]) >> (2 * (j // 4))) & 3
    return np.float32((low | (high << 4)) - 32), np.float32(0.0)


@numba.njit(**_INLINE)
def two_bit_part(w, kind, i, at, j, sum_qx, sum_x):  # pragma: no cover (compiled)
    """Scale j's share of row i's dot product in the Q2_K or Q3_K block at `at`: d·scale·Σq·x,
    Q2_K's less dmin·min·Σx (d at byte 80, dmin 82; Q3_K's d at 108)."""
    scale, low = two_bit_scale_min(w, kind, i, at, j)
    if kind == Q2_K:
        return half_at(w, i, at + 80) * scale * sum_qx - half_at(w, i, at + 82) * low * sum_x
    return half_at(w, i, at + 108) * scale * sum_qx


@numba.njit(**_CALLED)
def two_bit_block_rows(w, kind, i0, i1, i2, i3, x, n):  # pragma: no cover (compiled)
    """Rows i0..i3 of a Q2_K or Q3_K weight dotted with x row n: 256 values a block, 16 scales
    of 16 values each (`two_bit_value`, `two_bit_part`)."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    size = BLOCK_BYTES[kind]
    for b in range(x.shape[1] // 256):
        at = b * size
        for g in range(8):
            for part in range(2):
                s0 = s1 = s2 = s3 = total = np.float32(0.0)
                for k in range(part * 16, part * 16 + 16):
                    xv = x[n, b * 256 + g * 32 + k]
                    total += xv
                    s0 += two_bit_value(w, kind, i0, at, g, k) * xv
                    s1 += two_bit_value(w, kind, i1, at, g, k) * xv
                    s2 += two_bit_value(w, kind, i2, at, g, k) * xv
                    s3 += two_bit_value(w, kind, i3, at, g, k) * xv
                j = 2 * g + part
                a0 += two_bit_part(w, kind, i0, at, j, s0, total)
                a1 += two_bit_part(w, kind, i1, at, j, s1, total)
                a2 += two_bit_part(w, kind, i2, at, j, s2, total)
                a3 += two_bit_part(w, kind, i3, at, j, s3, total)
    return a0, a1, a2, a3


@numba.njit(**_INLINE)
def rows_of_kind(w, kind, i0, i1, i2, i3, x, n, sums, activations):  # pragma: no cover (compiled)
    """Rows i0..i3 of a weight of `kind` dotted with x row n (sums (N, in / 32): each 32 values'
    Σx, read by the float formats only), each format's loops compiled apart (`kind` a constant
    in each branch): a code past Q8_READS on `numba_q8`'s integer dots with its Q8 activations
    (the four arrays of `activation_arrays`), the others on `block_rows`, `k_block_rows` and
    `q6_block_rows`, `two_bit_block_rows`."""
    if kind >= Q8_READS:
        return q8_rows_of_kind(w, kind - Q8_READS, i0, i1, i2, i3, n, activations)
    if kind == Q2_K:
        return two_bit_block_rows(w, Q2_K, i0, i1, i2, i3, x, n)
    if kind == Q3_K:
        return two_bit_block_rows(w, Q3_K, i0, i1, i2, i3, x, n)
    if kind == Q4_K:
        return k_block_rows(w, Q4_K, i0, i1, i2, i3, x, n, sums)
    if kind == Q5_K:
        return k_block_rows(w, Q5_K, i0, i1, i2, i3, x, n, sums)
    if kind == Q6_K:
        return q6_block_rows(w, i0, i1, i2, i3, x, n)
    if kind == Q8_0:
        return block_rows(w, Q8_0, i0, i1, i2, i3, x, n, sums)
    if kind == Q4_0:
        return block_rows(w, Q4_0, i0, i1, i2, i3, x, n, sums)
    if kind == Q4_1:
        return block_rows(w, Q4_1, i0, i1, i2, i3, x, n, sums)
    if kind == Q5_0:
        return block_rows(w, Q5_0, i0, i1, i2, i3, x, n, sums)
    return block_rows(w, Q5_1, i0, i1, i2, i3, x, n, sums)


@numba.njit(**_CALLED)
def q8_rows_of_kind(w, kind, i0, i1, i2, i3, n, activations):  # pragma: no cover (compiled)
    """Rows i0..i3 of a weight of `kind` dotted with row n of Q8 activations (Q8_K's for a
    K-quant; called, not inlined, as the K-quants' float loops are: compiled once, not inside
    every `blocks_product`)."""
    quants, scales, counts, shifts = (activations[0][n], activations[1][n], activations[2][n],
                                      activations[3][n])
    if kind == Q2_K:
        return q2_k_rows(w, i0, i1, i2, i3, quants, scales, counts, shifts)
    if kind == Q3_K:
        return q3_k_rows(w, i0, i1, i2, i3, quants, scales, counts, shifts)
    if kind == Q4_K:
        return q4_k_rows(w, i0, i1, i2, i3, quants, scales, counts, shifts)
    if kind == Q5_K:
        return q5_k_rows(w, i0, i1, i2, i3, quants, scales, counts, shifts)
    if kind == Q6_K:
        return q6_k_rows(w, i0, i1, i2, i3, quants, scales, counts, shifts)
    if kind == Q8_0:
        return q8_0_rows(w, i0, i1, i2, i3, quants, scales, counts, shifts)
    if kind == Q4_0:
        return q4_0_rows(w, i0, i1, i2, i3, quants, scales, counts, shifts)
    if kind == Q4_1:
        return q4_1_rows(w, i0, i1, i2, i3, quants, scales, counts, shifts)
    if kind == Q5_0:
        return q5_0_rows(w, i0, i1, i2, i3, quants, scales, counts, shifts)
    return q5_1_rows(w, i0, i1, i2, i3, quants, scales, counts, shifts)


@numba.njit(**_INLINE)
def q8_tile_of_kind(w, kind, i0, i1, i2, i3, values, n, activations):  # pragma: no cover (compiled)
    """Rows n..n + 3 of Q8 activations dotted with rows i0..i3 of a weight of `kind`, their
    values read from `values` (`unpack_rows_of_kind`): 16 float32, row n's four first, each what
    `q8_rows_of_kind` gives for that row alone, to the bit."""
    quants, scales, counts, shifts = activations
    if kind == Q2_K:
        return q2_k_tile(w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n)
    if kind == Q3_K:
        return q3_k_tile(w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n)
    if kind == Q4_K:
        return q4_k_tile(w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n)
    if kind == Q5_K:
        return q5_k_tile(w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n)
    if kind == Q6_K:
        return q6_k_tile(w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n)
    if kind == Q8_0:
        return q8_0_tile(w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n)
    if kind == Q4_0:
        return q4_0_tile(w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n)
    if kind == Q4_1:
        return q4_1_tile(w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n)
    if kind == Q5_0:
        return q5_0_tile(w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n)
    return q5_1_tile(w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n)


@numba.njit(**_CALLED)
def unpack_rows_of_kind(w, kind, i0, i1, i2, i3, values):  # pragma: no cover (compiled)
    """Rows i0..i3 of a weight of `kind` into values (4, in) uint8 as the Q8 dots multiply them."""
    if kind == Q2_K:
        q2_k_unpack(w, i0, i1, i2, i3, values)
    elif kind == Q3_K:
        q3_k_unpack(w, i0, i1, i2, i3, values)
    elif kind == Q4_K:
        q4_k_unpack(w, i0, i1, i2, i3, values)
    elif kind == Q5_K:
        q5_k_unpack(w, i0, i1, i2, i3, values)
    elif kind == Q6_K:
        q6_k_unpack(w, i0, i1, i2, i3, values)
    elif kind == Q8_0:
        q8_0_unpack(w, i0, i1, i2, i3, values)
    elif kind == Q4_0:
        q4_0_unpack(w, i0, i1, i2, i3, values)
    elif kind == Q4_1:
        q4_1_unpack(w, i0, i1, i2, i3, values)
    elif kind == Q5_0:
        q5_0_unpack(w, i0, i1, i2, i3, values)
    else:
        q5_1_unpack(w, i0, i1, i2, i3, values)


@numba.njit(**_INLINE)
def activation_arrays(x, kind):  # pragma: no cover (compiled)
    """The four arrays a product of code `kind` reads x (N, in) quantized into: past Q8_READS
    those of `q8_activations` (of `q8_k_activations` and an empty one for a K-quant); empty
    below Q8_READS. Not filled (`quantize_row`)."""
    tokens, columns = x.shape
    k_quant = kind >= Q8_READS + Q4_K
    group = 256 if k_quant else 32
    blocks = columns // group if kind >= Q8_READS else 0
    quants = np.empty((tokens, blocks * group), np.int8)
    scales = np.empty((tokens, blocks), np.float32)
    counts = np.empty((tokens, columns // 16 if k_quant else blocks), np.float32)
    shifts = np.empty((tokens, 0 if k_quant else blocks), np.float32)
    return quants, scales, counts, shifts


@numba.njit(**_INLINE)
def quantize_row(x, kind, n, activations):  # pragma: no cover (compiled)
    """Row n of x quantized as llama.cpp's Q8_0 or Q8_1 (Q8_K for a K-quant) into row n of
    `activations` (`activation_arrays`)."""
    quants, scales, counts, shifts = activations
    row = slice(n, n + 1)
    if kind >= Q8_READS + Q4_K:
        q8_k_activations(x[row], quants[row], scales[row], counts[row])
    else:
        q8_activations(x[row], quants[row], scales[row], counts[row], shifts[row])


@numba.njit(**_INLINE)
def block_sums(x):  # pragma: no cover (compiled)
    """(N, in / 32) float32: the sum of each 32 values of each row of x (N, in)."""
    sums = np.zeros((x.shape[0], x.shape[1] // 32), np.float32)
    for n in range(x.shape[0]):
        for j in range(x.shape[1]):
            sums[n, j // 32] += x[n, j]
    return sums


@numba.njit(**_INLINE)
def dequantized_row(w, kind, i, out, r):  # pragma: no cover (compiled)
    """out[r] (columns,) float32 = row i of a weight of `kind` dequantized (the formats' rules in
    `kvcache.model.quantized`'s module docstring)."""
    size, quants = BLOCK_BYTES[kind], QUANTS_AT[kind]
    for b in range(out.shape[1] // 32):
        at, column = b * size, b * 32
        d = half_at(w, i, at)
        if kind == Q8_0:
            for j in range(32):
                out[r, column + j] = d * np.float32(np.int8(w[i, at + quants + j]))
            continue
        high = word_at(w, i, at + quants - 4) if kind >= Q5_0 else np.uint32(0)
        if kind == Q4_1 or kind == Q5_1:
            shift = half_at(w, i, at + 2)
        else:
            shift = -d * np.float32(8.0 if kind == Q4_0 else 16.0)
        for j in range(16):
            byte = np.uint32(w[i, at + quants + j])
            low = (byte & np.uint32(15)) | (((high >> np.uint32(j)) & np.uint32(1)) << np.uint32(4))
            top = (byte >> np.uint32(4)) | (((high >> np.uint32(j + 16)) & np.uint32(1)) << np.uint32(4))
            out[r, column + j] = d * np.float32(low) + shift
            out[r, column + 16 + j] = d * np.float32(top) + shift


@numba.njit(**_CALLED)
def k_dequantized_row(w, kind, i, out, r):  # pragma: no cover (compiled)
    """out[r] (columns,) float32 = row i of a K-quant weight of `kind` dequantized (`k_block_rows`,
    `q6_block_rows` say the layouts)."""
    size, quants = BLOCK_BYTES[kind], QUANTS_AT[kind]
    for b in range(out.shape[1] // 256):
        at, column = b * size, b * 256
        if kind == Q2_K or kind == Q3_K:
            d = half_at(w, i, at + (80 if kind == Q2_K else 108))
            for j in range(16):
                scale, low = two_bit_scale_min(w, kind, i, at, j)
                step = d * scale
                shift = half_at(w, i, at + 82) * low if kind == Q2_K else np.float32(0.0)
                for k in range(16):
                    value = two_bit_value(w, kind, i, at, j // 2, (j % 2) * 16 + k)
                    out[r, column + j * 16 + k] = step * value - shift
            continue
        if kind == Q6_K:
            d = half_at(w, i, at + 208)
            for g in range(8):
                for k in range(32):
                    scale = np.float32(np.int8(w[i, at + 192 + 2 * g + k // 16]))
                    out[r, column + g * 32 + k] = d * scale * q6_value(w, i, at, g, k)
            continue
        d, dmin = half_at(w, i, at), half_at(w, i, at + 2)
        for s in range(8):
            scale, low = k_scale_min(w, i, at + 4, s)
            step, shift = d * scale, dmin * low
            for k in range(32):
                q = (np.int32(w[i, at + quants + (s // 2) * 32 + k]) >> ((s % 2) * 4)) & 15
                if kind == Q5_K:
                    q |= ((np.int32(w[i, at + 16 + k]) >> s) & 1) << 4
                out[r, column + s * 32 + k] = step * np.float32(q) - shift


@numba.njit(**_INLINE)
def rows_dequantized(w, kind, i0, i1, i2, i3, out):  # pragma: no cover (compiled)
    """out (4, columns) = rows i0..i3 dequantized, each format's loop compiled apart."""
    for r, i in enumerate((i0, i1, i2, i3)):
        if kind == Q2_K:
            k_dequantized_row(w, Q2_K, i, out, r)
        elif kind == Q3_K:
            k_dequantized_row(w, Q3_K, i, out, r)
        elif kind == Q4_K:
            k_dequantized_row(w, Q4_K, i, out, r)
        elif kind == Q5_K:
            k_dequantized_row(w, Q5_K, i, out, r)
        elif kind == Q6_K:
            k_dequantized_row(w, Q6_K, i, out, r)
        elif kind == Q8_0:
            dequantized_row(w, Q8_0, i, out, r)
        elif kind == Q4_0:
            dequantized_row(w, Q4_0, i, out, r)
        elif kind == Q4_1:
            dequantized_row(w, Q4_1, i, out, r)
        elif kind == Q5_0:
            dequantized_row(w, Q5_0, i, out, r)
        else:
            dequantized_row(w, Q5_1, i, out, r)


@numba.njit(**_INLINE)
def float_rows(rows, x, n):  # pragma: no cover (compiled)
    """The four float32 rows (4, columns) dotted with x row n: four sums."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for j in range(rows.shape[1]):
        xv = x[n, j]
        a0 += rows[0, j] * xv
        a1 += rows[1, j] * xv
        a2 += rows[2, j] * xv
        a3 += rows[3, j] * xv
    return a0, a1, a2, a3


@numba.njit(**_INLINE)
def float_tiles(rows, x, out, start, i0, i1, i2, i3):  # pragma: no cover (compiled)
    """out[n, start + i] for the four float32 rows (4, columns) and x's rows four at a time (16
    sums in registers, each load used four times); returns the x rows done (a multiple of 4)."""
    done = 0
    while done + 4 <= x.shape[0]:
        t = np.zeros((4, 4), np.float32)
        c00 = c01 = c02 = c03 = c10 = c11 = c12 = c13 = np.float32(0.0)
        c20 = c21 = c22 = c23 = c30 = c31 = c32 = c33 = np.float32(0.0)
        for j in range(rows.shape[1]):
            w0, w1, w2, w3 = rows[0, j], rows[1, j], rows[2, j], rows[3, j]
            x0, x1, x2, x3 = x[done, j], x[done + 1, j], x[done + 2, j], x[done + 3, j]
            c00 += w0 * x0; c01 += w1 * x0; c02 += w2 * x0; c03 += w3 * x0  # noqa: E702
            c10 += w0 * x1; c11 += w1 * x1; c12 += w2 * x1; c13 += w3 * x1  # noqa: E702
            c20 += w0 * x2; c21 += w1 * x2; c22 += w2 * x2; c23 += w3 * x2  # noqa: E702
            c30 += w0 * x3; c31 += w1 * x3; c32 += w2 * x3; c33 += w3 * x3  # noqa: E702
        t[0, 0], t[0, 1], t[0, 2], t[0, 3] = c00, c01, c02, c03
        t[1, 0], t[1, 1], t[1, 2], t[1, 3] = c10, c11, c12, c13
        t[2, 0], t[2, 1], t[2, 2], t[2, 3] = c20, c21, c22, c23
        t[3, 0], t[3, 1], t[3, 2], t[3, 3] = c30, c31, c32, c33
        for n in range(4):
            out[done + n, start + i0] = t[n, 0]
            out[done + n, start + i1] = t[n, 1]
            out[done + n, start + i2] = t[n, 2]
            out[done + n, start + i3] = t[n, 3]
        done += 4
    return done


@numba.njit(**_INLINE)
def q8_tiles(w, kind, i0, i1, i2, i3, values, activations, out, start):  # pragma: no cover (compiled)
    """out[n, start + i] for rows i0..i3 (their values unpacked) and the Q8 activations' rows
    four at a time (`q8_tile_of_kind`); returns the rows done (a multiple of 4)."""
    done = 0
    while done + 4 <= activations[0].shape[0]:
        found = q8_tile_of_kind(w, kind, i0, i1, i2, i3, values, done, activations)
        for t in range(4):
            put(out, done + t, start, i0, i1, i2, i3, (found[4 * t], found[4 * t + 1], found[4 * t + 2],
                                                       found[4 * t + 3]))
        done += 4
    return done


@numba.njit(**_INLINE)
def put(out, n, start, i0, i1, i2, i3, sums):  # pragma: no cover (compiled)
    """out[n, start + i] = the four sums of rows i0..i3."""
    out[n, start + i0], out[n, start + i1], out[n, start + i2], out[n, start + i3] = sums


#: from this many activation rows a task unpacks its four weight rows once (float32, or the Q8
#: dots' values) and dots each activation row with them (unpacking blocks once per activation row
#: costs more past it)
MANY_ROWS = 4


@numba.njit(parallel=True, fastmath=FLAGS, error_model="numpy", cache=True, boundscheck=False, nogil=True)
def blocks_product(w, kind, x, start, out):  # pragma: no cover (compiled)
    """out[:, start : start + rows] = x (N, in) times the weight w (rows, row bytes) of code
    `kind`, transposed, x read as `quantize_row` says past Q8_READS: four weight rows a task, each read
    once for every row of x, the tasks split between the threads (the last task's missing rows
    repeat its last row, written once), each task first asking for the rows of the task AHEAD of
    it. From MANY_ROWS rows of x the task's weight rows are unpacked once into a scratch of its
    own first: dequantized to float32 tiles (float activations), or past Q8_READS to the values
    the integer dots multiply, each row of x then dotted exactly as one row alone is (a row's
    outputs do not depend on the rows beside it). A kernel of its own, called from the layer
    kernels (inlined there, its formats' loops made their compile time explode)."""
    tiles, q8 = x.shape[0] >= MANY_ROWS, kind >= Q8_READS
    activations = activation_arrays(x, kind)
    if q8 and tiles:
        for n in prange(x.shape[0]):  # (many rows: quantized in parallel)
            quantize_row(x, kind, n, activations)
    elif q8:
        for n in range(x.shape[0]):
            quantize_row(x, kind, n, activations)
    # each 32 values' Σx: the float formats' one-row dots read them
    sums = block_sums(x) if not q8 and not tiles else np.empty((x.shape[0], 0), np.float32)
    rows, width = w.shape
    flat = w.reshape(w.size)
    for task in prange((rows + 3) // 4):
        i0 = task * 4
        ahead = (i0 + 4 * AHEAD) * width
        if ahead + 4 * width <= flat.shape[0]:
            for line in range(0, 4 * width, _LINE):
                prefetch(flat, ahead + line)
        i1, i2, i3 = min(i0 + 1, rows - 1), min(i0 + 2, rows - 1), min(i0 + 3, rows - 1)
        if tiles and q8:
            values = np.empty((4, x.shape[1]), np.uint8)  # the task's rows' values, unpacked
            unpack_rows_of_kind(w, kind - Q8_READS, i0, i1, i2, i3, values)
            for n in range(q8_tiles(w, kind - Q8_READS, i0, i1, i2, i3, values, activations, out, start),
                           x.shape[0]):  # (the rest: the one-row dots, the same to the bit)
                found = rows_of_kind(w, kind, i0, i1, i2, i3, x, n, sums, activations)
                put(out, n, start, i0, i1, i2, i3, found)
        elif tiles:
            scratch = np.empty((4, x.shape[1]), np.float32)  # the task's rows, dequantized
            rows_dequantized(w, kind, i0, i1, i2, i3, scratch)
            for n in range(float_tiles(scratch, x, out, start, i0, i1, i2, i3), x.shape[0]):
                put(out, n, start, i0, i1, i2, i3, float_rows(scratch, x, n))
        else:
            for n in range(x.shape[0]):
                found = rows_of_kind(w, kind, i0, i1, i2, i3, x, n, sums, activations)
                put(out, n, start, i0, i1, i2, i3, found)
