"""A step's weights laid out once for oneDNN's products (`torch.ops.mkldnn`), and the product.

Why: oneDNN's packed product reads each weight once whatever the number of rows and accumulates
in float32, where the BLAS products a step could otherwise call re-read or re-lay their weights
out: torch's bfloat16 `F.linear` re-lays its weight out for oneDNN on every call, and OpenBLAS's
float32 product of a few rows (a matrix-matrix product) packs its weight on every call, so it
costs about twice its one-row matrix-vector product, which reads the weight once
(`docs/backends.md`). The half step's products are these for bfloat16 weights (float16 ones stay
plain for `F.linear`: packing them needs AVX512-FP16), the float32 step's are these for steps
of many tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvcache.backends.cpu.support import fused_products

#: weight dtypes oneDNN's packed product takes on the CPUs measured
PACKED_DTYPES = (torch.float32, torch.bfloat16)
#: the row count oneDNN is told to pack for: for float32 weights the layout it picks for one row
#: read slower than the one for a few rows at every row count measured (1 to 16); for bfloat16
#: the hint made no difference
PACKED_FOR_ROWS = 4


@dataclass(frozen=True)
class Member:
    """One module's share of a laid-out product: its parameters and the output columns
    [start, stop) of the fused matrix that are its outputs."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    start: int
    stop: int


@dataclass(frozen=True)
class LaidOutProduct:
    """A `laid_out` matrix (out, in) with its fused bias, and the modules it stands for."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype
    members: tuple[Member, ...]


def available() -> bool:
    """Whether this torch build has oneDNN (mkldnn), whose packed products this module uses."""
    return torch.backends.mkldnn.is_available()


def laid_out(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) weight as `product` reads it: float32 and bfloat16 in oneDNN's packed layout
    (a copy), float16 as a plain contiguous matrix."""
    weight = weight.detach()
    if weight.dtype in PACKED_DTYPES:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKED_FOR_ROWS)
    return weight.contiguous()


def product(x: np.ndarray, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> np.ndarray:
    """x (B, in) float32, rounded to the weights' `dtype`, times weightᵀ (+ bias (out,)), read back
    as float32 (B, out); `weight` is one `laid_out` returned."""
    rows = torch.from_numpy(x)
    if dtype != torch.float32:
        rows = rows.to(dtype)
    if dtype in PACKED_DTYPES:
        out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    else:
        out = F.linear(rows, weight, bias)
    return out.float().numpy()


def _vector(values: torch.Tensor) -> np.ndarray:
    """A norm weight (n,) as a float32 array (a copy when it is not float32 already)."""
    return values.detach().float().numpy()


class LaidOutLayer:
    """One decoder layer as `cpu_backend.CpuBackend` reads it (norm1, norm2, q_norm, k_norm as float32
    arrays or None; qkv, o, gate_up, down `laid_out`, each with its bias or None; q/k/v and
    gate/up fused), made from the model's DecoderLayer; `products` lists the same matrices with
    the modules each stands for (`prompt_products`: a prompt's forward reads them too)."""

    def __init__(self, layer) -> None:
        attention = layer.self_attn
        heads = attention.qk_norm == "head"
        self.norm1 = _vector(layer.input_layernorm.weight)
        self.norm2 = _vector(layer.post_attention_layernorm.weight)
        self.q_norm = _vector(attention.q_norm.weight) if heads else None
        self.k_norm = _vector(attention.k_norm.weight) if heads else None
        self.products: list[LaidOutProduct] = []
        for name, linears in fused_products(layer):
            product = laid_out_product(*linears)
            setattr(self, name, product.weight)
            setattr(self, f"{name}_bias", product.bias)
            self.products.append(product)


def laid_out_product(*linears) -> LaidOutProduct:
    """The (out, in) weights of `linears` (nn.Linear) stacked along out and `laid_out`, their
    biases stacked (None when they have none), and which columns are whose."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    members, start = [], 0
    for linear in linears:
        stop = start + linear.out_features
        members.append(Member(linear.weight, linear.bias, start, stop))
        start = stop
    return LaidOutProduct(laid_out(weight), bias, weight.dtype, tuple(members))
