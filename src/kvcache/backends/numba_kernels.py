"""The numba kernels of a one-row decode step: its products, and a layer in two calls.

Imported only through `numba_products` (which imports it on first use), so importing kvcache
never loads numba. Every kernel works on one row of float32 values; a weight is a tuple of parts
stacked along its output, each (out_i, in) row-major: float32, or a half-precision matrix viewed
as its bits (`numba_products.half_bits`; numba has no bfloat16 or float16 values): bfloat16 as
uint16 (widened by a shift: a bfloat16 is a float32's upper half), float16 as int16 (widened by
the CPU's half-precision conversion); numba compiles one version per kind. Stored keys and values
come the same three ways. `rounding` (NONE, BFLOAT16, FLOAT16) says what a product rounds its input
and its output (its bias added) to, as oneDNN's and torch's half-precision products do; the
arithmetic between products stays float32. An absent bias or norm is an empty array.

Floating point: reassociation and contraction are allowed (the dot products' sums are
vectorised in any order, as a BLAS sums them); infinities and NaNs keep their meaning (a masked
key's score is -inf; exp(-g) of a very negative gate is inf, making silu -0).

Each layer is two calls around the cache's update (`attention_inputs`: norm, q/k/v, the per-head
norms, RoPE, the queries' scale; `layer_output`: attention over the stored keys and values, o,
residual, norm, gate/up, SiLU, down, residual), so what a step costs between its products is two
calls a layer rather than a dozen numpy operations. The products' rows and the attention's heads
are split between numba's threads.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import prange
from numba.extending import intrinsic, overload

#: the fast-math flags: no "nnan"/"ninf", so -inf and inf behave as IEEE says
FLAGS = {"reassoc", "contract", "arcp", "nsz"}
#: only explicit prange loops run in parallel: numba would otherwise make every array expression
#: (np.zeros, a slice assignment) a parallel region of its own, each costing a thread hand-off
PARALLEL = {name: name == "prange" for name in (
    "comprehension", "reduction", "inplace_binop", "setitem", "numpy", "stencil", "fusion", "prange"
)}
#: error_model "numpy": a division by zero gives inf or nan, as numpy and torch give, not an error
KERNEL = dict(parallel=PARALLEL, fastmath=FLAGS, error_model="numpy", cache=True, boundscheck=False)
_HIGH = np.uint32(0xFFFF0000)
#: what a product rounds its input and output to (the weights' dtype)
NONE, BFLOAT16, FLOAT16 = 0, 1, 2


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


@numba.njit(cache=True, inline="always")
def bfloat16_bits(b):  # pragma: no cover (compiled: coverage cannot see inside)
    """float32 bits b rounded to bfloat16 (to nearest, ties to even), as float32 bits; a NaN
    stays a NaN (quieted, its upper half kept)."""
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return (b | np.uint32(0x00400000)) & _HIGH
    tie_to_even = (b >> np.uint32(16)) & np.uint32(1)
    return (b + np.uint32(0x7FFF) + tie_to_even) & _HIGH


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


@numba.njit(fastmath=FLAGS, cache=True, boundscheck=False)
def row_dot(weight, i, x):  # pragma: no cover (compiled)
    """weight[i] · x (in,) in float32, weight (out, in) float32 or half-precision bits."""
    total = np.float32(0.0)
    for j in range(weight.shape[1]):
        total += widened(weight[i, j]) * x[j]
    return total


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def round_in_place(x, rounding):  # pragma: no cover (compiled)
    """x (n,) float32 rounded in place to bfloat16 or float16 (as `rounding` says), kept float32."""
    if rounding == BFLOAT16:
        bits = x.view(np.uint32)
        round_to_bfloat16(bits, bits)
    elif rounding == FLOAT16:
        for i in range(x.shape[0]):
            x[i] = float16_widened(float16_rounded(x[i]))


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def product(parts, x, bias, rounding, out):  # pragma: no cover (compiled)
    """out (sum out_i,) = the parts stacked along out @ x (in,) (+ bias), each output one dot
    product of a weight row, the rows split between the threads; x and the output rounded as
    `rounding` says."""
    if rounding != NONE:
        x = x.copy()
        round_in_place(x, rounding)
    start = 0
    for part in parts:
        rows = part.shape[0]
        for i in prange(rows):
            out[start + i] = row_dot(part, i, x)
        start += rows
    if bias.shape[0]:
        for i in range(out.shape[0]):
            out[i] += bias[i]
    round_in_place(out, rounding)


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def rms_normed(x, weight, eps, out):  # pragma: no cover (compiled)
    """out (n,) = x (n,) / rms(x) * weight (n,)."""
    squares = np.float32(0.0)
    for i in range(x.shape[0]):
        squares += x[i] * x[i]
    inverse = np.float32(1.0 / np.sqrt(squares / x.shape[0] + eps))
    for i in range(x.shape[0]):
        out[i] = x[i] * weight[i] * inverse


@numba.njit(**KERNEL)
def normed_product(x, norm, eps, parts, bias, rounding, out):  # pragma: no cover (compiled)
    """out = product(parts, rms_normed(x, norm), bias): the final norm and lm_head."""
    normed = np.empty(x.shape[0], np.float32)
    rms_normed(x, norm, eps, normed)
    product(parts, normed, bias, rounding, out)


@numba.njit(**KERNEL)
def stacked_product(parts, x, bias, rounding, out):  # pragma: no cover (compiled)
    """out = product(parts, x, bias) (see `product`), on its own."""
    product(parts, x, bias, rounding, out)


@numba.njit(**KERNEL)
def attention_inputs(
    x, norm, eps, parts, bias, q_norm, k_norm, cos, signed_sin, scale, heads, kv_heads, rounding, qkv
):  # pragma: no cover (compiled)
    """qkv ((H + 2·H_kv)·D,) = one row's queries, keys and values: x (hidden,) normed, through
    the fused q/k/v product (+ bias), each q and k head normed (q_norm, k_norm (D,) or empty),
    turned by RoPE (x_i·cos_i + x_{(i + D/2) mod D}·signed_sin_i, cos and signed_sin (D,) of the
    row's position) and the queries multiplied by `scale`."""
    normed = np.empty(x.shape[0], np.float32)
    rms_normed(x, norm, eps, normed)
    product(parts, normed, bias, rounding, qkv)
    dim = cos.shape[0]
    half = dim // 2
    turned = np.empty(dim, np.float32)
    for head in range(heads + kv_heads):
        at = qkv[head * dim:(head + 1) * dim]
        if q_norm.shape[0]:
            rms_normed(at, q_norm if head < heads else k_norm, eps, turned)
            for i in range(dim):
                at[i] = turned[i]
        factor = scale if head < heads else np.float32(1.0)
        for i in range(dim):
            turned[i] = at[i] * cos[i] + at[(i + half) % dim] * signed_sin[i]
        for i in range(dim):
            at[i] = turned[i] * factor


#: keys one attention task scores: a kv head's keys are split into chunks of this many, scored
#: in parallel and their softmax parts combined (as flash attention does), so a long cache keeps
#: every thread busy whatever the number of kv heads
CHUNK = 128


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def attend(
    qkv, heads, kv_heads, keys, key_step, values, value_step, length, visible, key_rounding, out
):  # pragma: no cover (compiled)
    """out (H·D,) = each query head of qkv's over its kv head's `length` keys and values:
    softmax(q·kᵀ)·V, the keys where visible (T,) is False (when not empty) scored -inf. keys and
    values are rows (R, D), float32, bfloat16 bits (uint16) or float16 bits (int16), kv head h's key t at row
    h·key_step + t (its value at h·value_step + t). Each (kv head, CHUNK keys) is one task for
    the threads, its group of queries scored together; the tasks' softmax parts are combined as
    flash attention combines them. The queries are rounded first as `key_rounding` says (the
    keys' dtype), as the torch forward's attention in that dtype reads them."""
    dim = keys.shape[1]
    group = heads // kv_heads
    chunks = (length + CHUNK - 1) // CHUNK
    queries = np.empty((heads, dim), np.float32)
    for h in range(heads):
        for d in range(dim):
            queries[h, d] = qkv[h * dim + d]
    round_in_place(queries.reshape(heads * dim), key_rounding)
    tops = np.empty((kv_heads, chunks, group), np.float32)  # each task's top score per query
    sums = np.empty((kv_heads, chunks, group), np.float32)  # its sum of exp(score - top)
    parts = np.empty((kv_heads, chunks, group, dim), np.float32)  # its sum of exp(...)·value
    for task in prange(kv_heads * chunks):
        kv = task // chunks
        chunk = task % chunks
        lo = chunk * CHUNK
        count = min(length, lo + CHUNK) - lo
        first_key = kv * key_step + lo  # the chunk's first rows
        first_value = kv * value_step + lo
        group_queries = queries[kv * group:(kv + 1) * group]
        scores = np.empty((count, group), np.float32)
        for t in range(count):  # each key read once for the group's queries
            if visible.shape[0] == 0 or visible[lo + t]:
                key = keys[first_key + t]
                for g in range(group):
                    score = np.float32(0.0)
                    for d in range(dim):
                        score += group_queries[g, d] * widened(key[d])
                    scores[t, g] = score
            else:
                for g in range(group):
                    scores[t, g] = -np.inf
        for g in range(group):
            top = np.float32(-np.inf)
            for t in range(count):
                top = max(top, scores[t, g])
            total = np.float32(0.0)
            for t in range(count):  # (every key of the chunk masked: weights 0, not nan)
                weight = np.exp(scores[t, g] - top) if top != -np.inf else np.float32(0.0)
                scores[t, g] = weight
                total += weight
            tops[kv, chunk, g] = top
            sums[kv, chunk, g] = total
        summed = np.zeros((group, dim), np.float32)
        for t in range(count):  # each value read once for the group's queries
            value = values[first_value + t]
            for g in range(group):
                weight = scores[t, g]
                if weight != 0.0:  # (a masked key's value is never read: it may be unwritten)
                    for d in range(dim):
                        summed[g, d] += weight * widened(value[d])
        for g in range(group):
            for d in range(dim):
                parts[kv, chunk, g, d] = summed[g, d]
    for head in range(heads):  # the chunks' parts, rescaled to the head's top score, summed
        kv = head // group
        g = head % group
        top = np.float32(-np.inf)
        for chunk in range(chunks):
            top = max(top, tops[kv, chunk, g])
        total = np.float32(0.0)
        for d in range(dim):
            out[head * dim + d] = 0.0
        for chunk in range(chunks):  # (every key masked: top -inf, the output nan, as torch's)
            factor = np.exp(tops[kv, chunk, g] - top)
            total += factor * sums[kv, chunk, g]
            for d in range(dim):
                out[head * dim + d] += factor * parts[kv, chunk, g, d]
        for d in range(dim):
            out[head * dim + d] /= total


@numba.njit(**KERNEL)
def layer_output(
    x, qkv, heads, kv_heads, keys, key_step, values, value_step, length, visible, key_rounding,
    o, o_bias, norm, eps, gate_up, gate_up_bias, down, down_bias, rounding,
):  # pragma: no cover (compiled)
    """x (hidden,) += the layer's attention output through o (+ bias), then += the SwiGLU of
    its norm (gate/up stacked: gate's outputs, then up's; silu(gate)·up through down), in
    place; qkv, keys, values, their steps, length, visible and key_rounding as `attend` reads them."""
    hidden = x.shape[0]
    attended = np.empty(heads * keys.shape[1], np.float32)
    attend(qkv, heads, kv_heads, keys, key_step, values, value_step, length, visible, key_rounding, attended)
    projected = np.empty(hidden, np.float32)
    product(o, attended, o_bias, rounding, projected)
    for i in range(hidden):
        x[i] += projected[i]
    normed = np.empty(hidden, np.float32)
    rms_normed(x, norm, eps, normed)
    inner = 0
    for part in gate_up:
        inner += part.shape[0]
    both = np.empty(inner, np.float32)
    product(gate_up, normed, gate_up_bias, rounding, both)
    inner //= 2
    act = np.empty(inner, np.float32)
    for i in range(inner):
        gate = both[i]
        act[i] = gate / (np.float32(1.0) + np.exp(-gate)) * both[inner + i]
    product(down, act, down_bias, rounding, projected)
    for i in range(hidden):
        x[i] += projected[i]


@numba.njit(**KERNEL)
def matvec_check(weight, x, out):  # pragma: no cover (compiled)
    """out (n,) = weight (n, k) @ x (k,): a tiny parallel loop `available` runs to start numba's
    pool and read which threading layer it got."""
    for i in prange(weight.shape[0]):
        out[i] = row_dot(weight, i, x)
