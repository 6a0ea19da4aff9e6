"""Activations quantized as llama.cpp quantizes them for its products with ggml blocks (Q8_0 and
Q8_1: each 32 values as int8 with a float16 scale; Q8_K, for the K-quants: each 256 with a
float32 one), and four weight rows dotted with one such row as integer vectors: each 32 products
summed in int32 lanes (in fours by VNNI's vpdpbusd where the target CPU has it, else in pairs),
a K-quant's times its sub-blocks' integer scales, widened to float32 once a block and scaled by
both scales. The dots are LLVM vector IR (numba intrinsics): numba's own integer arithmetic
widens to 64 bits, which vector units multiply slowly. Imported only with the kernels.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
numba_q8.py.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core.codegen import get_host_cpu_features as host_cpu_features
from numba.extending import intrinsic

from kvcache.backends.cpu.numba_values import FLAGS, float16_rounded, float16_widened, quotient
from kvcache.model.quantized import STORED_KINDS

_INLINE = dict(inline="always", fastmath=FLAGS, error_model="numpy")
#: the K-quants' codes in `numba_blocks.CODES` (the formats' order in STORED_KINDS)
_Q4_K, _Q5_K, _Q6_K, _Q2_K, _Q3_K = (list(STORED_KINDS).index(kind)
                                     for kind in ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"))
#: the K-quants with a scale a 16 values (two a 32-value group): where their d is, and the offset
#: their q carry as dotted (unsigned; Q2_K's 0: its minimums are subtracted instead)
_SIXTEENS = {_Q6_K: (208, 32), _Q3_K: (108, 4), _Q2_K: (80, 0)}
#: the 32-value formats, by their codes in `numba_blocks.CODES`: (block bytes, where the q bytes
#: start, the float16 minimum's byte or -1, the fifth bits' byte or -1, the offset q carries as
#: dotted: Q8_0's signed q are read + 128, unsigned bytes, as the others' are)
LAYOUTS = {0: (34, 2, -1, -1, 128), 1: (18, 2, -1, -1, 8), 2: (20, 4, 2, -1, 0), 3: (22, 6, -1, 2, 16),
           4: (24, 8, 2, 4, 0)}
#: the K-quants' block bytes, by their codes in `numba_blocks.CODES`
K_BLOCK_BYTES = {code: STORED_KINDS[kind][1] for code, kind in
                 ((_Q4_K, "Q4_K"), (_Q5_K, "Q5_K"), (_Q6_K, "Q6_K"), (_Q2_K, "Q2_K"), (_Q3_K, "Q3_K"))}
#: by code: the offset a format's values carry as they are unpacked (`_group_values`): LAYOUTS'
#: for the 32-value formats, _SIXTEENS' for Q6_K, Q3_K and Q2_K, none for Q4_K and Q5_K
VALUE_OFFSETS = tuple(LAYOUTS[code][4] if code in LAYOUTS else _SIXTEENS.get(code, (0, 0))[1]
                      for code in range(len(STORED_KINDS)))
_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
#: the dots' float operations may fuse a multiply into an add (FMA, as llama.cpp's do) but not be
#: reordered ("reassoc"): the one-row dots and the tiles are different functions, and only the
#: written order makes them give the same float32 to the bit
_FAST = ("contract", "nsz")


def _target_features() -> set[str]:
    """The features numba hands LLVM ("+avx512vnni", ...): NUMBA_CPU_FEATURES where set, else the
    host's as numba reads them (without AVX where NUMBA_ENABLE_AVX is off), whatever the CPU's name."""
    features = numba.config.CPU_FEATURES
    if features is None:
        features = host_cpu_features()
    return set(features.split(","))


def target_has_vnni() -> bool:
    """Whether the CPU numba compiles for has 256-bit VNNI (AVX-VNNI, or AVX512-VNNI with
    AVX512VL), by `_target_features`."""
    named = _target_features()
    return "+avxvnni" in named or {"+avx512vnni", "+avx512vl"} <= named


def target_has_wide_vnni() -> bool:
    """Whether the CPU numba compiles for has 512-bit VNNI with AVX-512's byte and mask operations
    (AVX512-VNNI, BW, VL), by `_target_features`."""
    return {"+avx512f", "+avx512vnni", "+avx512bw", "+avx512vl"} <= _target_features()


#: the dots' integer sums: vpdpbusd's four products a lane (8 int32 lanes a block), or pairs
#: (16 lanes: the shape of a 16-bit multiply-add) where the target has no VNNI
VNNI = target_has_vnni()
#: the one-row dots take two weight rows' blocks in one 512-bit vector (each row's 8 lanes as
#: `_add_block`, `_q45_k_block` and `_sixteens_block` sum them, in the same operations: the same float32)
WIDE = VNNI and target_has_wide_vnni()
_LANES = ir.VectorType(_F32, 8 if VNNI else 16)  # a row's running sums, one block's lanes


#: what a block's scale is where its values are not all finite: a NaN, so that every product
#: reading the block is NaN (as the float products' are), never a finite wrong value
NOT_FINITE = np.float32(np.nan)
#: float32's largest finite value: a value is finite where its magnitude is at most this (a
#: comparison, which fast-math's reassociation leaves alone; NaN compares False)
LARGEST_FINITE = np.finfo(np.float32).max


@numba.njit(**_INLINE)
def q8_activations(x, quants, scales, counts, shifts):  # pragma: no cover (compiled)
    """Each 32 values of each row of x (N, in) as llama.cpp's Q8_0 and Q8_1 hold them: quants
    (N, in) int8 = round(x · 127 / max|x|) (ties to even), scales (N, in / 32) the float16 of
    max|x| / 127 widened, counts the sum of the 32 quants, shifts Q8_1's float16 of the unrounded
    scale times that sum (widened); all float32. A block holding a NaN or an inf: quants 0,
    scale and shift NOT_FINITE, count 0."""
    for n in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            largest, finite = np.float32(0.0), True
            for j in range(b * 32, b * 32 + 32):
                largest = max(largest, abs(x[n, j]))  # (max passes over a NaN: `finite` sees it)
                finite &= abs(x[n, j]) <= LARGEST_FINITE  # (False for a NaN or an inf)
            if not finite:
                for j in range(b * 32, b * 32 + 32):
                    quants[n, j] = 0
                scales[n, b], counts[n, b], shifts[n, b] = NOT_FINITE, np.float32(0.0), NOT_FINITE
            else:
                scale = quotient(largest, np.float32(127.0))
                inverse = quotient(np.float32(127.0), largest) if largest != 0 else np.float32(0.0)
                total = 0
                for j in range(b * 32, b * 32 + 32):
                    q = np.int8(np.rint(x[n, j] * inverse))
                    quants[n, j] = q
                    total += q
                scales[n, b] = float16_widened(float16_rounded(scale))
                counts[n, b] = np.float32(total)
                shifts[n, b] = float16_widened(float16_rounded(scale * np.float32(total)))


@numba.njit(**_INLINE)
def q8_k_activations(x, quants, scales, counts):  # pragma: no cover (compiled)
    """Each 256 values of each row of x (N, in) as llama.cpp's Q8_K holds them: quants (N, in)
    int8 = min(127, round(x · s)) (ties to even), s = -127 / m with m the first value of the
    largest magnitude; scales (N, in / 256) 1 / s (0 where every value is); counts (N, in / 16)
    the sum of each 16 quants; float32. A block holding a NaN or an inf: quants and counts 0,
    scale NOT_FINITE."""
    for n in range(x.shape[0]):
        for b in range(x.shape[1] // 256):
            largest, signed, finite = np.float32(0.0), np.float32(0.0), True
            for j in range(b * 256, b * 256 + 256):
                if abs(x[n, j]) > largest:  # (False for a NaN: `finite` sees it)
                    largest, signed = abs(x[n, j]), x[n, j]
                finite &= abs(x[n, j]) <= LARGEST_FINITE  # (False for a NaN or an inf)
            if not finite:
                for j in range(b * 256, b * 256 + 256):
                    quants[n, j] = 0
                for g in range(b * 16, b * 16 + 16):
                    counts[n, g] = np.float32(0.0)
                scales[n, b] = NOT_FINITE
            else:
                inverse = quotient(np.float32(-127.0), signed) if largest != 0 else np.float32(0.0)
                scales[n, b] = quotient(np.float32(1.0), inverse) if largest != 0 else np.float32(0.0)
                for g in range(b * 16, b * 16 + 16):
                    total = 0
                    for j in range(g * 16, g * 16 + 16):
                        q = np.int8(min(np.rint(x[n, j] * inverse), np.float32(127.0)))
                        quants[n, j] = q
                        total += q
                    counts[n, g] = np.float32(total)


def _splat(builder, value, lanes: int):
    """<lanes x value's type>, every lane `value`."""
    vector = ir.VectorType(value.type, lanes)
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes)
    return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined), zeros)


def _at(builder, pointer, offset):
    """pointer + offset elements (offset an int or an i64 value)."""
    return builder.gep(pointer, [ir.Constant(_I64, offset) if isinstance(offset, int) else offset])


def _load(builder, pointer, element, count: int | None = None):
    """The `count` elements (a vector; None: one value) at byte pointer `pointer`, unaligned."""
    kind = element if count is None else ir.VectorType(element, count)
    loaded = builder.load(builder.bitcast(pointer, kind.as_pointer()))
    loaded.align = 1
    return loaded


def _half(builder, pointer):
    return builder.fpext(_load(builder, pointer, ir.HalfType()), _F32)


def _block_bytes(builder, block, kind: int):
    """A block's 32 q values as unsigned <32 x i8> in their order, without the offset LAYOUTS
    gives: Q8_0's + 128 (its top bit flipped), the others' nibbles and the fifth bits above them."""
    _, quants, _, fifth, _ = LAYOUTS[kind]
    at = _at(builder, block, quants)
    if kind == 0:
        return builder.xor(_load(builder, at, _I8, 32), _const(128, 32))
    packed = _load(builder, at, _I8, 16)
    low = builder.and_(packed, ir.Constant(packed.type, [15] * 16))
    high = builder.lshr(packed, ir.Constant(packed.type, [4] * 16))
    values = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    if fifth < 0:
        return values
    # value j's fifth bit is bit j of the little-endian word: byte j // 8, bit j % 8 (each byte
    # spread over 8 lanes and tested there, as llama.cpp's bytes_from_bits_32)
    word = _load(builder, _at(builder, block, fifth), _I8, 4)
    byte_of = ir.Constant(ir.VectorType(_I32, 32), [j // 8 for j in range(32)])
    bit = builder.and_(builder.shuffle_vector(word, word, byte_of),
                       ir.Constant(values.type, [1 << (j % 8) for j in range(32)]))
    sixteens, zeros = ir.Constant(values.type, [16] * 32), ir.Constant(values.type, [0] * 32)
    return builder.or_(values, builder.select(builder.icmp_unsigned("!=", bit, zeros), sixteens, zeros))


def _quad_sums(builder, values, quants):
    """<8 x i32>: lane j = Σ values[4j..4j+3]·quants[4j..4j+3] (values <32 x i8> taken as
    unsigned, quants <32 x i8> signed), by vpdpbusd. Declared with its operands as <8 x i32>, as
    LLVM before 22 types them (LLVM 22 reads that declaration as its own <32 x i8> one)."""
    lanes = ir.VectorType(_I32, 8)
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(lanes, [lanes, lanes, lanes]),
        "llvm.x86.avx512.vpdpbusd.256",  # (AVX-VNNI's encoding where that is what the CPU has)
    )
    words = [builder.bitcast(values, lanes), builder.bitcast(quants, lanes)]
    return builder.call(function, [ir.Constant(lanes, [0] * 8), *words])


def _pair_sums(builder, values, quants):
    """<16 x i32>: lane j = values[2j]·quants[2j] + values[2j + 1]·quants[2j + 1] (the shape
    a vector unit's multiply-add of 16-bit pairs computes)."""
    lanes = ir.VectorType(_I32, 16)
    even, odd = (ir.Constant(lanes, list(range(first, 32, 2))) for first in (0, 1))
    products = [builder.mul(builder.shuffle_vector(values, values, pick),
                            builder.shuffle_vector(quants, quants, pick)) for pick in (even, odd)]
    return builder.add(*products)


def _integer_sums(builder, values, quants):
    """<_LANES x i32>: values <32 x i8> (unsigned) times quants <32 x i8> (signed), summed in
    fours (VNNI) or in pairs; either way the lanes in the values' order."""
    if VNNI:
        return _quad_sums(builder, values, quants)
    wide = ir.VectorType(_I32, 32)
    return _pair_sums(builder, builder.zext(values, wide), builder.sext(quants, wide))


def _add_block(builder, kind: int, block, values_of, activations, sums, extra) -> None:
    """One block of one row into its sums: sums (`_LANES`*) += the integer sums of its values
    (`values_of(0)`, as `_block_bytes` gives them) times d·d_x; extra (float*) += m·s (Q4_1,
    Q5_1) or -offset·Σq·d·d_x (the others, LAYOUTS)."""
    quants, x_scale, x_offset, x_shift = activations
    scale = builder.fmul(_half(builder, block), x_scale, flags=_FAST)
    _scaled_into(builder, sums, _integer_sums(builder, values_of(0), quants), scale)
    _add_extra(builder, kind, block, scale, x_offset, x_shift, extra)


def _add_extra(builder, kind: int, block, scale, x_offset, x_shift, extra) -> None:
    """A 32-value block's extra (float*) += m·s (Q4_1, Q5_1) or -offset·Σq·d·d_x (the others:
    scale d·d_x, x_offset -offset·Σq)."""
    minimum = LAYOUTS[kind][2]
    if minimum >= 0:
        part = builder.fmul(_half(builder, _at(builder, block, minimum)), x_shift, flags=_FAST)
    else:
        part = builder.fmul(scale, x_offset, flags=_FAST)
    builder.store(builder.fadd(builder.load(extra), part, flags=_FAST), extra)


def _const(value: int, lanes: int | None = None, kind=_I8):
    """An integer constant of `kind`: one value, or a vector of `lanes` of it."""
    if lanes is None:
        return ir.Constant(kind, value)
    return ir.Constant(ir.VectorType(kind, lanes), [value] * lanes)


def _byte(builder, block, at: int):
    """The byte at block + at as an i32 (unsigned)."""
    return builder.zext(_load(builder, _at(builder, block, at), _I8), _I32)


def _k_scale_min(builder, block, s: int):
    """Q4_K's and Q5_K's sub-block s scale and minimum (i32), 6-bit integers packed in the 12
    bytes after d and dmin (s < 4: the low 6 bits of bytes s and s + 4; else 4 bits of byte
    s + 4 and the top 2 of bytes s - 4 and s)."""
    if s < 4:
        return (builder.and_(_byte(builder, block, 4 + s), _const(63, kind=_I32)),
                builder.and_(_byte(builder, block, 8 + s), _const(63, kind=_I32)))
    packed, six = _byte(builder, block, 8 + s), _const(6, kind=_I32)
    top_scale = builder.shl(builder.lshr(_byte(builder, block, s), six), _const(4, kind=_I32))
    top_minimum = builder.shl(builder.lshr(_byte(builder, block, 4 + s), six), _const(4, kind=_I32))
    return (builder.or_(builder.and_(packed, _const(15, kind=_I32)), top_scale),
            builder.or_(builder.lshr(packed, _const(4, kind=_I32)), top_minimum))


def _nibbles(builder, packed, high: bool):
    """The low (or high) 4 bits of each byte of packed <32 x i8>."""
    return builder.lshr(packed, _const(4, 32)) if high else builder.and_(packed, _const(15, 32))


def _scaled_into(builder, sums, integers, scale) -> None:
    """sums (`_LANES`*) += the integer lanes as float32 times scale."""
    scaled = builder.fmul(builder.sitofp(integers, _LANES), _splat(builder, scale, _LANES.count), flags=_FAST)
    builder.store(builder.fadd(builder.load(sums), scaled, flags=_FAST), sums)


def _k_values(builder, kind: int, block, s: int):
    """Q4_K's or Q5_K's sub-block s (values 32·s..32·s + 31) as unsigned <32 x i8>: nibbles of
    the packed bytes, Q5_K's fifth bits (bit s of each of its 32 bytes) above them."""
    packed = _load(builder, _at(builder, block, (48 if kind == _Q5_K else 16) + (s // 2) * 32), _I8, 32)
    values = _nibbles(builder, packed, s % 2 == 1)
    if kind == _Q5_K:
        fifth = _load(builder, _at(builder, block, 16), _I8, 32)
        bit = builder.and_(builder.lshr(fifth, _const(s, 32)), _const(1, 32))
        values = builder.or_(values, builder.shl(bit, _const(4, 32)))
    return values


def _q6_values(builder, block, g: int):
    """Q6_K's group g of 32 values (values 32·g..32·g + 31) as unsigned <32 x i8> (0..63): four
    bits of the low bytes, two of the high ones above them."""
    half, t = divmod(g, 4)
    low_bits = _load(builder, _at(builder, block, 64 * half + 32 * (t % 2)), _I8, 32)
    high_bits = _load(builder, _at(builder, block, 128 + 32 * half), _I8, 32)
    high = builder.and_(builder.lshr(high_bits, _const(2 * t, 32)), _const(3, 32))
    return builder.or_(_nibbles(builder, low_bits, t >= 2), builder.shl(high, _const(4, 32)))


def _two_bit_values(builder, kind: int, block, g: int):
    """Q2_K's or Q3_K's group g of 32 values (values 32·g..32·g + 31) as unsigned <32 x i8>: bits
    2t, 2t + 1 of the 32 q bytes of half h (g = 4h + t; Q2_K's after 16 bytes of scales, Q3_K's
    after 32 of high bits), Q3_K's high bit (bit g of each of its 32 bytes) above them (0..7:
    q + 4)."""
    half, t = divmod(g, 4)
    packed = _load(builder, _at(builder, block, (16 if kind == _Q2_K else 32) + 32 * half), _I8, 32)
    values = builder.and_(builder.lshr(packed, _const(2 * t, 32)), _const(3, 32))
    if kind == _Q2_K:
        return values
    high = builder.and_(builder.lshr(_load(builder, block, _I8, 32), _const(g, 32)), _const(1, 32))
    return builder.or_(values, builder.shl(high, _const(2, 32)))


def _sixteen_scales(builder, kind: int, block, g: int) -> tuple[list, list]:
    """Group g's two scales (values 32·g..32·g + 15 and the next 16) of a block of Q6_K, Q3_K or
    Q2_K as i32, and what each times its 16 activations' sum subtracts (times the block's step):
    Q6_K's int8 scales; Q3_K's 6 bits (the low 4 nibble j // 8 of byte 96 + j % 8, the top 2
    bits 2·(j // 4) of byte 104 + j % 4) less 32; both the scale again (times the offset). Q2_K's
    the low nibble of byte j and its minimum the high one."""
    scales, factors = [], []
    for j in (2 * g, 2 * g + 1):
        if kind == _Q6_K:
            scale = builder.sext(_load(builder, _at(builder, block, 192 + j), _I8), _I32)
            factor = scale
        elif kind == _Q2_K:
            byte = _byte(builder, block, j)
            scale = builder.and_(byte, _const(15, kind=_I32))
            factor = builder.lshr(byte, _const(4, kind=_I32))
        else:
            low = builder.lshr(_byte(builder, block, 96 + j % 8), _const(4 * (j // 8), kind=_I32))
            high = builder.lshr(_byte(builder, block, 104 + j % 4), _const(2 * (j // 4), kind=_I32))
            low, high = builder.and_(low, _const(15, kind=_I32)), builder.and_(high, _const(3, kind=_I32))
            stored = builder.or_(low, builder.shl(high, _const(4, kind=_I32)))
            scale = builder.sub(stored, _const(32, kind=_I32))
            factor = scale
        scales.append(scale)
        factors.append(factor)
    return scales, factors


def _sixteens_shift(builder, kind: int, block, step, x_scale, offsets):
    """What a Q6_K, Q3_K or Q2_K block of a row subtracts from its sums: offset·d·d_x·Σ_j
    scale_j·Σq_x (step d·d_x; offsets the sum), Q2_K's dmin·d_x·Σ_j min_j·Σq_x."""
    if kind == _Q2_K:
        minimum_step = builder.fmul(_half(builder, _at(builder, block, 82)), x_scale, flags=_FAST)
        return builder.fmul(minimum_step, offsets, flags=_FAST)
    offset = ir.Constant(_F32, float(_SIXTEENS[kind][1]))
    return builder.fmul(builder.fmul(step, offset, flags=_FAST), offsets, flags=_FAST)


def _group_values(builder, kind: int, block, index: int):
    """The values of a block's 32-value group `index` (0 for the 32-value formats) as unsigned
    <32 x i8>, what the dots multiply: `_block_bytes`, `_k_values`, `_q6_values` or
    `_two_bit_values`."""
    if kind == _Q6_K:
        return _q6_values(builder, block, index)
    if kind in (_Q2_K, _Q3_K):
        return _two_bit_values(builder, kind, block, index)
    if kind in K_BLOCK_BYTES:
        return _k_values(builder, kind, block, index)
    return _block_bytes(builder, block, kind)


def _q45_k_block(builder, kind: int, block, values_of, quants, x_scale, counts, sums, extra) -> None:
    """A Q4_K or Q5_K block (256 values; sub-block s's values `values_of(s)`) of one row into
    its sums: d·d_x·Σ_s scale_s·Σq·q_x in integers, and extra -= dmin·d_x·Σ_s min_s·Σq_x (the
    sub-block's two counts of 16)."""
    integers = ir.Constant(ir.VectorType(_I32, _LANES.count), [0] * _LANES.count)
    minimum_sum = ir.Constant(_F32, 0.0)
    for s in range(8):
        scale, sub_minimum = _k_scale_min(builder, block, s)
        x = _load(builder, _at(builder, quants, s * 32), _I8, 32)
        dots = _integer_sums(builder, values_of(s), x)
        integers = builder.add(integers, builder.mul(dots, _splat(builder, scale, _LANES.count)))
        count = builder.fadd(builder.load(_at(builder, counts, 2 * s)),
                             builder.load(_at(builder, counts, 2 * s + 1)), flags=_FAST)
        share = builder.fmul(builder.sitofp(sub_minimum, _F32), count, flags=_FAST)
        minimum_sum = builder.fadd(minimum_sum, share, flags=_FAST)
    _scaled_into(builder, sums, integers, builder.fmul(_half(builder, block), x_scale, flags=_FAST))
    step = builder.fmul(_half(builder, _at(builder, block, 2)), x_scale, flags=_FAST)  # dmin·d_x
    shift = builder.fmul(step, minimum_sum, flags=_FAST)
    builder.store(builder.fsub(builder.load(extra), shift, flags=_FAST), extra)


def _sixteens_block(builder, kind: int, block, values_of, quants, x_scale, counts, sums, extra) -> None:
    """A Q6_K block (256 values; 128 bytes of low bits, 64 of high, 16 int8 scales, d), Q3_K
    or Q2_K (`_two_bit_values`, `_sixteen_scales`), group g's values `values_of(g)`, of one row
    into its sums: d·d_x·Σ_j scale_j·Σ q·q_x over its groups of 16 in integers (q unsigned), and
    extra -= `_sixteens_shift` (the offset q carries, or Q2_K's minimums)."""
    lanes = _LANES.count
    integers = ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes)
    offsets = ir.Constant(_F32, 0.0)
    halves = ir.Constant(ir.VectorType(_I32, lanes), [0] * (lanes // 2) + [lanes] * (lanes // 2))
    for g in range(8):
        dots = _integer_sums(builder, values_of(g), _load(builder, _at(builder, quants, g * 32), _I8, 32))
        (first, second), factors = _sixteen_scales(builder, kind, block, g)
        scales = builder.shuffle_vector(_splat(builder, first, lanes), _splat(builder, second, lanes), halves)
        integers = builder.add(integers, builder.mul(dots, scales))
        for j, factor in enumerate(factors):
            count = builder.load(_at(builder, counts, 2 * g + j))
            offsets = builder.fadd(offsets, builder.fmul(builder.sitofp(factor, _F32), count, flags=_FAST),
                                   flags=_FAST)
    step = builder.fmul(_half(builder, _at(builder, block, _SIXTEENS[kind][0])), x_scale, flags=_FAST)
    _scaled_into(builder, sums, integers, step)
    shift = _sixteens_shift(builder, kind, block, step, x_scale, offsets)
    builder.store(builder.fsub(builder.load(extra), shift, flags=_FAST), extra)


def _joined(builder, a, b):
    """Two vectors of n elements (of one type) as one of 2n, a's first."""
    count = 2 * a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, count), list(range(count))))


def _pair_block_bytes(builder, blocks, kind: int):
    """Two rows' blocks' 32 q values each, as `_block_bytes` gives one's, in one unsigned
    <64 x i8> (the first row's in lanes 0..31): the nibbles of both split at once, the fifth bits
    set through a mask of the two little-endian words (bit j: value j)."""
    _, quants, _, fifth, _ = LAYOUTS[kind]
    if kind == 0:
        a, b = (_load(builder, _at(builder, block, quants), _I8, 32) for block in blocks)
        return builder.xor(_joined(builder, a, b), _const(128, 64))
    a, b = (_load(builder, _at(builder, block, quants), _I8, 16) for block in blocks)
    twice = list(range(16)) * 2 + list(range(16, 32)) * 2  # each row's bytes, twice
    packed = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 64), twice))
    low, high = builder.and_(packed, _const(15, 64)), builder.lshr(packed, _const(4, 64))
    pick = [j + (64 if (j // 16) % 2 else 0) for j in range(64)]  # low, high, low, high
    values = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, 64), pick))
    if fifth < 0:
        return values
    bits = ir.VectorType(ir.IntType(1), 32)
    a, b = (builder.bitcast(_load(builder, _at(builder, block, fifth), _I32), bits) for block in blocks)
    return builder.select(_joined(builder, a, b), builder.or_(values, _const(16, 64)), values)


def _wide_sums(builder, values, quants):
    """<16 x i32>: lane j = Σ values[4j..4j+3]·quants[4j..4j+3] (<64 x i8>, values unsigned,
    quants signed), by the 512-bit vpdpbusd."""
    lanes = ir.VectorType(_I32, 16)
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(lanes, [lanes, lanes, lanes]), "llvm.x86.avx512.vpdpbusd.512")
    words = [builder.bitcast(values, lanes), builder.bitcast(quants, lanes)]
    return builder.call(function, [ir.Constant(lanes, [0] * 16), *words])


def _add_block_pair(builder, kind: int, blocks, activations, sums, extras) -> None:
    """`_add_block` for two rows' blocks at once: sums (<16 x float>*, each row's 8 lanes) +=
    their integer sums times d·d_x, each row's extra as `_add_block` adds it."""
    quants, x_scale, x_offset, x_shift = activations
    integers = _wide_sums(builder, _pair_block_bytes(builder, blocks, kind), _joined(builder, quants, quants))
    scales = [builder.fmul(_half(builder, block), x_scale, flags=_FAST) for block in blocks]
    spread = _pair_splat(builder, scales, 16)
    wide = ir.VectorType(_F32, 16)
    scaled = builder.fmul(builder.sitofp(integers, wide), spread, flags=_FAST)
    builder.store(builder.fadd(builder.load(sums), scaled, flags=_FAST), sums)
    for block, scale, extra in zip(blocks, scales, extras):
        _add_extra(builder, kind, block, scale, x_offset, x_shift, extra)


def _pair_splat(builder, values, lanes: int):
    """<lanes x type> of values (a few scalars of one type): each repeated lanes / len times, in
    order."""
    count = len(values)
    vector = ir.Constant(ir.VectorType(values[0].type, count), ir.Undefined)
    for at, value in enumerate(values):
        vector = builder.insert_element(vector, value, _const(at, kind=_I32))
    spread = [at * count // lanes for at in range(lanes)]
    return builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(_I32, lanes), spread))


def _pair_k_block(builder, kind: int, blocks, quants, x_scale, counts, sums, extras) -> None:
    """`_q45_k_block` or `_sixteens_block` for two rows' blocks at once: their groups' values in one
    <64 x i8>, one 512-bit vpdpbusd a group, each row's lanes and extra in the operations the
    one-row functions use (the same float32)."""
    wide = ir.VectorType(_I32, 16)
    integers = ir.Constant(wide, [0] * 16)
    shares = [ir.Constant(_F32, 0.0) for _ in blocks]
    for g in range(8):
        x = _load(builder, _at(builder, quants, g * 32), _I8, 32)
        a, b = (_group_values(builder, kind, block, g) for block in blocks)
        dots = _wide_sums(builder, _joined(builder, a, b), _joined(builder, x, x))
        if kind in _SIXTEENS:
            pairs = [_sixteen_scales(builder, kind, block, g) for block in blocks]
            scales = [scale for block_scales, _ in pairs for scale in block_scales]
            for r, (_, factors) in enumerate(pairs):
                for j, factor in enumerate(factors):
                    count = builder.load(_at(builder, counts, 2 * g + j))
                    part = builder.fmul(builder.sitofp(factor, _F32), count, flags=_FAST)
                    shares[r] = builder.fadd(shares[r], part, flags=_FAST)
        else:
            pairs = [_k_scale_min(builder, block, g) for block in blocks]
            scales = [scale for scale, _ in pairs]
            count = builder.fadd(builder.load(_at(builder, counts, 2 * g)),
                                 builder.load(_at(builder, counts, 2 * g + 1)), flags=_FAST)
            for r, (_, sub_minimum) in enumerate(pairs):
                part = builder.fmul(builder.sitofp(sub_minimum, _F32), count, flags=_FAST)
                shares[r] = builder.fadd(shares[r], part, flags=_FAST)
        integers = builder.add(integers, builder.mul(dots, _pair_splat(builder, scales, 16)))
    at = _SIXTEENS[kind][0] if kind in _SIXTEENS else 0
    steps = [builder.fmul(_half(builder, _at(builder, block, at)), x_scale, flags=_FAST) for block in blocks]
    scaled = builder.fmul(builder.sitofp(integers, ir.VectorType(_F32, 16)), _pair_splat(builder, steps, 16),
                          flags=_FAST)
    builder.store(builder.fadd(builder.load(sums), scaled, flags=_FAST), sums)
    for r, (block, extra) in enumerate(zip(blocks, extras)):
        if kind in _SIXTEENS:
            shift = _sixteens_shift(builder, kind, block, steps[r], x_scale, shares[r])
        else:
            step = builder.fmul(_half(builder, _at(builder, block, 2)), x_scale, flags=_FAST)
            shift = builder.fmul(step, shares[r], flags=_FAST)
        builder.store(builder.fsub(builder.load(extra), shift, flags=_FAST), extra)


def _pair_rows_codegen(kind: int):
    """Codegen of four rows' dots with one row of Q8 activations on 512-bit vectors (`WIDE`):
    rows two by two (`_add_block_pair`, `_pair_k_block`), each row's float32 what
    `_rows_codegen`'s give (the tiles read those)."""
    size, group = (K_BLOCK_BYTES[kind], 256) if kind in K_BLOCK_BYTES else (LAYOUTS[kind][0], 32)

    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args[5:9], args[5:9])]
        quants, scales, counts, shifts = (array.data for array in arrays)
        rows = _row_pointers(context, builder, signature.args[0], args[0], args[1:5])
        wide = ir.VectorType(_F32, 16)
        sums = [cgutils.alloca_once_value(builder, ir.Constant(wide, [0.0] * 16)) for _ in range(2)]
        extras = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in rows]
        with cgutils.for_range(builder, builder.extract_value(arrays[1].shape, 0)) as loop:
            b = loop.index
            first = builder.mul(b, ir.Constant(_I64, group))
            x_quants, x_scale, x_counts, activations = _block_activations(
                builder, kind, b, first, quants, scales, counts, shifts)
            blocks = [_at(builder, row, builder.mul(b, ir.Constant(_I64, size))) for row in rows]
            for pair in range(2):
                two, extra = blocks[2 * pair: 2 * pair + 2], extras[2 * pair: 2 * pair + 2]
                if kind in K_BLOCK_BYTES:
                    _pair_k_block(builder, kind, two, x_quants, x_scale, x_counts, sums[pair], extra)
                else:
                    _add_block_pair(builder, kind, two, activations, sums[pair], extra)
        halves = (range(8), range(8, 16))  # each row's lanes in its pair's vector
        found = [_lanes_summed(builder, builder.load(sums[r // 2]), halves[r % 2], extra)
                 for r, extra in enumerate(extras)]
        return context.make_tuple(builder, signature.return_type, found)

    return codegen


def _rows_codegen(kind: int, tile: bool = False):
    """Codegen of four rows' dots with one row of Q8 activations: the 32-value formats a block
    of 32 a step (`_add_block`), the K-quants a block of 256 (`_q45_k_block`, `_sixteens_block`), the
    rows' values unpacked from their blocks. With `tile`, the rows' values are read from (4, in)
    uint8 values `_unpack_codegen` wrote (the same integers), the activations are (N, ...) arrays
    and a last argument n: rows n..n + 3 of them, each pair of rows dotted in the same operations
    as one row is (16 results, activation row major)."""
    size, group = (K_BLOCK_BYTES[kind], 256) if kind in K_BLOCK_BYTES else (LAYOUTS[kind][0], 32)

    def codegen(context, builder, signature, args):
        last = 10 if tile else 9  # (the arrays' arguments end there; a tile's n follows them)
        arrays = [context.make_array(t)(context, builder, a)
                  for t, a in zip(signature.args[5:last], args[5:last])]
        values = arrays.pop(0) if tile else None
        quants, scales, counts, shifts = arrays
        if tile:
            x_rows = [tuple(_row_of(builder, array, builder.add(args[-1], ir.Constant(_I64, t)))
                            for array in (quants, scales, counts, shifts)) for t in range(4)]
        else:
            x_rows = [tuple(array.data for array in (quants, scales, counts, shifts))]
        rows = _row_pointers(context, builder, signature.args[0], args[0], args[1:5])
        sums = [[cgutils.alloca_once_value(builder, ir.Constant(_LANES, [0.0] * _LANES.count)) for _ in rows]
                for _ in x_rows]
        extras = [[cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in rows] for _ in x_rows]
        blocks = builder.extract_value(scales.shape, 1 if tile else 0)  # ((N, blocks), or 1-D)
        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            first = builder.mul(b, ir.Constant(_I64, group))  # the block's first value
            xs = [_block_activations(builder, kind, b, first, *x_row) for x_row in x_rows]
            for r, row in enumerate(rows):
                block = _at(builder, row, builder.mul(b, ir.Constant(_I64, size)))
                values_of = _values_of(builder, kind, block, values, r, first)
                for t, x in enumerate(xs):
                    _block_into(builder, kind, block, values_of, x, sums[t][r], extras[t][r])
        found = [value for t in range(len(x_rows)) for value in _reduced(builder, sums[t], extras[t])]
        return context.make_tuple(builder, signature.return_type, found)

    return codegen


def _row_of(builder, array, n):
    """A pointer to row n (an i64) of a C-contiguous 2-D array's data."""
    return builder.gep(array.data, [builder.mul(n, builder.extract_value(array.shape, 1))])


def _block_activations(builder, kind: int, b, first, quants, scales, counts, shifts) -> tuple:
    """What block b's dots read of a row of Q8 activations (pointers to the row's quants, scales,
    counts and shifts; b and its first value `first` i64 values): (its quants' pointer, its
    scale, its counts' pointer, and for a 32-value format `_add_block`'s four activations, else
    None)."""
    x_quants = _at(builder, quants, first)
    x_scale = builder.load(_at(builder, scales, b))
    activations = None
    if kind not in K_BLOCK_BYTES:
        count = builder.load(_at(builder, counts, b))
        activations = (
            _load(builder, x_quants, _I8, 32), x_scale,
            builder.fmul(count, ir.Constant(_F32, -LAYOUTS[kind][4]), flags=_FAST),
            builder.load(_at(builder, shifts, b)),
        )
    return x_quants, x_scale, _at(builder, counts, builder.mul(b, ir.Constant(_I64, 16))), activations


def _block_into(builder, kind: int, block, values_of, x: tuple, sums, extra) -> None:
    """One block of one row (its values `values_of`) dotted with x (`_block_activations`) into
    the row's sums and extra, as its format's dots do."""
    x_quants, x_scale, x_counts, activations = x
    if kind in _SIXTEENS:
        _sixteens_block(builder, kind, block, values_of, x_quants, x_scale, x_counts, sums, extra)
    elif kind in K_BLOCK_BYTES:
        _q45_k_block(builder, kind, block, values_of, x_quants, x_scale, x_counts, sums, extra)
    else:
        _add_block(builder, kind, block, values_of, activations, sums, extra)


def _row_pointers(context, builder, weight_type, weight, indices) -> list:
    """Byte pointers to rows `indices` (i64 values) of the weight (rows, row bytes) uint8."""
    array = context.make_array(weight_type)(context, builder, weight)
    stride = builder.extract_value(array.strides, 0)
    return [builder.gep(array.data, [builder.mul(i, stride)]) for i in indices]


def _values_of(builder, kind: int, block, values, r: int, start):
    """values_of(index): the <32 x i8> values of group `index` of a row's block, unpacked from
    the block (values None) or read from row r of `values` at start + 32·index (start: the
    block's first value, an i64)."""
    if values is None:
        return lambda index: _group_values(builder, kind, block, index)
    stride = builder.extract_value(values.strides, 0)
    row = builder.gep(values.data, [builder.mul(ir.Constant(_I64, r), stride)])
    return lambda index: _load(builder, _at(builder, row, builder.add(start, ir.Constant(_I64, 32 * index))),
                               _I8, 32)


def _unpack_codegen(kind: int):
    """Codegen writing four rows' values, as the dots multiply them (`_group_values`), into
    (4, in) uint8 values: row r's value j at [r, j]."""
    k_quant = kind in K_BLOCK_BYTES
    size, group = (K_BLOCK_BYTES[kind], 256) if k_quant else (LAYOUTS[kind][0], 32)

    def codegen(context, builder, signature, args):
        rows = _row_pointers(context, builder, signature.args[0], args[0], args[1:5])
        values = context.make_array(signature.args[5])(context, builder, args[5])
        stride = builder.extract_value(values.strides, 0)
        blocks = builder.sdiv(builder.extract_value(values.shape, 1), ir.Constant(_I64, group))
        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            for r, row in enumerate(rows):
                block = _at(builder, row, builder.mul(b, ir.Constant(_I64, size)))
                target = builder.gep(values.data, [builder.mul(ir.Constant(_I64, r), stride)])
                for index in range(group // 32):
                    vector = _group_values(builder, kind, block, index)
                    at = _at(builder, target, builder.add(builder.mul(b, ir.Constant(_I64, group)),
                                                          ir.Constant(_I64, 32 * index)))
                    stored = builder.store(vector, builder.bitcast(at, vector.type.as_pointer()))
                    stored.align = 1
        return context.get_dummy_value()

    return codegen


def _reduced(builder, sums, extras) -> list:
    """Each row's float lanes summed, plus its extra: four float32."""
    return [_lanes_summed(builder, builder.load(row_sums), range(_LANES.count), extra)
            for row_sums, extra in zip(sums, extras)]


def _lanes_summed(builder, lanes, picked: range, extra):
    """*extra plus the lanes `picked` of a float vector, added in order (one row's result)."""
    result = builder.load(extra)
    for lane in picked:
        result = builder.fadd(result, builder.extract_element(lanes, ir.Constant(_I32, lane)), flags=_FAST)
    return result


def _rows_intrinsic(kind: int):
    """The intrinsic dotting four rows of a weight of `kind` with one row of Q8 activations:
    (w, i0, i1, i2, i3, quants, scales, counts, shifts) -> four float32 (w (rows, row bytes)
    uint8; the activations one row of `q8_activations`' arrays, or of `q8_k_activations`' for a
    K-quant, whose shifts are not read)."""

    def rows(typingctx, w, i0, i1, i2, i3, quants, scales, counts, shifts):
        indices = (i0, i1, i2, i3)
        if not all(isinstance(i, numba.types.Integer) for i in indices):
            return None
        index = numba.types.int64
        signature = numba.types.UniTuple(numba.types.float32, 4)(
            w, index, index, index, index, quants, scales, counts, shifts
        )
        return signature, _pair_rows_codegen(kind) if WIDE else _rows_codegen(kind)

    rows.__name__ = f"q8_rows_{kind}"
    return intrinsic(rows)


def _tile_intrinsic(kind: int):
    """The intrinsic (w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n) dotting four
    rows of a weight of `kind`, their values read from `values` as the kind's `_unpack_intrinsic`
    wrote them, with rows n..n + 3 of Q8 activations (the (N, ...) arrays of `q8_activations`
    or `q8_k_activations`): 16 float32, row n's four first, each equal to the bit to what
    `_rows_intrinsic`'s dots give for that row alone."""

    def tile(typingctx, w, i0, i1, i2, i3, values, quants, scales, counts, shifts, n):
        if not all(isinstance(i, numba.types.Integer) for i in (i0, i1, i2, i3, n)):
            return None
        index = numba.types.int64
        signature = numba.types.UniTuple(numba.types.float32, 16)(
            w, index, index, index, index, values, quants, scales, counts, shifts, index)
        return signature, _rows_codegen(kind, tile=True)

    tile.__name__ = f"q8_tile_{kind}"
    return intrinsic(tile)


def _unpack_intrinsic(kind: int):
    """The intrinsic (w, i0, i1, i2, i3, values) writing rows i0..i3 of a weight of `kind` (w
    (rows, row bytes) uint8) into values (4, in) uint8 as its dots multiply them: unsigned, the
    format's offset left in (Q8_0's + 128), in the values' order."""

    def unpack(typingctx, w, i0, i1, i2, i3, values):
        if not all(isinstance(i, numba.types.Integer) for i in (i0, i1, i2, i3)):
            return None
        index = numba.types.int64
        return numba.types.none(w, index, index, index, index, values), _unpack_codegen(kind)

    unpack.__name__ = f"q8_unpack_{kind}"
    return intrinsic(unpack)


(q8_0_rows, q4_0_rows, q4_1_rows, q5_0_rows, q5_1_rows, q4_k_rows, q5_k_rows, q6_k_rows, q2_k_rows,
 q3_k_rows) = (_rows_intrinsic(kind) for kind in range(len(STORED_KINDS)))
(q8_0_unpack, q4_0_unpack, q4_1_unpack, q5_0_unpack, q5_1_unpack, q4_k_unpack, q5_k_unpack, q6_k_unpack,
 q2_k_unpack, q3_k_unpack) = (_unpack_intrinsic(kind) for kind in range(len(STORED_KINDS)))
(q8_0_tile, q4_0_tile, q4_1_tile, q5_0_tile, q5_1_tile, q4_k_tile, q5_k_tile, q6_k_tile, q2_k_tile,
 q3_k_tile) = (_tile_intrinsic(kind) for kind in range(len(STORED_KINDS)))
