"""Products of many activation rows with ggml blocks on the CPU's matrix unit (AMX tiles): each
group of 32 values (16 for the formats scaled every 16) of 16 weight rows times 16 activation
rows in one `tdpbusd`, the integer sums then scaled into float32 sums group after group. A row's
outputs are the same to the bit whatever rows stand beside it, but are summed in another order
than the one-row dots' (`numba_q8`): backends use it only past `kernel_rows` tokens. Usable once
the kernel grants the process the tiles (`usable`). Imported only with the kernels.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
numba_amx.py.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import numba
import numpy as np
from llvmlite import binding, ir
from numba import prange
from numba.core import cgutils
from numba.extending import intrinsic

from kvcache.backends.cpu.numba_blocks import (
    BLOCK_BYTES,
    Q2_K,
    Q3_K,
    Q4_1,
    Q4_K,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_READS,
    activation_arrays,
    half_at,
    k_scale_min,
    quantize_row,
    two_bit_scale_min,
    unpack_rows_of_kind,
)
from kvcache.backends.cpu.numba_q8 import VALUE_OFFSETS
from kvcache.backends.cpu.numba_values import FLAGS

_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
#: the formats whose scales step every 16 values (the others' every 32)
_SIXTEENS = (Q6_K, Q3_K, Q2_K)
#: the formats with minimums (Q4_1's and Q5_1's m, the K-quants' dmin·sub-minimum)
_MINIMUMS = (Q4_1, Q5_1, Q4_K, Q5_K, Q2_K)
_I64, _F32 = ir.IntType(64), ir.FloatType()
_I16, _F16 = ir.VectorType(ir.IntType(32), 16), ir.VectorType(_F32, 16)  # (16 lanes of each)
#: the float operations may fuse a multiply into an add, never reorder
_FAST = ("contract", "nsz")


@functools.cache
def usable() -> bool:
    """Whether this process may run the tile products: an x86-64 Linux CPU with AMX's tiles and
    8-bit dots, the tiles' state granted by the kernel (asked once here)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    features = binding.get_host_cpu_features()
    if not (features.get("amx-tile") and features.get("amx-int8")):
        return False
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
    if syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        return False
    binding.initialize_native_asmparser()  # (the tile instructions are inline assembly)
    return True


def _pointer(context, builder, array_type, array, offset):
    """The byte pointer to an array's data plus `offset` bytes (an i64)."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [offset])


@intrinsic
def tile_config(typingctx, config):
    """Loads the tile configuration (64 bytes, `_configured`) for the calling thread."""
    def codegen(context, builder, signature, args):
        data = _pointer(context, builder, signature.args[0], args[0], ir.Constant(_I64, 0))
        builder.asm(ir.FunctionType(ir.VoidType(), [data.type]), "ldtilecfg ($0)", "r,~{memory}", [data],
                    side_effect=True)
        return context.get_dummy_value()
    return numba.types.none(config), codegen


@intrinsic
def tile_release(typingctx):
    """Releases the calling thread's tiles (their state is then not saved on a switch)."""
    def codegen(context, builder, signature, args):
        builder.asm(ir.FunctionType(ir.VoidType(), []), "tilerelease", "~{memory}", [], side_effect=True)
        return context.get_dummy_value()
    return numba.types.none(), codegen


def _groups_intrinsic(with_minimums: bool):
    """The intrinsic (values, laid, offsets, x_scales, x_shifts, scales, minimums, group, found):
    found (16, 16) float32 = Σ over the groups g of 16 weight rows' values (16, in) uint8 times
    16 tokens' laid activations (in / 4, 64) int8 (`activation_tiles`, one tile's), each group's
    16×16 integer sums (`tdpbusd`, the tiles configured for `group` values) less offsets[g] (the
    tokens' (groups, 16) int32), times scales[r, g]·x_scales[g], plus minimums[r, g]·x_shifts[g]
    `with_minimums` (weight rows' (16, groups), tokens' (groups, 16) float32; without, they are
    not read), added group after group."""

    def tile_groups(typingctx, values, laid, offsets, x_scales, x_shifts, scales, minimums, group, found):
        signature = numba.types.none(values, laid, offsets, x_scales, x_shifts, scales, minimums,
                                     numba.types.int64, found)
        return signature, functools.partial(_groups_codegen, with_minimums)

    tile_groups.__name__ = "tile_groups" if with_minimums else "tile_groups_scaled"
    return intrinsic(tile_groups)


def _groups_codegen(with_minimums, context, builder, signature, args):
    """`_groups_intrinsic`'s code."""
    arrays = [context.make_array(t)(context, builder, a) for i, (t, a) in enumerate(zip(signature.args, args))
              if i != 7]
    data = [builder.bitcast(a.data, ir.IntType(8).as_pointer()) for a in arrays[:7]]
    p_values, p_laid, p_offsets, p_scales_x, p_shifts_x, p_scales, p_minimums = data
    p_found = builder.bitcast(arrays[7].data, _F16.as_pointer())
    width, groups = builder.extract_value(arrays[0].shape, 1), builder.extract_value(arrays[5].shape, 1)
    step = args[7]  # (the group's values, an i64)
    with builder.goto_entry_block():
        sums = builder.alloca(ir.ArrayType(_I16, 16))  # (the tile's 16 rows of 16 int32)
        sums.align = 64
    totals = [cgutils.alloca_once_value(builder, ir.Constant(_F16, [0.0] * 16)) for _ in range(16)]
    with cgutils.for_range(builder, groups) as loop:
        g = loop.index
        _tile_dot(builder, builder.gep(p_values, [builder.mul(g, step)]), width,
                  builder.gep(p_laid, [builder.mul(builder.mul(g, step), ir.Constant(_I64, 16))]),
                  builder.bitcast(sums, ir.IntType(8).as_pointer()))
        at = builder.mul(g, ir.Constant(_I64, 64))  # (bytes of a group's 16 int32 / float32)
        offset = _vector(builder, p_offsets, at, _I16)
        x_scale, x_shift = _vector(builder, p_scales_x, at, _F16), _vector(builder, p_shifts_x, at, _F16)
        for r in range(16):
            row = builder.load(builder.gep(sums, [ir.Constant(_I64, 0), ir.Constant(_I64, r)]))
            value = builder.sitofp(builder.sub(row, offset), _F16)
            weight_at = builder.mul(builder.add(builder.mul(ir.Constant(_I64, r), groups), g),
                                    ir.Constant(_I64, 4))  # (byte of [r, g] in (16, groups) float32)
            scale = _splat(builder, _scalar(builder, p_scales, weight_at))
            part = builder.fmul(value, builder.fmul(scale, x_scale, flags=_FAST), flags=_FAST)
            if with_minimums:
                minimum = _splat(builder, _scalar(builder, p_minimums, weight_at))
                part = builder.fadd(part, builder.fmul(minimum, x_shift, flags=_FAST), flags=_FAST)
            builder.store(builder.fadd(builder.load(totals[r]), part, flags=_FAST), totals[r])
    for r in range(16):
        target = builder.bitcast(builder.gep(p_found, [ir.Constant(_I64, r)]), _F16.as_pointer())
        builder.store(builder.load(totals[r]), target).align = 4
    return context.get_dummy_value()


tile_groups, tile_groups_scaled = _groups_intrinsic(True), _groups_intrinsic(False)


def _tile_dot(builder, a, a_stride, b, c) -> None:
    """c (16 rows of 16 int32, 64 bytes a row) = tile 1 (16 rows of a's unsigned bytes, a_stride
    apart) times tile 2 (b's signed bytes, 64 a row, four values of each of 16 columns a row), as
    `tdpbusd` sums them, the tiles' shapes as configured."""
    asm = ("tilezero %tmm0\n\ttileloadd ($0,$3,1), %tmm1\n\ttileloadd ($1,$4,1), %tmm2\n\t"
           "tdpbusd %tmm2, %tmm1, %tmm0\n\ttilestored %tmm0, ($2,$4,1)")
    function = ir.FunctionType(ir.VoidType(), [a.type, b.type, c.type, _I64, _I64])
    builder.asm(function, asm, "r,r,r,r,r,~{memory}", [a, b, c, a_stride, ir.Constant(_I64, 64)],
                side_effect=True)


def _vector(builder, pointer, at, kind):
    """The 16-lane vector of `kind` at byte `at` of an i8 pointer."""
    loaded = builder.load(builder.bitcast(builder.gep(pointer, [at]), kind.as_pointer()))
    loaded.align = 4
    return loaded


def _scalar(builder, pointer, at):
    """The float32 at byte `at` of an i8 pointer."""
    return builder.load(builder.bitcast(builder.gep(pointer, [at]), _F32.as_pointer()))


def _splat(builder, value):
    """A float32 in all 16 lanes."""
    undefined = ir.Constant(_F16, ir.Undefined)
    lanes = builder.insert_element(undefined, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(lanes, undefined, ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))


_KERNEL = dict(fastmath=FLAGS, error_model="numpy", cache=True, boundscheck=False, nogil=True)
_INLINE = dict(inline="always", fastmath=FLAGS, error_model="numpy")


@numba.njit(**_INLINE)
def configured(group):  # pragma: no cover (compiled)
    """The 64-byte tile configuration (palette 1) for groups of `group` values: tile 0 the sums
    (16 rows of 16 int32), tile 1 16 weight rows of `group` bytes, tile 2 the activations'
    group / 4 rows of 64 bytes."""
    config = np.zeros(64, np.uint8)
    config[0] = 1
    for tile, (rows, row_bytes) in enumerate(((16, 64), (16, group), (group // 4, 64))):
        config[16 + 2 * tile] = row_bytes
        config[48 + tile] = rows
    return config


@numba.njit(**_INLINE)
def weight_factors(w, kind, i, r, scales, minimums):  # pragma: no cover (compiled)
    """Row r of scales and minimums (16, groups) float32 from weight row i of `kind`: each
    group's scale (d, d·sub-scale) and what its activations' sum is multiplied by (the minimum:
    Q4_1's and Q5_1's m, the K-quants' -dmin·sub-minimum; 0 for the others)."""
    size = BLOCK_BYTES[kind]
    if kind < Q4_K:
        for g in range(scales.shape[1]):
            scales[r, g] = half_at(w, i, g * size)
            minimums[r, g] = half_at(w, i, g * size + 2) if kind == Q4_1 or kind == Q5_1 else np.float32(0.0)
    elif kind == Q4_K or kind == Q5_K:
        for b in range(scales.shape[1] // 8):
            d, least = half_at(w, i, b * size), half_at(w, i, b * size + 2)
            for s in range(8):
                scale, low = k_scale_min(w, i, b * size + 4, s)
                scales[r, 8 * b + s], minimums[r, 8 * b + s] = d * scale, -least * low
    else:
        for b in range(scales.shape[1] // 16):
            at = b * size
            for j in range(16):
                scales[r, 16 * b + j], minimums[r, 16 * b + j] = sixteen_factors(w, kind, i, at, j)


@numba.njit(**_INLINE)
def sixteen_factors(w, kind, i, at, j):  # pragma: no cover (compiled)
    """Q6_K's, Q3_K's or Q2_K's scale and minimum factor of 16-value group j of the block at
    `at` of row i (`numba_blocks.two_bit_scale_min`'s scales times d, Q2_K's minimum times -dmin)."""
    if kind == Q6_K:
        return half_at(w, i, at + 208) * np.float32(np.int8(w[i, at + 192 + j])), np.float32(0.0)
    scale, low = two_bit_scale_min(w, kind, i, at, j)
    if kind == Q2_K:
        return half_at(w, i, at + 80) * scale, -half_at(w, i, at + 82) * low
    return half_at(w, i, at + 108) * scale, np.float32(0.0)


@numba.njit(**_INLINE)
def activation_factors(kind, activations, n, g, group):  # pragma: no cover (compiled)
    """Token n's group g (of `group` values): (its scale, the sum of its quants, what the
    weight's minimum factor multiplies: Q8_1's s, or the scale times that sum for the K-quants
    with minimums)."""
    _, scales, counts, shifts = activations
    if kind < Q4_K:
        shift = shifts[n, g] if kind == Q4_1 or kind == Q5_1 else np.float32(0.0)
        return scales[n, g], counts[n, g], shift
    scale = scales[n, (g * group) // 256]
    total = counts[n, g] if group == 16 else counts[n, 2 * g] + counts[n, 2 * g + 1]
    return scale, total, scale * total if kind in _MINIMUMS else np.float32(0.0)


@numba.njit(parallel=True, **_KERNEL)
def activation_tiles(x, kind, group):  # pragma: no cover (compiled)
    """x (N, in) quantized as llama.cpp's products read it, laid out for tile 2: (tiles, in / 4,
    64) int8, token 16t + j's values 4k..4k + 3 at [t, k, 4j : 4j + 4] (zeros past N); and each
    16 tokens' groups' factors (tiles, groups, 16): offset times the quants' sum (int32), scale,
    and the minimum's multiplier (float32)."""
    tokens, width = x.shape
    activations = activation_arrays(x, kind + Q8_READS)
    tiles, groups = (tokens + 15) // 16, width // group
    laid = np.zeros((tiles, width // 4, 64), np.int8)
    offsets = np.zeros((tiles, groups, 16), np.int32)
    scales = np.zeros((tiles, groups, 16), np.float32)
    shifts = np.zeros((tiles, groups, 16), np.float32)
    for t in prange(tiles):
        for j in range(min(16, tokens - 16 * t)):
            n = 16 * t + j
            quantize_row(x, kind + Q8_READS, n, activations)
            for k in range(width):
                laid[t, k >> 2, 4 * j + (k & 3)] = activations[0][n, k]
            for g in range(groups):
                scale, total, shift = activation_factors(kind, activations, n, g, group)
                offsets[t, g, j] = VALUE_OFFSETS[kind] * np.int32(total)
                scales[t, g, j], shifts[t, g, j] = scale, shift
    return laid, offsets, scales, shifts


@numba.njit(parallel=True, **_KERNEL)
def tiles_product(w, kind, x, start, out):  # pragma: no cover (compiled)
    """out[:, start : start + rows] = x (N, in) times the weight w (rows, row bytes) of stored
    code `kind`, transposed, x quantized as llama.cpp's products read it: 16 weight rows a task
    (the last task's missing rows repeat its last row, written once), unpacked once, then each
    16 rows of x group by group on the tiles (see the module docstring). Call `usable()` first."""
    group = 16 if kind in _SIXTEENS else 32
    laid, offsets, x_scales, x_shifts = activation_tiles(x, kind, group)
    rows, width, tokens = w.shape[0], x.shape[1], x.shape[0]
    groups = width // group
    for task in prange((rows + 15) // 16):
        first = task * 16
        values = np.empty((16, width), np.uint8)
        scales = np.empty((16, groups), np.float32)
        minimums = np.empty((16, groups), np.float32)
        for r in range(0, 16, 4):
            i = [min(first + r + q, rows - 1) for q in range(4)]
            unpack_rows_of_kind(w, kind, i[0], i[1], i[2], i[3], values[r : r + 4])
        for r in range(16):
            weight_factors(w, kind, min(first + r, rows - 1), r, scales, minimums)
        tile_config(configured(group))
        found = np.empty((16, 16), np.float32)
        for t in range(laid.shape[0]):
            tile = (values, laid[t], offsets[t], x_scales[t], x_shifts[t], scales, minimums)
            if kind in _MINIMUMS:
                tile_groups(*tile, group, found)
            else:
                tile_groups_scaled(*tile, group, found)
            for r in range(min(16, rows - first)):
                for j in range(min(16, tokens - 16 * t)):
                    out[16 * t + j, start + first + r] = found[r, j]
        tile_release()
