"""Activations quantized as llama.cpp quantizes them for its products with ggml blocks (Q8_0 and
Q8_1: each 32 values as int8 with a float16 scale; Q8_K, for the K-quants: each 256 with a
float32 one), and four weight rows dotted with one such row: each block's exact integer sum (by
VNNI's vpdpbusd where the CPU has it, else in pairs; a K-quant's times its sub-blocks' integer
scales), then one fused multiply-add a block (`_block_accumulated`, the matrix unit's arithmetic
too: a row's sums the same to the bit on either). LLVM vector IR (numba intrinsics): numba's own
integer arithmetic widens to 64 bits, which vector units multiply slowly. Kernels only.

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
#: the one-row dots take two weight rows' blocks in one 512-bit vector (`_pair_block`)
WIDE = VNNI and target_has_wide_vnni()


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
    """<8 x i32> (VNNI) or <16 x i32>: values <32 x i8> (unsigned) times quants <32 x i8>
    (signed), summed in fours (VNNI) or in pairs; either way the lanes in the values' order."""
    if VNNI:
        return _quad_sums(builder, values, quants)
    wide = ir.VectorType(_I32, 32)
    return _pair_sums(builder, builder.zext(values, wide), builder.sext(quants, wide))


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
    # (the two words joined in a scalar register: one mask move, not two and a mask join)
    a, b = (builder.zext(_load(builder, _at(builder, block, fifth), _I32), _I64) for block in blocks)
    word = builder.or_(a, builder.shl(b, ir.Constant(_I64, 32)))
    mask = builder.bitcast(word, ir.VectorType(ir.IntType(1), 64))
    return builder.select(mask, builder.or_(values, _const(16, 64)), values)


def _wide_sums(builder, values, quants):
    """<16 x i32>: lane j = Σ values[4j..4j+3]·quants[4j..4j+3] (<64 x i8>, values unsigned,
    quants signed), by the 512-bit vpdpbusd."""
    lanes = ir.VectorType(_I32, 16)
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(lanes, [lanes, lanes, lanes]), "llvm.x86.avx512.vpdpbusd.512")
    words = [builder.bitcast(values, lanes), builder.bitcast(quants, lanes)]
    return builder.call(function, [ir.Constant(lanes, [0] * 16), *words])


def _fma(builder, a, b, c):
    """a·b + c rounded once, lane by lane (llvm.fma): the dots' one way to add a term."""
    suffix = f"v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "f32"
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(a.type, [a.type] * 3), f"llvm.fma.{suffix}")
    return builder.call(function, [a, b, c])


def _count(builder, pointer):
    """The activations' count at pointer (a float32 holding an integer) as an i32."""
    return builder.fptosi(builder.load(pointer), _I32)


def _gathered(builder, values):
    """<len(values) x their type>: the scalars in order."""
    vector = ir.Constant(ir.VectorType(values[0].type, len(values)), ir.Undefined)
    for at, value in enumerate(values):
        vector = builder.insert_element(vector, value, _const(at, kind=_I32))
    return vector


def _items_summed(builder, vectors, items: int):
    """<n x i32>: each item's lanes summed, of `vectors` (a power of two of them, each holding
    `items` items, an equal run of lanes each), the items in order. Integers: any order of the
    additions gives the same sums."""
    lanes = vectors[0].type.count // items
    while lanes > 1:
        paired = len(vectors) > 1
        count = 2 * items if paired else items
        evens = [i * lanes + 2 * lane for i in range(count) for lane in range(lanes // 2)]
        joined = []
        for at in range(0, len(vectors), 2 if paired else 1):
            a, b = vectors[at], vectors[at + 1] if paired else vectors[at]
            halves = [builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(evens)),
                                                               [e + odd for e in evens])) for odd in (0, 1)]
            joined.append(builder.add(*halves))
        vectors, items, lanes = joined, count, lanes // 2
    while len(vectors) > 1:
        vectors = [_joined(builder, vectors[at], vectors[at + 1]) for at in range(0, len(vectors), 2)]
    return vectors[0]


#: the formats whose blocks add a minimum counted in integers (-dmin times Σ min·Σq_x)
_COUNTED = (_Q4_K, _Q5_K, _Q2_K)
#: the formats whose blocks add their float16 minimum times the activations' Q8_1 s
_DIRECT = tuple(code for code, layout in LAYOUTS.items() if layout[2] >= 0)


def _row_block(builder, kind: int, block, values_of, x) -> tuple:
    """One row's block dotted with one activation row x (`_block_activations`): (integer lanes,
    what its sum loses to the offset its values carry or None, its counted minimum or None)."""
    x_quants, _, x_counts, _ = x
    if kind in K_BLOCK_BYTES:
        def dots_of(g):
            quants = _load(builder, _at(builder, x_quants, g * 32), _I8, 32)
            return _integer_sums(builder, values_of(g), quants)

        dots, [(loss, counted)] = _k_integers(builder, kind, dots_of, [block], x_counts)
        return dots, loss, counted
    dots = _integer_sums(builder, values_of(0), _load(builder, x_quants, _I8, 32))
    offset = LAYOUTS[kind][4]
    return dots, builder.mul(_count(builder, x_counts), _const(offset, kind=_I32)) if offset else None, None


def _pair_block(builder, kind: int, blocks, x) -> tuple:
    """`_row_block` of two rows' blocks at once, on 512-bit vectors: (<16 x i32>, the first
    row's 8 lanes first; [(offset loss, counted minimum)] a row)."""
    x_quants, _, x_counts, _ = x
    if kind not in K_BLOCK_BYTES:
        quants = _load(builder, x_quants, _I8, 32)
        dots = _wide_sums(builder, _pair_block_bytes(builder, blocks, kind), _joined(builder, quants, quants))
        offset = LAYOUTS[kind][4]
        loss = builder.mul(_count(builder, x_counts), _const(offset, kind=_I32)) if offset else None
        return dots, [(loss, None)] * 2

    def dots_of(g):
        quants = _load(builder, _at(builder, x_quants, g * 32), _I8, 32)
        values = _joined(builder, *(_group_values(builder, kind, block, g) for block in blocks))
        return _wide_sums(builder, values, _joined(builder, quants, quants))

    return _k_integers(builder, kind, dots_of, blocks, x_counts)


def _k_integers(builder, kind: int, dots_of, blocks, counts) -> tuple:
    """A K-quant block of each of `blocks` (one row's, or two rows' whose dots share a vector,
    the first row's lanes first): (integer lanes Σ_g scale_g·dots_g, [(what the row's sum
    loses to the offset its values carry or None, its counted minimum Σ min·Σq_x or None)] a
    row), from each 32-value group's dots `dots_of(g)` (`_integer_sums` or `_wide_sums`), the
    scales of `_k_scale_min` or `_sixteen_scales` (each 16 values' lanes their own scale) and
    the block's counts of 16."""
    integers, counted = None, [_const(0, kind=_I32)] * len(blocks)
    for g in range(8):
        dots = dots_of(g)
        lanes = dots.type.count // len(blocks)  # (a row's)
        scales = []
        for r, block in enumerate(blocks):
            if kind in _SIXTEENS:
                row_scales, factors = _sixteen_scales(builder, kind, block, g)
                scales += [row_scales[2 * j // lanes] for j in range(lanes)]  # (each 16 values' lanes)
                for j, factor in enumerate(factors):
                    count = _count(builder, _at(builder, counts, 2 * g + j))
                    counted[r] = builder.add(counted[r], builder.mul(factor, count))
            else:
                scale, minimum = _k_scale_min(builder, block, g)
                scales += [scale] * lanes
                count = builder.add(*(_count(builder, _at(builder, counts, 2 * g + j)) for j in (0, 1)))
                counted[r] = builder.add(counted[r], builder.mul(minimum, count))
        scaled = builder.mul(dots, _gathered(builder, scales))
        integers = scaled if integers is None else builder.add(integers, scaled)
    if kind in _COUNTED:
        return integers, [(None, total) for total in counted]
    offset = _const(_SIXTEENS[kind][1], kind=_I32)
    return integers, [(builder.mul(total, offset), None) for total in counted]


def _pair_items_summed(builder, a, b):
    """<4 x i32>: the lanes of a's two items (8 lanes each, <16 x i32>) summed, then b's: one
    two-source shuffle pair lays each item's four pair sums partial-major (lane 4p + item), then
    the halves are added twice (four shuffles where `_items_summed` takes six: the one-row dots
    wait on the shuffle unit)."""
    evens = [base + 2 * p for p in range(4) for base in (0, 8, 16, 24)]
    pairs = [builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 16), [e + odd for e in evens]))
             for odd in (0, 1)]
    c = builder.add(*pairs)
    for width in (8, 4):
        halves = [builder.shuffle_vector(c, c, ir.Constant(ir.VectorType(_I32, width), list(range(first,
                  first + width)))) for first in (0, width)]
        c = builder.add(*halves)
    return c


def _block_sums(builder, vectors, items: int, losses):
    """<n x i32>: each (weight row, activation row) pair's exact integer sum I of a block
    (`vectors`' items summed, `_items_summed`) less what its values' offset adds (losses: one
    i32 a pair, or Nones)."""
    if items == 2 and len(vectors) == 2 and vectors[0].type.count == 16:
        sums = _pair_items_summed(builder, *vectors)
    else:
        sums = _items_summed(builder, vectors, items)
    return sums if losses[0] is None else builder.sub(sums, _gathered(builder, losses))


def _block_accumulated(builder, kind: int, sums, steps, minimum, acc):
    """acc (<n x float>, a (weight row, activation row) pair a lane) plus one block of each pair,
    in the one arithmetic every product of Q8 activations with blocks runs (the one-row dots,
    the 4x4 tiles, the matrix unit's: `numba_amx`), the even blocks into one sum and the odd
    into another, those added at the end (`_summed_over`): acc = fma(I, d·d_x, acc) (sums: I,
    `_block_sums`; steps: d·d_x); then for a counted minimum M acc = fma(M, -dmin·d_x, acc)
    (minimum: (M <n x i32>, -dmin·d_x)), for Q4_1's and Q5_1's acc = fma(m, s_x, acc) (minimum:
    (m, s_x)); each float32 vector <n x float>."""
    floats = ir.VectorType(_F32, sums.type.count)
    total = _fma(builder, builder.sitofp(sums, floats), steps, acc)
    if kind in _COUNTED:
        total = _fma(builder, builder.sitofp(minimum[0], floats), minimum[1], total)
    elif kind in _DIRECT:
        total = _fma(builder, minimum[0], minimum[1], total)
    return total


def _block_activations(builder, kind: int, b, first, quants, scales, counts, shifts) -> tuple:
    """What block b's dots read of a row of Q8 activations (pointers to the row's quants, scales,
    counts and shifts; b and its first value `first` i64 values): (its quants' pointer, its
    scale d_x, its counts' pointer, its Q8_1 s_x or None)."""
    x_quants = _at(builder, quants, first)
    x_scale = builder.load(_at(builder, scales, b))
    if kind in K_BLOCK_BYTES:
        return x_quants, x_scale, _at(builder, counts, builder.mul(b, ir.Constant(_I64, 16))), None
    shift = builder.load(_at(builder, shifts, b)) if kind in _DIRECT else None
    return x_quants, x_scale, _at(builder, counts, b), shift


def _summed_over(builder, count, initial, body):
    """The sum a loop over `count` (an i64) blocks makes from `initial` (zeros), body(index,
    value) giving the next value: the even blocks into one value, the odd into another, the two
    added at the end (`_block_accumulated`'s order; two chains of fused multiply-adds, and a
    result LLVM does not merge with the loop's registers). Values are phis, never memory."""
    before = builder.block
    header, step, tail, last, after = (builder.append_basic_block(f"sums.{part}")
                                       for part in ("header", "step", "tail", "last", "after"))
    pairs = builder.sdiv(count, ir.Constant(_I64, 2))
    builder.branch(header)
    builder.position_at_end(header)
    index, even, odd = builder.phi(_I64), builder.phi(initial.type), builder.phi(initial.type)
    for phi, value in ((index, ir.Constant(_I64, 0)), (even, initial), (odd, initial)):
        phi.add_incoming(value, before)
    builder.cbranch(builder.icmp_signed("<", index, pairs), step, tail)
    builder.position_at_end(step)
    first = builder.mul(index, ir.Constant(_I64, 2))
    next_even = body(first, even)
    next_odd = body(builder.add(first, ir.Constant(_I64, 1)), odd)
    for phi, value in ((index, builder.add(index, ir.Constant(_I64, 1))), (even, next_even), (odd, next_odd)):
        phi.add_incoming(value, builder.block)
    builder.branch(header)
    builder.position_at_end(tail)
    builder.cbranch(builder.icmp_signed("<", builder.mul(pairs, ir.Constant(_I64, 2)), count), last, after)
    builder.position_at_end(last)
    with_last = body(builder.sub(count, ir.Constant(_I64, 1)), even)
    last_end = builder.block
    builder.branch(after)
    builder.position_at_end(after)
    total = builder.phi(initial.type)
    total.add_incoming(even, tail)
    total.add_incoming(with_last, last_end)
    return builder.fadd(total, odd)


def _pair_rows_codegen(kind: int):
    """Codegen of four rows' dots with one row of Q8 activations on 512-bit vectors (`WIDE`):
    rows two by two (`_pair_block`), each block into the four sums as `_block_accumulated` adds
    it (the same float32 as `_rows_codegen`'s); the rows' float16 factors gathered as one vector
    and widened at once (`_factors_read`)."""
    size = K_BLOCK_BYTES[kind] if kind in K_BLOCK_BYTES else LAYOUTS[kind][0]
    group = ir.Constant(_I64, 256 if kind in K_BLOCK_BYTES else 32)

    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args[5:9], args[5:9])]
        activations = tuple(array.data for array in arrays)
        rows = _row_pointers(context, builder, signature.args[0], args[0], args[1:5])
        def block(b, acc):
            x = _block_activations(builder, kind, b, builder.mul(b, group), *activations)
            blocks_at = [_at(builder, row, builder.mul(b, ir.Constant(_I64, size))) for row in rows]
            vectors, losses, counted = [], [], []
            for pair in range(2):
                dots, pair_losses = _pair_block(builder, kind, blocks_at[2 * pair: 2 * pair + 2], x)
                vectors.append(dots)
                losses += [loss for loss, _ in pair_losses]
                counted += [total for _, total in pair_losses]
            steps, minimum = _factors_read(builder, kind, blocks_at, x, counted)
            sums = _block_sums(builder, vectors, 2, losses)
            return _block_accumulated(builder, kind, sums, steps, minimum, acc)

        zeros = ir.Constant(ir.VectorType(_F32, 4), [0.0] * 4)
        found = _summed_over(builder, builder.extract_value(arrays[1].shape, 0), zeros, block)
        values = [builder.extract_element(found, _const(r, kind=_I32)) for r in range(4)]
        return context.make_tuple(builder, signature.return_type, values)

    return codegen


def _joined_factors(builder, parts) -> tuple:
    """`_factors_read`'s (steps, minimum) of several activation rows as one, the first row's
    lanes first."""
    def joined(vectors):
        while len(vectors) > 1:
            vectors = [_joined(builder, vectors[at], vectors[at + 1]) for at in range(0, len(vectors), 2)]
        return vectors[0]

    steps = joined([step for step, _ in parts])
    if parts[0][1] is None:
        return steps, None
    return steps, tuple(joined([minimum[k] for _, minimum in parts]) for k in (0, 1))


def _factor_bytes(kind: int) -> tuple:
    """Where a block of `kind` keeps its d and its minimum (dmin, or m; None where it has none)
    as float16."""
    if kind in _SIXTEENS:
        return _SIXTEENS[kind][0], 82 if kind == _Q2_K else None
    if kind in K_BLOCK_BYTES:
        return 0, 2
    return 0, LAYOUTS[kind][2] if LAYOUTS[kind][2] >= 0 else None


#: by code: where a block keeps its d and its minimum (dmin, or Q4_1's and Q5_1's m; -1: none) as
#: float16 (`_factor_bytes`), for the matrix unit's kernels (`numba_amx.weight_factors`)
D_BYTES, MINIMUM_BYTES = (tuple(-1 if at is None else at for at in column)
                          for column in zip(*(_factor_bytes(code) for code in range(len(STORED_KINDS)))))


def _factors_read(builder, kind: int, blocks, x, counted) -> tuple:
    """(d·d_x, the minimum's pair as `_block_accumulated` takes it) of four rows' blocks and the
    activations x (`_block_activations`; counted: the rows' counted minimums or Nones): each
    factor's four float16 gathered into one vector and widened once."""
    halves = []
    for offset in _factor_bytes(kind):
        if offset is not None:
            bits = _gathered(builder, [_load(builder, _at(builder, block, offset), ir.IntType(16))
                                       for block in blocks])
            half = builder.bitcast(bits, ir.VectorType(ir.HalfType(), 4))
            halves.append(builder.fpext(half, ir.VectorType(_F32, 4)))
    x_scale = _splat(builder, x[1], 4)
    steps = builder.fmul(halves[0], x_scale)
    if kind in _COUNTED:
        return steps, (_gathered(builder, counted), builder.fmul(builder.fneg(halves[1]), x_scale))
    if kind in _DIRECT:
        return steps, (halves[1], _splat(builder, x[3], 4))
    return steps, None


def _rows_codegen(kind: int, tile: bool = False):
    """Codegen of four rows' dots with one row of Q8 activations: the 32-value formats a block
    of 32 a step, the K-quants a block of 256 (`_row_block`), the rows' values unpacked from
    their blocks, each block into the sums as `_block_accumulated` adds it. With `tile`, the
    rows' values are read from (4, in) uint8 values `_unpack_codegen` wrote (the same integers),
    the activations are (N, ...) arrays and a last argument n: rows n..n + 3 of them (16
    results, activation row major, each what that row alone gives)."""
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
        count = 4 * len(x_rows)
        blocks = builder.extract_value(scales.shape, 1 if tile else 0)  # ((N, blocks), or 1-D)

        def block(b, acc):
            first = builder.mul(b, ir.Constant(_I64, group))  # the block's first value
            xs = [_block_activations(builder, kind, b, first, *x_row) for x_row in x_rows]
            row_blocks = [_at(builder, row, builder.mul(b, ir.Constant(_I64, size))) for row in rows]
            vectors, losses, parts = [], [], []
            for x in xs:
                counted = []
                for r, block in enumerate(row_blocks):
                    dots, loss, minimum = _row_block(builder, kind, block,
                                                     _values_of(builder, kind, block, values, r, first), x)
                    vectors.append(dots)
                    losses.append(loss)
                    counted.append(minimum)
                parts.append(_factors_read(builder, kind, row_blocks, x, counted))
            steps, minimum = _joined_factors(builder, parts)
            sums = _block_sums(builder, vectors, 1, losses)
            return _block_accumulated(builder, kind, sums, steps, minimum, acc)

        found = _summed_over(builder, blocks, ir.Constant(ir.VectorType(_F32, count), [0.0] * count), block)
        results = [builder.extract_element(found, _const(at, kind=_I32)) for at in range(count)]
        return context.make_tuple(builder, signature.return_type, results)

    return codegen


def _row_of(builder, array, n):
    """A pointer to row n (an i64) of a C-contiguous 2-D array's data."""
    return builder.gep(array.data, [builder.mul(n, builder.extract_value(array.shape, 1))])


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
