"""Products of many activation rows with ggml blocks on the CPU's matrix unit (AMX tiles): each
group of 32 values (16 for the formats scaled every 16) of 16 weight rows times 16 activation
rows in one `tdpbusd`, the exact integer sums then added block after block in the one-row dots'
arithmetic (`numba_q8._block_accumulated`): a row's outputs are the same to the bit here, on the
one-row dots and whatever rows stand beside it. Usable once the kernel grants the process the
tiles (`usable`). Imported only with the kernels.

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
from kvcache.backends.cpu.numba_q8 import D_BYTES, MINIMUM_BYTES, VALUE_OFFSETS
from kvcache.backends.cpu.numba_values import FLAGS

_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
# the tile instructions are inline assembly, which LLVM reads with the host's assembly parser:
# every kernel that can call `tiles_product` needs it to compile (`compiled_here`)
binding.initialize_native_asmparser()
#: the formats whose scales step every 16 values (the others' every 32)
_SIXTEENS = (Q6_K, Q3_K, Q2_K)
_I64, _I32, _F32 = ir.IntType(64), ir.IntType(32), ir.FloatType()


@functools.cache
def compiled_here() -> bool:
    """Whether kernels here carry the tile products: an x86-64 Linux CPU with AMX's tiles and
    8-bit dots (their inline assembly is x86's; elsewhere the kernels leave them out)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    features = binding.get_host_cpu_features()
    return bool(features.get("amx-tile") and features.get("amx-int8"))


@functools.cache
def usable() -> bool:
    """Whether this process may run the tile products: `compiled_here`, and the tiles' state
    granted by the kernel (asked once here)."""
    if not compiled_here():
        return False
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
    return syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


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


#: the formats whose blocks add a minimum counted in integers (-dmin times Σ min·Σq_x), and those
#: adding their float16 minimum times the activations' s (Q8_1's): as `numba_q8` adds them
_COUNTED, _DIRECT = (Q4_K, Q5_K, Q2_K), (Q4_1, Q5_1)
_I16, _F16 = ir.VectorType(ir.IntType(32), 16), ir.VectorType(_F32, 16)  # (16 lanes of each)


def _blocks_intrinsic(kind: int):
    """The intrinsic (values, laid, losses, counts, x_scales, x_shifts, sub_scales, sub_minimums,
    d, m, found) of `kind`: found (16, 16) float32 = 16 weight rows' values (16, in) uint8 times
    16 tokens' laid activations (in / 4, 64) int8 (`activation_tiles`, one tile's), block after
    block in `numba_q8._block_accumulated`'s arithmetic: each group's 16×16 integer sums
    (`tdpbusd`) less the tokens' offset losses[g] (groups, 16) int32, times the rows' integer
    sub_scales (16, groups) (K-quants), summed over the block's groups into I; the counted
    minimum M = Σ sub_minimums·counts (int32; Q4_K, Q5_K, Q2_K); then acc = fma(I, d·d_x, acc)
    and acc = fma(M, m·d_x, acc) (m: -dmin) or fma(m, s_x, acc) (Q4_1, Q5_1: m the rows'
    minimum, s_x x_shifts (blocks, 16)), acc the even blocks' sum or the odd's, the two added at
    the end; d, m (16, blocks), x_scales (blocks, 16) float32."""

    def tile_blocks(typingctx, values, laid, losses, counts, x_scales, x_shifts, sub_scales, sub_minimums,
                    d, m, found):
        signature = numba.types.none(values, laid, losses, counts, x_scales, x_shifts, sub_scales,
                                     sub_minimums, d, m, found)
        return signature, functools.partial(_blocks_codegen, kind)

    tile_blocks.__name__ = f"tile_blocks_{kind}"
    return intrinsic(tile_blocks)


def _blocks_codegen(kind, context, builder, signature, args):
    """`_blocks_intrinsic`'s code."""
    arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args)]
    data = [builder.bitcast(a.data, ir.IntType(8).as_pointer()) for a in arrays]
    values, laid, losses, counts, x_scales, x_shifts, sub_scales, sub_minimums, d, m, found = data
    group = 16 if kind in _SIXTEENS else 32
    per_block = 256 // group if kind >= Q4_K else 1
    width, blocks = builder.extract_value(arrays[0].shape, 1), builder.extract_value(arrays[8].shape, 1)
    groups = builder.mul(blocks, ir.Constant(_I64, per_block))
    with builder.goto_entry_block():
        sums = builder.alloca(ir.ArrayType(_I16, 16))  # (the tile's 16 rows of 16 int32)
        sums.align = 64
    sums_of = [[cgutils.alloca_once_value(builder, ir.Constant(_F16, [0.0] * 16)) for _ in range(16)]
               for _ in range(2)]  # (each row's sums of the even blocks, and of the odd)
    loses = VALUE_OFFSETS[kind] != 0
    with cgutils.for_range(builder, blocks) as loop:
        b = loop.index
        integers, minimums = [None] * 16, [None] * 16
        for within in range(per_block):
            g = builder.add(builder.mul(b, ir.Constant(_I64, per_block)), ir.Constant(_I64, within))
            at = builder.mul(g, ir.Constant(_I64, group))
            _tile_dot(builder, builder.gep(values, [at]), width,
                      builder.gep(laid, [builder.mul(at, ir.Constant(_I64, 16))]),
                      builder.bitcast(sums, ir.IntType(8).as_pointer()))
            lanes_at = builder.mul(g, ir.Constant(_I64, 64))  # (bytes of a group's 16 int32)
            loss = _vector(builder, losses, lanes_at, _I16) if loses else None
            count = _vector(builder, counts, lanes_at, _I16) if kind in _COUNTED else None
            for r in range(16):
                row = builder.load(builder.gep(sums, [ir.Constant(_I64, 0), ir.Constant(_I64, r)]))
                row = builder.sub(row, loss) if loss is not None else row
                weight_at = _row_major(builder, r, groups, g)
                if kind >= Q4_K:
                    row = builder.mul(row, _splat(builder, _scalar(builder, sub_scales, weight_at, _I32)))
                integers[r] = row if within == 0 else builder.add(integers[r], row)
                if count is not None:
                    minimum = _scalar(builder, sub_minimums, weight_at, _I32)
                    share = builder.mul(count, _splat(builder, minimum))
                    minimums[r] = share if within == 0 else builder.add(minimums[r], share)
        odd = builder.trunc(b, ir.IntType(1))
        totals = [builder.select(odd, sums_of[1][r], sums_of[0][r]) for r in range(16)]
        _blocks_into(builder, kind, b, blocks, integers, minimums, (x_scales, x_shifts, d, m), totals)
    for r in range(16):
        target = builder.bitcast(builder.gep(found, [ir.Constant(_I64, 64 * r)]), _F16.as_pointer())
        total = builder.fadd(builder.load(sums_of[0][r]), builder.load(sums_of[1][r]))
        builder.store(total, target).align = 4
    return context.get_dummy_value()


def _blocks_into(builder, kind, b, blocks, integers, minimums, factors, totals) -> None:
    """Block b's fused multiply-adds into each row's totals (see `_blocks_intrinsic`)."""
    x_scales, x_shifts, d, m = factors
    lanes_at = builder.mul(b, ir.Constant(_I64, 64))
    x_scale = _vector(builder, x_scales, lanes_at, _F16)
    x_shift = _vector(builder, x_shifts, lanes_at, _F16) if kind in _DIRECT else None
    for r in range(16):
        weight_at = _row_major(builder, r, blocks, b)
        step = builder.fmul(_splat(builder, _scalar(builder, d, weight_at)), x_scale)
        total = _fma(builder, builder.sitofp(integers[r], _F16), step, builder.load(totals[r]))
        if kind in _COUNTED:
            factor = builder.fmul(_splat(builder, _scalar(builder, m, weight_at)), x_scale)
            total = _fma(builder, builder.sitofp(minimums[r], _F16), factor, total)
        elif kind in _DIRECT:
            total = _fma(builder, _splat(builder, _scalar(builder, m, weight_at)), x_shift, total)
        builder.store(total, totals[r])


def _row_major(builder, r: int, columns, column):
    """The byte of [r, column] of a (16, columns) array of 4-byte elements."""
    return builder.mul(builder.add(builder.mul(ir.Constant(_I64, r), columns), column), ir.Constant(_I64, 4))


def _fma(builder, a, b, c):
    """a·b + c rounded once, lane by lane (llvm.fma), as `numba_q8` adds a block."""
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F16, [_F16] * 3),
                                              "llvm.fma.v16f32")
    return builder.call(function, [a, b, c])


(blocks_0, blocks_1, blocks_2, blocks_3, blocks_4, blocks_5, blocks_6, blocks_7, blocks_8,
 blocks_9) = (_blocks_intrinsic(kind) for kind in range(10))


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


def _scalar(builder, pointer, at, kind=_F32):
    """The float32 (or `kind`) at byte `at` of an i8 pointer."""
    return builder.load(builder.bitcast(builder.gep(pointer, [at]), kind.as_pointer()))


def _splat(builder, value):
    """A scalar in all 16 lanes."""
    undefined = ir.Constant(ir.VectorType(value.type, 16), ir.Undefined)
    lanes = builder.insert_element(undefined, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(lanes, undefined, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))


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
def weight_factors(w, kind, i, r, sub_scales, sub_minimums, d, m):  # pragma: no cover (compiled)
    """Row r of the factors (16, groups) int32 and (16, blocks) float32 from weight row i of
    `kind`, as `numba_q8`'s dots read them: each group's integer scale and minimum (K-quants),
    each block's d and m (-dmin for Q4_K, Q5_K, Q2_K; Q4_1's and Q5_1's minimum; else 0)."""
    size = BLOCK_BYTES[kind]
    for b in range(d.shape[1]):
        at = b * size
        d[r, b] = half_at(w, i, at + D_BYTES[kind])
        m[r, b] = np.float32(0.0) if MINIMUM_BYTES[kind] < 0 else half_at(w, i, at + MINIMUM_BYTES[kind])
        if kind in _COUNTED:
            m[r, b] = -m[r, b]
        if kind == Q4_K or kind == Q5_K:
            for s in range(8):
                scale, low = k_scale_min(w, i, at + 4, s)
                sub_scales[r, 8 * b + s], sub_minimums[r, 8 * b + s] = np.int32(scale), np.int32(low)
        elif kind in _SIXTEENS:
            for j in range(16):
                sub_scales[r, 16 * b + j], sub_minimums[r, 16 * b + j] = sixteen_factors(w, kind, i, at, j)


@numba.njit(**_INLINE)
def sixteen_factors(w, kind, i, at, j):  # pragma: no cover (compiled)
    """Q6_K's, Q3_K's or Q2_K's integer scale and minimum of 16-value group j of the block at
    `at` of row i (`numba_blocks.two_bit_scale_min`'s; Q6_K's int8 scale, minimum 0)."""
    if kind == Q6_K:
        return np.int32(np.int8(w[i, at + 192 + j])), np.int32(0)
    scale, low = two_bit_scale_min(w, kind, i, at, j)
    return np.int32(scale), np.int32(low)


@numba.njit(**_INLINE)
def group_count(kind, counts, n, g, group):  # pragma: no cover (compiled)
    """The sum of token n's quants in group g of `group` values (Q8_K's counts are of 16)."""
    if kind < Q4_K or group == 16:
        return np.int32(counts[n, g])
    return np.int32(counts[n, 2 * g]) + np.int32(counts[n, 2 * g + 1])


@numba.njit(parallel=True, **_KERNEL)
def activation_tiles(x, kind, group):  # pragma: no cover (compiled)
    """x (N, in) quantized as llama.cpp's products read it, laid out for tile 2: (tiles, in / 4,
    64) int8, token 16t + j's values 4k..4k + 3 at [t, k, 4j : 4j + 4] (zeros past N); each 16
    tokens' groups' offset losses (the format's offset times the quants' sum) and sums (tiles,
    groups, 16) int32; their blocks' scales d_x and Q8_1 s_x (tiles, blocks, 16) float32."""
    tokens, width = x.shape
    activations = activation_arrays(x, kind + Q8_READS)
    tiles, groups, blocks = (tokens + 15) // 16, width // group, activations[1].shape[1]
    laid = np.zeros((tiles, width // 4, 64), np.int8)
    losses = np.zeros((tiles, groups, 16), np.int32)
    counts = np.zeros((tiles, groups, 16), np.int32)
    scales = np.zeros((tiles, blocks, 16), np.float32)
    shifts = np.zeros((tiles, blocks, 16), np.float32)
    for t in prange(tiles):
        for j in range(min(16, tokens - 16 * t)):
            n = 16 * t + j
            quantize_row(x, kind + Q8_READS, n, activations)
            for k in range(width):
                laid[t, k >> 2, 4 * j + (k & 3)] = activations[0][n, k]
            for g in range(groups):
                counts[t, g, j] = group_count(kind, activations[2], n, g, group)
                losses[t, g, j] = VALUE_OFFSETS[kind] * counts[t, g, j]
            for b in range(blocks):
                scales[t, b, j] = activations[1][n, b]
                shifts[t, b, j] = activations[3][n, b] if kind == Q4_1 or kind == Q5_1 else np.float32(0.0)
    return laid, losses, counts, scales, shifts


@numba.njit(**_INLINE)
def tile_blocks(kind, v, laid, lo, co, xs, sh, ws, wm, d, m, found):  # pragma: no cover (compiled)
    """`_blocks_intrinsic(kind)`'s product: its arguments in its order."""
    if kind == 0:
        blocks_0(v, laid, lo, co, xs, sh, ws, wm, d, m, found)
    elif kind == 1:
        blocks_1(v, laid, lo, co, xs, sh, ws, wm, d, m, found)
    elif kind == 2:
        blocks_2(v, laid, lo, co, xs, sh, ws, wm, d, m, found)
    elif kind == 3:
        blocks_3(v, laid, lo, co, xs, sh, ws, wm, d, m, found)
    elif kind == 4:
        blocks_4(v, laid, lo, co, xs, sh, ws, wm, d, m, found)
    elif kind == 5:
        blocks_5(v, laid, lo, co, xs, sh, ws, wm, d, m, found)
    elif kind == 6:
        blocks_6(v, laid, lo, co, xs, sh, ws, wm, d, m, found)
    elif kind == 7:
        blocks_7(v, laid, lo, co, xs, sh, ws, wm, d, m, found)
    elif kind == 8:
        blocks_8(v, laid, lo, co, xs, sh, ws, wm, d, m, found)
    else:
        blocks_9(v, laid, lo, co, xs, sh, ws, wm, d, m, found)


@numba.njit(parallel=True, **_KERNEL)
def tiles_product(w, kind, x, start, out):  # pragma: no cover (compiled)
    """out[:, start : start + rows] = x (N, in) times the weight w (rows, row bytes) of stored
    code `kind`, transposed, x quantized as llama.cpp's products read it: 16 weight rows a task
    (the last task's missing rows repeat its last row, written once), unpacked once, then each
    16 rows of x block by block on the tiles (see the module docstring). Call `usable()` first."""
    group = 16 if kind in _SIXTEENS else 32
    laid, losses, counts, x_scales, x_shifts = activation_tiles(x, kind, group)
    rows, width, tokens = w.shape[0], x.shape[1], x.shape[0]
    groups, blocks = width // group, x_scales.shape[1]
    for task in prange((rows + 15) // 16):
        first = task * 16
        values = np.empty((16, width), np.uint8)
        sub_scales, sub_minimums = np.zeros((16, groups), np.int32), np.zeros((16, groups), np.int32)
        d, m = np.empty((16, blocks), np.float32), np.empty((16, blocks), np.float32)
        for r in range(0, 16, 4):
            i = [min(first + r + q, rows - 1) for q in range(4)]
            unpack_rows_of_kind(w, kind, i[0], i[1], i[2], i[3], values[r : r + 4])
        for r in range(16):
            weight_factors(w, kind, min(first + r, rows - 1), r, sub_scales, sub_minimums, d, m)
        tile_config(configured(group))
        found = np.empty((16, 16), np.float32)
        for t in range(laid.shape[0]):
            tile_blocks(kind, values, laid[t], losses[t], counts[t], x_scales[t], x_shifts[t],
                        sub_scales, sub_minimums, d, m, found)
            for r in range(min(16, rows - first)):
                for j in range(min(16, tokens - 16 * t)):
                    out[16 * t + j, start + first + r] = found[r, j]
        tile_release()
