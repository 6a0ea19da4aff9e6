"""GGUF weights kept in their stored block formats: a weight is its file's blocks, mapped, never a
dequantized copy.

ggml stores a weight (out, in) row by row, each row `in / 32` blocks of 32 values: Q8_0 a float16
scale d and 32 int8 (value = d·q); Q4_0 d and 16 bytes of 4-bit q (value = d·(q - 8)); Q4_1 d, a
float16 minimum m and 4-bit q (d·q + m); Q5_0 and Q5_1 the same with a fifth bit per value in a
32-bit word. In each byte the low nibble is value j, the high one value j + 16. The K-quants
group 256 values a block: Q4_K and Q5_K as 8 sub-blocks of 32 with 6-bit scales and minimums
(value = d·scale·q - dmin·min), Q6_K as 16 groups of 16 with int8 scales (d·scale·(q - 32)). `BlockWeight`
holds such rows; `QuantizedLinear` and `QuantizedEmbedding` stand in for `nn.Linear` and
`nn.Embedding` over them. Their own forwards dequantize (with the `gguf` package, the format's
own library) a slice of rows at a time: the exact float path. Inside `block_products(multiply)`
their products run on `multiply` instead: how the CPU block step (`kvcache.backends.cpu.
block_step`, which multiplies by the blocks directly) runs a prompt's forward on its kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

#: the block formats kept as stored: (values per block, bytes per block)
STORED_KINDS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
                "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
#: rows of a weight dequantized at once by the modules' own forwards (bounds their scratch)
TILE_ROWS = 4096
#: multiply(x (N, in) float32, weight) -> (N, out) float32, set by `block_products`
_MULTIPLY: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("block_multiply", default=None)


@contextlib.contextmanager
def block_products(multiply: Callable[[np.ndarray, BlockWeight], np.ndarray]) -> Iterator[None]:
    """While inside, every QuantizedLinear's product is multiply(x (N, in) float32, its
    BlockWeight) -> (N, out) float32 (the bias added after)."""
    token = _MULTIPLY.set(multiply)
    try:
        yield
    finally:
        _MULTIPLY.reset(token)


@dataclass(frozen=True, eq=False)
class BlockWeight:
    """A weight (rows, columns) as ggml blocks: `blocks` uint8 (rows, row bytes), read-only (a view
    of the mapped file, or a row-permuted copy), `kind` one of `STORED_KINDS`. Equal only to
    itself (its blocks are not compared)."""

    kind: str
    rows: int
    columns: int
    blocks: np.ndarray

    def __post_init__(self) -> None:
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

    def permuted_rows(self, order: np.ndarray) -> BlockWeight:
        """The same weight with its rows in `order` (a read-only copy: rows are whole blocks)."""
        blocks = np.ascontiguousarray(self.blocks[order])
        blocks.setflags(write=False)
        return BlockWeight(self.kind, self.rows, self.columns, blocks)


class QuantizedLinear(nn.Module):
    """`nn.Linear` over a `BlockWeight` (out_features, in_features), bias float (out,) or None."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_blocks = weight
        self.in_features, self.out_features = weight.columns, weight.rows
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out) in x's dtype: x times the dequantized weight, TILE_ROWS rows of
        it at a time (float32 products), or on `block_products`' multiply inside one."""
        rows = np.ascontiguousarray(x.reshape(-1, self.in_features).detach().float().numpy())
        multiply = _MULTIPLY.get()
        if multiply is not None:
            out = multiply(rows, self.weight_blocks)
        else:
            out = np.empty((rows.shape[0], self.out_features), np.float32)
            for start in range(0, self.out_features, TILE_ROWS):
                tile = self.weight_blocks.dequantized(start, start + TILE_ROWS)
                np.matmul(rows, tile.T, out=out[:, start : start + len(tile)])
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
    unique = {id(weight): weight for weight in block_weights(model).values()}
    if not unique:
        return None
    kinds = Counter(weight.kind for weight in unique.values())
    listed = ", ".join(f"{kind} ×{count}" for kind, count in kinds.most_common())
    total = sum(weight.nbytes for weight in unique.values())
    return f"{len(unique)} weights kept as stored blocks ({listed}; {total / 1e6:.1f} MB)"
