"""GGUF weights kept in their stored block formats: a weight is its file's blocks, mapped, never a
dequantized copy.

ggml stores a weight (out, in) row by row, each row `in / 32` blocks of 32 values: Q8_0 a float16
scale d and 32 int8 (value = d·q); Q4_0 d and 16 bytes of 4-bit q (value = d·(q - 8)); Q4_1 d, a
float16 minimum m and 4-bit q (d·q + m); Q5_0 and Q5_1 the same with a fifth bit per value in a
32-bit word. In each byte the low nibble is value j, the high one value j + 16. The K-quants
group 256 values a block: Q4_K and Q5_K as 8 sub-blocks of 32 with 6-bit scales and minimums
(value = d·scale·q - dmin·min), Q6_K as 16 groups of 16 with int8 scales (d·scale·(q - 32)), Q2_K
as 16 groups of 16 with 4-bit scales and minimums (2-bit q: d·scale·q - dmin·min), Q3_K as 16
groups of 16 with 6-bit scales stored + 32 (3-bit q: d·scale·(q - 4)). `BlockWeight` holds such
rows; `QuantizedLinear` and `QuantizedEmbedding` stand in for `nn.Linear` and `nn.Embedding` over
them.

A product reads its activations as float32: the dequantized weight's product, exact. A weight
whose `activations` is "q8" (`read_q8_activations`) reads them as llama.cpp's CPU products do
(`q8_activations`): a 32-value format each 32 values as int8 with a float16 scale (Q8_0; Q8_1, for
the formats with a minimum, also a float16 of the scale times the int8s' sum, which the minimum
multiplies), a K-quant each 256 as int8 with a float32 scale (Q8_K). That is llama.cpp's
arithmetic on the same file, and the kernels then dot integers
(faster); it is an approximation, and rounding is a step function, so answers then move with
summation order (a cache or not, a batch's size) at near-ties, as llama.cpp's do. The modules'
own forwards (the reference road) dequantize (with the `gguf` package, the format's own library)
a slice of rows at a time; the CPU block step (`kvcache.backends.cpu.block_step`) multiplies by
the blocks directly on its kernels.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

#: the block formats kept as stored: (values per block, bytes per block)
STORED_KINDS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
                "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q2_K": (256, 84),
                "Q3_K": (256, 110)}
#: the formats whose products read Q8_1 activations (a float16 minimum in each block) and Q8_K's
#: (256 values a block) when they read them as llama.cpp's; the others read Q8_0's
Q8_1_KINDS, Q8_K_KINDS = ("Q4_1", "Q5_1"), ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")
#: how a BlockWeight's products read their activations
ACTIVATIONS = ("float32", "q8")
#: rows of a weight dequantized at once by the modules' own forwards (bounds their scratch)
TILE_ROWS = 4096


@dataclass(frozen=True, eq=False)
class BlockWeight:
    """A weight (rows, columns) as ggml blocks: `blocks` uint8 (rows, row bytes), read-only (a view
    of the mapped file, or a row-permuted copy), `kind` one of `STORED_KINDS`. Equal only to
    itself (its blocks are not compared)."""

    kind: str
    rows: int
    columns: int
    blocks: np.ndarray
    #: "float32", or "q8": as llama.cpp's products read them
    activations: str = "float32"

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"{self.kind} blocks read activations as one of {ACTIVATIONS}, "
                             f"got {self.activations!r}")
        values, size = STORED_KINDS[self.kind]
        expected = (self.rows, self.columns // values * size)
        if self.columns % values or self.blocks.shape != expected or self.blocks.dtype != np.uint8:
            raise ValueError(
                f"{self.kind} blocks of a ({self.rows}, {self.columns}) weight must be uint8 {expected}, "
                f"got {self.blocks.dtype} {self.blocks.shape}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes the blocks take (scales included)."""
        return self.blocks.nbytes

    def dequantized(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start..stop dequantized to float32 (n, columns), a new array."""
        return self.take_rows(slice(start, stop))

    def take_rows(self, ids: np.ndarray | slice) -> np.ndarray:
        """The rows at ids (n,) (or a slice of rows) dequantized to float32 (n, columns), with the
        `gguf` package's dequantizer, a new array."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return np.ascontiguousarray(dequantize(self.blocks[ids], GGMLQuantizationType[self.kind]), np.float32)

    def times(self, rows: np.ndarray) -> np.ndarray:
        """rows (N, columns) float32 times this weight, transposed -> (N, rows) float32: the rows
        (quantized as llama.cpp's are where `activations` is "q8": `q8_activations`) times the
        weight dequantized TILE_ROWS rows at a time (float32 products)."""
        if self.activations == "float32":
            read, gaps = rows, None
        else:
            read, gaps = q8_activations(rows, self.kind)
        out = np.empty((rows.shape[0], self.rows), np.float32)
        for start in range(0, self.rows, TILE_ROWS):
            tile = self.dequantized(start, start + TILE_ROWS)
            np.matmul(read, tile.T, out=out[:, start : start + len(tile)])
        if gaps is not None and self.kind in Q8_1_KINDS:  # a minimum times Q8_1's float16 sum
            size = STORED_KINDS[self.kind][1]
            minimums = self.blocks.reshape(self.rows, -1, size)[:, :, 2:4].copy().view(np.float16)[:, :, 0]
            out += gaps @ minimums.T.astype(np.float32)
        return out

    def permuted_rows(self, order: np.ndarray) -> BlockWeight:
        """The same weight with its rows in `order` (a read-only copy: rows are whole blocks)."""
        blocks = np.ascontiguousarray(self.blocks[order])
        blocks.setflags(write=False)
        return BlockWeight(self.kind, self.rows, self.columns, blocks, self.activations)


def q8_activations(rows: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(read, gaps): what a product with a weight of `kind` reads of rows (N, in) float32 as
    llama.cpp's CPU products quantize it: a 32-value format's each 32 values q = round(x · 127 /
    max|x|) (ties to even) times d = max|x| / 127 rounded to float16, a K-quant's as
    `q8_k_activations` says; read (N, in) float32; for Q4_1 and Q5_1 gaps (N, in / 32) = Q8_1's
    float16 of (unrounded d)·Σq minus Σ read, what a block's minimum multiplies beyond the read
    values' sum (else empty)."""
    if kind in Q8_K_KINDS:
        return q8_k_activations(rows), np.empty((len(rows), 0), np.float32)
    blocks = rows.reshape(len(rows), -1, 32)
    largest = np.abs(blocks).max(axis=-1, keepdims=True)
    inverse = np.divide(np.float32(127.0), largest, out=np.zeros_like(largest), where=largest != 0)
    quants = np.rint(blocks * inverse)
    scale = largest / np.float32(127.0)
    read = quants * scale.astype(np.float16).astype(np.float32)
    if kind not in Q8_1_KINDS:
        return read.reshape(rows.shape), np.empty((len(rows), 0), np.float32)
    sums = (scale[..., 0] * quants.sum(axis=-1)).astype(np.float16).astype(np.float32)
    return read.reshape(rows.shape), sums - read.sum(axis=-1)


def q8_k_activations(rows: np.ndarray) -> np.ndarray:
    """rows (N, in) float32 as llama.cpp's Q8_K holds them, read back (N, in) float32: each 256
    values q = min(127, round(x · s)) (ties to even), s = -127 / m with m the first value of the
    largest magnitude, times d = 1 / s (float32; all 0 where every value is)."""
    blocks = rows.reshape(len(rows), -1, 256)
    first = np.abs(blocks).argmax(axis=-1)[..., None]  # (argmax: the first, as llama.cpp's strict >)
    largest = np.take_along_axis(blocks, first, axis=-1)
    scale = np.divide(np.float32(-127.0), largest, out=np.zeros_like(largest), where=largest != 0)
    quants = np.minimum(np.rint(blocks * scale), np.float32(127.0))
    step = np.divide(np.float32(1.0), scale, out=np.zeros_like(scale), where=scale != 0)
    return (quants * step).reshape(rows.shape)


class QuantizedLinear(nn.Module):
    """`nn.Linear` over a `BlockWeight` (out_features, in_features), bias float (out,) or None."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_blocks = weight
        self.in_features, self.out_features = weight.columns, weight.rows
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out) in x's dtype (`BlockWeight.times`)."""
        rows = np.ascontiguousarray(x.reshape(-1, self.in_features).detach().float().numpy())
        out = self.weight_blocks.times(rows)
        result = torch.from_numpy(out).reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            result += self.bias.float()
        return result.to(x.dtype)

    def extra_repr(self) -> str:
        kind = self.weight_blocks.kind
        return f"{self.in_features}, {self.out_features}, {kind}, bias={self.bias is not None}"


class QuantizedEmbedding(nn.Module):
    """`nn.Embedding` over a `BlockWeight` (num_embeddings, embedding_dim): rows dequantized as
    they are looked up."""

    def __init__(self, weight: BlockWeight) -> None:
        super().__init__()
        self.weight_blocks = weight
        self.num_embeddings, self.embedding_dim = weight.rows, weight.columns

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...) int -> (..., embedding_dim) float32; an id outside the table is an IndexError."""
        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            raise IndexError(
                f"token ids must lie in [0, {self.num_embeddings}), got min {flat.min()} and max {flat.max()}"
            )
        rows = self.weight_blocks.take_rows(flat)
        return torch.from_numpy(rows).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.weight_blocks.kind}"


def block_weights(model: nn.Module) -> dict[str, BlockWeight]:
    """Module name -> the BlockWeight it multiplies by (a tied head and embedding: both names)."""
    return {name: module.weight_blocks for name, module in model.named_modules()
            if isinstance(module, (QuantizedLinear, QuantizedEmbedding))}


def stored_summary(model: nn.Module) -> str | None:
    """A line for a start-up message: how many weights are kept as which blocks and their bytes,
    e.g. "211 weights kept as stored blocks (Q4_1 ×210, Q8_0 ×1; 96.1 MB)"; None when none is."""
    weights = block_weights(model).values()
    unique = {id(weight.blocks): weight for weight in weights}  # (a tied head's blocks once)
    if not unique:
        return None
    kinds = Counter(weight.kind for weight in unique.values())
    listed = ", ".join(f"{kind} ×{count}" for kind, count in kinds.most_common())
    total = sum(weight.nbytes for weight in unique.values())
    q8 = sum(weight.activations == "q8" for weight in weights)
    rounded = f", {q8} of their products reading activations rounded to 8 bits as llama.cpp's" if q8 else ""
    return f"{len(unique)} weights kept as stored blocks ({listed}; {total / 1e6:.1f} MB){rounded}"


def read_q8_activations(model: nn.Module) -> int:
    """Make every QuantizedLinear of `model` read its activations as llama.cpp's products do
    (`BlockWeight.activations` "q8"; the blocks shared, not copied); return how many now do."""
    changed = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.weight_blocks = replace(module.weight_blocks, activations="q8")
            changed += 1
    return changed
