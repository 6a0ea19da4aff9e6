"""One-row products of a decode step, compiled by numba and run on its OpenMP threads.

Why: a one-row decode step is a chain of matrix-vector products, each reading its weight once,
so it is bound by memory bandwidth plus what each call costs to start. On the CPU measured
(`docs/backends.md`) a plain loop over the weight's rows (each row one dot product, the rows
split between the threads), compiled by numba with fast-math vectorisation, read float32
weights faster in the step than numpy's OpenBLAS matrix-vector product, and its calls start
faster on small matrices. numba's pool must be OpenMP (or TBB): on its fallback `workqueue`
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

#: numba threading layers on which the kernels are worth running
FAST_LAYERS = ("omp", "tbb")


@functools.cache
def _kernels():
    """(float32 matrix-vector kernel, numba module), compiled once; None when numba is missing."""
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

    return matvec, numba


@functools.cache
def available() -> bool:
    """Whether numba is installed and runs parallel loops on OpenMP or TBB threads (checked
    once, by running the kernel on a tiny matrix)."""
    found = _kernels()
    if found is None:
        return False
    matvec, numba = found
    matvec(np.ones((4, 4), np.float32), np.ones(4, np.float32), np.empty(4, np.float32))
    return numba.threading_layer() in FAST_LAYERS


def set_threads(threads: int) -> None:
    """Run the kernels on `threads` threads (at most numba's NUMBA_NUM_THREADS, at least 1)."""
    _, numba = _kernels()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


def matvec(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x (in,) float32 times weight (out, in) float32, C-contiguous -> (out,) float32, a new
    array. Call `available()` first."""
    out = np.empty(weight.shape[0], np.float32)
    _kernels()[0](weight, x, out)
    return out
