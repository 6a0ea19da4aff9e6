"""How the numba kernels (`numba_kernels`) read, write and round the values they work on: float32
as it is, bfloat16 as its bits (uint16: a float32's upper half, widened by a shift), float16 as
its bits (int16, widened and narrowed by the CPU's half-precision conversion through an LLVM
intrinsic); numba has no bfloat16 or float16 values. Also the compile options every kernel
shares. Imported only with the kernels (numba is loaded then)."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic, overload

#: the fast-math flags: no "nnan"/"ninf", so -inf and inf behave as IEEE says
FLAGS = {"reassoc", "contract", "arcp", "nsz"}
#: only explicit prange loops run in parallel: numba would otherwise make every array expression
#: (np.zeros, a slice assignment) a parallel region of its own, each costing a thread hand-off
PARALLEL = {name: name == "prange" for name in (
    "comprehension", "reduction", "inplace_binop", "setitem", "numpy", "stencil", "fusion", "prange"
)}
#: error_model "numpy": a division by zero gives inf or nan, as numpy and torch give, not an error
#: nogil: a kernel lets go of the GIL while it runs, so a server's event loop streams meanwhile
KERNEL = dict(
    parallel=PARALLEL, fastmath=FLAGS, error_model="numpy", cache=True, boundscheck=False, nogil=True
)
#: a kernel of one thread (its work is a pass over N rows, no parallel loop)
SERIAL = dict(fastmath=FLAGS, error_model="numpy", cache=True, boundscheck=False, nogil=True)
_HIGH = np.uint32(0xFFFF0000)
#: what a product rounds its input and output to (the weights' dtype)
NONE, BFLOAT16, FLOAT16 = 0, 1, 2


@numba.njit(fastmath=False, error_model="numpy")
def quotient(numerator, denominator):  # pragma: no cover (compiled)
    """numerator / denominator rounded once, as IEEE (and torch) divide. Compiled without the
    kernels' fast-math: its reciprocal (x · (1 / s)) would move a code or a scale one step from
    the seam's (or llama.cpp's) at a rounding tie; LLVM keeps these flags per instruction,
    inlined or not."""
    return numerator / denominator


@intrinsic
def float16_widened(typingctx, half):  # pragma: no cover (compiled)
    """A float16 given as its bits (uint16 or int16) as float32, exactly (one instruction)."""
    if half not in (numba.types.uint16, numba.types.int16):
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return numba.types.float32(half), codegen


@intrinsic
def float16_rounded(typingctx, value):  # pragma: no cover (compiled)
    """float32 rounded to the nearest float16 (ties to even; beyond its range ±inf), as its
    bits (uint16), as torch and numpy round."""
    if value != numba.types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return numba.types.uint16(value), codegen


@intrinsic
def prefetch(typingctx, array, index):  # pragma: no cover (compiled)
    """Ask the CPU to bring the cache line holding array[index] (a 1-d array) into its caches for
    reading (LLVM's prefetch: a hint, never a fault)."""
    if not isinstance(array, numba.types.Array) or array.ndim != 1:
        return None
    if not isinstance(index, numba.types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        word = ir.IntType(32)
        hint = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [address.type, word, word, word])
        )
        # read (0), keep in every cache level (3), data (1)
        builder.call(hint, [address, ir.Constant(word, 0), ir.Constant(word, 3), ir.Constant(word, 1)])
        return context.get_dummy_value()

    return numba.types.void(array, numba.types.intp), codegen


@numba.njit(cache=True, inline="always")
def bfloat16_bits(b):  # pragma: no cover (compiled: coverage cannot see inside)
    """float32 bits b rounded to bfloat16 (to nearest, ties to even), as float32 bits; a NaN
    stays a NaN (quieted, its upper half kept)."""
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return (b | np.uint32(0x00400000)) & _HIGH
    tie_to_even = (b >> np.uint32(16)) & np.uint32(1)
    return (b + np.uint32(0x7FFF) + tie_to_even) & _HIGH


@numba.njit(cache=True, inline="always")
def bfloat16_half(value):  # pragma: no cover (compiled)
    """float32 `value` rounded to bfloat16 (to nearest, ties to even), as its bits (uint16)."""
    bits = np.float32(value).view(np.uint32)
    return np.uint16(bfloat16_bits(bits) >> np.uint32(16))


@numba.njit(cache=True, boundscheck=False)
def round_to_bfloat16(bits, out):  # pragma: no cover (compiled)
    """out (n,) uint32 = float32 bits (n,) rounded to bfloat16, as float32 bits."""
    for i in range(bits.shape[0]):
        out[i] = bfloat16_bits(bits[i])


@numba.njit(cache=True, boundscheck=False)
def bfloat16_halves(bits, out):  # pragma: no cover (compiled)
    """out (n,) uint16 = float32 bits (n,) rounded to bfloat16: the bfloat16 values' own bits."""
    for i in range(bits.shape[0]):
        out[i] = np.uint16(bfloat16_bits(bits[i]) >> np.uint32(16))


def widened(value):  # typed by the overload below
    """A weight, key or value as float32: float32 as it is, bfloat16 bits (uint16) and float16
    bits (int16) widened."""
    raise NotImplementedError


@overload(widened, inline="always")
def _widened(value):  # pragma: no cover (compiled)
    if value == numba.types.float32:
        return lambda value: value
    if value == numba.types.uint16:
        return lambda value: np.uint32(np.uint32(value) << np.uint32(16)).view(np.float32)
    if value == numba.types.int16:
        return lambda value: float16_widened(value)
    return None


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def round_in_place(x, rounding):  # pragma: no cover (compiled)
    """x (n,) float32 rounded in place to bfloat16 or float16 (as `rounding` says), kept float32."""
    if rounding == BFLOAT16:
        bits = x.view(np.uint32)
        round_to_bfloat16(bits, bits)
    elif rounding == FLOAT16:
        for i in range(x.shape[0]):
            x[i] = float16_widened(float16_rounded(x[i]))


def narrowed(value, like):  # typed by the overload below
    """A float32 value as a stored key or value of `like`'s type: float32 as it is, bfloat16
    bits (uint16) and float16 bits (int16) rounded to nearest (ties to even)."""
    raise NotImplementedError


@overload(narrowed)
def _narrowed(value, like):  # pragma: no cover (compiled)
    if like == numba.types.float32:
        return lambda value, like: value
    if like == numba.types.uint16:
        return lambda value, like: bfloat16_half(value)
    if like == numba.types.int16:
        return lambda value, like: np.int16(float16_rounded(np.float32(value)))
    return None
