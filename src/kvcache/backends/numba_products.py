"""One-row products of a decode step, compiled by numba and run on its OpenMP threads: float32
weights, and bfloat16 ones read in place as pairs.

Why: a one-row decode step is a chain of matrix-vector products, each reading its weight once,
so it is bound by memory bandwidth plus what each call costs to start. On the CPU measured
(`docs/backends.md`) a plain loop over the weight's rows (each row one dot product, the rows
split between the threads), compiled by numba with fast-math vectorisation, read float32
weights faster in the step than numpy's OpenBLAS matrix-vector product, and its calls start
faster on small matrices; the bfloat16 loop (each weight widened to float32 by a shift: a
bfloat16 is a float32's upper half) read faster than oneDNN's packed bfloat16 product.
numba's pool must be OpenMP (or TBB): on its fallback `workqueue`
pool the same loop ran at about half OpenBLAS's speed, so `available()` is False there and the
numpy step keeps numpy's products.

The kernels are compiled on first use (about a second) and cached on disk beside this module
(numba's `cache=True`); numba is imported only then, so importing kvcache does not load it.
Two OpenMP pools spinning at once (numba's and torch's, or numba's beside OpenBLAS's) make each
other wait, so a step that runs these products runs torch on one thread and calls no threaded
BLAS in between.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

#: numba threading layers on which the kernels are worth running
FAST_LAYERS = ("omp", "tbb")


@functools.cache
def _kernels():
    """(float32 matrix-vector kernel, numba module, bfloat16 rounding, the rounded bfloat16
    product of stacked parts), compiled once; None when numba is missing."""
    try:
        import numba
    except ImportError:
        return None

    @numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
    def matvec(weight, x, out):  # pragma: no cover (compiled: coverage cannot see inside)
        """out (n,) = weight (n, k) @ x (k,), float32, each row a dot product."""
        rows, columns = weight.shape
        for i in numba.prange(rows):
            total = np.float32(0.0)
            for j in range(columns):
                total += weight[i, j] * x[j]
            out[i] = total

    @numba.njit(cache=True, inline="always")
    def bfloat16_bits(b):  # pragma: no cover (compiled)
        """float32 bits b rounded to bfloat16 (to nearest, ties to even), as float32 bits; a NaN
        stays a NaN (quieted, its upper half kept)."""
        if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            return (b | np.uint32(0x00400000)) & np.uint32(0xFFFF0000)
        tie_to_even = (b >> np.uint32(16)) & np.uint32(1)
        return (b + np.uint32(0x7FFF) + tie_to_even) & np.uint32(0xFFFF0000)

    @numba.njit(cache=True, boundscheck=False)
    def round_to_bfloat16(bits, out):  # pragma: no cover (compiled)
        """out (n,) uint32 = float32 bits (n,) rounded to bfloat16, as float32 bits."""
        for i in range(bits.shape[0]):
            out[i] = bfloat16_bits(bits[i])

    @numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
    def product_pairs(parts, x_bits, bias, out):  # pragma: no cover (compiled)
        """out (sum n_i,) = the bfloat16 weights `parts` (a tuple of (n_i, k/2) uint32 pairs,
        stacked along out) @ x (k,) given as float32 bits, + bias (sum n_i,) or an empty bias:
        x rounded to bfloat16 first and the output after, as oneDNN's bfloat16 product rounds."""
        rounded = np.empty(x_bits.shape[0], np.uint32)
        for j in range(x_bits.shape[0]):
            rounded[j] = bfloat16_bits(x_bits[j])
        x = rounded.view(np.float32)
        start = 0
        for pairs in parts:
            rows, half = pairs.shape
            for i in numba.prange(rows):
                even = np.float32(0.0)
                odd = np.float32(0.0)
                for j in range(half):
                    pair = pairs[i, j]
                    even += np.uint32(pair << np.uint32(16)).view(np.float32) * x[2 * j]
                    odd += np.uint32(pair & np.uint32(0xFFFF0000)).view(np.float32) * x[2 * j + 1]
                out[start + i] = even + odd
            start += rows
        out_bits = out.view(np.uint32)
        for i in range(out.shape[0]):
            value = out[i] + bias[i] if bias.shape[0] else out[i]
            out_bits[i] = bfloat16_bits(np.float32(value).view(np.uint32))

    return matvec, numba, round_to_bfloat16, product_pairs


@functools.cache
def available() -> bool:
    """Whether numba is installed and runs parallel loops on OpenMP or TBB threads (checked
    once, by running the kernel on a tiny matrix)."""
    found = _kernels()
    if found is None:
        return False
    matvec, numba = found[:2]
    matvec(np.ones((4, 4), np.float32), np.ones(4, np.float32), np.empty(4, np.float32))
    return numba.threading_layer() in FAST_LAYERS


def set_threads(threads: int) -> None:
    """Run the kernels on `threads` threads (at most numba's NUMBA_NUM_THREADS, at least 1)."""
    numba = _kernels()[1]
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


def matvec(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x (in,) float32 times weight (out, in) float32, C-contiguous -> (out,) float32, a new
    array. Call `available()` first."""
    out = np.empty(weight.shape[0], np.float32)
    _kernels()[0](weight, x, out)
    return out


def bfloat16_pairs(weight) -> np.ndarray | None:
    """A contiguous (out, in) bfloat16 torch tensor's memory as (out, in/2) uint32 pairs (a view,
    no copy), or None when `in` is odd or the tensor is not contiguous."""
    if weight.shape[-1] % 2 or not weight.is_contiguous():
        return None
    return weight.detach().view(torch.int16).numpy().view(np.uint32)


def rounded_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """x (n,) float32 rounded to the nearest bfloat16 (ties to even, as torch rounds), kept as
    float32: a new array (the rounding `product_bfloat16` applies, on its own)."""
    out = np.empty(x.shape[0], np.uint32)
    _kernels()[2](np.ascontiguousarray(x).view(np.uint32), out)
    return out.view(np.float32)


_NO_BIAS = np.empty(0, np.float32)


def product_bfloat16(x: np.ndarray, parts: tuple, bias: np.ndarray | None) -> np.ndarray:
    """x (in,) float32 through bfloat16 weights given as `bfloat16_pairs` `parts` (stacked along
    out, each (out_i, in/2)) (+ bias (sum out_i,) float32) -> (sum out_i,) float32, one numba
    call: x rounded to bfloat16, each product exact in float32 and summed in float32, the output
    rounded to bfloat16, as oneDNN's (and torch's) bfloat16 product computes. Call `available()`
    first."""
    out = np.empty(sum(part.shape[0] for part in parts), np.float32)
    _kernels()[3](parts, np.ascontiguousarray(x).view(np.uint32), _NO_BIAS if bias is None else bias, out)
    return out
