"""The numba kernels of a decode step of N rows (tokens): its products, a layer in two calls, and
attention that reads stored keys and values in place through a block table: token t of table row
r, kv head h, sits at row (tables[r, t // S]·S + t % S)·token_stride + h·head_stride of the
stored keys. Weights are tuples of row-major parts, float32 or half precision read as its bits,
or ggml blocks (`numba_blocks`).

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
numba_kernels.py.
"""

from __future__ import annotations

import warnings

import numba
import numpy as np
from numba import prange, types
from numba.core import event
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import overload

# numba's disk cache keys a kernel on its own file only, and the kernels here carry compiled
# copies of `numba_blocks` (and its `numba_q8`), `numba_amx` and `numba_rows`: a change there
# needs a change here (or the `__pycache__` cleared) for a checkout to recompile them
# (numba_blocks.py needs one for numba_q8 too; the last such change:
# numba_blocks, numba_q8 and numba_amx: one K-quant integer sum for one row or two; then here:
# one SwiGLU, `swiglu_row`, in the layer kernel and a long step's)
from kvcache.backends.cpu.numba_amx import compiled_here, tiles_product
from kvcache.backends.cpu.numba_blocks import Q8_READS, TILE_READS, blocks_product
from kvcache.backends.cpu.numba_rows import accumulated, scored, stored
from kvcache.backends.cpu.numba_values import (  # noqa: F401 (NONE, BFLOAT16, FLOAT16: read from here too)
    BFLOAT16,
    FLAGS,
    FLOAT16,
    KERNEL,
    NONE,
    PARALLEL,
    SERIAL,
    bfloat16_halves,
    round_in_place,
    widened,
)

#: numba's note that parallel=True found nothing to parallelize (`QuietCompiles`)
_NOTHING_PARALLEL = r"\s*The keyword argument 'parallel=True' was specified but no transformation"


class QuietCompiles(event.Listener):
    """While one of kvcache's kernels compiles (an install's first run), two of numba's own
    warnings are not shown, every other warning is: NumbaIRAssumptionWarning, an internal check
    that numba's inlining of an `overload(inline="always")` used twice in one kernel trips
    (numba issue 9489; the code compiled is unaffected), and the note that
    parallel=True found nothing to do, expected in a kernel whose every product is of ggml blocks
    (their parallel loops are in `blocks_product`). The filters are set around the outermost
    kernel's compilation only (compiles run one at a time, under numba's lock)."""

    def __init__(self) -> None:
        self.depth = 0  # kvcache kernels compiling now, one inside another
        self.caught: warnings.catch_warnings | None = None

    @staticmethod
    def ours(compiling: event.Event) -> bool:
        return compiling.data["dispatcher"].py_func.__module__.startswith("kvcache.")

    def on_start(self, compiling: event.Event) -> None:
        if not self.ours(compiling):
            return
        if self.depth == 0:
            self.caught = warnings.catch_warnings()
            self.caught.__enter__()
            warnings.filterwarnings("ignore", category=NumbaIRAssumptionWarning)
            warnings.filterwarnings("ignore", _NOTHING_PARALLEL, numba.NumbaPerformanceWarning)
        self.depth += 1

    def on_end(self, compiling: event.Event) -> None:
        if not self.ours(compiling):
            return
        self.depth -= 1
        if self.depth == 0 and self.caught is not None:
            self.caught.__exit__(None, None, None)
            self.caught = None


event.register("numba:compile", QuietCompiles())


def part_product(part, x, start, out):  # typed by the overload below
    """out[:, start : start + the part's rows] = x (N, in) times one part of a product, transposed:
    a float32 or half-precision (out_i, in) array, or ggml blocks given as (blocks, code)
    (`numba_blocks`)."""
    raise NotImplementedError


_PARALLEL_INLINE = dict(parallel=PARALLEL, fastmath=FLAGS, error_model="numpy")
#: from this many activation rows a part coded past TILE_READS runs on the matrix unit's tiles
#: (fewer rows: the one-row dots, which the tiles' fixed cost a task outweighs)
TILE_ROWS = 8


@overload(part_product, inline="always", jit_options=_PARALLEL_INLINE)
def _part_product(part, x, start, out):  # pragma: no cover (compiled)
    if isinstance(part, types.BaseTuple) and not compiled_here():
        def blocks_only(part, x, start, out):  # (no tiles on this CPU: no part is coded for them)
            blocks_product(part[0], part[1], x, start, out)
        return blocks_only
    if isinstance(part, types.BaseTuple):
        def blocks(part, x, start, out):
            code = part[1]
            if code < TILE_READS:
                blocks_product(part[0], code, x, start, out)
            elif x.shape[0] >= TILE_ROWS:
                tiles_product(part[0], code - TILE_READS, x, start, out)
            else:
                blocks_product(part[0], code - TILE_READS + Q8_READS, x, start, out)
        return blocks

    def array(part, x, start, out):
        rows = x.shape[0]
        for i in prange(part.shape[0]):
            n = 0
            while n + 4 <= rows:  # one pass over the weight row for four rows of x
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for j in range(part.shape[1]):
                    w = widened(part[i, j])
                    a0 += w * x[n, j]
                    a1 += w * x[n + 1, j]
                    a2 += w * x[n + 2, j]
                    a3 += w * x[n + 3, j]
                out[n, start + i] = a0
                out[n + 1, start + i] = a1
                out[n + 2, start + i] = a2
                out[n + 3, start + i] = a3
                n += 4
            while n < rows:
                total = np.float32(0.0)
                for j in range(part.shape[1]):
                    total += widened(part[i, j]) * x[n, j]
                out[n, start + i] = total
                n += 1
    return array


def part_rows(part):  # typed by the overload below
    """The outputs of one part of a product (see `part_product`)."""
    raise NotImplementedError


@overload(part_rows, inline="always")
def _part_rows(part):  # pragma: no cover (compiled)
    if isinstance(part, types.BaseTuple):
        return lambda part: part[0].shape[0]
    return lambda part: part.shape[0]


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def product(parts, x, bias, rounding, out):  # pragma: no cover (compiled)
    """out (N, sum out_i) = x (N, in) @ the parts stacked along out, transposed (+ bias): each
    weight row (or four rows of blocks) read once and dotted with every row of x, the weight
    rows split between the threads; x and the output rounded as `rounding` says."""
    if rounding != NONE:
        x = x.copy()
        round_in_place(x.reshape(x.size), rounding)
    start = 0
    for part in parts:
        part_product(part, x, start, out)
        start += part_rows(part)
    if bias.shape[0]:
        for n in range(x.shape[0]):
            for i in range(out.shape[1]):
                out[n, i] += bias[i]
    round_in_place(out.reshape(out.size), rounding)


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def rms_normed(x, weight, eps, out):  # pragma: no cover (compiled)
    """out (N, n) = each row of x (N, n) / its rms * weight (n,)."""
    for row in range(x.shape[0]):
        squares = np.float32(0.0)
        for i in range(x.shape[1]):
            squares += x[row, i] * x[row, i]
        inverse = np.float32(1.0 / np.sqrt(squares / x.shape[1] + eps))
        for i in range(x.shape[1]):
            out[row, i] = x[row, i] * weight[i] * inverse


@numba.njit(**KERNEL)
def normed_product(x, norm, eps, parts, bias, rounding, out):  # pragma: no cover (compiled)
    """out (N, out) = product(parts, rms_normed(x (N, hidden), norm), bias): the final norm and
    lm_head."""
    normed = np.empty(x.shape, np.float32)
    rms_normed(x, norm, eps, normed)
    product(parts, normed, bias, rounding, out)


@numba.njit(**KERNEL)
def stacked_product(parts, x, bias, rounding, out):  # pragma: no cover (compiled)
    """out = product(parts, x, bias) (see `product`), on its own."""
    product(parts, x, bias, rounding, out)


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def turned(qkv, cos, signed_sin, q_norm, k_norm, eps, scale, heads, kv_heads):  # pragma: no cover
    """In place on qkv (N, (H + 2·H_kv)·D): each q and k head normed (q_norm, k_norm (D,) or
    empty), turned by RoPE (x_i·cos_i + x_{(i + D/2) mod D}·signed_sin_i, cos and signed_sin
    (N, D): each row's position) and the queries multiplied by `scale`."""
    dim = cos.shape[1]
    half = dim // 2
    work = np.empty(dim, np.float32)
    for row in range(qkv.shape[0]):
        for head in range(heads + kv_heads):
            at = qkv[row, head * dim:(head + 1) * dim]
            if q_norm.shape[0]:
                squares = np.float32(0.0)
                for i in range(dim):
                    squares += at[i] * at[i]
                inverse = np.float32(1.0 / np.sqrt(squares / dim + eps))
                weight = q_norm if head < heads else k_norm
                for i in range(dim):
                    at[i] = at[i] * weight[i] * inverse
            factor = scale if head < heads else np.float32(1.0)
            for i in range(dim):
                work[i] = at[i] * cos[row, i] + at[(i + half) % dim] * signed_sin[row, i]
            for i in range(dim):
                at[i] = work[i] * factor


@numba.njit(**KERNEL)
def attention_inputs(
    x, norm, eps, parts, bias, q_norm, k_norm, cos, signed_sin, scale, heads, kv_heads, rounding, qkv
):  # pragma: no cover (compiled)
    """qkv (N, (H + 2·H_kv)·D) = N rows' queries, keys and values: x (N, hidden) normed, through
    the fused q/k/v product (+ bias), then `turned` (per-head norms, RoPE at each row's position,
    the queries' scale)."""
    normed = np.empty(x.shape, np.float32)
    rms_normed(x, norm, eps, normed)
    product(parts, normed, bias, rounding, qkv)
    turned(qkv, cos, signed_sin, q_norm, k_norm, eps, scale, heads, kv_heads)


@numba.njit(**SERIAL)
def rope(qkv, cos, signed_sin, q_norm, k_norm, eps, scale, heads, kv_heads):  # pragma: no cover
    """`turned` on its own: qkv computed by another library's product."""
    turned(qkv, cos, signed_sin, q_norm, k_norm, eps, scale, heads, kv_heads)


@numba.njit(inline="always")
def head_dim_of(qkv, heads, kv_heads):  # pragma: no cover (compiled)
    """D of rows qkv (N, (H + 2·H_kv)·D): the stored keys' width is a packed row's, not D."""
    return qkv.shape[1] // (heads + 2 * kv_heads)


@numba.njit(**SERIAL)
def store(qkv, heads, kv_heads, slots, keys, values):  # pragma: no cover (compiled)
    """Write each row's keys and values (qkv (N, (H + 2·H_kv)·D) after `turned`) into a paged
    cache's storage, keys and values (blocks·S·H_kv, D) in its dtype, or packed rows (…, width)
    quantized (`numba_rows.stored`): row n's kv head h at row slots[n]·H_kv + h."""
    dim = head_dim_of(qkv, heads, kv_heads)
    for row in range(qkv.shape[0]):
        for h in range(kv_heads):
            target = slots[row] * kv_heads + h
            stored(qkv[row, (heads + h) * dim:(heads + h + 1) * dim], keys[target])
            stored(qkv[row, (heads + kv_heads + h) * dim:(heads + kv_heads + h + 1) * dim], values[target])


#: keys one attention task scores: a kv head's keys are split into chunks of this many, scored
#: in parallel and their softmax parts combined (as flash attention does), so a long cache keeps
#: every thread busy whatever the number of kv heads
CHUNK = 128
#: where `attend` finds a layout's numbers: (block size, token stride, key head stride, value
#: head stride, window or 0, positions a full-precision window holds or 0)
BLOCK, TOKEN_STRIDE, KEY_HEAD_STRIDE, VALUE_HEAD_STRIDE, WINDOW, RECENT = 0, 1, 2, 3, 4, 5


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def first_key(length, window):  # pragma: no cover (compiled)
    """The first key a query seeing `length` keys attends to (its window's, or 0)."""
    return max(0, length - window) if window > 0 else 0


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def attend(
    qkv, heads, kv_heads, keys, values, tables, token_row, lengths, layout, visible, key_rounding, recent, out
):  # pragma: no cover (compiled)
    """out (N, H·D) = each query head of qkv's rows (N, ...) over its kv head's keys and values:
    softmax(q·kᵀ)·V. Row n sees keys first_key(lengths[n], window) .. lengths[n] - 1 of table
    row token_row[n]; with one row, keys where visible (T,) is False (when not empty) are scored
    -inf. Keys and values are rows (R, D), float32, bfloat16 bits (uint16) or float16 bits
    (int16), or a quantized cache's packed rows (uint8, `numba_rows`), found through `tables`
    (see the module docstring; `layout` holds the block size, strides and window). Each (row,
    kv head, CHUNK keys) is one task for the threads, its group of queries scored together; the
    tasks' softmax parts are combined as flash attention combines them. The queries are rounded
    first as `key_rounding` says (the keys' dtype), as the torch forward's attention in that
    dtype reads them. recent: a paged cache's full-precision window (`kvcache.cache.paged.recent`),
    (keys (R', D), values (R', D_v) in the forward's dtype, exact (N, 2) int64): row n reads
    positions from exact[n, 0] on there, kv head h of position p at row exact[n, 1] + (p %
    layout[RECENT])·H_kv + h; exact empty: no window."""
    tokens, dim, group = qkv.shape[0], head_dim_of(qkv, heads, kv_heads), heads // kv_heads
    size, step, window = layout[BLOCK], layout[TOKEN_STRIDE], layout[WINDOW]
    recent_keys, recent_values, exact = recent
    windowed = exact.shape[0] > 0
    span = 1
    for n in range(tokens):
        span = max(span, lengths[n] - first_key(lengths[n], window))
    chunks = (span + CHUNK - 1) // CHUNK
    queries = np.empty((tokens, heads * dim), np.float32)
    queries[:] = qkv[:, :heads * dim]
    round_in_place(queries.reshape(queries.size), key_rounding)
    query_sums = np.zeros((tokens, heads), np.float32)  # (a packed key's zero point multiplies them)
    for n in range(tokens):
        for h in range(heads):
            for d in range(dim):
                query_sums[n, h] += queries[n, h * dim + d]
    tops = np.full((tokens, kv_heads, chunks, group), -np.inf, np.float32)  # each task's top score
    sums = np.zeros((tokens, kv_heads, chunks, group), np.float32)  # its sum of exp(score - top)
    parts = np.zeros((tokens, kv_heads, chunks, group, dim), np.float32)  # its sum of exp(...)·value
    all_scores = np.empty((tokens * kv_heads * chunks, group, CHUNK), np.float32)  # each task's
    all_codes = np.empty((tokens * kv_heads * chunks, dim), np.float32)  # each task's packed row scratch
    for task in prange(tokens * kv_heads * chunks):
        n, kv, chunk = task // (kv_heads * chunks), task // chunks % kv_heads, task % chunks
        lo = first_key(lengths[n], window) + chunk * CHUNK
        count = min(lengths[n], lo + CHUNK) - lo
        if count > 0:
            table = tables[token_row[n]]
            group_queries = queries[n].reshape(heads, dim)[kv * group:(kv + 1) * group]  # (G, D)
            group_sums = query_sums[n, kv * group:(kv + 1) * group]
            scores, codes = all_scores[task], all_codes[task]
            # keys from the blocks, then (a windowed row's last ones) from its window: no branch per key
            stored = count if not windowed else min(count, max(0, exact[n, 0] - lo))
            for t in range(stored):  # each key read once for the group's queries
                at = lo + t
                if visible.shape[0] == 0 or visible[at]:
                    slot = table[at // size] * size + at % size
                    key = keys[slot * step + kv * layout[KEY_HEAD_STRIDE]]
                    scored(group_queries, key, group_sums, scores[:, t], codes)
                else:
                    for g in range(group):
                        scores[g, t] = -np.inf
            for t in range(stored, count):  # (a windowed row attends causally: no mask)
                row = exact[n, 1] + (lo + t) % layout[RECENT] * kv_heads + kv
                scored(group_queries, recent_keys[row], group_sums, scores[:, t], codes)
            exponentiated(scores, count, tops[n, kv, chunk], sums[n, kv, chunk])
            summed = parts[n, kv, chunk]  # (G, D), zeros
            for t in range(stored):  # each value read once for the group's queries
                at = lo + t  # (a masked key's weight is 0: its value is never read, maybe unwritten)
                slot = table[at // size] * size + at % size
                accumulated(summed, scores[:, t], values[slot * step + kv * layout[VALUE_HEAD_STRIDE]], codes)
            for t in range(stored, count):
                row = exact[n, 1] + (lo + t) % layout[RECENT] * kv_heads + kv
                accumulated(summed, scores[:, t], recent_values[row], codes)
    combine(tops, sums, parts, out)


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def exponentiated(scores, count, tops, sums):  # pragma: no cover (compiled)
    """scores (G, ≥ count) of one task's first `count` keys -> exp(score - top) per query of the
    group (`exp_below`), in place; tops (G,) = each query's top score, sums (G,) = its weights'
    sum (every key masked: weights 0, not nan)."""
    for g in range(scores.shape[0]):
        top = np.float32(-np.inf)
        for t in range(count):
            top = max(top, scores[g, t])
        total = np.float32(0.0)
        if top != -np.inf:
            for t in range(count):
                weight = exp_below(scores[g, t] - top)
                scores[g, t] = weight
                total += weight
        else:
            for t in range(count):
                scores[g, t] = np.float32(0.0)
        tops[g] = top
        sums[g] = total


#: exp_below's constants: log2(e), ln(2) in two parts (the first exact in few bits, so n·it is
#: exact), and where float32's exp stops being a normal number
_LOG2E = np.float32(1.4426950408889634)
_LN2_HIGH, _LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)
_LOWEST = np.float32(-87.0)
#: no reassociation (which would undo the two-part reduction): a function of its own, called, as
#: an inlined one takes its caller's flags
_EXP_FLAGS = {"contract", "arcp", "nsz"}


@numba.njit(fastmath=_EXP_FLAGS, error_model="numpy", cache=True)
def exp_below(x):  # pragma: no cover (compiled)
    """e^x for x <= 0 (a score less its top), 0 below -87 (-inf included), within about one
    float32 ulp elsewhere: x = n·ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7,
    times 2^n made in the exponent's bits. Arithmetic only, so a loop of it vectorizes (numba's
    np.exp is a scalar call a value)."""
    clamped = max(x, _LOWEST)
    n = np.rint(clamped * _LOG2E)
    r = (clamped - n * _LN2_HIGH) - n * _LN2_LOW
    p = np.float32(1.0 / 5040.0) * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = (p * r + np.float32(1.0)) * r + np.float32(1.0)
    power = np.int32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)
    return p * power if x >= _LOWEST else np.float32(0.0)


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def swiglu_row(gate_up, out):  # pragma: no cover (compiled)
    """out (inner,) = silu(gate)·up of one row gate_up (2·inner,) (gate's outputs, then up's);
    the sigmoid from `exp_below` of -|gate| (vectorized, within an ulp or so of libm's)."""
    inner = out.shape[0]
    for i in range(inner):
        gate = gate_up[i]
        e = exp_below(-abs(gate))
        sigmoid = np.float32(1.0) / (np.float32(1.0) + e) if gate >= 0 else e / (np.float32(1.0) + e)
        out[i] = gate * sigmoid * gate_up[inner + i]


@numba.njit(**KERNEL)
def swiglu_rows(gate_up, out):  # pragma: no cover (compiled)
    """out (N, inner) = `swiglu_row` of each row of gate_up (N, 2·inner), the rows split between
    the threads: a long step's, whose products run outside the layer calls."""
    for n in prange(gate_up.shape[0]):
        swiglu_row(gate_up[n], out[n])


@numba.njit(**KERNEL)
def normed_rows(x, weight, eps, out):  # pragma: no cover (compiled)
    """out (N, n) = `rms_normed` of x (N, n), the rows split between the threads: a long step's
    norms, in the layer kernels' arithmetic."""
    for row in prange(x.shape[0]):
        rms_normed(x[row:row + 1], weight, eps, out[row:row + 1])


@numba.njit(inline="always", fastmath=FLAGS, error_model="numpy")
def combine(tops, sums, parts, out):  # pragma: no cover (compiled)
    """out (N, H·D): each query head's chunks' softmax parts rescaled to its top score, summed and
    divided by their weights' sum (every key masked: top -inf, the output nan, as torch's)."""
    tokens, kv_heads, chunks, group, dim = parts.shape
    for n in range(tokens):
        for head in range(kv_heads * group):
            kv, g = head // group, head % group
            top = np.float32(-np.inf)
            for chunk in range(chunks):
                top = max(top, tops[n, kv, chunk, g])
            total = np.float32(0.0)
            for d in range(dim):
                out[n, head * dim + d] = 0.0
            for chunk in range(chunks):
                factor = np.exp(tops[n, kv, chunk, g] - top)
                total += factor * sums[n, kv, chunk, g]
                for d in range(dim):
                    out[n, head * dim + d] += factor * parts[n, kv, chunk, g, d]
            for d in range(dim):
                out[n, head * dim + d] /= total


@numba.njit(**KERNEL)
def attention(
    qkv, heads, kv_heads, keys, values, tables, token_row, lengths, layout, visible, key_rounding, recent, out
):  # pragma: no cover (compiled)
    """`attend` on its own (a step whose products another library runs)."""
    attend(qkv, heads, kv_heads, keys, values, tables, token_row, lengths, layout, visible, key_rounding,
           recent, out)


@numba.njit(**KERNEL)
def layer_output(
    x, qkv, heads, kv_heads, keys, values, tables, token_row, lengths, layout, visible, key_rounding, recent,
    o, o_bias, norm, eps, gate_up, gate_up_bias, down, down_bias, rounding,
):  # pragma: no cover (compiled)
    """x (N, hidden) += the layer's attention output through o (+ bias), then += the SwiGLU of
    its norm (gate/up stacked: gate's outputs, then up's; silu(gate)·up through down), in
    place; qkv and the keys, values and their addressing as `attend` reads them."""
    tokens, hidden = x.shape
    attended = np.empty((tokens, head_dim_of(qkv, heads, kv_heads) * heads), np.float32)
    attend(qkv, heads, kv_heads, keys, values, tables, token_row, lengths, layout, visible, key_rounding,
           recent, attended)
    projected = np.empty((tokens, hidden), np.float32)
    product(o, attended, o_bias, rounding, projected)
    x += projected
    normed = np.empty((tokens, hidden), np.float32)
    rms_normed(x, norm, eps, normed)
    inner = 0
    for part in gate_up:
        inner += part_rows(part)
    both = np.empty((tokens, inner), np.float32)
    product(gate_up, normed, gate_up_bias, rounding, both)
    act = np.empty((tokens, inner // 2), np.float32)
    for n in range(tokens):
        swiglu_row(both[n], act[n])
    product(down, act, down_bias, rounding, projected)
    x += projected


@numba.njit(**KERNEL)
def matvec_check(weight, x, out):  # pragma: no cover (compiled)
    """out (n,) = weight (n, k) @ x (k,): a tiny parallel loop `available` runs to start numba's
    pool and read which threading layer it got."""
    for i in prange(weight.shape[0]):
        total = np.float32(0.0)
        for j in range(weight.shape[1]):
            total += weight[i, j] * x[j]
        out[i] = total
