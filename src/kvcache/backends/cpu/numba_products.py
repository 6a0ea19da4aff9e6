"""A one-row decode step on numba's compiled kernels: what a backend hands them, and checks.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
numba_products.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvcache.cache.arrays import array_of

#: numba threading layers on which the kernels are worth running
FAST_LAYERS = ("omp", "tbb")
_EMPTY = np.empty(0, np.float32)


@functools.cache
def kernels():
    """The `numba_kernels` module, imported (numba with it) on first use; None without numba."""
    try:
        from kvcache.backends.cpu import numba_kernels
    except ImportError:
        return None
    return numba_kernels


@functools.cache
def available() -> bool:
    """Whether numba is installed and runs parallel loops on OpenMP or TBB threads (checked
    once, by running a kernel on a tiny matrix)."""
    found = kernels()
    if found is None:
        return False
    threads = torch.get_num_threads()
    found.matvec_check(np.ones((4, 4), np.float32), np.ones(4, np.float32), np.empty(4, np.float32))
    # numba's OpenMP pool, started by that first kernel, sets the OpenMP runtime's thread count
    # (torch's, which shares the runtime) to numba's own: the caller's count is put back
    torch.set_num_threads(threads)
    import numba

    return numba.threading_layer() in FAST_LAYERS


@contextlib.contextmanager
def compiling_reported(report: Callable[[str], None]) -> Iterator[None]:
    """While inside, report(kernel name) as each of kvcache's compiled kernels starts compiling
    (on an install's first run; a kernel loaded from numba's disk cache is not reported, nor a
    function compiled inside a kernel's own compilation). Does nothing without numba."""
    if kernels() is None:
        yield
        return
    from numba.core import event

    class KernelListener(event.Listener):
        depth = 0  # kvcache kernels being compiled now, one inside another

        def on_start(self, compiling: event.Event) -> None:
            function = compiling.data["dispatcher"].py_func
            if function.__module__.startswith("kvcache."):
                if self.depth == 0:
                    report(function.__name__)
                self.depth += 1

        def on_end(self, compiling: event.Event) -> None:
            if compiling.data["dispatcher"].py_func.__module__.startswith("kvcache."):
                self.depth -= 1

    listener = KernelListener()
    event.register("numba:compile", listener)
    try:
        yield
    finally:
        event.unregister("numba:compile", listener)


def set_threads(threads: int) -> None:
    """Run the kernels on `threads` threads (at most numba's NUMBA_NUM_THREADS, at least 1)."""
    import numba

    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


def rounding_of(dtype: torch.dtype) -> int:
    """What the kernels' products round to for weights of `dtype` (`numba_kernels.NONE`,
    `BFLOAT16` or `FLOAT16`). Call `available()` first."""
    found = kernels()
    return {torch.float32: found.NONE, torch.bfloat16: found.BFLOAT16, torch.float16: found.FLOAT16}[dtype]


def key_rounding(stored: np.ndarray) -> int:
    """What the kernels' attention rounds queries to for keys stored as `stored` is: float32
    none, uint16 (bfloat16 bits) bfloat16, int16 (float16 bits) float16 (`numba_kernels.NONE`,
    ...), uint8 or int8 (a quantized cache's packed rows) none."""
    found = kernels()
    by_char = {"f": found.NONE, "H": found.BFLOAT16, "h": found.FLOAT16, "B": found.NONE, "b": found.NONE}
    return by_char[stored.dtype.char]


def as_kernel_array(array: np.ndarray) -> np.ndarray:
    """A numpy array (weights, stored keys or values) as the kernels read it, a view: float16 as
    its bits, int16 (numba has no float16 values); float32 and bfloat16 bits (uint16, as the
    cache passes them, `kvcache.cache.arrays`) as they are."""
    return array.view(np.int16) if array.dtype == np.float16 else array


def half_bits(weight) -> np.ndarray | None:
    """A contiguous bfloat16 or float16 torch tensor's memory as its bits, as the kernels read
    it: bfloat16 as uint16, float16 as int16, of the same shape (a view, no copy); None when
    the tensor is not contiguous."""
    if not weight.is_contiguous():
        return None
    return as_kernel_array(array_of(weight.detach()))


def bfloat16_bits_of(x: np.ndarray) -> np.ndarray:
    """x float32 (any shape, C-contiguous) rounded to the nearest bfloat16 (ties to even, as
    torch rounds; the kernels' products round the same way), as the bfloat16 values' bits:
    uint16 of x's shape, a new array (the kernels' own rounding of what they store)."""
    out = np.empty(x.shape, np.uint16)
    kernels().bfloat16_halves(x.reshape(-1).view(np.uint32), out.reshape(-1))
    return out


def product(
    x: np.ndarray, parts: tuple, bias: np.ndarray | None = None, dtype: torch.dtype = torch.float32
) -> np.ndarray:
    """x (in,) or (N, in) float32 through a weight of `dtype` given as parts stacked along out
    (each (out_i, in) row-major: float32, or half precision as `half_bits`; or ggml blocks as
    `block_part`s, dtype float32) (+ bias (sum out_i,)
    float32) -> (sum out_i,) or (N, sum out_i) float32, a new array: each output one dot product
    summed in float32; in half precision x rounded to `dtype` first and the output after, as
    oneDNN's (and torch's) half-precision product computes. The kernels' own product, on its
    own. Call `available()` first."""
    rows = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])  # (N, in)
    out = np.empty((rows.shape[0], outputs(parts)), np.float32)
    kernels().stacked_product(parts, rows, _vector(bias), rounding_of(dtype), out)
    return out.reshape(*x.shape[:-1], out.shape[1])


@functools.cache
def matrix_unit():
    """The `numba_amx` module where this process may run its tile products (`numba_amx.usable`:
    a CPU with AMX, the tiles granted), else None. Call `available()` first."""
    from kvcache.backends.cpu import numba_amx

    return numba_amx if numba_amx.usable() else None


def tiles_product(x: np.ndarray, parts: tuple, bias: np.ndarray | None = None) -> np.ndarray:
    """x (N, in) float32 through parts that are all ggml blocks read with Q8 activations
    (`block_part_of(..., q8=True)`) (+ bias) -> (N, sum out_i) float32, a new array, on the
    matrix unit (`numba_amx.tiles_product`) whatever N: `product`'s sums to the bit. Call
    `matrix_unit()` first (not None)."""
    from kvcache.backends.cpu.numba_blocks import Q8_READS

    unit = matrix_unit()
    rows = np.ascontiguousarray(x, np.float32)
    out = np.empty((rows.shape[0], outputs(parts)), np.float32)
    start = 0
    for blocks, code in parts:
        unit.tiles_product(blocks, code % Q8_READS, rows, start, out)
        start += blocks.shape[0]
    if bias is not None:
        out += bias
    return out


def outputs(parts: tuple) -> int:
    """The outputs of a product given as parts (see `product`): each part an (out_i, in) array or
    ggml blocks as (blocks (out_i, row bytes), code) (`block_part`)."""
    return sum(part[0].shape[0] if isinstance(part, tuple) else part.shape[0] for part in parts)


def block_part(weight, tiles: bool = False) -> tuple[np.ndarray, int]:
    """A `kvcache.model.quantized.BlockWeight` as a product's part (`block_part_of`)."""
    return block_part_of(weight.blocks, weight.kind, weight.activations == "q8", tiles)


def block_part_of(
    blocks: np.ndarray, kind: str, q8: bool = False, tiles: bool = False
) -> tuple[np.ndarray, int]:
    """ggml blocks (rows, row bytes) uint8 of `kind` ("Q8_0", ...) as a product's part: (the
    blocks, read-only as a mapped file's are, and the format's code in `numba_blocks.CODES`,
    plus `numba_blocks.Q8_READS` when q8: its products read activations as llama.cpp's; plus
    `TILE_READS` instead with tiles, its products of many rows on the matrix unit: call
    `matrix_unit()` first)."""
    from kvcache.backends.cpu.numba_blocks import CODES, Q8_READS, TILE_READS

    if tiles and not q8:
        raise ValueError("a part on the matrix unit reads Q8 activations: tiles needs q8")
    if blocks.flags.writeable:  # (one array type for every part: the kernels compile once)
        blocks = blocks.view()
        blocks.setflags(write=False)
    return blocks, CODES[kind] + (TILE_READS if tiles else Q8_READS if q8 else 0)


def row_product(parts: tuple, bias: np.ndarray | None) -> tuple[tuple, np.ndarray]:
    """A product as the kernels read it: (parts, its bias as float32, empty when absent)."""
    return parts, _vector(bias)


def _vector(values: np.ndarray | None) -> np.ndarray:
    """A norm's or bias's float32 array, or the kernels' empty array for an absent one."""
    return _EMPTY if values is None else np.ascontiguousarray(values, np.float32)


@dataclass(frozen=True)
class RowLayer:
    """One decoder layer as the kernels read it: the norms (n,) float32 (q_norm, k_norm empty
    when absent), each product a tuple of parts stacked along out (see `product`) and its bias
    (empty when absent)."""

    norm1: np.ndarray
    norm2: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    qkv: tuple
    qkv_bias: np.ndarray
    o: tuple
    o_bias: np.ndarray
    gate_up: tuple
    gate_up_bias: np.ndarray
    down: tuple
    down_bias: np.ndarray

    @classmethod
    def of(cls, layer, products: list[tuple[tuple, np.ndarray | None]]) -> RowLayer:
        """From a layer's norms (`layer.norm1`, `norm2`, `q_norm`, `k_norm`: float32 arrays or
        None) and its four products as (parts, bias), in the order qkv, o, gate_up, down."""
        (qkv, qkv_bias), (o, o_bias), (gate_up, gate_up_bias), (down, down_bias) = products
        return cls(
            _vector(layer.norm1), _vector(layer.norm2), _vector(layer.q_norm), _vector(layer.k_norm),
            qkv, _vector(qkv_bias), o, _vector(o_bias),
            gate_up, _vector(gate_up_bias), down, _vector(down_bias),
        )


#: the kernels' attention's `recent` argument where there is no full-precision window
NO_RECENT = (np.empty((0, 1), np.float32), np.empty((0, 1), np.float32), np.empty((0, 2), np.int64))


def paged_layout(block_size: int, kv_heads: int, window: int | None, recent: int = 0) -> np.ndarray:
    """How the kernels' attention finds keys in a paged cache's storage (blocks·S·H_kv, D):
    slot s's kv head h at row s·H_kv + h; `window` (None: every key) as the layer attends;
    `recent`: the positions a full-precision window holds per row (0: none)."""
    return np.array([block_size, kv_heads, 1, 1, window or 0, recent], np.int64)


